//! The native locks of the wait queue (`crate::gate`), by dialect: where a store's locks
//! live ([`Kind`]), the lock of one mutex ([`Key`]), the sessions that hold locks on a
//! server ([`Session`], PostgreSQL and MySQL) with what ends their blocking waits
//! ([`Canceller`]), and the three lock operations the queue uses ([`Locks`]: one try, one
//! blocking wait, one unlock). Each dialect's own lock code is in its module's `lock`
//! (`crate::postgres::lock`, `crate::mysql::lock`, `crate::sqlite::lock`).
//!
//! An enum per role, as for the store (`crate::dialect`): a store keeps sessions of its
//! dialect in a spare list and a holder slot, and their methods are `async` (no `dyn`).
//!
//! # The cap on blocking waits
//! A blocking wait holds a server session (PostgreSQL, MySQL) or a blocking thread (the
//! lock file) for as long as it waits, and a session that got its lock keeps it while its
//! mutex is owned. Without a bound, a process that waits for thousands of distinct mutexes
//! opens thousands of sessions (MariaDB answered "Too many connections" at scale) or fills
//! tokio's blocking pool. So one store runs at
//! most [`MAX_NATIVE_WAITS`] of them: its lock sessions other than the shared holder (waiting,
//! holding a lock for an owner, or spare) and its lock-file waits in flight. A wait beyond
//! the cap takes none: its gate tries the lock once per [`NATIVE_WAIT_POLL`] with a
//! non-blocking try (on the shared holder session, or on the lock file), takes a free slot
//! as soon as one frees (first come first, a FIFO semaphore), and is woken at once by the
//! push that exists: on PostgreSQL the store's LISTEN connection pokes the gate of a
//! mutex whose release it hears. No waiter is starved (each tries at least once per
//! interval, and a released row is also theirs by the lease once its grace ends), and no
//! storm of connections happens (at most `MAX_NATIVE_WAITS` sessions, plus the transient
//! connection MySQL's `KILL QUERY` of a cancelled wait opens).

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tracing::debug;

use crate::lock_error::LockError;

#[cfg(feature = "sqlite")]
pub(crate) use crate::sqlite::{DbFile, FileKey, FileLock};
#[cfg(not(feature = "sqlite"))]
pub(crate) use no_files::{FileKey, FileLock};

