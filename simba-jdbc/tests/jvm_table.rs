//! A table made by the JVM Simba library, shared with simba-jdbc (issue #27): the migration
//! adds simba's two waiter columns in place, keeps the rows, and adapts to the narrow
//! columns (`owner_id CHAR(32)`, `version INT UNSIGNED`); fences continue from the JVM's
//! `version` and stay strictly increasing across a mixed history; contenders that speak the
//! JVM library's SQL and simba contenders never own a mutex at once.
//!
//! The JVM side is written here from the protocol's description (its DDL, the conditional
//! `UPDATE … WHERE transition_at < now OR (owner_id = me AND transition_at > now)`, the
//! owner-checked release), driven through a plain connection of the test.
#![allow(missing_docs)]
// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]
// With only some backend features, parts of this file are unused.
#![cfg_attr(
    not(all(feature = "sqlite", feature = "mysql", feature = "postgres")),
    allow(unused)
)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::SqlHarness;
use diesel::QueryableByName;
use diesel::sql_types::BigInt;
use simba_core::backend::LeaseStore;
use simba_core::{ContendServiceFactory, Error, LeaseServiceFactory, LossReason};
use simba_jdbc::{Backend, SqlStore};
use simba_test_kit::history::{History, Violation};
use simba_test_kit::support::{init_tracing, lease};
use tokio::time::Instant;

/// A plain connection: the JVM library's side (one per contender; size does not matter).
#[allow(clippy::large_enum_variant)]
enum Raw {
    #[cfg(feature = "mysql")]
    Mysql(diesel_async::AsyncMysqlConnection),
    #[cfg(feature = "postgres")]
    Postgres(diesel_async::AsyncPgConnection),
    #[cfg(feature = "sqlite")]
    Sqlite(diesel::SqliteConnection),
}

#[derive(QueryableByName)]
struct One {
    #[diesel(sql_type = BigInt)]
    v: i64,
}

impl Raw {
    async fn connect(h: &SqlHarness, kind: Backend) -> Raw {
        match kind {
            #[cfg(feature = "mysql")]
            Backend::Mysql => {
                use diesel_async::AsyncConnection;
                Raw::Mysql(
                    diesel_async::AsyncMysqlConnection::establish(h.url())
                        .await
                        .unwrap(),
                )
            }
            #[cfg(feature = "postgres")]
            Backend::Postgres => {
                use diesel_async::AsyncConnection;
                Raw::Postgres(
                    diesel_async::AsyncPgConnection::establish(h.url())
                        .await
                        .unwrap(),
                )
            }
            #[cfg(feature = "sqlite")]
            Backend::Sqlite => {
                use diesel::Connection;
                let path = h.url().strip_prefix("sqlite://").unwrap();
                let mut c = diesel::SqliteConnection::establish(path).unwrap();
                // Wait for the write lock as simba's connections do, rather than fail.
                diesel::connection::SimpleConnection::batch_execute(
                    &mut c,
                    "PRAGMA busy_timeout = 5000",
                )
                .unwrap();
                Raw::Sqlite(c)
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("backend feature off"),
        }
    }

    fn kind(&self) -> Backend {
        match self {
            #[cfg(feature = "mysql")]
            Raw::Mysql(_) => Backend::Mysql,
            #[cfg(feature = "postgres")]
            Raw::Postgres(_) => Backend::Postgres,
            #[cfg(feature = "sqlite")]
            Raw::Sqlite(_) => Backend::Sqlite,
        }
    }

    /// Runs `sql`; the number of rows it changed.
    async fn exec(&mut self, sql: &str) -> usize {
        let q = diesel::sql_query(sql);
        match self {
            #[cfg(feature = "mysql")]
            Raw::Mysql(c) => diesel_async::RunQueryDsl::execute(q, c).await.unwrap(),
            #[cfg(feature = "postgres")]
            Raw::Postgres(c) => diesel_async::RunQueryDsl::execute(q, c).await.unwrap(),
            #[cfg(feature = "sqlite")]
            Raw::Sqlite(c) => diesel::RunQueryDsl::execute(q, c).unwrap(),
        }
    }

    /// The one BIGINT `v` that `sql` selects.
    async fn value(&mut self, sql: &str) -> i64 {
        let q = diesel::sql_query(sql);
        let rows: Vec<One> = match self {
            #[cfg(feature = "mysql")]
            Raw::Mysql(c) => diesel_async::RunQueryDsl::load(q, c).await.unwrap(),
            #[cfg(feature = "postgres")]
            Raw::Postgres(c) => diesel_async::RunQueryDsl::load(q, c).await.unwrap(),
            #[cfg(feature = "sqlite")]
            Raw::Sqlite(c) => diesel::RunQueryDsl::load(q, c).unwrap(),
        };
        rows.first().map(|r| r.v).unwrap()
    }

    /// `table` quoted as simba quotes it (PostgreSQL folds unquoted names to lower case).
    fn quoted(&self, table: &str) -> String {
        match self.kind() {
            Backend::Mysql => format!("`{table}`"),
            _ => format!("\"{table}\""),
        }
    }

    /// The database's clock in ms, as the JVM library writes it.
    fn now(&self) -> &'static str {
        match self.kind() {
            Backend::Mysql => "ROUND(UNIX_TIMESTAMP(CURRENT_TIMESTAMP(3)) * 1000)",
            Backend::Postgres => {
                "CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)"
            }
            _ => "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
        }
    }

