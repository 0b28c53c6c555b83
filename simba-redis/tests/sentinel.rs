//! Redis Sentinel: the store finds the primary through a sentinel.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use common::{cmd, raw, test_config};
use simba_core::backend::{Lease, LeaseStore};
use simba_core::{ContendService, LeaseServiceFactory, SilentContender};
use simba_redis::RedisStore;
use simba_test_kit::servers::{redis_private, redis_sentinel, redis_sentinel_with_replicas};
use simba_test_kit::support::{expect_status, init_tracing, lease, unique_name};
use tokio::time::Instant;

/// A sentinel process (`redis-server --sentinel`) watching one primary; killed on drop.
struct Sentinel {
    _child: tokio::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

async fn start_sentinel(primary_port: u16) -> Sentinel {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap();
    let conf = dir.path().join("sentinel.conf");
    let text = format!(
        "port {port}\nbind 127.0.0.1\ndir {}\n\
         sentinel monitor simba-primary 127.0.0.1 {primary_port} 1\n\
         sentinel down-after-milliseconds simba-primary 10000\n",
        dir.path().display()
    );
    tokio::fs::write(&conf, text).await.unwrap();
    let child = tokio::process::Command::new("redis-server")
        .arg(&conf)
        .arg("--sentinel")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("starting redis-server --sentinel: {e}"));
    let sentinel = Sentinel {
        _child: child,
        port,
        _dir: dir,
    };
    // Wait until the sentinel answers with the primary's address (no event to await).
    let t0 = Instant::now();
    loop {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            let r = raw(&format!("redis://127.0.0.1:{port}")).await;
            let addr = cmd(
                &r,
                "SENTINEL",
                &["get-master-addr-by-name", "simba-primary"],
            )
            .await;
            if let fred::types::Value::Array(v) = addr
                && v.len() == 2
            {
                break;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "sentinel never became ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sentinel
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_finds_the_primary() {
    init_tracing();
    let primary = redis_private().await.unwrap_or_else(|e| panic!("{e}"));
    let sentinel = start_sentinel(primary.port()).await;
    let url = format!(
        "redis-sentinel://127.0.0.1:{}?sentinelServiceName=simba-primary",
        sentinel.port
    );
    let prefix = unique_name("t");
    // This primary has no replica: no replica can confirm anything (see the failover
    // tests below for the replica check).
    let store = RedisStore::connect(test_config(&url, &prefix).with_replica_acks(Some(0)))
        .await
        .unwrap();
    let lease_of = Lease {
        ttl: Duration::from_secs(2),
        transition: Duration::from_secs(1),
    };
    let a = store.acquire("s", "a", lease_of).await.unwrap();
    assert_eq!(a.owner.owner_id, "a");
    // The key is on the primary the sentinel names.
    let direct = raw(primary.url()).await;
    let value = cmd(&direct, "GET", &[&store.owner_key("s")]).await;
    assert_eq!(value.as_string().as_deref(), Some("a"));
    assert!(store.release("s", "a").await.unwrap());

    // Pub/sub handoff through the sentinel-found primary.
    let timing = lease(Duration::from_secs(5), Duration::from_secs(2));
    let o = LeaseServiceFactory::new(store, timing.clone())
        .unwrap()
        .contend_service("s", Arc::new(SilentContender))
        .unwrap();
    let w = LeaseServiceFactory::new(
        RedisStore::connect(test_config(&url, &prefix).with_replica_acks(Some(0)))
            .await
            .unwrap(),
        timing,
    )
    .unwrap()
    .contend_service("s", Arc::new(SilentContender))
    .unwrap();
    o.start().unwrap();
    expect_status(&o, "owner", Duration::from_secs(5), |s| s.held.is_some()).await;
    w.start().unwrap();
    expect_status(&w, "waiter", Duration::from_secs(5), |s| s.attempts > 0).await;
    o.stop().await.unwrap();
    // A poll would come ~7 s later; 1.5 s shows the push.
    expect_status(&w, "handoff", Duration::from_millis(1500), |s| {
        s.held.is_some()
    })
    .await;
    w.stop().await.unwrap();
}

/// A lease long enough that the first owner still believes it owns through the whole
/// failover (which takes a few seconds: the sentinels call the primary down after 1 s).
fn long_lease() -> Lease {
    Lease {
        ttl: Duration::from_secs(20),
        transition: Duration::from_secs(5),
    }
}

/// Warms a mutex up: one acquisition and release, replicated, so that the new primary
/// will have the fence counter (as it would in any long-lived deployment). Replication is
/// asynchronous, so the warm-up ends with an acquisition of another mutex that one replica
/// confirmed (`WAIT 1`) on the same connection: the replica then has every write before
/// it, the release included. Without that, a freeze right after the warm-up could leave
/// the replica without the counter, and the promoted replica would seed a new, larger
/// fence from its clock (seen in a cold run of the test command).
async fn warm_up(url: &str, prefix: &str, mutex: &str) -> u64 {
    let store = RedisStore::connect(
        test_config(url, prefix)
            .with_replica_acks(Some(1))
            .with_connect_timeout(Duration::from_secs(15)),
    )
    .await
    .unwrap();
    let fence = retry_acquire(&store, mutex, "warm").await;
    assert!(store.release(mutex, "warm").await.unwrap());
    let sync = format!("{mutex}-replicated");
    retry_acquire(&store, &sync, "warm").await;
    fence
}

/// The finding of issue #14, reproduced with the replica check and the failover quarantine
/// turned off: replication is frozen, an owner acquires, the primary dies and the replica
/// is promoted without the owner key. A second contender then acquires while the first
/// still believes it owns: the failure that the replica check (next test) and the
/// failover quarantine prevent. Its fence is still larger (it once was the same: the
/// fence follows the server's clock now).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_without_replica_acks_loses_the_owner_but_fences_still_increase() {
    init_tracing();
    let deployment = redis_sentinel().await.unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    let config = || {
        test_config(&deployment.url(), &prefix)
            .with_replica_acks(Some(0))
            .with_connect_timeout(Duration::from_secs(15))
    };
    let a_store = RedisStore::connect(config()).await.unwrap();
    let warm = warm_up(&deployment.url(), &prefix, "m").await;
    deployment.freeze_replication().await.unwrap();
    let a = a_store.acquire("m", "a", long_lease()).await.unwrap();
    assert_eq!(a.owner.owner_id, "a");
    assert!(a.owner.fence > warm, "{} after {warm}", a.owner.fence);
    let epoch = deployment.config_epoch().await.unwrap();
    deployment
        .kill_primary_and_fail_over(Duration::from_secs(60))
        .await
        .unwrap();
    let b_store = RedisStore::connect(config()).await.unwrap();
    let b = b_store.acquire("m", "b", long_lease()).await.unwrap();
    let failovers = deployment.config_epoch().await.unwrap() - epoch;
    if failovers > 1 && b.owner.owner_id == "a" {
        // A second failover (the new primary missed the sentinels' 1 s window on a loaded
        // machine) promoted the old primary, restarted from its append-only file with a's
        // key: the loss this test shows did not happen in this run.
        eprintln!("{failovers} failovers: the old primary came back with a's key");
        return;
    }
    // a's lease (25 s from its acquisition) has not ended, yet b owns: the unsafety.
    assert_eq!(b.owner.owner_id, "b", "the promoted replica kept a's key");
    assert!(
        b.owner.fence > a.owner.fence,
        "fences of a and b: {} and {}",
        a.owner.fence,
        b.owner.fence
    );
}

/// simba's answer: behind Sentinel every acquisition and renewal waits for one replica
/// (`WAIT 1`); one that no replica confirmed fails and is not counted. Across a failover
/// with frozen replication, fences stay strictly increasing and a confirmed owner's key
/// survives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_with_replica_acks_keeps_exclusion_and_fences() {
    init_tracing();
    let deployment = redis_sentinel().await.unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    // The default for Sentinel: one replica must confirm.
    let config =
        || test_config(&deployment.url(), &prefix).with_connect_timeout(Duration::from_secs(15));
    let a_store = RedisStore::connect(config()).await.unwrap();

    // A confirmed owner of "h", with a lease that outlasts everything below (a failover
    // with a re-election can take most of its 60 s bound, and the retries 15 s each): the
    // check after the failover must see a lease that has not ended, not one that expired.
    let hold = Lease {
        ttl: Duration::from_secs(600),
        transition: Duration::from_secs(5),
    };
    let held = common::retry_acquire_for(&a_store, "h", "a", hold).await;
    let held_at = Instant::now();
    let warm = warm_up(&deployment.url(), &prefix, "m").await;
    deployment.freeze_replication().await.unwrap();

    // An acquisition made while replication is frozen is refused, not counted.
    let t0 = Instant::now();
    let e = a_store
        .acquire("m", "a", long_lease())
        .await
        .expect_err("an acquisition no replica has must not count");
    assert!(e.is_retryable(), "{e}");
    assert!(e.to_string().contains("replica"), "{e}");
    // Bounded by the replica-ack timeout (500 ms), with room for a slow machine.
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    // So is a renewal.
    let e = a_store
        .guard("h", "a", long_lease())
        .await
        .expect_err("a renewal no replica has must not count");
    assert!(e.to_string().contains("replica"), "{e}");

    let epoch = deployment.config_epoch().await.unwrap();
    deployment
        .kill_primary_and_fail_over(Duration::from_secs(60))
        .await
        .unwrap();
    let b_store = RedisStore::connect(config()).await.unwrap();
    // The unconfirmed acquisition was lost; b's fence is above every fence handed out.
    let b = retry_acquire(&b_store, "m", "b").await;
    assert!(b > warm, "{b} after {warm}");
    let seen = b_store.acquire("h", "b", long_lease()).await.unwrap();
    assert!(
        held_at.elapsed() < hold.ttl,
        "the scenario outlasted a's lease"
    );
    // Whatever the sentinels did, b does not own "h" while a's lease runs.
    assert_ne!(seen.owner.owner_id, "b", "two owners of h: {seen:?}");
    let failovers = deployment.config_epoch().await.unwrap() - epoch;
    if failovers > 1 {
        // A second failover (the new primary missed the sentinels' 1 s down-after window
        // on a loaded machine) may promote the old primary, restarted empty and still
        // syncing: one replica's confirmation covers one failover, not two (see the
        // crate's README). The quarantine keeps "h" from b; the key itself may be gone.
        eprintln!("{failovers} failovers: the strict check of a's key is skipped");
        return;
    }
    // The confirmed owner of "h" kept its key and fence through the failover.
    assert_eq!(
        seen.owner.owner_id, "a",
        "the promoted replica lost a confirmed owner"
    );
    assert_eq!(seen.owner.fence, held);
    // And a renews on the new primary, with its fence.
    let renewed = a_store.guard("h", "a", long_lease()).await.unwrap();
    assert_eq!(renewed.owner.owner_id, "a");
    assert_eq!(renewed.owner.fence, held);
}

async fn retry_acquire(store: &RedisStore, mutex: &str, id: &str) -> u64 {
    common::retry_acquire_for(store, mutex, id, long_lease()).await
}

/// A store that connects through the sentinels while a failover is under way (the
/// primary just died, the sentinels still name it) waits for the new primary instead of
/// failing ("cannot connect through the sentinels after failover", issue #14).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_during_a_failover_finds_the_new_primary() {
    init_tracing();
    let deployment = redis_sentinel().await.unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    let old = deployment.primary().await.unwrap();
    let failover = deployment.kill_primary_and_fail_over(Duration::from_secs(60));
    let connect = async {
        // Connect as soon as the primary is gone, while the sentinels still name it.
        while deployment.nodes()[old].is_running().await.unwrap() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        RedisStore::connect(
            test_config(&deployment.url(), &prefix).with_connect_timeout(Duration::from_secs(30)),
        )
        .await
    };
    let (failover, store) = tokio::join!(failover, connect);
    assert_eq!(failover.unwrap(), 1 - old);
    let store = store.unwrap_or_else(|e| panic!("connecting during the failover: {e}"));
    let a = retry_acquire(&store, "m", "a").await;
    assert!(a > 0);
}

