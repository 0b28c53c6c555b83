//! Redis Cluster: three primaries from the test kit.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::test_config;
use simba_core::backend::{Lease, LeaseStore};
use simba_core::{ContendService, LeaseServiceFactory, SilentContender};
use simba_redis::RedisStore;
use simba_test_kit::servers::redis_cluster;
use simba_test_kit::support::{expect_status, init_tracing, lease, unique_name};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_acquire_renew_release_and_handoff() {
    init_tracing();
    let cluster = redis_cluster(3).await.unwrap_or_else(|e| panic!("{e}"));
    let url = cluster.cluster_url();
    let prefix = unique_name("t");
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
    let timing = lease(Duration::from_secs(5), Duration::from_secs(2));
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
        let first = expect_status(&o, "owner", Duration::from_secs(5), |s| s.held.is_some()).await;
        w.start().unwrap();
        expect_status(&w, "waiter", Duration::from_secs(5), |s| s.attempts > 0).await;
        let t0 = Instant::now();
        o.stop().await.unwrap();
        // A poll would come ~7 s later; 1.5 s shows the release was pushed.
        let st = expect_status(&w, "handoff", Duration::from_millis(1500), |s| {
            s.held.is_some()
        })
        .await;
        tracing::info!(mutex = %m, took = ?t0.elapsed(), "cluster handoff");
        assert!(st.held.map(|h| h.fence) > first.held.map(|h| h.fence));
        w.stop().await.unwrap();
    }
}

/// The id of a cluster node (`CLUSTER MYID`).
async fn node_id(client: &fred::clients::Client) -> String {
    common::cmd(client, "CLUSTER", &["MYID"])
        .await
        .as_string()
        .unwrap()
}

/// Moves `slot` from `from` to `to` as `redis-cli --cluster reshard` does: IMPORTING /
/// MIGRATING, `MIGRATE` of its keys in batches, then `SETSLOT NODE` on every node.
async fn migrate_slot(
    nodes: &[fred::clients::Client],
    ports: &[u16],
    ids: &[String],
    slot: u16,
    from: usize,
    to: usize,
) {
    let slot = slot.to_string();
    common::cmd(
        &nodes[to],
        "CLUSTER",
        &["SETSLOT", &slot, "IMPORTING", &ids[from]],
    )
    .await;
    common::cmd(
        &nodes[from],
        "CLUSTER",
        &["SETSLOT", &slot, "MIGRATING", &ids[to]],
    )
    .await;
    loop {
        let keys = common::cmd(&nodes[from], "CLUSTER", &["GETKEYSINSLOT", &slot, "1"]).await;
        let keys: Vec<String> = match keys {
            fred::types::Value::Array(v) => v.iter().filter_map(|k| k.as_string()).collect(),
            other => panic!("GETKEYSINSLOT: {other:?}"),
        };
        let Some(key) = keys.first() else {
            break;
        };
        // One key at a time, so the owner's scripts meet the slot half-moved.
        let port = ports[to].to_string();
        common::cmd(
            &nodes[from],
            "MIGRATE",
            &["127.0.0.1", &port, "", "0", "5000", "KEYS", key],
        )
        .await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for node in nodes {
        common::cmd(node, "CLUSTER", &["SETSLOT", &slot, "NODE", &ids[to]]).await;
    }
}

/// The slot of a held mutex's hash tag migrates back and forth between two nodes, key by
/// key, while its owner renews, a waiter waits, and the two hand the mutex over: no two
/// ownerships overlap and fences keep increasing (the kit's history checker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_migration_of_a_held_mutex_keeps_safety() {
    use simba_test_kit::history::History;
    init_tracing();
    let cluster = redis_cluster(3).await.unwrap_or_else(|e| panic!("{e}"));
    let url = cluster.cluster_url();
    let prefix = unique_name("t");
    let timing = lease(Duration::from_secs(1), Duration::from_millis(500));
    let factory = |store| LeaseServiceFactory::new(store, timing.clone()).unwrap();
    let fa = factory(
        RedisStore::connect(test_config(&url, &prefix))
            .await
            .unwrap(),
    );
    let fb = factory(
        RedisStore::connect(test_config(&url, &prefix))
            .await
            .unwrap(),
    );
    let m = "migrating";
    let slot = fred::util::redis_keyslot(fa.store().owner_key(m).as_bytes());
    let home = usize::from(slot) * 3 / 16_384;
    let away = (home + 1) % 3;

    let mut nodes = Vec::new();
    let mut ids = Vec::new();
    let mut ports = Vec::new();
    for node in cluster.nodes() {
        let c = common::raw(node.url()).await;
        ids.push(node_id(&c).await);
        ports.push(node.port());
        nodes.push(c);
    }

    let history = History::new();
    let a = fa.contend_service(m, history.contender("a")).unwrap();
    let b = fb.contend_service(m, history.contender("b")).unwrap();
    a.start().unwrap();
    expect_status(&a, "owner", Duration::from_secs(5), |s| s.held.is_some()).await;
    b.start().unwrap();
    expect_status(&b, "waiter", Duration::from_secs(5), |s| s.attempts > 0).await;

    let (mut from, mut to) = (home, away);
    let mut stalls = 0;
    for round in 0..6 {
        migrate_slot(&nodes, &ports, &ids, slot, from, to).await;
        std::mem::swap(&mut from, &mut to);
        // Hand over now and then: the owner stops (releasing), and comes back as a waiter.
        let (owner, other) = if a.is_owner() { (&a, &b) } else { (&b, &a) };
        if round % 2 == 1 && owner.is_owner() {
            owner.stop().await.unwrap();
            // Liveness is not what this test checks: after a migration, calls sometimes
            // time out for seconds (an open problem, see the README), so a handoff that
            // does not come in time is reported, not failed.
            let mut rx = other.status();
            let handed =
                tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|s| s.held.is_some()))
                    .await;
            if handed.is_err() {
                stalls += 1;
                tracing::warn!(status = ?*other.status().borrow(), "no handoff within 10 s");
            }
            owner.start().unwrap();
        }
        // Let a few renewals (every ttl) happen on the slot's new node.
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }
    a.stop().await.unwrap();
    b.stop().await.unwrap();
    let v = history.violations();
    assert!(v.is_empty(), "violations across slot migrations: {v:?}");
    assert!(history.len() >= 2, "only {} ownerships", history.len());
    tracing::info!(stalls, ownerships = history.len(), "slot migrations done");
}