    /// How many of simba's waiter columns `table` has.
    async fn waiter_columns(&mut self, table: &str) -> i64 {
        let sql = match self.kind() {
            Backend::Mysql => format!(
                "SELECT CAST(COUNT(*) AS SIGNED) AS v FROM information_schema.COLUMNS \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{table}' \
                 AND COLUMN_NAME LIKE 'waiter%'"
            ),
            Backend::Postgres => format!(
                "SELECT COUNT(*) AS v FROM information_schema.columns \
                 WHERE table_schema = current_schema() AND table_name = '{table}' \
                 AND column_name LIKE 'waiter%'"
            ),
            _ => format!(
                "SELECT COUNT(*) AS v FROM pragma_table_info('{table}') WHERE name LIKE 'waiter%'"
            ),
        };
        self.value(&sql).await
    }

    /// The JVM library's table, as its init script makes it.
    async fn create_jvm_table(&mut self, table: &str) {
        let table = &self.quoted(table);
        let ddl = match self.kind() {
            Backend::Mysql => format!(
                "CREATE TABLE {table} (mutex VARCHAR(66) NOT NULL PRIMARY KEY, \
                 acquired_at BIGINT UNSIGNED NOT NULL, ttl_at BIGINT UNSIGNED NOT NULL, \
                 transition_at BIGINT UNSIGNED NOT NULL, owner_id CHAR(32) NOT NULL, \
                 version INT UNSIGNED NOT NULL)"
            ),
            Backend::Postgres => format!(
                "CREATE TABLE {table} (mutex VARCHAR(66) NOT NULL PRIMARY KEY, \
                 acquired_at BIGINT NOT NULL, ttl_at BIGINT NOT NULL, \
                 transition_at BIGINT NOT NULL, owner_id CHAR(32) NOT NULL, \
                 version INTEGER NOT NULL)"
            ),
            _ => format!(
                "CREATE TABLE {table} (mutex VARCHAR(66) NOT NULL PRIMARY KEY, \
                 acquired_at BIGINT UNSIGNED NOT NULL, ttl_at BIGINT UNSIGNED NOT NULL, \
                 transition_at BIGINT UNSIGNED NOT NULL, owner_id CHAR(32) NOT NULL, \
                 version INT UNSIGNED NOT NULL)"
            ),
        };
        self.exec(&ddl).await;
    }

