//! [`Locker`]: acquire a distributed mutex as a guard, with its fence and a loss signal.
//!
//! Every `Locker` for one (factory, mutex, contender id) in a process shares one [`Slot`]:
//! a FIFO turn (a `tokio::sync::Mutex`) that a task holds from the start of its backend
//! contention until the release of its ownership has completed. So tasks of one process
//! exclude each other, N local waiters cost one backend contender, and a new acquisition
//! never overlaps the release of the ownership before it.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex as StdMutex, OnceLock, Weak};
use std::time::Duration;

use tokio::sync::{OwnedMutexGuard, oneshot, watch};
use tokio::time::Instant;

use crate::error::{Error, LossReason, Result};
use crate::id::generate_contender_id;
use crate::service::{ContendService, ContendServiceFactory, Contender, ContenderStatus};

struct IdContender(String);
impl Contender for IdContender {
    fn contender_id(&self) -> Option<String> {
        Some(self.0.clone())
    }
}

/// What identifies a [`Slot`] in the process: the factory (by address: a live slot keeps
/// its factory alive, so the address cannot be reused while the entry matters), the mutex,
/// and the contender id if the user chose one.
#[derive(Clone, PartialEq, Eq, Hash)]
struct SlotKey {
    factory: usize,
    mutex: String,
    contender_id: Option<String>,
}

type Registry = StdMutex<HashMap<SlotKey, Weak<Slot>>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

fn lock<T>(m: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether the holder of the turn is releasing, and how many tasks wait for the turn.
#[derive(Default)]
struct TurnState {
    releasing: bool,
    waiting: usize,
}

/// The process-wide state of one locker: see the module docs.
struct Slot {
    key: SlotKey,
    factory: Arc<dyn ContendServiceFactory>,
    turn: Arc<tokio::sync::Mutex<()>>,
    state: StdMutex<TurnState>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut map = lock(registry());
        if map.get(&self.key).is_some_and(|w| w.strong_count() == 0) {
            map.remove(&self.key);
        }
    }
}

type Turn = OwnedMutexGuard<()>;

impl Slot {
    fn obtain(
        factory: Arc<dyn ContendServiceFactory>,
        mutex: &str,
        contender_id: Option<String>,
    ) -> Arc<Slot> {
        let key = SlotKey {
            factory: Arc::as_ptr(&factory).cast::<()>() as usize,
            mutex: mutex.to_owned(),
            contender_id,
        };
        let mut map = lock(registry());
        if let Some(slot) = map.get(&key).and_then(Weak::upgrade) {
            return slot;
        }
        let slot = Arc::new(Slot {
            key: key.clone(),
            factory,
            turn: Arc::new(tokio::sync::Mutex::new(())),
            state: StdMutex::default(),
        });
        map.insert(key, Arc::downgrade(&slot));
        slot
    }

    fn mutex(&self) -> &str {
        &self.key.mutex
    }

    /// The holder of the turn started releasing (or giving up): a `try_acquire` may wait
    /// for that instead of saying the mutex is held.
    fn releasing(&self) {
        lock(&self.state).releasing = true;
    }

    /// Gives the turn to the next local waiter. Under the state lock, so that a
    /// `try_acquire` sees either the turn still held and releasing, or it passed on.
    fn end_turn(&self, turn: Turn) {
        let mut state = lock(&self.state);
        drop(turn);
        state.releasing = false;
    }

    /// Waits for the turn, counted as a waiter. Cancel safe: dropping it leaves the queue.
    async fn wait_turn(self: &Arc<Self>) -> Turn {
        struct Waiting<'a>(&'a Slot);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                lock(&self.0.state).waiting -= 1;
            }
        }
        lock(&self.state).waiting += 1;
        let _waiting = Waiting(self);
        self.turn.clone().lock_owned().await
    }

    /// The turn without waiting behind another task: `None` when another task holds it
    /// for a contention or an ownership. A holder that is only finishing its release is
    /// waited for (bounded by that release), unless other tasks wait already.
    async fn try_turn(self: &Arc<Self>) -> Option<Turn> {
        {
            let state = lock(&self.state);
            if let Ok(turn) = self.turn.clone().try_lock_owned() {
                return Some(turn);
            }
            if !state.releasing || state.waiting > 0 {
                return None;
            }
        }
        Some(self.wait_turn().await)
    }
}

