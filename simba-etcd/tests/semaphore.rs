//! Semaphores on a real etcd: the kit's semaphore and read-write lock cases, and a waiter
//! that stops renewing (its process paused or cut off) without holding up the ones behind it.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{proxied, random_prefix, server, test_config};
use etcd_client::GetOptions;
use simba_core::backend::{Lease, PermitStore};
use simba_core::{LeaseConfig, Semaphore};
use simba_etcd::EtcdFactory;
use simba_test_kit::support::unique_name;
use tokio::time::{Instant, sleep, timeout};

simba_test_kit::semaphore_tests!(common::EtcdPermitHarness::start().await);

simba_test_kit::rw_lock_tests!(common::EtcdPermitHarness::start().await);

/// The permit lease of the paused-waiter test: long, so that a waiter kept in the queue
/// by the admission rule alone (its place lasts a lease and two seconds past its last
/// call) would hold the live one up for well over 14 s.
const LONG: Lease = Lease {
    ttl: Duration::from_secs(8),
    transition: Duration::from_secs(4),
};

/// How many contender keys `semaphore` has (holders and waiters).
async fn keys(factory: &EtcdFactory, store: &simba_etcd::EtcdPermitStore, name: &str) -> usize {
    let range = format!("{}/", store.semaphore_key(name));
    factory
        .client()
        .kv_client()
        .get(
            range,
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await
        .unwrap()
        .count() as usize
}

/// A waiter that stops renewing — its connection blackholed, as for a SIGSTOPped or
/// partitioned process — is first in line when one of a 2-permit semaphore's permits
/// frees. It loses its place when its store's presence lease (2 s) ends, and the live
/// waiter behind it gets the permit then: within the presence lease, not after the 12 s
/// permit lease the rule would keep its place for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_waiter_does_not_stall_the_ones_behind_it() {
    let etcd = server().await;
    let prefix = random_prefix();
    let name = unique_name("sem_silent");
    let config = LeaseConfig::with_lease(LONG.ttl, LONG.transition);
    let direct = EtcdFactory::connect(test_config(etcd.url(), &prefix, Duration::from_secs(5)))
        .await
        .unwrap();
    let holders = Semaphore::new(direct.permit_store(), config.clone(), &name, 2).unwrap();
    let first = holders
        .acquire_timeout(Duration::from_secs(10))
        .await
        .unwrap();
    let second = holders
        .acquire_timeout(Duration::from_secs(10))
        .await
        .unwrap();

    // The silent waiter: queued first through a proxy, with a 2 s presence lease.
    let (paused, proxy) = proxied(&etcd, &prefix).await;
    let silent = paused.permit_store();
    let _wakeups = silent.permit_subscribe(&name, "silent").await.unwrap();
    let reply = silent
        .permit_acquire(&name, "silent", 2, LONG)
        .await
        .unwrap();
    assert!(reply.owner.owner_id.is_empty(), "{:?}", reply.owner);

    // The live waiter, behind it.
    let live_store = direct.permit_store();
    let live = Semaphore::new(live_store.clone(), config, &name, 2).unwrap();
    let waiter = tokio::spawn(async move {
        let g = live.acquire_timeout(Duration::from_secs(60)).await;
        (Instant::now(), g)
    });
    // Bound: the live waiter queues with its first call, a round trip or two.
    let queued = timeout(Duration::from_secs(15), async {
        while keys(&direct, &live_store, &name).await < 4 {
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(queued.is_ok(), "the live waiter never queued");

    proxy.blackhole(true);
    let released_at = Instant::now();
    first.release().await.unwrap();
    let (taken_at, taken) = waiter.await.unwrap();
    let taken = taken.expect("the live waiter got a permit");
    let took = taken_at - released_at;
    println!("a permit past a silent waiter: {took:?}");
    // The presence lease is 2 s (kept alive every 2/3 s: it ends at most 2 s after the
    // blackhole), the leader revokes an expired lease within 500 ms, then the watch wakes
    // the live waiter; 7 s leaves room for a loaded machine and stays far below the 14 s
    // the silent waiter's place would last by the rule alone.
    assert!(took <= Duration::from_secs(7), "took {took:?}");
    assert!(
        taken.fence() > second.fence(),
        "the new fence is not greater"
    );
    let listed = holders.holders().await.unwrap();
    let mut ids: Vec<String> = listed.holders.iter().map(|h| h.owner_id.clone()).collect();
    ids.sort_unstable();
    let mut expected = vec![
        second.contender_id().to_owned(),
        taken.contender_id().to_owned(),
    ];
    expected.sort_unstable();
    assert_eq!(ids, expected);
    taken.release().await.unwrap();
    second.release().await.unwrap();
    proxy.heal();
}

/// The connector opens working etcd semaphores: one permit, held on one connection, is
/// refused to the other until released, and a count mismatch is typed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connector_opens_semaphores() {
    use simba_core::connect::{ConnectOptions, Connectors};
    let etcd = server().await;
    let url = format!("{}{}", etcd.url(), random_prefix());
    let connectors = Connectors::new(vec![&simba_etcd::CONNECTOR]);
    let a = connectors
        .connect(&url, &ConnectOptions::default())
        .await
        .unwrap();
    let b = connectors
        .connect(&url, &ConnectOptions::default())
        .await
        .unwrap();
    let name = unique_name("sem_conn");
    let sa = a.open_semaphore(&name, 1).await.unwrap();
    let sb = b.open_semaphore(&name, 1).await.unwrap();
    let g = sa.acquire_timeout(Duration::from_secs(10)).await.unwrap();
    assert!(matches!(
        sb.try_acquire().await,
        Err(simba_core::Error::WouldBlock { .. })
    ));
    let wrong = b.open_semaphore(&name, 2).await.unwrap();
    assert!(matches!(
        wrong.try_acquire().await,
        Err(simba_core::Error::PermitsMismatch { existing: 1, .. })
    ));
    g.release().await.unwrap();
    let g = sb.acquire_timeout(Duration::from_secs(10)).await.unwrap();
    g.release().await.unwrap();
}

/// The fence of a permit is given when it is taken, not when its contender queued: with
/// two permits freed at once, the later of two waiters taking first gets the smaller
/// fence, and the earlier one, taking after it, a greater one (fences from the keys'
/// create revisions would have it the other way round).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_takes_later_gets_the_greater_fence() {
    let etcd = server().await;
    let f = EtcdFactory::connect(test_config(
        etcd.url(),
        &random_prefix(),
        Duration::from_secs(5),
    ))
    .await
    .unwrap();
    let store = f.permit_store();
    let name = unique_name("sem_late");
    let ask = |who: &'static str| store.permit_acquire(&name, who, 3, LONG);
    let mut fences = Vec::new();
    for who in ["a", "b", "c"] {
        let reply = ask(who).await.unwrap();
        assert_eq!(reply.owner.owner_id, who);
        fences.push(reply.owner.fence);
    }
    for who in ["w1", "w2"] {
        assert!(
            ask(who).await.unwrap().owner.owner_id.is_empty(),
            "{who} waits"
        );
    }
    assert!(store.permit_release(&name, "a").await.unwrap());
    assert!(store.permit_release(&name, "b").await.unwrap());
    // Two permits free, one owed to each waiter: w2 calls first.
    let second = ask("w2").await.unwrap();
    assert_eq!(second.owner.owner_id, "w2");
    let first = ask("w1").await.unwrap();
    assert_eq!(first.owner.owner_id, "w1");
    let last = fences.iter().copied().max().unwrap_or(0);
    assert!(
        second.owner.fence > last,
        "{} after {last}",
        second.owner.fence
    );
    assert!(
        first.owner.fence > second.owner.fence,
        "w1 took after w2 with fence {}, not above w2's {}",
        first.owner.fence,
        second.owner.fence
    );
    for who in ["c", "w1", "w2"] {
        assert!(store.permit_release(&name, who).await.unwrap(), "{who}");
    }
}

/// The permit lease of the clock and lease-end tests: 2 s + 1 s, so a holder key's etcd
/// lease is 3 s.
const SHORT: Lease = Lease {
    ttl: Duration::from_secs(2),
    transition: Duration::from_secs(1),
};

/// A holder that keeps renewing keeps its permit against a contender whose clock runs
/// 10 s ahead: that one sees the holder's `transition_at` long past on its clock, yet does
/// not take the permit, and reads the holder as holding, until the holder releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewing_holder_keeps_its_permit_against_a_clock_running_ahead() {
    let etcd = server().await;
    let f = EtcdFactory::connect(test_config(
        etcd.url(),
        &random_prefix(),
        Duration::from_secs(5),
    ))
    .await
    .unwrap();
    let here = f.permit_store();
    let ahead = here.with_clock_offset(10_000);
    let name = unique_name("sem_skew");
    let took = here.permit_acquire(&name, "a", 1, SHORT).await.unwrap();
    assert_eq!(took.owner.owner_id, "a");
    let fence = took.owner.fence;
    // Two key leases and more: the holder renews every 500 ms (well within its 2 s ttl on
    // a loaded machine), the other asks in between.
    let until = Instant::now() + Duration::from_secs(7);
    let mut asked = 0;
    while Instant::now() < until {
        let renewed = here.permit_guard(&name, "a", 1, SHORT).await.unwrap();
        assert_eq!(renewed.owner.owner_id, "a", "the holder lost its permit");
        assert_eq!(renewed.owner.fence, fence);
        let other = ahead.permit_acquire(&name, "b", 1, SHORT).await.unwrap();
        assert!(
            other.owner.owner_id.is_empty(),
            "the contender 10 s ahead took the permit of a live holder: {:?}",
            other.owner
        );
        let seen = ahead.permit_owners(&name).await.unwrap();
        let ids: Vec<&str> = seen.holders.iter().map(|h| h.owner_id.as_str()).collect();
        assert_eq!(ids, ["a"], "read by the contender 10 s ahead");
        assert!(
            seen.holders[0].transition_at < seen.now,
            "the holder's transition_at is past on the skewed clock (the case under test)"
        );
        asked += 1;
        sleep(Duration::from_millis(500)).await;
    }
    assert!(asked >= 3, "asked {asked} times");
    assert!(here.permit_release(&name, "a").await.unwrap());
    let next = ahead.permit_acquire(&name, "b", 1, SHORT).await.unwrap();
    assert_eq!(
        next.owner.owner_id, "b",
        "the freed permit goes to the waiter"
    );
    assert!(next.owner.fence > fence);
    assert!(ahead.permit_release(&name, "b").await.unwrap());
}