/// Issue #24: two replicas, the lagging one preferred by the sentinels. Replica R
/// (`replica-priority` 1) is held back from the replication while R2 (priority 100) stays
/// live, so the default replica check is satisfied by R2 alone (R is not connected to the
/// primary). A acquires; the primary is killed and the sentinels promote R, which has
/// neither A's key nor A's fence. B's fence must still be above A's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_to_a_lagging_preferred_replica_keeps_fences_increasing() {
    init_tracing();
    let deployment = redis_sentinel_with_replicas(&[1, 100])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    let config =
        || test_config(&deployment.url(), &prefix).with_connect_timeout(Duration::from_secs(15));
    // Both replicas get the fence counter (as in any long-lived deployment).
    let warm = {
        let store = RedisStore::connect(config().with_replica_acks(Some(2)))
            .await
            .unwrap();
        let fence = retry_acquire(&store, "m", "warm").await;
        assert!(store.release("m", "warm").await.unwrap());
        retry_acquire(&store, "m-replicated", "warm").await;
        fence
    };
    let a_store = RedisStore::connect(config()).await.unwrap();
    let preferred = 1;
    assert_eq!(deployment.priority(preferred), Some(1));
    deployment.hold_back_replica(preferred).await.unwrap();
    // Only R2 is connected now (R reconnects once released or promoted).
    let t0 = Instant::now();
    while deployment.online_replicas().await.unwrap() != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "R2 did not stay online"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let a = retry_acquire(&a_store, "m", "a").await;
    assert!(a > warm, "{a} after {warm}");
    let promoted = deployment
        .kill_primary_and_fail_over(Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        promoted, preferred,
        "the sentinels promoted the other replica"
    );
    let b_store = RedisStore::connect(config()).await.unwrap();
    let b = retry_acquire(&b_store, "m", "b").await;
    assert!(
        b > a,
        "B's fence {b} is not above A's {a}: a fence was handed out twice"
    );
}

