//! [`SqlStore`]: the [`LeaseStore`] over a SQL table.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use simba_core::backend::{Lease, LeaseReply, LeaseStore, PermitStore, hold_millis};
use simba_core::events::EventReceiver;
use simba_core::{Error, MutexOwner, Result, check_common_contender_id, check_common_mutex_name};
use tracing::{debug, info, warn};

use crate::call::{Call, Pass};
use crate::config::{Backend, SqlConfig, Target, redact_url};
use crate::conn::{Arg, Checked, SqlConn};
use crate::dialect::{Dialect, notify_acquired, notify_released, on_pool, with_fast};
use crate::gate::Gates;
use crate::rows::OwnerRow;
use crate::schema::{self, Shape};
use crate::sql::{Columns, FenceRule, Statements};

/// The shortest bound for a migration (DDL may wait for metadata locks).
const MIGRATE_TIMEOUT_MIN: Duration = Duration::from_secs(30);

/// Why a call failed, before it gets its context.
enum Failure {
    Connect(String, Box<dyn std::error::Error + Send + Sync>),
    Query(diesel::result::Error),
}

/// Runs `$body` (an expression using the connection `$c`) on a pooled connection of
/// whatever backend the store has. A statement that fails on a connection that had been
/// idle in the pool is retried once on a new connection, after the idle ones are dropped:
/// after a database restart every pooled connection is dead, and every call is safe to
/// repeat (acquire and release are idempotent, reads are reads).
macro_rules! on_conn {
    (@run $inner:expr, $pool:expr, |$c:ident| $body:expr) => {{
        let mut tries = 0u32;
        loop {
            tries += 1;
            let obj = match $pool.get().await {
                Ok(obj) => obj,
                Err(e) => break Err(Failure::Connect(e.to_string(), Box::new(e))),
            };
            let mut checked = Checked { obj: Some(obj), discard: $inner.discard };
            let reused = checked.reused();
            let result = match checked.conn() {
                Some($c) => $body.await,
                None => Err(diesel::result::Error::BrokenTransactionManager),
            };
            match result {
                Ok(v) => {
                    checked.keep();
                    break Ok(v);
                }
                Err(e) => {
                    drop(checked);
                    if $inner.discard && reused && tries == 1 {
                        debug!(backend = $inner.kind.name(), "statement failed on a pooled connection, retrying on a new one: {e}");
                        $pool.retain(|_, _| false);
                        continue;
                    }
                    break Err(Failure::Query(e));
                }
            }
        }
    }};
    // Renewal batches: on the renewal connections (`crate::pool::split_pool`), and on
    // SQLite with the next turn, ahead of every queued acquisition (see `Turns`).
    (@renewal $inner:expr, |$c:ident| $body:expr) => {{
        let inner: &Inner = $inner;
        let _turn = match &inner.turns {
            Some(turns) => Some(turns.turn.lock().await),
            None => None,
        };
        on_pool!(renew &inner.dialect, |p| on_conn!(@run inner, p, |$c| $body))
    }};
    ($inner:expr, |$c:ident| $body:expr) => {{
        let inner: &Inner = $inner;
        // SQLite: one call at a time per store (see `Inner::turns`).
        let _turn = match &inner.turns {
            Some(turns) => {
                let line = turns.line.lock().await;
                Some((line, turns.turn.lock().await))
            }
            None => None,
        };
        on_pool!(&inner.dialect, |p| on_conn!(@run inner, p, |$c| $body))
    }};
}

/// Runs one store call (`$body` on a connection `$c`) bounded by the statement timeout,
/// its failure described as `$what`: on PostgreSQL's prepared-statement connections when
/// the store has them (`fast`), else on a pooled connection.
macro_rules! run_fast {
    ($inner:expr, $what:expr, |$c:ident| $body:expr) => {{
        let inner: &Inner = $inner;
        let done = with_fast!(&inner.dialect, |fast| {
            let limit = inner.config.statement_timeout();
            let what = $what;
            // A handle not finished (the call failed, or was cut off halfway) retires its
            // connection: the next call opens a new one.
            inner
                .bounded(&what, limit, async {
                    let mut handle = fast
                        .handle()
                        .await
                        .map_err(|e| Failure::Connect(e.to_string(), e.into()))?;
                    let answer = {
                        let $c = &mut handle;
                        $body.await.map_err(Failure::Query)?
                    };
                    handle.finish();
                    Ok(answer)
                })
                .await
        });
        match done {
            Some(result) => result,
            None => run!(inner, $what, |$c| $body),
        }
    }};
}

/// Runs one store call (`$body` on a pooled connection `$c`) bounded by the statement
/// timeout, its failure described as `$what`.
macro_rules! run {
    ($inner:expr, $what:expr, |$c:ident| $body:expr) => {{
        let inner: &Inner = $inner;
        inner
            .bounded(&$what, inner.config.statement_timeout(), async {
                on_conn!(inner, |$c| $body)
            })
            .await
    }};
}

#[cfg(feature = "bench")]
mod acquisition_floor;
pub(crate) mod permits;
mod renew;

pub use permits::{PERMIT_POLL, create_permits_table_sql};
pub use renew::RenewalCounts;

struct Inner {
    kind: Backend,
    config: SqlConfig,
    /// The pool, and what else the store's database needs.
    dialect: Dialect,
    /// What the first successful migration learned of the table ([`Table`]).
    table: OnceLock<Table>,
    /// Simba's own table, until a migration has looked at it.
    default_table: Table,
    /// Mutexes whose row a watcher reads while a foreign owner holds it
    /// ([`watch_foreign`]).
    foreign: std::sync::Mutex<std::collections::HashSet<String>>,
    /// The native wait queues of this store's mutexes.
    gates: Arc<Gates>,
    /// Close connections whose call failed or was cut off (not SQLite: its calls run to
    /// completion on the connection's thread, and an in-memory database lives in its connection).
    discard: bool,
    /// Renewals waiting for their batch ([`renew`]).
    renewals: renew::Renewals,
    /// SQLite file databases: the store's calls take turns. SQLite has one writer at a
    /// time; connections of one process that write at once do not queue for it but fail
    /// with "busy" and retry after sleeps of 1 to 100 ms (its busy handler), so hundreds
    /// of concurrent acquisitions spent most of their time asleep. In turn, each call
    /// finds the write lock free (unless another process holds it: then the busy
    /// handler waits). A renewal batch takes the next turn, ahead of the queued calls
    /// ([`Turns`]). `None` elsewhere.
    turns: Option<Turns>,
    /// Semaphores: the statements of the permits table and this store's waiters.
    permits: permits::Permits,
}