/// 64-bit FNV-1a: a hash that is the same in every process and every Rust version (the
/// key of a native lock must be, across the processes that share it).
pub(crate) fn stable_hash(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.bytes().chain(std::iter::once(0u8)) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The most native locks one store holds on its shared session (PostgreSQL's advisory
/// locks live in the server's shared lock table, about 64 × max_connections entries for
/// every session together). A contender that finds the store at the bound acquires by the
/// row alone (see [`Pass::Unlocked`](crate::conn::Pass::Unlocked)): correct, only without
/// the queue's order and push.
const MAX_SHARED_LOCKS: usize = 1000;

/// The most blocking waits for a native lock one store runs at once: lock sessions besides
/// the shared one (waiting, holding a lock for an owner, or spare) on PostgreSQL and
/// MySQL, lock-file waits in flight (each on a blocking thread) on SQLite. Waits beyond
/// it take no session: they try the lock every [`NATIVE_WAIT_POLL`] and on every push
/// (see the crate README, *Connections at scale*).
pub const MAX_NATIVE_WAITS: usize = 16;

/// How often a wait beyond [`MAX_NATIVE_WAITS`] tries its native lock when no push wakes
/// it sooner.
pub const NATIVE_WAIT_POLL: Duration = Duration::from_secs(1);

/// The first pause after a cancel request of a given-up wait before the next one (see
/// `Locks::end_wait`), and the longest.
const CANCEL_AGAIN_MIN: Duration = Duration::from_millis(25);
const CANCEL_AGAIN_MAX: Duration = Duration::from_millis(400);

/// How a blocking wait for the native lock ended.
pub(crate) enum Waited {
    Got(Held),
    /// Given up (cancelled); nothing of it is left.
    GaveUp,
    /// Given up, but a blocking lock-file call of it cannot be interrupted: it still waits,
    /// holding the entry, and returns the lock when the lock is free. Its slot under the
    /// cap is held until then.
    Lingering(JoinHandle<Result<FileLock, LockError>>, WaitSlot),
}

/// A place under [`MAX_NATIVE_WAITS`]: dropping it frees it for the next wait.
pub(crate) type WaitSlot = OwnedSemaphorePermit;

/// A lock session other than the shared holder, with its place under the cap.
pub(crate) struct OwnSession {
    session: Session,
    slot: WaitSlot,
}

/// How a wait that found no free slot under the cap went on.
enum Entry {
    /// A slot freed: wait blocking.
    Slot(WaitSlot),
    /// A spare session appeared (it has its slot): wait blocking on it.
    Spare(OwnSession),
    /// A poll found the lock free and took it.
    Got(Held),
    /// Cancelled meanwhile.
    GaveUp,
}

/// Counts a wait beyond the cap while it polls.
struct Capped<'a>(&'a AtomicUsize);

impl Drop for Capped<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A native lock this process holds, and what holds it.
pub(crate) enum Held {
    /// On the store's shared holder session (taken by a non-blocking try).
    Shared,
    /// On a session of its own (taken by a blocking wait); back to the spares on unlock.
    /// Boxed: every gate has a `held` slot, and few hold a session.
    Own(Box<OwnSession>),
    /// The lock file, open and locked; closing it unlocks.
    File(FileLock),
    /// Nothing to hold (`sqlite::memory:`).
    Local,
}

/// The gated flag of an owner whose native lock proves nothing about its process (a
/// server session's lock): written, never taken over by.
pub(crate) const NO_IDENTITY: i64 = 1;

/// The gated flag of an owner of `sqlite::memory:` (one store, one process: its local
/// queue is the whole lock).
pub(crate) const LOCAL_IDENTITY: i64 = 2;

impl Held {
    /// What an owner holding this lock writes to its row's gated flag, and the value of a
    /// gated row that it may take over at once (SQLite): the database file's identity
    /// where the lock is provably that file's, else a value that is never taken over.
    pub(crate) fn mark(&self) -> i64 {
        match self {
            Held::File(f) => f.mark(),
            Held::Local => LOCAL_IDENTITY,
            Held::Shared | Held::Own(_) => NO_IDENTITY,
        }
    }
}

/// The native locks of one store: where they live, and the sessions that hold them
/// (PostgreSQL, MySQL).
pub(crate) struct Locks {
    kind: Kind,
    /// Bound of a non-blocking lock call (the store's statement timeout).
    bound: Duration,
    /// The session that holds locks taken by a try (PostgreSQL, MySQL).
    holder: tokio::sync::Mutex<Option<Session>>,
    /// How many locks the holder session holds.
    shared: AtomicUsize,
    /// Idle sessions for blocking waits.
    spare: StdMutex<Vec<OwnSession>>,
    /// The places under [`MAX_NATIVE_WAITS`].
    slots: Arc<Semaphore>,
    /// Waits beyond the cap, polling: while there are any, a session that comes back is
    /// closed rather than kept spare, so that its slot goes to them.
    capped: AtomicUsize,
    /// Whether the lock files of earlier builds were swept (SQLite, first lock call).
    #[cfg(feature = "sqlite")]
    swept: std::sync::Once,
}

impl Locks {
    pub(crate) fn new(kind: Kind, bound: Duration) -> Self {
        Locks {
            kind,
            bound,
            holder: tokio::sync::Mutex::new(None),
            shared: AtomicUsize::new(0),
            spare: StdMutex::new(Vec::new()),
            slots: Arc::new(Semaphore::new(MAX_NATIVE_WAITS)),
            capped: AtomicUsize::new(0),
            #[cfg(feature = "sqlite")]
            swept: std::sync::Once::new(),
        }
    }

    /// On this store's first lock-file call, removes the per-name lock files that earlier
    /// builds left beside the database (`crate::sqlite::sweep_earlier`), best effort, on
    /// a blocking thread that nobody waits for.
    fn sweep_once(&self) {
        #[cfg(feature = "sqlite")]
        if let Kind::Files { db } = &self.kind {
            self.swept.call_once(|| {
                let db = db.clone();
                drop(tokio::task::spawn_blocking(move || {
                    let removed = crate::sqlite::sweep_earlier(db.path());
                    if removed > 0 {
                        debug!(removed, database = %db.path().display(), "removed lock files of earlier builds");
                    }
                }));
            });
        }
    }

    /// SQLite: that the database file exists and has one name (an `fstat` of a free
    /// description of it, on Linux); nothing elsewhere. With the key of a mutex, also
    /// whether a job of its owner runs (`crate::sqlite::DbFile::check_job`): `Some` of
    /// the mark of the rows that owner gated when one does.
    #[cfg(feature = "sqlite")]
    pub(crate) fn check_db_file(
        &self,
        key: Option<&Key>,
    ) -> Result<Option<i64>, crate::sqlite::Refused> {
        match (&self.kind, key) {
            (Kind::Files { db }, Some(Key::File(k))) => db.check_job(k),
            (Kind::Files { db }, _) => db.check().map(|_| None),
            _ => Ok(None),
        }
    }

    /// The error of a call on the locks that got no answer within the store's bound.
    fn no_answer(&self, what: &'static str) -> LockError {
        LockError::NoAnswer {
            what,
            bound: self.bound,
        }
    }

    /// Where the locks live.
    pub(crate) fn kind(&self) -> &Kind {
        &self.kind
    }

    /// One non-blocking attempt at the native lock.
    pub(crate) async fn try_lock(&self, key: &Key) -> Result<Option<Held>, LockError> {
        match key {
            Key::Local => Ok(Some(Held::Local)),
            Key::File(files) => {
                self.sweep_once();
                files.try_lock().await.map(|f| f.map(Held::File))
            }
            Key::Session(_) => {
                if self.shared.load(Ordering::Relaxed) >= MAX_SHARED_LOCKS {
                    return Err(LockError::AtCap(MAX_SHARED_LOCKS));
                }
                let mut holder = self.holder.lock().await;
                if holder.is_none() {
                    let s = timeout(self.bound, Session::connect(&self.kind))
                        .await
                        .map_err(|_| self.no_answer("lock session connect"))??;
                    *holder = Some(s);
                }
                let Some(session) = holder.as_mut() else {
                    return Err(LockError::Mismatch("no lock session"));
                };
                match timeout(self.bound, session.try_lock(key)).await {
                    Ok(Ok(true)) => {
                        self.shared.fetch_add(1, Ordering::Relaxed);
                        Ok(Some(Held::Shared))
                    }
                    Ok(Ok(false)) => Ok(None),
                    Ok(Err(e)) => {
                        *holder = None;
                        Err(e)
                    }
                    Err(_) => {
                        *holder = None;
                        Err(self.no_answer("lock session"))
                    }
                }
            }
        }
    }

    /// Waits (without bound) until the native lock is this process's, or until `cancel`
    /// fires (or its sender is dropped): then `None`, and no lock is left granted to a
    /// session of this process that nobody waits on. Beyond the cap ([`MAX_NATIVE_WAITS`]) it
    /// polls instead, waking early when `poke` is notified (a push about the mutex).
    pub(crate) async fn wait(
        &self,
        key: &Key,
        mut cancel: oneshot::Receiver<()>,
        poke: &Notify,
    ) -> Result<Waited, LockError> {
        // Fired, or its sender dropped: given up. A receiver that `try_recv` found closed
        // is finished and must not be polled again (tokio panics "called after complete").
        if !matches!(cancel.try_recv(), Err(oneshot::error::TryRecvError::Empty)) {
            return Ok(Waited::GaveUp);
        }
        match key {
            Key::Local => Ok(Waited::Got(Held::Local)),
            Key::File(files) => {
                self.sweep_once();
                let slot = match self.slot_or_poll(key, &mut cancel, poke).await {
                    Entry::Slot(slot) => slot,
                    Entry::Spare(own) => own.slot,
                    Entry::Got(held) => return Ok(Waited::Got(held)),
                    Entry::GaveUp => return Ok(Waited::GaveUp),
                };
                let mut blocking = files.wait();
                tokio::select! {
                    r = &mut blocking => r?.map(|f| Waited::Got(Held::File(f))),
                    // A blocking lock call cannot be interrupted: its thread goes on
                    // waiting, and the gate follows it (`Gates::linger`).
                    _ = cancel => Ok(Waited::Lingering(blocking, slot)),
                }
            }
            Key::Session(_) => {
                let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
                let own = match spare {
                    Some(s) => s,
                    None => match self.slot_or_poll(key, &mut cancel, poke).await {
                        Entry::Spare(own) => own,
                        Entry::Slot(slot) => {
                            let connect = timeout(self.bound, Session::connect(&self.kind));
                            // Given up while connecting: nothing was asked of the server.
                            let session = tokio::select! {
                                biased;
                                _ = &mut cancel => return Ok(Waited::GaveUp),
                                s = connect => s
                                    .map_err(|_| self.no_answer("lock session connect"))??,
                            };
                            OwnSession { session, slot }
                        }
                        Entry::Got(held) => return Ok(Waited::Got(held)),
                        Entry::GaveUp => return Ok(Waited::GaveUp),
                    },
                };
                // Given up before the blocking lock was sent: the session goes back as it
                // came, and nothing is left on the server.
                if !matches!(cancel.try_recv(), Err(oneshot::error::TryRecvError::Empty)) {
                    self.keep(own);
                    return Ok(Waited::GaveUp);
                }
                self.wait_on(key, own, cancel).await
            }
        }
    }

    /// The blocking wait of `own` for `key`, until the lock is granted or `cancel` fires.
    /// A given-up wait is cancelled on the server, and a lock granted meanwhile unlocked.
    async fn wait_on(
        &self,
        key: &Key,
        mut own: OwnSession,
        cancel: oneshot::Receiver<()>,
    ) -> Result<Waited, LockError> {
        let canceller = own.session.canceller(&self.kind);
        let mut given_up = false;
        let got = {
            let lock = own.session.lock(key);
            tokio::pin!(lock);
            tokio::select! {
                biased;
                r = &mut lock => r,
                _ = cancel => {
                    given_up = true;
                    self.end_wait(&canceller, lock).await
                }
            }
        };
        match (got, given_up) {
            (Ok(()), false) => Ok(Waited::Got(Held::Own(Box::new(own)))),
            (Ok(()), true) => {
                self.unlock(key, Held::Own(Box::new(own))).await?;
                Ok(Waited::GaveUp)
            }
            // The session is dropped: its connection closes, and whatever the server
            // still had it wait for or hold goes with it (and its slot frees).
            (Err(_), true) => Ok(Waited::GaveUp),
            (Err(e), false) => Err(e),
        }
    }

    /// Ends a given-up blocking wait, `lock`: it ends with an error (cancelled), or with
    /// the lock if the lock was granted first. A cancel request that reaches the server
    /// before the wait has started there ends nothing (the lock statement may still be on
    /// its way), so requests are sent again, at growing intervals, until the wait ends or
    /// the store's statement timeout passes. (One request was not enough: a wait given up
    /// while its session was connecting then blocked until the timeout, and the lock that
    /// the owner's release freed went to it, not to the contender that looked next.)
    async fn end_wait<F>(
        &self,
        canceller: &Canceller,
        mut lock: std::pin::Pin<&mut F>,
    ) -> Result<(), LockError>
    where
        F: std::future::Future<Output = Result<(), LockError>>,
    {
        let deadline = tokio::time::Instant::now() + self.bound;
        let mut pause = CANCEL_AGAIN_MIN;
        loop {
            match tokio::time::timeout_at(deadline, canceller.cancel()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!("cancelling a native lock wait: {e}"),
                Err(_) => debug!(
                    "cancelling a native lock wait: no answer within {:?}",
                    self.bound
                ),
            }
            let until = (tokio::time::Instant::now() + pause).min(deadline);
            match tokio::time::timeout_at(until, &mut lock).await {
                Ok(r) => return r,
                Err(_) if until >= deadline => {
                    return Err(self.no_answer("a cancelled wait"));
                }
                Err(_) => pause = (pause * 2).min(CANCEL_AGAIN_MAX),
            }
        }
    }

    /// A slot under the cap for a blocking wait on `key`: at once if one is free;
    /// otherwise (beyond the cap) the lock is tried without blocking once per
    /// [`NATIVE_WAIT_POLL`] and on every `poke`, until a slot or a spare session frees, the
    /// lock is got, or `cancel` fires.
    async fn slot_or_poll(
        &self,
        key: &Key,
        cancel: &mut oneshot::Receiver<()>,
        poke: &Notify,
    ) -> Entry {
        if let Ok(slot) = self.slots.clone().try_acquire_owned() {
            return Entry::Slot(slot);
        }
        self.capped.fetch_add(1, Ordering::Relaxed);
        let _capped = Capped(&self.capped);
        debug!(
            cap = MAX_NATIVE_WAITS,
            "native waits at the cap: polling the lock instead"
        );
        loop {
            tokio::select! {
                // FIFO: the waits beyond the cap get freed slots in the order they came.
                slot = self.slots.clone().acquire_owned() => match slot {
                    Ok(slot) => return Entry::Slot(slot),
                    // Never closed; poll on.
                    Err(_) => tokio::time::sleep(NATIVE_WAIT_POLL).await,
                },
                () = tokio::time::sleep(NATIVE_WAIT_POLL) => {}
                () = poke.notified() => {}
                _ = &mut *cancel => return Entry::GaveUp,
            }
            if let Some(own) = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop() {
                return Entry::Spare(own);
            }
            match self.try_lock(key).await {
                Ok(Some(held)) => return Entry::Got(held),
                Ok(None) => {}
                Err(e) => debug!("a capped wait's try failed (it tries again): {e}"),
            }
        }
    }

    /// A lock session that holds and waits for nothing goes back to the spares, or is
    /// closed (freeing its slot) when waits beyond the cap want a slot more than the
    /// spares want a session.
    fn keep(&self, own: OwnSession) {
        if self.capped.load(Ordering::Relaxed) == 0 {
            self.spare
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(own);
        }
    }

    pub(crate) async fn unlock(&self, key: &Key, held: Held) -> Result<(), LockError> {
        match held {
            Held::Local => Ok(()),
            Held::File(file) => {
                drop(file);
                Ok(())
            }
            Held::Shared => {
                let _ = self
                    .shared
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
                let mut holder = self.holder.lock().await;
                let Some(session) = holder.as_mut() else {
                    // The session is gone, and its locks with it.
                    return Ok(());
                };
                match timeout(self.bound, session.unlock(key)).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => {
                        *holder = None;
                        Err(e)
                    }
                    Err(_) => {
                        *holder = None;
                        Err(self.no_answer("lock session"))
                    }
                }
            }
            Held::Own(mut own) => match timeout(self.bound, own.session.unlock(key)).await {
                Ok(Ok(())) => {
                    self.keep(*own);
                    Ok(())
                }
                Ok(Err(e)) => Err(e),
                Err(_) => Err(self.no_answer("lock session")),
            },
        }
    }
}