/// Stops `service` and waits until it has stopped, released remotely included. Waits on
/// the status too: a second caller of `stop` (after a first one was dropped) does not get
/// the task to wait for.
async fn stop_fully(service: &Arc<dyn ContendService>) {
    let mut status = service.status();
    let _ = service.stop().await;
    let _ = status.wait_for(|s| !s.running).await;
}

/// A contention under way: if the acquire future is dropped with it, the service is
/// stopped and the turn passed on only once the stop (and so the remote release) is done.
struct Pending {
    slot: Arc<Slot>,
    contention: Option<(Arc<dyn ContendService>, Turn)>,
}

impl Pending {
    /// Stops the contention and waits for it (releasing whatever it may have won), and
    /// keeps the turn for the next round of the same acquisition. `None` if there was no
    /// contention. Dropped halfway, it finishes as a drop of `self` does.
    async fn stop_keeping_turn(&mut self) -> Option<Turn> {
        let service = self.contention.as_ref()?.0.clone();
        stop_fully(&service).await;
        self.contention.take().map(|(_, turn)| turn)
    }

    /// Stops the contention and waits for it (releasing whatever it may have won), then
    /// passes the turn on.
    async fn give_up(mut self) {
        let Some((service, turn)) = self.contention.take() else {
            return;
        };
        self.slot.releasing();
        // Put back while stopping: if this future is dropped, `drop` finishes the job.
        self.contention = Some((service.clone(), turn));
        stop_fully(&service).await;
        if let Some((_, turn)) = self.contention.take() {
            self.slot.end_turn(turn);
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some((service, turn)) = self.contention.take() else {
            return;
        };
        self.slot.releasing();
        let slot = self.slot.clone();
        match crate::rt::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    stop_fully(&service).await;
                    slot.end_turn(turn);
                });
            }
            Err(_) => {
                // `stop` signals at once; its release then runs on the service's own task.
                drop(service.stop());
                slot.end_turn(turn);
            }
        }
    }
}

/// Acquires one mutex through a backend's factory.
///
/// **One locker per mutex per process.** Every `Locker` made for the same mutex from the
/// same factory (the same `Arc`), and every clone of one, is the same locker: tasks that
/// acquire through it exclude each other like a [`tokio::sync::Mutex`]. They wait in this
/// process, first come first served, in front of at most one backend contender, so a
/// thousand waiting tasks cost the backend one waiter. There is no reentrancy: a second
/// `acquire` while a guard is alive waits for that guard, whichever task or clone asks.
/// [`LockRegistry::obtain`] is the same as [`Locker::new`], as a method of the factory.
///
/// Each acquisition contends under a new contender id (see [`LockGuard::contender_id`]),
/// unless the locker was made [with one](Locker::with_contender_id). A new acquisition
/// starts only after the release of the ownership before it has completed, so the release
/// of an old ownership can never free a new one.
///
/// ```
/// # async fn demo() -> simba_core::Result<()> {
/// use std::sync::Arc;
/// use simba_core::{LeaseConfig, LeaseServiceFactory, Locker, MemoryStore};
///
/// let factory = Arc::new(LeaseServiceFactory::new(MemoryStore::new(), LeaseConfig::default())?);
/// let locker = Locker::new(factory, "nightly-report")?;
/// let guard = locker.acquire().await?;
/// println!("writing with fence {}", guard.fence());
/// guard.release().await?;
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(demo()).unwrap();
/// ```
#[derive(Clone)]
pub struct Locker {
    slot: Arc<Slot>,
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locker")
            .field("backend", &self.slot.factory.backend())
            .field("mutex", &self.slot.mutex())
            .field("contender_id", &self.slot.key.contender_id)
            .finish()
    }
}