    /// A JVM contender's row for `mutex`, made as its library makes it, at `version`.
    async fn insert(&mut self, table: &str, mutex: &str, version: i64) {
        let table = &self.quoted(table);
        let values = format!(
            "(mutex, acquired_at, ttl_at, transition_at, owner_id, version) \
             VALUES ('{mutex}', 0, 0, 0, '', {version})"
        );
        let sql = match self.kind() {
            Backend::Mysql => format!("INSERT IGNORE INTO {table} {values}"),
            _ => {
                format!("INSERT INTO {table} {values} ON CONFLICT (mutex) DO NOTHING")
            }
        };
        self.exec(&sql).await;
    }

    /// The JVM library's acquire (or renew): whether `me` owns `mutex` now, and its fence.
    async fn acquire(&mut self, table: &str, mutex: &str, me: &str, ttl_ms: i64) -> Option<u64> {
        let table = &self.quoted(table);
        let now = self.now();
        let changed = self
            .exec(&format!(
                "UPDATE {table} SET acquired_at = {now}, ttl_at = {now} + {ttl_ms}, \
                 transition_at = {now} + {total}, owner_id = '{me}', version = version + 1 \
                 WHERE mutex = '{mutex}' AND (transition_at < {now} \
                 OR (owner_id = '{me}' AND transition_at > {now}))",
                total = ttl_ms * 2
            ))
            .await;
        if changed == 0 {
            return None;
        }
        let v = self
            .value(&format!(
                "SELECT CAST(version AS {int}) AS v FROM {table} WHERE mutex = '{mutex}'",
                int = if self.kind() == Backend::Mysql {
                    "SIGNED"
                } else {
                    "BIGINT"
                }
            ))
            .await;
        Some(u64::try_from(v).unwrap())
    }

    /// The JVM library's release.
    async fn release(&mut self, table: &str, mutex: &str, me: &str) -> bool {
        let table = &self.quoted(table);
        self.exec(&format!(
            "UPDATE {table} SET acquired_at = 0, ttl_at = 0, transition_at = 0, owner_id = '', \
             version = version + 1 WHERE mutex = '{mutex}' AND owner_id = '{me}'"
        ))
        .await
            == 1
    }
}

/// A store on `h`'s table, migrated, with DDL allowed or not.
async fn store_with_ddl(h: &SqlHarness, ddl: bool) -> SqlStore {
    let store = SqlStore::connect(h.config(h.url()).with_ddl(ddl))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    store
}

