//! The store's wire protocol on a real Redis: contract, JVM compatibility, scripts,
//! subscriptions, handoff order, polling.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{cmd, numsub, raw, test_config, wait_numsub};
use fred::types::Value;
use simba_core::backend::{Lease, LeaseStore};
use simba_core::{ContendService, LeaseServiceFactory, MutexOwner, SilentContender};
use simba_redis::{RedisStore, WaitMode};
use simba_test_kit::history::History;
use simba_test_kit::servers::{TestServer, redis};
use simba_test_kit::support::{expect_status, init_tracing, lease, unique_name};
use tokio::time::Instant;

const LEASE: Lease = Lease {
    ttl: Duration::from_secs(2),
    transition: Duration::from_secs(1),
};

async fn server() -> TestServer {
    init_tracing();
    redis().await.unwrap_or_else(|e| panic!("{e}"))
}

fn text(v: &Value) -> String {
    v.as_string().unwrap_or_default()
}

fn zrange(v: Value) -> Vec<String> {
    match v {
        Value::Array(items) => items.iter().map(text).collect(),
        other => panic!("ZRANGE: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_renew_release_contract() {
    let server = server().await;
    let prefix = unique_name("t");
    let store = RedisStore::connect(test_config(server.url(), &prefix))
        .await
        .unwrap();
    let r = raw(server.url()).await;
    let m = "contract";
    let owner_key = store.owner_key(m);
    assert_eq!(owner_key, format!("{prefix}:{{{m}}}"));

    let first = store.acquire(m, "a", LEASE).await.unwrap();
    let o = &first.owner;
    assert_eq!(o.owner_id, "a");
    assert!(o.fence > 0);
    assert_eq!(o.acquired_at, first.now);
    assert_eq!(o.ttl_at, first.now + 2000);
    assert_eq!(o.transition_at, first.now + 3000);
    // The JVM-compatible owner key: exactly the id, with a lease of ttl + transition.
    assert_eq!(text(&cmd(&r, "GET", &[&owner_key]).await), "a");
    let pttl = cmd(&r, "PTTL", &[&owner_key]).await.as_i64().unwrap();
    assert!(pttl > 2000 && pttl <= 3000, "PTTL {pttl}");

    // Acquire again by the owner = renewal: same fence, same acquired_at.
    let again = store.acquire(m, "a", LEASE).await.unwrap();
    assert_eq!(again.owner.fence, o.fence);
    assert_eq!(again.owner.acquired_at, o.acquired_at);
    assert!(again.owner.ttl_at >= o.ttl_at);
    let renewed = store.guard(m, "a", LEASE).await.unwrap();
    assert_eq!(renewed.owner.fence, o.fence);

    // Another contender is told who owns, joins the queue, and cannot renew or release.
    let b = store.acquire(m, "b", LEASE).await.unwrap();
    assert_eq!(b.owner.owner_id, "a");
    assert_eq!(b.owner.fence, o.fence);
    let queue = format!("{owner_key}:contender");
    assert_eq!(zrange(cmd(&r, "ZRANGE", &[&queue, "0", "-1"]).await), ["b"]);
    let gb = store.guard(m, "b", LEASE).await.unwrap();
    assert_eq!(gb.owner.owner_id, "a", "guard must never take a held mutex");
    assert!(!store.release(m, "b").await.unwrap());
    assert_eq!(store.owner(m).await.unwrap().owner.owner_id, "a");
    assert!(
        zrange(cmd(&r, "ZRANGE", &[&queue, "0", "-1"]).await).is_empty(),
        "a release by a non-owner leaves the queue"
    );

    // Release twice: the second run finds nothing to free (fred may replay it).
    assert!(store.release(m, "a").await.unwrap());
    assert!(!store.release(m, "a").await.unwrap());
    let none = store.owner(m).await.unwrap();
    assert_eq!(none.owner, MutexOwner::NONE);
    assert!(none.now >= first.now);
    let g = store.guard(m, "a", LEASE).await.unwrap();
    assert_eq!(
        g.owner,
        MutexOwner::NONE,
        "guard must not take a free mutex"
    );

    let next = store.acquire(m, "b", LEASE).await.unwrap();
    assert_eq!(next.owner.owner_id, "b");
    assert!(next.owner.fence > o.fence);
    assert!(store.release(m, "b").await.unwrap());

    // Bad input never reaches the server.
    assert!(matches!(
        store.acquire("x{y}", "a", LEASE).await,
        Err(simba_core::Error::InvalidName { .. })
    ));
    assert!(matches!(
        store.acquire(m, "a@@b", LEASE).await,
        Err(simba_core::Error::InvalidContenderId { .. })
    ));
    let zero = Lease {
        ttl: Duration::ZERO,
        transition: Duration::ZERO,
    };
    assert!(matches!(
        store.acquire(m, "a", zero).await,
        Err(simba_core::Error::InvalidConfig { .. })
    ));
}

/// A JVM Simba contender takes the owner key with `SET NX PX` and nothing else: the Rust
/// store must respect it, and the JVM must see the Rust owner in the same key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jvm_owner_key_compatibility() {
    let server = server().await;
    let prefix = unique_name("t");
    let store = RedisStore::connect(test_config(server.url(), &prefix))
        .await
        .unwrap();
    let r = raw(server.url()).await;
    let key = store.owner_key("jvm");

    // A JVM owner.
    let set = cmd(&r, "SET", &[&key, "1:77@jvm-host", "NX", "PX", "5000"]).await;
    assert_eq!(text(&set), "OK");
    let seen = store.acquire("jvm", "rust", LEASE).await.unwrap();
    assert_eq!(seen.owner.owner_id, "1:77@jvm-host");
    assert_eq!(seen.owner.fence, 0, "a foreign owner has no fence");
    assert!(seen.owner.transition_at > seen.now && seen.owner.transition_at <= seen.now + 5000);
    assert!(!store.release("jvm", "rust").await.unwrap());
    assert_eq!(
        store
            .guard("jvm", "rust", LEASE)
            .await
            .unwrap()
            .owner
            .owner_id,
        "1:77@jvm-host"
    );
    assert_eq!(text(&cmd(&r, "GET", &[&key]).await), "1:77@jvm-host");

    // The JVM releases (owner-checked delete); now Rust owns, and the JVM's SET NX fails.
    cmd(&r, "DEL", &[&key]).await;
    let mine = store.acquire("jvm", "rust", LEASE).await.unwrap();
    assert_eq!(mine.owner.owner_id, "rust");
    assert_eq!(text(&cmd(&r, "GET", &[&key]).await), "rust");
    let jvm_try = cmd(&r, "SET", &[&key, "1:77@jvm-host", "NX", "PX", "5000"]).await;
    assert!(matches!(jvm_try, Value::Null), "{jvm_try:?}");
    assert!(store.release("jvm", "rust").await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_script_flush() {
    // A server of its own: SCRIPT FLUSH empties the whole server's script cache, and a
    // test on the shared server between a client's SCRIPT LOAD and its EVALSHA would get
    // NOSCRIPT (jvm_fleet's JVM-protocol contenders once did, four tests at a time).
    init_tracing();
    let server = simba_test_kit::servers::redis_private()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = RedisStore::connect(test_config(server.url(), &unique_name("t")))
        .await
        .unwrap();
    let r = raw(server.url()).await;
    let first = store.acquire("flush", "a", LEASE).await.unwrap();
    cmd(&r, "SCRIPT", &["FLUSH"]).await;
    let renewed = store.guard("flush", "a", LEASE).await.unwrap();
    assert_eq!(renewed.owner.fence, first.owner.fence);
    cmd(&r, "SCRIPT", &["FLUSH"]).await;
    assert_eq!(store.owner("flush").await.unwrap().owner.owner_id, "a");
    cmd(&r, "SCRIPT", &["FLUSH"]).await;
    assert!(store.release("flush", "a").await.unwrap());
    cmd(&r, "SCRIPT", &["FLUSH"]).await;
    store.leave("flush", "a").await.unwrap();
    cmd(&r, "SCRIPT", &["FLUSH"]).await;
    assert!(
        store
            .acquire("flush", "b", LEASE)
            .await
            .unwrap()
            .owner
            .fence
            > first.owner.fence
    );
}

/// Waiters get the mutex in arrival order, each right after the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_goes_to_waiters_in_arrival_order() {
    let server = server().await;
    let prefix = unique_name("t");
    // A long lease: a waiter that got the mutex by polling would need ~7 s.
    let timing = lease(Duration::from_secs(5), Duration::from_secs(2));
    let mut services = Vec::new();
    let history = History::new();
    for i in 0..4 {
        let store = RedisStore::connect(test_config(server.url(), &prefix))
            .await
            .unwrap();
        let f = LeaseServiceFactory::new(store, timing.clone()).unwrap();
        let svc = f
            .contend_service("fifo", history.contender(format!("c{i}")))
            .unwrap();
        svc.start().unwrap();
        // Start them one after another, so the queue order is known.
        if i == 0 {
            expect_status(&svc, "first owner", Duration::from_secs(5), |s| {
                s.held.is_some()
            })
            .await;
        } else {
            expect_status(&svc, "waiter queued", Duration::from_secs(5), |s| {
                s.attempts > 0
            })
            .await;
        }
        services.push(svc);
    }
    for i in 0..3 {
        let t0 = Instant::now();
        services[i].stop().await.unwrap();
        // One round trip is the goal; 1.5 s leaves room for a loaded machine and is still
        // far below the ~7 s of a poll.
        let st = expect_status(
            &services[i + 1],
            "handoff",
            Duration::from_millis(1500),
            |s| s.held.is_some(),
        )
        .await;
        tracing::info!(took = ?t0.elapsed(), fence = ?st.held, "handoff to c{}", i + 1);
        for (j, s) in services.iter().enumerate() {
            if j != i + 1 {
                assert!(!s.is_owner(), "c{j} owns instead of c{}", i + 1);
            }
        }
    }
    services[3].stop().await.unwrap();
    assert!(
        history.violations().is_empty(),
        "{:?}",
        history.violations()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_mode_has_no_subscriber_and_still_hands_over() {
    let server = server().await;
    let prefix = unique_name("t");
    let config = test_config(server.url(), &prefix).with_wait_mode(WaitMode::Polling);
    let store = RedisStore::connect(config.clone()).await.unwrap();
    assert!(store.subscribe("poll", "a").await.unwrap().is_none());
    let timing = lease(Duration::from_millis(500), Duration::from_millis(200));
    let fa = LeaseServiceFactory::new(store, timing.clone()).unwrap();
    let fb = LeaseServiceFactory::new(RedisStore::connect(config).await.unwrap(), timing).unwrap();
    let a = fa
        .contend_service("poll", Arc::new(SilentContender))
        .unwrap();
    let b = fb
        .contend_service("poll", Arc::new(SilentContender))
        .unwrap();
    a.start().unwrap();
    expect_status(&a, "owner", Duration::from_secs(5), |s| s.held.is_some()).await;
    b.start().unwrap();
    expect_status(&b, "waiter", Duration::from_secs(5), |s| s.attempts > 0).await;
    a.stop().await.unwrap();
    // A poll comes by the end of a's lease (700 ms) plus jitter (< 1 s); 4 s is generous.
    expect_status(&b, "poll takes over", Duration::from_secs(4), |s| {
        s.held.is_some()
    })
    .await;
    b.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_are_dropped_when_contenders_stop() {
    let server = server().await;
    let prefix = unique_name("t");
    let store = RedisStore::connect(test_config(server.url(), &prefix))
        .await
        .unwrap();
    let r = raw(server.url()).await;
    let f = LeaseServiceFactory::new(
        store.clone(),
        lease(Duration::from_secs(1), Duration::from_millis(500)),
    )
    .unwrap();
    let a = f
        .contend_service("subs", Arc::new(SilentContender))
        .unwrap();
    let b = f
        .contend_service("subs", Arc::new(SilentContender))
        .unwrap();
    a.start().unwrap();
    b.start().unwrap();
    expect_status(&a, "a contends", Duration::from_secs(5), |s| s.attempts > 0).await;
    expect_status(&b, "b contends", Duration::from_secs(5), |s| s.attempts > 0).await;
    let mutex_channel = store.owner_key("subs");
    let a_channel = format!("{mutex_channel}:{}", a.contender_id());
    let b_channel = format!("{mutex_channel}:{}", b.contender_id());
    // One subscriber connection serves both contenders.
    assert_eq!(numsub(&r, &mutex_channel).await, 1);
    assert_eq!(numsub(&r, &a_channel).await, 1);
    assert_eq!(numsub(&r, &b_channel).await, 1);
    a.stop().await.unwrap();
    wait_numsub(&r, &a_channel, 0, Duration::from_secs(5)).await;
    assert_eq!(numsub(&r, &mutex_channel).await, 1, "b still listens");
    b.stop().await.unwrap();
    wait_numsub(&r, &b_channel, 0, Duration::from_secs(5)).await;
    wait_numsub(&r, &mutex_channel, 0, Duration::from_secs(5)).await;

    // Dropping the store closes its connections.
    drop(f);
    drop(a);
    drop(b);
    let before = numsub(&r, &mutex_channel).await;
    assert_eq!(before, 0);
    let rx = store.subscribe("subs", "late").await.unwrap();
    assert!(rx.is_some());
    wait_numsub(&r, &mutex_channel, 1, Duration::from_secs(5)).await;
    drop(store);
    wait_numsub(&r, &mutex_channel, 0, Duration::from_secs(5)).await;
}

/// The store pushes `Acquired` to other contenders and `Released` to the next waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_reach_subscribers() {
    let server = server().await;
    let prefix = unique_name("t");
    let owner = RedisStore::connect(test_config(server.url(), &prefix))
        .await
        .unwrap();
    let waiter = RedisStore::connect(test_config(server.url(), &prefix))
        .await
        .unwrap();
    let mut rx = waiter.subscribe("ev", "w").await.unwrap().unwrap();
    let mut own_rx = owner.subscribe("ev", "o").await.unwrap().unwrap();
    owner.acquire("ev", "o", LEASE).await.unwrap();
    let bound = Duration::from_secs(5);
    let ev = tokio::time::timeout(bound, rx.recv()).await.unwrap();
    assert_eq!(
        ev,
        Some(simba_core::backend::StoreEvent::Acquired {
            owner_id: "o".into()
        })
    );
    waiter.acquire("ev", "w", LEASE).await.unwrap();
    assert!(owner.release("ev", "o").await.unwrap());
    let ev = tokio::time::timeout(bound, rx.recv()).await.unwrap();
    assert_eq!(ev, Some(simba_core::backend::StoreEvent::Released));
    // The owner hears nothing of its own acquisition.
    assert!(own_rx.try_recv().is_err());
}

/// Without the hash tag the keys are named as some JVM Simba versions name them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_without_hash_tag() {
    let server = server().await;
    let prefix = unique_name("t");
    let config = test_config(server.url(), &prefix).with_hash_tag(false);
    let store = RedisStore::connect(config.clone()).await.unwrap();
    let r = raw(server.url()).await;
    assert_eq!(store.owner_key("plain"), format!("{prefix}:plain"));
    store.acquire("plain", "a", LEASE).await.unwrap();
    assert_eq!(
        text(&cmd(&r, "GET", &[&format!("{prefix}:plain")]).await),
        "a"
    );
    // The handoff works the same.
    let waiter = RedisStore::connect(config).await.unwrap();
    let mut rx = waiter.subscribe("plain", "w").await.unwrap().unwrap();
    waiter.acquire("plain", "w", LEASE).await.unwrap();
    assert!(store.release("plain", "a").await.unwrap());
    let ev = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap();
    assert_eq!(ev, Some(simba_core::backend::StoreEvent::Released));
    assert_eq!(
        waiter
            .acquire("plain", "w", LEASE)
            .await
            .unwrap()
            .owner
            .owner_id,
        "w"
    );
}

/// A release hands the mutex to the waiter it woke: while that waiter's reservation lasts,
/// no other contender (the releaser included) can take the free mutex past the queue; once
/// it ends, anyone can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_woken_waiter_cannot_be_barged() {
    let server = server().await;
    let prefix = unique_name("t");
    let store = RedisStore::connect(test_config(server.url(), &prefix))
        .await
        .unwrap();
    let bound = Duration::from_secs(5);
    for (m, reserved) in [("barge", true), ("late", false)] {
        assert_eq!(
            store.acquire(m, "a", LEASE).await.unwrap().owner.owner_id,
            "a"
        );
        let mut rx = store.subscribe(m, "w").await.unwrap().unwrap();
        assert_eq!(
            store.acquire(m, "w", LEASE).await.unwrap().owner.owner_id,
            "a"
        );
        assert!(store.release(m, "a").await.unwrap());
        let ev = tokio::time::timeout(bound, rx.recv()).await.unwrap();
        assert_eq!(ev, Some(simba_core::backend::StoreEvent::Released));
        if !reserved {
            // The reservation is short (250 ms): a woken waiter that never comes back does
            // not keep the mutex from the others for long.
            tokio::time::sleep(Duration::from_millis(400)).await;
            let r = store.acquire(m, "a", LEASE).await.unwrap();
            assert!(
                r.owner.is_owner("a"),
                "the reservation ended: {:?}",
                r.owner
            );
            assert!(store.release(m, "a").await.unwrap());
        } else {
            // The releaser and a newcomer try to take it.
            for other in ["a", "n"] {
                let r = store.acquire(m, other, LEASE).await.unwrap();
                assert!(
                    !r.owner.is_owner(other),
                    "{other} barged past the woken waiter: {:?}",
                    r.owner
                );
                assert!(r.owner.transition_at > r.now, "told when to look again");
            }
            let r = store.acquire(m, "w", LEASE).await.unwrap();
            assert!(
                r.owner.is_owner("w"),
                "the woken waiter takes it: {:?}",
                r.owner
            );
            assert!(store.release(m, "w").await.unwrap());
        }
    }
}

/// `release_after` (hold at least): the kit's contract, and the keys as a JVM Simba sees
/// them: the owner key holds an id (the hold's) with a PX lease of the hold, so a JVM
/// contender's `SET NX` fails until the hold ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_after_holds_the_owner_key() {
    // The contract itself is the kit's `release_after_contract` (tests/conformance.rs).
    let server = server().await;
    let a = RedisStore::connect(test_config(server.url(), &unique_name("t")))
        .await
        .unwrap();
    let r = raw(server.url()).await;
    let m = "held-keys";
    let key = a.owner_key(m);
    assert!(a.acquire(m, "a", LEASE).await.unwrap().owner.is_owner("a"));
    assert!(
        a.release_after(m, "a", Duration::from_secs(60))
            .await
            .unwrap()
    );
    assert_eq!(text(&cmd(&r, "GET", &[&key]).await), "held@@a");
    let pttl = cmd(&r, "PTTL", &[&key]).await.as_i64().unwrap_or(-1);
    assert!((55_000..=60_000).contains(&pttl), "PTTL {pttl}");
    let jvm = cmd(&r, "SET", &[&key, "jvm-contender", "NX", "PX", "16000"]).await;
    assert!(
        jvm.is_null(),
        "a JVM contender's SET NX took a held mutex: {jvm:?}"
    );
}

/// An observer (retrieval service) on Redis is pushed: it sees an early release within
/// 500 ms while the lease is 16 s, and costs a few reads, not hundreds, while idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observer_is_pushed_and_does_not_spin() {
    init_tracing();
    // A private server: its command statistics count this test's commands only.
    let server = simba_test_kit::servers::redis_private()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let r = raw(server.url()).await;
    let _ = cmd(&r, "CONFIG", &["RESETSTAT"]).await;
    // The source owns the server (and keeps it running) from here on.
    let source = common::RedisHarness::on(server, "", None);
    simba_test_kit::store_cases::observer_is_pushed_and_idle(&source)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // Commands the server ran for the whole case (about 5 s), every client together: the
    // old observer ran ~800 reads (GET + EVALSHA + TIME) per second on a free mutex.
    let info = text(&cmd(&r, "INFO", &["commandstats"]).await);
    let evalsha = info
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    eprintln!("observer case: {evalsha} EVALSHA calls on the server in total");
    assert!(evalsha < 60, "{evalsha} scripts run: {info}");
}

/// The connector gives a generic tool a working backend: the kit's connector check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connector_passes_the_kit_check() {
    let server = server().await;
    simba_test_kit::connector::check(
        &simba_redis::CONNECTOR,
        server.url(),
        None,
        common::CONNECTOR_EXPECT,
    )
    .await;
}