/// The replica check on Cluster: `WAIT` reaches the primary that took the write, so a
/// stopped replica of *that* primary makes the acquisition fail, while mutexes on other
/// primaries go on. (A `WAIT` routed by its arguments' slot would reach another primary,
/// whose running replica would "confirm" a write it never saw.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_check_waits_on_the_primary_of_the_mutex() {
    init_tracing();
    let cluster = simba_test_kit::servers::redis_cluster_with_replicas(3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!(
        "{}&replicaAcks=1&replicaAckTimeoutMs=300",
        cluster.cluster_url()
    );
    let store = RedisStore::connect(test_config(&url, &unique_name("t")))
        .await
        .unwrap();
    let node_of = |key: &str| usize::from(fred::util::redis_keyslot(key.as_bytes())) * 3 / 16_384;
    let on_node = |prefix: &str, wanted: &dyn Fn(usize) -> bool| {
        (0..1000)
            .map(|i| format!("{prefix}{i}"))
            .find(|m| wanted(node_of(&store.owner_key(m))))
            .unwrap()
    };
    // A mutex away from the node that routing by the slot of WAIT's first argument would
    // pick, so that only routing by the mutex's own slot can fail below.
    let misrouted = node_of("1");
    let mutex = on_node("r", &|n| n != misrouted);
    let node = node_of(&store.owner_key(&mutex));
    let lease_of = Lease {
        ttl: Duration::from_secs(5),
        transition: Duration::from_secs(1),
    };

    let got = store.acquire(&mutex, "a", lease_of).await.unwrap();
    assert_eq!(got.owner.owner_id, "a");
    let renewed = store.guard(&mutex, "a", lease_of).await.unwrap();
    assert_eq!(renewed.owner.fence, got.owner.fence);
    assert!(store.release(&mutex, "a").await.unwrap());

    cluster.replicas()[node].pause().await.unwrap();
    let refused = store.acquire(&mutex, "a", lease_of).await;
    let other = on_node("o", &|n| n != node);
    let elsewhere = store.acquire(&other, "a", lease_of).await;
    cluster.replicas()[node].resume().await.unwrap();
    match refused {
        Err(e) => assert!(e.to_string().contains("only 0 of the 1 replica"), "{e}"),
        Ok(r) => panic!("counted without the replica of its primary: {r:?}"),
    }
    assert_eq!(
        elsewhere.unwrap().owner.owner_id,
        "a",
        "another primary's mutex"
    );

    // Back: the same call counts again (the replica catches up with the write).
    let again = store.acquire(&mutex, "a", lease_of).await.unwrap();
    assert_eq!(again.owner.owner_id, "a");
}