/// The process-wide [`Locker`] of a name, from a factory: Spring's `LockRegistry.obtain`.
///
/// ```
/// # async fn demo() -> simba_core::Result<()> {
/// use std::sync::Arc;
/// use simba_core::{LeaseConfig, LeaseServiceFactory, LockRegistry, MemoryStore};
///
/// let factory = Arc::new(LeaseServiceFactory::new(MemoryStore::new(), LeaseConfig::default())?);
/// let guard = factory.obtain("invoices")?.acquire().await?;
/// // Any task of this process that obtains "invoices" from `factory` now waits.
/// assert!(factory.obtain("invoices")?.try_acquire().await.is_err());
/// guard.release().await?;
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(demo()).unwrap();
/// ```
pub trait LockRegistry {
    /// The locker of `mutex`, shared by every task of this process that obtains it from
    /// this factory (see [`Locker`]).
    ///
    /// # Errors
    /// [`Error::InvalidName`] for a bad mutex name.
    fn obtain(&self, mutex: &str) -> Result<Locker>;
}

impl LockRegistry for Arc<dyn ContendServiceFactory> {
    fn obtain(&self, mutex: &str) -> Result<Locker> {
        Locker::new(self.clone(), mutex)
    }
}

impl<F: ContendServiceFactory + 'static> LockRegistry for Arc<F> {
    fn obtain(&self, mutex: &str) -> Result<Locker> {
        Locker::new(self.clone(), mutex)
    }
}

/// How long an acquisition may wait.
#[derive(Clone, Copy)]
enum Wait {
    Forever,
    Until(Instant),
    /// One backend attempt, no waiting behind another task.
    Once,
}

impl Locker {
    /// The locker of `mutex` in this process for `factory` (the same one for every call
    /// with the same factory `Arc` and name). Each acquisition contends under a new
    /// generated contender id.
    ///
    /// # Errors
    /// [`Error::InvalidName`] for a bad mutex name.
    pub fn new(factory: Arc<dyn ContendServiceFactory>, mutex: &str) -> Result<Self> {
        factory.check_mutex_name(mutex)?;
        Ok(Locker {
            slot: Slot::obtain(factory, mutex, None),
        })
    }

    /// The locker of `mutex` in this process for `factory` that contends as
    /// `contender_id` (the same one for every call with the same factory, name and id).
    ///
    /// Prefer [`Locker::new`]: with a fixed id, a new acquisition waits for the release of
    /// the previous one, but a release whose answer never came (the backend stopped
    /// answering within the request timeout) may still land later and free the next
    /// ownership under the same id. Generated ids are new for each acquisition.
    ///
    /// # Errors
    /// [`Error::InvalidName`] / [`Error::InvalidContenderId`] for bad input.
    pub fn with_contender_id(
        factory: Arc<dyn ContendServiceFactory>,
        mutex: &str,
        contender_id: impl Into<String>,
    ) -> Result<Self> {
        factory.check_mutex_name(mutex)?;
        let contender_id = contender_id.into();
        factory.check_contender_id(&contender_id)?;
        Ok(Locker {
            slot: Slot::obtain(factory, mutex, Some(contender_id)),
        })
    }

    /// The mutex.
    pub fn mutex(&self) -> &str {
        self.slot.mutex()
    }

    /// The contender id this locker was made with, if any; `None` when each acquisition
    /// generates its own (see [`LockGuard::contender_id`]).
    pub fn contender_id(&self) -> Option<&str> {
        self.slot.key.contender_id.as_deref()
    }

    /// Waits until this process owns the mutex: first for the tasks of this process that
    /// asked before (in order), then for the backend.
    ///
    /// The guard it returns holds an ownership that stands when it returns. An ownership
    /// won but already ended when this call looked at it (the process was paused between
    /// the backend's grant and this call running on, past the local lease deadline) is
    /// released and the call goes on waiting, as for any other wait.
    ///
    /// # Errors
    /// [`Error::Shutdown`] if the backend's service stopped while waiting; nothing else:
    /// backend errors are retried, not returned (bound the wait with
    /// [`Locker::acquire_timeout`]).
    ///
    /// # Cancel safety
    /// Dropping the future leaves no ownership behind, but only in the background: the
    /// contention is stopped and, if it won meanwhile, released by a spawned task (the
    /// next local waiter gets its turn when that is done). Await [`Locker::settled`]
    /// before exiting the process, or a release cut short by the exit leaves the mutex
    /// owned until its lease ends; [`Locker::acquire_timeout`] gives up without that.
    pub async fn acquire(&self) -> Result<LockGuard> {
        self.acquire_inner(Wait::Forever).await
    }

