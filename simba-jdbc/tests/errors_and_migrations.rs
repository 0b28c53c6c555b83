//! Typed errors for bad input, and idempotent migrations on every backend.
#![allow(missing_docs)]
// With only some backend features, parts of this file are unused.
#![cfg_attr(
    not(all(feature = "sqlite", feature = "mysql", feature = "postgres")),
    allow(unused)
)]

mod common;

use std::time::Duration;

use simba_core::Error;
use simba_core::backend::LeaseStore;
use simba_jdbc::{Backend, SqlConfig, SqlStore, create_table_sql};

use common::SqlHarness;

fn invalid_config(e: Error) -> (&'static str, String) {
    match e {
        Error::InvalidConfig { field, reason } => (field, reason),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_scheme_names_the_supported_ones() {
    let e = SqlStore::connect(SqlConfig::new("redis://127.0.0.1:6379"))
        .await
        .expect_err("redis is not SQL");
    let (field, reason) = invalid_config(e);
    assert_eq!(field, "url");
    for s in [
        "mysql://",
        "mariadb://",
        "postgres://",
        "postgresql://",
        "sqlite://",
        "sqlite::memory:",
    ] {
        assert!(reason.contains(s), "{reason}");
    }
    assert!(
        reason.contains("enabled"),
        "says which features are enabled: {reason}"
    );
    for bad in ["", "127.0.0.1:3306", "mysql:/no-slashes", "sqlite://"] {
        let e = SqlStore::connect(SqlConfig::new(bad)).await.expect_err(bad);
        assert_eq!(invalid_config(e).0, "url", "{bad:?}");
    }
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_are_typed_errors() {
    let base = || SqlConfig::new("sqlite::memory:");
    let cases = [
        (
            base().with_statement_timeout(Duration::ZERO),
            "statement_timeout",
        ),
        (
            base().with_statement_timeout(Duration::from_nanos(1_500_000)),
            "statement_timeout",
        ),
        (
            base().with_statement_timeout(Duration::from_secs(400 * 24 * 3600)),
            "statement_timeout",
        ),
        (base().with_pool_size(0), "pool_size"),
        (base().with_max_name_len(0), "max_name_len"),
        (
            base().with_max_name_len(simba_core::MAX_MUTEX_NAME_LEN + 1),
            "max_name_len",
        ),
        (base().with_table("simba-mutex"), "table"),
        (base().with_table("x; DROP TABLE y"), "table"),
    ];
    for (config, field) in cases {
        let e = SqlStore::connect(config.clone()).await.expect_err(field);
        assert_eq!(invalid_config(e).0, field, "{config:?}");
    }
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_longer_than_the_column_are_invalid_names() {
    let h = SqlHarness::sqlite();
    let store = SqlStore::connect(h.config(h.url()).with_max_name_len(10))
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    let lease = common::LEASE;
    let long = "n".repeat(11);
    let e = store
        .acquire(&long, "me", lease)
        .await
        .expect_err("too long");
    match e {
        Error::InvalidName { reason, .. } => {
            assert!(
                reason.contains("longer than the `mutex` column"),
                "{reason}"
            );
        }
        other => panic!("expected InvalidName, got {other:?}"),
    }
    assert!(matches!(
        store.owner(&long).await,
        Err(Error::InvalidName { .. })
    ));
    assert!(matches!(
        store.release(&long, "me").await,
        Err(Error::InvalidName { .. })
    ));
    // Exactly the limit is fine, in characters (not bytes).
    let ok = "ñ".repeat(10);
    assert!(
        store
            .acquire(&ok, "me", lease)
            .await
            .expect("fits")
            .owner
            .is_owner("me")
    );
    // Core validation applies too.
    assert!(matches!(
        store.acquire("", "me", lease).await,
        Err(Error::InvalidName { .. })
    ));
    assert!(matches!(
        store.acquire("fine", "has space", lease).await,
        Err(Error::InvalidContenderId { .. })
    ));
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_table_says_how_to_fix_it() {
    let h = SqlHarness::sqlite();
    let store = h.store().await.expect("store");
    let other = SqlStore::connect(h.config(h.url()).with_table("never_created"))
        .await
        .expect("connect");
    let e = other.owner("m").await.expect_err("no table");
    assert!(
        !e.is_retryable(),
        "a missing table does not heal by retrying: {e}"
    );
    assert!(e.to_string().contains("migrate"), "{e}");
    drop(store);
}

/// A table of an older simba-jdbc (no waiter columns): calls before the migration fail
/// with a clear error; without DDL the migration keeps the table as it is and the store
/// works without the columns; with DDL (the default) the migration adds the columns and
/// keeps the rows.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_without_the_waiter_columns_gets_them() {
    use diesel::Connection;
    use diesel::connection::SimpleConnection;
    let h = SqlHarness::sqlite();
    let path = h.url().strip_prefix("sqlite://").expect("a sqlite url");
    // The table as an older simba-jdbc made it: no waiter_id / waiter_until.
    let mut raw = diesel::SqliteConnection::establish(path).expect("open the file");
    raw.batch_execute(
        "CREATE TABLE old_mutex (mutex VARCHAR(200) NOT NULL PRIMARY KEY, \
         acquired_at BIGINT NOT NULL DEFAULT 0, ttl_at BIGINT NOT NULL DEFAULT 0, \
         transition_at BIGINT NOT NULL DEFAULT 0, owner_id VARCHAR(200) NOT NULL DEFAULT '', \
         version BIGINT NOT NULL DEFAULT 0); \
         INSERT INTO old_mutex (mutex, version) VALUES ('kept', 17)",
    )
    .expect("create the old table");
    let config = h.config(h.url()).with_table("old_mutex");
    let strict = SqlStore::connect(config.clone().with_ddl(false))
        .await
        .expect("connect");
    // Before its migration, a store expects simba's columns: a clear error.
    let e = strict
        .acquire("m", "c", common::LEASE)
        .await
        .expect_err("no acquire on the old table before the migration");
    assert!(
        !e.is_retryable() && e.to_string().contains("lacks a column"),
        "{e}"
    );
    // Without DDL the migration keeps the table as it is and the store runs without the
    // waiter columns.
    strict.migrate().await.expect("DDL off: used as it is");
    let waiter_columns = |raw: &mut diesel::SqliteConnection| {
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let rows: Vec<N> = diesel::RunQueryDsl::load(
            diesel::sql_query(
                "SELECT COUNT(*) AS n FROM pragma_table_info('old_mutex') \
                 WHERE name LIKE 'waiter%'",
            ),
            raw,
        )
        .expect("pragma");
        rows.first().map_or(-1, |r| r.n)
    };
    assert_eq!(waiter_columns(&mut raw), 0, "DDL off added a column");
    let r = strict
        .acquire("m", "c", common::LEASE)
        .await
        .expect("acquire");
    assert!(r.owner.is_owned_by_at("c", r.now), "{r:?}");
    assert!(strict.release("m", "c").await.expect("release"));

    let store = SqlStore::connect(config).await.expect("connect");
    store.migrate().await.expect("the columns are added");
    assert_eq!(waiter_columns(&mut raw), 2);
    let kept = store
        .acquire("kept", "c", common::LEASE)
        .await
        .expect("acquire");
    assert_eq!(kept.owner.owner_id, "c");
    assert!(kept.owner.fence > 17, "the row was kept: {kept:?}");
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_database_is_a_bounded_backend_error() {
    // Port 1 on loopback: nothing listens, the connection is refused.
    let config = SqlConfig::new("mysql://root:hunter2@127.0.0.1:1/simba")
        .with_statement_timeout(Duration::from_secs(2));
    let lazy = SqlStore::connect_lazy(config.clone()).expect("lazy connect does no I/O");
    assert!(!format!("{lazy:?}").contains("hunter2"), "{lazy:?}");
    let t0 = std::time::Instant::now();
    let e = SqlStore::connect(config)
        .await
        .expect_err("nothing listens");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "bounded by the statement timeout"
    );
    assert!(
        matches!(
            e,
            Error::Backend {
                backend: "mysql",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.is_retryable());
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        text.push_str(&s.to_string());
        source = s.source();
    }
    assert!(!text.contains("hunter2"), "password leaked: {text}");
    let e = lazy.owner("m").await.expect_err("nothing listens");
    assert!(matches!(e, Error::Backend { .. }), "{e:?}");
}

async fn migrate_twice(h: &SqlHarness) {
    let a = SqlStore::connect(h.config(h.url())).await.expect("connect");
    let b = SqlStore::connect(h.config(h.url())).await.expect("connect");
    // Concurrently from two stores (two processes would do the same), then again.
    let (ra, rb) = tokio::join!(a.migrate(), b.migrate());
    ra.expect("first migration");
    rb.expect("concurrent migration");
    a.migrate().await.expect("migration is idempotent");
    assert!(
        a.acquire("after-migrate", "me", common::LEASE)
            .await
            .expect("usable")
            .owner
            .is_owner("me")
    );
    a.migrate().await.expect("migration keeps the data");
    assert!(
        b.owner("after-migrate")
            .await
            .expect("owner")
            .owner
            .is_owner("me")
    );
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_migration_is_idempotent() {
    migrate_twice(&SqlHarness::sqlite()).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_migration_is_idempotent() {
    migrate_twice(&SqlHarness::mysql().await).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_migration_is_idempotent() {
    migrate_twice(&SqlHarness::postgres().await).await;
}

#[test]
fn readme_shows_the_sql_the_migration_runs() {
    let readme = include_str!("../README.md");
    for backend in [Backend::Mysql, Backend::Postgres, Backend::Sqlite] {
        let ddl = create_table_sql(backend, "simba_mutex").expect("valid");
        assert!(
            readme.contains(&ddl),
            "README lacks the {backend} DDL:\n{ddl}"
        );
    }
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn factory_connects_and_migrates() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("f.db").display());
    let f = std::sync::Arc::new(
        simba_jdbc::factory(&url, simba_core::LeaseConfig::default())
            .await
            .expect("factory"),
    );
    let locker = simba_core::Locker::new(f, "factory-test").expect("locker");
    let guard = tokio::time::timeout(Duration::from_secs(10), locker.acquire())
        .await
        .expect("in time")
        .expect("acquire");
    assert!(guard.fence() > 0);
    guard.release().await.expect("release");
    let e = simba_jdbc::factory(
        "sqlite::memory:",
        simba_core::LeaseConfig::with_lease(Duration::ZERO, Duration::ZERO),
    )
    .await
    .expect_err("zero ttl");
    assert!(
        matches!(e, Error::InvalidConfig { field: "ttl", .. }),
        "{e:?}"
    );
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_memory_works_in_one_process() {
    let store = SqlStore::connect(SqlConfig::new("sqlite::memory:"))
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    // One store, shared: `sqlite::memory:` is one database per store.
    let source = simba_test_kit::memory::StoreHarness::new("sqlite::memory:", store, false);
    for r in [
        simba_test_kit::store_cases::acquire_renew_release(&source).await,
        simba_test_kit::store_cases::stale_calls_change_nothing(&source).await,
        simba_test_kit::store_cases::fences_strictly_increase(&source).await,
    ] {
        r.unwrap_or_else(|e| panic!("{e}"));
    }
}

/// Many stores (processes would do the same) opening a new SQLite file at the same instant
/// all succeed: switching to WAL can fail with "database is locked" without waiting on
/// the busy timeout, and the store retries it.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_many_stores_open_a_new_file_at_once() {
    for round in 0..5 {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", dir.path().join("new.db").display());
        let opens = (0..12).map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let store = SqlStore::connect(SqlConfig::new(&url)).await?;
                store.migrate().await?;
                Ok::<_, Error>(store)
            })
        });
        for (i, r) in join_all(opens).await.into_iter().enumerate() {
            r.expect("task")
                .unwrap_or_else(|e| panic!("round {round}, store {i}: {e}"));
        }
    }
}

async fn join_all<T>(
    handles: impl Iterator<Item = tokio::task::JoinHandle<T>>,
) -> Vec<std::result::Result<T, tokio::task::JoinError>> {
    let mut out = Vec::new();
    for h in handles.collect::<Vec<_>>() {
        out.push(h.await);
    }
    out
}