/// An acquisition the replica check refuses leaves no owner key behind, and an owner
/// whose key was lost (as in a failover) is never told "taken over" by a write that did
/// not count: while the acquisition waits for its replicas, and after it was refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_acquisition_leaves_nothing_and_takes_over_nobody() {
    init_tracing();
    let deployment = redis_sentinel_with_replicas(&[1, 100])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    let config =
        || test_config(&deployment.url(), &prefix).with_connect_timeout(Duration::from_secs(15));
    let a_store = RedisStore::connect(config()).await.unwrap();
    let b_store = RedisStore::connect(config()).await.unwrap();
    let a = retry_acquire(&a_store, "m", "a").await;
    let primary = deployment.primary().await.unwrap();
    let direct = raw(&format!("redis://{}", deployment.admin_addr(primary))).await;
    let key = a_store.owner_key("m");
    // a's key is lost, as in a failover to a replica that missed it.
    cmd(&direct, "DEL", &[&key, &format!("{key}:owner")]).await;
    // A replica that stays connected but confirms nothing: the check must refuse.
    let frozen = (0..deployment.nodes().len())
        .find(|&i| i != primary)
        .unwrap();
    deployment.nodes()[frozen].pause().await.unwrap();
    let refused = tokio::spawn({
        let b_store = b_store.clone();
        async move { b_store.acquire("m", "b", long_lease()).await }
    });
    // While b waits for its replicas, its key exists on the primary: a must not learn
    // from it that b took over.
    let t0 = Instant::now();
    while cmd(&direct, "GET", &[&key]).await.as_string().as_deref() != Some("b") {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "b's acquisition never reached the primary"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    match a_store.guard("m", "a", long_lease()).await {
        Ok(r) => assert_ne!(
            r.owner.owner_id, "b",
            "a was told b took over, from a write not yet confirmed"
        ),
        Err(e) => assert!(e.is_retryable(), "{e}"),
    }
    let e = refused
        .await
        .unwrap()
        .expect_err("an acquisition no replica confirmed must not count");
    assert!(e.is_retryable() && e.to_string().contains("replica"), "{e}");
    deployment.nodes()[frozen].resume().await.unwrap();
    // Nothing is left behind: no owner key, and a reads no owner (its key is gone).
    let left = cmd(&direct, "GET", &[&key]).await;
    assert!(
        left.is_null(),
        "the refused acquisition left the owner key {left:?}"
    );
    let seen = a_store.guard("m", "a", long_lease()).await.unwrap();
    assert_eq!(seen.owner.owner_id, "", "after b's refused acquisition");
    // The mutex is free: b (or anyone) takes it, with a fence above a's.
    let b = retry_acquire(&b_store, "m", "b").await;
    assert!(b > a, "{b} after {a}");
}