    /// Like [`Locker::acquire`], giving up after `wait`.
    ///
    /// Honest either way: it returns the guard it won, or, when it gives up, it has
    /// stopped contending and released whatever its contention took before it returns. A
    /// backend call in flight at the deadline is waited for (at most the backend's request
    /// timeout) rather than cut off, since it may be winning the mutex on the server; so
    /// the call can return somewhat after `wait`.
    ///
    /// An ownership won but already ended when the call looked at it (a pause) is
    /// released and the call goes on waiting until `wait` has passed, as
    /// [`Locker::acquire`] does.
    ///
    /// # Errors
    /// [`Error::Timeout`] when `wait` has passed without an ownership that stands (an
    /// ownership won during the give-up is released before this returns), and never
    /// before; [`Error::Shutdown`] as for `acquire`. Nothing else: backend errors are
    /// retried until the deadline.
    ///
    /// # Cancel safety
    /// As [`Locker::acquire`].
    pub async fn acquire_timeout(&self, wait: Duration) -> Result<LockGuard> {
        let until = Instant::now()
            .checked_add(wait)
            .map_or(Wait::Forever, Wait::Until);
        self.acquire_inner(until).await.map_err(|e| match e {
            Error::Timeout { mutex, .. } => Error::Timeout {
                mutex,
                waited: wait,
            },
            e => e,
        })
    }

    /// Tries once: returns a guard if the mutex could be taken by one backend attempt,
    /// without waiting for another task of this process (a release of this locker still
    /// in flight is waited for).
    ///
    /// # Errors
    /// - [`Error::WouldBlock`] when another contender owns it, or another task of this
    ///   process holds or waits for it;
    /// - [`Error::Timeout`] when the attempt won, but the ownership had already ended when
    ///   the call looked at it (the process was paused past the local lease deadline, or
    ///   the backend answered after the lease);
    /// - the backend's error when the call failed;
    /// - [`Error::Shutdown`] if the backend's service stopped.
    ///
    /// The attempt is stopped, and what it may have taken released, before this returns.
    ///
    /// # Cancel safety
    /// As [`Locker::acquire`].
    pub async fn try_acquire(&self) -> Result<LockGuard> {
        self.acquire_inner(Wait::Once).await
    }

    /// Waits until no acquisition or release through this locker is under way in this
    /// process: tasks that asked before are served (and release) first, and the
    /// background stop of a dropped acquire future or guard completes. Call it before the
    /// process exits after dropping an acquire future (on a signal, say), so that nothing
    /// that acquisition may have won stays owned.
    ///
    /// # Cancel safety
    /// Cancel safe: it only waits for its turn and gives it back at once.
    pub async fn settled(&self) {
        drop(self.slot.wait_turn().await);
    }

    fn timeout(&self, since: Instant) -> Error {
        Error::Timeout {
            mutex: self.mutex().to_owned(),
            waited: since.elapsed(),
        }
    }

    async fn acquire_inner(&self, wait: Wait) -> Result<LockGuard> {
        let slot = &self.slot;
        let started = Instant::now();
        let turn = match wait {
            Wait::Forever => slot.wait_turn().await,
            Wait::Until(at) => crate::rt::timeout_at(at, slot.wait_turn())
                .await
                .map_err(|_| self.timeout(started))?,
            Wait::Once => slot.try_turn().await.ok_or_else(|| Error::WouldBlock {
                mutex: self.mutex().to_owned(),
            })?,
        };
        self.contend(turn, wait, started).await
    }

