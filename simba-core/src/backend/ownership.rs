//! [`ServiceStatus`] and [`OwnershipTracker`]: the ownership state machine and status
//! publisher every contend and retrieval service shares.

use std::fmt;
use std::sync::{Arc, Mutex as StdMutex, MutexGuard, PoisonError};

use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::error::LossReason;
use crate::metrics::{FailureKind, Labels};
use crate::owner::{MutexOwner, MutexState};
use crate::service::{Contender, ContenderStatus, Held, Loss, MutexRetriever};

/// Whom a service reports ownership changes to.
#[derive(Clone)]
pub enum Reporter {
    /// A contend service: [`Contender::on_acquired`] / [`Contender::on_released`].
    Contender(Arc<dyn Contender>),
    /// A retrieval service: [`MutexRetriever::on_changed`].
    Retriever(Arc<dyn MutexRetriever>),
}

impl fmt::Debug for Reporter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Reporter::Contender(_) => "Reporter::Contender",
            Reporter::Retriever(_) => "Reporter::Retriever",
        })
    }
}

/// The published side of one service: its [`ContenderStatus`], the last owner change it
/// saw, and whom it reports to.
///
/// A service keeps one for its whole life (restarts keep the channels, so receivers taken
/// before a restart go on working) and hands each run of its driver an
/// [`OwnershipTracker`] from [`begin`](ServiceStatus::begin). Cloning shares the channels.
#[derive(Debug, Clone)]
pub struct ServiceStatus {
    status: watch::Sender<ContenderStatus>,
    owner_state: Arc<StdMutex<OwnerState>>,
    reporter: Reporter,
    identity: Arc<Identity>,
}

/// The last owner change seen: the value alone until someone asks for a receiver
/// ([`ServiceStatus::owner_state`]), then a `watch` channel made from it. A `watch` costs
/// about 460 bytes, and most services (every one a [`Locker`](crate::Locker) holds) never
/// hand one out. Every read and write goes through the one lock, so the channel made
/// starts from the latest value and misses no update.
#[derive(Debug)]
enum OwnerState {
    Value(MutexState),
    Channel(watch::Sender<MutexState>),
}

impl OwnerState {
    /// Replaces the value and notifies receivers.
    fn replace(&mut self, state: MutexState) {
        match self {
            OwnerState::Value(v) => *v = state,
            OwnerState::Channel(tx) => {
                tx.send_replace(state);
            }
        }
    }

    /// Sets the times of the owner after the change (a renewal), without notifying.
    fn refresh_after(&mut self, after: &MutexOwner) {
        match self {
            OwnerState::Value(v) => v.after = after.clone(),
            OwnerState::Channel(tx) => {
                tx.send_if_modified(|s| {
                    s.after = after.clone();
                    false
                });
            }
        }
    }

    fn get<R>(&self, f: impl FnOnce(&MutexState) -> R) -> R {
        match self {
            OwnerState::Value(v) => f(v),
            OwnerState::Channel(tx) => f(&tx.borrow()),
        }
    }
}

/// Whom the metrics and the loss / suspect events of a service name.
#[derive(Debug, Default)]
struct Identity {
    backend: &'static str,
    mutex: String,
    contender: String,
    labels: Labels,
}

impl ServiceStatus {
    /// New channels (not running, no owner known) reporting to `reporter`.
    pub fn new(reporter: Reporter) -> Self {
        ServiceStatus {
            status: watch::Sender::new(ContenderStatus::default()),
            owner_state: Arc::new(StdMutex::new(OwnerState::Value(MutexState::default()))),
            reporter,
            identity: Arc::default(),
        }
    }

    /// Names the service in its metrics ([`crate::metrics`]: label `backend`, and label
    /// `mutex` when `mutex_label` is set) and in the fields of its loss and suspect
    /// events (`backend`, `mutex`, `contender`). A backend calls it once, right after
    /// [`new`](Self::new); without it the metrics say `backend="unknown"`.
    pub fn with_identity(
        mut self,
        backend: &'static str,
        mutex: &str,
        contender: &str,
        mutex_label: bool,
    ) -> Self {
        self.identity = Arc::new(Identity {
            backend,
            mutex: mutex.to_owned(),
            contender: contender.to_owned(),
            labels: Labels::new(backend, mutex_label.then_some(mutex)),
        });
        self
    }

