//! [`ServiceHandle`]: the part of a contend or retrieval service every backend shares —
//! its identity, its published status and its background task — and the two traits that
//! make a service type of it ([`ContendHandle`], [`RetrievalHandle`]).

use std::fmt;
use std::future::Future;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{OwnershipTracker, ServiceRunner, ServiceStatus};
use crate::error::Result;
use crate::owner::MutexState;
use crate::service::{
    BoxFuture, ContendService, ContenderStatus, RetrievalService, unsupported_hold,
};

/// What starts one run of a service's driver: the driver reports through the tracker and
/// runs until the token is cancelled, then finishes its shutdown (a release, say) before
/// its future ends.
pub type DriverFn =
    Box<dyn Fn(OwnershipTracker, CancellationToken) -> BoxFuture<'static, ()> + Send + Sync>;

/// A service's [`ServiceStatus`], its driver and its [`ServiceRunner`]: start, stop,
/// restart and status, the same for every backend.
///
/// - [`start`](Self::start) begins a run of the status (so it says `running` when
///   `start` returns) and spawns the driver in a span `simba` with the fields `backend`,
///   `mutex` and `contender` (the service's identity, from
///   [`ServiceStatus::with_identity`]);
/// - [`stop`](Self::stop) signals the stop at once and waits for the driver's shutdown;
/// - dropping the handle stops the driver in the background.
///
/// A backend's service type wraps one and implements [`ContendHandle`] or
/// [`RetrievalHandle`], which give it [`ContendService`] or [`RetrievalService`].
pub struct ServiceHandle {
    out: ServiceStatus,
    driver: DriverFn,
    runner: ServiceRunner,
}

impl fmt::Debug for ServiceHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("ServiceHandle");
        s.field("backend", &self.out.backend())
            .field("mutex", &self.out.mutex());
        if self.out.contends() {
            s.field("contender_id", &self.out.contender_id())
                .field("status", &self.out.current());
        } else {
            s.field("state", &self.out.current_owner());
        }
        s.finish()
    }
}

impl ServiceHandle {
    /// A service that publishes to `out` and runs `driver`; not started.
    pub fn new<F>(out: ServiceStatus, driver: F) -> Self
    where
        F: Fn(OwnershipTracker, CancellationToken) -> BoxFuture<'static, ()>
            + Send
            + Sync
            + 'static,
    {
        ServiceHandle {
            out,
            driver: Box::new(driver),
            runner: ServiceRunner::new(),
        }
    }

    /// The published side of the service.
    pub fn service_status(&self) -> &ServiceStatus {
        &self.out
    }

    /// Starts a run of the driver in the background.
    ///
    /// # Errors
    /// [`Error::InvalidState`](crate::Error::InvalidState) when called outside a tokio
    /// runtime, or while an earlier run is still going.
    pub fn start(&self) -> Result<()> {
        let kind = if self.out.contends() {
            "contend"
        } else {
            "retrieval"
        };
        let what = format!("{kind} service for mutex {:?}", self.out.mutex());
        self.runner.start(what, |stop| {
            let tracker = self.out.begin();
            let span = tracing::debug_span!(
                "simba",
                backend = self.out.backend(),
                mutex = %self.out.mutex(),
                contender = %self.out.contender_id()
            );
            (self.driver)(tracker, stop).instrument(span)
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
    pub fn stop_task(&self) -> Option<impl Future<Output = ()> + Send + 'static + use<>> {
        self.runner.stop_task()
    }
}

/// A contend service type made of a [`ServiceHandle`]: implementing this gives it
/// [`ContendService`].
pub trait ContendHandle: Send + Sync + fmt::Debug {
    /// The handle the service is made of.
    fn handle(&self) -> &ServiceHandle;

    /// [`ContendService::stop_holding_until`]; by default the backend cannot hold.
    fn stop_holding_until(&self, until: Instant) -> BoxFuture<'_, Result<()>> {
        let _ = until;
        let backend = self.handle().out.backend();
        Box::pin(async move { Err(unsupported_hold(backend)) })
    }
}

impl<T: ContendHandle> ContendService for T {
    fn mutex(&self) -> &str {
        self.handle().out.mutex()
    }

    fn contender_id(&self) -> &str {
        self.handle().out.contender_id()
    }

    fn start(&self) -> Result<()> {
        self.handle().start()
    }

    fn stop(&self) -> BoxFuture<'_, Result<()>> {
        self.handle().stop()
    }

    fn stop_holding_until(&self, until: Instant) -> BoxFuture<'_, Result<()>> {
        ContendHandle::stop_holding_until(self, until)
    }

    fn status(&self) -> watch::Receiver<ContenderStatus> {
        self.handle().out.status()
    }
}

/// A retrieval service type made of a [`ServiceHandle`]: implementing this gives it
/// [`RetrievalService`].
pub trait RetrievalHandle: Send + Sync + fmt::Debug {
    /// The handle the service is made of.
    fn handle(&self) -> &ServiceHandle;
}

impl<T: RetrievalHandle> RetrievalService for T {
    fn mutex(&self) -> &str {
        self.handle().out.mutex()
    }

    fn start(&self) -> Result<()> {
        self.handle().start()
    }

    fn stop(&self) -> BoxFuture<'_, Result<()>> {
        self.handle().stop()
    }

    fn state(&self) -> watch::Receiver<MutexState> {
        self.handle().out.owner_state()
    }
}