/// Where the native locks of a store live.
#[derive(Clone)]
pub(crate) enum Kind {
    /// PostgreSQL advisory locks, on sessions the store's connector opens.
    #[cfg(feature = "postgres")]
    Postgres {
        /// Opens the sessions (and sends cancel requests), with the store's TLS.
        pg: std::sync::Arc<crate::postgres::Connector>,
    },
    /// MySQL / MariaDB user locks, on sessions to `url`.
    #[cfg(feature = "mysql")]
    Mysql {
        /// The connection URL.
        url: String,
    },
    /// SQLite: on Linux byte-range locks on the database file itself; elsewhere lock
    /// files beside it (`{db}-simba-{hash}.lock` / `.entry`).
    #[cfg(feature = "sqlite")]
    Files {
        /// The database file.
        db: std::sync::Arc<DbFile>,
    },
    /// No other process can reach the database (`sqlite::memory:`): the local queue is all.
    Local,
}

impl fmt::Debug for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            #[cfg(feature = "postgres")]
            Kind::Postgres { .. } => "postgres advisory locks",
            #[cfg(feature = "mysql")]
            Kind::Mysql { .. } => "mysql GET_LOCK",
            #[cfg(feature = "sqlite")]
            Kind::Files { .. } => "lock files",
            Kind::Local => "local",
        };
        f.write_str(name)
    }
}

