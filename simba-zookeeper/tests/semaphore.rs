//! Semaphores on a real ZooKeeper: the kit's semaphore cases, and a holder cut off from
//! the server.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{proxied, random_root, server, test_config};
use simba_core::{Error, LossReason};
use simba_zookeeper::ZkFactory;
use tokio::time::{Instant, timeout};

simba_test_kit::semaphore_tests!(common::ZkPermitHarness::start().await);

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
