//! The driver task of a lease service: when to call the store, what an answer means, the
//! local lease deadline. It reports through an [`OwnershipTracker`].

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span, debug, info, warn};

use super::service::{OBSERVE_FLOOR, Shared};
use crate::backend::OwnershipTracker;
use crate::error::{Error, LossReason, Result};
use crate::events::{EventReceiver, TryRecvError};
#[cfg(feature = "bench")]
use crate::hops::Hop;
use crate::metrics::FailureKind;
use crate::owner::{ContendPeriod, MutexOwner};
use crate::rt::{sleep_until, timeout};
use crate::store::{LeaseReply, LeaseStore, StoreEvent};

/// The span of one store call: `simba_call` at DEBUG with `op`, `backend`, `mutex`,
/// `contender`, `fence` (when known; recorded later when the answer tells it) and
/// `outcome` (recorded when the call ends).
fn call_span<S: LeaseStore>(shared: &Shared<S>, op: &'static str, fence: Option<u64>) -> Span {
    tracing::debug_span!(
        "simba_call",
        op,
        backend = shared.store.backend(),
        mutex = %shared.mutex,
        contender = %shared.contender_id,
        fence,
        outcome = tracing::field::Empty,
    )
}

/// What a subscription came back with (bounded by the request timeout).
type Subscribed = std::result::Result<Result<Option<EventReceiver>>, crate::rt::Elapsed>;

/// What one attempt (acquire, renew or read) came back with.
enum Outcome {
    Stop,
    DeadlinePassed,
    Reply(Instant, Result<LeaseReply>),
    /// No answer within the call's bound.
    TimedOut(Error),
}

pub(super) struct Driver<S> {
    shared: Arc<Shared<S>>,
    /// The ownership state machine; the only writer of the status.
    tracker: OwnershipTracker,
    stop: CancellationToken,
    period: ContendPeriod,
    events: Option<EventReceiver>,
    subscribed: bool,
    next: Instant,
    /// The next attempt was asked for at once (start, or a pushed event): it goes ahead
    /// without waiting on a timer, because tokio rounds timer deadlines up to the next
    /// millisecond, which would add up to 1 ms to every acquisition and handoff.
    urgent: bool,
    /// An attempt was made: from now on a non-owner subscribes to pushed events.
    looked: bool,
    failures: u32,
}

/// The pause of a contender that does not own after its `failures`-th failed call in a
/// row: `retry` after the first, then doubling, up to the smaller of 8 × `retry` and the
/// ttl (never below `retry`), at a random point of its second half from the second on.
///
/// A backend that times out under load would otherwise get a call every `retry` from every
/// waiting mutex of every process, load that can keep it timing out (the likely reason a
/// Redis soak at 8,000 mutexes never recovered from a load spike, docs/testing.md). An
/// owner does not back off: its deadline bounds its retries.
pub(crate) fn backoff(retry: Duration, ttl: Duration, failures: u32) -> Duration {
    let cap = retry.max(ttl.min(retry.saturating_mul(8)));
    let doubled = retry.saturating_mul(1u32 << failures.saturating_sub(1).min(16));
    let delay = doubled.min(cap);
    if failures <= 1 {
        return delay;
    }
    let ms = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
    let jittered = crate::owner::random_in(ms - ms / 2..ms + 1);
    Duration::from_millis(u64::try_from(jittered).unwrap_or(0))
}

/// Whether `reply` is a permit store's [`LeaseReply::look_again_at`]: no holder named, the
/// time to look again in its lease times. A reply with no owner at all
/// ([`MutexOwner::NONE`](crate::MutexOwner::NONE), every time zero) is not one: it keeps
/// Simba's schedule rather than an immediate look.
fn is_look_again(reply: &LeaseReply) -> bool {
    let o = &reply.owner;
    o.owner_id.is_empty()
        && o.fence == 0
        && o.acquired_at == 0
        && o.ttl_at > 0
        && o.ttl_at == o.transition_at
}