impl Kind {
    /// The native lock of `mutex` in the namespace `scope` (the database and the table).
    pub(crate) fn key(&self, scope: &str, mutex: &str) -> Key {
        let h = stable_hash(&[scope, mutex]);
        match self {
            #[cfg(feature = "postgres")]
            Kind::Postgres { .. } => {
                Key::Session(SessionKey::Pg(i64::from_ne_bytes(h.to_ne_bytes())))
            }
            #[cfg(feature = "mysql")]
            Kind::Mysql { .. } => Key::Session(SessionKey::My(format!("simba:{h:016x}"))),
            #[cfg(feature = "sqlite")]
            Kind::Files { db } => Key::File(FileKey::new(db, h)),
            Kind::Local => {
                let _ = h;
                Key::Local
            }
        }
    }
}

/// The native lock of one mutex.
#[derive(Debug, Clone)]
pub(crate) enum Key {
    /// Held by a server session ([`Session`]).
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    Session(SessionKey),
    /// Lock files (SQLite).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    File(FileKey),
    /// Nothing to lock (`sqlite::memory:`).
    Local,
}

/// The lock of one mutex on a server.
#[derive(Debug, Clone)]
pub(crate) enum SessionKey {
    /// A PostgreSQL advisory lock's key.
    #[cfg(feature = "postgres")]
    Pg(i64),
    /// A MySQL user lock's name.
    #[cfg(feature = "mysql")]
    My(String),
}