    /// The backend that names the service ([`with_identity`](Self::with_identity);
    /// `"unknown"` without it).
    pub fn backend(&self) -> &'static str {
        if self.identity.backend.is_empty() {
            "unknown"
        } else {
            self.identity.backend
        }
    }

    /// The mutex of the service ([`with_identity`](Self::with_identity)).
    pub fn mutex(&self) -> &str {
        &self.identity.mutex
    }

    /// The contender id of the service ([`with_identity`](Self::with_identity)); empty for
    /// a retrieval service that has none.
    pub fn contender_id(&self) -> &str {
        &self.identity.contender
    }

    /// The metric labels of this service.
    pub(crate) fn labels(&self) -> &Labels {
        &self.identity.labels
    }

    /// Whether this service contends (rather than only observes).
    pub fn contends(&self) -> bool {
        matches!(self.reporter, Reporter::Contender(_))
    }

    /// A receiver of the status ([`ContendService::status`](crate::ContendService::status)).
    pub fn status(&self) -> watch::Receiver<ContenderStatus> {
        self.status.subscribe()
    }

    /// A receiver of the last owner change seen
    /// ([`RetrievalService::state`](crate::RetrievalService::state)).
    pub fn owner_state(&self) -> watch::Receiver<MutexState> {
        let mut state = self.lock_owner_state();
        match &mut *state {
            OwnerState::Channel(tx) => tx.subscribe(),
            OwnerState::Value(v) => {
                let (tx, rx) = watch::channel(std::mem::take(v));
                *state = OwnerState::Channel(tx);
                rx
            }
        }
    }

    fn lock_owner_state(&self) -> MutexGuard<'_, OwnerState> {
        // Nothing panics while it is held but an allocation failure; the state is whole
        // after every statement.
        self.owner_state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The status now.
    pub fn current(&self) -> ContenderStatus {
        self.status.borrow().clone()
    }

    /// The last owner change seen, now.
    pub fn current_owner(&self) -> MutexState {
        self.lock_owner_state().get(MutexState::clone)
    }

    /// Starts a run of the service's driver: publishes `running`, clears `held`,
    /// `deadline`, `attempts` and `last_error` (the last owner change and the last loss
    /// stay), and returns the tracker the driver reports through.
    /// [`ServiceHandle::start`](super::ServiceHandle::start) calls it (a service built on
    /// a bare [`ServiceRunner`](super::ServiceRunner) calls it from the
    /// [`ServiceRunner::start`](super::ServiceRunner::start) closure), so that the status
    /// says "running" when `start` returns.
    pub fn begin(&self) -> OwnershipTracker {
        self.status.send_modify(|s| {
            s.running = true;
            s.held = None;
            s.deadline = None;
            s.attempts = 0;
            s.last_error = None;
        });
        OwnershipTracker {
            out: self.clone(),
            known: self.lock_owner_state().get(|s| s.after.clone()),
            owned: None,
            contending_since: Instant::now(),
            handoff_from: None,
        }
    }
}

struct Owned {
    fence: u64,
    suspect: bool,
    deadline: Option<Instant>,
}