/// How long a contender that does not own waits before it looks again, after `reply`.
///
/// - A store's [`LeaseReply::look_again_at`] names the instant itself: the waiter looks
///   again then, with no jitter on top (the store knows when the turn may come; jitter
///   would only delay it), or after `waiter_poll` if one is configured and comes first —
///   a store that asks to be looked at again does not promise a push before then, even
///   when it has an event channel.
/// - Otherwise Simba's schedule ([`ContendPeriod::next_delay`]: the owner's transition end
///   plus jitter), cut to a random time in the second half of `waiter_poll` when the store
///   cannot push (so that waiters that started together do not poll in lockstep).
fn waiter_delay(
    period: &ContendPeriod,
    reply: &LeaseReply,
    pushed: bool,
    waiter_poll: Option<Duration>,
) -> Duration {
    if is_look_again(reply) {
        let ms = reply.owner.transition_at.saturating_sub(reply.now).max(0);
        let at = Duration::from_millis(u64::try_from(ms).unwrap_or(0));
        return waiter_poll.map_or(at, |poll| at.min(poll));
    }
    let delay = period.next_delay(&reply.owner, reply.now);
    match waiter_poll {
        Some(poll) if !pushed => {
            let ms = i64::try_from(poll.as_millis()).unwrap_or(i64::MAX);
            let jittered = crate::owner::random_in(ms - ms / 2..ms + 1);
            delay.min(Duration::from_millis(u64::try_from(jittered).unwrap_or(0)))
        }
        _ => delay,
    }
}

impl<S: LeaseStore> Driver<S> {
    pub(super) fn new(
        shared: Arc<Shared<S>>,
        tracker: OwnershipTracker,
        stop: CancellationToken,
    ) -> Self {
        let period = ContendPeriod::new(shared.contender_id.clone())
            .with_jitter(
                shared.config.jitter.clone(),
                shared.config.jitter_no_transition.clone(),
            )
            .unwrap_or_else(|_| ContendPeriod::new(shared.contender_id.clone()));
        Driver {
            shared,
            tracker,
            stop,
            period,
            events: None,
            subscribed: false,
            next: Instant::now(),
            urgent: true,
            looked: false,
            failures: 0,
        }
    }

    fn contending(&self) -> bool {
        self.shared.out.contends()
    }

    fn deadline(&self) -> Option<Instant> {
        self.tracker.deadline()
    }