/// What a store knows of its table: the statements for its columns and fence rule, and
/// its bounds. Chosen once, when the table is known (the first successful
/// [`SqlStore::migrate`]); until then, simba's own table with 64-bit fences.
#[derive(Debug)]
struct Table {
    /// The statements for the table's columns ([`Columns`]) and fence rule ([`FenceRule`]).
    st: Statements,
    /// Whether the server runs an acquisition in one statement (MariaDB ≥ 10.5, and
    /// [`SqlConfig::with_one_statement_acquire`]).
    one_statement: bool,
    /// The largest value of the `version` column when it is narrower than 64 bits (then
    /// fences are `version + 1`), else `i64::MAX`.
    fence_max: i64,
    /// The longest contender id the `owner_id` column holds (with a hold's prefix).
    max_contender: usize,
    /// The width of the `mutex` column (names are also bounded by
    /// `SqlConfig::max_name_len`).
    max_name: usize,
}

impl Table {
    /// The table of `shape`, with or without simba's waiter columns.
    fn new(kind: Backend, name: &str, shape: &Shape, waiter_columns: bool, one: bool) -> Table {
        let fence_max = shape.fence_max.unwrap_or(i64::MAX);
        let rule = if fence_max < i64::MAX {
            FenceRule::Counter
        } else {
            FenceRule::Clock
        };
        let columns = if waiter_columns {
            Columns::All
        } else {
            Columns::Lease
        };
        Table {
            st: Statements::new(kind, name, rule, columns),
            one_statement: one,
            fence_max,
            max_contender: shape.max_contender_len(),
            max_name: shape.name_len,
        }
    }

    /// Whether fences are `version + 1` (a narrow `version` column).
    fn counter_fence(&self) -> bool {
        self.fence_max < i64::MAX
    }

    /// Whether `other` runs other statements or bounds than this one.
    fn differs(&self, other: &Table) -> bool {
        (self.st.waiter_columns, self.one_statement, self.fence_max)
            != (
                other.st.waiter_columns,
                other.one_statement,
                other.fence_max,
            )
            || (self.max_contender, self.max_name) != (other.max_contender, other.max_name)
    }
}

/// SQLite's turns: calls queue in `line` (first come first) and then take `turn`; a
/// renewal batch takes `turn` only, so it waits for at most the call running and the one
/// call that has left the line, never behind the thousands queued there (10,000
/// acquisitions at once must not make every renewal late).
#[derive(Default)]
struct Turns {
    line: tokio::sync::Mutex<()>,
    turn: tokio::sync::Mutex<()>,
}

