//! [`ServiceRunner`]: the background task of a service — start once, stop, restart.

use std::fmt;
use std::future::Future;
use std::sync::Mutex as StdMutex;

use crate::rt::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::error::{Error, Result};
use crate::service::BoxFuture;

/// The background task of one contend or retrieval service.
///
/// It gives a service the start / stop / restart behaviour the
/// [`ContendService`](crate::ContendService) contract asks for, so that a backend writes
/// only its driver (the future that runs until its stop token is cancelled):
///
/// - [`start`](ServiceRunner::start) spawns the driver onto the current tokio runtime,
///   unless one is still running (an error then), and hands it a fresh
///   [`CancellationToken`] that is cancelled when the service is told to stop;
/// - [`stop`](ServiceRunner::stop) cancels the token **at once** (not when the returned
///   future is first polled), so that dropping the future still stops the service; the
///   future waits for the driver to finish its shutdown;
/// - dropping the runner (that is, the service) cancels the token too: the driver then
///   finishes its shutdown (a remote release, say) in the background;
/// - after a stop the runner can start again.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> simba_core::Result<()> {
/// use simba_core::backend::ServiceRunner;
///
/// let runner = ServiceRunner::new();
/// runner.start("example driver", |stop| async move {
///     // A driver loops until told to stop, then cleans up.
///     stop.cancelled().await;
/// })?;
/// assert!(runner.is_running());
/// assert!(runner.start("example driver", |_| async {}).is_err(), "already running");
/// runner.stop().await?;
/// assert!(!runner.is_running());
/// # Ok(())
/// # }
/// ```
#[derive(Default)]
pub struct ServiceRunner {
    running: StdMutex<Option<Running>>,
}

struct Running {
    what: String,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl fmt::Debug for ServiceRunner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceRunner")
            .field("running", &self.is_running())
            .finish()
    }
}

impl ServiceRunner {
    /// A runner with nothing running.
    pub fn new() -> Self {
        ServiceRunner::default()
    }

    /// Spawns `make(stop)` onto the current tokio runtime. `what` names the service in
    /// errors and logs (e.g. `contend service for mutex "jobs"`). `make` runs before the
    /// spawn, under the runner's lock: publish "running" there, so that the status says
    /// so when `start` returns.
    ///
    /// # Errors
    /// [`Error::InvalidState`] when called outside a tokio runtime, or when the driver of
    /// an earlier start is still running.
    pub fn start<F, Fut>(&self, what: impl Into<String>, make: F) -> Result<()>
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let what = what.into();
        let handle = crate::rt::Handle::try_current().map_err(|_| {
            Error::InvalidState("start() must be called inside a tokio runtime".into())
        })?;
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if running.as_ref().is_some_and(|r| !r.task.is_finished()) {
            return Err(Error::InvalidState(format!("{what} is already running")));
        }
        let stop = CancellationToken::new();
        let task = handle.spawn(make(stop.clone()));
        *running = Some(Running { what, stop, task });
        Ok(())
    }

    /// Whether a driver was started and has not finished.
    pub fn is_running(&self) -> bool {
        self.running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|r| !r.task.is_finished())
    }

    /// Tells the driver to stop, now, and returns a future that waits until it has
    /// finished: what [`ContendService::stop`](crate::ContendService::stop) and
    /// [`RetrievalService::stop`](crate::RetrievalService::stop) return. Stopping a runner
    /// that is not running is `Ok` at once.
    ///
    /// # Errors
    /// Never fails: a driver that panicked is logged, not propagated.
    ///
    /// # Cancel safety
    /// The stop is signalled before this returns; dropping the future only stops waiting.
    pub fn stop(&self) -> BoxFuture<'static, Result<()>> {
        let stopped = self.stop_task();
        Box::pin(async move {
            if let Some(stopped) = stopped {
                stopped.await;
            }
            Ok(())
        })
    }

    /// Tells the driver to stop, now. Returns `None` when nothing was started since the
    /// last stop, else a future that waits until the driver has finished (a driver that
    /// panicked is logged, not propagated).
    ///
    /// # Cancel safety
    /// The stop is signalled before this returns; dropping the future only stops waiting.
    pub fn stop_task(&self) -> Option<impl Future<Output = ()> + Send + 'static + use<>> {
        let Running { what, stop, task } = self
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        stop.cancel();
        Some(async move {
            if let Err(e) = task.await {
                warn!("{what}: task ended abnormally: {e}");
            }
        })
    }
}

impl Drop for ServiceRunner {
    fn drop(&mut self) {
        // The driver notices and finishes its shutdown in the background.
        if let Some(running) = self.running.get_mut().ok().and_then(|r| r.as_ref()) {
            running.stop.cancel();
        }
    }
}
