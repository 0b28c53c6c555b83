//! The lease contention engine shared by every lease backend (Redis, SQL, in-memory).

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until, timeout};
use tracing::{Instrument, debug, info, warn};

use crate::error::{Error, LossReason, Result};
use crate::id::{generate_contender_id, validate_contender_id, validate_mutex_name};
use crate::owner::{
    ContendPeriod, DEFAULT_JITTER, DEFAULT_JITTER_NO_TRANSITION, MutexOwner, MutexState,
};
use crate::service::{
    BoxFuture, ContendService, ContendServiceFactory, Contender, ContenderStatus, Held, Loss,
    MutexRetriever, RetrievalService,
};
use crate::store::{Lease, LeaseReply, LeaseStore, StoreEvent};

/// The longest duration any setting accepts (one year): longer values are mistakes.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// Checks a duration setting the way every simba config does: at least `min`, at most
/// [`MAX_DURATION`], and a whole number of milliseconds (backends count in ms).
///
/// # Errors
/// [`Error::InvalidConfig`] naming `field` and what is wrong with `d`.
///
/// ```
/// use std::time::Duration;
/// use simba_core::validate_duration;
///
/// let ms = Duration::from_millis(1);
/// assert!(validate_duration("ttl", Duration::from_secs(10), ms).is_ok());
/// assert!(validate_duration("ttl", Duration::ZERO, ms).is_err());
/// assert!(validate_duration("ttl", Duration::from_micros(1500), ms).is_err());
/// ```
pub fn validate_duration(field: &'static str, d: Duration, min: Duration) -> Result<()> {
    if d < min {
        return Err(Error::config(
            field,
            format!("{d:?} is shorter than {min:?}"),
        ));
    }
    if d > MAX_DURATION {
        return Err(Error::config(
            field,
            format!("{d:?} is longer than one year"),
        ));
    }
    if !d.subsec_nanos().is_multiple_of(1_000_000) {
        return Err(Error::config(
            field,
            format!("{d:?} is not a whole number of milliseconds (backends count in ms)"),
        ));
    }
    Ok(())
}

/// Timing of a lease contender. Defaults are Simba's (ttl 10 s, transition 6 s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Time to live of an ownership; the owner renews from here on.
    pub ttl: Duration,
    /// Transition period after the ttl in which only the owner may renew.
    pub transition: Duration,
    /// Safety margin subtracted from the local lease deadline for clock-rate drift between
    /// this process and the backend.
    pub drift_margin: Duration,
    /// Upper bound for one backend call made while not owning (an owner's calls are bounded
    /// by its lease deadline).
    pub request_timeout: Duration,
    /// Pause before retrying after a failed call.
    pub retry_interval: Duration,
    /// When the store cannot push releases (SQLite, MySQL, Redis in polling mode): the
    /// longest a non-owner sleeps between two looks (a random time in the second half of
    /// it, so that waiters do not poll in lockstep), so that a released mutex is taken
    /// within this time rather than at the end of the old lease. `None` keeps Simba's
    /// schedule (wake at the end of the owner's transition).
    ///
    /// Retrieval services (observers) on such stores read the owner every `waiter_poll`
    /// too; with `None` they read every `max(ttl / 2, 500 ms)` and at the end of each
    /// lease they saw (see [`LeaseRetrievalService`]).
    pub waiter_poll: Option<Duration>,
    /// Jitter (ms) for non-owners when the owner has a transition period.
    pub jitter: Range<i64>,
    /// Jitter (ms) for non-owners when it has none.
    pub jitter_no_transition: Range<i64>,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            ttl: Duration::from_secs(10),
            transition: Duration::from_secs(6),
            drift_margin: Duration::from_millis(100),
            request_timeout: Duration::from_secs(5),
            retry_interval: Duration::from_secs(1),
            waiter_poll: None,
            jitter: DEFAULT_JITTER,
            jitter_no_transition: DEFAULT_JITTER_NO_TRANSITION,
        }
    }
}

impl LeaseConfig {
    /// Default timing with the given ttl and transition.
    pub fn with_lease(ttl: Duration, transition: Duration) -> Self {
        LeaseConfig {
            ttl,
            transition,
            ..LeaseConfig::default()
        }
    }