impl Inner {
    /// Bounds `work` by the statement timeout and gives its failure a context.
    async fn bounded<T>(
        &self,
        what: &str,
        limit: Duration,
        work: impl Future<Output = std::result::Result<T, Failure>>,
    ) -> Result<T> {
        let backend = self.kind.name();
        match tokio::time::timeout(limit, work).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(Failure::Connect(msg, source))) => {
                // A TLS problem is permanent, and says what to fix (each dialect finds it
                // its own way: see `Dialect::tls_failure`).
                if let Some((message, tls)) = self.dialect.tls_failure(&msg) {
                    return Err(Error::backend_source(
                        backend,
                        format!(
                            "{what}: cannot get a connection to {}: {message}",
                            self.config.redacted_url()
                        ),
                        false,
                        tls,
                    ));
                }
                Err(Error::Backend {
                    backend,
                    message: format!(
                        "{what}: cannot get a connection to {}: {msg}",
                        self.config.redacted_url()
                    ),
                    retryable: true,
                    source: Some(source),
                })
            }
            Ok(Err(Failure::Query(e))) => Err(self.query_error(what, e)),
            Err(_) => Err(Error::backend(
                backend,
                if self.discard {
                    format!(
                        "{what}: no answer within {limit:?} (statement timeout); its connection \
                         was closed"
                    )
                } else {
                    format!("{what}: no answer within {limit:?} (statement timeout)")
                },
            )),
        }
    }

    fn query_error(&self, what: &str, e: diesel::result::Error) -> Error {
        let text = e.to_string();
        let lower = text.to_ascii_lowercase();
        let missing_table = lower.contains("no such table")
            || (lower.contains("does not exist") && lower.contains("relation"))
            || (lower.contains("doesn't exist") && lower.contains("table"));
        let missing_column = lower.contains("no such column")
            || lower.contains("unknown column")
            || (lower.contains("column") && lower.contains("does not exist"));
        let fence_full = self.table().counter_fence() && schema::fence_exhausted(&text);
        let permanent = missing_table || missing_column || fence_full || lower.contains("syntax");
        let hint = if fence_full {
            format!(
                "; the `version` column of {} (the fence, narrower than 64 bits in a JVM Simba \
                 table) is at its largest value: the database refuses `version + 1` rather \
                 than let a fence wrap; widen it to BIGINT (MySQL: ALTER TABLE … MODIFY \
                 version BIGINT UNSIGNED NOT NULL; PostgreSQL: ALTER TABLE … ALTER COLUMN \
                 version TYPE BIGINT)",
                self.config.table()
            )
        } else if missing_table {
            format!(
                "; the table {} is missing: call SqlStore::migrate() or create it with the SQL \
                 in the simba-jdbc README",
                self.config.table()
            )
        } else if missing_column {
            format!(
                "; the table {} lacks a column this version of simba-jdbc uses (made by an \
                 older version?): compare it with create_table_sql() and add the column, or \
                 drop the table while no contender runs and let migrate() create it",
                self.config.table()
            )
        } else {
            String::new()
        };
        Error::backend_source(
            self.kind.name(),
            format!("{what}: {text}{hint}"),
            !permanent,
            e,
        )
    }

    /// Whether a `simba exec` job of `mutex`'s owner runs (SQLite on Linux: its job byte
    /// is held); `false` elsewhere.
    fn job_runs(&self, mutex: &str) -> Result<bool> {
        #[cfg(feature = "sqlite")]
        return Ok(self.check_db_file(false, Some(mutex))?.is_some());
        #[cfg(not(feature = "sqlite"))]
        {
            let _ = mutex;
            Ok(false)
        }
    }

    /// SQLite: refuses a database file that has more than one name, or is missing unless
    /// `missing_ok` (see `crate::sqlite::Refused`), with a configuration error that says
    /// why and how to fix it. Any other failure to open it is left to the native lock,
    /// whose failure makes the acquisition lease-bound.
    ///
    /// With a mutex, also whether a job of its owner runs (`simba exec`'s command holds the
    /// mutex's job byte, see `crate::sqlite::DbFile::check_job`): `Some` of the mark of the
    /// rows that owner gated, which no contender may then take, not even by lease.
    #[cfg(feature = "sqlite")]
    fn check_db_file(&self, missing_ok: bool, mutex: Option<&str>) -> Result<Option<i64>> {
        use crate::sqlite::Refused;
        match self.gates.check_db_file(mutex) {
            Ok(job) => Ok(job),
            Err(Refused::Missing { .. }) if missing_ok => Ok(None),
            Err(e @ (Refused::HardLinked { .. } | Refused::Missing { .. })) => {
                Err(Error::config("url", e.to_string()))
            }
            Err(e @ (Refused::Io { .. } | Refused::Deleted)) => {
                debug!("cannot check the SQLite database file: {e}");
                Ok(None)
            }
        }
    }

    /// Checks the inputs of a call on `mutex` (by `contender`, if any) before any SQL runs.
    fn start<'a>(&'a self, mutex: &'a str, contender: Option<&str>) -> Result<Call<'a>> {
        self.check_name(mutex)?;
        if let Some(c) = contender {
            self.check_contender(c)?;
        }
        Ok(self.call(mutex))
    }

    fn call<'a>(&'a self, mutex: &'a str) -> Call<'a> {
        let table = self.table();
        Call {
            st: &table.st,
            mutex,
            one: table
                .st
                .one_statement
                .as_ref()
                .filter(|_| table.one_statement),
        }
    }

    fn check_name(&self, mutex: &str) -> Result<()> {
        check_common_mutex_name(mutex)?;
        let chars = mutex.chars().count();
        let max = self.config.max_name_len().min(self.table().max_name);
        if chars > max {
            let short: String = mutex.chars().take(64).collect();
            return Err(Error::InvalidName {
                name: if chars > 64 {
                    format!("{short}…")
                } else {
                    short
                },
                reason: format!(
                    "{chars} characters is longer than the `mutex` column of table {} allows \
                     ({max}); use a shorter name, or widen the column and raise \
                     SqlConfig::with_max_name_len",
                    self.config.table()
                ),
            });
        }
        Ok(())
    }

    fn check_contender(&self, contender: &str) -> Result<()> {
        check_common_contender_id(contender)?;
        let max = self.table().max_contender;
        if contender.chars().count() > max {
            return Err(Error::InvalidContenderId {
                id: contender.chars().take(64).collect(),
                reason: format!(
                    "longer than {max} characters, what the `owner_id` column of {} holds \
                     with the `held@@` prefix of a hold (contender ids are generated \
                     shorter; give a shorter one, or widen the column)",
                    self.config.table()
                ),
            });
        }
        Ok(())
    }

    /// What the store knows of its table (see [`Table`]).
    fn table(&self) -> &Table {
        self.table.get().unwrap_or(&self.default_table)
    }

    /// The reply from the row ([`owner_reply`] for this store's backend).
    fn reply(&self, row: Option<OwnerRow>, grace: Option<i64>) -> Result<LeaseReply> {
        owner_reply(self.kind, row, grace)
    }
}

/// The reply from the row. `grace` is given to a contender that may not take a free
/// row yet (it has not got the native lock): a row released less than `grace` ms ago
/// is, to it, held by nobody (empty id) until then, so that the engine looks again
/// when the grace ends if no push came before.
pub(crate) fn owner_reply(
    kind: Backend,
    row: Option<OwnerRow>,
    grace: Option<i64>,
) -> Result<LeaseReply> {
    let backend = kind.name();
    let Some(row) = row else {
        return Err(Error::backend(
            backend,
            "the owner query returned no row (it always returns one)",
        ));
    };
    let now = row.now_ms;
    let transition_at = row.transition_at.unwrap_or(0);
    // A `CHAR(n)` column (a JVM Simba table) comes back padded with spaces on
    // PostgreSQL; contender ids hold no whitespace, so trailing spaces are padding.
    let owner_id = row.owner_id.map(|mut id| {
        id.truncate(id.trim_end_matches(' ').len());
        id
    });
    let owner = match owner_id {
        Some(owner_id) if !owner_id.is_empty() => {
            if transition_at > now {
                let version = row.version.unwrap_or(0);
                let fence = u64::try_from(version).map_err(|_| {
                    Error::backend(
                        backend,
                        format!("the version (fence) of the row is negative: {version}"),
                    )
                })?;
                MutexOwner {
                    owner_id,
                    acquired_at: row.acquired_at.unwrap_or(0),
                    ttl_at: row.ttl_at.unwrap_or(0),
                    transition_at,
                    fence,
                }
            } else {
                // An ownership past its lease is no ownership.
                MutexOwner::NONE
            }
        }
        Some(_) => match grace {
            Some(grace) if transition_at.saturating_add(grace) > now => {
                let until = transition_at.saturating_add(grace);
                MutexOwner {
                    owner_id: String::new(),
                    acquired_at: 0,
                    ttl_at: until,
                    transition_at: until,
                    fence: 0,
                }
            }
            _ => MutexOwner::NONE,
        },
        None => MutexOwner::NONE,
    };
    Ok(LeaseReply { owner, now })
}