    pub(super) async fn run(mut self) {
        loop {
            if self.stop.is_cancelled() {
                break;
            }
            // Subscribing may take up to a request timeout, so it is tried only while not
            // owning: an owner's lease deadline must never wait behind it. The first attempt
            // subscribes at the same time (see `attempt`); this is for later ones.
            if !self.subscribed && !self.tracker.is_held() && self.looked {
                if !Box::pin(self.subscribe()).await {
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
                    self.tracker
                        .lose(LossReason::LeaseExpired, MutexOwner::NONE);
                    continue;
                }
            } else {
                // One timer for both instants (a timer is 112 bytes of every idle driver):
                // the deadline goes first when both are due, then an event that came.
                let wake = deadline.map_or(self.next, |d| d.min(self.next));
                tokio::select! {
                    biased;
                    _ = self.stop.cancelled() => break,
                    _ = sleep_until(wake) => {
                        if deadline.is_some_and(|d| d <= Instant::now()) {
                            self.tracker.lose(LossReason::LeaseExpired, MutexOwner::NONE);
                            self.next = Instant::now();
                            continue;
                        }
                        if let Some(ev) = try_event(&mut self.events) {
                            self.on_event(ev);
                            continue;
                        }
                    }
                    ev = recv_event(&mut self.events) => {
                        self.on_event(ev);
                        continue;
                    }
                }
            }
            self.urgent = false;
            let first = !self.looked;
            self.looked = true;
            // Boxed, as the other calls below: a driver waits between calls for most of
            // its life, and its future is as large as the largest state it can be in (an
            // attempt's timers and call futures inline took about 1 KB per service).
            let (outcome, subscribed) = Box::pin(self.attempt(first)).await;
            if let Some(result) = subscribed {
                self.on_subscribed(result);
            }
            let answered = matches!(outcome, Outcome::Reply(_, Ok(_)));
            match outcome {
                Outcome::Stop => break,
                Outcome::DeadlinePassed => {
                    self.tracker
                        .lose(LossReason::LeaseExpired, MutexOwner::NONE);
                    self.next = Instant::now();
                }
                Outcome::Reply(sent, Ok(reply)) => self.on_reply(sent, reply),
                Outcome::Reply(_, Err(e)) => self.on_failure(FailureKind::of(&e), e),
                Outcome::TimedOut(e) => self.on_failure(FailureKind::Timeout, e),
            }
            if first && answered && !self.tracker.is_held() {
                self.look_again_if_subscribed();
            }
        }
        Box::pin(self.shutdown()).await;
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
            _ = self.stop.cancelled() => return false,
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
                if !self.tracker.is_held() && self.contending() =>
            {
                debug!(%owner_id, "acquired elsewhere");
                // Nothing to do now: the next attempt is due when that lease ends.
            }
            Some(ev) => {
                // Observers re-read on every event, contenders contend again.
                debug!(?ev, "store event: looking now");
                if ev == StoreEvent::Released && self.contending() {
                    #[cfg(feature = "bench")]
                    crate::hops::record(Hop::WaiterWoken, &self.shared.mutex);
                    self.tracker.handoff_begins();
                }
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
        let owning = self.tracker.is_held();
        let subscribe = (first && !self.subscribed && !owning)
            .then(|| Box::pin(shared.store.subscribe(&shared.mutex, &shared.contender_id)));
        let op = match (shared.out.contends(), owning) {
            (false, _) => "owner",
            (true, true) => "guard",
            (true, false) => "acquire",
        };
        let span = call_span(&shared, op, self.tracker.held().map(|h| h.fence));
        let call = Box::pin(
            async {
                match (shared.out.contends(), owning) {
                    (false, _) => shared.store.owner(&shared.mutex).await,
                    (true, true) => {
                        shared
                            .store
                            .guard(&shared.mutex, &shared.contender_id, lease)
                            .await
                    }
                    (true, false) => {
                        shared
                            .store
                            .acquire(&shared.mutex, &shared.contender_id, lease)
                            .await
                    }
                }
            }
            .instrument(span.clone()),
        );
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
        // A renewal that does not answer is a backend that does not answer: the owner is
        // suspect from `suspect_at` on while the call goes on, as after a failed renewal.
        // The deadline still ends the ownership, whatever the call does.
        let mut suspect_at = match deadline {
            Some(d) if owning && self.contending() => Some(suspect_after(sent, d, request_timeout)),
            _ => None,
        };
        #[cfg(feature = "bench")]
        if acquiring {
            crate::hops::record(Hop::AcquireSent, &shared.mutex);
        }
        let mut both = std::pin::pin!(both);
        let result = loop {
            break tokio::select! {
                biased;
                _ = self.stop.cancelled(), if !acquiring => (Outcome::Stop, None),
                _ = sleep_until(deadline.unwrap_or(sent)), if deadline.is_some() => (Outcome::DeadlinePassed, None),
                (r, subscribed) = &mut both => (match r {
                    Ok(r) => Outcome::Reply(sent, r),
                    Err(_) => Outcome::TimedOut(Error::backend(
                        shared.store.backend(),
                        format!("call did not answer within {bound:?}"),
                    )),
                }, subscribed),
                _ = sleep_until(suspect_at.unwrap_or(sent)), if suspect_at.is_some() => {
                    suspect_at = None;
                    self.tracker.mark_suspect(&format_args!(
                        "renewal unanswered for {:?}",
                        Instant::now().saturating_duration_since(sent)
                    ));
                    continue;
                }
            };
        };
        #[cfg(feature = "bench")]
        if acquiring {
            crate::hops::record(Hop::AcquireAnswered, &shared.mutex);
        }
        record_outcome(&span, &result.0, &shared.contender_id);
        result
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
            self.tracker.observe(reply.owner.clone());
            self.next = now + self.observe_delay(&reply.owner, reply.now);
            self.tracker.count_attempt(None);
            return;
        }
        if self.tracker.is_held() {
            // A renewal the backend answered (whatever it said).
            self.shared
                .out
                .labels()
                .renewal(now.saturating_duration_since(sent));
        }
        let me = &self.shared.contender_id;
        if reply.owner.is_owned_by_at(me, reply.now) {
            let lease = self.shared.config.lease().total();
            let deadline = sent + lease.saturating_sub(self.shared.config.drift_margin);
            self.tracker.hold(reply.owner.clone(), Some(deadline));
            let period = self.period.next_delay(&reply.owner, reply.now);
            let until_deadline = deadline.saturating_duration_since(now);
            self.next = now + period.min(until_deadline * 2 / 3);
        } else {
            self.tracker
                .lose(LossReason::TakenOver, reply.owner.clone());
            self.tracker.observe(reply.owner.clone());
            self.tracker.handoff_missed();
            let poll = self.shared.config.waiter_poll;
            self.next = now + waiter_delay(&self.period, &reply, self.events.is_some(), poll);
        }
        self.tracker.count_attempt(None);
    }