/// The JVM library takes `mutex` for `me` once its clock has passed simba's release
/// (`transition_at < now`: within a few milliseconds); its fence. The JVM protocol has no
/// event to await: a 2 ms retry, bounded at 5 s.
async fn jvm_takes(jvm: &mut Raw, table: &str, mutex: &str, me: &str) -> u64 {
    let t0 = Instant::now();
    loop {
        if let Some(f) = jvm.acquire(table, mutex, me, 5_000).await {
            return f;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the JVM never took the row"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A JVM table: used as it is with DDL off (no column added; fences continue one apart
/// across JVM → simba → JVM → simba), migrated in place with DDL on (rows kept, twice is
/// fine), then fences continue from the JVM's `version` the same way, and contender ids
/// that do not fit are refused before any statement.
async fn jvm_table_is_migrated_in_place(h: SqlHarness, kind: Backend) {
    init_tracing();
    let mut jvm = Raw::connect(&h, kind).await;
    let table = h.table();
    jvm.create_jvm_table(table).await;
    jvm.insert(table, "m", 41).await;

    // DDL off: the table as it is.
    let strict = store_with_ddl(&h, false).await;
    assert_eq!(jvm.waiter_columns(table).await, 0, "DDL off added a column");
    jvm.insert(table, "c", 7).await;
    let mut fences = vec![jvm.acquire(table, "c", "jvm-a", 5_000).await.unwrap()];
    let taken = strict.acquire("c", "simba-a", common::LEASE).await.unwrap();
    assert_eq!(taken.owner.owner_id, "jvm-a", "{taken:?}");
    assert!(jvm.release(table, "c", "jvm-a").await);
    let s = strict.acquire("c", "simba-a", common::LEASE).await.unwrap();
    assert!(s.owner.is_owned_by_at("simba-a", s.now), "{s:?}");
    fences.push(s.owner.fence);
    let r = strict.guard("c", "simba-a", common::LEASE).await.unwrap();
    assert_eq!(r.owner.fence, s.owner.fence);
    assert_eq!(jvm.acquire(table, "c", "jvm-b", 5_000).await, None);
    assert!(strict.release("c", "simba-a").await.unwrap());
    fences.push(jvm_takes(&mut jvm, table, "c", "jvm-b").await);
    assert!(jvm.release(table, "c", "jvm-b").await);
    let s = strict.acquire("c", "simba-b", common::LEASE).await.unwrap();
    fences.push(s.owner.fence);
    assert!(strict.release("c", "simba-b").await.unwrap());
    assert_eq!(fences, vec![8, 10, 11, 13]);
    assert_eq!(jvm.waiter_columns(table).await, 0);

    let store = h.store().await.unwrap();
    assert_eq!(jvm.waiter_columns(table).await, 2);
    store.migrate().await.expect("a second migration");
    // The JVM row is still there, free, at its version.
    let free = store.owner("m").await.unwrap();
    assert!(free.owner.owner_id.is_empty(), "{free:?}");

    // JVM → simba → JVM → simba: each fence the previous one + 1.
    let mut fences = vec![jvm.acquire(table, "m", "jvm-a", 5_000).await.unwrap()];
    assert_eq!(fences[0], 42);
    let taken = store.acquire("m", "simba-a", common::LEASE).await.unwrap();
    assert_eq!(
        taken.owner.owner_id, "jvm-a",
        "a JVM owner is an owner to simba"
    );
    assert!(jvm.release(table, "m", "jvm-a").await);
    let s = store.acquire("m", "simba-a", common::LEASE).await.unwrap();
    assert_eq!(s.owner.owner_id, "simba-a");
    fences.push(s.owner.fence);
    // The renewal keeps the fence.
    let r = store.guard("m", "simba-a", common::LEASE).await.unwrap();
    assert_eq!(r.owner.fence, s.owner.fence);
    assert_eq!(
        jvm.acquire(table, "m", "jvm-b", 5_000).await,
        None,
        "a simba owner is an owner to the JVM library"
    );
    assert!(store.release("m", "simba-a").await.unwrap());
    fences.push(jvm_takes(&mut jvm, table, "m", "jvm-b").await);
    assert!(jvm.release(table, "m", "jvm-b").await);
    let s = store.acquire("m", "simba-b", common::LEASE).await.unwrap();
    fences.push(s.owner.fence);
    // The JVM library's release counts a version too (42 → 43); simba's does not.
    assert_eq!(fences, vec![42, 44, 45, 47]);

    // Ids: a generated one fits, one that leaves no room for `held@@` in CHAR(32) does not
    // (SQLite does not enforce a declared width: any id fits there).
    store
        .check_contender_id(&simba_core::generate_contender_id())
        .unwrap();
    store.check_contender_id(&"x".repeat(26)).unwrap();
    if kind != Backend::Sqlite {
        let e = store
            .check_contender_id(&"x".repeat(27))
            .expect_err("27 + 6 > 32");
        assert!(
            matches!(&e, Error::InvalidContenderId { reason, .. } if reason.contains("owner_id")),
            "{e}"
        );
    }
    // Names: the JVM table's `mutex VARCHAR(66)` (SQLite does not enforce a width).
    if kind != Backend::Sqlite {
        let e = store
            .owner(&"n".repeat(67))
            .await
            .expect_err("67 > VARCHAR(66)");
        assert!(matches!(e, Error::InvalidName { .. }), "{e}");
    }
    store.owner(&"n".repeat(66)).await.unwrap();
    // A hold by a 26-character id fits the column.
    let long = "y".repeat(26);
    store.release("m", "simba-b").await.unwrap();
    store.acquire("m", &long, common::LEASE).await.unwrap();
    assert!(
        store
            .release_after("m", &long, Duration::from_millis(200))
            .await
            .unwrap()
    );
    let held = store.owner("m").await.unwrap();
    assert_eq!(held.owner.owner_id, format!("held@@{long}"));
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_jvm_table_is_migrated_in_place() {
    jvm_table_is_migrated_in_place(SqlHarness::sqlite(), Backend::Sqlite).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_jvm_table_is_migrated_in_place() {
    jvm_table_is_migrated_in_place(SqlHarness::mysql().await, Backend::Mysql).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_jvm_table_is_migrated_in_place() {
    jvm_table_is_migrated_in_place(SqlHarness::postgres().await, Backend::Postgres).await;
}

/// How long each owner holds the mutex at least, and rests before contending again.
const HOLD: Duration = Duration::from_millis(20);
const REST: Duration = Duration::from_millis(30);

/// A hold: [`HOLD`], plus up to `SIMBA_JVM_FLEET_HOLD_EXTRA_MS` more (0 by default; the
/// README's figures use 230, holds of 20–250 ms).
fn hold(n: &mut u64) -> Duration {
    let extra: u64 = std::env::var("SIMBA_JVM_FLEET_HOLD_EXTRA_MS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    *n = n
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    HOLD + Duration::from_millis((*n >> 33) % (extra + 1))
}

/// The run's length: `SIMBA_JVM_FLEET_SECS`, 10 s by default.
fn fleet_secs() -> u64 {
    std::env::var("SIMBA_JVM_FLEET_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10)
}
/// The JVM contenders' poll: at most every 50 ms, as the JVM library's schedule does.
const JVM_POLL: Duration = Duration::from_millis(50);

async fn jvm_contender(
    h: Arc<SqlHarness>,
    kind: Backend,
    id: String,
    history: History,
    end: Instant,
) {
    let mut jvm = Raw::connect(&h, kind).await;
    let table = h.table().to_owned();
    let mut n = id.len() as u64;
    while Instant::now() < end {
        match jvm.acquire(&table, "fleet", &id, 3_000).await {
            Some(fence) => {
                history.begin(&id, fence);
                tokio::time::sleep(hold(&mut n)).await;
                history.end(&id, LossReason::Released);
                assert!(jvm.release(&table, "fleet", &id).await);
                tokio::time::sleep(REST).await;
            }
            None => tokio::time::sleep(JVM_POLL).await,
        }
    }
}

async fn simba_contender(
    h: Arc<SqlHarness>,
    ddl: bool,
    id: String,
    history: History,
    end: Instant,
) {
    let store = store_with_ddl(&h, ddl).await;
    let factory =
        LeaseServiceFactory::new(store, lease(Duration::from_secs(2), Duration::from_secs(1)))
            .unwrap();
    let mut n = id.len() as u64 + 7;
    let svc = factory
        .create_contend_service("fleet", history.contender(id))
        .unwrap();
    while Instant::now() < end {
        svc.start().unwrap();
        let mut status = svc.status();
        let held = matches!(
            tokio::time::timeout_at(end, status.wait_for(|s| s.held.is_some())).await,
            Ok(Ok(_))
        );
        if !held {
            break;
        }
        tokio::time::sleep(hold(&mut n)).await;
        svc.stop().await.unwrap();
        tokio::time::sleep(REST).await;
    }
    svc.stop().await.unwrap();
}

/// Three JVM-protocol contenders and two simba contenders on one mutex of a JVM table for
/// 10 s: never two owners at once, fences strictly increasing over the whole mixed history
/// (the checker reads every interval's fence), and each side gets a share. Longer runs
/// with longer holds (the README's figures):
/// `SIMBA_JVM_FLEET_SECS=60 SIMBA_JVM_FLEET_HOLD_EXTRA_MS=230 cargo nextest run -p simba-jdbc --test jvm_table -E 'test(mixed)' --no-capture`.
/// With `ddl` false the table keeps its six columns (simba runs without its waiter
/// columns).
async fn mixed_fleet_on_a_jvm_table(h: SqlHarness, kind: Backend, ddl: bool) {
    init_tracing();
    let mut jvm = Raw::connect(&h, kind).await;
    jvm.create_jvm_table(h.table()).await;
    jvm.insert(h.table(), "fleet", 0).await;
    drop(jvm);
    // The migration runs once before the fleet starts, as a deploy would.
    store_with_ddl(&h, ddl).await;
    assert_eq!(
        Raw::connect(&h, kind).await.waiter_columns(h.table()).await,
        if ddl { 2 } else { 0 }
    );
    let h = Arc::new(h);
    let secs = fleet_secs();
    let end = Instant::now() + Duration::from_secs(secs);
    let history = History::new();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..3 {
        tasks.spawn(jvm_contender(
            h.clone(),
            kind,
            format!("jvm-{i}"),
            history.clone(),
            end,
        ));
    }
    for i in 0..2 {
        tasks.spawn(simba_contender(
            h.clone(),
            ddl,
            format!("simba-{i}"),
            history.clone(),
            end,
        ));
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let intervals = history.intervals();
    let simba = intervals
        .iter()
        .filter(|i| i.contender.starts_with("simba-"))
        .count();
    let total = intervals.len();
    println!(
        "{kind:?}, DDL {ddl}, {secs} s: {total} ownerships, simba {simba} ({:.0} %), JVM-protocol {} ({:.0} %)",
        100.0 * simba as f64 / total.max(1) as f64,
        total - simba,
        100.0 * (total - simba) as f64 / total.max(1) as f64,
    );
    // Who followed whom, and after how long a gap (the next start after the previous end):
    // where a side loses its share shows here.
    let mut sorted = intervals.clone();
    sorted.sort_by_key(|i| i.start);
    let side = |c: &str| {
        if c.starts_with("simba-") {
            "simba"
        } else {
            "jvm"
        }
    };
    let mut pairs: std::collections::BTreeMap<String, (usize, Duration)> = Default::default();
    for w in sorted.windows(2) {
        let gap = w[0]
            .end
            .map_or(Duration::ZERO, |e| w[1].start.saturating_duration_since(e));
        let e = pairs
            .entry(format!(
                "{}->{}",
                side(&w[0].contender),
                side(&w[1].contender)
            ))
            .or_default();
        e.0 += 1;
        e.1 += gap;
    }
    for (k, (n, gap)) in &pairs {
        println!(
            "  {k}: {n}, mean gap {:?}",
            *gap / u32::try_from(*n).unwrap_or(1).max(1)
        );
    }
    let violations: Vec<Violation> = history.violations();
    assert!(violations.is_empty(), "{violations:?}");
    assert!(total >= 50, "only {total} ownerships in {secs} s");
    // Fair: 40 % for simba's two of five. Without a read of rows the JVM library owns,
    // simba got 0 of 186 here (its waiters slept until the JVM owner's lease end). The
    // bound is loose (a sixteenth): in 10 s runs on MariaDB and PostgreSQL simba got 11 %
    // to 34 % (eleven runs, at `8dfb7a1` and after it, idle and loaded), below an eighth
    // twice; the README has the 60 s figures.
    // On SQLite all contenders share one file's write lock and its busy waits, and
    // without the waiter columns every simba owner looks foreign, so simba's waiters
    // also wake on each other's releases and the JVM side gets less than an eighth (10 %
    // to 33 % measured, the crate README; 12 % in a cold run of the test command): only
    // that both sides own is checked there.
    let least = if kind == Backend::Sqlite || !ddl {
        1
    } else {
        total.div_ceil(16)
    };
    assert!(
        simba >= least && total - simba >= least,
        "simba got {simba} of {total} ownerships (at least {least} expected on each side)"
    );
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_mixed_fleet_on_a_jvm_table() {
    mixed_fleet_on_a_jvm_table(SqlHarness::sqlite(), Backend::Sqlite, true).await;
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_mixed_fleet_on_a_jvm_table_without_ddl() {
    mixed_fleet_on_a_jvm_table(SqlHarness::sqlite(), Backend::Sqlite, false).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_mixed_fleet_on_a_jvm_table() {
    mixed_fleet_on_a_jvm_table(SqlHarness::mysql().await, Backend::Mysql, true).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_mixed_fleet_on_a_jvm_table_without_ddl() {
    mixed_fleet_on_a_jvm_table(SqlHarness::mysql().await, Backend::Mysql, false).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_mixed_fleet_on_a_jvm_table() {
    mixed_fleet_on_a_jvm_table(SqlHarness::postgres().await, Backend::Postgres, true).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_mixed_fleet_on_a_jvm_table_without_ddl() {
    mixed_fleet_on_a_jvm_table(SqlHarness::postgres().await, Backend::Postgres, false).await;
}

/// A connector URL with `simba_table` and `simba_ddl=false` (what `simba exec` users
/// write): the JVM table by its name, left as it is, and a lock on it.
async fn connector_url_options_on_a_jvm_table(h: SqlHarness, kind: Backend) {
    init_tracing();
    let mut jvm = Raw::connect(&h, kind).await;
    let table = h.table();
    jvm.create_jvm_table(table).await;
    jvm.insert(table, "by-url", 5).await;
    let sep = if h.url().contains('?') { '&' } else { '?' };
    let url = format!("{}{sep}simba_table={table}&simba_ddl=false", h.url());
    let conn = simba_core::connect::Connectors::new(vec![&simba_jdbc::CONNECTOR])
        .connect(&url, &simba_core::connect::ConnectOptions::new())
        .await
        .expect("connects");
    let locker = simba_core::Locker::new(conn.factory(), "by-url").expect("locker");
    let guard = locker.acquire().await.expect("acquire");
    // The JVM's version 5, plus one: simba's fence rule for the narrow column.
    assert_eq!(guard.fence(), 6);
    assert_eq!(
        jvm.acquire(table, "by-url", "jvm-a", 5_000).await,
        None,
        "the JVM library sees simba's owner"
    );
    guard.release().await.expect("release");
    assert_eq!(
        jvm.waiter_columns(table).await,
        0,
        "simba_ddl=false added a column"
    );
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_connector_url_options_on_a_jvm_table() {
    connector_url_options_on_a_jvm_table(SqlHarness::sqlite(), Backend::Sqlite).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_connector_url_options_on_a_jvm_table() {
    connector_url_options_on_a_jvm_table(SqlHarness::mysql().await, Backend::Mysql).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connector_url_options_on_a_jvm_table() {
    connector_url_options_on_a_jvm_table(SqlHarness::postgres().await, Backend::Postgres).await;
}

/// A JVM table whose narrow `version` is at its largest value: the database refuses the
/// next fence (no wrap), and the store says which column to widen and how, as a permanent
/// error (the troubleshooting page's row).
async fn a_full_jvm_version_column_is_a_clear_permanent_error(
    h: SqlHarness,
    kind: Backend,
    max: i64,
) {
    init_tracing();
    let mut jvm = Raw::connect(&h, kind).await;
    let table = h.table();
    jvm.create_jvm_table(table).await;
    jvm.insert(table, "full", max).await;
    let store = store_with_ddl(&h, false).await;
    let e = store
        .acquire("full", "simba-a", common::LEASE)
        .await
        .expect_err("a fence past the column's largest value");
    let text = e.to_string();
    assert!(text.contains("is at its largest value"), "{text}");
    assert!(text.contains("widen it to BIGINT"), "{text}");
    assert!(!e.is_retryable(), "{e:?}");
    // Nothing was taken.
    let owner = store.owner("full").await.unwrap();
    assert!(owner.owner.owner_id.is_empty(), "{owner:?}");
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_full_jvm_version_column_is_a_clear_permanent_error() {
    // INT UNSIGNED
    a_full_jvm_version_column_is_a_clear_permanent_error(
        SqlHarness::mysql().await,
        Backend::Mysql,
        4_294_967_295,
    )
    .await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_full_jvm_version_column_is_a_clear_permanent_error() {
    // INTEGER
    a_full_jvm_version_column_is_a_clear_permanent_error(
        SqlHarness::postgres().await,
        Backend::Postgres,
        2_147_483_647,
    )
    .await;
}