    /// The lease this config asks for.
    pub fn lease(&self) -> Lease {
        Lease {
            ttl: self.ttl,
            transition: self.transition,
        }
    }

    /// Checks every setting.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first bad setting: zero or sub-millisecond ttl,
    /// durations over a year, ttl + transition over a year, a drift margin that eats the whole lease, empty jitter ranges.
    pub fn validate(&self) -> Result<()> {
        let ms = Duration::from_millis(1);
        let checks: [(&'static str, Duration, Duration); 5] = [
            ("ttl", self.ttl, ms),
            ("transition", self.transition, Duration::ZERO),
            ("drift_margin", self.drift_margin, Duration::ZERO),
            ("request_timeout", self.request_timeout, ms),
            ("retry_interval", self.retry_interval, Duration::ZERO),
        ];
        for (field, d, min) in checks {
            validate_duration(field, d, min)?;
        }
        if let Some(p) = self.waiter_poll {
            validate_duration("waiter_poll", p, ms)?;
        }
        if self.ttl + self.transition > MAX_DURATION {
            return Err(Error::config(
                "transition",
                format!(
                    "ttl + transition = {:?} is longer than one year (a lease that long \
                     outlives any owner it protects)",
                    self.ttl + self.transition
                ),
            ));
        }
        if self.drift_margin * 2 >= self.ttl + self.transition {
            return Err(Error::config(
                "drift_margin",
                format!(
                    "{:?} must be less than half of ttl + transition ({:?})",
                    self.drift_margin,
                    self.ttl + self.transition
                ),
            ));
        }
        if self.jitter.is_empty() || self.jitter_no_transition.is_empty() {
            return Err(Error::config("jitter", "jitter ranges must not be empty"));
        }
        Ok(())
    }
}

/// Makes lease contend services over one store.
pub struct LeaseServiceFactory<S> {
    store: Arc<S>,
    config: LeaseConfig,
}

impl<S: LeaseStore> fmt::Debug for LeaseServiceFactory<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseServiceFactory")
            .field("backend", &self.store.backend())
            .field("config", &self.config)
            .finish()
    }
}

impl<S: LeaseStore> LeaseServiceFactory<S> {
    /// A factory over `store` with `config`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if the config does not validate.
    pub fn new(store: S, config: LeaseConfig) -> Result<Self> {
        Self::from_arc(Arc::new(store), config)
    }

    /// A factory over a shared store.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if the config does not validate.
    pub fn from_arc(store: Arc<S>, config: LeaseConfig) -> Result<Self> {
        config.validate()?;
        Ok(LeaseServiceFactory { store, config })
    }

    /// The store.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// The config.
    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// A concrete (not boxed) contend service.
    ///
    /// # Errors
    /// As [`ContendServiceFactory::create_contend_service`].
    pub fn contend_service(
        &self,
        mutex: &str,
        contender: Arc<dyn Contender>,
    ) -> Result<LeaseContendService<S>> {
        validate_mutex_name(mutex)?;
        let id = match contender.contender_id() {
            Some(id) => {
                validate_contender_id(&id)?;
                id
            }
            None => generate_contender_id(),
        };
        Ok(LeaseContendService::new(
            self.store.clone(),
            mutex.to_owned(),
            id,
            self.config.clone(),
            Mode::Contend(contender),
        ))
    }
}

impl<S: LeaseStore> ContendServiceFactory for LeaseServiceFactory<S> {
    fn backend(&self) -> &'static str {
        self.store.backend()
    }

    /// Every lease store can keep a released mutex held ([`LeaseStore::release_after`]).
    fn check_hold(&self) -> Result<()> {
        Ok(())
    }

    fn create_contend_service(
        &self,
        mutex: &str,
        contender: Arc<dyn Contender>,
    ) -> Result<Arc<dyn ContendService>> {
        Ok(Arc::new(self.contend_service(mutex, contender)?))
    }

    fn create_retrieval_service(
        &self,
        mutex: &str,
        retriever: Arc<dyn MutexRetriever>,
    ) -> Result<Arc<dyn RetrievalService>> {
        validate_mutex_name(mutex)?;
        Ok(Arc::new(LeaseRetrievalService(LeaseContendService::new(
            self.store.clone(),
            mutex.to_owned(),
            generate_contender_id(),
            self.config.clone(),
            Mode::Observe(retriever),
        ))))
    }
}

