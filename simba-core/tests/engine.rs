//! The lease engine under a store whose calls succeed, fail, stall or hang, in paused tokio
//! time: every instant below is exact, not a wall-clock guess.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use simba_core::backend::LeaseStore;
use simba_core::fault::{Behavior, FaultStore, Op};
use simba_core::{
    ContendService, ContendServiceFactory, Contender, ContenderStatus, LeaderScheduler,
    LeaseConfig, LeaseServiceFactory, Locker, LossReason, MemoryStore, MutexState, Schedule,
};
use tokio::time::Instant;

const TTL: Duration = Duration::from_millis(1000);
const TRANSITION: Duration = Duration::from_millis(500);
const DRIFT: Duration = Duration::from_millis(100);

fn config() -> LeaseConfig {
    LeaseConfig {
        drift_margin: DRIFT,
        request_timeout: Duration::from_secs(3),
        retry_interval: Duration::from_millis(100),
        ..LeaseConfig::with_lease(TTL, TRANSITION)
    }
}

/// When, what ("acquired" / "released"), fence, and the loss reason.
type Entry = (Instant, &'static str, u64, Option<LossReason>);

#[derive(Default)]
struct Events {
    log: Mutex<Vec<Entry>>,
}

impl Events {
    fn entries(&self) -> Vec<Entry> {
        self.log.lock().expect("log").clone()
    }
}

struct Recorder(Arc<Events>);
impl Contender for Recorder {
    fn on_acquired(&self, s: &MutexState) {
        self.0
            .log
            .lock()
            .expect("log")
            .push((Instant::now(), "acquired", s.after.fence, None));
    }
    fn on_released(&self, s: &MutexState, reason: LossReason) {
        let fence = s.before.fence;
        self.0
            .log
            .lock()
            .expect("log")
            .push((Instant::now(), "released", fence, Some(reason)));
    }
}

struct Setup {
    memory: MemoryStore,
    store: FaultStore<MemoryStore>,
    factory: LeaseServiceFactory<FaultStore<MemoryStore>>,
}

fn setup() -> Setup {
    let memory = MemoryStore::new();
    let store = FaultStore::new(memory.clone());
    let factory = LeaseServiceFactory::new(store.clone(), config()).expect("config");
    Setup {
        memory,
        store,
        factory,
    }
}

fn contender(setup: &Setup, m: &str) -> (Arc<dyn ContendService>, Arc<Events>) {
    let events = Arc::new(Events::default());
    let svc = setup
        .factory
        .create_contend_service(m, Arc::new(Recorder(events.clone())))
        .expect("service");
    (svc, events)
}

async fn wait(
    svc: &Arc<dyn ContendService>,
    pred: impl FnMut(&ContenderStatus) -> bool,
) -> ContenderStatus {
    let mut rx = svc.status();
    let s = tokio::time::timeout(Duration::from_secs(60), rx.wait_for(pred))
        .await
        .expect("condition within 60 s of paused time")
        .expect("status channel open");
    s.clone()
}

/// Waits until `svc` owns the mutex; its fence.
async fn held_fence(svc: &Arc<dyn ContendService>) -> Option<u64> {
    wait(svc, |st| st.held.is_some())
        .await
        .held
        .map(|h| h.fence)
}

#[tokio::test(start_paused = true)]
async fn hanging_renewal_is_a_loss_at_the_local_deadline() {
    let s = setup();
    let (svc, events) = contender(&s, "m");
    let t0 = Instant::now();
    svc.start().expect("start");
    wait(&svc, |st| st.held.is_some()).await;
    s.store.control().set_all(Behavior::Hang);
    let st = wait(&svc, |st| st.held.is_none()).await;
    let lost_at = Instant::now();
    assert_eq!(
        st.last_loss.map(|l| l.reason),
        Some(LossReason::LeaseExpired)
    );
    // The acquire request was sent at t0: the deadline is t0 + ttl + transition - drift,
    // although the renewal never answered.
    assert_eq!(lost_at - t0, TTL + TRANSITION - DRIFT);
    assert_eq!(
        s.store.control().calls(Op::Guard),
        1,
        "one renewal, hanging"
    );
    let log = events.entries();
    assert_eq!(log.len(), 2, "{log:?}");
    assert_eq!(log[1].3, Some(LossReason::LeaseExpired));
    // The backend's lease outlives the local belief: nobody else could own before.
    let backend_expiry = s
        .memory
        .owner("m")
        .await
        .expect("owner")
        .owner
        .transition_at;
    assert!(
        backend_expiry >= s.memory.now() + 100 - 1,
        "local loss comes before the backend lease ends"
    );
    svc.stop().await.expect("stop");
}

/// A renewal that hangs is a backend that does not answer: the owner is suspect well
/// before its deadline (it was lost at the deadline without ever being suspect before),
/// and still loses the ownership exactly at the deadline.
#[tokio::test(start_paused = true)]
async fn a_hanging_renewal_makes_the_owner_suspect_before_the_deadline() {
    let s = setup();
    let (svc, events) = contender(&s, "m");
    let t0 = Instant::now();
    svc.start().expect("start");
    let fence = held_fence(&svc).await;
    s.store.control().set_all(Behavior::Hang);
    let st = wait(&svc, |st| st.held.is_none_or(|h| h.suspect)).await;
    let suspect_at = Instant::now() - t0;
    assert_eq!(
        st.held.map(|h| (h.fence, h.suspect)),
        fence.map(|f| (f, true)),
        "suspect before lost ({suspect_at:?})"
    );
    assert!(
        svc.is_owner(),
        "a hanging renewal alone does not end ownership"
    );
    // The renewal went out at two thirds of the 1.4 s to the deadline (~934 ms); it is
    // suspect two thirds of the rest later (~1245 ms), not at the 3 s request timeout.
    assert!(
        suspect_at > Duration::from_millis(1200) && suspect_at < Duration::from_millis(1300),
        "{suspect_at:?}"
    );
    let st = wait(&svc, |st| st.held.is_none()).await;
    assert_eq!(
        Instant::now() - t0,
        TTL + TRANSITION - DRIFT,
        "lost at the deadline"
    );
    assert_eq!(
        st.last_loss.map(|l| l.reason),
        Some(LossReason::LeaseExpired)
    );
    assert_eq!(
        s.store.control().calls(Op::Guard),
        1,
        "one renewal, hanging"
    );
    assert_eq!(events.entries().len(), 2, "{:?}", events.entries());
    s.store.control().set_all(Behavior::Pass);
    svc.stop().await.expect("stop");
}

/// A renewal that answers late but before the deadline: suspect while it is unanswered, no
/// longer suspect (same ownership, no loss) once it answers.
#[tokio::test(start_paused = true)]
async fn a_slow_renewal_is_suspect_until_it_answers() {
    let s = setup();
    let (svc, events) = contender(&s, "m");
    svc.start().expect("start");
    let fence = held_fence(&svc).await;
    // Sent at ~934 ms, suspect at ~1245 ms, answered at ~1334 ms, deadline 1400 ms.
    s.store
        .control()
        .set(Op::Guard, Behavior::Delay(Duration::from_millis(400)));
    wait(&svc, |st| st.held.is_none_or(|h| h.suspect)).await;
    assert!(svc.is_owner());
    s.store.control().set(Op::Guard, Behavior::Pass);
    let st = wait(&svc, |st| st.held.is_none_or(|h| !h.suspect)).await;
    assert_eq!(
        st.held.map(|h| h.fence),
        fence,
        "same ownership, not suspect"
    );
    assert_eq!(events.entries().len(), 1, "no loss: {:?}", events.entries());
    svc.stop().await.expect("stop");
}

/// A contender that does not own backs off while its calls fail: the retry interval (100
/// ms) after the first failure, then doubling up to 800 ms (8 × the interval, under the 1 s
/// ttl), so a backend that times out under load is not kept busy by every waiting mutex.
/// Once the backend answers again it owns within one capped pause.
#[tokio::test(start_paused = true)]
async fn a_waiter_backs_off_while_the_backend_fails_and_resumes_when_it_answers() {
    let s = setup();
    s.store.control().set(Op::Acquire, Behavior::Fail);
    let (svc, _events) = contender(&s, "m");
    svc.start().expect("start");
    tokio::time::sleep(Duration::from_secs(10)).await;
    let calls = s.store.control().calls(Op::Acquire);
    // At a flat 100 ms it would be about 100 calls; with the back-off: 1 + 1 (100 ms) + the
    // pauses of 100-200, 200-400 and 400-800 ms, then one every 400-800 ms: 14-28.
    assert!(
        (12..=30).contains(&calls),
        "{calls} calls in 10 s of failures"
    );
    s.store.control().set(Op::Acquire, Behavior::Pass);
    let since = Instant::now();
    wait(&svc, |st| st.held.is_some()).await;
    assert!(
        Instant::now() - since <= Duration::from_millis(800),
        "owned {:?} after the backend answered again",
        Instant::now() - since
    );
    svc.stop().await.expect("stop");
}

#[tokio::test(start_paused = true)]
async fn failing_renewals_make_the_owner_suspect_and_a_success_recovers() {
    let s = setup();
    let (svc, events) = contender(&s, "m");
    svc.start().expect("start");
    let fence = held_fence(&svc).await;
    s.store.control().set(Op::Guard, Behavior::Fail);
    wait(&svc, |st| st.held.is_some_and(|h| h.suspect)).await;
    assert!(
        svc.is_owner(),
        "a failed renewal alone does not end ownership"
    );
    let failures_seen = s.store.control().calls(Op::Guard);
    s.store.control().set(Op::Guard, Behavior::Pass);
    let st = wait(&svc, |st| st.held.is_some_and(|h| !h.suspect)).await;
    assert_eq!(
        st.held.map(|h| h.fence),
        fence,
        "same ownership after recovery"
    );
    assert!(
        s.store.control().calls(Op::Guard) > failures_seen,
        "it retried"
    );
    assert_eq!(
        events.entries().len(),
        1,
        "no loss was reported: {:?}",
        events.entries()
    );
    svc.stop().await.expect("stop");
}

#[tokio::test(start_paused = true)]
async fn renewals_failing_until_the_deadline_end_ownership_there() {
    let s = setup();
    let (svc, _events) = contender(&s, "m");
    let t0 = Instant::now();
    svc.start().expect("start");
    wait(&svc, |st| st.held.is_some()).await;
    s.store.control().set(Op::Guard, Behavior::Fail);
    s.store.control().set(Op::Acquire, Behavior::Fail);
    let st = wait(&svc, |st| st.held.is_none()).await;
    assert_eq!(Instant::now() - t0, TTL + TRANSITION - DRIFT);
    assert_eq!(
        st.last_loss.map(|l| l.reason),
        Some(LossReason::LeaseExpired)
    );
    assert!(
        s.store.control().calls(Op::Guard) >= 3,
        "retried before giving up"
    );
    svc.stop().await.expect("stop");
}

#[tokio::test(start_paused = true)]
async fn stop_releases_on_the_backend_and_restart_contends_again() {
    let s = setup();
    let (svc, events) = contender(&s, "m");
    svc.start().expect("start");
    let first = wait(&svc, |st| st.held.is_some())
        .await
        .held
        .map_or(0, |h| h.fence);
    svc.stop().await.expect("stop");
    assert_eq!(s.store.control().calls(Op::Release), 1);
    assert!(
        !s.memory.owner("m").await.expect("owner").owner.has_owner(),
        "released remotely"
    );
    assert_eq!(events.entries()[1].3, Some(LossReason::Released));
    svc.start().expect("restart");
    let second = wait(&svc, |st| st.held.is_some())
        .await
        .held
        .map_or(0, |h| h.fence);
    assert!(second > first);
    svc.stop().await.expect("stop");
}

#[tokio::test(start_paused = true)]
async fn results_arriving_after_stop_are_ignored() {
    let s = setup();
    let (svc, events) = contender(&s, "m");
    s.store.control().set(Op::Acquire, Behavior::ApplyThenHang);
    svc.start().expect("start");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(s.store.control().calls(Op::Acquire), 1);
    // The backend applied the acquisition, but the answer never came.
    assert!(s.memory.owner("m").await.expect("owner").owner.has_owner());
    svc.stop().await.expect("stop");
    assert!(
        events.entries().is_empty(),
        "no callback for an answer that never came"
    );
    assert!(!svc.is_owner());
    assert!(
        !s.memory.owner("m").await.expect("owner").owner.has_owner(),
        "stop released what the unanswered call took"
    );
}

#[tokio::test(start_paused = true)]
async fn a_dropped_acquire_leaves_no_ownership_behind() {
    let s = setup();
    let factory: Arc<dyn ContendServiceFactory> =
        Arc::new(LeaseServiceFactory::new(s.store.clone(), config()).expect("config"));
    let locker = Locker::new(factory, "m").expect("locker");
    s.store.control().set(Op::Acquire, Behavior::ApplyThenHang);
    let attempt = tokio::time::timeout(Duration::from_millis(50), locker.acquire()).await;
    assert!(attempt.is_err(), "the acquire hung and was dropped");
    assert!(
        s.memory.owner("m").await.expect("owner").owner.has_owner(),
        "the backend applied it"
    );
    // The contention stops in the background. Its acquisition, sent but never answered,
    // may still win on a real server, so the stop waits for it (up to the request timeout)
    // before it releases; `settled` waits for all of that.
    locker.settled().await;
    assert!(
        !s.memory.owner("m").await.expect("owner").owner.has_owner(),
        "the dropped acquire was released"
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiter_takes_over_on_the_release_push_without_polling() {
    let s = setup();
    let (a, _) = contender(&s, "m");
    let (b, _) = contender(&s, "m");
    a.start().expect("a");
    wait(&a, |st| st.held.is_some()).await;
    b.start().expect("b");
    wait(&b, |st| st.attempts > 0).await;
    let t = Instant::now();
    a.stop().await.expect("stop a");
    wait(&b, |st| st.held.is_some()).await;
    assert_eq!(
        Instant::now() - t,
        Duration::ZERO,
        "handoff needed no timer"
    );
    b.stop().await.expect("stop b");
}

#[tokio::test(start_paused = true)]
async fn a_non_owner_polls_at_the_end_of_the_lease_plus_jitter() {
    let s = setup();
    let (a, _) = contender(&s, "m");
    a.start().expect("a");
    wait(&a, |st| st.held.is_some()).await;
    // b is another process on the same backend, without a push channel: it must poll on
    // the contend period.
    let b_store = FaultStore::new(s.memory.clone());
    b_store.control().set(Op::Subscribe, Behavior::Fail);
    let b_factory = LeaseServiceFactory::new(b_store.clone(), config()).expect("config");
    let b = b_factory
        .create_contend_service("m", Arc::new(simba_core::SilentContender))
        .expect("b");
    b.start().expect("b");
    wait(&b, |st| st.attempts > 0).await;
    let seen = b_store.control().calls(Op::Acquire);
    // a dies silently: every call it makes hangs from now on.
    s.store.control().set_all(Behavior::Hang);
    let t = Instant::now();
    wait(&b, |st| st.held.is_some()).await;
    let took = Instant::now() - t;
    // It takes over after a's lease (1.5 s after a's last renewal) plus at most 1 s jitter.
    assert!(
        took <= TTL + TRANSITION + Duration::from_millis(1000),
        "{took:?}"
    );
    assert!(!a.is_owner(), "a gave up by its deadline");
    // b did not spin: a handful of polls, not hundreds.
    assert!(b_store.control().calls(Op::Acquire) - seen < 10);
    b.stop().await.expect("stop");
    s.store.control().set_all(Behavior::Pass);
    a.stop().await.expect("stop");
}

#[tokio::test(start_paused = true)]
async fn a_reply_naming_another_owner_is_a_takeover() {
    let s = setup();
    let (a, events) = contender(&s, "m");
    a.start().expect("a");
    wait(&a, |st| st.held.is_some()).await;
    // An operator frees the mutex behind the owner's back and someone else takes it.
    assert!(
        s.memory
            .release("m", a.contender_id())
            .await
            .expect("release")
    );
    let lease = simba_core::backend::Lease {
        ttl: TTL,
        transition: TRANSITION,
    };
    s.memory
        .acquire("m", "intruder", lease)
        .await
        .expect("intruder");
    let t = Instant::now();
    let st = wait(&a, |st| st.held.is_none()).await;
    assert_eq!(st.last_loss.map(|l| l.reason), Some(LossReason::TakenOver));
    assert_eq!(st.state.after.owner_id, "intruder");
    assert_eq!(
        Instant::now() - t,
        Duration::ZERO,
        "the acquisition push made it look at once"
    );
    assert_eq!(
        events.entries().last().and_then(|e| e.3),
        Some(LossReason::TakenOver)
    );
    a.stop().await.expect("stop");
}

#[tokio::test(start_paused = true)]
async fn scheduled_work_is_cancelled_when_ownership_is_lost() {
    let s = setup();
    let started = Arc::new(AtomicUsize::new(0));
    let cancelled = Arc::new(AtomicBool::new(false));
    struct OnDrop(Arc<AtomicBool>);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let (st, ca) = (started.clone(), cancelled.clone());
    let scheduler = LeaderScheduler::new(
        &s.factory,
        "m",
        Schedule::FixedDelay {
            initial_delay: Duration::ZERO,
            delay: Duration::from_millis(10),
        },
        move |_ctx| {
            let (st, ca) = (st.clone(), ca.clone());
            async move {
                st.fetch_add(1, Ordering::SeqCst);
                let _guard = OnDrop(ca);
                // Long work, still running when the lease is lost.
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
        },
    )
    .expect("scheduler");
    scheduler.start().expect("start");
    wait(scheduler.service(), |st| st.held.is_some()).await;
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(started.load(Ordering::SeqCst), 1);
    assert!(!cancelled.load(Ordering::SeqCst));
    s.store.control().set_all(Behavior::Hang);
    wait(scheduler.service(), |st| st.held.is_none()).await;
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert!(
        cancelled.load(Ordering::SeqCst),
        "running work was cancelled on loss"
    );
    assert_eq!(
        started.load(Ordering::SeqCst),
        1,
        "no new run while not owner"
    );
    s.store.control().set_all(Behavior::Pass);
    scheduler.stop().await.expect("stop");
}

/// The work context's token reaches what `abort` cannot: a task the work spawned. It is
/// cancelled when the ownership ends, and again (a new token) when the scheduler stops.
#[tokio::test(start_paused = true)]
async fn work_context_token_stops_spawned_work_on_loss_and_on_stop() {
    let s = setup();
    // Fences whose helper task saw its token cancelled, in order.
    let stopped: Arc<Mutex<Vec<u64>>> = Arc::default();
    let seen_cancelled_at_start = Arc::new(AtomicBool::new(false));
    let (st, early) = (stopped.clone(), seen_cancelled_at_start.clone());
    let scheduler = LeaderScheduler::new(
        &s.factory,
        "m",
        Schedule::FixedRate {
            initial_delay: Duration::ZERO,
            period: Duration::from_secs(3600),
        },
        move |ctx| {
            let (st, early) = (st.clone(), early.clone());
            async move {
                if ctx.is_cancelled() {
                    early.store(true, Ordering::SeqCst);
                }
                // A helper the work hands its token to; aborting the run does not stop it.
                let token = ctx.token().clone();
                let fence = ctx.fence;
                tokio::spawn(async move {
                    token.cancelled().await;
                    st.lock().expect("log").push(fence);
                });
                ctx.cancelled().await;
            }
        },
    )
    .expect("scheduler");
    scheduler.start().expect("start");
    wait(scheduler.service(), |st| st.held.is_some()).await;
    let first = scheduler
        .service()
        .status()
        .borrow()
        .held
        .expect("held")
        .fence;
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert!(
        stopped.lock().expect("log").is_empty(),
        "not cancelled while owner"
    );
    // Lose the ownership: the deadline passes while every call hangs.
    s.store.control().set_all(Behavior::Hang);
    wait(scheduler.service(), |st| st.held.is_none()).await;
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(
        *stopped.lock().expect("log"),
        vec![first],
        "helper stopped on loss"
    );
    // Own again (a new fence, a new token), then stop the scheduler.
    s.store.control().set_all(Behavior::Pass);
    wait(scheduler.service(), |st| st.held.is_some()).await;
    let second = scheduler
        .service()
        .status()
        .borrow()
        .held
        .expect("held")
        .fence;
    assert!(second > first);
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(
        stopped.lock().expect("log").len(),
        1,
        "the new run's token stands"
    );
    scheduler.stop().await.expect("stop");
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(
        *stopped.lock().expect("log"),
        vec![first, second],
        "helper stopped on stop"
    );
    assert!(!seen_cancelled_at_start.load(Ordering::SeqCst));
}

#[tokio::test(start_paused = true)]
async fn guard_reports_suspect_and_loss_reason() {
    let s = setup();
    let factory: Arc<dyn ContendServiceFactory> =
        Arc::new(LeaseServiceFactory::new(s.store.clone(), config()).expect("config"));
    let locker = Locker::new(factory, "m").expect("locker");
    let guard = locker.acquire().await.expect("acquire");
    assert!(guard.is_held() && !guard.is_suspect());
    s.store.control().set(Op::Guard, Behavior::Fail);
    s.store.control().set(Op::Acquire, Behavior::Fail);
    let mut status = guard_status_probe(&guard).await;
    let reason = guard.lost().await;
    status.retain(|suspect| *suspect);
    assert!(
        !status.is_empty(),
        "the guard was seen suspect before the loss"
    );
    assert_eq!(reason, LossReason::LeaseExpired);
    assert!(!guard.is_held());
    s.store.control().set_all(Behavior::Pass);
    let r = guard.release().await;
    assert!(
        matches!(
            r,
            Err(simba_core::Error::Lost {
                reason: LossReason::LeaseExpired,
                ..
            })
        ),
        "{r:?}"
    );
}

/// Samples `is_suspect` until the guard is lost.
async fn guard_status_probe(guard: &simba_core::LockGuard) -> Vec<bool> {
    let mut seen = Vec::new();
    while guard.is_held() {
        seen.push(guard.is_suspect());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    seen
}

#[test]
fn bad_configs_are_refused_with_the_field_named() {
    let cases = [
        (
            LeaseConfig {
                ttl: Duration::ZERO,
                ..config()
            },
            "ttl",
        ),
        (
            LeaseConfig {
                ttl: Duration::from_micros(1500),
                ..config()
            },
            "ttl",
        ),
        (
            LeaseConfig {
                transition: Duration::from_secs(400 * 24 * 3600),
                ..config()
            },
            "transition",
        ),
        (
            // Each part within a year, the lease (ttl + transition) two years.
            LeaseConfig {
                ttl: Duration::from_secs(365 * 24 * 3600),
                transition: Duration::from_secs(365 * 24 * 3600),
                ..config()
            },
            "transition",
        ),
        (
            LeaseConfig {
                drift_margin: Duration::from_millis(800),
                ..config()
            },
            "drift_margin",
        ),
        (
            LeaseConfig {
                jitter: 5..5,
                ..config()
            },
            "jitter",
        ),
    ];
    for (cfg, field) in cases {
        match LeaseServiceFactory::new(MemoryStore::new(), cfg) {
            Err(simba_core::Error::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: expected InvalidConfig, got {other:?}"),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn waiter_poll_caps_the_sleep_of_a_waiter_without_push() {
    let s = setup();
    let (a, _) = contender(&s, "m");
    a.start().expect("a");
    wait(&a, |st| st.held.is_some()).await;
    let b_store = FaultStore::new(s.memory.clone());
    b_store.control().set(Op::Subscribe, Behavior::Fail);
    let poll = Duration::from_millis(50);
    let cfg = LeaseConfig {
        waiter_poll: Some(poll),
        ..config()
    };
    let b = LeaseServiceFactory::new(b_store.clone(), cfg)
        .expect("config")
        .create_contend_service("m", Arc::new(simba_core::SilentContender))
        .expect("b");
    b.start().expect("b");
    wait(&b, |st| st.attempts > 0).await;
    let t = Instant::now();
    a.stop().await.expect("stop a");
    wait(&b, |st| st.held.is_some()).await;
    assert!(Instant::now() - t <= poll, "took {:?}", Instant::now() - t);
    b.stop().await.expect("stop b");
    let bad = LeaseConfig {
        waiter_poll: Some(Duration::ZERO),
        ..config()
    };
    assert!(LeaseServiceFactory::new(MemoryStore::new(), bad).is_err());
}