/// A holder that stops renewing (without releasing) keeps its permit until its key's etcd
/// lease ends — `ttl + transition` rounded up to whole seconds after its last renewal —
/// and no longer: a waiter on the engine takes it then, woken by the key's deletion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_holders_permit_returns_when_its_key_lease_ends() {
    let etcd = server().await;
    let f = EtcdFactory::connect(test_config(
        etcd.url(),
        &random_prefix(),
        Duration::from_secs(5),
    ))
    .await
    .unwrap();
    let store = f.permit_store();
    let name = unique_name("sem_dead");
    assert_eq!(
        store
            .permit_acquire(&name, "a", 1, SHORT)
            .await
            .unwrap()
            .owner
            .owner_id,
        "a"
    );
    // The renewal's send time: its key lease is granted after it.
    let sent = Instant::now();
    let renewed = store.permit_guard(&name, "a", 1, SHORT).await.unwrap();
    assert_eq!(renewed.owner.owner_id, "a");
    let key = format!("{}/a", store.semaphore_key(&name));
    let kv = f.client().kv_client().get(key, None).await.unwrap();
    let lease = kv.kvs().first().map(|k| k.lease()).unwrap_or(0);
    assert_ne!(lease, 0, "the holder key is on a lease");
    let ttl = f
        .client()
        .lease_client()
        .time_to_live(lease, None)
        .await
        .unwrap();
    assert_eq!(ttl.granted_ttl(), 3, "ttl + transition, rounded up");
    // "a" falls silent. A waiter on the engine, on another store.
    let waiter = Semaphore::new(
        f.permit_store(),
        LeaseConfig::with_lease(SHORT.ttl, SHORT.transition),
        &name,
        1,
    )
    .unwrap();
    let permit = waiter
        .acquire_timeout(Duration::from_secs(20))
        .await
        .unwrap();
    let after = sent.elapsed();
    eprintln!("a silent holder's permit returned {after:?} after its last renewal was sent");
    assert!(permit.fence() > renewed.owner.fence);
    // Not before the key lease (3 s from a grant made after `sent`); the leader's lessor
    // looks for expired leases every 500 ms and the revoke goes through Raft, then the
    // watch wakes the waiter: 3 s of slack on a loaded 2-core machine.
    assert!(after >= Duration::from_secs(3), "returned after {after:?}");
    assert!(after <= Duration::from_secs(6), "returned after {after:?}");
    permit.release().await.unwrap();
}
