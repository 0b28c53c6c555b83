//! Waiters that receive the handoff but never act on it (paused: a GC pause, a SIGSTOP, a
//! frozen VM) do not hold up a live waiter behind them for a whole lease.
//!
//! A paused waiter is stood in for by a connection that subscribed to its channel and
//! queued itself, and then never calls again: to the server it looks exactly like a paused
//! process (its `PUBLISH`es count a receiver). The CLI test
//! `paused_waiters_do_not_stall_the_handoff_on_redis` does the same with SIGSTOPped
//! `simba exec` processes.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{cmd, raw, test_config};
use fred::interfaces::{ClientLike, PubsubInterface};
use simba_core::{ContendService, LeaseServiceFactory, SilentContender};
use simba_redis::RedisStore;
use simba_test_kit::support::{expect_status, init_tracing, lease, unique_name};
use tokio::time::Instant;

/// A contend service on a store of its own, and the mutex's owner key.
async fn service(
    url: &str,
    prefix: &str,
    timing: &simba_core::LeaseConfig,
) -> (impl ContendService + use<>, String) {
    let store = RedisStore::connect(test_config(url, prefix)).await.unwrap();
    let owner_key = store.owner_key("paused");
    let f = LeaseServiceFactory::new(store, timing.clone()).unwrap();
    let svc = f
        .contend_service("paused", std::sync::Arc::new(SilentContender))
        .unwrap();
    (svc, owner_key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_waiter_behind_four_paused_ones_gets_the_mutex_within_a_second() {
    init_tracing();
    let server = simba_test_kit::servers::redis()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let url = server.url();
    let prefix = unique_name("t");
    // A long lease: a live waiter that had to wait for it (~7 s) would fail the bound below.
    let timing = lease(Duration::from_secs(5), Duration::from_secs(2));
    let (holder, owner_key) = service(url, &prefix, &timing).await;
    holder.start().unwrap();
    expect_status(&holder, "holder owns", Duration::from_secs(5), |s| {
        s.held.is_some()
    })
    .await;
    let (live, _) = service(url, &prefix, &timing).await;
    live.start().unwrap();
    expect_status(&live, "live waiter queued", Duration::from_secs(5), |s| {
        s.attempts > 0
    })
    .await;

    // Four paused waiters ahead of the live one: subscribed, queued first, silent.
    let commands = raw(url).await;
    let mut paused = Vec::new();
    for i in 0..4 {
        let c = raw(url).await;
        let id = format!("paused-{i}");
        c.subscribe(format!("{owner_key}:{id}")).await.unwrap();
        cmd(
            &commands,
            "ZADD",
            &[&format!("{owner_key}:contender"), &i.to_string(), &id],
        )
        .await;
        paused.push(c);
    }

    let released = Instant::now();
    holder.stop().await.unwrap();
    expect_status(&live, "live waiter owns", Duration::from_secs(20), |s| {
        s.held.is_some()
    })
    .await;
    let took = released.elapsed();
    tracing::info!(?took, "handoff past four paused waiters");
    println!("handoff past four paused waiters: {took:?}");
    // One reservation (250 ms) plus a call; 3 s leaves room for a loaded machine and is
    // far below the 7 s lease.
    assert!(took <= Duration::from_secs(3), "took {took:?}");
    live.stop().await.unwrap();
    for c in paused {
        let _ = c.quit().await;
    }
}