/// The ownership state machine of one run of a service's driver, and the only writer of
/// its status.
///
/// A backend's driver decides *what* happened (it answered: this owner; the call failed;
/// our node is gone; the deadline passed); the tracker turns that into callbacks and
/// status updates in the order the [`ContendService`](crate::ContendService) contract
/// promises:
///
/// - **callback before status**: `on_acquired` runs before `held` becomes `Some`,
///   `on_released` before `held` becomes `None` and `last_loss` is set, so whoever waits
///   on the status sees what the callback did;
/// - a retriever's `on_changed` runs before the status and the owner state show the change;
/// - [`count_attempt`](OwnershipTracker::count_attempt) after the effects of a call, so a
///   watcher that sees the count also sees the outcome;
/// - at the end of the run (dropped, or [`finish`](OwnershipTracker::finish)): a still
///   owned mutex is reported `Released` (by `finish`), then `running`, `held` and
///   `deadline` are cleared.
///
/// It also records the ownership metrics of [`crate::metrics`] (acquisitions, losses,
/// suspect episodes, the held gauge, the acquire and handoff waits, backend errors), so
/// that every backend reports the same numbers, and logs losses and suspect episodes at
/// WARN with the fields `backend`, `mutex`, `contender` and `fence`.
///
/// What it does not do: call the backend, keep time, or decide when an ownership ended —
/// a driver calls [`lose`](OwnershipTracker::lose) when its deadline passes, its node
/// vanished, or another owner answered.
pub struct OwnershipTracker {
    out: ServiceStatus,
    known: MutexOwner,
    owned: Option<Owned>,
    /// Since when this run contends without owning (its start, or the end of its last
    /// ownership): the start of the acquire wait.
    contending_since: Instant,
    /// When the backend told this waiter that the owner let go
    /// ([`handoff_begins`](OwnershipTracker::handoff_begins)).
    handoff_from: Option<Instant>,
}

impl fmt::Debug for OwnershipTracker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnershipTracker")
            .field("known", &self.known)
            .field("held", &self.held())
            .field("deadline", &self.deadline())
            .finish()
    }
}

impl OwnershipTracker {
    /// The channels this tracker publishes to.
    pub fn service_status(&self) -> &ServiceStatus {
        &self.out
    }

    /// The owner last seen (by [`observe`](Self::observe), [`hold`](Self::hold) or
    /// [`lose`](Self::lose)).
    pub fn known(&self) -> &MutexOwner {
        &self.known
    }

    /// What this run owns, if anything.
    pub fn held(&self) -> Option<Held> {
        self.owned.as_ref().map(|o| Held {
            fence: o.fence,
            suspect: o.suspect,
        })
    }

    /// Whether this run owns the mutex (deadline not checked: the driver's job).
    pub fn is_held(&self) -> bool {
        self.owned.is_some()
    }

    /// The local deadline of the current ownership, as last given to
    /// [`hold`](Self::hold) or [`set_deadline`](Self::set_deadline).
    pub fn deadline(&self) -> Option<Instant> {
        self.owned.as_ref().and_then(|o| o.deadline)
    }

    /// The most recent loss published (this run or an earlier one).
    pub fn last_loss(&self) -> Option<Loss> {
        self.out.status.borrow().last_loss
    }

    /// Records `owner` as the owner seen now. A change (another owner id or fence) goes to
    /// the owner state, to the retriever (a retrieval service) and to the status; the same
    /// owner again (a renewal) only refreshes its times in the owner state, without
    /// notifying anyone. Returns the change.
    pub fn observe(&mut self, owner: MutexOwner) -> MutexState {
        let state = MutexState::new(std::mem::replace(&mut self.known, owner.clone()), owner);
        if state.is_changed() {
            debug!(owner = %state.after.owner_id, fence = state.after.fence, "owner changed");
            self.out.lock_owner_state().replace(state.clone());
            if let Reporter::Retriever(r) = &self.out.reporter {
                r.on_changed(&state);
            }
            self.out.status.send_modify(|s| s.state = state.clone());
        } else {
            self.out.lock_owner_state().refresh_after(&state.after);
        }
        state
    }

