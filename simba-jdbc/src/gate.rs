//! Native wait queues: how SQL waiters wait without polling.
//!
//! The row of `simba_mutex` stays the one truth for ownership and fence. What this module
//! adds is a *native lock* per mutex, whose server (or kernel) keeps a fair queue of the
//! sessions that wait for it and drops a dead session's place by itself:
//!
//! - PostgreSQL: session advisory locks (`pg_try_advisory_lock` / `pg_advisory_lock` /
//!   `pg_advisory_unlock`) on a 64-bit key hashed from the table and the mutex;
//! - MySQL / MariaDB: `GET_LOCK` / `RELEASE_LOCK` on a name hashed from the database, the
//!   table and the mutex;
//! - SQLite: `flock` on a lock file next to the database file, behind a second "entry"
//!   lock file that keeps the order (see the crate README).
//!
//! Each store keeps one [`Gate`] per mutex in use: a process-local FIFO of its contenders
//! in front of the native lock, so that a process waits on the server with at most one
//! session per mutex. The owner keeps the native lock while it owns; a release updates the
//! row, then unlocks; the server grants the lock to the next waiting session, whose gate
//! wakes its first local waiter with [`StoreEvent::Released`] (one wake-up per release).
//!
//! Everything that changes the native lock runs in a spawned task and records its result
//! in the gate itself, so a caller's future that is dropped halfway never leaves the lock
//! held by nobody's knowledge.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex, MutexGuard};
use std::time::Duration;

use simba_core::backend::StoreEvent;
use tokio::sync::{mpsc, oneshot};
use tokio::task::{AbortHandle, JoinHandle};
use tokio::time::{Instant, timeout};
use tracing::{debug, warn};

/// Events a subscriber may have queued before it reads them. A full queue already holds an
/// event that makes the contender look again, so dropping more is harmless.
const QUEUE: usize = 16;
/// How long a contender gives a cancelled lock-file wait of this process to finish (see
/// `State::lingering`): it finishes at once when the lock file is free, and not at all
/// while another process holds it.
#[cfg(feature = "sqlite")]
const LINGER: Duration = Duration::from_millis(250);
/// First and longest pause before a failed wait is tried again.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);
/// The most native locks one store holds on its shared session (PostgreSQL's advisory
/// locks live in the server's shared lock table, about 64 × max_connections entries for
/// every session together). A contender that finds the store at the bound acquires by the
/// row alone (see [`Pass::Unlocked`]): correct, only without the queue's order and push.
const MAX_SHARED_LOCKS: usize = 1000;

/// How a contender may run its acquisition, as its gate decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// This process holds the native lock for the contender: it may take a free row (and
    /// on SQLite the row of an owner whose process is gone).
    Locked,
    /// It does not: it may renew its own row, and take a row only when its owner's lease
    /// has run out (never a released one: that belongs to whoever holds the native lock).
    Unlocked,
}

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