#[derive(Clone)]
enum Mode {
    Contend(Arc<dyn Contender>),
    Observe(Arc<dyn MutexRetriever>),
}

struct Running {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// A stop that keeps the mutex held until `until`, and where its outcome goes.
struct HoldRequest {
    until: Instant,
    reply: oneshot::Sender<Result<()>>,
}

struct Shared<S> {
    /// Set by `stop_holding_until` before it signals stop; taken by the driver's shutdown.
    hold: StdMutex<Option<HoldRequest>>,
    store: Arc<S>,
    mutex: String,
    contender_id: String,
    config: LeaseConfig,
    mode: Mode,
    status: watch::Sender<ContenderStatus>,
    owner_state: watch::Sender<MutexState>,
}

/// A contend service driven by the lease engine over a [`LeaseStore`].
///
/// What it guarantees (DESIGN §3):
/// - it believes it owns the mutex only until the local lease deadline: the instant the
///   last successful acquire/renew request was **sent**, plus `ttl + transition`, minus
///   `drift_margin`. When no renewal has succeeded by then it reports
///   [`LossReason::LeaseExpired`] at once, even while a renewal call still hangs;
/// - a failed renewal before the deadline marks the ownership *suspect* and is retried; it
///   does not end the ownership;
/// - `stop` (and dropping the last handle) releases the mutex on the backend; an
///   acquisition in flight is not cut off but waited for first (at most the request
///   timeout), because it may win on the server after its answer was dropped;
/// - results that arrive after `stop` are ignored.
pub struct LeaseContendService<S> {
    shared: Arc<Shared<S>>,
    running: StdMutex<Option<Running>>,
}

impl<S: LeaseStore> fmt::Debug for LeaseContendService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseContendService")
            .field("backend", &self.shared.store.backend())
            .field("mutex", &self.shared.mutex)
            .field("contender_id", &self.shared.contender_id)
            .field("status", &*self.shared.status.borrow())
            .finish()
    }
}

impl<S: LeaseStore> LeaseContendService<S> {
    fn new(
        store: Arc<S>,
        mutex: String,
        contender_id: String,
        config: LeaseConfig,
        mode: Mode,
    ) -> Self {
        LeaseContendService {
            shared: Arc::new(Shared {
                hold: StdMutex::new(None),
                store,
                mutex,
                contender_id,
                config,
                mode,
                status: watch::channel(ContenderStatus::default()).0,
                owner_state: watch::channel(MutexState::default()).0,
            }),
            running: StdMutex::new(None),
        }
    }

    fn start_inner(&self) -> Result<()> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::InvalidState("start() must be called inside a tokio runtime".into())
        })?;
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if running.as_ref().is_some_and(|r| !r.task.is_finished()) {
            return Err(Error::InvalidState(format!(
                "contend service for mutex {:?} is already running",
                self.shared.mutex
            )));
        }
        let (stop, stop_rx) = watch::channel(false);
        self.shared.status.send_modify(|s| {
            s.running = true;
            s.held = None;
            s.attempts = 0;
            s.last_error = None;
        });
        let span = tracing::debug_span!(
            "simba",
            backend = self.shared.store.backend(),
            mutex = %self.shared.mutex,
            contender = %self.shared.contender_id
        );
        let task = handle.spawn(
            Driver::new(self.shared.clone(), stop_rx)
                .run()
                .instrument(span),
        );
        *running = Some(Running { stop, task });
        Ok(())
    }

    fn signal_stop(&self) -> Option<JoinHandle<()>> {
        let running = self
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        let _ = running.stop.send(true);
        Some(running.task)
    }
}