/// A lease store over one SQL table, for the core lease engine
/// ([`simba_core::LeaseServiceFactory`]).
///
/// Cloning is cheap and shares the connection pool (and, on PostgreSQL, the LISTEN
/// connection). Every decision is taken by one conditional `UPDATE` evaluated on the
/// database's clock; see the crate documentation for the SQL.
#[derive(Clone)]
pub struct SqlStore {
    inner: Arc<Inner>,
}

impl fmt::Debug for SqlStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlStore")
            .field("backend", &self.inner.kind)
            .field("url", &redact_url(self.inner.config.url()))
            .field("table", &self.inner.config.table())
            .finish_non_exhaustive()
    }
}

impl SqlStore {
    /// Connects to the database of `config`: checks the config, builds the pool and opens
    /// one connection to prove the database answers. Does not create the table: see
    /// [`SqlStore::migrate`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a bad config (see [`SqlConfig::validate`]), and for a
    /// SQLite database file with more than one name (hard links);
    /// [`Error::Backend`] if the database cannot be reached within the statement timeout
    /// or refuses the connection.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-built store and its connections.
    pub async fn connect(config: SqlConfig) -> Result<SqlStore> {
        let store = SqlStore::connect_lazy(config)?;
        let inner = &*store.inner;
        // SQLite: a hard-linked database is refused before SQLite opens it.
        #[cfg(feature = "sqlite")]
        inner.check_db_file(true, None)?;
        run!(inner, "connect", |c| c.batch("SELECT 1"))?;
        Ok(store)
    }

    /// Like [`SqlStore::connect`] but without any I/O: connections are opened by the first
    /// calls. Useful when the database may be down while the process starts.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a bad config (see [`SqlConfig::validate`]).
    pub fn connect_lazy(config: SqlConfig) -> Result<SqlStore> {
        let target = config.target()?;
        let kind = target.backend();
        let default_table = Table::new(kind, config.table(), &Shape::default(), true, false);
        let channel = channel_name(config.table());
        let dialect = Dialect::new(&target, &config, &channel)?;
        let gates = Arc::new(Gates::new(
            dialect.gate_kind(),
            lock_scope(&target, config.table()),
            config.statement_timeout(),
        ));
        // A release heard by push pokes the mutex's gate (a wait beyond the cap on native
        // waits polls otherwise). Weak: the listener lives in the store it would keep.
        let weak = Arc::downgrade(&gates);
        dialect.on_release(Box::new(move |mutex| {
            if let Some(gates) = weak.upgrade() {
                gates.poke(mutex);
            }
        }));
        Ok(SqlStore {
            inner: Arc::new(Inner {
                kind,
                discard: kind != Backend::Sqlite,
                renewals: renew::Renewals::new(kind, config.pool_size()),
                turns: (kind == Backend::Sqlite).then(Turns::default),
                permits: permits::Permits::new(kind, config.table()),
                gates,
                config,
                dialect,
                table: OnceLock::new(),
                default_table,
                foreign: std::sync::Mutex::new(std::collections::HashSet::new()),
            }),
        })
    }