/// Where the native locks of a store live.
#[derive(Clone)]
pub(crate) enum Kind {
    /// PostgreSQL advisory locks, on sessions the store's connector opens.
    #[cfg(feature = "postgres")]
    Postgres {
        /// Opens the sessions (and sends cancel requests), with the store's TLS.
        pg: std::sync::Arc<crate::pg::Connector>,
    },
    /// MySQL / MariaDB user locks, on sessions to `url`.
    #[cfg(feature = "mysql")]
    Mysql {
        /// The connection URL.
        url: String,
    },
    /// Lock files; `prefix` is the database file's path.
    #[cfg(feature = "sqlite")]
    Files {
        /// The database file: lock files are `{prefix}-simba-{hash}.lock` / `.entry`.
        prefix: String,
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

/// The native lock of one mutex.
#[derive(Debug, Clone)]
enum Key {
    #[cfg(feature = "postgres")]
    Pg(i64),
    #[cfg(feature = "mysql")]
    My(String),
    #[cfg(feature = "sqlite")]
    File {
        main: std::path::PathBuf,
        entry: std::path::PathBuf,
    },
    Local,
}

/// A session that can hold native locks (PostgreSQL, MySQL).
enum Session {
    #[cfg(feature = "postgres")]
    Pg(pg::Session),
    #[cfg(feature = "mysql")]
    My(my::Session),
}

impl Session {
    async fn connect(kind: &Kind) -> Result<Session, String> {
        match kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres { pg } => pg::Session::connect(pg).await.map(Session::Pg),
            #[cfg(feature = "mysql")]
            Kind::Mysql { url } => my::Session::connect(url).await.map(Session::My),
            #[allow(unreachable_patterns)]
            _ => Err("this backend has no lock sessions".to_owned()),
        }
    }

    async fn try_lock(&mut self, key: &Key) -> Result<bool, String> {
        match (self, key) {
            #[cfg(feature = "postgres")]
            (Session::Pg(s), Key::Pg(k)) => s.try_lock(*k).await,
            #[cfg(feature = "mysql")]
            (Session::My(s), Key::My(k)) => s.try_lock(k).await,
            #[allow(unreachable_patterns)]
            _ => Err("a lock key of another backend".to_owned()),
        }
    }

    async fn lock(&mut self, key: &Key) -> Result<(), String> {
        match (self, key) {
            #[cfg(feature = "postgres")]
            (Session::Pg(s), Key::Pg(k)) => s.lock(*k).await,
            #[cfg(feature = "mysql")]
            (Session::My(s), Key::My(k)) => s.lock(k).await,
            #[allow(unreachable_patterns)]
            _ => Err("a lock key of another backend".to_owned()),
        }
    }

    async fn unlock(&mut self, key: &Key) -> Result<(), String> {
        match (self, key) {
            #[cfg(feature = "postgres")]
            (Session::Pg(s), Key::Pg(k)) => s.unlock(*k).await,
            #[cfg(feature = "mysql")]
            (Session::My(s), Key::My(k)) => s.unlock(k).await,
            #[allow(unreachable_patterns)]
            _ => Err("a lock key of another backend".to_owned()),
        }
    }

    /// What ends this session's blocking wait from outside (another connection).
    fn canceller(&self, kind: &Kind) -> Canceller {
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
enum Canceller {
    #[cfg(feature = "postgres")]
    Pg(
        tokio_postgres::CancelToken,
        std::sync::Arc<crate::pg::Connector>,
    ),
    #[cfg(feature = "mysql")]
    My { url: String, id: u32 },
    /// Nothing to cancel with (a session and a kind of two different backends).
    None,
}

impl Canceller {
    async fn cancel(self) -> Result<(), String> {
        match self {
            #[cfg(feature = "postgres")]
            Canceller::Pg(token, pg) => pg
                .cancel(&token)
                .await
                .map_err(|e| format!("postgres cancel request: {e}")),
            #[cfg(feature = "mysql")]
            Canceller::My { url, id } => my::kill_query(&url, id).await,
            Canceller::None => Ok(()),
        }
    }
}

/// A blocking wait for the native lock in flight: its task, and the signal that ends it.
struct Wait {
    cancel: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

/// How a blocking wait for the native lock ended.
enum Waited {
    Got(Held),
    /// Given up (cancelled); nothing of it is left.
    GaveUp,
    /// Given up, but a blocking lock-file call of it cannot be interrupted: it still waits,
    /// holding the entry file, and returns the lock when the lock file is free.
    #[cfg(feature = "sqlite")]
    Lingering(JoinHandle<Result<std::fs::File, String>>),
}

/// A native lock this process holds, and what holds it.
enum Held {
    /// On the store's shared holder session (taken by a non-blocking try).
    Shared,
    /// On a session of its own (taken by a blocking wait); back to the spares on unlock.
    Own(Session),
    /// The lock file, open and locked; closing it unlocks.
    #[cfg(feature = "sqlite")]
    File(std::fs::File),
    /// Nothing to hold (`sqlite::memory:`).
    Local,
}

/// A local subscriber of a mutex's events.
struct Sub {
    tx: mpsc::Sender<StoreEvent>,
    /// Set once the subscriber contends: PostgreSQL's NOTIFY hub then stops telling it
    /// about every change (only its gate wakes it).
    contending: Arc<AtomicBool>,
}

#[derive(Default)]
struct State {
    /// Contenders waiting, first come first.
    queue: VecDeque<String>,
    subs: HashMap<String, Sub>,
    /// The local contender that owns the row, as far as this process knows.
    owner: Option<String>,
    /// When that ownership ends unless renewed: the start of its last successful
    /// acquire or renewal call plus the whole lease (later than the engine's own local
    /// deadline, which counts from before the call and subtracts a drift margin).
    owner_until: Option<Instant>,
    /// The timer that ends the ownership here at `owner_until`.
    expiry: Option<AbortHandle>,
    /// The local waiter the held native lock was handed to (woken), until it takes the row.
    granted: Option<String>,
    held: Option<Held>,
    /// A try, wait or unlock is in flight: the native lock is changing hands.
    busy: bool,
    /// The blocking wait in flight, if any.
    wait: Option<Wait>,
    /// Consecutive failed waits, for the back-off.
    failures: u32,
    /// A cancelled lock-file wait of this process still blocks in its thread (SQLite): it
    /// holds the entry file, so no other process can take the lock before it, and when it
    /// returns the lock it goes to whoever here wants it then (see `Gates::linger`).
    lingering: bool,
    /// Contenders that acquired here and have not released or left: they are pushed;
    /// anyone else who subscribes is an observer.
    contenders: std::collections::HashSet<String>,
}

impl State {
    fn enqueue(&mut self, id: &str) {
        if !self.queue.iter().any(|q| q == id) {
            self.queue.push_back(id.to_owned());
        }
    }

    fn unqueue(&mut self, id: &str) {
        self.queue.retain(|q| q != id);
    }

    /// Whether anyone here wants the native lock.
    fn wants(&self) -> bool {
        self.owner.is_some() || self.granted.is_some() || !self.queue.is_empty()
    }

    fn idle(&self) -> bool {
        !self.wants()
            && self.subs.is_empty()
            && self.contenders.is_empty()
            && self.held.is_none()
            && !self.busy
            && !self.lingering
    }

    fn is(&self, slot: &Option<String>, id: &str) -> bool {
        slot.as_deref() == Some(id)
    }
}

/// The local queue and native lock of one mutex.
struct Gate {
    mutex: String,
    key: Key,
    state: StdMutex<State>,
    /// Signalled when a lingering lock-file wait has ended (`State::lingering`).
    lingered: tokio::sync::Notify,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The gates of one store.
pub(crate) struct Gates {
    kind: Kind,
    /// The namespace of lock keys: the database and the table.
    scope: String,
    /// Bound of a non-blocking lock call (the store's statement timeout).
    bound: Duration,
    gates: StdMutex<HashMap<String, Arc<Gate>>>,
    /// The session that holds locks taken by a try (PostgreSQL, MySQL).
    holder: tokio::sync::Mutex<Option<Session>>,
    /// How many locks the holder session holds.
    shared: std::sync::atomic::AtomicUsize,
    /// Idle sessions for blocking waits.
    spare: StdMutex<Vec<Session>>,
}

impl fmt::Debug for Gates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gates")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl Gates {
    pub(crate) fn new(kind: Kind, scope: String, bound: Duration) -> Self {
        Gates {
            kind,
            scope,
            bound,
            gates: StdMutex::new(HashMap::new()),
            holder: tokio::sync::Mutex::new(None),
            shared: std::sync::atomic::AtomicUsize::new(0),
            spare: StdMutex::new(Vec::new()),
        }
    }

    fn key(&self, mutex: &str) -> Key {
        let h = stable_hash(&[&self.scope, mutex]);
        match &self.kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres { .. } => Key::Pg(i64::from_ne_bytes(h.to_ne_bytes())),
            #[cfg(feature = "mysql")]
            Kind::Mysql { .. } => Key::My(format!("simba:{h:016x}")),
            #[cfg(feature = "sqlite")]
            Kind::Files { prefix } => Key::File {
                main: format!("{prefix}-simba-{h:016x}.lock").into(),
                entry: format!("{prefix}-simba-{h:016x}.entry").into(),
            },
            Kind::Local => Key::Local,
        }
    }

    fn gate(&self, mutex: &str) -> Arc<Gate> {
        let mut gates = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        gates
            .entry(mutex.to_owned())
            .or_insert_with(|| {
                Arc::new(Gate {
                    mutex: mutex.to_owned(),
                    key: self.key(mutex),
                    state: StdMutex::new(State::default()),
                    lingered: tokio::sync::Notify::new(),
                })
            })
            .clone()
    }

    fn existing(&self, mutex: &str) -> Option<Arc<Gate>> {
        let gates = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        gates.get(mutex).cloned()
    }

    /// A close-on-exec duplicate of the lock file `id` holds for `mutex` (see
    /// `Connection::owner_anchor`): `None` unless this process's gate has `id` as the
    /// owner and holds the lock file for it.
    #[cfg(all(unix, feature = "sqlite"))]
    pub(crate) fn anchor(
        &self,
        mutex: &str,
        id: &str,
    ) -> std::io::Result<Option<std::os::fd::OwnedFd>> {
        let Some(gate) = self.existing(mutex) else {
            return Ok(None);
        };
        let s = gate.lock();
        match &s.held {
            Some(Held::File(file)) if s.is(&s.owner, id) => file
                .try_clone()
                .map(|f| Some(std::os::fd::OwnedFd::from(f))),
            _ => Ok(None),
        }
    }

    /// Forgets the gate of `mutex` if nothing uses it.
    fn tidy(&self, gate: &Arc<Gate>) {
        let mut gates = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        if gate.lock().idle() && gates.get(&gate.mutex).is_some_and(|g| Arc::ptr_eq(g, gate)) {
            gates.remove(&gate.mutex);
        }
    }

    /// Decides how `id` may acquire `mutex` now, trying the native lock if nobody here
    /// holds or waits for it. A contender that may not take the row yet is queued (and the
    /// gate waits for the native lock for it).
    ///
    /// # Cancel safety
    /// Cancel safe: the try runs in a task of its own and records its result in the gate.
    pub(crate) async fn enter(self: &Arc<Self>, mutex: &str, id: &str) -> Pass {
        let gate = self.gate(mutex);
        let lingered = {
            let mut s = gate.lock();
            s.contenders.insert(id.to_owned());
            if let Some(sub) = s.subs.get(id) {
                sub.contending.store(true, Ordering::Relaxed);
            }
            if let Some(g) = s.granted.clone()
                && s.subs.get(&g).is_some_and(|sub| sub.tx.is_closed())
            {
                // Handed to a waiter that went away without a word: take it back.
                s.granted = None;
            }
            if s.is(&s.owner, id) || s.is(&s.granted, id) {
                return if s.held.is_some() {
                    Pass::Locked
                } else {
                    Pass::Unlocked
                };
            }
            if s.owner.is_some() || s.granted.is_some() || s.busy {
                s.enqueue(id);
                return Pass::Unlocked;
            }
            if s.held.is_some() {
                // Held for nobody (a moment between a loss and the next grant): the first
                // waiter here gets it, or this contender if none waits.
                s.unqueue(id);
                if s.queue.is_empty() {
                    s.granted = Some(id.to_owned());
                    return Pass::Locked;
                }
                s.enqueue(id);
                self.assign(&gate, &mut s);
                return Pass::Unlocked;
            }
            if s.queue.iter().any(|q| q != id) {
                // Others here wait already (their wait is being retried): join them.
                s.enqueue(id);
                self.start_wait(&gate, &mut s);
                return Pass::Unlocked;
            }
            if s.lingering {
                // A cancelled wait of this process still blocks on the lock file, holding
                // the entry file: a try would find the entry taken, and no other process
                // can get the lock before that wait. It returns the lock at once if the
                // lock file is free (the lock then goes to the first contender queued
                // here), and not while another process holds it: queue, and give it a
                // moment (below).
                s.enqueue(id);
                Some(gate.lingered.notified())
            } else {
                s.busy = true;
                None
            }
        };
        if let Some(lingered) = lingered {
            #[cfg(feature = "sqlite")]
            let _ = timeout(LINGER, lingered).await;
            #[cfg(not(feature = "sqlite"))]
            drop(lingered);
            let s = gate.lock();
            return if s.is(&s.granted, id) && s.held.is_some() {
                Pass::Locked
            } else {
                Pass::Unlocked
            };
        }
        let this = self.clone();
        let task_gate = gate.clone();
        let me = id.to_owned();
        let task = tokio::spawn(async move {
            let got = this.try_native(&task_gate.key).await;
            let mut s = task_gate.lock();
            s.busy = false;
            match got {
                Ok(Some(held)) => {
                    s.held = Some(held);
                    s.unqueue(&me);
                    if s.owner.is_none() && s.granted.is_none() {
                        s.granted = Some(me.clone());
                    } else {
                        // Someone else's meanwhile (cannot happen while busy, but be sure).
                        s.enqueue(&me);
                    }
                    this.assign(&task_gate, &mut s);
                }
                Ok(None) => {
                    // Held elsewhere: queue here, and wait on the server for the lock.
                    s.unqueue(&me);
                    s.queue.push_front(me.clone());
                    this.start_wait(&task_gate, &mut s);
                }
                Err(e) => {
                    // No native lock now (a failed session, or too many held): this
                    // attempt goes by the row alone; the next one tries again.
                    debug!(mutex = %task_gate.mutex, "native lock try failed: {e}");
                }
            }
            s.is(&s.granted, &me) && s.held.is_some()
        });
        match task.await {
            Ok(true) => Pass::Locked,
            _ => Pass::Unlocked,
        }
    }

    /// Records what `id`'s acquisition or renewal came to: whether it owns the row now,
    /// and, if it does, until when (the call's start plus the whole lease).
    pub(crate) fn outcome(self: &Arc<Self>, mutex: &str, id: &str, owns: bool, until: Instant) {
        let gate = if owns {
            self.gate(mutex)
        } else {
            match self.existing(mutex) {
                Some(g) => g,
                None => return,
            }
        };
        let mut s = gate.lock();
        if owns {
            if !s.is(&s.owner, id) {
                s.owner_until = None;
            }
            s.owner = Some(id.to_owned());
            if s.owner_until.is_none_or(|u| u < until) {
                s.owner_until = Some(until);
                if let Some(old) = s.expiry.take() {
                    old.abort();
                }
                let this = self.clone();
                let timer_gate = gate.clone();
                let me = id.to_owned();
                let timer = tokio::spawn(async move {
                    tokio::time::sleep_until(until).await;
                    this.expire(&timer_gate, &me, until);
                });
                s.expiry = Some(timer.abort_handle());
            }
            if s.is(&s.granted, id) {
                s.granted = None;
            }
            // Owning by the row alone (no native lock: its holder went silent, or this store
            // holds too many) needs no session: the next local waiter starts a wait.
            s.unqueue(id);
        } else if s.is(&s.owner, id) {
            // It lost the row: a waiter again, first in line if this process holds the lock.
            s.owner = None;
            s.owner_until = None;
            if s.held.is_some() && s.granted.is_none() {
                s.granted = Some(id.to_owned());
            } else {
                s.enqueue(id);
            }
        }
    }

    /// The ownership of `id` was not renewed by `until`: its engine has given it up by
    /// now, so the native lock goes on as after a release (an owner that comes back
    /// contends anew).
    fn expire(self: &Arc<Self>, gate: &Arc<Gate>, id: &str, until: Instant) {
        let mut s = gate.lock();
        if !s.is(&s.owner, id) || s.owner_until != Some(until) {
            return;
        }
        debug!(mutex = %gate.mutex, "local ownership ran out unrenewed; passing the native lock on");
        s.owner = None;
        s.owner_until = None;
        s.expiry = None;
        if s.held.is_some() && s.granted.is_none() && !s.busy {
            drop(self.unlock(gate, &mut s));
        }
    }

    /// `id` released the row, or stopped waiting: it no longer needs the native lock. When
    /// nobody here does, the lock is unlocked, so the server wakes the next session in its
    /// queue; when other contenders here wait, they queue on the server again (behind the
    /// other processes' waiters, so a busy process does not keep the mutex to itself).
    ///
    /// # Cancel safety
    /// Cancel safe: the unlock runs in a task of its own.
    pub(crate) async fn done(self: &Arc<Self>, mutex: &str, id: &str, unsubscribe: bool) {
        let Some(gate) = self.existing(mutex) else {
            return;
        };
        let task = {
            let mut s = gate.lock();
            if s.is(&s.owner, id) {
                s.owner = None;
                s.owner_until = None;
                if let Some(timer) = s.expiry.take() {
                    timer.abort();
                }
            }
            if s.is(&s.granted, id) {
                s.granted = None;
            }
            s.unqueue(id);
            s.contenders.remove(id);
            if unsubscribe {
                s.subs.remove(id);
            }
            s.subs.retain(|_, sub| !sub.tx.is_closed());
            let task = if s.held.is_some() && s.owner.is_none() && s.granted.is_none() && !s.busy {
                self.unlock(&gate, &mut s)
            } else if !s.wants()
                && let Some(wait) = s.wait.take()
            {
                // Nobody here waits any more: give the server queue's place up, and wait
                // until the server has ended the wait (or the lock it granted meanwhile is
                // given back). Otherwise the lock could be granted, after this returns, to a
                // session nobody here waits on, and a try right after a release elsewhere
                // would find it held.
                let _ = wait.cancel.send(());
                Some(wait.task)
            } else {
                None
            };
            drop(s);
            task
        };
        if let Some(task) = task {
            let _ = task.await;
        }
        self.tidy(&gate);
    }

    /// Whether `id` contends for `mutex` here (it acquired, and has not released or left
    /// since). The engine's first acquisition starts before its subscription (both are in
    /// flight together, the acquisition polled first), so a subscriber that is not known
    /// here by then is an observer.
    pub(crate) fn contends(&self, mutex: &str, id: &str) -> bool {
        self.existing(mutex)
            .is_some_and(|g| g.lock().contenders.contains(id))
    }

    /// A channel of events for `id` about `mutex`, and the flag that says it contends.
    pub(crate) fn subscribe(
        self: &Arc<Self>,
        mutex: &str,
        id: &str,
    ) -> (
        mpsc::Receiver<StoreEvent>,
        mpsc::Sender<StoreEvent>,
        Arc<AtomicBool>,
    ) {
        let gate = self.gate(mutex);
        let (tx, rx) = mpsc::channel(QUEUE);
        let mut s = gate.lock();
        let queued = s.queue.iter().any(|q| q == id) || s.is(&s.granted, id);
        let contending = Arc::new(AtomicBool::new(queued || s.is(&s.owner, id)));
        if s.is(&s.granted, id) && s.held.is_some() {
            let _ = tx.try_send(StoreEvent::Released);
        }
        s.subs.retain(|_, sub| !sub.tx.is_closed());
        s.subs.insert(
            id.to_owned(),
            Sub {
                tx: tx.clone(),
                contending: contending.clone(),
            },
        );
        (rx, tx, contending)
    }

    /// Hands a held, unassigned native lock to the first live local waiter (one wake-up),
    /// or unlocks it when nobody here wants it.
    fn assign(self: &Arc<Self>, gate: &Arc<Gate>, s: &mut State) {
        if s.held.is_none() || s.owner.is_some() {
            return;
        }
        if s.granted.is_some() {
            return;
        }
        while let Some(id) = s.queue.pop_front() {
            if s.subs.get(&id).is_some_and(|sub| sub.tx.is_closed()) {
                // A waiter that went away without leaving: skip it.
                s.subs.remove(&id);
                continue;
            }
            self.wake(s, &id);
            s.granted = Some(id);
            return;
        }
        if let Some(task) = self.unlock(gate, s) {
            drop(task);
        }
    }

    fn wake(&self, s: &State, id: &str) {
        if let Some(sub) = s.subs.get(id) {
            let _ = sub.tx.try_send(StoreEvent::Released);
        }
    }

    /// Unlocks a held native lock in a task of its own; afterwards, queues on the server
    /// again if anyone here still waits.
    fn unlock(
        self: &Arc<Self>,
        gate: &Arc<Gate>,
        s: &mut State,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let held = s.held.take()?;
        s.busy = true;
        let this = self.clone();
        let gate = gate.clone();
        Some(tokio::spawn(async move {
            if let Err(e) = this.unlock_native(&gate.key, held).await {
                // The session is closed instead, which frees the lock on the server.
                debug!(mutex = %gate.mutex, "native unlock failed, its session was closed: {e}");
            }
            let mut s = gate.lock();
            s.busy = false;
            this.start_wait(&gate, &mut s);
            drop(s);
            this.tidy(&gate);
        }))
    }

    /// Starts a blocking wait for the native lock, if a contender here waits and nothing
    /// holds or changes it.
    fn start_wait(self: &Arc<Self>, gate: &Arc<Gate>, s: &mut State) {
        if s.busy || s.held.is_some() || s.queue.is_empty() {
            return;
        }
        s.busy = true;
        let pause = if s.failures == 0 {
            Duration::ZERO
        } else {
            (RETRY_MIN * 2u32.saturating_pow(s.failures.min(5) - 1)).min(RETRY_MAX)
        };
        let this = self.clone();
        let task_gate = gate.clone();
        let (cancel, mut cancelled) = oneshot::channel();
        let task = tokio::spawn(async move {
            if !pause.is_zero() {
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    _ = &mut cancelled => {}
                }
            }
            let got = this.wait_native(&task_gate.key, cancelled).await;
            let mut s = task_gate.lock();
            s.busy = false;
            s.wait = None;
            match got {
                Ok(Waited::Got(held)) => {
                    s.failures = 0;
                    s.held = Some(held);
                    this.assign(&task_gate, &mut s);
                }
                #[cfg(feature = "sqlite")]
                Ok(Waited::Lingering(blocking)) => {
                    s.lingering = true;
                    this.linger(&task_gate, blocking);
                }
                Ok(Waited::GaveUp) => {
                    // Given up (nobody here waited any more); whoever queued since waits anew.
                    this.start_wait(&task_gate, &mut s);
                }
                Err(e) => {
                    s.failures = s.failures.saturating_add(1);
                    if s.failures == 1 {
                        warn!(mutex = %task_gate.mutex, "waiting for the native lock failed (waiters fall back to the lease until it works again): {e}");
                    }
                    // Whatever happened meanwhile was not heard: everyone here looks again.
                    for sub in s.subs.values() {
                        let _ = sub.tx.try_send(StoreEvent::Resync);
                    }
                    this.start_wait(&task_gate, &mut s);
                }
            }
        });
        s.wait = Some(Wait { cancel, task });
    }

    /// Follows a cancelled lock-file wait that still blocks (`State::lingering`) until it
    /// returns: the lock it then holds goes to whoever here wants it (`assign`); when
    /// nobody does, or the gate holds or is changing the lock meanwhile, it is dropped
    /// (unlocked) at once.
    #[cfg(feature = "sqlite")]
    fn linger(
        self: &Arc<Self>,
        gate: &Arc<Gate>,
        blocking: JoinHandle<Result<std::fs::File, String>>,
    ) {
        let this = self.clone();
        let gate = gate.clone();
        tokio::spawn(async move {
            let got = blocking.await;
            {
                let mut s = gate.lock();
                s.lingering = false;
                match got {
                    Ok(Ok(file)) if s.held.is_none() && !s.busy && s.wants() => {
                        s.held = Some(Held::File(file));
                        this.assign(&gate, &mut s);
                    }
                    // Unlocked here and now (closing the file), not in an unlock task: a
                    // try right after must not find the gate busy with it.
                    Ok(Ok(file)) => drop(file),
                    Ok(Err(e)) => {
                        debug!(mutex = %gate.mutex, "a cancelled lock-file wait failed: {e}")
                    }
                    Err(e) => debug!(mutex = %gate.mutex, "a cancelled lock-file wait's task: {e}"),
                }
                // Whoever queued meanwhile and got nothing waits on the file again.
                this.start_wait(&gate, &mut s);
            }
            gate.lingered.notify_waiters();
            this.tidy(&gate);
        });
    }

    /// One non-blocking attempt at the native lock.
    async fn try_native(&self, key: &Key) -> Result<Option<Held>, String> {
        match key {
            Key::Local => Ok(Some(Held::Local)),
            #[cfg(feature = "sqlite")]
            Key::File { main, entry } => {
                let (main, entry) = (main.clone(), entry.clone());
                tokio::task::spawn_blocking(move || files::try_lock(&main, &entry))
                    .await
                    .map_err(|e| format!("lock file task: {e}"))?
                    .map(|f| f.map(Held::File))
            }
            #[allow(unreachable_patterns)]
            _ => {
                if self.shared.load(Ordering::Relaxed) >= MAX_SHARED_LOCKS {
                    return Err(format!(
                        "this store holds {MAX_SHARED_LOCKS} native locks already"
                    ));
                }
                let mut holder = self.holder.lock().await;
                if holder.is_none() {
                    let s = timeout(self.bound, Session::connect(&self.kind))
                        .await
                        .map_err(|_| format!("no lock session within {:?}", self.bound))??;
                    *holder = Some(s);
                }
                let Some(session) = holder.as_mut() else {
                    return Err("no lock session".to_owned());
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
                        Err(format!("lock session: no answer within {:?}", self.bound))
                    }
                }
            }
        }
    }

    /// Waits (without bound) until the native lock is this process's, or until `cancel`
    /// fires (or its sender is dropped): then `None`, and no lock is left granted to a
    /// session of this process that nobody waits on.
    async fn wait_native(
        &self,
        key: &Key,
        mut cancel: oneshot::Receiver<()>,
    ) -> Result<Waited, String> {
        if cancel.try_recv().is_ok() {
            return Ok(Waited::GaveUp);
        }
        match key {
            Key::Local => Ok(Waited::Got(Held::Local)),
            #[cfg(feature = "sqlite")]
            Key::File { main, entry } => {
                let (main, entry) = (main.clone(), entry.clone());
                let mut blocking = tokio::task::spawn_blocking(move || files::lock(&main, &entry));
                tokio::select! {
                    r = &mut blocking => r
                        .map_err(|e| format!("lock file task: {e}"))?
                        .map(|f| Waited::Got(Held::File(f))),
                    // A blocking lock call cannot be interrupted: its thread goes on
                    // waiting, and the gate follows it (`Gates::linger`).
                    _ = cancel => Ok(Waited::Lingering(blocking)),
                }
            }
            #[allow(unreachable_patterns)]
            _ => {
                let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
                let mut session = match spare {
                    Some(s) => s,
                    None => timeout(self.bound, Session::connect(&self.kind))
                        .await
                        .map_err(|_| format!("no lock session within {:?}", self.bound))??,
                };
                let canceller = session.canceller(&self.kind);
                let mut given_up = false;
                let got = {
                    let lock = session.lock(key);
                    tokio::pin!(lock);
                    tokio::select! {
                        r = &mut lock => r,
                        _ = cancel => {
                            given_up = true;
                            if let Err(e) = timeout(self.bound, canceller.cancel()).await
                                .unwrap_or_else(|_| Err(format!("no answer within {:?}", self.bound)))
                            {
                                debug!("cancelling a native lock wait: {e}");
                            }
                            // The wait ends with an error (cancelled), or with the lock if it
                            // was granted first.
                            timeout(self.bound, &mut lock).await.unwrap_or_else(|_| {
                                Err(format!("a cancelled wait did not end within {:?}", self.bound))
                            })
                        }
                    }
                };
                match (got, given_up) {
                    (Ok(()), false) => Ok(Waited::Got(Held::Own(session))),
                    (Ok(()), true) => {
                        self.unlock_native(key, Held::Own(session)).await?;
                        Ok(Waited::GaveUp)
                    }
                    // The session is dropped: its connection closes, and whatever the server
                    // still had it wait for or hold goes with it.
                    (Err(_), true) => Ok(Waited::GaveUp),
                    (Err(e), false) => Err(e),
                }
            }
        }
    }

    async fn unlock_native(&self, key: &Key, held: Held) -> Result<(), String> {
        match held {
            Held::Local => Ok(()),
            #[cfg(feature = "sqlite")]
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
                        Err(format!("lock session: no answer within {:?}", self.bound))
                    }
                }
            }
            Held::Own(mut session) => match timeout(self.bound, session.unlock(key)).await {
                Ok(Ok(())) => {
                    self.spare
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(session);
                    Ok(())
                }
                Ok(Err(e)) => Err(e),
                Err(_) => Err(format!("lock session: no answer within {:?}", self.bound)),
            },
        }
    }
}

