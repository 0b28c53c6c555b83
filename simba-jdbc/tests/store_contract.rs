//! The LeaseStore contract, call by call, on each backend; plus PostgreSQL push events.
#![allow(missing_docs)]
// With only some backend features, parts of this file are unused.
#![cfg_attr(
    not(all(feature = "sqlite", feature = "mysql", feature = "postgres")),
    allow(unused)
)]

mod common;

use common::{LEASE, SqlHarness};

async fn contract(h: &SqlHarness) {
    let a = h.store().await.expect("store a");
    let b = h.store().await.expect("store b");
    common::store_contract(&a, &b, "contract-mutex").await;
    // Names: unicode and the longest the column holds.
    let long = "ü".repeat(simba_jdbc::MUTEX_COLUMN_LEN / 2);
    common::store_contract(&a, &b, &long).await;
}

/// The waiter slot: a waiter that found the mutex held has first claim on it after the
/// release, so the releaser cannot barge past it; leaving gives the claim up, and a claim
/// whose waiter stopped looking lapses.
async fn waiter_claim(h: &SqlHarness) {
    use simba_core::LeaseStore;
    use std::time::Duration;
    let reservation = Duration::from_millis(300);
    let store = |name: &'static str| async move {
        let s =
            simba_jdbc::SqlStore::connect(h.config(h.url()).with_waiter_reservation(reservation))
                .await
                .unwrap_or_else(|e| panic!("store {name}: {e}"));
        s.migrate().await.expect("migrate");
        s
    };
    let (a, b, c) = (store("a").await, store("b").await, store("c").await);
    let m = "claim-mutex";

    assert!(
        a.acquire(m, "a", LEASE)
            .await
            .expect("a")
            .owner
            .is_owner("a")
    );
    // b finds it held: b takes the waiter slot; c finds the slot taken.
    assert!(
        b.acquire(m, "b", LEASE)
            .await
            .expect("b")
            .owner
            .is_owner("a")
    );
    assert!(
        c.acquire(m, "c", LEASE)
            .await
            .expect("c")
            .owner
            .is_owner("a")
    );
    assert!(a.release(m, "a").await.expect("release"));
    // The releaser and c contend again at once: the free mutex is b's to take.
    for (s, id) in [(&a, "a"), (&c, "c")] {
        let r = s.acquire(m, id, LEASE).await.expect("barge");
        assert!(!r.owner.has_owner(), "{id} barged past the waiter: {r:?}");
        assert!(
            r.owner.transition_at > r.now && r.owner.transition_at <= r.now + 300,
            "{id} is told to look again when the claim lapses: {r:?}"
        );
    }
    let took = b.acquire(m, "b", LEASE).await.expect("b takes it");
    assert!(took.owner.is_owned_by_at("b", took.now), "{took:?}");
    // Taking it freed the slot: a, now waiting, claims it; b's release goes to a.
    assert!(
        a.acquire(m, "a", LEASE)
            .await
            .expect("a waits")
            .owner
            .is_owner("b")
    );
    assert!(b.release(m, "b").await.expect("release"));
    assert!(
        !c.acquire(m, "c", LEASE).await.expect("c").owner.has_owner(),
        "the claim passed to the next waiter"
    );
    // A waiter that leaves gives its claim up at once.
    a.leave(m, "a").await.expect("leave");
    let r = c.acquire(m, "c", LEASE).await.expect("c after leave");
    assert!(r.owner.is_owned_by_at("c", r.now), "{r:?}");

    // A claim whose waiter stopped looking lapses: b waits once, then goes silent.
    assert!(
        b.acquire(m, "b", LEASE)
            .await
            .expect("b")
            .owner
            .is_owner("c")
    );
    assert!(c.release(m, "c").await.expect("release"));
    let blocked = a.acquire(m, "a", LEASE).await.expect("a");
    assert!(!blocked.owner.has_owner(), "{blocked:?}");
    // Time is the subject here: wait out the claim (300 ms from b's look) on the
    // database's clock, as the reply told us, plus a margin for a loaded machine.
    let left = u64::try_from(blocked.owner.transition_at - blocked.now).unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(left + 100)).await;
    let r = a
        .acquire(m, "a", LEASE)
        .await
        .expect("a after the claim lapsed");
    assert!(r.owner.is_owned_by_at("a", r.now), "{r:?}");

    // Readers never see a claim as an owner.
    let seen = b.owner(m).await.expect("owner");
    assert!(seen.owner.is_owner("a"), "{seen:?}");
    assert!(a.release(m, "a").await.expect("release"));
    assert!(!b.owner(m).await.expect("owner").owner.has_owner());

    // With claims off, the releaser may take it back at once.
    let off =
        simba_jdbc::SqlStore::connect(h.config(h.url()).with_waiter_reservation(Duration::ZERO))
            .await
            .expect("store");
    let m = "claim-off";
    assert!(
        off.acquire(m, "x", LEASE)
            .await
            .expect("x")
            .owner
            .is_owner("x")
    );
    assert!(
        off.acquire(m, "y", LEASE)
            .await
            .expect("y")
            .owner
            .is_owner("x")
    );
    assert!(off.release(m, "x").await.expect("release"));
    let r = off.acquire(m, "x", LEASE).await.expect("x again");
    assert!(r.owner.is_owned_by_at("x", r.now), "{r:?}");
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_contract() {
    let h = SqlHarness::sqlite();
    contract(&h).await;
    waiter_claim(&h).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_contract() {
    let h = SqlHarness::mysql().await;
    contract(&h).await;
    waiter_claim(&h).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_contract() {
    let h = SqlHarness::postgres().await;
    contract(&h).await;
    waiter_claim(&h).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_pushes_acquired_and_released() {
    use simba_core::{LeaseStore, StoreEvent};
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

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_does_not_push() {
    use simba_core::LeaseStore;
    let h = SqlHarness::sqlite();
    let store = h.store().await.expect("store");
    assert!(
        store
            .subscribe("m", "c")
            .await
            .expect("subscribe")
            .is_none()
    );
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
