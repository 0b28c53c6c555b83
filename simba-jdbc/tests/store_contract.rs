//! The LeaseStore contract, call by call, on each database (the kit's store-level cases);
//! the longest names; PostgreSQL push events.
#![allow(missing_docs)]
// With only some backend features, parts of this file are unused.
#![cfg_attr(
    not(all(feature = "sqlite", feature = "mysql", feature = "postgres")),
    allow(unused)
)]

mod common;

use common::SqlHarness;

// The kit's store-level cases (the whole `LeaseStore` contract), on each database.
#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    simba_test_kit::store_conformance_tests!(SqlHarness::sqlite());

    /// The store contract's property test (the kit's `store_props`): a bounded number of
    /// random call sequences on the database's clock, checked against the lease model. A
    /// contender refused while the mutex was held has first claim on it (the wait queue):
    /// another contender's acquisition of the free mutex may get the unnamed holder.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn store_contract_properties() {
        use simba_test_kit::store_props::{PropertyRun, check_store_contract};
        let source = SqlHarness::sqlite();
        if let Err(e) = check_store_contract(&source, &PropertyRun::backend(true)).await {
            panic!("{e}");
        }
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    simba_test_kit::store_conformance_tests!(SqlHarness::mysql().await);

    /// The store contract's property test (the kit's `store_props`): a bounded number of
    /// random call sequences on the database's clock, checked against the lease model. A
    /// contender refused while the mutex was held has first claim on it (the wait queue):
    /// another contender's acquisition of the free mutex may get the unnamed holder.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn store_contract_properties() {
        use simba_test_kit::store_props::{PropertyRun, check_store_contract};
        let source = SqlHarness::mysql().await;
        if let Err(e) = check_store_contract(&source, &PropertyRun::backend(true)).await {
            panic!("{e}");
        }
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    simba_test_kit::store_conformance_tests!(SqlHarness::postgres().await);

    /// The store contract's property test (the kit's `store_props`): a bounded number of
    /// random call sequences on the database's clock, checked against the lease model. A
    /// contender refused while the mutex was held has first claim on it (the wait queue):
    /// another contender's acquisition of the free mutex may get the unnamed holder.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn store_contract_properties() {
        use simba_test_kit::store_props::{PropertyRun, check_store_contract};
        let source = SqlHarness::postgres().await;
        if let Err(e) = check_store_contract(&source, &PropertyRun::backend(true)).await {
            panic!("{e}");
        }
    }
}

/// The longest names every backend accepts (200 bytes: 100 two-byte "ü"); a store whose
/// `mutex` column is narrower refuses longer names, in characters, before any SQL runs,
/// when a service is made.
async fn longest_names(h: &SqlHarness) {
    use simba_core::backend::LeaseStore;
    let a = h.store().await.expect("store a");
    let b = h.store().await.expect("store b");
    let long = "ü".repeat(simba_jdbc::MUTEX_COLUMN_LEN / 2);
    let got = a.acquire(&long, "a", common::LEASE).await.expect("acquire");
    assert!(got.owner.is_owner("a"), "{got:?}");
    let seen = b.owner(&long).await.expect("owner");
    assert_eq!(seen.owner, got.owner);
    assert!(a.release(&long, "a").await.expect("release"));

    let narrow = simba_jdbc::SqlStore::connect(h.config(h.url()).with_max_name_len(10))
        .await
        .expect("a store with 10-character names");
    assert!(narrow.check_mutex_name(&"ü".repeat(10)).is_ok());
    let longer = "ü".repeat(11);
    assert!(
        matches!(
            narrow.check_mutex_name(&longer),
            Err(simba_core::Error::InvalidName { .. })
        ),
        "the store accepts a name longer than its column"
    );
    let factory = simba_core::LeaseServiceFactory::new(narrow, simba_core::LeaseConfig::default())
        .expect("factory");
    let made = simba_core::ContendServiceFactory::create_contend_service(
        &factory,
        &longer,
        std::sync::Arc::new(simba_core::SilentContender),
    );
    assert!(
        matches!(made, Err(simba_core::Error::InvalidName { .. })),
        "a service was made for a name longer than the column"
    );
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_longest_names() {
    longest_names(&SqlHarness::sqlite()).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_longest_names() {
    longest_names(&SqlHarness::mysql().await).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_longest_names() {
    longest_names(&SqlHarness::postgres().await).await;
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

/// The connector gives a generic tool a working backend on each database: the kit's
/// connector check, on the harness's URL (default table, as `simba` uses it).
async fn connector(h: &SqlHarness, notifies: bool) {
    // The password of the URL, if it has one, must not show in its redaction.
    let secret = h
        .url()
        .split_once("://")
        .and_then(|(_, rest)| rest.split_once('@'))
        .and_then(|(userinfo, _)| userinfo.split_once(':'))
        .map(|(_, password)| password.to_owned())
        .filter(|p| !p.is_empty());
    simba_test_kit::connector::check(
        &simba_jdbc::CONNECTOR,
        h.url(),
        secret.as_deref(),
        simba_test_kit::connector::Expect {
            ownership: simba_core::connect::Ownership::Lease,
            round_trip: "SELECT 1",
            counts_connections: false,
        },
    )
    .await;
    let conn = simba_core::connect::Connectors::new(vec![&simba_jdbc::CONNECTOR])
        .connect(h.url(), &simba_core::connect::ConnectOptions::new())
        .await
        .expect("connects");
    assert_eq!(conn.capabilities().pushes_to_observers, notifies);
    assert!(conn.capabilities().pushes_to_waiters);
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_connector() {
    connector(&SqlHarness::sqlite(), false).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_connector() {
    connector(&SqlHarness::mysql().await, false).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connector() {
    connector(&SqlHarness::postgres().await, true).await;
}