    /// Creates the table if it does not exist (`CREATE TABLE IF NOT EXISTS`, see
    /// [`create_table_sql`](crate::create_table_sql)) and the semaphores' table beside it
    /// ([`create_permits_table_sql`](crate::create_permits_table_sql)), adds simba's two waiter columns to
    /// a table that lacks them (a table made by the JVM Simba library: see the crate
    /// README's migration guide), learns the widths of `owner_id` and `version`, and checks
    /// that the table has every column the store uses. Idempotent, and safe to run from
    /// many processes at once (PostgreSQL serialises it with an advisory lock; elsewhere a
    /// column another process added first is found on a second look). With
    /// [`SqlConfig::with_ddl`]`(false)` it changes nothing and only checks.
    ///
    /// A table whose `version` is narrower than 64 bits (JVM Simba's `INT UNSIGNED`) gets
    /// fences `version + 1`; one whose `owner_id` is narrower than 200 characters lowers
    /// the longest contender id accepted to its width less 6 (the `held@@` prefix).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a SQLite database file with more than one name (hard
    /// links). [`Error::Backend`] if the database fails, denies the DDL, or the table lacks a
    /// column (and may not or cannot get it). Bounded by the statement timeout, but at
    /// least 30 s.
    ///
    /// # Cancel safety
    /// Dropping the future may leave the table created or a column added, or not; running
    /// it again is fine.
    pub async fn migrate(&self) -> Result<()> {
        let inner = &*self.inner;
        let limit = inner.config.statement_timeout().max(MIGRATE_TIMEOUT_MIN);
        let ddl = inner.config.ddl();
        // SQLite: a hard-linked database is refused before SQLite opens it (a database
        // not made yet is made by the DDL, and checked after it).
        #[cfg(feature = "sqlite")]
        inner.check_db_file(true, None)?;
        let (describe, describe_args) = schema::describe(inner.kind, inner.config.table());
        let columns = || async {
            inner
                .bounded::<Vec<schema::ColumnRow>>("migrate", limit, async {
                    on_conn!(inner, |c| async {
                        let args: Vec<Arg<'_>> =
                            describe_args.iter().map(|a| Arg::Text(a)).collect();
                        c.load_columns(&describe, &args).await
                    })
                })
                .await
        };
        if ddl {
            let st = &inner.default_table.st;
            inner
                .bounded::<()>("migrate", limit, async {
                    on_conn!(inner, |c| c.batch(&st.migrate))
                })
                .await?;
        }
        // SQLite: the database file exists now; one with several names is refused.
        #[cfg(feature = "sqlite")]
        inner.check_db_file(false, None)?;
        let mut found = schema::inspect(inner.kind, &columns().await?);
        if ddl && found.missing_lease.is_empty() && !found.missing_waiter.is_empty() {
            let quoted = crate::sql::quote_table(inner.kind, inner.config.table());
            for statement in schema::add_columns(inner.kind, &quoted, &found.missing_waiter) {
                info!(
                    backend = inner.kind.name(),
                    table = inner.config.table(),
                    "adding a column simba uses: {statement}"
                );
                let added = inner
                    .bounded::<()>("migrate", limit, async {
                        on_conn!(inner, |c| c.batch(&statement))
                    })
                    .await;
                let fallback = schema::alter_fallback(&statement);
                if let (Err(e), Some(fallback)) = (&added, fallback) {
                    debug!("{e}; trying {fallback}");
                    let _ = inner
                        .bounded::<()>("migrate", limit, async {
                            on_conn!(inner, |c| c.batch(&fallback))
                        })
                        .await;
                } else if let Err(e) = added {
                    // Another process may have added it first: the second look decides.
                    debug!("{e}");
                }
            }
            found = schema::inspect(inner.kind, &columns().await?);
        }
        let quoted = crate::sql::quote_table(inner.kind, inner.config.table());
        if !found.missing_lease.is_empty()
            && found.missing_lease.len() < schema::LEASE_COLUMNS.len()
        {
            return Err(permanent(
                inner.kind.name(),
                format!(
                    "migrate: the table {} lacks the column(s) {}: it is neither simba's nor \
                     the JVM Simba library's; compare it with create_table_sql()",
                    inner.config.table(),
                    found.missing_lease.join(", ")
                ),
            ));
        }
        let lease_only = found.missing_lease.is_empty() && !found.missing_waiter.is_empty();
        if lease_only {
            let statements = schema::add_columns(inner.kind, &quoted, &found.missing_waiter);
            if ddl {
                return Err(permanent(
                    inner.kind.name(),
                    format!(
                        "migrate: the table {} lacks the waiter column(s) {} and adding them \
                         failed (see the log); add them (online, and the JVM Simba library's \
                         statements keep working): {}; or run without them with \
                         SqlConfig::with_ddl(false), in a connector URL (simba exec) \
                         `simba_ddl=false` (see the crate README, migration guide)",
                        inner.config.table(),
                        found.missing_waiter.join(", "),
                        statements.join("; ")
                    ),
                ));
            }
            warn!(
                backend = inner.kind.name(),
                table = inner.config.table(),
                "the table lacks simba's waiter column(s) {} and DDL is off: running without \
                 them. Every owner outside this process looks foreign, so waiters read the \
                 row every {:?} while another process owns it{}. To add them: {}",
                found.missing_waiter.join(", "),
                inner.config.foreign_poll(),
                if inner.kind == Backend::Sqlite {
                    ", and the row of an owner whose process died is taken at its lease end"
                } else {
                    ""
                },
                statements.join("; ")
            );
        }
        let mut one = false;
        if inner.kind == Backend::Mysql && inner.config.one_statement_acquire() {
            let version = inner
                .bounded::<Vec<crate::rows::TextRow>>("migrate", limit, async {
                    on_conn!(inner, |c| c.load_text("SELECT VERSION() AS value"))
                })
                .await?;
            let version = version.first().map_or("", |r| r.value.as_str());
            one = returning_acquire(version);
            debug!(
                version,
                one_statement = one,
                "MySQL / MariaDB: an acquisition in one statement where the server is MariaDB ≥ 10.5"
            );
        }
        let table = Table::new(
            inner.kind,
            inner.config.table(),
            &found.shape,
            !lease_only,
            one,
        );
        if found.shape != Shape::default() {
            info!(
                backend = inner.kind.name(),
                table = inner.config.table(),
                fence_max = ?found.shape.fence_max,
                owner_len = found.shape.owner_len,
                name_len = found.shape.name_len,
                "a narrow table (JVM Simba's?): fences are version + 1 and contender ids at \
                 most {} characters",
                found.shape.max_contender_len()
            );
        }
        inner
            .bounded::<()>("migrate", limit, async {
                on_conn!(inner, |c| c.batch(&table.st.check))
            })
            .await?;
        if let Err(found) = inner.table.set(table)
            && inner.table().differs(&found)
        {
            warn!(
                backend = inner.kind.name(),
                table = inner.config.table(),
                "the table changed since this store's first migration: the store keeps \
                 running the statements it chose then ({:?}); a new store (a restart) uses \
                 the table as it is now ({:?})",
                inner.table(),
                found
            );
        }
        self.permit_ops().migrate(limit, ddl).await
    }