    fn on_failure(&mut self, kind: FailureKind, e: Error) {
        self.failures = self.failures.saturating_add(1);
        let now = Instant::now();
        let retry = self.shared.config.retry_interval;
        match self.deadline() {
            Some(deadline) => {
                self.tracker
                    .mark_suspect(&format_args!("renewal failed ({e})"));
                // The deadline stays where the last success put it.
                let left = deadline.saturating_duration_since(now);
                self.next = now + retry.min(left / 3);
            }
            None => {
                let delay = backoff(retry, self.shared.config.ttl, self.failures);
                if self.failures == 1 {
                    warn!(
                        "backend call failed, retrying in {delay:?}, and less often while it fails: {e}"
                    );
                } else {
                    debug!("backend call failed again, retrying in {delay:?}: {e}");
                }
                self.next = now + delay;
            }
        }
        self.tracker.count_failure(kind, e.to_string());
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
            let was_owner = self.tracker.is_held();
            let fence = self.tracker.held().map(|h| h.fence);
            let now = Instant::now();
            // The ownership a hold can keep: one that stands by the local deadline.
            let standing = self.deadline().is_some_and(|d| d > now);
            let earlier_loss = self.tracker.last_loss().map(|l| l.reason);
            // Stop acting as owner before the mutex is freed for others.
            self.tracker.lose(LossReason::Released, MutexOwner::NONE);
            // What a release that finds the mutex no longer ours says: another contender
            // (or a hand) changed it while we believed we owned it; past the local
            // deadline, the lease may simply have run out.
            let found = if standing {
                LossReason::TakenOver
            } else {
                LossReason::LeaseExpired
            };
            match hold {
                Some(req) if standing => {
                    let outcome = self.hold_remotely(req.until, fence).await;
                    if let (Err(Error::Lost { reason, .. }), Some(fence)) = (&outcome, fence) {
                        self.tracker.lost_at_release(fence, *reason);
                    }
                    let _ = req.reply.send(outcome);
                }
                Some(req) => {
                    let released = self.release_remotely(was_owner, fence).await;
                    self.report_release(released, was_owner, fence, found);
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
                None => {
                    let released = self.release_remotely(was_owner, fence).await;
                    self.report_release(released, was_owner, fence, found);
                }
            }
        } else if let Some(req) = hold {
            let _ = req.reply.send(Err(Error::InvalidState(
                "an observer holds nothing".to_owned(),
            )));
        }
        self.tracker.finish();
    }

    /// A release of an ownership this run held until then that the backend answered with
    /// "not the owner" is a loss found at the release (`reason`); an acquisition whose
    /// answer never came (not `was_owner`) was never an ownership, and an error or a
    /// timeout proves nothing: both stay quiet.
    fn report_release(
        &mut self,
        released: Released,
        was_owner: bool,
        fence: Option<u64>,
        reason: LossReason,
    ) {
        if let (Released::NotOwner, true, Some(fence)) = (released, was_owner, fence) {
            self.tracker.lost_at_release(fence, reason);
        }
    }

    /// Releases on the backend, bounded by the request timeout (best effort: the lease
    /// frees the mutex anyway); says what the backend answered.
    async fn release_remotely(&self, was_owner: bool, fence: Option<u64>) -> Released {
        let shared = self.shared.clone();
        let (mutex, me) = (&shared.mutex, &shared.contender_id);
        let bound = shared.config.request_timeout;
        let span = call_span(&shared, "release", fence);
        // Always release: a call dropped in flight may have made us owner unknowingly.
        let call = Box::pin(shared.store.release(mutex, me).instrument(span.clone()));
        #[cfg(feature = "bench")]
        crate::hops::record(Hop::ReleaseSent, mutex);
        let released = timeout(bound, call).await;
        #[cfg(feature = "bench")]
        crate::hops::record(Hop::ReleaseAnswered, mutex);
        let answer = match released {
            Ok(Ok(done)) => {
                span.record("outcome", if done { "released" } else { "not_owner" });
                debug!(released = done, "stop: release");
                if done {
                    Released::Done
                } else {
                    Released::NotOwner
                }
            }
            Ok(Err(e)) => {
                span.record("outcome", "error");
                self.tracker.record_failure(FailureKind::of(&e));
                warn!("stop: release failed, the lease will free the mutex: {e}");
                Released::Unknown
            }
            Err(_) => {
                span.record("outcome", "timeout");
                self.tracker.record_failure(FailureKind::Timeout);
                warn!("stop: release timed out, the lease will free the mutex");
                Released::Unknown
            }
        };
        if !was_owner {
            let _ = timeout(bound, Box::pin(shared.store.leave(mutex, me))).await;
        }
        answer
    }

