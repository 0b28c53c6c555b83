//! [`LeaseContendService`] and [`LeaseRetrievalService`]: the services the lease engine
//! drives.

use std::fmt;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::LeaseConfig;
use super::driver::Driver;
use crate::backend::{ContendHandle, Reporter, RetrievalHandle, ServiceHandle, ServiceStatus};
use crate::error::{Error, LossReason, Result};
use crate::id::generate_contender_id;
use crate::service::{BoxFuture, MutexRetriever};
use crate::store::LeaseStore;

/// A stop that keeps the mutex held until `until`, and where its outcome goes.
pub(super) struct HoldRequest {
    pub(super) until: Instant,
    pub(super) reply: oneshot::Sender<Result<()>>,
}

/// What a service and its driver share.
pub(super) struct Shared<S> {
    /// Set by `stop_holding_until` before it signals stop; taken by the driver's shutdown.
    pub(super) hold: StdMutex<Option<HoldRequest>>,
    pub(super) store: Arc<S>,
    pub(super) mutex: String,
    pub(super) contender_id: String,
    /// The factory's, shared by all its services.
    pub(super) config: Arc<LeaseConfig>,
    pub(super) out: ServiceStatus,
}

/// A contend service driven by the lease engine over a [`LeaseStore`].
///
/// What it guarantees, besides the [`ContendService` contract](crate::ContendService#contract):
/// - it believes it owns the mutex only until the local lease deadline: the instant the
///   last successful acquire/renew request was **sent**, plus `ttl + transition`, minus
///   `drift_margin`. When no renewal has succeeded by then it reports
///   [`LossReason::LeaseExpired`] at once, even while a renewal call still hangs;
/// - a failed renewal before the deadline marks the ownership *suspect* and is retried; it
///   does not end the ownership. So does a renewal still unanswered after the request
///   timeout, or two thirds of the way to the deadline if that is sooner (it is waited for
///   until the deadline);
/// - `stop` (and dropping the last handle) releases the mutex on the backend; an
///   acquisition in flight is not cut off but waited for first (at most the request
///   timeout), because it may win on the server after its answer was dropped;
/// - results that arrive after `stop` are ignored.
pub struct LeaseContendService<S> {
    shared: Arc<Shared<S>>,
    handle: ServiceHandle,
}

impl<S: LeaseStore> fmt::Debug for LeaseContendService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("LeaseContendService")
            .field(&self.handle)
            .finish()
    }
}

impl<S: LeaseStore> LeaseContendService<S> {
    pub(super) fn new(
        store: Arc<S>,
        mutex: String,
        contender_id: String,
        config: Arc<LeaseConfig>,
        reporter: Reporter,
    ) -> Self {
        let out = ServiceStatus::new(reporter).with_identity(
            store.backend(),
            &mutex,
            &contender_id,
            config.metrics_mutex_label,
        );
        let shared = Arc::new(Shared {
            hold: StdMutex::new(None),
            store,
            mutex,
            contender_id,
            config,
            out: out.clone(),
        });
        let driver = shared.clone();
        let handle = ServiceHandle::new(out, move |tracker, stop| {
            Box::pin(Driver::new(driver.clone(), tracker, stop).run())
        });
        LeaseContendService { shared, handle }
    }
}

impl<S: LeaseStore> ContendHandle for LeaseContendService<S> {
    fn handle(&self) -> &ServiceHandle {
        &self.handle
    }

    fn stop_holding_until(&self, until: Instant) -> BoxFuture<'_, Result<()>> {
        if let Err(e) = crate::store::hold_millis(until.saturating_duration_since(Instant::now())) {
            return Box::pin(async { Err(e) });
        }
        let shared = &self.shared;
        let (reply, outcome) = oneshot::channel();
        *shared.hold.lock().unwrap_or_else(|p| p.into_inner()) = Some(HoldRequest { until, reply });
        // Signalled at once, so that dropping the returned future still stops and holds.
        let stopped = self.handle.stop_task();
        if stopped.is_none() {
            shared.hold.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
        let mutex = shared.mutex.clone();
        // Not running: the ownership ended before (e.g. lost, and the service stopped).
        let ended = shared.out.current().last_loss.map(|l| l.reason);
        Box::pin(async move {
            let Some(stopped) = stopped else {
                return Err(match ended {
                    Some(reason) if reason != LossReason::Released => Error::Lost { mutex, reason },
                    _ => Error::Shutdown { mutex },
                });
            };
            stopped.await;
            outcome
                .await
                .unwrap_or_else(|_| Err(Error::Shutdown { mutex }))
        })
    }
}

/// The shortest interval at which an observer reads an idle mutex by itself.
pub(super) const OBSERVE_FLOOR: Duration = Duration::from_millis(500);

/// A retrieval service driven by the lease engine (reads the owner, never contends).
///
/// Where the store pushes ([`LeaseStore::subscribe`]: Redis pub/sub, PostgreSQL NOTIFY,
/// the memory store) it re-reads the owner on every pushed event, so a release or a new
/// owner is seen within milliseconds; besides, it reads when the lease it last saw ends
/// and at least every `max(ttl / 2, 500 ms)`. Where the store cannot push it reads every
/// [`LeaseConfig::waiter_poll`] (or `max(ttl / 2, 500 ms)` when unset), and at the end of
/// each lease it saw. Either way an idle observer costs a few reads per lease; it never
/// loops on a free mutex.
pub struct LeaseRetrievalService<S>(LeaseContendService<S>);

impl<S: LeaseStore> LeaseRetrievalService<S> {
    pub(super) fn new(
        store: Arc<S>,
        mutex: String,
        config: Arc<LeaseConfig>,
        retriever: Arc<dyn MutexRetriever>,
    ) -> Self {
        LeaseRetrievalService(LeaseContendService::new(
            store,
            mutex,
            generate_contender_id(),
            config,
            Reporter::Retriever(retriever),
        ))
    }
}

impl<S: LeaseStore> fmt::Debug for LeaseRetrievalService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("LeaseRetrievalService")
            .field(&self.0)
            .finish()
    }
}

impl<S: LeaseStore> RetrievalHandle for LeaseRetrievalService<S> {
    fn handle(&self) -> &ServiceHandle {
        &self.0.handle
    }
}