    /// Contends through a new service per round, holding the local turn, until a round
    /// wins an ownership that still stands, or gives up as `wait` says.
    ///
    /// A round that won an ownership that had already ended when this task looked (the
    /// process was paused between the backend's grant and this task running, or the answer
    /// came back after the lease) is stopped, which releases what may be left of it, and
    /// another round starts: that win was this process's own, not another contender's
    /// hold, so it is neither a `WouldBlock` nor a reason to give up before the deadline.
    /// The next round contends under a new service, whose status knows no earlier loss.
    async fn contend(&self, mut turn: Turn, wait: Wait, started: Instant) -> Result<LockGuard> {
        let slot = &self.slot;
        let once = matches!(wait, Wait::Once);
        loop {
            let contender_id = slot
                .key
                .contender_id
                .clone()
                .unwrap_or_else(generate_contender_id);
            let service = match slot
                .factory
                .create_contend_service(self.mutex(), Arc::new(IdContender(contender_id.clone())))
            {
                Ok(s) => s,
                Err(e) => {
                    slot.end_turn(turn);
                    return Err(e);
                }
            };
            let mut status = service.status();
            if let Err(e) = service.start() {
                slot.end_turn(turn);
                return Err(e);
            }
            let mut pending = Pending {
                slot: slot.clone(),
                contention: Some((service, turn)),
            };
            // This round won (held now, or held and already lost), stopped, or (once) its
            // attempt came back.
            let done = |s: &ContenderStatus| {
                s.held.is_some() || s.last_loss.is_some() || !s.running || (once && s.attempts > 0)
            };
            let timed_out = match wait {
                Wait::Until(at) => crate::rt::timeout_at(at, status.wait_for(done))
                    .await
                    .is_err(),
                Wait::Forever | Wait::Once => {
                    let _ = status.wait_for(done).await;
                    false
                }
            };
            // Won, even if at the very deadline: return it.
            let snapshot = status.borrow().clone();
            if let Some(held) = snapshot.held.filter(|h| held_with(&snapshot, h.fence))
                && let Some((service, turn)) = pending.contention.take()
            {
                return Ok(LockGuard::start(
                    slot.clone(),
                    service,
                    turn,
                    status,
                    held.fence,
                    contender_id,
                ));
            }
            let won = snapshot.held.is_some() || snapshot.last_loss.is_some();
            let deadline_passed = match wait {
                Wait::Until(at) => timed_out || Instant::now() >= at,
                Wait::Forever | Wait::Once => false,
            };
            if won && snapshot.running && !once && !deadline_passed {
                tracing::warn!(
                    mutex = self.mutex(),
                    contender = %contender_id,
                    "acquired, but the ownership had ended before the acquirer could use it \
                     (the process was paused, or the backend answered after the lease): \
                     releasing it and contending again"
                );
                match pending.stop_keeping_turn().await {
                    Some(t) => {
                        turn = t;
                        continue;
                    }
                    None => {
                        return Err(Error::InvalidState(
                            "locker: the contention vanished while restarting".to_owned(),
                        ));
                    }
                }
            }
            // Giving up: whatever the contention takes from here on is released before the
            // answer goes back.
            pending.give_up().await;
            return Err(if deadline_passed || (once && won) {
                self.timeout(started)
            } else if !snapshot.running {
                Error::Shutdown {
                    mutex: self.mutex().to_owned(),
                }
            } else if let Some(message) = snapshot.last_error {
                Error::Backend {
                    backend: slot.factory.backend(),
                    message,
                    retryable: true,
                    source: None,
                }
            } else {
                Error::WouldBlock {
                    mutex: self.mutex().to_owned(),
                }
            });
        }
    }
}

/// Stops the service when the guard goes or when the ownership is lost (so that a locker
/// never re-acquires behind its user's back), then passes the turn on and says so.
///
/// The guard's stop message may carry an instant to keep the mutex held until (a release
/// with [`LockGuard::release_holding_until`]); the outcome of applying it is sent back.
#[allow(clippy::too_many_arguments)]
async fn watch_hold(
    slot: Arc<Slot>,
    service: Arc<dyn ContendService>,
    turn: Turn,
    mut status: watch::Receiver<ContenderStatus>,
    fence: u64,
    stop: oneshot::Receiver<Option<Instant>>,
    done: oneshot::Sender<Result<()>>,
) {
    let hold = tokio::select! {
        until = stop => until.ok().flatten(),
        _ = status.wait_for(|s| !held_with(s, fence)) => None,
    };
    slot.releasing();
    // The model checker's mutation (tests only) passes the turn on before the release.
    #[cfg(test)]
    let turn = mutation::early_turn(&slot, turn);
    #[cfg(not(test))]
    let turn = Some(turn);
    let outcome = match hold {
        Some(until) => match service.stop_holding_until(until).await {
            Ok(()) => {
                let _ = status.wait_for(|s| !s.running).await;
                Ok(())
            }
            Err(e) => {
                // Not held (ZooKeeper has no leases, or the call failed): a release.
                tracing::warn!(mutex = slot.mutex(), "keeping the mutex held failed: {e}");
                stop_fully(&service).await;
                Err(e)
            }
        },
        None => {
            stop_fully(&service).await;
            // A release that found the mutex no longer ours published the loss it found
            // (`OwnershipTracker::lost_at_release`) before the service stopped.
            match ended_with(&status.borrow(), fence) {
                Some(reason) => Err(Error::Lost {
                    mutex: slot.mutex().to_owned(),
                    reason,
                }),
                None => Ok(()),
            }
        }
    };
    if let Some(turn) = turn {
        slot.end_turn(turn);
    }
    let _ = done.send(outcome);
}