#[cfg(feature = "postgres")]
mod pg {
    use tokio_postgres::{AsyncMessage, Client, Statement};

    use crate::pg::Connector;

    /// A PostgreSQL session for advisory locks, its statements prepared once.
    pub(super) struct Session {
        client: Client,
        try_lock: Statement,
        lock: Statement,
        unlock: Statement,
        driver: tokio::task::JoinHandle<()>,
    }

    impl Drop for Session {
        fn drop(&mut self) {
            self.driver.abort();
        }
    }

    fn text(e: tokio_postgres::Error) -> String {
        format!("postgres lock session: {e}")
    }

    impl Session {
        pub(super) async fn connect(pg: &Connector) -> Result<Session, String> {
            let (client, mut connection) = pg
                .connect()
                .await
                .map_err(|e| format!("postgres lock session: {e}"))?;
            let driver = tokio::spawn(async move {
                while let Some(msg) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                    match msg {
                        Ok(AsyncMessage::Notice(_) | AsyncMessage::Notification(_)) => {}
                        Ok(_) => {}
                        Err(_) => break,
                    }
                }
            });
            // A wait may last as long as an ownership: no server-side statement bound.
            client
                .batch_execute("SET statement_timeout = 0")
                .await
                .map_err(text)?;
            let try_lock = client
                .prepare("SELECT pg_try_advisory_lock($1)")
                .await
                .map_err(text)?;
            let lock = client
                .prepare("SELECT pg_advisory_lock($1)::text")
                .await
                .map_err(text)?;
            let unlock = client
                .prepare("SELECT pg_advisory_unlock($1)")
                .await
                .map_err(text)?;
            Ok(Session {
                client,
                try_lock,
                lock,
                unlock,
                driver,
            })
        }

