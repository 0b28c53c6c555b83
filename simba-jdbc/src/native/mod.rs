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

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tracing::debug;

use crate::lock_error::LockError;

mod session;
#[cfg(test)]
mod tests;

pub(crate) use session::{Canceller, FileLock, Key, Kind, Session};

/// The most native locks one store holds on its shared session (PostgreSQL's advisory
/// locks live in the server's shared lock table, about 64 × max_connections entries for
/// every session together). A contender that finds the store at the bound acquires by the
/// row alone (see [`Pass::Unlocked`](crate::call::Pass::Unlocked)): correct, only without
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

/// How many blocking waits a store's locks may run at once: [`MAX_NATIVE_WAITS`]; none
/// behind a session-mode pooler (`simba_pooler=session`), where every wait tries its lock
/// once per [`NATIVE_WAIT_POLL`] and on every NOTIFY of a release instead: a blocking wait
/// given up needs a cancel request, which PgBouncer 1.18 can exit on, and a wait given up
/// by closing its session stays queued on the server until the lock comes to it, which then
/// holds the lock a moment after its owner's release (a `try_acquire` then was refused).
fn blocking_waits(kind: &Kind) -> usize {
    match kind {
        #[cfg(feature = "postgres")]
        Kind::Postgres { pg } if pg.pooler().session => 0,
        _ => MAX_NATIVE_WAITS,
    }
}

impl Locks {
    pub(crate) fn new(kind: Kind, bound: Duration) -> Self {
        let slots = Arc::new(Semaphore::new(blocking_waits(&kind)));
        Locks {
            kind,
            bound,
            holder: tokio::sync::Mutex::new(None),
            shared: AtomicUsize::new(0),
            spare: StdMutex::new(Vec::new()),
            slots,
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
                // The wait ends with its session, which the caller drops.
                #[cfg(feature = "postgres")]
                Ok(Err(e @ LockError::Closed)) => return Err(e),
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
