//! Faults on a real Redis: data loss on restart, cut connections, dead waiters.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{raw, test_config, wait_numsub};
use simba_core::backend::{Lease, LeaseStore};
use simba_core::{ContendService, LeaseServiceFactory, LossReason, SilentContender};
use simba_redis::RedisStore;
use simba_test_kit::history::History;
use simba_test_kit::proxy::FaultProxy;
use simba_test_kit::servers::{redis, redis_private};
use simba_test_kit::support::{expect_status, init_tracing, lease, unique_name};
use tokio::time::Instant;

/// Redis restarts with every key lost while a contender owns: the owner reports the loss
/// by its local deadline at the latest, someone owns again after the restart, and fences
/// keep increasing although the fence counter was lost too.
///
/// Lost keys would let a new owner in while the old one still believes it owns; the
/// store's restart quarantine keeps the mutex free for one lease after the restart, so
/// the recorded history must show no overlap at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_with_data_loss() {
    init_tracing();
    let server = redis_private().await.unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    let timing = lease(Duration::from_secs(2), Duration::from_secs(1));
    let history = History::new();
    let mut services = Vec::new();
    for i in 0..2 {
        let config = test_config(server.url(), &prefix).with_restart_quarantine(true);
        let store = RedisStore::connect(config).await.unwrap();
        let f = LeaseServiceFactory::new(store, timing.clone()).unwrap();
        let svc = f
            .contend_service("restart", history.contender(format!("c{i}")))
            .unwrap();
        services.push(svc);
    }
    // c0 first, so that it is the owner when the restart comes.
    services[0].start().unwrap();
    // The server just started: the quarantine (3 s) and a jitter (≤ 1 s) come first.
    let first = expect_status(&services[0], "first owner", Duration::from_secs(8), |s| {
        s.held.is_some()
    })
    .await;
    services[1].start().unwrap();
    expect_status(&services[1], "waiter", Duration::from_secs(5), |s| {
        s.attempts > 0
    })
    .await;
    let fence_before = first.held.map_or(0, |h| h.fence);

    let t0 = Instant::now();
    server.wipe_restart().await.unwrap();
    let restarted = t0.elapsed();
    // The local deadline is at most ttl + transition (3 s) after the last renewal that
    // was sent before the restart began; 500 ms covers scheduling on a loaded machine.
    let lost = expect_status(
        &services[0],
        "owner reports the loss",
        Duration::from_millis(3500),
        |s| s.held.is_none(),
    )
    .await;
    let loss = lost.last_loss.expect("a recorded loss");
    assert!(
        matches!(
            loss.reason,
            LossReason::LeaseExpired | LossReason::TakenOver
        ),
        "{loss:?}"
    );
    assert!(
        t0.elapsed() <= Duration::from_millis(3500),
        "loss reported {:?} after the restart began",
        t0.elapsed()
    );

    // Someone owns again: reconnect (backoff ≤ 500 ms), the quarantine (one lease, 3 s,
    // from the restart) and a poll jitter (≤ 1 s) — 10 s is generous.
    let bound = Duration::from_secs(10);
    let t1 = Instant::now();
    let mut rx0 = services[0].status();
    let mut rx1 = services[1].status();
    let owner = loop {
        if let Some(i) = services.iter().position(|s| s.is_owner()) {
            break i;
        }
        assert!(
            t1.elapsed() < bound,
            "nobody owns {bound:?} after the restart"
        );
        // Either service may win; each waits on its own status channel.
        tokio::select! {
            _ = rx0.changed() => {}
            _ = rx1.changed() => {}
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    };
    let held = services[owner].status().borrow().held.expect("held");
    assert!(
        held.fence > fence_before,
        "fence {} after data loss is not above {fence_before}",
        held.fence
    );
    tracing::info!(
        ?restarted,
        fence_before,
        fence_after = held.fence,
        "restart"
    );
    for s in &services {
        s.stop().await.unwrap();
    }
    let v = history.violations();
    assert!(v.is_empty(), "two owners around the restart: {v:?}");
}

/// Cut connections of the owner again and again: it reconnects and keeps the mutex, and
/// the rival never owns at the same time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_connections_never_make_two_owners() {
    init_tracing();
    let server = redis().await.unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    let proxy = FaultProxy::start(server.socket_addr().unwrap())
        .await
        .unwrap();
    let timing = lease(Duration::from_secs(1), Duration::from_millis(500));
    let history = History::new();
    let behind = RedisStore::connect(test_config(&server.url_via(proxy.addr()), &prefix))
        .await
        .unwrap();
    let direct = RedisStore::connect(test_config(server.url(), &prefix))
        .await
        .unwrap();
    let a = LeaseServiceFactory::new(behind, timing.clone())
        .unwrap()
        .contend_service("cut", history.contender("a"))
        .unwrap();
    let b = LeaseServiceFactory::new(direct, timing)
        .unwrap()
        .contend_service("cut", history.contender("b"))
        .unwrap();
    a.start().unwrap();
    expect_status(&a, "a owns", Duration::from_secs(5), |s| s.held.is_some()).await;
    b.start().unwrap();
    for _ in 0..8 {
        proxy.cut();
        // Cuts are the fault being injected, spaced over several ttl periods.
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    proxy.cut();
    proxy.refuse(true);
    // With new connections refused the owner cannot renew: it must give up by its
    // deadline, and then b takes over.
    expect_status(&b, "b takes over", Duration::from_secs(6), |s| {
        s.held.is_some()
    })
    .await;
    assert!(!a.is_owner());
    proxy.heal();
    b.stop().await.unwrap();
    a.stop().await.unwrap();
    let v = history.violations();
    assert!(v.is_empty(), "{v:?}");
    assert!(history.len() >= 2, "{:?}", history.intervals());
}