    fn permit_ops(&self) -> permits::Ops<'_> {
        permits::Ops { inner: &self.inner }
    }

    /// The dialect's part of the store (its pool, and on PostgreSQL its connector).
    pub(crate) fn dialect(&self) -> &Dialect {
        &self.inner.dialect
    }

    /// The native lock `contender_id` holds for `mutex` (SQLite), to share with another
    /// process, see `simba_core::connect::Connection::owner_anchor`.
    #[cfg(all(unix, feature = "sqlite"))]
    pub(crate) fn anchor(
        &self,
        mutex: &str,
        contender_id: &str,
    ) -> Option<simba_core::connect::Anchor> {
        self.inner.gates.anchor(mutex, contender_id)
    }

    /// How many renewals this store answered, and in how many batched statements: with
    /// many ownerships renewed at once, far fewer batches than calls.
    pub fn renewal_counts(&self) -> RenewalCounts {
        self.inner.renewals.counts()
    }

    /// Whether this store's acquisitions are one statement (MariaDB ≥ 10.5, learnt by
    /// [`SqlStore::migrate`]; see [`SqlConfig::with_one_statement_acquire`]). PostgreSQL's
    /// always are (`UPDATE … RETURNING` joined with the row), SQLite's run on the
    /// connection's thread in one hop; this tells only MariaDB from MySQL.
    pub fn one_statement_acquire(&self) -> bool {
        self.inner.table().one_statement
    }

    /// The backend this store talks to.
    pub fn kind(&self) -> Backend {
        self.inner.kind
    }

    /// The config the store was made with.
    pub fn config(&self) -> &SqlConfig {
        &self.inner.config
    }

    /// The time on the database's clock, in milliseconds since the Unix epoch.
    ///
    /// # Errors
    /// [`Error::Backend`] if the database fails or does not answer within the statement
    /// timeout.
    ///
    /// # Cancel safety
    /// Cancel safe (a read).
    pub async fn now_ms(&self) -> Result<i64> {
        // The owner query of any valid name returns the time even when the table is empty;
        // it needs the table, as every call does.
        Ok(self.owner("simba-clock-probe").await?.now)
    }
}

/// The namespace of a store's lock keys: its database and table. MySQL's user locks are
/// server-wide, PostgreSQL's advisory locks per database; the path part of the URL names
/// the database (lock files live beside the SQLite file anyway).
fn lock_scope(target: &Target, table: &str) -> String {
    let database = match target {
        Target::Postgres(url) | Target::Mysql(url) => {
            let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
            let path = rest.split_once('/').map_or("", |(_, p)| p);
            path.split(['?', '#']).next().unwrap_or("").to_owned()
        }
        Target::Sqlite { .. } => String::new(),
    };
    format!("{database}\n{table}")
}

/// Whether a MySQL-protocol server of this `VERSION()` runs `INSERT … RETURNING`: MariaDB
/// 10.5 and later (`10.11.6-MariaDB-0+deb12u1`, `11.4.2-MariaDB`). MySQL has no
/// `RETURNING`; an unknown form runs the two statements every server runs.
fn returning_acquire(version: &str) -> bool {
    if !version.contains("MariaDB") {
        return false;
    }
    let mut parts = version.split(['.', '-']).map(str::parse::<u32>);
    match (parts.next(), parts.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => (major, minor) >= (10, 5),
        _ => false,
    }
}

/// The id of the row's owner if it took the row outside simba (its id is not the one simba
/// writes beside its own ownerships, `waiter_id`), and is not a hold.
fn foreign_owner(row: &OwnerRow) -> Option<String> {
    let owner = row.owner_id.as_deref()?.trim_end_matches(' ');
    let marked = row.waiter_id.as_deref().map(|w| w.trim_end_matches(' '));
    (!owner.is_empty() && !owner.starts_with(simba_core::HELD_PREFIX) && marked != Some(owner))
        .then(|| owner.to_owned())
}

/// Reads `mutex`'s row every [`SqlConfig::foreign_poll`] while `owner` (a foreign owner) holds it and
/// a local contender waits, and wakes one waiter once `owner` no longer owns it (the one
/// holding the native lock, else the first queued, which may take a row the JVM library
/// released without the lock: such a release leaves `transition_at = 0`, past any grace).
/// One watcher per mutex and store; it ends with the foreign ownership, when nobody here
/// waits any more, or with the store.
fn watch_foreign(inner: &Arc<Inner>, mutex: &str, owner: String) {
    {
        let mut watched = inner.foreign.lock().unwrap_or_else(|p| p.into_inner());
        if !watched.insert(mutex.to_owned()) {
            return;
        }
    }
    debug!(
        mutex,
        owner, "an owner outside simba's queue: reading its row until it goes"
    );
    let weak = Arc::downgrade(inner);
    let mutex = mutex.to_owned();
    tokio::spawn(async move {
        loop {
            let Some(every) = weak.upgrade().map(|i| i.config.foreign_poll()) else {
                return;
            };
            tokio::time::sleep(every).await;
            let Some(inner) = weak.upgrade() else {
                return;
            };
            if !inner.gates.waiting(&mutex) {
                break;
            }
            let call = inner.call(&mutex);
            let read = run!(&inner, format!("read owner of mutex {mutex:?}"), |c| call
                .select(c));
            let gone = match read.and_then(|row| inner.reply(row, None)) {
                Ok(r) => r.owner.owner_id != owner,
                // Try again at the next tick (the waiter's own schedule still runs).
                Err(_) => false,
            };
            if gone {
                // The waiter here, and a wait beyond the native-wait cap (which then
                // tries the lock now rather than at its next poll).
                inner.gates.wake_one(&mutex);
                inner.gates.poke(&mutex);
                break;
            }
        }
        if let Some(inner) = weak.upgrade() {
            inner
                .foreign
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&mutex);
        }
    });
}

/// A backend error that retrying does not heal.
fn permanent(backend: &'static str, message: String) -> Error {
    Error::Backend {
        backend,
        message,
        retryable: false,
        source: None,
    }
}

/// How long a contender waits before it looks again at a row that a running job keeps
/// past its owner's lease (at most; the lease's ttl when shorter). The job's end frees
/// the native lock too, which wakes a queued contender at once: this is the fallback.
const JOB_LOOK_MS: i64 = 1_000;

/// Whether `row` is the row of an owner other than `me` whose lease has run out: a row
/// that a running job of that owner may keep (SQLite, `Statements::file_marks`).
fn past_lease_of_another(row: &OwnerRow, me: &str) -> bool {
    row.owner_id
        .as_deref()
        .is_some_and(|o| !o.is_empty() && o != me)
        && row.transition_at.is_some_and(|t| t <= row.now_ms)
}

