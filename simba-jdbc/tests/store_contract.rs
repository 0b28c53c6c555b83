//! The LeaseStore contract, call by call, on each backend; plus PostgreSQL push events.
#![allow(missing_docs)]
// With only some backend features, parts of this file are unused.
#![cfg_attr(
    not(all(feature = "sqlite", feature = "mysql", feature = "postgres")),
    allow(unused)
)]

mod common;

use common::SqlHarness;

async fn contract(h: &SqlHarness) {
    let a = h.store().await.expect("store a");
    let b = h.store().await.expect("store b");
    common::store_contract(&a, &b, "contract-mutex").await;
    // Names: unicode and the longest the column holds.
    let long = "ü".repeat(simba_jdbc::MUTEX_COLUMN_LEN / 2);
    common::store_contract(&a, &b, &long).await;
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_contract() {
    let h = SqlHarness::sqlite();
    contract(&h).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_contract() {
    let h = SqlHarness::mysql().await;
    contract(&h).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_contract() {
    let h = SqlHarness::postgres().await;
    contract(&h).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_pushes_acquired_and_released() {
    use simba_core::backend::{LeaseStore, StoreEvent};
    use std::time::Duration;
    let h = SqlHarness::postgres().await;
    let owner = h.store().await.expect("store");
    let waiter = h.store().await.expect("store");
    let mut rx = waiter
        .subscribe("push", "waiter")
        .await
        .expect("subscribe")
        .expect("postgres pushes");
    // The first event after the LISTEN connection is up is a Resync.
    let first = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await;
    assert_eq!(first.ok().flatten(), Some(StoreEvent::Resync));
    let mut own = owner
        .subscribe("push", "owner")
        .await
        .expect("subscribe")
        .expect("postgres pushes");
    assert!(
        owner
            .acquire("push", "owner", common::LEASE)
            .await
            .expect("acquire")
            .owner
            .is_owner("owner")
    );
    let ev = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await;
    assert_eq!(
        ev.ok().flatten(),
        Some(StoreEvent::Acquired {
            owner_id: "owner".into()
        })
    );
    // A renewal is not an acquisition: no event.
    owner
        .acquire("push", "owner", common::LEASE)
        .await
        .expect("renew");
    assert!(owner.release("push", "owner").await.expect("release"));
    let ev = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await;
    assert_eq!(
        ev.ok().flatten(),
        Some(StoreEvent::Released),
        "renewal sent no event, release did"
    );
    // The actor hears nothing of its own changes (only the Resync of its subscription).
    // Showing that nothing comes needs a wait: half a second is far longer than the
    // NOTIFY round trip on loopback (the waiter above got its events within it).
    let mut seen = Vec::new();
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(500), own.recv()).await {
        seen.push(e);
    }
    assert!(seen.iter().all(|e| *e == StoreEvent::Resync), "{seen:?}");
}

/// `release_after` (hold at least) and observers (pushed on PostgreSQL, bounded reads
/// elsewhere), through the kit's store-level cases.
async fn hold_and_observe(h: &SqlHarness, pushes: bool) {
    let a = h.store().await.expect("store a");
    let b = h.store().await.expect("store b");
    simba_test_kit::store_cases::release_after_contract(&a, &b, "held-mutex")
        .await
        .unwrap_or_else(|e| panic!("release_after on {}: {e}", a.kind().name()));
    simba_test_kit::store_cases::observer_is_pushed_and_idle(a.clone(), b, pushes, "seen-mutex")
        .await
        .unwrap_or_else(|e| panic!("observer on {}: {e}", a.kind().name()));
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_hold_and_observe() {
    hold_and_observe(&SqlHarness::sqlite(), false).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_hold_and_observe() {
    hold_and_observe(&SqlHarness::mysql().await, false).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_hold_and_observe() {
    hold_and_observe(&SqlHarness::postgres().await, true).await;
}