        pub(super) fn cancel_token(&self) -> tokio_postgres::CancelToken {
            self.client.cancel_token()
        }

        pub(super) async fn try_lock(&mut self, key: i64) -> Result<bool, String> {
            let row = self
                .client
                .query_one(&self.try_lock, &[&key])
                .await
                .map_err(text)?;
            row.try_get::<_, bool>(0).map_err(text)
        }

        pub(super) async fn lock(&mut self, key: i64) -> Result<(), String> {
            self.client
                .query_one(&self.lock, &[&key])
                .await
                .map(|_| ())
                .map_err(text)
        }

        pub(super) async fn unlock(&mut self, key: i64) -> Result<(), String> {
            let row = self
                .client
                .query_one(&self.unlock, &[&key])
                .await
                .map_err(text)?;
            match row.try_get::<_, bool>(0).map_err(text)? {
                true => Ok(()),
                false => Err("the advisory lock was not held by its session".to_owned()),
            }
        }
    }
}

#[cfg(feature = "mysql")]
mod my {
    use mysql_async::Conn;
    use mysql_async::prelude::Queryable;

    /// `GET_LOCK`'s timeout for a blocking wait, in seconds: a year (some servers read a
    /// negative timeout as "no wait").
    const FOREVER_S: i64 = 365 * 24 * 3600;