/// A session that can hold native locks (PostgreSQL, MySQL).
pub(crate) enum Session {
    #[cfg(feature = "postgres")]
    Pg(crate::postgres::lock::Session),
    #[cfg(feature = "mysql")]
    My(crate::mysql::lock::Session),
}

impl Session {
    pub(crate) async fn connect(kind: &Kind) -> Result<Session, LockError> {
        match kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres { pg } => crate::postgres::lock::Session::connect(pg)
                .await
                .map(Session::Pg),
            #[cfg(feature = "mysql")]
            Kind::Mysql { url } => crate::mysql::lock::Session::connect(url)
                .await
                .map(Session::My),
            #[allow(unreachable_patterns)]
            _ => Err(LockError::Mismatch("this backend has no lock sessions")),
        }
    }

    pub(crate) async fn try_lock(&mut self, key: &Key) -> Result<bool, LockError> {
        match (self, key) {
            #[cfg(feature = "postgres")]
            (Session::Pg(s), Key::Session(SessionKey::Pg(k))) => s.try_lock(*k).await,
            #[cfg(feature = "mysql")]
            (Session::My(s), Key::Session(SessionKey::My(k))) => s.try_lock(k).await,
            #[allow(unreachable_patterns)]
            _ => Err(LockError::Mismatch("a lock key of another backend")),
        }
    }

    pub(crate) async fn lock(&mut self, key: &Key) -> Result<(), LockError> {
        match (self, key) {
            #[cfg(feature = "postgres")]
            (Session::Pg(s), Key::Session(SessionKey::Pg(k))) => s.lock(*k).await,
            #[cfg(feature = "mysql")]
            (Session::My(s), Key::Session(SessionKey::My(k))) => s.lock(k).await,
            #[allow(unreachable_patterns)]
            _ => Err(LockError::Mismatch("a lock key of another backend")),
        }
    }

    pub(crate) async fn unlock(&mut self, key: &Key) -> Result<(), LockError> {
        match (self, key) {
            #[cfg(feature = "postgres")]
            (Session::Pg(s), Key::Session(SessionKey::Pg(k))) => s.unlock(*k).await,
            #[cfg(feature = "mysql")]
            (Session::My(s), Key::Session(SessionKey::My(k))) => s.unlock(k).await,
            #[allow(unreachable_patterns)]
            _ => Err(LockError::Mismatch("a lock key of another backend")),
        }
    }

    /// What ends this session's blocking wait from outside (another connection).
    pub(crate) fn canceller(&self, kind: &Kind) -> Canceller {
        match (self, kind) {
            #[cfg(feature = "postgres")]
            (Session::Pg(s), Kind::Postgres { pg }) => Canceller::Pg(s.cancel_token(), pg.clone()),
            #[cfg(feature = "mysql")]
            (Session::My(s), Kind::Mysql { url }) => Canceller::My {
                url: url.clone(),
                id: s.id(),
            },
            #[allow(unreachable_patterns)]
            _ => Canceller::None,
        }
    }
}

