//! [`ServiceHandle`]: the part of a contend or retrieval service every backend shares —
//! its identity, its published status and its background task.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{OwnershipTracker, ServiceRunner, ServiceStatus};
use crate::error::Result;
use crate::owner::MutexState;
use crate::service::{BoxFuture, ContenderStatus};

/// What a backend writes to get a service from [`ServiceHandle`]: the state the service
/// shares with its driver, and the driver.
///
/// The lease engine's services and ZooKeeper's are built this way; a backend's public
/// service type wraps a `ServiceHandle` and forwards the
/// [`ContendService`](crate::ContendService) or
/// [`RetrievalService`](crate::RetrievalService) methods to it.
pub trait ServiceDriver: Send + Sync + 'static {
    /// The backend's name (the `backend` field of the driver's span).
    fn backend(&self) -> &'static str;

    /// The mutex the service contends for or observes.
    fn mutex(&self) -> &str;

    /// The contender id the service contends with; empty for a retrieval service that
    /// has none.
    fn contender_id(&self) -> &str;

    /// The published side of the service (made once, kept across restarts).
    fn service_status(&self) -> &ServiceStatus;

    /// One run of the driver: it reports through `tracker` and runs until `stop` is
    /// cancelled, then finishes its shutdown (a release, say) before it returns.
    fn run(
        self: Arc<Self>,
        tracker: OwnershipTracker,
        stop: CancellationToken,
    ) -> impl Future<Output = ()> + Send + 'static;
}

/// A service's shared state `D` and its [`ServiceRunner`]: start, stop, restart and
/// status, the same for every backend.
///
/// - [`start`](Self::start) begins a run of the [`ServiceStatus`] (so the status says
///   `running` when `start` returns) and spawns [`ServiceDriver::run`] in a span `simba`
///   with the fields `backend`, `mutex` and `contender`;
/// - [`stop`](Self::stop) signals the stop at once and waits for the driver's shutdown;
/// - dropping the handle stops the driver in the background.
pub struct ServiceHandle<D> {
    shared: Arc<D>,
    runner: ServiceRunner,
}

impl<D: ServiceDriver> fmt::Debug for ServiceHandle<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("ServiceHandle");
        s.field("backend", &self.shared.backend())
            .field("mutex", &self.shared.mutex());
        if !self.shared.contender_id().is_empty() {
            s.field("contender_id", &self.shared.contender_id());
        }
        let out = self.shared.service_status();
        if out.contends() {
            s.field("status", &out.current());
        } else {
            s.field("state", &out.current_owner());
        }
        s.finish()
    }
}

impl<D: ServiceDriver> ServiceHandle<D> {
    /// A service over `shared`, not started.
    pub fn new(shared: D) -> Self {
        ServiceHandle {
            shared: Arc::new(shared),
            runner: ServiceRunner::new(),
        }
    }

    /// The state the service shares with its driver.
    pub fn shared(&self) -> &D {
        &self.shared
    }

    /// [`ServiceDriver::mutex`].
    pub fn mutex(&self) -> &str {
        self.shared.mutex()
    }

    /// [`ServiceDriver::contender_id`].
    pub fn contender_id(&self) -> &str {
        self.shared.contender_id()
    }

    /// Starts a run of the driver in the background.
    ///
    /// # Errors
    /// [`Error::InvalidState`](crate::Error::InvalidState) when called outside a tokio
    /// runtime, or while an earlier run is still going.
    pub fn start(&self) -> Result<()> {
        let shared = self.shared.clone();
        let kind = if shared.service_status().contends() {
            "contend"
        } else {
            "retrieval"
        };
        let what = format!("{kind} service for mutex {:?}", shared.mutex());
        self.runner.start(what, move |stop| {
            let tracker = shared.service_status().begin();
            let span = tracing::debug_span!(
                "simba",
                backend = shared.backend(),
                mutex = %shared.mutex(),
                contender = %shared.contender_id()
            );
            shared.run(tracker, stop).instrument(span)
        })
    }

    /// Tells the driver to stop, now, and returns a future that waits for its shutdown
    /// ([`ServiceRunner::stop`]).
    ///
    /// # Errors
    /// Never fails.
    ///
    /// # Cancel safety
    /// The stop is signalled before this returns; dropping the future only stops waiting.
    pub fn stop(&self) -> BoxFuture<'static, Result<()>> {
        self.runner.stop()
    }

    /// Tells the driver to stop, now ([`ServiceRunner::stop_task`]): `None` when it was not
    /// running.
    ///
    /// # Cancel safety
    /// The stop is signalled before this returns; dropping the future only stops waiting.
    pub fn stop_task(&self) -> Option<impl Future<Output = ()> + Send + 'static + use<D>> {
        self.runner.stop_task()
    }

    /// A receiver of the status ([`ContendService::status`](crate::ContendService::status)).
    pub fn status(&self) -> watch::Receiver<ContenderStatus> {
        self.shared.service_status().status()
    }

    /// A receiver of the last owner change seen
    /// ([`RetrievalService::state`](crate::RetrievalService::state)).
    pub fn owner_state(&self) -> watch::Receiver<MutexState> {
        self.shared.service_status().owner_state()
    }
}