    /// Ends the ownership at `until` instead of now ([`LeaseStore::release_after`]).
    async fn hold_remotely(&self, until: Instant, fence: Option<u64>) -> Result<()> {
        let shared = self.shared.clone();
        let (mutex, me) = (&shared.mutex, &shared.contender_id);
        let left = until.saturating_duration_since(Instant::now());
        let not_owner = || Error::Lost {
            mutex: mutex.clone(),
            reason: LossReason::TakenOver,
        };
        if left.is_zero() {
            return match self.release_remotely(true, fence).await {
                Released::NotOwner => Err(not_owner()),
                Released::Done | Released::Unknown => Ok(()),
            };
        }
        let bound = shared.config.request_timeout;
        let span = call_span(&shared, "release_after", fence);
        let call = Box::pin(
            shared
                .store
                .release_after(mutex, me, left)
                .instrument(span.clone()),
        );
        let result = timeout(bound, call).await;
        span.record(
            "outcome",
            match &result {
                Ok(Ok(true)) => "released",
                Ok(Ok(false)) => "not_owner",
                Ok(Err(_)) => "error",
                Err(_) => "timeout",
            },
        );
        match result {
            Ok(Ok(true)) => {
                info!(?left, "released; the mutex stays held until the hold ends");
                Ok(())
            }
            Ok(Ok(false)) => Err(not_owner()),
            Ok(Err(e)) => {
                self.tracker.record_failure(FailureKind::of(&e));
                warn!("stop: hold failed, the lease ends the ownership: {e}");
                Err(e)
            }
            Err(_) => {
                self.tracker.record_failure(FailureKind::Timeout);
                Err(Error::backend(
                    shared.store.backend(),
                    format!(
                        "keeping mutex {mutex:?} held: no answer within {bound:?}; the ownership \
                     ends with its lease (maybe before the hold would have)"
                    ),
                ))
            }
        }
    }
}

/// What the backend answered a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Released {
    /// It freed the mutex: this contender owned it.
    Done,
    /// This contender did not own it (any more, or ever).
    NotOwner,
    /// No answer (an error, a timeout): nothing is known.
    Unknown,
}

/// When a renewal sent at `sent` and still unanswered makes the ownership suspect: after
/// the request timeout, or two thirds of the way from `sent` to the local `deadline` if
/// that is sooner. So a hanging renewal leaves at least a third of the time it had
/// suspect before the loss (a failing one is suspect as soon as it fails).
fn suspect_after(sent: Instant, deadline: Instant, request_timeout: Duration) -> Instant {
    let left = deadline.saturating_duration_since(sent);
    sent + request_timeout.min(left * 2 / 3)
}

/// Records how a call of [`Driver::attempt`] ended on its span: `owner` (this contender
/// owns, with the fence), `other` (another contender owns, with its fence), `free`, `error`,
/// `timeout`, `deadline` (the lease deadline passed first) or `stopped`.
fn record_outcome(span: &Span, outcome: &Outcome, me: &str) {
    let what = match outcome {
        Outcome::Stop => "stopped",
        Outcome::DeadlinePassed => "deadline",
        Outcome::TimedOut(_) => "timeout",
        Outcome::Reply(_, Err(_)) => "error",
        Outcome::Reply(_, Ok(reply)) => {
            let owner = &reply.owner;
            if owner.is_in_lease(reply.now) {
                span.record("fence", owner.fence);
            }
            if owner.is_owned_by_at(me, reply.now) {
                "owner"
            } else if owner.is_in_lease(reply.now) {
                "other"
            } else {
                "free"
            }
        }
    };
    span.record("outcome", what);
}

