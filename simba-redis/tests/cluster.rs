//! Redis Cluster: three primaries from the test kit.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{lease, random_prefix, test_config, wait_status};
use simba_core::{ContendService, Lease, LeaseServiceFactory, LeaseStore, SilentContender};
use simba_redis::RedisStore;
use simba_test_kit::servers::redis_cluster;
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_acquire_renew_release_and_handoff() {
    common::init_tracing();
    let cluster = redis_cluster(3).await.unwrap_or_else(|e| panic!("{e}"));
    let url = cluster.cluster_url();
    let prefix = random_prefix();
    let store = RedisStore::connect(test_config(&url, &prefix))
        .await
        .unwrap();
    let lease_of = Lease {
        ttl: Duration::from_secs(2),
        transition: Duration::from_secs(1),
    };

    // Enough names to land on every node: each mutex's keys share one slot.
    let mut slots = std::collections::BTreeSet::new();
    for i in 0..12 {
        let m = format!("m{i}");
        slots.insert(
            usize::from(fred::util::redis_keyslot(store.owner_key(&m).as_bytes())) * 3 / 16_384,
        );
        let a = store.acquire(&m, "a", lease_of).await.unwrap();
        assert_eq!(a.owner.owner_id, "a");
        let renewed = store.guard(&m, "a", lease_of).await.unwrap();
        assert_eq!(renewed.owner.fence, a.owner.fence);
        let b = store.acquire(&m, "b", lease_of).await.unwrap();
        assert_eq!(b.owner.owner_id, "a");
        assert!(store.release(&m, "a").await.unwrap());
        assert!(!store.release(&m, "a").await.unwrap());
        let b = store.acquire(&m, "b", lease_of).await.unwrap();
        assert_eq!(b.owner.owner_id, "b");
        assert!(b.owner.fence > a.owner.fence);
        assert!(store.release(&m, "b").await.unwrap());
        assert_eq!(store.owner(&m).await.unwrap().owner.owner_id, "");
    }
    assert_eq!(slots.len(), 3, "the mutexes did not cover every node");

    // Handoff through sharded pub/sub, on mutexes served by different nodes.
    let timing = lease(5000, 2000);
    let fo = LeaseServiceFactory::new(store, timing.clone()).unwrap();
    let fw = LeaseServiceFactory::new(
        RedisStore::connect(test_config(&url, &prefix))
            .await
            .unwrap(),
        timing,
    )
    .unwrap();
    // One mutex per node (node i serves the i-th third of the slots).
    let node_of = |m: &str| fo.store().owner_key(m).as_bytes().to_vec();
    let mut names: Vec<Option<String>> = vec![None; 3];
    for i in 0.. {
        let m = format!("handoff{i}");
        let node = usize::from(fred::util::redis_keyslot(&node_of(&m))) * 3 / 16_384;
        names[node].get_or_insert(m);
        if names.iter().all(Option::is_some) {
            break;
        }
    }
    for m in names.into_iter().flatten() {
        let o = fo.contend_service(&m, Arc::new(SilentContender)).unwrap();
        let w = fw.contend_service(&m, Arc::new(SilentContender)).unwrap();
        o.start().unwrap();
        let first = wait_status(&o, "owner", Duration::from_secs(5), |s| s.held.is_some()).await;
        w.start().unwrap();
        wait_status(&w, "waiter", Duration::from_secs(5), |s| s.attempts > 0).await;
        let t0 = Instant::now();
        o.stop().await.unwrap();
        // A poll would come ~7 s later; 1.5 s shows the release was pushed.
        let st = wait_status(&w, "handoff", Duration::from_millis(1500), |s| {
            s.held.is_some()
        })
        .await;
        tracing::info!(mutex = %m, took = ?t0.elapsed(), "cluster handoff");
        assert!(st.held.map(|h| h.fence) > first.held.map(|h| h.fence));
        w.stop().await.unwrap();
    }
}