    /// A MySQL / MariaDB session for user locks.
    pub(super) struct Session(Conn);

    /// Ends the statement that connection `id` runs (a blocking `GET_LOCK`), from a
    /// connection of its own.
    pub(super) async fn kill_query(url: &str, id: u32) -> Result<(), String> {
        let mut killer = Session::connect(url).await?;
        let killed = killer.0.query_drop(format!("KILL QUERY {id}")).await;
        let _ = killer.0.disconnect().await;
        killed.map_err(text)
    }

    fn text(e: mysql_async::Error) -> String {
        format!("mysql lock session: {e}")
    }

    impl Session {
        pub(super) async fn connect(url: &str) -> Result<Session, String> {
            // The URL's TLS options (crate::my), as every connection of the store.
            let opts = crate::my::opts(url).map_err(|e| format!("mysql lock session: {e}"))?;
            let conn = Conn::new(opts).await.map_err(text)?;
            Ok(Session(conn))
        }

        async fn get(&mut self, name: &str, wait_s: i64) -> Result<Option<i64>, String> {
            self.0
                .exec_first::<Option<i64>, _, _>("SELECT GET_LOCK(?, ?)", (name, wait_s))
                .await
                .map(Option::flatten)
                .map_err(text)
        }

        /// The server's id of this session's connection.
        pub(super) fn id(&self) -> u32 {
            self.0.id()
        }