/// Signals `service` to stop without waiting for it: its stop future is polled once (a
/// [`ContendService::stop`] is signalled by then) and dropped; whoever waits for the stop
/// waits on the service's status.
fn signal_stop(service: &Arc<dyn ContendService>) {
    let mut stop = service.stop();
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let _ = std::future::Future::poll(stop.as_mut(), &mut cx);
}

/// Whether the ownership with `fence` stands.
fn held_with(s: &ContenderStatus, fence: u64) -> bool {
    s.running
        && s.owns_now()
        && s.held.is_some_and(|h| h.fence == fence)
        && s.last_loss.is_none_or(|l| l.fence != fence)
}

/// How the ownership with `fence` ended, when not by its release: the loss published for
/// it ([`LossReason::Released`] is no loss).
fn ended_with(s: &ContenderStatus, fence: u64) -> Option<LossReason> {
    s.last_loss
        .filter(|l| l.fence == fence && l.reason != LossReason::Released)
        .map(|l| l.reason)
}

/// Why the ownership with `fence` is not held (given that it is not).
fn loss_reason(s: &ContenderStatus, fence: u64) -> LossReason {
    match (s.last_loss, s.held) {
        (Some(loss), _) if loss.fence == fence => loss.reason,
        // The deadline passed before the service's task said so.
        (_, Some(h)) if h.fence == fence && s.running => LossReason::LeaseExpired,
        (_, Some(_)) => LossReason::TakenOver,
        _ => LossReason::Released,
    }
}

/// Proof of ownership of a mutex, from [`Locker::acquire`].
///
/// Dropping it releases in the background (best effort; the lease frees the mutex anyway);
/// the next acquisition through the locker starts when that release is done. Prefer
/// [`LockGuard::release`], which waits for the release and says whether the ownership had
/// already ended (before the call, or as the release found it on the backend).
pub struct LockGuard {
    slot: Arc<Slot>,
    /// The service of this ownership: a release signals its stop from the releasing task
    /// itself (the watcher follows), so the backend release is one task hop away.
    service: Arc<dyn ContendService>,
    contender_id: String,
    fence: u64,
    status: watch::Receiver<ContenderStatus>,
    /// When the acquisition returned (local clock): where `release_at_least` counts from.
    acquired: Instant,
    /// Tells the watcher to release, or to keep the mutex held until the instant given.
    stop: Option<oneshot::Sender<Option<Instant>>>,
    done: Option<oneshot::Receiver<Result<()>>>,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("mutex", &self.mutex())
            .field("fence", &self.fence)
            .field("held", &self.is_held())
            .finish()
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            // Marked before the watcher runs, so that a `try_acquire` right after the drop
            // waits for this release rather than calling the mutex held.
            self.slot.releasing();
            // The service's task releases on the backend as soon as it hears the stop:
            // signalled here rather than by the watcher, which still holds the turn until
            // the release is done and passes it on.
            signal_stop(&self.service);
            let _ = stop.send(None);
        }
    }
}

