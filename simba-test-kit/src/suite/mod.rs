//! The conformance suite: one public async fn per behaviour every backend must show.
//!
//! Each case takes a [`Harness`] and returns `Ok(())` or a [`CaseError`] saying what the
//! backend did wrong. [`conformance_tests!`](crate::conformance_tests) expands the whole
//! suite into one named `#[tokio::test]` per case. Every case uses its own random mutex
//! name, so cases can share one server and run in parallel.
//!
//! Where time is the subject (failover, loss on outage), bounds come from the harness's
//! [`SuiteCapabilities`] and are generous on purpose: the machine may be loaded by other tests.

mod harness;

pub use harness::{
    Fault, FaultyFactory, Harness, INTRUDER, Intrusion, SetupError, SuiteCapabilities, SuiteTiming,
    intrude_through_store,
};

use std::fmt;
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use simba_core::{
    Error, LeaderScheduler, Locker, LossReason, MutexState, Schedule, SilentRetriever,
    generate_contender_id,
};
use tokio::time::{Instant, timeout};

use crate::history::History;
use crate::support::{unique_name, wait_status};

/// Why a case failed.
#[derive(Debug)]
pub struct CaseError(pub String);

impl fmt::Display for CaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CaseError {}

impl From<SetupError> for CaseError {
    fn from(e: SetupError) -> Self {
        CaseError(format!("setting the backend up failed: {e}"))
    }
}

impl From<Error> for CaseError {
    fn from(e: Error) -> Self {
        CaseError(format!("unexpected simba error: {e}"))
    }
}

/// What a case returns.
pub type CaseResult = Result<(), CaseError>;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(CaseError(format!($($fmt)+)));
        }
    };
}

mod multi;

pub use multi::{
    CoreMultiLock, MultiHold, MultiLockUnderTest, MultiWait, multi_lock_lost_part,
    multi_lock_lost_part_with, multi_lock_no_deadlock, multi_lock_no_deadlock_with,
    multi_lock_no_partial_hold, multi_lock_no_partial_hold_with, multi_lock_release_frees_all,
    multi_lock_release_frees_all_with, multi_lock_with_singles, multi_lock_with_singles_with,
};

/// The names of every case, in the order [`conformance_tests!`](crate::conformance_tests)
/// runs them.
pub const CASES: &[&str] = crate::__suite_cases!(names);

/// Every service-level case, written once: `$mode` picks what to expand them into.
#[doc(hidden)]
#[macro_export]
macro_rules! __suite_cases {
    ($($mode:tt)*) => {
        $crate::__expand_cases! { suite, $($mode)*;
            start, restart, guard_past_ttl, multi_contend, schedule, locker_timeout,
            try_acquire, guard_drop_releases, lost_signal_on_outage, failover_after_crash,
            fences_increase, handoff_without_poll, in_process_exclusion, reacquire_after_drop,
            retriever_sees_changes, retriever_sees_release, hold_at_least, bad_input,
            safety_under_partitions, release_after_intrusion_is_lost,
            multi_lock_release_after_intrusion_is_lost,
            // Multi-locks (suite/multi.rs).
            multi_lock_no_deadlock, multi_lock_no_partial_hold, multi_lock_lost_part,
            multi_lock_release_frees_all, multi_lock_with_singles
        }
    };
}

/// Expands a list of cases into their names (`names`) or into one `#[tokio::test]` each
/// (`tests EXPR`), for the service suite (`suite`) or the store-level cases
/// (`store_cases`, in a module `store_contract`).
#[doc(hidden)]
#[macro_export]
macro_rules! __expand_cases {
    // A family of cases in a module `$cases` of the kit, over a source whose trait
    // `$source_trait` names it, expanded into a module `$module` of tests; `$what` names the
    // family in failures.
    (@family $module:ident, $cases:ident, $source_trait:ident, $what:literal, names;
     $($case:ident),+ $(,)?) => {
        &[$(stringify!($case)),+]
    };
    (@family $module:ident, $cases:ident, $source_trait:ident, $what:literal,
     tests $source:expr; $($case:ident),+ $(,)?) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let source = $source;
                    if let Err(e) = $crate::$cases::$case(&source).await {
                        panic!(
                            concat!($what, " case `{}` failed on {}: {}"),
                            stringify!($case),
                            $crate::$cases::$source_trait::name(&source),
                            e
                        );
                    }
                }
            )+
        }
    };
    ($module:ident, names; $($case:ident),+ $(,)?) => {
        &[$(stringify!($case)),+]
    };
    (suite, tests $harness:expr; $($case:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let harness = $harness;
                if let Err(e) = $crate::suite::$case(&harness).await {
                    panic!(
                        "conformance case `{}` failed on {}: {}",
                        stringify!($case),
                        $crate::suite::Harness::name(&harness),
                        e
                    );
                }
            }
        )+
    };
    (store_cases, tests $source:expr; $($case:ident),+ $(,)?) => {
        mod store_contract {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let source = $source;
                    if let Err(e) = $crate::store_cases::$case(&source).await {
                        panic!(
                            "store case `{}` failed on {}: {}",
                            stringify!($case),
                            $crate::store_cases::StoreSource::name(&source),
                            e
                        );
                    }
                }
            )+
        }
    };
}