/// SQLite: such a row ([`past_lease_of_another`]), read while the owner's job runs (the
/// acquire statements left it), is shown as that owner's for `look_ms` more, not as
/// free: a contender then waits instead of trying again at once, and observers (`simba
/// owner`, `watch`) name who keeps it.
fn keep_for_job(row: &mut Option<OwnerRow>, me: &str, look_ms: i64) {
    if let Some(r) = row.as_mut().filter(|r| past_lease_of_another(r, me)) {
        let until = r.now_ms.saturating_add(look_ms.max(1));
        r.ttl_at = Some(until);
        r.transition_at = Some(until);
    }
}

fn channel_name(table: &str) -> String {
    format!("simba:{table}")
}

impl LeaseStore for SqlStore {
    fn backend(&self) -> &'static str {
        self.inner.kind.name()
    }

    /// At most [`SqlConfig::with_max_name_len`] characters (the `mutex` column).
    fn check_mutex_name(&self, mutex: &str) -> Result<()> {
        self.inner.check_name(mutex)
    }

    /// At most [`OWNER_COLUMN_LEN`](crate::OWNER_COLUMN_LEN) characters (the `owner_id` column), or
    /// the width of a narrower one less 6 (a JVM Simba table; see [`SqlStore::migrate`]).
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        self.inner.check_contender(contender_id)
    }

    /// # Cancel safety
    /// Dropping the future may leave the acquisition applied or not (the connection is then
    /// closed); acquiring again is idempotent for the same contender.
    async fn acquire(&self, mutex: &str, contender_id: &str, lease: Lease) -> Result<LeaseReply> {
        // Boxed: the statement futures of three dialects take about 4.5 KB, and a
        // contender's driver future would hold that much for its whole life (10,000
        // contenders: 45 MB); boxed, only calls in flight use it.
        Box::pin(async move {
            let inner = &*self.inner;
            let call = inner.start(mutex, Some(contender_id))?;
            #[cfg(feature = "sqlite")]
            let job = inner.check_db_file(false, Some(mutex))?;
            #[cfg(not(feature = "sqlite"))]
            let job: Option<i64> = None;
            let pass = inner.gates.enter(mutex, contender_id).await;
            #[cfg(feature = "bench")]
            simba_core::hops::record(simba_core::hops::Hop::StatementSent, mutex);
            let mut row: Option<OwnerRow> = run_fast!(
                inner,
                format!("acquire mutex {mutex:?}"),
                |c| call.acquire(c, contender_id, lease, pass, job)
            )?;
            #[cfg(feature = "bench")]
            simba_core::hops::record(simba_core::hops::Hop::StatementAnswered, mutex);
            if job.is_some() {
                keep_for_job(&mut row, contender_id, JOB_LOOK_MS.min(lease.ttl_ms()));
            }
            let grace = match pass {
                Pass::Locked(_) => None,
                Pass::Unlocked => Some(lease.ttl_ms().saturating_add(lease.transition_ms())),
            };
            let foreign = row.as_ref().and_then(foreign_owner);
            let reply = inner.reply(row, grace)?;
            let owns = reply.owner.is_owned_by_at(contender_id, reply.now);
            // Until the whole lease from the answer (see `Gates::outcome`).
            let answered = tokio::time::Instant::now();
            let new = inner
                .gates
                .outcome(mutex, contender_id, owns, answered + lease.total());
            if new {
                // Observers hear of a new owner (not of an owner's acquire that renews).
                inner
                    .dialect
                    .notify(|| notify_acquired(mutex, contender_id));
            }
            if let Some(foreign) = foreign
                && !owns
                && reply.owner.owner_id == foreign
            {
                watch_foreign(&self.inner, mutex, foreign);
            }
            // SQLite stores any integer whatever the declared type: a narrow `version` is
            // checked here (MySQL and PostgreSQL refuse the write themselves).
            let max = inner.table().fence_max;
            if owns && i64::try_from(reply.owner.fence).unwrap_or(i64::MAX) > max {
                let _ = self.release(mutex, contender_id).await;
                return Err(permanent(
                    inner.kind.name(),
                    format!(
                        "acquire mutex {mutex:?}: the fence {} is past the largest value of \
                         the `version` column of {} ({max}); widen the column",
                        reply.owner.fence,
                        inner.config.table()
                    ),
                ));
            }
            Ok(reply)
        })
        .await
    }

    /// Renews only: never takes a mutex that `contender_id` does not own within its lease.
    /// Concurrent renewals of this store share statements: one `UPDATE` renews every
    /// ownership whose call waits, and each call gets its own row's answer (see the crate
    /// README, *Renewals in batches*).
    ///
    /// # Cancel safety
    /// Dropping the future may leave the renewal applied or not; a renewal changes nothing
    /// but the lease of a row the contender owns.
    async fn guard(&self, mutex: &str, contender_id: &str, lease: Lease) -> Result<LeaseReply> {
        self.inner.start(mutex, Some(contender_id))?;
        renew::Renewals::renew(&self.inner, mutex, contender_id, lease).await
    }

    async fn release(&self, mutex: &str, contender_id: &str) -> Result<bool> {
        // Boxed, as `acquire`.
        Box::pin(async move {
            let inner = &*self.inner;
            let call = inner.start(mutex, Some(contender_id))?;
            let released = run_fast!(inner, format!("release mutex {mutex:?}"), |c| call
                .release(c, contender_id));
            if matches!(released, Ok(true)) {
                inner
                    .dialect
                    .notify(|| notify_released(mutex, contender_id));
            }
            // The row first, then the native lock: the waiter it wakes finds the row free.
            // On failure too: the engine releases only what it no longer believes it owns.
            inner.gates.done(mutex, contender_id, false).await;
            released
        })
        .await
    }

    /// One conditional UPDATE on the database clock (see [`LeaseStore::release_after`]).
    async fn release_after(&self, mutex: &str, contender_id: &str, hold: Duration) -> Result<bool> {
        // Boxed, as `acquire`.
        Box::pin(async move {
            let inner = &*self.inner;
            let call = inner.start(mutex, Some(contender_id))?;
            let ms = hold_millis(hold)?;
            if ms == 0 {
                return self.release(mutex, contender_id).await;
            }
            let held = run!(inner, format!("release mutex {mutex:?} with a hold"), |c| {
                call.release_after(c, contender_id, ms)
            });
            // Observers hear of the hold as of a new owner (the hold's id).
            if matches!(held, Ok(true)) {
                inner.dialect.notify(|| {
                    notify_acquired(mutex, &simba_core::backend::held_owner_id(contender_id))
                });
            }
            // The next waiter gets the native lock, finds the row held, and waits for the
            // hold's end on the lease clock.
            inner.gates.done(mutex, contender_id, false).await;
            held
        })
        .await
    }

    async fn owner(&self, mutex: &str) -> Result<LeaseReply> {
        // Boxed, as `acquire`.
        Box::pin(async move {
            let inner = &*self.inner;
            let call = inner.start(mutex, None)?;
            let mut row: Option<OwnerRow> =
                run!(inner, format!("read owner of mutex {mutex:?}"), |c| call
                    .select(c))?;
            // SQLite: an owner whose lease ran out while its `simba exec` job still runs
            // keeps the mutex (nobody may take it): shown as the owner, not as free. The
            // job byte is probed only for such a row.
            if row.as_ref().is_some_and(|r| past_lease_of_another(r, ""))
                && inner.job_runs(mutex)?
            {
                keep_for_job(&mut row, "", JOB_LOOK_MS);
            }
            inner.reply(row, None)
        })
        .await
    }

    /// Takes the contender out of the mutex's wait queue: its place in the local queue,
    /// and the native lock if it had been handed to it.
    async fn leave(&self, mutex: &str, contender_id: &str) -> Result<()> {
        let inner = &*self.inner;
        inner.start(mutex, Some(contender_id))?;
        inner.gates.done(mutex, contender_id, true).await;
        Ok(())
    }

    /// Every backend pushes to contenders: a contender that waits is woken with
    /// [`StoreEvent::Released`](simba_core::backend::StoreEvent::Released) when the database (or, on SQLite, the kernel) hands its
    /// process the mutex's native lock, and gets [`StoreEvent::Resync`](simba_core::backend::StoreEvent::Resync) when waiting
    /// failed (a lost session). On PostgreSQL a subscriber that does not contend (an
    /// observer) hears every change by LISTEN/NOTIFY; on MySQL and SQLite an observer gets
    /// `None` (the engine reads on its schedule). A contender is one that called
    /// [`LeaseStore::acquire`] on this store and has not released or left since.
    async fn subscribe(&self, mutex: &str, contender_id: &str) -> Result<Option<EventReceiver>> {
        self.inner.check_name(mutex)?;
        let observers_hear = self.dialect().observers_hear();
        if !observers_hear && !self.inner.gates.contends(mutex, contender_id) {
            // An observer on MySQL / SQLite: nothing tells it of other processes'
            // changes, so the engine reads on its own schedule.
            return Ok(None);
        }
        let (rx, tx, contending) = self.inner.gates.subscribe(mutex, contender_id);
        self.dialect().listen(mutex, contender_id, &tx, &contending);
        drop((tx, contending));
        Ok(Some(rx))
    }
}