impl LockGuard {
    fn start(
        slot: Arc<Slot>,
        service: Arc<dyn ContendService>,
        turn: Turn,
        status: watch::Receiver<ContenderStatus>,
        fence: u64,
        contender_id: String,
    ) -> Self {
        let (stop_tx, stop_rx) = oneshot::channel();
        let (done_tx, done_rx) = oneshot::channel();
        crate::rt::spawn(watch_hold(
            slot.clone(),
            service.clone(),
            turn,
            status.clone(),
            fence,
            stop_rx,
            done_tx,
        ));
        #[cfg(feature = "bench")]
        crate::hops::record(crate::hops::Hop::GuardReturned, slot.mutex());
        LockGuard {
            slot,
            service,
            contender_id,
            fence,
            status,
            acquired: Instant::now(),
            stop: Some(stop_tx),
            done: Some(done_rx),
        }
    }

    /// The fencing token of this ownership: pass it to the resource you protect, which
    /// should reject writes carrying a smaller token than one it has seen.
    pub fn fence(&self) -> u64 {
        self.fence
    }

    /// The mutex.
    pub fn mutex(&self) -> &str {
        self.slot.mutex()
    }

    /// The contender id this ownership was acquired under (the backend's owner id).
    pub fn contender_id(&self) -> &str {
        &self.contender_id
    }

    /// Whether the ownership still stands. Checks the local lease deadline itself, so a
    /// process that was paused past its lease sees `false` at once on waking, before its
    /// background task has run. Check it right before each write to a shared resource,
    /// and send the [fence](LockGuard::fence) along.
    pub fn is_held(&self) -> bool {
        held_with(&self.status.borrow(), self.fence)
    }

