//! PostgreSQL through PgBouncer (issue #49): the conformance suite, the store cases and the
//! semaphore cases in transaction mode (`simba_pooler=transaction`, without and with
//! `simba_direct_url`) and in session mode, and what a URL without the option gets from a
//! transaction pooler.
#![allow(missing_docs)]
#![cfg(feature = "postgres")]

mod common;

use common::SqlHarness;
use simba_test_kit::servers::PoolMode;

/// Transaction mode, no direct URL: no native queue across processes, no LISTEN; waiters
/// read the row of another process's owner.
mod transaction {
    use super::*;
    simba_test_kit::conformance_tests!(SqlHarness::pgbouncer(PoolMode::Transaction, false).await);

    mod store {
        use super::*;
        simba_test_kit::store_conformance_tests!(
            SqlHarness::pgbouncer(PoolMode::Transaction, false).await
        );
    }

    mod semaphore {
        use super::*;
        simba_test_kit::semaphore_tests!(SqlHarness::pgbouncer(PoolMode::Transaction, false).await);
    }
}

/// Transaction mode with `simba_direct_url`: the native queue and LISTEN on the direct
/// connection, every statement through the pooler.
mod transaction_direct {
    use super::*;
    simba_test_kit::conformance_tests!(SqlHarness::pgbouncer(PoolMode::Transaction, true).await);

    mod store {
        use super::*;
        simba_test_kit::store_conformance_tests!(
            SqlHarness::pgbouncer(PoolMode::Transaction, true).await
        );
    }
}

/// Session mode: a direct connection, as far as simba can tell.
mod session {
    use super::*;
    simba_test_kit::conformance_tests!(SqlHarness::pgbouncer(PoolMode::Session, false).await);

    mod store {
        use super::*;
        simba_test_kit::store_conformance_tests!(
            SqlHarness::pgbouncer(PoolMode::Session, false).await
        );
    }

    mod semaphore {
        use super::*;
        simba_test_kit::semaphore_tests!(SqlHarness::pgbouncer(PoolMode::Session, false).await);
    }
}

/// A URL without `simba_pooler` through a transaction pooler: the store's first statement
/// prepared by name meets one that another process left on the same server connection (a
/// private PgBouncer has opened one server connection, so every client gets it), and the
/// error says which option to set; with it, the same store works. tokio-postgres names
/// statements `s0`, `s1`, … by a counter of the process, so the other process is played by
/// `PREPARE s0` … `s19999` through the pooler (more than the other tests of this file
/// prepare when they share the process: `cargo test` runs them as threads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_option_a_transaction_pooler_is_named_in_the_error() {
    use simba_core::backend::{Lease, LeaseStore};
    use simba_jdbc::{SqlConfig, SqlStore};
    let pooler = simba_test_kit::servers::pgbouncer_private(PoolMode::Transaction)
        .await
        .expect("a private PgBouncer");
    let (client, conn) = tokio_postgres::connect(pooler.url(), tokio_postgres::NoTls)
        .await
        .expect("a client of PgBouncer");
    let driver = tokio::spawn(conn);
    // One simple query: one implicit transaction, so one server connection holds them all.
    let prepares: String = (0..20_000)
        .map(|i| format!("PREPARE s{i} AS SELECT {i};"))
        .collect();
    client
        .batch_execute(&prepares)
        .await
        .expect("PREPARE s0 … s19999");
    let table = simba_test_kit::support::unique_name("simba_pgb");
    let lease = Lease {
        ttl: std::time::Duration::from_secs(5),
        transition: std::time::Duration::from_secs(1),
    };
    let attempt = async |url: String| -> simba_core::Result<()> {
        let store = SqlStore::connect(SqlConfig::new(url).with_table(&table)).await?;
        store.migrate().await?;
        store.acquire("m", "c1", lease).await?;
        store.release("m", "c1").await.map(drop)
    };
    let e = attempt(pooler.url().to_owned())
        .await
        .expect_err("a statement named s0 meets the one on the server connection");
    let text = e.to_string();
    assert!(
        text.contains("already exists") && text.contains("simba_pooler=transaction"),
        "{text}"
    );
    attempt(format!("{}?simba_pooler=transaction", pooler.url()))
        .await
        .expect("the same through the pooler with the option");
    drop(client);
    let _ = driver.await;
}