/// A Cluster failover with the replica check (the Cluster form of the Sentinel test): a
/// confirmed owner keeps its key and fence on the promoted replica, an acquisition made
/// while replication was frozen is refused rather than counted, and the next owner's
/// fence is above every fence handed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_with_replica_acks_keeps_the_owner_and_fences() {
    init_tracing();
    let cluster = simba_test_kit::servers::redis_cluster_with_replicas(3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!(
        "{}&replicaAcks=1&replicaAckTimeoutMs=500",
        cluster.cluster_url()
    );
    let prefix = unique_name("t");
    let config = || test_config(&url, &prefix).with_connect_timeout(Duration::from_secs(15));
    let a_store = RedisStore::connect(config()).await.unwrap();
    let node_of = |m: &str| {
        usize::from(fred::util::redis_keyslot(a_store.owner_key(m).as_bytes())) * 3 / 16_384
    };
    // Three mutexes on one primary: the held one, the contended one, and one whose
    // confirmed acquisition proves the replica has every write before it.
    let node = node_of("h");
    let mut same = (0..1000)
        .map(|i| format!("n{i}"))
        .filter(|m| node_of(m) == node);
    let (m, sync) = (same.next().unwrap(), same.next().unwrap());
    // Longer than the whole scenario (a failover and reconnects within their bounds).
    let hold = Lease {
        ttl: Duration::from_secs(600),
        transition: Duration::from_secs(5),
    };
    let short = Lease {
        ttl: Duration::from_secs(20),
        transition: Duration::from_secs(5),
    };
    let held = common::retry_acquire_for(&a_store, "h", "a", hold).await;
    let warm = common::retry_acquire_for(&a_store, &m, "warm", short).await;
    assert!(a_store.release(&m, "warm").await.unwrap());
    common::retry_acquire_for(&a_store, &sync, "warm", short).await;

    cluster.freeze_replication(node).await.unwrap();
    let e = a_store
        .acquire(&m, "a", short)
        .await
        .expect_err("an acquisition no replica has must not count");
    assert!(e.is_retryable() && e.to_string().contains("replica"), "{e}");

    cluster
        .kill_primary_and_fail_over(node, Duration::from_secs(60))
        .await
        .unwrap();
    let b_store = RedisStore::connect(config()).await.unwrap();
    let b = common::retry_acquire_for(&b_store, &m, "b", short).await;
    assert!(
        b > warm,
        "fence {b} after {warm}: a fence was handed out twice"
    );
    let seen = b_store.acquire("h", "b", short).await.unwrap();
    assert_eq!(
        seen.owner.owner_id, "a",
        "the promoted replica lost a confirmed owner"
    );
    assert_eq!(seen.owner.fence, held);
    // a's own connections find the new primary, and a renews with its fence.
    let t0 = tokio::time::Instant::now();
    let renewed = loop {
        match a_store.guard("h", "a", hold).await {
            Ok(r) => break r,
            Err(e) => assert!(t0.elapsed() < Duration::from_secs(30), "{e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (renewed.owner.owner_id.as_str(), renewed.owner.fence),
        ("a", held)
    );
}

/// Fences on a Cluster failover that loses a counted acquisition (the replica check off,
/// replication frozen): the promoted replica has an older fence counter, yet the next
/// owner's fence is above the lost one (the fence follows the primary's clock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_that_loses_a_fence_hands_out_a_larger_one() {
    init_tracing();
    let cluster = simba_test_kit::servers::redis_cluster_with_replicas(3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    let url = cluster.cluster_url();
    let config = || test_config(&url, &prefix).with_connect_timeout(Duration::from_secs(15));
    let short = Lease {
        ttl: Duration::from_secs(20),
        transition: Duration::from_secs(5),
    };
    // The counter reaches the replica: a warm-up confirmed by it.
    let confirmed = RedisStore::connect(config().with_replica_acks(Some(1)))
        .await
        .unwrap();
    let warm = common::retry_acquire_for(&confirmed, "m", "warm", short).await;
    assert!(confirmed.release("m", "warm").await.unwrap());
    common::retry_acquire_for(&confirmed, "m", "warm", short).await;
    assert!(confirmed.release("m", "warm").await.unwrap());
    let node = usize::from(fred::util::redis_keyslot(
        confirmed.owner_key("m").as_bytes(),
    )) * 3
        / 16_384;
    cluster.freeze_replication(node).await.unwrap();
    let a_store = RedisStore::connect(config()).await.unwrap();
    let a = a_store.acquire("m", "a", short).await.unwrap();
    assert_eq!(a.owner.owner_id, "a");
    assert!(a.owner.fence > warm);
    cluster
        .kill_primary_and_fail_over(node, Duration::from_secs(60))
        .await
        .unwrap();
    let b_store = RedisStore::connect(config()).await.unwrap();
    let b = common::retry_acquire_for(&b_store, "m", "b", short).await;
    assert!(
        b > a.owner.fence,
        "B's fence {b} is not above A's {}: a fence was handed out twice",
        a.owner.fence
    );
}