/// A longer timing for cases that must tell a release apart from a lease expiry.
const LONG: SuiteTiming = SuiteTiming {
    ttl: Duration::from_secs(5),
    transition: Duration::from_secs(2),
};

async fn within<T>(
    what: &str,
    bound: Duration,
    fut: impl Future<Output = T>,
) -> Result<T, CaseError> {
    timeout(bound, fut)
        .await
        .map_err(|_| CaseError(format!("{what}: not within {bound:?}")))
}

fn acquire_bound(caps: &SuiteCapabilities) -> Duration {
    caps.failover_bound + Duration::from_secs(2)
}

/// A single contender acquires a free mutex, gets a fence, and gives it up on stop.
pub async fn start(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let f = h.factory(SuiteTiming::SHORT).await?;
    let history = History::new();
    let id = generate_contender_id();
    let svc = f.create_contend_service(&unique_name("start"), history.contender(&id))?;
    ensure!(
        svc.contender_id() == id,
        "the service ignored the contender's id: {}",
        svc.contender_id()
    );
    ensure!(!svc.is_owner(), "owner before start");
    svc.start()?;
    let st = wait_status(&*svc, "acquire a free mutex", acquire_bound(&caps), |s| {
        s.held.is_some()
    })
    .await?;
    ensure!(svc.is_owner(), "is_owner() is false while status says held");
    ensure!(st.running, "status not running");
    let fence = st.held.map_or(0, |h| h.fence);
    ensure!(
        fence > 0,
        "fence of an acquisition must be positive, got {fence}"
    );
    ensure!(
        st.state.after.owner_id == id,
        "state.after names {:?}, not the owner",
        st.state.after.owner_id
    );
    let iv = history.intervals();
    ensure!(
        iv.len() == 1 && iv[0].fence == fence,
        "on_acquired not called once with the fence: {iv:?}"
    );
    ensure!(
        svc.start().is_err(),
        "a second start() while running must fail"
    );
    svc.stop().await?;
    ensure!(!svc.is_owner(), "still owner after stop");
    let iv = history.intervals();
    ensure!(
        iv[0].reason == Some(LossReason::Released),
        "stop must report on_released(Released): {iv:?}"
    );
    ensure!(
        !svc.status().borrow().running,
        "status still running after stop"
    );
    Ok(())
}

/// A stopped service can start again and re-acquires with a larger fence; while it is
/// stopped another contender can take the mutex.
pub async fn restart(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let f = h.factory(SuiteTiming::SHORT).await?;
    let g = h.factory(SuiteTiming::SHORT).await?;
    let m = unique_name("restart");
    let history = History::new();
    let a = f.create_contend_service(&m, history.contender(generate_contender_id()))?;
    let b = g.create_contend_service(&m, history.contender(generate_contender_id()))?;
    let bound = acquire_bound(&caps);
    a.start()?;
    let first = wait_status(&*a, "first acquisition", bound, |s| s.held.is_some()).await?;
    a.stop().await?;
    b.start()?;
    let second = wait_status(&*b, "another contender acquires after stop", bound, |s| {
        s.held.is_some()
    })
    .await?;
    b.stop().await?;
    a.start()?;
    let third = wait_status(&*a, "re-acquire after restart", bound, |s| s.held.is_some()).await?;
    a.stop().await?;
    let fences: Vec<u64> = [first, second, third]
        .iter()
        .map(|s| s.held.map_or(0, |h| h.fence))
        .collect();
    ensure!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fences must increase across restarts: {fences:?}"
    );
    ensure!(
        history.violations().is_empty(),
        "{:?}",
        history.violations()
    );
    Ok(())
}

/// The owner keeps its ownership, with the same fence, across many ttl periods.
pub async fn guard_past_ttl(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let f = h.factory(SuiteTiming::SHORT).await?;
    let g = h.factory(SuiteTiming::SHORT).await?;
    let m = unique_name("guard");
    let history = History::new();
    let a = f.create_contend_service(&m, history.contender(generate_contender_id()))?;
    a.start()?;
    let st = wait_status(&*a, "acquire", acquire_bound(&caps), |s| s.held.is_some()).await?;
    let fence = st.held.map_or(0, |h| h.fence);
    let b = g.create_contend_service(&m, history.contender(generate_contender_id()))?;
    b.start()?;
    // Time is the subject: hold through three whole leases while a rival contends.
    let lease = SuiteTiming::SHORT.ttl + SuiteTiming::SHORT.transition;
    let lost = wait_status(&*a, "", lease * 3, |s| s.held.is_none()).await;
    ensure!(
        lost.is_err(),
        "the owner lost the mutex while renewing: {:?}",
        *a.status().borrow()
    );
    let now = a.status().borrow().clone();
    ensure!(
        now.held.map(|h| h.fence) == Some(fence),
        "renewals must keep the fence {fence}: {now:?}"
    );
    ensure!(!b.is_owner(), "the rival owns while the owner renews");
    a.stop().await?;
    b.stop().await?;
    ensure!(
        history.violations().is_empty(),
        "{:?}",
        history.violations()
    );
    Ok(())
}