    /// The backend confirmed that this contender owns the mutex as `owner` (its fence is
    /// the ownership's), and this process may believe so until `deadline` (`None`: no local
    /// deadline). Returns whether the ownership is new.
    ///
    /// - A new ownership: observes `owner`, calls `on_acquired` with the change, then
    ///   publishes `held` (not suspect), `deadline` and the state.
    /// - The same fence again (a renewal, a re-check): moves the deadline, clears
    ///   *suspect*, and publishes them.
    /// - Another fence while owning: the earlier ownership ended unseen in between; it is
    ///   reported lost ([`LossReason::LeaseExpired`]) before the new one is reported.
    pub fn hold(&mut self, owner: MutexOwner, deadline: Option<Instant>) -> bool {
        let fence = owner.fence;
        if self.owned.as_ref().is_some_and(|o| o.fence != fence) {
            self.lose(LossReason::LeaseExpired, MutexOwner::NONE);
        }
        let newly = match &mut self.owned {
            Some(o) => {
                if o.suspect {
                    info!(
                        fence,
                        "the backend answers again: ownership no longer suspect"
                    );
                }
                o.suspect = false;
                o.deadline = deadline;
                false
            }
            None => {
                self.owned = Some(Owned {
                    fence,
                    suspect: false,
                    deadline,
                });
                true
            }
        };
        let state = self.observe(owner.clone());
        if newly {
            let now = Instant::now();
            let wait = now.saturating_duration_since(self.contending_since);
            let handoff = self
                .handoff_from
                .take()
                .map(|t| now.saturating_duration_since(t));
            self.out.identity.labels.acquired(wait, handoff);
            info!(fence, ?wait, "acquired");
            let state = if state.is_changed() {
                state
            } else {
                MutexState::new(MutexOwner::NONE, owner)
            };
            if let Reporter::Contender(c) = &self.out.reporter {
                c.on_acquired(&state);
            }
            self.publish_held(&state);
        } else {
            debug!(fence, "renewed");
            self.publish_held(&state);
        }
        newly
    }

    fn publish_held(&self, state: &MutexState) {
        let held = self.held();
        let deadline = self.deadline();
        let changed = state.is_changed();
        self.out.status.send_modify(|s| {
            s.held = held;
            s.deadline = deadline;
            if changed {
                s.state = state.clone();
            }
        });
    }

