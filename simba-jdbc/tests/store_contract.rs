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

    /// The kit's MariaDB acquires in one statement once migrated (the suite above runs
    /// that statement), and in two when told not to (the module below).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mariadb_acquires_in_one_statement() {
        let harness = SqlHarness::mysql().await;
        let store = harness.store().await.expect("store");
        assert!(store.one_statement_acquire());
        let two = SqlHarness::mysql().await.with_two_statement_acquire();
        let store = two.store().await.expect("store");
        assert!(!store.one_statement_acquire());
    }

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

/// MariaDB with the `UPDATE` and `SELECT` of an acquisition that MySQL runs (the kit has
/// no MySQL server; the default on MariaDB is one statement, run by the module above).
#[cfg(feature = "mysql")]
mod mysql_two_statements {
    use super::*;
    simba_test_kit::store_conformance_tests!(
        SqlHarness::mysql().await.with_two_statement_acquire()
    );
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

/// A mutex's first acquisition inserts its row already owned, in one statement. Four
/// contenders of two stores acquire new mutexes at once, 20 times: one owns each, every
/// reply that names an owner names it with its fence, the fence is the database clock
/// (the rule of a fresh row: `max(version + 1, clock)`), the lease is the one asked for,
/// and the owner's next acquire renews the same ownership.
async fn first_acquisitions(h: &SqlHarness) {
    use simba_core::backend::LeaseStore;
    let a = h.store().await.expect("store a");
    let b = h.store().await.expect("store b");
    let ids = ["a1", "a2", "b1", "b2"];
    let ttl_ms = common::LEASE.ttl.as_millis() as i64;
    let total_ms = ttl_ms + common::LEASE.transition.as_millis() as i64;
    for round in 0..20 {
        let name = simba_test_kit::support::unique_name(&format!("first{round}"));
        let replies = futures_util::future::join_all(ids.iter().enumerate().map(|(i, id)| {
            let store = if i < 2 { &a } else { &b };
            store.acquire(&name, id, common::LEASE)
        }))
        .await;
        let replies: Vec<_> = replies
            .into_iter()
            .map(|r| r.expect("a first acquisition failed"))
            .collect();
        let winners: Vec<usize> = (0..ids.len())
            .filter(|&i| replies[i].owner.is_owner(ids[i]))
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: {replies:?}");
        let won = &replies[winners[0]];
        let winner = ids[winners[0]];
        for r in &replies {
            if r.owner.has_owner() {
                assert_eq!(r.owner.owner_id, winner, "round {round}: {replies:?}");
                assert_eq!(r.owner.fence, won.owner.fence, "round {round}: {replies:?}");
            }
        }
        // The database clock in ms (after 2020), no later than the reply's time.
        assert!(
            won.owner.fence > 1_577_836_800_000 && won.owner.fence as i64 <= won.now,
            "round {round}: the first fence is not the database clock: {won:?}"
        );
        assert_eq!(won.owner.acquired_at, won.owner.fence as i64, "{won:?}");
        assert_eq!(won.owner.ttl_at - won.owner.acquired_at, ttl_ms, "{won:?}");
        assert_eq!(
            won.owner.transition_at - won.owner.acquired_at,
            total_ms,
            "{won:?}"
        );
        let store = if winners[0] < 2 { &a } else { &b };
        let again = store
            .acquire(&name, winner, common::LEASE)
            .await
            .expect("acquire again");
        assert!(again.owner.is_owner(winner), "{again:?}");
        assert_eq!(
            again.owner.fence, won.owner.fence,
            "a renewal changed the fence"
        );
        assert!(store.release(&name, winner).await.expect("release"));
    }
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_first_acquisitions() {
    first_acquisitions(&SqlHarness::sqlite()).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_first_acquisitions() {
    first_acquisitions(&SqlHarness::mysql().await).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_first_acquisitions() {
    first_acquisitions(&SqlHarness::postgres().await).await;
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
            semaphores: true,
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