        pub(super) async fn try_lock(&mut self, name: &str) -> Result<bool, String> {
            match self.get(name, 0).await? {
                Some(1) => Ok(true),
                Some(_) => Ok(false),
                None => Err("GET_LOCK returned NULL (an error on the server)".to_owned()),
            }
        }

        pub(super) async fn lock(&mut self, name: &str) -> Result<(), String> {
            loop {
                match self.get(name, FOREVER_S).await? {
                    Some(1) => return Ok(()),
                    Some(_) => {}
                    None => {
                        return Err("GET_LOCK returned NULL (an error on the server)".to_owned());
                    }
                }
            }
        }

        pub(super) async fn unlock(&mut self, name: &str) -> Result<(), String> {
            match self
                .0
                .exec_first::<Option<i64>, _, _>("SELECT RELEASE_LOCK(?)", (name,))
                .await
                .map(Option::flatten)
                .map_err(text)?
            {
                Some(1) => Ok(()),
                other => Err(format!(
                    "RELEASE_LOCK returned {other:?}: the lock was not this session's"
                )),
            }
        }
    }
}

#[cfg(feature = "sqlite")]
mod files {
    use std::fs::{File, OpenOptions, TryLockError};
    use std::path::Path;

    fn open(path: &Path) -> Result<File, String> {
        // std opens with O_CLOEXEC: a child process (simba exec's command) never inherits
        // the lock.
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| format!("lock file {}: {e}", path.display()))
    }

    fn try_one(file: &File, path: &Path) -> Result<bool, String> {
        match file.try_lock() {
            Ok(()) => Ok(true),
            Err(TryLockError::WouldBlock) => Ok(false),
            Err(TryLockError::Error(e)) => Err(format!("lock file {}: {e}", path.display())),
        }
    }

    /// The lock without waiting, unless someone waits for it (holds the entry file).
    pub(super) fn try_lock(main: &Path, entry: &Path) -> Result<Option<File>, String> {
        let gate = open(entry)?;
        if !try_one(&gate, entry)? {
            return Ok(None);
        }
        let file = open(main)?;
        Ok(try_one(&file, main)?.then_some(file))
    }

    /// Waits for the lock: first for the entry file (the kernel queues its waiters behind
    /// one another), then, holding it, for the lock file itself; the entry is let go once
    /// the lock is held. So at most one process waits on the lock file at a time, and one
    /// that just unlocked it cannot take it back before that waiter.
    pub(super) fn lock(main: &Path, entry: &Path) -> Result<File, String> {
        let gate = open(entry)?;
        gate.lock()
            .map_err(|e| format!("lock file {}: {e}", entry.display()))?;
        let file = open(main)?;
        file.lock()
            .map_err(|e| format!("lock file {}: {e}", main.display()))?;
        drop(gate);
        Ok(file)
    }
}