impl<S> Drop for LeaseContendService<S> {
    fn drop(&mut self) {
        // The driver notices and releases in the background.
        if let Some(running) = self.running.get_mut().ok().and_then(Option::take) {
            let _ = running.stop.send(true);
        }
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
        // Signal synchronously so that dropping the returned future still stops.
        let task = self.signal_stop();
        let mutex = self.shared.mutex.clone();
        Box::pin(async move {
            if let Some(task) = task
                && let Err(e) = task.await
            {
                warn!(%mutex, "contend task ended abnormally: {e}");
            }
            Ok(())
        })
    }

    fn stop_holding_until(&self, until: Instant) -> BoxFuture<'_, Result<()>> {
        if let Err(e) = crate::store::hold_millis(until.saturating_duration_since(Instant::now())) {
            return Box::pin(async { Err(e) });
        }
        let (reply, outcome) = oneshot::channel();
        *self.shared.hold.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(HoldRequest { until, reply });
        // Signalled at once, so that dropping the returned future still stops and holds.
        let task = self.signal_stop();
        if task.is_none() {
            self.shared
                .hold
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
        }
        let mutex = self.shared.mutex.clone();
        // Not running: the ownership ended before (e.g. lost, and the service stopped).
        let ended = self.shared.status.borrow().last_loss.map(|l| l.reason);
        Box::pin(async move {
            let Some(task) = task else {
                return Err(match ended {
                    Some(reason) if reason != LossReason::Released => Error::Lost { mutex, reason },
                    _ => Error::Shutdown { mutex },
                });
            };
            if let Err(e) = task.await {
                warn!(%mutex, "contend task ended abnormally: {e}");
            }
            outcome
                .await
                .unwrap_or_else(|_| Err(Error::Shutdown { mutex }))
        })
    }

    fn status(&self) -> watch::Receiver<ContenderStatus> {
        self.shared.status.subscribe()
    }
}

/// The shortest interval at which an observer reads an idle mutex by itself.
const OBSERVE_FLOOR: Duration = Duration::from_millis(500);

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
        self.0.shared.owner_state.subscribe()
    }
}

/// What a subscription came back with (bounded by the request timeout).
type Subscribed =
    std::result::Result<Result<Option<mpsc::Receiver<StoreEvent>>>, tokio::time::error::Elapsed>;

/// What one attempt (acquire, renew or read) came back with.
enum Outcome {
    Stop,
    DeadlinePassed,
    Reply(Instant, Result<LeaseReply>),
}

struct Owned {
    fence: u64,
    deadline: Instant,
    suspect: bool,
}

struct Driver<S> {
    shared: Arc<Shared<S>>,
    stop: watch::Receiver<bool>,
    period: ContendPeriod,
    events: Option<mpsc::Receiver<StoreEvent>>,
    subscribed: bool,
    owned: Option<Owned>,
    known: MutexOwner,
    next: Instant,
    /// The next attempt was asked for at once (start, or a pushed event): it goes ahead
    /// without waiting on a timer, because tokio rounds timer deadlines up to the next
    /// millisecond, which would add up to 1 ms to every acquisition and handoff.
    urgent: bool,
    /// An attempt was made: from now on a non-owner subscribes to pushed events.
    looked: bool,
    failures: u32,
}

impl<S: LeaseStore> Driver<S> {
    fn new(shared: Arc<Shared<S>>, stop: watch::Receiver<bool>) -> Self {
        let period = ContendPeriod::new(shared.contender_id.clone())
            .with_jitter(
                shared.config.jitter.clone(),
                shared.config.jitter_no_transition.clone(),
            )
            .unwrap_or_else(|_| ContendPeriod::new(shared.contender_id.clone()));
        let known = shared.owner_state.borrow().after.clone();
        Driver {
            shared,
            stop,
            period,
            events: None,
            subscribed: false,
            owned: None,
            known,
            next: Instant::now(),
            urgent: true,
            looked: false,
            failures: 0,
        }
    }

    fn contending(&self) -> bool {
        matches!(self.shared.mode, Mode::Contend(_))
    }

    fn deadline(&self) -> Option<Instant> {
        self.owned.as_ref().map(|o| o.deadline)
    }