/// An event already queued: `Some(None)` when the store dropped the channel.
fn try_event(events: &mut Option<EventReceiver>) -> Option<Option<StoreEvent>> {
    match events.as_mut()?.try_recv() {
        Ok(ev) => Some(Some(ev)),
        Err(TryRecvError::Empty) => None,
        Err(TryRecvError::Disconnected) => Some(None),
    }
}

async fn recv_event(events: &mut Option<EventReceiver>) -> Option<StoreEvent> {
    match events {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::{backoff, waiter_delay};
    use crate::owner::{ContendPeriod, MutexOwner};
    use crate::store::LeaseReply;
    use std::time::Duration;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_first_retry_is_the_interval_then_it_doubles_up_to_the_cap() {
        let (retry, ttl) = (MS * 100, MS * 10_000);
        assert_eq!(backoff(retry, ttl, 1), retry);
        for _ in 0..200 {
            for (failures, full) in [(2, 200), (3, 400), (4, 800), (5, 800), (40, 800)] {
                let d = backoff(retry, ttl, failures);
                assert!(
                    d >= MS * (full / 2) && d <= MS * full,
                    "failure {failures}: {d:?} not in the second half of {full} ms"
                );
            }
        }
    }

    #[test]
    fn a_short_ttl_caps_the_pause_but_never_below_the_interval() {
        let retry = MS * 1000;
        for _ in 0..100 {
            assert!(backoff(retry, MS * 3000, 10) <= MS * 3000);
            assert!(backoff(retry, MS * 3000, 10) >= MS * 1500);
            // A ttl shorter than the interval: the interval stays the pause.
            assert!(backoff(retry, MS * 500, 10) <= retry);
            assert!(backoff(retry, MS * 500, 10) >= retry / 2);
        }
    }

    #[test]
    fn the_pauses_are_spread_so_that_contenders_do_not_retry_in_step() {
        let pauses: std::collections::HashSet<Duration> = (0..50)
            .map(|_| backoff(MS * 1000, MS * 30_000, 4))
            .collect();
        assert!(pauses.len() > 10, "{} distinct pauses of 50", pauses.len());
    }

    /// A permit store's look-again time is kept to the millisecond, with or without a
    /// push channel (the default jitter without a transition adds 0 to 1,000 ms), and a
    /// configured `waiter_poll` caps it; other replies keep Simba's jittered schedule.
    #[test]
    fn a_look_again_reply_is_waited_for_without_jitter() {
        let period = ContendPeriod::new("me".to_owned());
        let now = 1_000_000;
        let look = LeaseReply::look_again_at(now + 250, now);
        for _ in 0..200 {
            for pushed in [true, false] {
                assert_eq!(waiter_delay(&period, &look, pushed, None), MS * 250);
                assert_eq!(waiter_delay(&period, &look, pushed, Some(MS * 50)), MS * 50);
                assert_eq!(
                    waiter_delay(&period, &look, pushed, Some(MS * 400)),
                    MS * 250
                );
            }
        }
        // No owner at all is not a look-again reply: Simba's schedule, not at once.
        let none = LeaseReply {
            owner: MutexOwner::NONE,
            now,
        };
        assert!(!super::is_look_again(&none));
        // A look-again time already past: at once.
        let past = LeaseReply::look_again_at(now - 5, now);
        assert_eq!(waiter_delay(&period, &past, true, None), Duration::ZERO);
        // A named owner whose lease has a transition: its end plus jitter in [-200, 1000).
        let owned = LeaseReply {
            owner: MutexOwner {
                owner_id: "other".to_owned(),
                acquired_at: now - 100,
                ttl_at: now + 300,
                transition_at: now + 500,
                fence: 7,
            },
            now,
        };
        let delays: std::collections::HashSet<Duration> = (0..100)
            .map(|_| {
                let d = waiter_delay(&period, &owned, true, Some(MS * 50));
                assert!(d >= MS * 300 && d < MS * 1500, "{d:?}");
                d
            })
            .collect();
        assert!(
            delays.len() > 10,
            "jitter kept: {} distinct delays",
            delays.len()
        );
        // Without a push channel the poll cuts it, in its second half.
        let d = waiter_delay(&period, &owned, false, Some(MS * 50));
        assert!(d >= MS * 25 && d <= MS * 50, "{d:?}");
    }
}
