//! Hand-overs on a real etcd while other writes move its revision on.
//!
//! A waiter reads its predecessor in a transaction and then opens a watch on it from etcd's
//! revision at that moment (not from the transaction's, which etcd serves from its
//! 100 ms catch-up loop once the store has moved on). A deletion that falls between the
//! two is then not in the watch: the waiter reads the predecessor again when the revision
//! moved. Missing that read leaves the waiter watching a key that is already gone, which
//! nothing wakes: the acquisitions below would time out.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::{LEASE, random_prefix, server, test_config};
use simba_core::{ContendServiceFactory, Locker};
use simba_etcd::EtcdFactory;
use simba_test_kit::support::unique_name;

/// Contenders taking turns, and turns each. Two: each waiter's predecessor is then the
/// owner, which releases within microseconds of owning, so its key is often deleted in the
/// gap between the waiter's read and its watch. (With the re-read removed, this test fails
/// on a stuck waiter every time; with five contenders it did not, the predecessor being
/// another waiter.)
const CONTENDERS: usize = 2;
const TURNS: usize = 100;

/// One acquisition waits for at most the other contender's turn, a few round trips; 20 s
/// covers a loaded machine many times over and still fails long before the test harness's
/// own limit if a waiter is stuck.
const WAIT: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_see_deletions_while_other_writes_move_the_revision() {
    let etcd = server().await;
    let prefix = random_prefix();
    let mutex = unique_name("busy");
    let done = Arc::new(AtomicBool::new(false));

    // The noise: puts under another key as fast as they are answered, so that the
    // revision moves between a waiter's read and its watch again and again.
    let endpoint = format!(
        "http://{}",
        etcd.socket_addr().expect("the server's address")
    );
    let mut noise_client = etcd_client::Client::connect([endpoint], None)
        .await
        .expect("connect the writer of noise");
    let noise_key = format!("{prefix}/noise/{mutex}");
    let noise_done = done.clone();
    let noise = tokio::spawn(async move {
        let mut puts = 0u64;
        while !noise_done.load(Ordering::SeqCst) {
            noise_client
                .put(noise_key.as_str(), puts.to_string(), None)
                .await
                .expect("a put of noise");
            puts += 1;
        }
        puts
    });

    let holders = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..CONTENDERS {
        let factory: Arc<dyn ContendServiceFactory> = Arc::new(
            EtcdFactory::connect(test_config(etcd.url(), &prefix, LEASE))
                .await
                .expect("connect a contender"),
        );
        let locker = Locker::new(factory, &mutex).expect("a locker");
        let holders = holders.clone();
        tasks.spawn(async move {
            let mut last = 0u64;
            for turn in 0..TURNS {
                let guard = locker
                    .acquire_timeout(WAIT)
                    .await
                    .unwrap_or_else(|e| panic!("contender {c}, turn {turn}: {e}"));
                assert_eq!(holders.fetch_add(1, Ordering::SeqCst), 0, "two owners");
                assert!(guard.fence() > last, "the fence went back");
                last = guard.fence();
                tokio::task::yield_now().await;
                holders.fetch_sub(1, Ordering::SeqCst);
                guard.release().await.expect("release");
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.expect("a contender");
    }
    done.store(true, Ordering::SeqCst);
    let puts = noise.await.expect("the writer of noise");
    // The noise ran beside the turns (else the test proves nothing about them).
    assert!(puts > 0, "no write of noise");
}