    /// Moves the local deadline of the current ownership (a backend whose deadline follows
    /// its session rather than each renewal). Published only while owning and when it
    /// changed.
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        let Some(o) = &mut self.owned else {
            return;
        };
        if o.deadline == deadline {
            return;
        }
        o.deadline = deadline;
        self.out.status.send_if_modified(|s| {
            if s.held.is_some() && s.deadline != deadline {
                s.deadline = deadline;
                true
            } else {
                false
            }
        });
    }

    /// The backend does not answer while this contender owns: the ownership stands until
    /// its deadline but is *suspect* ([`Held::suspect`]) until [`hold`](Self::hold) says
    /// otherwise. `why` goes into the warning logged the first time. Returns whether the
    /// ownership became suspect now (false: not owned, or suspect already).
    pub fn mark_suspect(&mut self, why: &dyn fmt::Display) -> bool {
        let Some(o) = &mut self.owned else {
            return false;
        };
        if o.suspect {
            return false;
        }
        let id = &self.out.identity;
        warn!(
            backend = id.backend,
            mutex = %id.mutex,
            contender = %id.contender,
            fence = o.fence,
            "{why}: ownership suspect until the backend answers again"
        );
        id.labels.suspect();
        o.suspect = true;
        let held = Held {
            fence: o.fence,
            suspect: true,
        };
        self.out.status.send_modify(|s| s.held = Some(held));
        true
    }

    /// Ends this process's ownership for `reason`; `after` is the owner known afterwards
    /// ([`MutexOwner::NONE`] when unknown). Calls `on_released`, then publishes `held =
    /// None`, `last_loss` and the state. Returns the loss, or `None` when nothing was
    /// owned (then nothing happens).
    pub fn lose(&mut self, reason: LossReason, after: MutexOwner) -> Option<Loss> {
        let owned = self.owned.take()?;
        let id = &self.out.identity;
        match reason {
            LossReason::Released => info!(fence = owned.fence, "released"),
            _ => warn!(
                backend = id.backend,
                mutex = %id.mutex,
                contender = %id.contender,
                fence = owned.fence,
                reason = crate::metrics::reason_label(reason),
                "ownership lost: {reason}"
            ),
        }
        id.labels.lost(reason);
        self.contending_since = Instant::now();
        self.handoff_from = None;
        let state = MutexState::new(
            std::mem::replace(&mut self.known, after),
            self.known.clone(),
        );
        if state.is_changed() {
            self.out.lock_owner_state().replace(state.clone());
        }
        let loss = Loss {
            fence: owned.fence,
            reason,
        };
        if let Reporter::Contender(c) = &self.out.reporter {
            c.on_released(&state, reason);
        }
        self.out.status.send_modify(|s| {
            s.held = None;
            s.deadline = None;
            s.last_loss = Some(loss);
            s.state = state.clone();
        });
        Some(loss)
    }

    /// The release of the ownership with `fence`, reported [`LossReason::Released`] when
    /// it began, found that the backend no longer had the mutex as this contender's: taken
    /// over, deleted, or changed by hand. The ownership had ended before, unseen, and the
    /// work done under it may have overlapped another owner's. Replaces that fence's
    /// `last_loss` with `reason` (a [`LockGuard::release`](crate::LockGuard::release)
    /// then returns [`Error::Lost`](crate::Error::Lost), and its `lost()` says `reason`),
    /// logs it at WARN and counts it in [`LOSSES`](crate::metrics::LOSSES).
    /// `on_released` is not called again: it ran, with `Released`, when the release began.
    ///
    /// Call it only on the backend's answer that the ownership is not this contender's —
    /// never on an error or a timeout, which prove nothing — and only for an ownership this
    /// run held until the release (not for an acquisition whose answer never came).
    /// Returns whether it changed anything (false: the last loss is not that release's).
    pub fn lost_at_release(&mut self, fence: u64, reason: LossReason) -> bool {
        let released = Loss {
            fence,
            reason: LossReason::Released,
        };
        if self.last_loss() != Some(released) || reason == LossReason::Released {
            return false;
        }
        let id = &self.out.identity;
        warn!(
            backend = id.backend,
            mutex = %id.mutex,
            contender = %id.contender,
            fence,
            reason = crate::metrics::reason_label(reason),
            "the release found the mutex no longer this contender's: ownership lost before \
             the release ({reason}); the work done under it may have run unprotected"
        );
        id.labels.lost_at_release(reason);
        self.out
            .status
            .send_modify(|s| s.last_loss = Some(Loss { fence, reason }));
        true
    }

    /// Counts one completed backend call (an answer or an error) and records its error.
    /// Call it after the call's effects were published
    /// ([`ContenderStatus::attempts`]). A failed call is better counted with
    /// [`count_failure`](Self::count_failure), which records its kind in the metrics too.
    pub fn count_attempt(&self, error: Option<String>) {
        self.out.status.send_modify(|s| {
            s.attempts += 1;
            s.last_error = error;
        });
    }

    /// Counts one failed backend call, like `count_attempt(Some(error))`, and records it
    /// in [`BACKEND_ERRORS`](crate::metrics::BACKEND_ERRORS) as `kind`.
    pub fn count_failure(&self, kind: FailureKind, error: String) {
        self.record_failure(kind);
        self.count_attempt(Some(error));
    }

    /// Records a failed backend call in the metrics only (a call that is not an attempt,
    /// such as the release at stop).
    pub fn record_failure(&self, kind: FailureKind) {
        self.out.identity.labels.failure(kind);
    }

    /// The backend told this waiter that the owner let go (a pushed release, a fired watch
    /// on the owner's node): if this run acquires next, the time from now is recorded as
    /// its handoff wait ([`HANDOFF_WAIT`](crate::metrics::HANDOFF_WAIT)). Ignored while
    /// owning, and when an earlier word is still pending.
    pub fn handoff_begins(&mut self) {
        if self.owned.is_none() && self.handoff_from.is_none() {
            self.handoff_from = Some(Instant::now());
        }
    }

    /// Another contender took the mutex after [`handoff_begins`](Self::handoff_begins):
    /// that handoff was not ours; forget it.
    pub fn handoff_missed(&mut self) {
        self.handoff_from = None;
    }

    /// Ends the run: reports a still owned mutex [`LossReason::Released`], then publishes
    /// `running = false`. (Dropping the tracker publishes `running = false` too, without
    /// the callback: a driver that panicked.)
    pub fn finish(mut self) {
        self.lose(LossReason::Released, MutexOwner::NONE);
    }
}

impl Drop for OwnershipTracker {
    fn drop(&mut self) {
        if self.owned.take().is_some() {
            self.out.identity.labels.dropped();
        }
        self.out.status.send_modify(|s| {
            s.running = false;
            s.held = None;
            s.deadline = None;
        });
    }
}