    /// How much longer this process may act as owner without another successful renewal:
    /// the time left until the local lease deadline. `Some(ZERO)` once lost; `None` when
    /// the backend gives no deadline.
    pub fn valid_for(&self) -> Option<Duration> {
        let status = self.status.borrow();
        if !held_with(&status, self.fence) {
            return Some(Duration::ZERO);
        }
        status
            .deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Whether renewals are failing (the ownership stands until its local deadline, but
    /// the holder should not start new work).
    pub fn is_suspect(&self) -> bool {
        self.status
            .borrow()
            .held
            .is_some_and(|x| x.fence == self.fence && x.suspect)
    }

    /// A receiver of the status of the contender behind this guard: it changes when the
    /// ownership turns suspect or recovers ([`is_suspect`](Self::is_suspect)), when the
    /// local deadline moves, and when the ownership ends. For watching, not for deciding:
    /// [`is_held`](Self::is_held) is the check before a write.
    pub fn status(&self) -> watch::Receiver<ContenderStatus> {
        self.status.clone()
    }

    /// Resolves when the ownership ends, with the reason.
    ///
    /// # Cancel safety
    /// Cancel safe: it only observes.
    pub async fn lost(&self) -> LossReason {
        let mut status = self.status.clone();
        let fence = self.fence;
        match status.wait_for(|s| !held_with(s, fence)).await {
            Ok(s) => loss_reason(&s, fence),
            Err(_) => LossReason::Released,
        }
    }

    /// Releases the mutex on the backend and waits for that (bounded by the backend's
    /// request timeout; a release that fails or times out is logged, and the lease frees
    /// the mutex).
    ///
    /// # Errors
    /// [`Error::Lost`] with the reason when the ownership had ended before it was released,
    /// so that the work done under this guard may have overlapped another owner's:
    /// - it had ended before this call (lease expired, taken over, backend session lost);
    /// - or the release itself found the mutex no longer this contender's on the backend:
    ///   taken over, deleted, or changed by hand (a row's `owner_id`, a key's value, a
    ///   node gone or rewritten). The reason is then [`LossReason::TakenOver`]
    ///   ([`LossReason::LeaseExpired`] if the local lease deadline had passed too), and
    ///   the guard's [`status`](Self::status) shows that loss as its `last_loss`.
    ///
    /// Never `Ok` after either. A release that fails or gets no answer within the request
    /// timeout proves neither: it is logged and this returns `Ok` (the lease frees the
    /// mutex). The mutex is released all the same.
    ///
    /// # Cancel safety
    /// Dropping the future still releases, in the background.
    pub async fn release(mut self) -> Result<()> {
        let lost = self.lost_now();
        let done = self.done.take();
        // Dropping `self` signals the watcher, which stops the service (releasing remotely).
        let mutex = self.mutex().to_owned();
        drop(self);
        let found = match done {
            Some(done) => done.await.ok().and_then(Result::err),
            None => None,
        };
        match (lost, found) {
            (Some(reason), _) => Err(Error::Lost { mutex, reason }),
            (None, Some(e @ Error::Lost { .. })) => Err(e),
            (None, _) => Ok(()),
        }
    }

    /// Whether the ownership had ended, and why.
    fn lost_now(&self) -> Option<LossReason> {
        let status = self.status.borrow();
        (!held_with(&status, self.fence)).then(|| loss_reason(&status, self.fence))
    }

    /// Releases so that the mutex stays held until `until` (ShedLock's `lockAtLeastFor`):
    /// nobody — this process included — can take it before then, and nothing renews it.
    /// Typical use: a job that several hosts run on a schedule, which must run once per
    /// period even when it finishes early and the hosts' clocks disagree. An `until` that
    /// has passed is a plain [`release`](LockGuard::release).
    ///
    /// The backend is told the time left (`until - now` on this process's monotonic
    /// clock) and adds it to its own clock, so no wall clock of this process matters.
    /// Local waiters of this process wait for the hold too.
    ///
    /// # Errors
    /// - [`Error::Lost`] when the ownership had ended before: nothing was held (the
    ///   mutex is released as by [`release`](LockGuard::release));
    /// - [`Error::Unsupported`] on ZooKeeper (sessions, not leases): the mutex is then
    ///   released as by [`release`](LockGuard::release);
    /// - [`Error::Backend`] when the backend call failed: the ownership then ends with its
    ///   current lease, maybe before `until`;
    /// - [`Error::InvalidConfig`] for a hold longer than a year (the mutex is then
    ///   released as by [`release`](LockGuard::release)).
    ///
    /// # Cancel safety
    /// Dropping the future after the first poll still applies the hold, in the background.
    pub async fn release_holding_until(mut self, until: Instant) -> Result<()> {
        if let Some(reason) = self.lost_now() {
            let mutex = self.mutex().to_owned();
            let _ = self.release().await;
            return Err(Error::Lost { mutex, reason });
        }
        let done = self.done.take();
        if let Some(stop) = self.stop.take() {
            self.slot.releasing();
            let _ = stop.send(Some(until));
        }
        drop(self);
        match done {
            Some(done) => done.await.unwrap_or(Ok(())),
            None => Ok(()),
        }
    }

    /// Releases so that the mutex stays held until `at_least` after it was acquired
    /// (counted from when the acquisition returned, on this process's clock), like
    /// ShedLock's `lockAtLeastFor`. See
    /// [`release_holding_until`](LockGuard::release_holding_until).
    ///
    /// # Errors
    /// As [`release_holding_until`](LockGuard::release_holding_until).
    ///
    /// # Cancel safety
    /// As [`release_holding_until`](LockGuard::release_holding_until).
    pub async fn release_at_least(self, at_least: Duration) -> Result<()> {
        // An `at_least` so long that the instant overflows is over a year: the store's
        // check of the hold rejects it.
        let until = self
            .acquired
            .checked_add(at_least)
            .unwrap_or_else(|| Instant::now() + crate::MAX_DURATION * 2);
        self.release_holding_until(until).await
    }

    /// When this guard's acquisition returned, on this process's monotonic clock.
    pub fn acquired_at(&self) -> Instant {
        self.acquired
    }
}

/// Mutations for the model-checked tests (`crate::model`), off unless a test sets them.
#[cfg(test)]
pub(crate) mod mutation {
    use std::cell::Cell;

    use super::{Slot, Turn};

    thread_local! {
        /// Re-creates the same-fence race: the turn passes on as soon as the guard goes,
        /// before the release of its ownership has completed.
        pub(crate) static EARLY_TURN: Cell<bool> = const { Cell::new(false) };
    }

    pub(super) fn early_turn(slot: &Slot, turn: Turn) -> Option<Turn> {
        if EARLY_TURN.get() {
            slot.end_turn(turn);
            None
        } else {
            Some(turn)
        }
    }
}