impl PermitStore for SqlStore {
    fn backend(&self) -> &'static str {
        self.inner.kind.name()
    }

    /// At most [`SqlConfig::with_max_name_len`] characters (the `semaphore` column holds as
    /// much).
    fn check_semaphore_name(&self, semaphore: &str) -> Result<()> {
        self.inner.check_name(semaphore)
    }

    /// As [`LeaseStore::check_contender_id`].
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        self.inner.check_contender(contender_id)
    }

    /// One transaction on the permits table (see the crate README, *Semaphores*).
    ///
    /// # Cancel safety
    /// The transaction runs in a task of its own and ends (commit or rollback) even when
    /// the future is dropped; acquiring again is idempotent for the same contender.
    async fn permit_acquire(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> Result<LeaseReply> {
        Box::pin(
            self.permit_ops()
                .acquire(semaphore, contender_id, permits, lease),
        )
        .await
    }

    /// Renews only, in one statement on the database clock.
    async fn permit_guard(
        &self,
        semaphore: &str,
        contender_id: &str,
        _permits: u32,
        lease: Lease,
    ) -> Result<LeaseReply> {
        Box::pin(self.permit_ops().guard(semaphore, contender_id, lease)).await
    }

    async fn permit_release(&self, semaphore: &str, contender_id: &str) -> Result<bool> {
        Box::pin(self.permit_ops().release(semaphore, contender_id)).await
    }

    async fn permit_owners(&self, semaphore: &str) -> Result<simba_core::backend::PermitHolders> {
        Box::pin(self.permit_ops().owners(semaphore)).await
    }

    /// Waiters of this store are woken by its releases; others look again every
    /// [`PERMIT_POLL`] at most.
    async fn permit_subscribe(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> Result<Option<EventReceiver>> {
        self.permit_ops().subscribe(semaphore, contender_id)
    }

    async fn permit_leave(&self, semaphore: &str, contender_id: &str) -> Result<()> {
        Box::pin(self.permit_ops().leave(semaphore, contender_id)).await
    }
}

#[cfg(test)]
mod tests {
    use super::returning_acquire;

    #[test]
    fn only_mariadb_from_10_5_acquires_in_one_statement() {
        for (version, one) in [
            ("10.11.19-MariaDB-0+deb12u1", true),
            ("10.5.0-MariaDB", true),
            ("11.4.2-MariaDB-log", true),
            ("10.4.32-MariaDB", false),
            ("5.5.5-10.11.6-MariaDB", false),
            ("8.0.36", false),
            ("8.4.0-commercial", false),
            ("MariaDB", false),
            ("", false),
        ] {
            assert_eq!(returning_acquire(version), one, "{version}");
        }
    }
}
