//! Contenders, retrievers, and the object-safe service and factory traits every backend
//! offers.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::error::{LossReason, Result};
use crate::owner::MutexState;

/// A boxed, `Send` future (the object-safe traits return these).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Receives ownership changes of one contend service.
///
/// Callbacks run on the service's driver task, one at a time, in order. They **must not
/// block**: hand work to another task (or use [`ContendService::status`] instead).
pub trait Contender: Send + Sync + 'static {
    /// The id this contender contends with; `None` lets the factory generate one
    /// (see [`generate_contender_id`](crate::generate_contender_id)).
    fn contender_id(&self) -> Option<String> {
        None
    }

    /// This contender became the owner. `state.after.fence` is its fencing token.
    fn on_acquired(&self, state: &MutexState) {
        let _ = state;
    }

    /// This contender stopped being the owner, for `reason`.
    fn on_released(&self, state: &MutexState, reason: LossReason) {
        let _ = (state, reason);
    }
}

/// A contender that only reports through [`ContendService::status`].
#[derive(Debug, Default, Clone, Copy)]
pub struct SilentContender;
impl Contender for SilentContender {}

/// Observes the owner of a mutex without contending.
pub trait MutexRetriever: Send + Sync + 'static {
    /// The owner changed (a renewal by the same owner is not a change).
    fn on_changed(&self, state: &MutexState);
}

/// A retriever that only reports through [`RetrievalService::state`].
#[derive(Debug, Default, Clone, Copy)]
pub struct SilentRetriever;
impl MutexRetriever for SilentRetriever {
    fn on_changed(&self, _state: &MutexState) {}
}

/// What this process holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    /// The fencing token of this ownership.
    pub fence: u64,
    /// True while renewals are failing or go unanswered (see
    /// [`LeaseConfig::request_timeout`](crate::LeaseConfig::request_timeout)): the lease
    /// still protects the ownership until its local deadline, but the holder should avoid
    /// starting new work.
    pub suspect: bool,
}

/// The most recent loss of ownership.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Loss {
    /// The fence of the ownership that ended.
    pub fence: u64,
    /// Why it ended.
    pub reason: LossReason,
}

/// Where a contend service stands, published through a `tokio::sync::watch` channel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContenderStatus {
    /// Whether the service is running (started and not stopped).
    pub running: bool,
    /// The last owner change this service observed.
    pub state: MutexState,
    /// `Some` while this contender owns the mutex.
    pub held: Option<Held>,
    /// The most recent ownership of this contender that ended.
    pub last_loss: Option<Loss>,
    /// How many backend calls (acquire, renew, read) completed since the start, with an
    /// answer or an error; counted after the call's effects were published (see the
    /// [`ContendService` contract](ContendService#contract)).
    pub attempts: u64,
    /// The error of the last failed call, cleared by the next success.
    pub last_error: Option<String>,
    /// While held: the local deadline after which this process must not believe it owns,
    /// even if the service's task has not run yet to say so (a paused process that wakes
    /// up checks this first).
    pub deadline: Option<tokio::time::Instant>,
}

impl ContenderStatus {
    /// Whether this contender owns the mutex at this instant: held, and before the local
    /// deadline.
    pub fn owns_now(&self) -> bool {
        self.held.is_some()
            && self
                .deadline
                .is_none_or(|d| tokio::time::Instant::now() < d)
    }
}