/// Ends a session's blocking wait for a native lock on the server: PostgreSQL's cancel
/// request, MySQL's `KILL QUERY` of the session's connection.
pub(crate) enum Canceller {
    #[cfg(feature = "postgres")]
    Pg(
        tokio_postgres::CancelToken,
        std::sync::Arc<crate::postgres::Connector>,
    ),
    #[cfg(feature = "mysql")]
    My { url: String, id: u32 },
    /// Nothing to cancel with (a session and a kind of two different backends).
    None,
}

impl Canceller {
    pub(crate) async fn cancel(&self) -> Result<(), LockError> {
        match self {
            #[cfg(feature = "postgres")]
            Canceller::Pg(token, pg) => pg
                .cancel(token)
                .await
                .map_err(|e| LockError::session("postgres", e)),
            #[cfg(feature = "mysql")]
            Canceller::My { url, id } => crate::mysql::lock::kill_query(url, *id).await,
            Canceller::None => Ok(()),
        }
    }
}

/// Without SQLite there are no lock files: their key and lock cannot be made.
#[cfg(not(feature = "sqlite"))]
mod no_files {
    use tokio::task::JoinHandle;

    use crate::lock_error::LockError;

    /// The lock files of a mutex: none in this build.
    #[derive(Debug, Clone)]
    pub(crate) enum FileKey {}

