//! Semaphores on a real ZooKeeper: the kit's semaphore and read-write lock cases, and a
//! holder cut off from the server.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{proxied, random_root, server, test_config};
use simba_core::{Error, LossReason};
use simba_zookeeper::ZkFactory;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, timeout};
use zookeeper_async::ZooKeeper;

simba_test_kit::semaphore_tests!(common::ZkPermitHarness::start().await);

simba_test_kit::rw_lock_tests!(common::ZkPermitHarness::start().await);

/// A holder whose connection is cut (as for a partitioned or killed process) stops
/// believing at its local deadline; its permit then returns to the waiter (at the lease's
/// end on the server's clock, or at the session's end, whichever the waiter sees first),
/// with a greater fence, and the holder's node is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_off_holder_permit_returns_to_a_waiter() {
    let zk = server().await;
    let root = random_root();
    let session = Duration::from_secs(4);
    let (fa, proxy) = proxied(&zk, |c| test_config(c, &root, session)).await;
    let fb = ZkFactory::connect(test_config(zk.url(), &root, session))
        .await
        .unwrap();
    let name = simba_test_kit::support::unique_name("sem_cut");
    let held = fa.semaphore(&name, 1).unwrap();
    let other = fb.semaphore(&name, 1).unwrap();
    let g = held.acquire_timeout(Duration::from_secs(10)).await.unwrap();
    let waiter = tokio::spawn(async move {
        let got = other.acquire_timeout(Duration::from_secs(30)).await;
        (Instant::now(), got)
    });
    proxy.blackhole(true);
    let cut_at = Instant::now();
    // Bound: the lease is 2 s (half the session); the loss comes at the local deadline,
    // well within 10 s on a loaded machine.
    let reason = timeout(Duration::from_secs(10), g.lost())
        .await
        .expect("the cut-off holder never stopped believing");
    let lost_at = Instant::now();
    assert_eq!(reason, LossReason::LeaseExpired);
    let (taken_at, taken) = waiter.await.unwrap();
    let taken = taken.expect("the waiter got the permit");
    assert!(
        lost_at <= taken_at,
        "taken {:?} after the cut, before the holder's loss ({:?} after the cut)",
        taken_at - cut_at,
        lost_at - cut_at
    );
    assert!(taken.fence() > g.fence(), "the new fence is not greater");
    let holders = fb.semaphore(&name, 1).unwrap().holders().await.unwrap();
    assert_eq!(holders.permits, Some(1));
    assert_eq!(holders.holders.len(), 1, "{holders:?}");
    assert_eq!(holders.holders[0].owner_id, taken.contender_id());
    taken.release().await.unwrap();
    proxy.heal();
    drop(g);
}

/// A lease longer than half the session timeout is refused at once, typed: the session
/// could expire, and the node go, while the holder still believes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_longer_than_half_the_session_is_refused() {
    let zk = server().await;
    let root = random_root();
    let f = ZkFactory::connect(test_config(zk.url(), &root, Duration::from_secs(4)))
        .await
        .unwrap();
    let config =
        simba_core::LeaseConfig::with_lease(Duration::from_secs(2), Duration::from_secs(1));
    let s = simba_core::Semaphore::new(f.permit_store(), config, "sem_long", 2).unwrap();
    match timeout(Duration::from_secs(10), s.acquire()).await.unwrap() {
        Err(Error::Unsupported { backend, .. }) => assert_eq!(backend, "zookeeper"),
        other => panic!("a 3 s lease on a 4 s session: {other:?}"),
    }
    // The fitted lease works.
    let ok = f.semaphore("sem_long", 2).unwrap();
    ok.try_acquire().await.unwrap().release().await.unwrap();
}

/// A handover pushed by a watch takes a few round trips; 5 s leaves room for a loaded
/// machine and is far below the 30 s lease a waiter that was not woken would wait for.
const HANDOVER: Duration = Duration::from_secs(5);

/// Waits until the semaphore node at `path` has `count` children (polled: the children
/// are the subject, and a raw client has nothing to wait on for a count).
async fn wait_children(raw: &ZooKeeper, path: &str, count: usize) {
    let started = Instant::now();
    loop {
        let n = raw.get_children(path, false).await.map_or(0, |c| c.len());
        if n == count {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{path} has {n} children, not {count}"
        );
        sleep(Duration::from_millis(20)).await;
    }
}