/// One contender's participation in one mutex: start, stop, and observe.
///
/// A service is restartable: `start` after `stop` contends again.
///
/// # Contract
/// What every implementation MUST do, and what [`Locker`](crate::Locker),
/// [`LockGuard`](crate::LockGuard) and [`LeaderScheduler`](crate::LeaderScheduler) rely on.
/// The status is one [`ContenderStatus`] in a `tokio::sync::watch` channel
/// ([`status`](ContendService::status)); a session-style backend gets all of the rules
/// below from [`ServiceHandle`](crate::backend::ServiceHandle) and
/// [`OwnershipTracker`](crate::backend::OwnershipTracker), which the lease engine uses too.
///
/// **Start and stop**
/// - When [`start`](ContendService::start) returns `Ok`, the status already says
///   `running`, with `held`, `deadline`, `attempts` and `last_error` cleared (`state` and
///   `last_loss` are kept from earlier runs). A second `start` while running is an
///   [`Error::InvalidState`](crate::Error::InvalidState).
/// - [`stop`](ContendService::stop) signals the stop before it returns its future; when
///   the future completes, an ownership has been reported lost with
///   [`LossReason::Released`] (callback included) and the status says `running = false`,
///   `held = None`, `deadline = None`. Dropping the service stops it in the background.
/// - A release (by `stop`) that the backend answers with "not this contender's" — the
///   mutex taken over, deleted or changed by hand while this contender believed it owned
///   it — replaces that ownership's `last_loss` reason with the loss it found
///   ([`LossReason::TakenOver`]; [`OwnershipTracker::lost_at_release`](crate::backend::OwnershipTracker::lost_at_release))
///   before `running = false` is published; `on_released` is not called again. A release
///   that fails or is not answered changes nothing, nor does one of an acquisition whose
///   answer never came. [`LockGuard::release`](crate::LockGuard::release) turns such a
///   loss into [`Error::Lost`](crate::Error::Lost).
/// - `running = false` is published last, only when the service's task is done: a
///   watcher waiting for it knows no callback will follow.
///
/// **Ownership**
/// - `held` is `Some` exactly while this contender believes it owns the mutex; its fence is
///   the ownership's fencing token and `state.after` names this contender with that fence.
///   A new ownership has a fence no earlier ownership of the mutex had.
/// - `deadline`, when `Some` while held, is the local instant after which the contender
///   must not believe it owns, even if its task has not run since
///   ([`ContenderStatus::owns_now`] checks it). The service reports the loss
///   ([`LossReason::LeaseExpired`]) at that instant by itself, without waiting for the
///   backend.
/// - `held.suspect` is true while the backend does not answer but the deadline has not
///   passed; it clears when the backend confirms the ownership again.
/// - Every end of an ownership sets `last_loss` (its fence and reason) in the same update
///   that clears `held`.
///
/// **Callback before status**
/// - [`Contender::on_acquired`] runs before `held` becomes `Some`, and
///   [`Contender::on_released`] before `held` becomes `None`: whoever sees the status
///   change also sees what the callback did. Callbacks run one at a time, in order.
///
/// **Attempts**
/// - `attempts` counts the backend round trips (acquire, renew, read, a check of the
///   recipe) that completed since `start`, with an answer or an error; it is incremented
///   after the round trip's effects (`held`, `last_loss`, `state`) are published, in a
///   later update. So `attempts > 0` means at least one complete try was made, and its
///   outcome is visible: a watcher that sees `attempts > 0` and `held = None` knows that
///   this contender did not win on its first try
///   ([`Locker::try_acquire`](crate::Locker::try_acquire) relies on this).
/// - `last_error` holds the error of the last failed round trip and is cleared by the next
///   success.
///
/// **Retrieval**
/// - A [`RetrievalService`] follows the same start and stop rules, and calls
///   [`MutexRetriever::on_changed`] before its [`state`](RetrievalService::state) shows the
///   change; a renewal by the same owner is not a change.
pub trait ContendService: Send + Sync + fmt::Debug {
    /// The mutex contended for.
    fn mutex(&self) -> &str;

    /// This contender's id.
    fn contender_id(&self) -> &str;

    /// Starts contending in the background (spawns onto the current tokio runtime).
    ///
    /// # Errors
    /// [`Error::InvalidState`](crate::Error::InvalidState) if already running or called
    /// outside a tokio runtime.
    fn start(&self) -> Result<()>;

    /// Stops contending: releases the mutex on the backend if owned, reports
    /// `on_released(.., Released)`, and waits for the background task to end. A release
    /// that finds the mutex no longer this contender's says so in the status's `last_loss`
    /// (see the [contract](ContendService#contract)).
    ///
    /// # Errors
    /// Never fails today; the remote release is best effort and bounded in time (the lease
    /// frees the mutex anyway).
    ///
    /// # Cancel safety
    /// Dropping the future after the first poll still stops the service; the release then
    /// finishes in the background.
    fn stop(&self) -> BoxFuture<'_, Result<()>>;

    /// Stops contending like [`stop`](ContendService::stop), but if this contender owns
    /// the mutex, keeps it held until `until` (ShedLock's `lockAtLeastFor`): the backend
    /// is told, owner-checked and atomically, to end the ownership `until - now` from its
    /// own `now`, and nobody — this contender included — can renew or take it before that
    /// (see [`LeaseStore::release_after`](crate::backend::LeaseStore::release_after)). An `until`
    /// already past is a plain release.
    ///
    /// # Errors
    /// - [`Error::Lost`](crate::Error::Lost) when the ownership had already ended (or never
    ///   began): nothing was held;
    /// - [`Error::Unsupported`](crate::Error::Unsupported) on a backend that has no leases
    ///   (ZooKeeper); the service then keeps running: call `stop` to release;
    /// - [`Error::Backend`](crate::Error::Backend) when the backend call failed or did not
    ///   answer: the ownership is then neither renewed nor released, so it ends when its
    ///   current lease does — maybe before `until`;
    /// - [`Error::Shutdown`](crate::Error::Shutdown) when the service was not running.
    ///
    /// # Cancel safety
    /// Dropping the future after the first poll still stops the service and applies the
    /// hold in the background.
    fn stop_holding_until(&self, until: tokio::time::Instant) -> BoxFuture<'_, Result<()>> {
        let _ = until;
        Box::pin(async { Err(unsupported_hold("this backend")) })
    }

    /// A receiver of this service's status.
    fn status(&self) -> watch::Receiver<ContenderStatus>;

    /// Whether this contender owns the mutex now (see [`ContenderStatus::owns_now`]).
    fn is_owner(&self) -> bool {
        self.status().borrow().owns_now()
    }
}