/// A waiter whose connections were cut subscribes again, and still gets the handoff
/// without a poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_resubscribes_after_a_cut() {
    init_tracing();
    let server = redis().await.unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    let proxy = FaultProxy::start(server.socket_addr().unwrap())
        .await
        .unwrap();
    // A long lease: a waiter that needs a poll would own only ~7 s after the release.
    let timing = lease(Duration::from_secs(5), Duration::from_secs(2));
    let owner_store = RedisStore::connect(test_config(server.url(), &prefix))
        .await
        .unwrap();
    let waiter_store = RedisStore::connect(test_config(&server.url_via(proxy.addr()), &prefix))
        .await
        .unwrap();
    let channel_of = |id: &str| format!("{}:{id}", owner_store.owner_key("resub"));
    let o = LeaseServiceFactory::new(owner_store.clone(), timing.clone())
        .unwrap()
        .contend_service("resub", Arc::new(SilentContender))
        .unwrap();
    let w = LeaseServiceFactory::new(waiter_store, timing)
        .unwrap()
        .contend_service("resub", Arc::new(SilentContender))
        .unwrap();
    o.start().unwrap();
    expect_status(&o, "owner", Duration::from_secs(5), |s| s.held.is_some()).await;
    w.start().unwrap();
    let attempts = expect_status(&w, "waiter", Duration::from_secs(5), |s| s.attempts > 0)
        .await
        .attempts;
    let r = raw(server.url()).await;
    let channel = channel_of(w.contender_id());
    wait_numsub(&r, &channel, 1, Duration::from_secs(5)).await;

    proxy.cut();
    wait_numsub(&r, &channel, 0, Duration::from_secs(5)).await;
    // After the reconnect the channel is subscribed again and the waiter re-reads (Resync).
    wait_numsub(&r, &channel, 1, Duration::from_secs(5)).await;
    expect_status(&w, "re-read after resync", Duration::from_secs(5), |s| {
        s.attempts > attempts
    })
    .await;

    let t0 = Instant::now();
    o.stop().await.unwrap();
    expect_status(
        &w,
        "handoff after reconnect",
        Duration::from_millis(1500),
        |s| s.held.is_some(),
    )
    .await;
    tracing::info!(took = ?t0.elapsed(), "handoff after reconnect");
    w.stop().await.unwrap();
}

/// A waiter that died without leaving (its queue entry stays) does not stall the handoff:
/// the release script's publish to it reaches nobody, and the next live waiter owns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_waiter_does_not_stall_handoff() {
    init_tracing();
    let server = redis().await.unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    let timing = lease(Duration::from_secs(5), Duration::from_secs(2));
    let r = raw(server.url()).await;

    let owner_store = RedisStore::connect(test_config(server.url(), &prefix))
        .await
        .unwrap();
    let o = LeaseServiceFactory::new(owner_store.clone(), timing.clone())
        .unwrap()
        .contend_service("dead", Arc::new(SilentContender))
        .unwrap();
    o.start().unwrap();
    expect_status(&o, "owner", Duration::from_secs(5), |s| s.held.is_some()).await;

    // The dead waiter: queued first, then its process "dies" (store dropped, no leave).
    let dead_store = RedisStore::connect(test_config(server.url(), &prefix))
        .await
        .unwrap();
    let _events = dead_store.subscribe("dead", "ghost").await.unwrap();
    let lease_of = Lease {
        ttl: timing.ttl,
        transition: timing.transition,
    };
    let seen = dead_store.acquire("dead", "ghost", lease_of).await.unwrap();
    assert_ne!(seen.owner.owner_id, "ghost");
    let ghost_channel = format!("{}:ghost", owner_store.owner_key("dead"));
    wait_numsub(&r, &ghost_channel, 1, Duration::from_secs(5)).await;

    let live = LeaseServiceFactory::new(
        RedisStore::connect(test_config(server.url(), &prefix))
            .await
            .unwrap(),
        timing,
    )
    .unwrap()
    .contend_service("dead", Arc::new(SilentContender))
    .unwrap();
    live.start().unwrap();
    expect_status(&live, "live waiter queued", Duration::from_secs(5), |s| {
        s.attempts > 0
    })
    .await;

    drop(dead_store);
    wait_numsub(&r, &ghost_channel, 0, Duration::from_secs(5)).await;
    let queue = format!("{}:contender", owner_store.owner_key("dead"));
    let queued = common::cmd(&r, "ZRANGE", &[&queue, "0", "-1"]).await;
    let queued: Vec<String> = match queued {
        fred::types::Value::Array(v) => v.iter().filter_map(|x| x.as_string()).collect(),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        queued.first().map(String::as_str),
        Some("ghost"),
        "{queued:?}"
    );
    assert_eq!(queued.len(), 2, "{queued:?}");

    let t0 = Instant::now();
    o.stop().await.unwrap();
    // A poll would come ~7 s after the owner's last renewal; 1.5 s proves the push.
    expect_status(
        &live,
        "handoff past the dead waiter",
        Duration::from_millis(1500),
        |s| s.held.is_some(),
    )
    .await;
    tracing::info!(took = ?t0.elapsed(), "handoff past a dead waiter");
    live.stop().await.unwrap();
    assert!(!owner_store.release("dead", "ghost").await.unwrap());
}