    /// A held lock file: none in this build.
    pub(crate) enum FileLock {}

    /// Dropping a held lock file unlocks it (there is none to drop here).
    impl Drop for FileLock {
        fn drop(&mut self) {
            match *self {}
        }
    }

    impl FileLock {
        pub(crate) fn mark(&self) -> i64 {
            match *self {}
        }
    }

    impl FileKey {
        pub(crate) async fn try_lock(&self) -> Result<Option<FileLock>, LockError> {
            match *self {}
        }

        pub(crate) fn wait(&self) -> JoinHandle<Result<FileLock, LockError>> {
            match *self {}
        }
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;

    /// A wait whose cancel sender is gone has been given up: it returns at once without
    /// polling the finished receiver again (which panicked in a gate's wait task, and left
    /// that mutex's acquisitions waiting for good; found by `simba-chaos soak` on
    /// PostgreSQL).
    #[tokio::test]
    async fn a_wait_whose_canceller_is_gone_gives_up() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("t.db").display().to_string();
        std::fs::write(&db, b"").expect("db file");
        for kind in [
            Kind::Files {
                db: DbFile::new(&db),
            },
            Kind::Local,
        ] {
            let locks = Locks::new(kind, Duration::from_secs(5));
            let key = locks.kind.key("simba_mutex", "m");
            let (tx, rx) = oneshot::channel::<()>();
            drop(tx);
            let waited = locks.wait(&key, rx, &Notify::new()).await;
            assert!(matches!(waited, Ok(Waited::GaveUp)), "{:?}", waited.is_ok());
        }
    }
}

/// A given-up wait whose first cancel request reached the server before the lock statement
/// (what a give-up that comes while the wait's session connects, or while its statement is
/// on the way, sends) still ends, long before the statement timeout: MariaDB forgets a
/// `KILL QUERY` of an idle connection (by hand: the `GET_LOCK` sent after it waited its
/// whole timeout), and PostgreSQL ignores a cancel request of an idle session.
#[cfg(all(test, any(feature = "mysql", feature = "postgres")))]
mod cancel_tests {
    use super::*;
    use tokio::time::Instant;

    /// Far longer than a handoff; the wait must end well within half of it.
    const BOUND: Duration = Duration::from_secs(10);

    async fn a_cancel_before_the_wait_still_ends_it(kind: Kind) {
        let locks = Locks::new(kind.clone(), BOUND);
        let key = kind.key("cancel_tests", "m");
        let mut holder = Session::connect(&kind).await.expect("holder session");
        assert!(
            holder.try_lock(&key).await.expect("try"),
            "the lock is free"
        );
        let mut waiter = Session::connect(&kind).await.expect("waiter session");
        let canceller = waiter.canceller(&kind);
        let started = Instant::now();
        // `end_wait` sends its first request before the statement has been polled at all.
        let lock = waiter.lock(&key);
        tokio::pin!(lock);
        let ended = locks.end_wait(&canceller, lock).await;
        let took = started.elapsed();
        assert!(
            ended.is_err(),
            "{kind:?}: the wait got a lock another session holds"
        );
        assert!(
            took < BOUND / 2,
            "{kind:?}: the cancelled wait ended after {took:?} (the statement timeout is {BOUND:?})"
        );
        holder.unlock(&key).await.expect("unlock");
    }

    #[cfg(feature = "mysql")]
    #[tokio::test]
    async fn mysql_a_cancel_before_the_wait_still_ends_it() {
        let server = simba_test_kit::servers::mysql().await.expect("MariaDB");
        let url = server.url().to_owned();
        a_cancel_before_the_wait_still_ends_it(Kind::Mysql { url }).await;
    }

    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn postgres_a_cancel_before_the_wait_still_ends_it() {
        let server = simba_test_kit::servers::postgres()
            .await
            .expect("PostgreSQL");
        let pg = crate::postgres::Connector::new(server.url()).expect("connector");
        a_cancel_before_the_wait_still_ends_it(Kind::Postgres {
            pg: std::sync::Arc::new(pg),
        })
        .await;
    }
}
