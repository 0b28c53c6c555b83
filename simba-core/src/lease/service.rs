//! [`LeaseContendService`] and [`LeaseRetrievalService`]: the services the lease engine
//! drives.

use std::fmt;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use tracing::Instrument;

use super::LeaseConfig;
use super::driver::Driver;
use crate::backend::{Reporter, ServiceRunner, ServiceStatus};
use crate::error::{Error, LossReason, Result};
use crate::id::generate_contender_id;
use crate::owner::MutexState;
use crate::service::{
    BoxFuture, ContendService, ContenderStatus, MutexRetriever, RetrievalService,
};
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
    pub(super) config: LeaseConfig,
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
    runner: ServiceRunner,
}

impl<S: LeaseStore> fmt::Debug for LeaseContendService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseContendService")
            .field("backend", &self.shared.store.backend())
            .field("mutex", &self.shared.mutex)
            .field("contender_id", &self.shared.contender_id)
            .field("status", &self.shared.out.current())
            .finish()
    }
}

impl<S: LeaseStore> LeaseContendService<S> {
    pub(super) fn new(
        store: Arc<S>,
        mutex: String,
        contender_id: String,
        config: LeaseConfig,
        reporter: Reporter,
    ) -> Self {
        let out = ServiceStatus::new(reporter).with_identity(
            store.backend(),
            &mutex,
            &contender_id,
            config.metrics_mutex_label,
        );
        LeaseContendService {
            shared: Arc::new(Shared {
                hold: StdMutex::new(None),
                store,
                mutex,
                contender_id,
                config,
                out,
            }),
            runner: ServiceRunner::new(),
        }
    }

    fn start_inner(&self) -> Result<()> {
        let shared = self.shared.clone();
        let what = if shared.out.contends() {
            format!("contend service for mutex {:?}", shared.mutex)
        } else {
            format!("retrieval service for mutex {:?}", shared.mutex)
        };
        self.runner.start(what, move |stop| {
            let tracker = shared.out.begin();
            let span = tracing::debug_span!(
                "simba",
                backend = shared.store.backend(),
                mutex = %shared.mutex,
                contender = %shared.contender_id
            );
            Driver::new(shared, tracker, stop).run().instrument(span)
        })
    }
}

impl<S: LeaseStore> ContendService for LeaseContendService<S> {
    fn mutex(&self) -> &str {
        &self.shared.mutex
    }

    fn contender_id(&self) -> &str {
        &self.shared.contender_id
    }

    fn start(&self) -> Result<()> {
        self.start_inner()
    }

    fn stop(&self) -> BoxFuture<'_, Result<()>> {
        // Signalled now, so that dropping the returned future still stops.
        self.runner.stop()
    }

    fn stop_holding_until(&self, until: Instant) -> BoxFuture<'_, Result<()>> {
        if let Err(e) = crate::store::hold_millis(until.saturating_duration_since(Instant::now())) {
            return Box::pin(async { Err(e) });
        }
        let (reply, outcome) = oneshot::channel();
        *self.shared.hold.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(HoldRequest { until, reply });
        // Signalled at once, so that dropping the returned future still stops and holds.
        let stopped = self.runner.stop_task();
        if stopped.is_none() {
            self.shared
                .hold
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
        }
        let mutex = self.shared.mutex.clone();
        // Not running: the ownership ended before (e.g. lost, and the service stopped).
        let ended = self.shared.out.current().last_loss.map(|l| l.reason);
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

    fn status(&self) -> watch::Receiver<ContenderStatus> {
        self.shared.out.status()
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
        config: LeaseConfig,
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

impl<S: LeaseStore> RetrievalService for LeaseRetrievalService<S> {
    fn mutex(&self) -> &str {
        &self.0.shared.mutex
    }
    fn start(&self) -> Result<()> {
        self.0.start_inner()
    }
    fn stop(&self) -> BoxFuture<'_, Result<()>> {
        // One stop path for both services: signalled at once, awaited in the future.
        ContendService::stop(&self.0)
    }
    fn state(&self) -> watch::Receiver<MutexState> {
        self.0.shared.out.owner_state()
    }
}