/// A subscriber connection that silently stops answering (no traffic, no FIN) is noticed by
/// the heartbeat and replaced; after that the waiter still gets the handoff at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_subscriber_connection_is_replaced() {
    init_tracing();
    let server = redis().await.unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    let proxy = FaultProxy::start(server.socket_addr().unwrap())
        .await
        .unwrap();
    // A long lease keeps the waiter's own calls rare, so only heartbeats are in flight.
    let timing = lease(Duration::from_secs(5), Duration::from_secs(2));
    let o = LeaseServiceFactory::new(
        RedisStore::connect(test_config(server.url(), &prefix))
            .await
            .unwrap(),
        timing.clone(),
    )
    .unwrap()
    .contend_service("silent", Arc::new(SilentContender))
    .unwrap();
    let w = LeaseServiceFactory::new(
        RedisStore::connect(test_config(&server.url_via(proxy.addr()), &prefix))
            .await
            .unwrap(),
        timing,
    )
    .unwrap()
    .contend_service("silent", Arc::new(SilentContender))
    .unwrap();
    o.start().unwrap();
    expect_status(&o, "owner", Duration::from_secs(5), |s| s.held.is_some()).await;
    w.start().unwrap();
    expect_status(&w, "waiter", Duration::from_secs(5), |s| s.attempts > 0).await;
    let connections = proxy.total_connections();

    proxy.blackhole(true);
    // The fault lasts longer than heartbeat (500 ms) + unresponsive timeout (1 s).
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.heal();
    let t0 = Instant::now();
    while proxy.total_connections() == connections {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the silent connection was never replaced"
        );
        // The proxy's counter has no event to await.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = raw(server.url()).await;
    let channel = format!("{}:{}", o_key(&prefix, "silent"), w.contender_id());
    wait_numsub(&r, &channel, 1, Duration::from_secs(10)).await;
    // Renewals kept the owner's lease alive meanwhile; its release is pushed to the waiter.
    assert!(o.is_owner());
    let t1 = Instant::now();
    o.stop().await.unwrap();
    expect_status(
        &w,
        "handoff after the silent connection",
        Duration::from_millis(1500),
        |s| s.held.is_some(),
    )
    .await;
    tracing::info!(took = ?t1.elapsed(), "handoff after a replaced subscriber connection");
    w.stop().await.unwrap();
}

fn o_key(prefix: &str, mutex: &str) -> String {
    format!("{prefix}:{{{mutex}}}")
}

/// A command connection whose answers stop while calls keep coming (callers that give up
/// early and retry) is replaced: fred alone would not, as every new write makes it look
/// busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_command_connection_is_replaced() {
    init_tracing();
    let server = redis().await.unwrap_or_else(|e| panic!("{e}"));
    let proxy = FaultProxy::start(server.socket_addr().unwrap())
        .await
        .unwrap();
    let config = test_config(&server.url_via(proxy.addr()), &unique_name("t"))
        .with_wait_mode(simba_redis::WaitMode::Polling);
    let store = RedisStore::connect(config).await.unwrap();
    store.owner("stall").await.unwrap();
    let before = proxy.total_connections();
    proxy.blackhole(true);
    let t0 = Instant::now();
    // Callers give up after 300 ms and retry, like contenders with a short request timeout.
    while proxy.total_connections() == before {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the stalled connection was never replaced"
        );
        let r = tokio::time::timeout(Duration::from_millis(300), store.owner("stall")).await;
        assert!(r.is_err(), "an answer through a blackhole: {r:?}");
    }
    let replaced_after = t0.elapsed();
    proxy.heal();
    let r = tokio::time::timeout(Duration::from_secs(5), store.owner("stall")).await;
    assert!(matches!(r, Ok(Ok(_))), "{r:?}");
    tracing::info!(?replaced_after, "stalled connection replaced");
}