/// Waiters are handed permits by watches, not by the lease's end: with two permits held
/// by A and B and waiters C then D queued, A's release gives C the permit (C watches the
/// children), and C's first renewal wakes D (which watched only C), so that B's release
/// then gives D the permit. Either step missed would leave a waiter to its 30 s look.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_handed_permits_by_watches() {
    let zk = server().await;
    let root = random_root();
    let session = common::PERMIT_SESSION;
    let mut factories = Vec::new();
    for _ in 0..4 {
        factories.push(
            ZkFactory::connect(test_config(zk.url(), &root, session))
                .await
                .unwrap(),
        );
    }
    let name = simba_test_kit::support::unique_name("sem_chain");
    let sems: Vec<_> = factories
        .iter()
        .map(|f| f.semaphore(&name, 2).unwrap())
        .collect();
    assert_eq!(
        factories[0].permit_lease().ttl + factories[0].permit_lease().transition,
        Duration::from_secs(30)
    );
    let path = factories[0].permit_store().semaphore_path(&name);
    let raw = ZooKeeper::connect(zk.url(), Duration::from_secs(10), |_e| {})
        .await
        .unwrap();
    let a = sems[0].acquire().await.unwrap();
    let b = sems[1].acquire().await.unwrap();
    let spawn = |i: usize| -> JoinHandle<_> {
        let s = sems[i].clone();
        tokio::spawn(async move {
            let g = s.acquire_timeout(Duration::from_secs(60)).await;
            (Instant::now(), g)
        })
    };
    let c = spawn(2);
    wait_children(&raw, &path, 3).await;
    let d = spawn(3);
    wait_children(&raw, &path, 4).await;

    let released = Instant::now();
    a.release().await.unwrap();
    let (at, gc) = timeout(HANDOVER * 2, c)
        .await
        .expect("C was not woken")
        .unwrap();
    let gc = gc.unwrap();
    assert!(
        at - released < HANDOVER,
        "C got it {:?} after A's release",
        at - released
    );
    assert!(gc.fence() > b.fence());
    assert!(!d.is_finished(), "D got a third permit of two");

    let released = Instant::now();
    b.release().await.unwrap();
    let (at, gd) = timeout(HANDOVER * 2, d)
        .await
        .expect("D was not woken")
        .unwrap();
    let gd = gd.unwrap();
    assert!(
        at - released < HANDOVER,
        "D got it {:?} after B's release",
        at - released
    );
    assert!(gd.fence() > gc.fence());
    let holders = sems[0].holders().await.unwrap();
    let ids: Vec<&str> = holders
        .holders
        .iter()
        .map(|h| h.owner_id.as_str())
        .collect();
    assert_eq!(ids, vec![gc.contender_id(), gd.contender_id()]);
    gc.release().await.unwrap();
    gd.release().await.unwrap();
    let _ = raw.close().await;
}

/// A holder past its lease does not hold the count: while a cut-off holder of a 2-permit
/// semaphore believes, a contender asking for 3 is refused; once its lease has ended
/// (the holder lost), the contender removes its node, and 3 becomes the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_count_changes_once_the_last_lease_ended() {
    let zk = server().await;
    let root = random_root();
    let session = Duration::from_secs(4);
    let (fa, proxy) = proxied(&zk, |c| test_config(c, &root, session)).await;
    let fb = ZkFactory::connect(test_config(zk.url(), &root, session))
        .await
        .unwrap();
    let name = simba_test_kit::support::unique_name("sem_recount");
    let g = fa.semaphore(&name, 2).unwrap().acquire().await.unwrap();
    let three = fb.semaphore(&name, 3).unwrap();
    match three.try_acquire().await {
        Err(Error::PermitsMismatch {
            asked: 3,
            existing: 2,
            ..
        }) => {}
        other => panic!("3 asked while 2 are held: {other:?}"),
    }
    proxy.blackhole(true);
    // Bound: the loss comes at the local deadline, within the 2 s lease.
    let reason = timeout(Duration::from_secs(10), g.lost())
        .await
        .expect("the cut-off holder never stopped believing");
    assert_eq!(reason, LossReason::LeaseExpired);
    // The holder stops believing a drift margin before its lease ends on the server's
    // clock; the backend's view is the subject here, so read it until the lease is over.
    let started = Instant::now();
    while three.holders().await.unwrap().permits.is_some() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the cut-off holder's lease never ended"
        );
        sleep(Duration::from_millis(50)).await;
    }
    let got = three
        .acquire_timeout(Duration::from_secs(10))
        .await
        .expect("the count changes once no lease is left");
    assert!(got.fence() > g.fence());
    assert_eq!(three.holders().await.unwrap().permits, Some(3));
    got.release().await.unwrap();
    proxy.heal();
    drop(g);
}
