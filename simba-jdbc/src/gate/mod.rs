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
//! - SQLite: on Linux an OFD byte-range lock on a byte per mutex in one lock file next to
//!   the database file, behind a second "entry" byte that keeps the order (elsewhere
//!   `flock` on a lock file and an entry file per mutex; see the crate README).
//!
//! Each store keeps one [`Gate`] per mutex in use: a process-local FIFO of its contenders
//! in front of the native lock, so that a process waits on the server with at most one
//! session per mutex. The owner keeps the native lock while it owns; a release updates the
//! row, then unlocks; the server grants the lock to the next waiting session, whose gate
//! wakes its first local waiter with [`StoreEvent::Released`] (one wake-up per release).
//!
//! A store runs at most `crate::native::MAX_NATIVE_WAITS` (16) blocking waits at once (each
//! holds a session or a blocking thread): a gate whose mutex is beyond that cap waits
//! without one, trying the lock once a second and whenever a push about the mutex comes
//! (PostgreSQL's NOTIFY of a release), and blocks again as soon as a place frees (see
//! `crate::native`, *The cap on blocking waits*).
//!
//! Everything that changes the native lock runs in a spawned task and records its result
//! in the gate itself, so a caller's future that is dropped halfway never leaves the lock
//! held by nobody's knowledge.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex, MutexGuard, Weak};
use std::time::Duration;

use simba_core::backend::StoreEvent;
use simba_core::events::{self, EventReceiver, EventSender};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};
use tracing::{debug, warn};

use crate::call::Pass;
use crate::native::{FileLock, Held, Key, Kind, Locks, WaitSlot, Waited};

mod expiry;
mod lock;
#[cfg(test)]
mod tests;

use expiry::{Expiries, ExpiryKey};

/// Events a subscriber may have queued before it reads them. A full queue already holds an
/// event that makes the contender look again, so dropping more is harmless.
const QUEUE: usize = 16;
/// How long a contender gives a cancelled lock-file wait of this process to finish (see
/// `State::lingering`): it finishes at once when the lock file is free, and not at all
/// while another process holds it.
const LINGER: Duration = Duration::from_millis(250);
/// First and longest pause before a failed wait is tried again.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// A blocking wait for the native lock in flight: its task, and the signal that ends it.
struct Wait {
    cancel: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

/// A local subscriber of a mutex's events.
struct Sub {
    tx: EventSender,
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
    /// The entry in the store's expiry queue ([`Expiries`]) that ends the ownership here at
    /// `owner_until`.
    expiry: Option<ExpiryKey>,
    /// The owner has an acquisition or renewal in flight (see [`Gates::calling`]): if its
    /// ownership runs out here meanwhile, the native lock stays with it.
    calling: Option<String>,
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
    /// holds the entry, so no other process can take the lock before it, and when it
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
    /// A push about this mutex (PostgreSQL's NOTIFY of a release): a wait beyond the cap
    /// (`crate::native::MAX_NATIVE_WAITS`) tries the lock at once rather than at its next poll.
    poke: tokio::sync::Notify,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The gates of one store.
pub(crate) struct Gates {
    /// The native locks, and the sessions that hold them.
    locks: Locks,
    /// The namespace of lock keys: the database and the table.
    scope: String,
    gates: StdMutex<HashMap<String, Arc<Gate>>>,
    /// When the ownerships held here end unless renewed: one queue and at most one task
    /// for the whole store, not a timer task per owned mutex.
    expiries: Expiries,
}

impl fmt::Debug for Gates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gates")
            .field("kind", self.locks.kind())
            .finish_non_exhaustive()
    }
}

impl Gates {
    pub(crate) fn new(kind: Kind, scope: String, bound: Duration) -> Self {
        Gates {
            locks: Locks::new(kind, bound),
            scope,
            gates: StdMutex::new(HashMap::new()),
            expiries: Expiries::default(),
        }
    }