/// The failover quarantine: as in the test above, R (preferred) is held back and promoted
/// without A's key; with the quarantine on (the default), nobody takes the mutex on the
/// new primary before A's lease has ended, so A and B never both own it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_quarantine_keeps_the_mutex_until_the_lost_owners_lease_ends() {
    init_tracing();
    let deployment = redis_sentinel_with_replicas(&[1, 100])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    let config = || {
        test_config(&deployment.url(), &prefix)
            .with_restart_quarantine(true)
            .with_connect_timeout(Duration::from_secs(15))
    };
    let primary = deployment.primary().await.unwrap();
    let direct = raw(&format!("redis://{}", deployment.admin_addr(primary))).await;
    // Not a fresh server: the boot marker is there, so only the failover quarantine acts.
    cmd(&direct, "SET", &[&format!("{prefix}:{{}}:boot"), "1"]).await;
    {
        let store = RedisStore::connect(config().with_replica_acks(Some(2)))
            .await
            .unwrap();
        retry_acquire(&store, "m", "warm").await;
        assert!(store.release("m", "warm").await.unwrap());
        retry_acquire(&store, "m-replicated", "warm").await;
    }
    let a_store = RedisStore::connect(config()).await.unwrap();
    deployment.hold_back_replica(1).await.unwrap();
    let t0 = Instant::now();
    while deployment.online_replicas().await.unwrap() != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "R2 did not stay online"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Longer than the failover (seconds), so that B tries while A's lease runs.
    let lease_of = Lease {
        ttl: Duration::from_secs(25),
        transition: Duration::from_secs(5),
    };
    let sent = Instant::now();
    let a = common::retry_acquire_for(&a_store, "m", "a", lease_of).await;
    let promoted = deployment
        .kill_primary_and_fail_over(Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(promoted, 1, "the sentinels promoted the other replica");
    assert!(
        sent.elapsed() < lease_of.total(),
        "the failover outlasted a's lease"
    );
    let b_store = RedisStore::connect(config()).await.unwrap();
    let mut refused = 0;
    let b = loop {
        match b_store.acquire("m", "b", lease_of).await {
            Ok(r) if r.owner.owner_id == "b" => break r.owner.fence,
            Ok(r) => {
                assert_eq!(r.owner.owner_id, "", "a's key came back");
                refused += 1;
            }
            Err(e) => assert!(e.is_retryable(), "{e}"),
        }
        assert!(
            sent.elapsed() < lease_of.total() * 3,
            "b never acquired after the quarantine"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    // A believes it owns until its lease ends, counted from before its request was sent.
    assert!(
        sent.elapsed() >= lease_of.total(),
        "b acquired {:?} after a's request, within a's lease of {:?}",
        sent.elapsed(),
        lease_of.total()
    );
    assert!(refused > 0, "b was never held off");
    assert!(b > a, "{b} after {a}");
}
