//! Releases that keep the mutex held (`release_after`, `LockGuard::release_holding_until`)
//! and observers (retrieval services) that are pushed and never spin, in paused tokio time
//! over the in-memory store behind a call-counting fault wrapper.

use std::sync::Arc;
use std::time::Duration;

use simba_core::fault::{Behavior, FaultStore, Op};
use simba_core::{
    ContendServiceFactory, Error, LeaseConfig, LeaseServiceFactory, Locker, MemoryStore,
    MutexState, RetrievalService, SilentContender, SilentRetriever,
};
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(10);
const TRANSITION: Duration = Duration::from_secs(6);

fn config() -> LeaseConfig {
    LeaseConfig {
        request_timeout: Duration::from_secs(3),
        retry_interval: Duration::from_millis(100),
        ..LeaseConfig::with_lease(TTL, TRANSITION)
    }
}

type Store = FaultStore<MemoryStore>;

/// Two "processes" (factories) over one memory store, each behind its own counting wrapper.
fn two(
    config: LeaseConfig,
) -> (
    Store,
    Arc<dyn ContendServiceFactory>,
    Store,
    Arc<dyn ContendServiceFactory>,
) {
    let memory = MemoryStore::new();
    let a = FaultStore::new(memory.clone());
    let b = FaultStore::new(memory);
    let fa = LeaseServiceFactory::new(a.clone(), config.clone()).expect("config");
    let fb = LeaseServiceFactory::new(b.clone(), config).expect("config");
    (a, Arc::new(fa), b, Arc::new(fb))
}

/// Lets `span` of paused time pass in small steps, giving every task a turn in between;
/// unlike a plain sleep this also ends when some task never lets time auto-advance (a
/// loop on a free mutex), which is what the counting tests must catch.
async fn pass(span: Duration) {
    let step = Duration::from_millis(50);
    let end = Instant::now() + span;
    while Instant::now() < end {
        tokio::time::advance(step).await;
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
    }
}

fn observer(f: &Arc<dyn ContendServiceFactory>, m: &str) -> Arc<dyn RetrievalService> {
    let r = f
        .create_retrieval_service(m, Arc::new(SilentRetriever))
        .expect("retriever");
    r.start().expect("start");
    r
}

async fn seen(
    r: &Arc<dyn RetrievalService>,
    within: Duration,
    pred: impl FnMut(&MutexState) -> bool,
) -> bool {
    let mut rx = r.state();
    tokio::time::timeout(within, rx.wait_for(pred))
        .await
        .is_ok()
}

#[tokio::test(start_paused = true)]
async fn an_idle_observer_of_a_free_mutex_reads_a_few_times_per_lease() {
    let (_, _, b, fb) = two(config());
    let r = observer(&fb, "m");
    pass(Duration::from_secs(60)).await;
    let reads = b.control().calls(Op::Owner);
    // Pushed store: a read at start, one right after subscribing, then one per
    // max(ttl / 2, 500 ms) = 5 s: 14 in 60 s. An observer reading in a loop makes thousands.
    assert!(
        (2..=16).contains(&reads),
        "{reads} owner reads in 60 s on a free mutex"
    );
    r.stop().await.expect("stop");
}

#[tokio::test(start_paused = true)]
async fn an_observer_without_push_polls_at_a_bounded_interval() {
    let (_, _, b, fb) = two(config());
    b.control().set(Op::Subscribe, Behavior::Fail);
    let r = observer(&fb, "m");
    pass(Duration::from_secs(60)).await;
    let reads = b.control().calls(Op::Owner);
    assert!(
        (2..=16).contains(&reads),
        "{reads} owner reads in 60 s on a free mutex without push"
    );
    r.stop().await.expect("stop");
}

#[tokio::test(start_paused = true)]
async fn an_observer_sees_an_early_release_at_once_where_the_store_pushes() {
    let (_, fa, b, fb) = two(config());
    let r = observer(&fb, "m");
    let owner = fa
        .create_contend_service("m", Arc::new(SilentContender))
        .expect("service");
    let id = owner.contender_id().to_owned();
    owner.start().expect("start");
    assert!(
        seen(&r, Duration::from_millis(50), |s| s.after.owner_id == id).await,
        "the acquisition was pushed"
    );
    pass(Duration::from_secs(30)).await;
    let reads = b.control().calls(Op::Owner);
    // A live owner renews every ttl: reads at the lease end and every 5 s, not a loop.
    assert!(reads <= 16, "{reads} owner reads in 30 s of a held mutex");
    owner.stop().await.expect("stop");
    // The old lease would end up to 16 s later: the release must be seen at once.
    let t0 = Instant::now();
    assert!(
        seen(&r, Duration::from_millis(50), |s| !s.after.has_owner()).await,
        "the release was not seen within 50 ms (the lease would end in {:?})",
        TTL + TRANSITION
    );
    assert!(t0.elapsed() <= Duration::from_millis(50));
    r.stop().await.expect("stop");
}