    async fn run(mut self) {
        loop {
            if *self.stop.borrow() {
                break;
            }
            // Subscribing may take up to a request timeout, so it is tried only while not
            // owning: an owner's lease deadline must never wait behind it. The first attempt
            // subscribes at the same time (see `attempt`); this is for later ones.
            if !self.subscribed && self.owned.is_none() && self.looked {
                if !self.subscribe().await {
                    break;
                }
                self.look_again_if_subscribed();
            }
            // Wait for the next attempt, an event, the lease deadline, or stop; an urgent
            // attempt that is due goes ahead at once (the deadline checked by hand).
            let deadline = self.deadline();
            let now = Instant::now();
            if self.urgent && self.next <= now {
                if deadline.is_some_and(|d| d <= now) {
                    self.lose(LossReason::LeaseExpired, MutexOwner::NONE);
                    continue;
                }
            } else {
                tokio::select! {
                    biased;
                    _ = self.stop.changed() => break,
                    _ = sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                        self.lose(LossReason::LeaseExpired, MutexOwner::NONE);
                        self.next = Instant::now();
                        continue;
                    }
                    ev = recv_event(&mut self.events) => {
                        self.on_event(ev);
                        continue;
                    }
                    _ = sleep_until(self.next) => {}
                }
            }
            self.urgent = false;
            let first = !self.looked;
            self.looked = true;
            let (outcome, subscribed) = self.attempt(first).await;
            if let Some(result) = subscribed {
                self.on_subscribed(result);
            }
            let answered = matches!(outcome, Outcome::Reply(_, Ok(_)));
            match outcome {
                Outcome::Stop => break,
                Outcome::DeadlinePassed => {
                    self.lose(LossReason::LeaseExpired, MutexOwner::NONE);
                    self.next = Instant::now();
                }
                Outcome::Reply(sent, Ok(reply)) => self.on_reply(sent, reply),
                Outcome::Reply(_, Err(e)) => self.on_failure(e),
            }
            if first && answered && self.owned.is_none() {
                self.look_again_if_subscribed();
            }
        }
        self.shutdown().await;
    }

    /// A waiter that just subscribed looks again at once: a release between its last look
    /// and the subscription was not heard.
    fn look_again_if_subscribed(&mut self) {
        if self.events.is_some() {
            self.next = Instant::now();
            self.urgent = true;
        }
    }

    /// Subscribes to store events; returns false if stop was requested meanwhile.
    async fn subscribe(&mut self) -> bool {
        let shared = self.shared.clone();
        // Store futures are boxed: a driver lives as long as its service, and holding the
        // largest store future inline would cost every idle service kilobytes.
        let call = Box::pin(shared.store.subscribe(&shared.mutex, &shared.contender_id));
        let result = tokio::select! {
            biased;
            _ = self.stop.changed() => return false,
            r = timeout(shared.config.request_timeout, call) => r,
        };
        self.on_subscribed(result);
        true
    }

    fn on_subscribed(&mut self, result: Subscribed) {
        match result {
            Ok(Ok(rx)) => {
                self.events = rx;
                self.subscribed = true;
            }
            Ok(Err(e)) => debug!("subscribe failed, polling until it succeeds: {e}"),
            Err(_) => debug!("subscribe timed out, polling until it succeeds"),
        }
    }

    fn on_event(&mut self, ev: Option<StoreEvent>) {
        match ev {
            None => {
                // The store dropped the channel: poll, and subscribe again.
                self.events = None;
                self.subscribed = false;
                self.next = Instant::now();
            }
            Some(StoreEvent::Acquired { owner_id })
                if self.owned.is_none() && self.contending() =>
            {
                debug!(%owner_id, "acquired elsewhere");
                // Nothing to do now: the next attempt is due when that lease ends.
            }
            Some(ev) => {
                // Observers re-read on every event, contenders contend again.
                debug!(?ev, "store event: looking now");
                self.next = Instant::now();
                self.urgent = true;
            }
        }
    }

    /// One backend call. A contender that has not subscribed yet and not looked yet
    /// subscribes at the same time (the store may use another connection for it), so that
    /// an uncontended acquisition waits for one round trip, not two; the subscription's
    /// result comes back beside the outcome.
    async fn attempt(&mut self, first: bool) -> (Outcome, Option<Subscribed>) {
        let shared = self.shared.clone();
        let lease = shared.config.lease();
        let sent = Instant::now();
        let owning = self.owned.is_some();
        let subscribe = (first && !self.subscribed && !owning)
            .then(|| Box::pin(shared.store.subscribe(&shared.mutex, &shared.contender_id)));
        let call = Box::pin(async {
            match (&shared.mode, owning) {
                (Mode::Observe(_), _) => shared.store.owner(&shared.mutex).await,
                (Mode::Contend(_), true) => {
                    shared
                        .store
                        .guard(&shared.mutex, &shared.contender_id, lease)
                        .await
                }
                (Mode::Contend(_), false) => {
                    shared
                        .store
                        .acquire(&shared.mutex, &shared.contender_id, lease)
                        .await
                }
            }
        });
        let bound = match self.deadline() {
            Some(d) => d
                .saturating_duration_since(sent)
                .min(shared.config.request_timeout.max(lease.total())),
            None => shared.config.request_timeout,
        };
        let deadline = self.deadline();
        let request_timeout = shared.config.request_timeout;
        let both = async {
            let subscribed = async {
                match subscribe {
                    Some(call) => Some(timeout(request_timeout, call).await),
                    None => None,
                }
            };
            tokio::join!(timeout(bound, call), subscribed)
        };
        // A stop cuts renewals and reads short, but not an acquisition: once sent, it may
        // win on the server even if its answer is dropped (a statement on a blocking
        // thread or on the wire runs on), and a release sent before it lands would leave a
        // dead owner for a whole lease. So a stop waits for the acquisition's answer
        // (bounded by the request timeout), and the release follows it.
        let acquiring = !owning && self.contending();
        tokio::select! {
            biased;
            _ = self.stop.changed(), if !acquiring => (Outcome::Stop, None),
            _ = sleep_until(deadline.unwrap_or(sent)), if deadline.is_some() => (Outcome::DeadlinePassed, None),
            (r, subscribed) = both => (Outcome::Reply(sent, r.unwrap_or_else(|_| Err(Error::backend(
                shared.store.backend(),
                format!("call did not answer within {bound:?}"),
            )))), subscribed),
        }
    }

    /// When an observer reads next, after it saw `owner` at backend time `now`: at the end
    /// of that owner's lease, and at least every interval (see [`LeaseRetrievalService`]).
    fn observe_delay(&self, owner: &MutexOwner, now: i64) -> Duration {
        let config = &self.shared.config;
        let idle = (config.ttl / 2).max(OBSERVE_FLOOR);
        let interval = match (&self.events, config.waiter_poll) {
            (None, Some(poll)) => poll,
            _ => idle,
        };
        if owner.is_in_lease(now) {
            // One millisecond past the end, so that the read sees the lease over.
            let left = owner.transition_at.saturating_sub(now).saturating_add(1);
            interval.min(Duration::from_millis(u64::try_from(left).unwrap_or(0)))
        } else {
            interval
        }
    }

    fn on_reply(&mut self, sent: Instant, reply: LeaseReply) {
        self.failures = 0;
        let now = Instant::now();
        if !self.contending() {
            self.observe(reply.owner.clone());
            self.next = now + self.observe_delay(&reply.owner, reply.now);
            self.count_attempt(None);
            return;
        }
        let me = self.shared.contender_id.clone();
        let mine = reply.owner.is_owned_by_at(&me, reply.now);
        if mine && self.contending() {
            let lease = self.shared.config.lease().total();
            let deadline = sent + lease.saturating_sub(self.shared.config.drift_margin);
            let fence = reply.owner.fence;
            if self.owned.as_ref().is_some_and(|o| o.fence != fence) {
                // Our earlier ownership ended and a new one began in between.
                self.lose(LossReason::LeaseExpired, MutexOwner::NONE);
            }
            let newly = self.owned.is_none();
            if let Some(o) = &mut self.owned {
                o.deadline = deadline;
                if o.suspect {
                    info!(
                        fence,
                        "renewal succeeded again; ownership no longer suspect"
                    );
                }
                o.suspect = false;
            } else {
                self.owned = Some(Owned {
                    fence,
                    deadline,
                    suspect: false,
                });
            }
            let state = self.observe(reply.owner.clone());
            if newly {
                info!(fence, "acquired");
                let state = if state.is_changed() {
                    state
                } else {
                    MutexState::new(MutexOwner::NONE, reply.owner.clone())
                };
                // The callback runs before the status says "held", so that whoever waits
                // on the status sees what the callback did.
                if let Mode::Contend(c) = &self.shared.mode {
                    c.on_acquired(&state);
                }
                self.publish_held(&state);
            } else {
                debug!(fence, "renewed");
                self.publish_held(&state);
            }
            let period = self.period.next_delay(&reply.owner, reply.now);
            let until_deadline = deadline.saturating_duration_since(now);
            self.next = now + period.min(until_deadline * 2 / 3);
        } else {
            if self.owned.is_some() {
                self.lose(LossReason::TakenOver, reply.owner.clone());
            }
            self.observe(reply.owner.clone());
            let mut delay = self.period.next_delay(&reply.owner, reply.now);
            if self.events.is_none()
                && let Some(poll) = self.shared.config.waiter_poll
            {
                // Somewhere in the second half of the poll period, so that waiters that
                // started together do not poll in lockstep.
                let ms = i64::try_from(poll.as_millis()).unwrap_or(i64::MAX);
                let jittered = crate::owner::random_in(ms - ms / 2..ms + 1);
                delay = delay.min(Duration::from_millis(u64::try_from(jittered).unwrap_or(0)));
            }
            self.next = now + delay;
        }
        self.count_attempt(None);
    }

    /// Counts a completed call; published after the call's effects so that a watcher that
    /// sees the count also sees the outcome.
    fn count_attempt(&self, error: Option<String>) {
        self.shared.status.send_modify(|s| {
            s.attempts += 1;
            s.last_error = error;
        });
    }

    fn on_failure(&mut self, e: Error) {
        self.failures = self.failures.saturating_add(1);
        let now = Instant::now();
        let retry = self.shared.config.retry_interval;
        match &mut self.owned {
            Some(o) => {
                if !o.suspect {
                    warn!(
                        fence = o.fence,
                        "renewal failed, ownership suspect until a renewal succeeds: {e}"
                    );
                }
                o.suspect = true;
                let left = o.deadline.saturating_duration_since(now);
                self.next = now + retry.min(left / 3);
                let held = Held {
                    fence: o.fence,
                    suspect: true,
                };
                self.shared.status.send_modify(|s| s.held = Some(held));
                // The deadline stays where the last success put it.
            }
            None => {
                if self.failures == 1 {
                    warn!("backend call failed, retrying every {retry:?}: {e}");
                } else {
                    debug!("backend call failed again: {e}");
                }
                self.next = now + retry;
            }
        }
        self.count_attempt(Some(e.to_string()));
    }

    /// Records the owner seen; tells retrievers about a change. Returns the change.
    fn observe(&mut self, owner: MutexOwner) -> MutexState {
        let state = MutexState::new(std::mem::replace(&mut self.known, owner.clone()), owner);
        if state.is_changed() {
            self.shared.owner_state.send_replace(state.clone());
            if let Mode::Observe(r) = &self.shared.mode {
                r.on_changed(&state);
            }
            self.shared.status.send_modify(|s| s.state = state.clone());
        } else {
            // Renewal: keep times fresh without signalling a change to retrievers.
            self.shared.owner_state.send_if_modified(|s| {
                s.after = state.after.clone();
                false
            });
        }
        state
    }

    fn publish_held(&self, state: &MutexState) {
        let held = self.owned.as_ref().map(|o| Held {
            fence: o.fence,
            suspect: o.suspect,
        });
        let deadline = self.deadline();
        let changed = state.is_changed();
        self.shared.status.send_modify(|s| {
            s.held = held;
            s.deadline = deadline;
            if changed {
                s.state = state.clone();
            }
        });
    }

    /// Ends this process's ownership for `reason`; `after` is the owner known afterwards.
    fn lose(&mut self, reason: LossReason, after: MutexOwner) {
        let Some(owned) = self.owned.take() else {
            return;
        };
        match reason {
            LossReason::Released => info!(fence = owned.fence, "released"),
            _ => warn!(fence = owned.fence, %reason, "ownership lost"),
        }
        let state = MutexState::new(
            std::mem::replace(&mut self.known, after),
            self.known.clone(),
        );
        if state.is_changed() {
            self.shared.owner_state.send_replace(state.clone());
        }
        let loss = Loss {
            fence: owned.fence,
            reason,
        };
        if let Mode::Contend(c) = &self.shared.mode {
            c.on_released(&state, reason);
        }
        self.shared.status.send_modify(|s| {
            s.held = None;
            s.deadline = None;
            s.last_loss = Some(loss);
            s.state = state.clone();
        });
    }

    async fn shutdown(mut self) {
        self.events = None;
        let hold = self
            .shared
            .hold
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if self.contending() {
            let was_owner = self.owned.is_some();
            let now = Instant::now();
            // The ownership a hold can keep: one that stands by the local deadline.
            let standing = self.owned.as_ref().is_some_and(|o| o.deadline > now);
            let earlier_loss = self.shared.status.borrow().last_loss.map(|l| l.reason);
            // Stop acting as owner before the mutex is freed for others.
            self.lose(LossReason::Released, MutexOwner::NONE);
            match hold {
                Some(req) if standing => {
                    let outcome = self.hold_remotely(req.until).await;
                    let _ = req.reply.send(outcome);
                }
                Some(req) => {
                    self.release_remotely(was_owner).await;
                    let reason = if was_owner {
                        LossReason::LeaseExpired
                    } else {
                        earlier_loss.unwrap_or(LossReason::LeaseExpired)
                    };
                    let _ = req.reply.send(Err(Error::Lost {
                        mutex: self.shared.mutex.clone(),
                        reason,
                    }));
                }
                None => self.release_remotely(was_owner).await,
            }
        } else if let Some(req) = hold {
            let _ = req.reply.send(Err(Error::InvalidState(
                "an observer holds nothing".to_owned(),
            )));
        }
        self.shared.status.send_modify(|s| {
            s.running = false;
            s.held = None;
            s.deadline = None;
        });
    }

    /// Releases on the backend, bounded by the request timeout (best effort: the lease
    /// frees the mutex anyway).
    async fn release_remotely(&self, was_owner: bool) {
        let shared = self.shared.clone();
        let (mutex, me) = (&shared.mutex, &shared.contender_id);
        let bound = shared.config.request_timeout;
        // Always release: a call dropped in flight may have made us owner unknowingly.
        match timeout(bound, Box::pin(shared.store.release(mutex, me))).await {
            Ok(Ok(done)) => debug!(released = done, "stop: release"),
            Ok(Err(e)) => warn!("stop: release failed, the lease will free the mutex: {e}"),
            Err(_) => warn!("stop: release timed out, the lease will free the mutex"),
        }
        if !was_owner {
            let _ = timeout(bound, Box::pin(shared.store.leave(mutex, me))).await;
        }
    }

    /// Ends the ownership at `until` instead of now ([`LeaseStore::release_after`]).
    async fn hold_remotely(&self, until: Instant) -> Result<()> {
        let shared = self.shared.clone();
        let (mutex, me) = (&shared.mutex, &shared.contender_id);
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            self.release_remotely(true).await;
            return Ok(());
        }
        let bound = shared.config.request_timeout;
        let call = Box::pin(shared.store.release_after(mutex, me, left));
        match timeout(bound, call).await {
            Ok(Ok(true)) => {
                info!(?left, "released; the mutex stays held until the hold ends");
                Ok(())
            }
            Ok(Ok(false)) => Err(Error::Lost {
                mutex: mutex.clone(),
                reason: LossReason::TakenOver,
            }),
            Ok(Err(e)) => {
                warn!("stop: hold failed, the lease ends the ownership: {e}");
                Err(e)
            }
            Err(_) => Err(Error::backend(
                shared.store.backend(),
                format!(
                    "keeping mutex {mutex:?} held: no answer within {bound:?}; the ownership \
                     ends with its lease (maybe before the hold would have)"
                ),
            )),
        }
    }
}

async fn recv_event(events: &mut Option<mpsc::Receiver<StoreEvent>>) -> Option<StoreEvent> {
    match events {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}