pub(crate) fn unsupported_hold(backend: &'static str) -> crate::Error {
    crate::Error::unsupported(
        backend,
        "hold-at-least",
        "this backend cannot keep a released mutex held (it has no leases); release it \
         instead",
    )
}

/// Observes one mutex without contending.
///
/// An observer is pushed where the backend pushes (Redis pub/sub, PostgreSQL NOTIFY,
/// ZooKeeper watches) and reads at a bounded interval otherwise: an idle observer costs a
/// few reads per lease, never a loop.
pub trait RetrievalService: Send + Sync + fmt::Debug {
    /// The mutex observed.
    fn mutex(&self) -> &str;

    /// Starts observing in the background.
    ///
    /// # Errors
    /// [`Error::InvalidState`](crate::Error::InvalidState) if already running.
    fn start(&self) -> Result<()>;

    /// Stops observing.
    ///
    /// # Errors
    /// Never fails today.
    ///
    /// # Cancel safety
    /// Dropping the future still stops the service.
    fn stop(&self) -> BoxFuture<'_, Result<()>>;

    /// A receiver of the last observed owner change.
    fn state(&self) -> watch::Receiver<MutexState>;
}

/// Makes contend and retrieval services for one backend. Object-safe, so a program can
/// choose the backend at run time (`Arc<dyn ContendServiceFactory>`).
///
/// A backend implements it through [`ServiceFactory`](crate::backend::ServiceFactory),
/// which gives the defaults of the checks below and boxes the services.
pub trait ContendServiceFactory: Send + Sync + fmt::Debug {
    /// The backend's name.
    fn backend(&self) -> &'static str;

    /// Whether this backend can keep a released mutex held for a while
    /// ([`ContendService::stop_holding_until`], [`LockGuard::release_holding_until`](crate::LockGuard::release_holding_until)).
    ///
    /// # Errors
    /// [`Error::Unsupported`](crate::Error::Unsupported) saying why not (ZooKeeper has
    /// sessions, not leases).
    fn check_hold(&self) -> Result<()>;

    /// Checks a mutex name for this backend: the rules every backend shares
    /// ([`check_common_mutex_name`](crate::check_common_mutex_name)) and what this backend cannot
    /// accept besides. [`Locker::new`](crate::Locker::new) calls it.
    ///
    /// # Errors
    /// [`Error::InvalidName`](crate::Error::InvalidName) saying why.
    fn check_mutex_name(&self, mutex: &str) -> Result<()>;

    /// Checks a contender id for this backend: the rules every backend shares
    /// ([`check_common_contender_id`](crate::check_common_contender_id)) and what this backend
    /// cannot accept besides. [`Locker::with_contender_id`](crate::Locker::with_contender_id)
    /// calls it.
    ///
    /// # Errors
    /// [`Error::InvalidContenderId`](crate::Error::InvalidContenderId) saying why.
    fn check_contender_id(&self, contender_id: &str) -> Result<()>;

    /// A new contend service for `mutex`, reporting to `contender`. Not started.
    ///
    /// # Errors
    /// [`Error::InvalidName`](crate::Error::InvalidName) /
    /// [`Error::InvalidContenderId`](crate::Error::InvalidContenderId) for bad input.
    fn create_contend_service(
        &self,
        mutex: &str,
        contender: Arc<dyn Contender>,
    ) -> Result<Arc<dyn ContendService>>;

    /// A new retrieval service for `mutex`, reporting to `retriever`. Not started.
    ///
    /// # Errors
    /// [`Error::InvalidName`](crate::Error::InvalidName) for a bad name.
    fn create_retrieval_service(
        &self,
        mutex: &str,
        retriever: Arc<dyn MutexRetriever>,
    ) -> Result<Arc<dyn RetrievalService>>;
}