/// Ten contenders over two factories: exactly one owner at any instant while owners stop
/// and come back.
pub async fn multi_contend(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let factories = [
        h.factory(SuiteTiming::SHORT).await?,
        h.factory(SuiteTiming::SHORT).await?,
    ];
    let m = unique_name("multi");
    let history = History::new();
    let mut services = Vec::new();
    for i in 0..10 {
        let svc = factories[i % 2]
            .create_contend_service(&m, history.contender(generate_contender_id()))?;
        svc.start()?;
        services.push(svc);
    }
    let rounds = 5;
    for round in 0..rounds {
        let deadline = Instant::now() + acquire_bound(&caps);
        let owner = loop {
            let owners: Vec<usize> = (0..services.len())
                .filter(|i| services[*i].is_owner())
                .collect();
            ensure!(
                owners.len() <= 1,
                "round {round}: several owners at once: {owners:?}"
            );
            if let [o] = owners.as_slice() {
                break *o;
            }
            ensure!(
                Instant::now() < deadline,
                "round {round}: no owner within {:?}",
                acquire_bound(&caps)
            );
            // Sampling the owner count is the point here (each sample checks exclusion).
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        services[owner].stop().await?;
        services[owner].start()?;
    }
    for s in &services {
        s.stop().await?;
    }
    let v = history.violations();
    ensure!(v.is_empty(), "violations: {}", join(&v));
    ensure!(
        history.len() >= rounds,
        "only {} ownerships in {rounds} rounds",
        history.len()
    );
    Ok(())
}

fn join<T: fmt::Display>(v: &[T]) -> String {
    v.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Scheduled work runs only on the leader, is cancelled when it stops, and moves to the
/// other scheduler.
pub async fn schedule(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let m = unique_name("schedule");
    let runs: Arc<Mutex<Vec<(usize, u64)>>> = Arc::default();
    let mut schedulers = Vec::new();
    for who in 0..2 {
        let f = h.factory(SuiteTiming::SHORT).await?;
        let runs = runs.clone();
        let s = LeaderScheduler::new(
            f.as_ref(),
            &m,
            Schedule::FixedRate {
                initial_delay: Duration::ZERO,
                period: Duration::from_millis(50),
            },
            move |ctx| {
                let runs = runs.clone();
                async move {
                    runs.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((who, ctx.fence));
                }
            },
        )?;
        s.start()?;
        schedulers.push(s);
    }
    let count = |who: usize| {
        runs.lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|r| r.0 == who)
            .count()
    };
    let bound = acquire_bound(&caps);
    let t0 = Instant::now();
    let leader = loop {
        if let Some(w) = (0..2).find(|w| count(*w) >= 3) {
            break w;
        }
        ensure!(
            t0.elapsed() < bound,
            "no scheduled work ran within {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let other = 1 - leader;
    ensure!(
        schedulers[leader].is_leader(),
        "work ran on a scheduler that is not leader"
    );
    ensure!(
        count(other) == 0,
        "work ran on both schedulers before any handover"
    );
    schedulers[leader].stop().await?;
    let after_stop = count(leader);
    let t1 = Instant::now();
    while count(other) < 3 {
        ensure!(
            t1.elapsed() < bound,
            "work did not move to the other scheduler within {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ensure!(
        count(leader) == after_stop,
        "the stopped leader kept running work"
    );
    schedulers[other].stop().await?;
    let fences: Vec<u64> = runs
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|r| r.1)
        .collect();
    ensure!(
        fences.windows(2).all(|w| w[0] <= w[1]),
        "work saw fences go back: {fences:?}"
    );
    Ok(())
}

/// `acquire_timeout` on a held mutex gives up with [`Error::Timeout`] after about the wait.
pub async fn locker_timeout(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let m = unique_name("timeout");
    let a = Locker::new(h.factory(SuiteTiming::SHORT).await?, &m)?;
    let b = Locker::new(h.factory(SuiteTiming::SHORT).await?, &m)?;
    let ga = within("acquire a free mutex", acquire_bound(&caps), a.acquire()).await??;
    let wait = Duration::from_millis(400);
    let t0 = Instant::now();
    let r = b.acquire_timeout(wait).await;
    let took = t0.elapsed();
    ensure!(
        matches!(r, Err(Error::Timeout { .. })),
        "expected Error::Timeout, got {r:?}"
    );
    ensure!(
        took >= wait,
        "gave up after {took:?}, before the wait of {wait:?}"
    );
    ensure!(
        took < wait + Duration::from_secs(2),
        "gave up only after {took:?}"
    );
    ensure!(
        ga.is_held(),
        "the holder lost the mutex while another timed out"
    );
    ga.release().await?;
    Ok(())
}

/// `try_acquire` succeeds on a free mutex and says [`Error::WouldBlock`] on a held one.
pub async fn try_acquire(h: &dyn Harness) -> CaseResult {
    let m = unique_name("try");
    let a = Locker::new(h.factory(SuiteTiming::SHORT).await?, &m)?;
    let b = Locker::new(h.factory(SuiteTiming::SHORT).await?, &m)?;
    let bound = Duration::from_secs(10);
    let ga = within("try_acquire", bound, a.try_acquire()).await??;
    let r = within("try_acquire of a held mutex", bound, b.try_acquire()).await?;
    ensure!(
        matches!(r, Err(Error::WouldBlock { .. })),
        "expected WouldBlock, got {r:?}"
    );
    ga.release().await?;
    let gb = within("try_acquire after release", bound, b.try_acquire()).await?;
    ensure!(gb.is_ok(), "try_acquire after the release failed: {gb:?}");
    if let Ok(g) = gb {
        ensure!(g.fence() > 0, "fence 0");
        g.release().await?;
    }
    Ok(())
}

/// Dropping a guard releases the mutex: another contender gets it long before the lease
/// would have expired.
pub async fn guard_drop_releases(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(LONG);
    let m = unique_name("drop");
    let a = Locker::new(h.factory(LONG).await?, &m)?;
    let b = Locker::new(h.factory(LONG).await?, &m)?;
    let ga = within("acquire", acquire_bound(&caps), a.acquire()).await??;
    drop(ga);
    // Polling is the point: b is a separate process that cannot await a's drop. The bound
    // is the ttl, well below the 7 s lease that an unreleased mutex would hold for.
    let t0 = Instant::now();
    loop {
        match b.try_acquire().await {
            Ok(g) => {
                g.release().await?;
                return Ok(());
            }
            Err(Error::WouldBlock { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        ensure!(
            t0.elapsed() < LONG.ttl,
            "the dropped guard's mutex was still held after {:?}",
            LONG.ttl
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// When the backend stops answering, the owner's loss signal fires within the lease,
/// without waiting for an answer.
pub async fn lost_signal_on_outage(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let (f, fault) = h.faulty_factory(SuiteTiming::SHORT).await?;
    let a = Locker::new(f, &unique_name("outage"))?;
    let guard = within("acquire", acquire_bound(&caps), a.acquire()).await??;
    fault.partition().await?;
    let t0 = Instant::now();
    let reason = within(
        "loss signal after the backend went silent",
        caps.loss_bound + Duration::from_secs(2),
        guard.lost(),
    )
    .await;
    let took = t0.elapsed();
    fault.heal().await?;
    let reason = reason?;
    ensure!(
        matches!(reason, LossReason::LeaseExpired | LossReason::SessionLost),
        "loss reported as {reason:?}"
    );
    ensure!(
        took <= caps.loss_bound,
        "loss reported after {took:?}, beyond {:?}",
        caps.loss_bound
    );
    ensure!(!guard.is_held(), "guard still held after its loss signal");
    Ok(())
}

/// The owner goes silent (crash, partition): a waiter owns within the failover bound, and
/// never before the old owner stopped believing it owned.
pub async fn failover_after_crash(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let (fa, fault) = h.faulty_factory(SuiteTiming::SHORT).await?;
    let fb = h.factory(SuiteTiming::SHORT).await?;
    let m = unique_name("failover");
    let history = History::new();
    let a = fa.create_contend_service(&m, history.contender(generate_contender_id()))?;
    let b = fb.create_contend_service(&m, history.contender(generate_contender_id()))?;
    a.start()?;
    wait_status(&*a, "first owner", acquire_bound(&caps), |s| {
        s.held.is_some()
    })
    .await?;
    b.start()?;
    wait_status(&*b, "waiter contends", acquire_bound(&caps), |s| {
        s.attempts > 0
    })
    .await?;
    fault.partition().await?;
    let t0 = Instant::now();
    let r = wait_status(&*b, "failover", caps.failover_bound, |s| s.held.is_some()).await;
    let took = t0.elapsed();
    fault.heal().await?;
    r?;
    ensure!(
        !a.is_owner(),
        "the silent owner still believes it owns after the failover"
    );
    b.stop().await?;
    a.stop().await?;
    let v = history.violations();
    ensure!(
        v.is_empty(),
        "failover after {took:?} broke safety: {}",
        join(&v)
    );
    Ok(())
}

/// Fences strictly increase across acquisitions by different contenders.
pub async fn fences_increase(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let m = unique_name("fence");
    let lockers = [
        Locker::new(h.factory(SuiteTiming::SHORT).await?, &m)?,
        Locker::new(h.factory(SuiteTiming::SHORT).await?, &m)?,
    ];
    let mut fences = Vec::new();
    for i in 0..6 {
        let g = within("acquire", acquire_bound(&caps), lockers[i % 2].acquire()).await??;
        fences.push(g.fence());
        g.release().await?;
    }
    ensure!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fences must strictly increase: {fences:?}"
    );
    Ok(())
}

/// A waiter takes over right after a release: at once where the backend pushes releases,
/// else within a poll period.
pub async fn handoff_without_poll(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(LONG);
    let m = unique_name("handoff");
    let a = h
        .factory(LONG)
        .await?
        .create_contend_service(&m, Arc::new(simba_core::SilentContender))?;
    let b = h
        .factory(LONG)
        .await?
        .create_contend_service(&m, Arc::new(simba_core::SilentContender))?;
    a.start()?;
    wait_status(&*a, "first owner", acquire_bound(&caps), |s| {
        s.held.is_some()
    })
    .await?;
    b.start()?;
    wait_status(&*b, "waiter contends", acquire_bound(&caps), |s| {
        s.attempts > 0
    })
    .await?;
    ensure!(!b.is_owner(), "two owners");
    a.stop().await?;
    let t0 = Instant::now();
    // A poll would come only at the end of a's lease (~7 s after it acquired).
    let bound = if caps.pushes_release {
        Duration::from_millis(1500)
    } else {
        LONG.ttl + LONG.transition + Duration::from_secs(2)
    };
    wait_status(&*b, "handoff to the waiter", bound, |s| s.held.is_some()).await?;
    let took = t0.elapsed();
    b.stop().await?;
    tracing::info!(backend = %h.name(), ?took, "handoff");
    Ok(())
}

/// Tasks of one process exclude each other like a `tokio::sync::Mutex`: there is no
/// reentrancy by handle (a clone, or another `Locker` for the name from the same factory,
/// waits while a guard lives), tasks acquiring through clones and through separate
/// `Locker`s are never inside at once, and every ownership, local handoffs included, has a
/// new fence.
pub async fn in_process_exclusion(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let bound = acquire_bound(&caps);
    let m = unique_name("local");
    let f = h.factory(SuiteTiming::SHORT).await?;
    let a = Locker::new(f.clone(), &m)?;
    let g = within("acquire", bound, a.acquire()).await??;
    let r = within(
        "try_acquire through a clone",
        bound,
        a.clone().try_acquire(),
    )
    .await?;
    ensure!(
        matches!(r, Err(Error::WouldBlock { .. })),
        "a clone acquired while a guard of its locker lives: {r:?}"
    );
    let r = within(
        "try_acquire through another Locker of the factory",
        bound,
        Locker::new(f.clone(), &m)?.try_acquire(),
    )
    .await?;
    ensure!(
        matches!(r, Err(Error::WouldBlock { .. })),
        "another Locker of the same factory acquired while a guard lives: {r:?}"
    );
    let wait = Duration::from_millis(200);
    let r = within(
        "acquire_timeout through the same handle",
        bound,
        a.acquire_timeout(wait),
    )
    .await?;
    ensure!(
        matches!(r, Err(Error::Timeout { .. })),
        "a second acquire through the same handle did not wait: {r:?}"
    );
    ensure!(g.is_held(), "the first guard lost the mutex meanwhile");
    g.release().await?;

    let inside = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let fences = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..4 {
        // Two tasks share `a` through clones; two have Lockers of their own for the name.
        let locker = if t % 2 == 0 {
            a.clone()
        } else {
            Locker::new(f.clone(), &m)?
        };
        let (inside, most, fences) = (inside.clone(), most.clone(), fences.clone());
        tasks.spawn(async move {
            for _ in 0..3 {
                let g = within("acquire in a task", bound, locker.acquire()).await??;
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                fences
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(g.fence());
                tokio::time::sleep(Duration::from_millis(20)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                g.release().await?;
            }
            Ok::<_, CaseError>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.map_err(|e| CaseError(format!("a task failed: {e}")))??;
    }
    let most = most.load(Ordering::SeqCst);
    ensure!(
        most == 1,
        "{most} tasks of one process were inside the mutex at once"
    );
    let fences = fences.lock().unwrap_or_else(|p| p.into_inner()).clone();
    ensure!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "each ownership needs a new, greater fence, local handoffs too: {fences:?}"
    );
    Ok(())
}

/// `drop(guard); locker.acquire()` while the dropped guard's release is in flight: the new
/// ownership is a new one (a greater fence) that the old release cannot free, so another
/// process cannot take the mutex while the new guard says it holds it.
pub async fn reacquire_after_drop(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let bound = acquire_bound(&caps);
    let m = unique_name("reacquire");
    let a = Locker::new(h.factory(SuiteTiming::SHORT).await?, &m)?;
    let other = Locker::new(h.factory(SuiteTiming::SHORT).await?, &m)?;
    for round in 0..10 {
        let g = within("acquire", bound, a.acquire()).await??;
        let fence = g.fence();
        drop(g);
        let again = within("acquire after a drop", bound, a.acquire()).await??;
        ensure!(
            again.fence() > fence,
            "round {round}: the re-acquisition kept fence {} (after {fence}): the old \
             release can free it",
            again.fence()
        );
        let theirs = within("try_acquire by another process", bound, other.try_acquire()).await?;
        let held = again.is_held();
        if let Ok(g) = theirs {
            let fence = g.fence();
            g.release().await.ok();
            return Err(CaseError(format!(
                "round {round}: another process acquired (fence {fence}) while the \
                 re-acquired guard (fence {}) said held = {held}",
                again.fence()
            )));
        }
        ensure!(held, "round {round}: the re-acquired guard lost the mutex");
        again.release().await?;
    }
    Ok(())
}

/// A retrieval service sees each new owner.
pub async fn retriever_sees_changes(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let m = unique_name("retriever");
    let r = h
        .factory(SuiteTiming::SHORT)
        .await?
        .create_retrieval_service(&m, Arc::new(SilentRetriever))?;
    r.start()?;
    let mut rx = r.state();
    let bound = acquire_bound(&caps) + SuiteTiming::SHORT.ttl + SuiteTiming::SHORT.transition;
    let mut seen = Vec::new();
    for _ in 0..2 {
        let f = h.factory(SuiteTiming::SHORT).await?;
        let svc = f.create_contend_service(&m, Arc::new(simba_core::SilentContender))?;
        let id = svc.contender_id().to_owned();
        svc.start()?;
        let got = within("the retriever sees the new owner", bound, async {
            rx.wait_for(|s: &MutexState| s.after.owner_id == id)
                .await
                .is_ok()
        })
        .await?;
        ensure!(got, "retriever channel closed");
        seen.push(id);
        svc.stop().await?;
    }
    r.stop().await?;
    ensure!(seen[0] != seen[1], "contender ids repeat");
    Ok(())
}

/// A retrieval service sees an early release: within a push's delay where the backend
/// pushes, else within its read interval — not when the old lease would have ended.
pub async fn retriever_sees_release(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(LONG);
    let m = unique_name("observed");
    let r = h
        .factory(LONG)
        .await?
        .create_retrieval_service(&m, Arc::new(SilentRetriever))?;
    r.start()?;
    let mut rx = r.state();
    let locker = Locker::new(h.factory(LONG).await?, &m)?;
    let g = within("acquire", acquire_bound(&caps), locker.acquire()).await??;
    let id = g.contender_id().to_owned();
    // Pushed backends report at once (1.5 s is generous for a loaded machine); others
    // read at least every max(ttl / 2, 500 ms).
    let bound = if caps.pushes_release {
        Duration::from_millis(1500)
    } else {
        LONG.ttl / 2 + Duration::from_millis(1500)
    };
    let seen = within("the retriever sees the owner", bound, async {
        rx.wait_for(|s: &MutexState| s.after.owner_id == id)
            .await
            .is_ok()
    })
    .await?;
    ensure!(seen, "retriever channel closed");
    g.release().await?;
    let t0 = Instant::now();
    let seen = within(
        "the retriever sees the release (the lease would end 7 s later)",
        bound,
        async {
            rx.wait_for(|s: &MutexState| !s.after.has_owner())
                .await
                .is_ok()
        },
    )
    .await?;
    ensure!(seen, "retriever channel closed");
    tracing::info!(backend = %h.name(), took = ?t0.elapsed(), "retriever saw the release");
    r.stop().await?;
    Ok(())
}

/// A release with a hold (ShedLock's `lockAtLeastFor`) keeps the mutex from everyone —
/// the releaser's own locker included — until the instant asked for, and it is free
/// soon after. Backends without leases (ZooKeeper) refuse it with a typed error and
/// release.
pub async fn hold_at_least(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let m = unique_name("hold");
    let fa = h.factory(SuiteTiming::SHORT).await?;
    let a = Locker::new(fa.clone(), &m)?;
    let b = Locker::new(h.factory(SuiteTiming::SHORT).await?, &m)?;
    let g = within("acquire", acquire_bound(&caps), a.acquire()).await??;
    let fence = g.fence();
    if let Err(e) = fa.check_hold() {
        ensure!(
            matches!(e, Error::Unsupported { .. }),
            "check_hold failed with a wrong error: {e}"
        );
        let r = g.release_at_least(Duration::from_secs(30)).await;
        ensure!(
            matches!(r, Err(Error::Unsupported { .. })),
            "a backend without holds answered {r:?}"
        );
        let g = within("released instead", acquire_bound(&caps), b.acquire()).await??;
        g.release().await?;
        return Ok(());
    }
    // Held for 3 s from the acquisition: longer than the lease (1.5 s), so a hold that
    // were only the lease running out would end too early.
    let hold = Duration::from_secs(3);
    let acquired = g.acquired_at();
    g.release_at_least(hold).await?;
    for (who, l) in [("the releaser's locker", &a), ("another process", &b)] {
        let r = l.try_acquire().await;
        ensure!(
            matches!(r, Err(Error::WouldBlock { .. })),
            "{who} took the mutex during the hold: {r:?}"
        );
    }
    let g = within(
        "acquire after the hold",
        hold + acquire_bound(&caps),
        b.acquire(),
    )
    .await??;
    let took = acquired.elapsed();
    // The backend adds the time left to its own clock after the call, so the hold ends
    // a little after `acquired + hold` by this clock, never before.
    ensure!(
        took >= hold,
        "the mutex was free after {took:?}, held for {hold:?}"
    );
    ensure!(g.fence() > fence, "fence {} after {fence}", g.fence());
    g.release().await?;
    Ok(())
}

/// Bad names and ids are refused with typed errors, before anything reaches the backend.
pub async fn bad_input(h: &dyn Harness) -> CaseResult {
    let f = h.factory(SuiteTiming::SHORT).await?;
    let long = "x".repeat(simba_core::MAX_MUTEX_NAME_LEN + 1);
    for bad in [
        "",
        "line\nbreak",
        " padded",
        long.as_str(),
        "zero\u{200B}width",
    ] {
        let r = f.create_contend_service(bad, Arc::new(simba_core::SilentContender));
        ensure!(
            matches!(r, Err(Error::InvalidName { .. })),
            "name {bad:?} accepted: {r:?}"
        );
        let r = f.create_retrieval_service(bad, Arc::new(SilentRetriever));
        ensure!(
            matches!(r, Err(Error::InvalidName { .. })),
            "retriever name {bad:?} accepted"
        );
        let r = Locker::new(f.clone(), bad);
        ensure!(
            matches!(r, Err(Error::InvalidName { .. })),
            "locker name {bad:?} accepted"
        );
    }
    let r = Locker::with_contender_id(
        f.clone(),
        "fine",
        format!("{}evil", simba_core::HELD_PREFIX),
    );
    ensure!(
        matches!(r, Err(Error::InvalidContenderId { .. })),
        "id with the hold prefix accepted: {r:?}"
    );
    let history = History::new();
    let r = f.create_contend_service("fine", history.contender("has space"));
    ensure!(
        matches!(r, Err(Error::InvalidContenderId { .. })),
        "id with a space accepted: {r:?}"
    );
    Ok(())
}

/// Three contenders, each behind its own fault point, partitioned and healed at random
/// for a few seconds: no two ownerships overlap and fences increase.
pub async fn safety_under_partitions(h: &dyn Harness) -> CaseResult {
    let m = unique_name("safety");
    let history = History::new();
    let mut parts = Vec::new();
    for _ in 0..3 {
        let (f, fault) = h.faulty_factory(SuiteTiming::SHORT).await?;
        let svc = f.create_contend_service(&m, history.contender(generate_contender_id()))?;
        svc.start()?;
        parts.push((svc, fault, AtomicBool::new(false)));
    }
    let t0 = Instant::now();
    let mut n: u64 = 0;
    while t0.elapsed() < Duration::from_secs(6) {
        n += 1;
        let pick = std::collections::hash_map::RandomState::new().hash_one(n) % 3;
        let (_, fault, cut) = &parts[pick as usize];
        if cut.load(Ordering::Relaxed) {
            fault.heal().await?;
            cut.store(false, Ordering::Relaxed);
        } else {
            fault.partition().await?;
            cut.store(true, Ordering::Relaxed);
        }
        tokio::time::sleep(Duration::from_millis(150 + (n % 5) * 90)).await;
    }
    for (_, fault, _) in &parts {
        fault.heal().await?;
    }
    for (svc, _, _) in &parts {
        within("stop", Duration::from_secs(10), svc.stop()).await??;
    }
    let v = history.violations();
    ensure!(v.is_empty(), "violations under partitions: {}", join(&v));
    ensure!(!history.is_empty(), "nobody owned during the run");
    Ok(())
}

/// A release that finds the mutex no longer its owner's is a loss, never a success: the
/// owner holds a guard, the mutex is changed by hand behind its back
/// ([`Harness::intrude`]), and `release()` must return [`Error::Lost`] with
/// [`LossReason::TakenOver`], the guard's status must show that loss for its fence, and
/// an intruder that took the mutex must still own it afterwards (a stale release frees
/// nothing).
pub async fn release_after_intrusion_is_lost(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(LONG);
    let f = h.factory(LONG).await?;
    let m = unique_name("intruded");
    let guard = within(
        "acquire a free mutex",
        acquire_bound(&caps),
        Locker::new(f.clone(), &m)?.acquire(),
    )
    .await??;
    let (fence, status) = (guard.fence(), guard.status());
    let intrusion = within(
        "change the owner by hand",
        Duration::from_secs(15),
        h.intrude(&m, guard.contender_id()),
    )
    .await??;
    let released = within("release", Duration::from_secs(15), guard.release()).await?;
    match released {
        Err(Error::Lost { mutex, reason }) => {
            ensure!(mutex == m, "the loss names mutex {mutex:?}, not {m:?}");
            ensure!(
                reason == LossReason::TakenOver,
                "the release of a mutex changed by hand says {reason:?}, not TakenOver"
            );
        }
        Ok(()) => {
            return Err(CaseError(
                "release() returned Ok for a mutex changed by hand while held: the work ran \
                 unprotected and the caller was not told"
                    .to_owned(),
            ));
        }
        Err(e) => return Err(CaseError(format!("release() failed otherwise: {e}"))),
    }
    let last = status.borrow().last_loss;
    ensure!(
        last.is_some_and(|l| l.fence == fence && l.reason == LossReason::TakenOver),
        "the guard's status does not show the loss of fence {fence}: last_loss {last:?}"
    );
    if intrusion == Intrusion::Freed {
        return Ok(());
    }
    // The intruder keeps what it took: nobody else gets the mutex now.
    let other = Locker::new(h.factory(LONG).await?, &m)?;
    match within("try_acquire", Duration::from_secs(15), other.try_acquire()).await? {
        Err(Error::WouldBlock { .. }) => Ok(()),
        Ok(g) => {
            let _ = g.release().await;
            Err(CaseError(
                "the stale release freed the mutex its intruder held".to_owned(),
            ))
        }
        Err(e) => Err(CaseError(format!("try_acquire after the release: {e}"))),
    }
}

/// A multi-lock one of whose parts another writer makes its own while the guard holds it
/// ([`Harness::intrude`]): the release is [`Error::Lost`] naming that part, and every other
/// part is released all the same.
pub async fn multi_lock_release_after_intrusion_is_lost(h: &dyn Harness) -> CaseResult {
    let caps = h.capabilities(LONG);
    let f = h.factory(LONG).await?;
    let (a, b) = (unique_name("intruded-a"), unique_name("intruded-b"));
    let guard = within(
        "acquire both",
        acquire_bound(&caps) * 2,
        simba_core::MultiLocker::new(f, [a.as_str(), b.as_str()])?.acquire(),
    )
    .await??;
    let owner = guard
        .part(&a)
        .map(|p| p.contender_id().to_owned())
        .ok_or_else(|| CaseError(format!("no part {a:?} in the guard")))?;
    within(
        "change the owner by hand",
        Duration::from_secs(15),
        h.intrude(&a, &owner),
    )
    .await??;
    match within("release", Duration::from_secs(15), guard.release()).await? {
        Err(Error::Lost { mutex, reason }) => {
            ensure!(mutex == a, "the loss names {mutex:?}, not the part {a:?}");
            ensure!(
                reason == LossReason::TakenOver,
                "the loss says {reason:?}, not TakenOver"
            );
        }
        Ok(()) => {
            return Err(CaseError(
                "MultiGuard::release() is Ok although another writer owns one of its parts"
                    .to_owned(),
            ));
        }
        Err(e) => return Err(CaseError(format!("release() failed otherwise: {e}"))),
    }
    // The other part was released: another contender takes it at once.
    let other = Locker::new(h.factory(LONG).await?, &b)?;
    let g = within(
        "acquire the other part",
        acquire_bound(&caps),
        other.try_acquire(),
    )
    .await?
    .map_err(|e| CaseError(format!("the other part was not released: {e}")))?;
    g.release().await?;
    Ok(())
}

/// Expands the whole suite into one `#[tokio::test]` per case.
///
/// The argument is an expression evaluated inside each (async) test that yields a value
/// implementing [`Harness`]; it may `.await`.
///
/// ```no_run
/// # mod my_backend {
/// #     pub struct MyHarness;
/// #     impl MyHarness {
/// #         pub async fn start() -> simba_test_kit::memory::MemoryHarness {
/// #             simba_test_kit::memory::MemoryHarness::memory()
/// #         }
/// #     }
/// # }
/// # use my_backend::MyHarness;
/// simba_test_kit::conformance_tests!(MyHarness::start().await);
/// # fn main() {}
/// ```
///
/// A backend that cannot run some cases names the ones it runs (and says why not the
/// others):
///
/// ```no_run
/// # mod my_backend {
/// #     pub struct MyHarness;
/// #     impl MyHarness {
/// #         pub async fn start() -> simba_test_kit::memory::MemoryHarness {
/// #             simba_test_kit::memory::MemoryHarness::memory()
/// #         }
/// #     }
/// # }
/// # use my_backend::MyHarness;
/// simba_test_kit::conformance_tests!(@cases MyHarness::start().await; start, restart);
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! conformance_tests {
    (@cases $harness:expr; $($case:ident),+ $(,)?) => {
        $crate::__expand_cases! { suite, tests $harness; $($case),+ }
    };
    ($harness:expr) => {
        $crate::__suite_cases!(tests $harness);
    };
}