#[tokio::test(start_paused = true)]
async fn an_observer_without_push_sees_a_release_within_its_poll() {
    let poll = Duration::from_millis(300);
    let (_, fa, b, fb) = two(LeaseConfig {
        waiter_poll: Some(poll),
        ..config()
    });
    b.control().set(Op::Subscribe, Behavior::Fail);
    let r = observer(&fb, "m");
    let owner = Locker::new(fa, "m").expect("locker");
    let g = owner.acquire().await.expect("acquire");
    assert!(seen(&r, poll * 2, |s| s.after.has_owner()).await);
    g.release().await.expect("release");
    assert!(
        seen(&r, poll + Duration::from_millis(20), |s| !s
            .after
            .has_owner())
        .await,
        "the release was not seen within one poll"
    );
    r.stop().await.expect("stop");
}

#[tokio::test(start_paused = true)]
async fn release_at_least_keeps_the_mutex_from_everyone_until_then() {
    let (a, fa, _, fb) = two(config());
    fa.check_hold().expect("lease stores hold");
    let la = Locker::new(fa, "job").expect("locker");
    let lb = Locker::new(fb, "job").expect("locker");
    let g = la.acquire().await.expect("acquire");
    let acquired = g.acquired_at();
    let fence = g.fence();
    // The job takes 2 s; the mutex stays held for at least 60 s from the acquisition,
    // which is longer than the lease (16 s): nothing renews it meanwhile.
    pass(Duration::from_secs(2)).await;
    g.release_at_least(Duration::from_secs(60))
        .await
        .expect("hold");
    assert_eq!(a.control().calls(Op::ReleaseAfter), 1);
    let renewals = a.control().calls(Op::Guard);
    pass(Duration::from_secs(57)).await;
    for (who, l) in [("the releaser", &la), ("another process", &lb)] {
        let r = l.try_acquire().await;
        assert!(
            matches!(r, Err(Error::WouldBlock { .. })),
            "{who} took the held mutex: {r:?}"
        );
    }
    assert_eq!(
        a.control().calls(Op::Guard),
        renewals,
        "a hold is never renewed"
    );
    // It ends by itself at the instant asked for (the memory store's clock is tokio's).
    let end = acquired + Duration::from_secs(60);
    tokio::time::advance(end.saturating_duration_since(Instant::now())).await;
    tokio::time::advance(Duration::from_millis(2)).await;
    let g = lb.try_acquire().await.expect("free once the hold ended");
    assert!(g.fence() > fence);
    g.release().await.expect("release");
}

#[tokio::test(start_paused = true)]
async fn a_hold_already_past_is_a_plain_release() {
    let (a, fa, _, fb) = two(config());
    let la = Locker::new(fa, "m").expect("locker");
    let g = la.acquire().await.expect("acquire");
    pass(Duration::from_secs(1)).await;
    g.release_at_least(Duration::from_millis(500))
        .await
        .expect("release");
    assert_eq!(a.control().calls(Op::ReleaseAfter), 0);
    assert_eq!(a.control().calls(Op::Release), 1);
    let g = Locker::new(fb, "m").expect("locker").try_acquire().await;
    assert!(g.is_ok(), "released at once: {g:?}");
}

#[tokio::test(start_paused = true)]
async fn holding_a_lost_ownership_says_it_was_lost() {
    let (a, fa, _, _) = two(config());
    let la = Locker::new(fa, "m").expect("locker");
    let g = la.acquire().await.expect("acquire");
    a.control().set(Op::Guard, Behavior::Hang);
    a.control().set(Op::Acquire, Behavior::Hang);
    // Past the local deadline (ttl + transition - drift): the ownership is over.
    pass(TTL + TRANSITION).await;
    assert!(!g.is_held());
    let r = g.release_at_least(Duration::from_secs(60)).await;
    assert!(matches!(r, Err(Error::Lost { .. })), "{r:?}");
    assert_eq!(a.control().calls(Op::ReleaseAfter), 0, "nothing to hold");
}

#[tokio::test(start_paused = true)]
async fn a_hold_over_a_year_is_refused_and_the_mutex_released() {
    let (a, fa, _, _) = two(config());
    let la = Locker::new(fa, "m").expect("locker");
    let g = la.acquire().await.expect("acquire");
    let r = g
        .release_at_least(Duration::from_secs(400 * 24 * 3600))
        .await;
    assert!(
        matches!(r, Err(Error::InvalidConfig { field: "hold", .. })),
        "{r:?}"
    );
    assert_eq!(a.control().calls(Op::Release), 1);
}

/// A hold keeps the releasing process's own tasks out too: the local turn passes on when
/// the hold is applied, and the next task's acquisition waits for the backend's hold.
#[tokio::test(start_paused = true)]
async fn a_hold_keeps_local_waiters_out_until_it_ends() {
    let (_, fa, _, _) = two(config());
    let la = Locker::new(fa, "m").expect("locker");
    let g = la.acquire().await.expect("acquire");
    let t0 = Instant::now();
    let waiter = {
        let la = la.clone();
        tokio::spawn(async move {
            let g = la.acquire().await.expect("acquire after the hold");
            (Instant::now(), g)
        })
    };
    g.release_holding_until(t0 + Duration::from_secs(30))
        .await
        .expect("hold");
    let (at, g2) = waiter.await.expect("waiter");
    assert!(
        at >= t0 + Duration::from_secs(30),
        "a local waiter took the mutex {:?} into a 30 s hold",
        at - t0
    );
    g2.release().await.expect("release");
}