    fn key(&self, mutex: &str) -> Key {
        self.locks.kind().key(&self.scope, mutex)
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
                    poke: tokio::sync::Notify::new(),
                })
            })
            .clone()
    }

    fn existing(&self, mutex: &str) -> Option<Arc<Gate>> {
        let gates = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        gates.get(mutex).cloned()
    }

    /// The description of the database file (the lock file outside Linux) that `id`
    /// holds its native lock of `mutex` by, to be shared with another process (see
    /// `Connection::owner_anchor`): `None` unless this process's gate has `id` as the
    /// owner and holds the lock for it. An anchored lock is never unlocked by this
    /// process nor its description reused (`crate::sqlite::FileLock::anchor`).
    #[cfg(all(unix, feature = "sqlite"))]
    pub(crate) fn anchor(&self, mutex: &str, id: &str) -> Option<simba_core::connect::Anchor> {
        let gate = self.existing(mutex)?;
        let mut s = gate.lock();
        let owner = s.is(&s.owner, id);
        match &mut s.held {
            Some(Held::File(file)) if owner => file.anchor(),
            _ => None,
        }
    }

    /// SQLite: that the database file exists and has one name, and with a mutex whether a
    /// job of its owner runs (see `crate::native::Locks::check_db_file`).
    #[cfg(feature = "sqlite")]
    pub(crate) fn check_db_file(
        &self,
        mutex: Option<&str>,
    ) -> Result<Option<i64>, crate::sqlite::Refused> {
        let key = mutex.map(|m| self.key(m));
        self.locks.check_db_file(key.as_ref())
    }

    /// A push says `mutex` was released by another process: a wait of its gate beyond the
    /// cap tries the lock now (one stored wake-up if it is not polling at this instant).
    pub(crate) fn poke(&self, mutex: &str) {
        if let Some(gate) = self.existing(mutex) {
            gate.poke.notify_one();
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
                if s.is(&s.owner, id) {
                    s.calling = Some(id.to_owned());
                }
                return s
                    .held
                    .as_ref()
                    .map_or(Pass::Unlocked, |h| Pass::Locked(h.mark()));
            }
            if s.owner.is_some() || s.granted.is_some() || s.busy {
                s.enqueue(id);
                return Pass::Unlocked;
            }
            if s.held.is_some() {
                // Held for nobody (a moment between a loss and the next grant): the first
                // waiter here gets it, or this contender if none waits.
                s.unqueue(id);
                if s.queue.is_empty()
                    && let Some(mark) = s.held.as_ref().map(Held::mark)
                {
                    s.granted = Some(id.to_owned());
                    return Pass::Locked(mark);
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
                // A cancelled wait of this process still blocks on the lock, holding the
                // entry: a try would find the entry taken, and no other process can get
                // the lock before that wait. It returns the lock at once if the lock is
                // free (the lock then goes to the first contender queued
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
            let _ = timeout(LINGER, lingered).await;
            let s = gate.lock();
            return match &s.held {
                Some(h) if s.is(&s.granted, id) => Pass::Locked(h.mark()),
                _ => Pass::Unlocked,
            };
        }
        let this = self.clone();
        let task_gate = gate.clone();
        let me = id.to_owned();
        let task = tokio::spawn(async move {
            let got = this.locks.try_lock(&task_gate.key).await;
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
            match &s.held {
                Some(h) if s.is(&s.granted, &me) => Some(h.mark()),
                _ => None,
            }
        });
        match task.await {
            Ok(Some(mark)) => Pass::Locked(mark),
            _ => Pass::Unlocked,
        }
    }

    /// `id` starts a renewal of `mutex`: if it owns it here, its ownership's expiry
    /// keeps the native lock for it until the renewal's outcome (see `State::calling`).
    pub(crate) fn calling(&self, mutex: &str, id: &str) {
        if let Some(gate) = self.existing(mutex) {
            let mut s = gate.lock();
            if s.is(&s.owner, id) {
                s.calling = Some(id.to_owned());
            }
        }
    }

    /// Records what `id`'s acquisition or renewal came to: whether it owns the row now,
    /// and, if it does, until when: the whole lease (ttl and transition) from the moment
    /// the answer came. The database stamped the row's lease during the call, so this is
    /// never before the row's lease ends (on SQLite, one machine's clock: a waiter that
    /// gets the lock file then and takes a gated row over never takes one whose lease is
    /// in force), and it is later than the engine's own local deadline, which counts from
    /// before the call and ends at the ttl less a drift margin.
    ///
    /// Returns whether `id` owns now and was not the owner here before (a new ownership, as
    /// far as this process knows; observers are told of it).
    ///
    /// An answer that comes after `id` released or left here ([`Gates::done`]) records
    /// nothing: an acquisition that renewed the row while its owner's release was on its
    /// way (the engine looks again when it hears of a release elsewhere) would otherwise
    /// leave `id` as the owner here after its release, and every later contender of this
    /// process would wait for that stale ownership's end (seen behind a pooler, where the
    /// NOTIFY that makes the engine look comes later than on a direct connection).
    pub(crate) fn outcome(
        self: &Arc<Self>,
        mutex: &str,
        id: &str,
        owns: bool,
        until: Instant,
    ) -> bool {
        self.record(mutex, id, owns, until, true)
    }

    /// [`Gates::outcome`], of a contender that may not have entered (`entered_only`
    /// false: the unit tests' ownerships without an acquisition).
    fn record(
        self: &Arc<Self>,
        mutex: &str,
        id: &str,
        owns: bool,
        until: Instant,
        entered_only: bool,
    ) -> bool {
        let gate = if owns && !entered_only {
            self.gate(mutex)
        } else {
            match self.existing(mutex) {
                Some(g) => g,
                None => return false,
            }
        };
        let mut s = gate.lock();
        if entered_only && !s.contenders.contains(id) {
            return false;
        }
        if s.is(&s.calling, id) {
            s.calling = None;
        }
        let new = owns && !s.is(&s.owner, id);
        if owns {
            if new {
                s.owner_until = None;
            }
            s.owner = Some(id.to_owned());
            if s.owner_until.is_none_or(|u| u < until) {
                s.owner_until = Some(until);
                let old = s.expiry.take();
                s.expiry = Some(self.schedule(&gate, until, old));
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
            if let Some(key) = s.expiry.take() {
                self.expiries.remove(key);
            }
            if s.held.is_some() && s.granted.is_none() {
                s.granted = Some(id.to_owned());
            } else {
                s.enqueue(id);
            }
        }
        new
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
            if s.is(&s.calling, id) {
                s.calling = None;
            }
            if s.is(&s.owner, id) {
                s.owner = None;
                s.owner_until = None;
                if let Some(key) = s.expiry.take() {
                    self.expiries.remove(key);
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

    /// Whether a local contender waits for `mutex` (holding its native lock without the
    /// row, or queued for it): while the row's owner is one that took it without the
    /// native queue (a JVM Simba contender), nothing but a read tells it when that
    /// ownership ends (see `store::watch_owner`).
    pub(crate) fn waiting(&self, mutex: &str) -> bool {
        self.existing(mutex).is_some_and(|g| {
            let s = g.lock();
            s.granted.is_some() || !s.queue.is_empty()
        })
    }

    /// Wakes one local waiter of `mutex` (the one holding its native lock, else the first
    /// in the local queue, which may take a row freed outside the queue without the lock):
    /// the owner outside the native queue has gone.
    pub(crate) fn wake_one(&self, mutex: &str) {
        if let Some(gate) = self.existing(mutex) {
            let s = gate.lock();
            if let Some(id) = s.granted.as_deref().or(s.queue.front().map(String::as_str)) {
                self.wake(&s, id);
            }
        }
    }

    /// A channel of events for `id` about `mutex`, and the flag that says it contends.
    pub(crate) fn subscribe(
        self: &Arc<Self>,
        mutex: &str,
        id: &str,
    ) -> (EventReceiver, EventSender, Arc<AtomicBool>) {
        let gate = self.gate(mutex);
        let (tx, rx) = events::channel(QUEUE);
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
}
