//! [`SqlStore`]: the [`LeaseStore`] over a SQL table.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use deadpool::managed::Manager;
use diesel::QueryableByName;
use diesel::backend::Backend as DieselBackend;
use diesel::query_builder::{BoxedSqlQuery, SqlQuery};
use diesel::result::QueryResult;
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, HasSqlType, Nullable, Text};
#[cfg(feature = "sqlite")]
use diesel_async::AsyncConnection;
use diesel_async::SimpleAsyncConnection;
use diesel_async::pooled_connection::deadpool::{Object, Pool as DeadPool};
use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod,
};
use simba_core::backend::{Lease, LeaseReply, LeaseStore, StoreEvent, held_owner_id, hold_millis};
use simba_core::{Error, MutexOwner, Result, check_common_contender_id, check_common_mutex_name};
use tokio::sync::mpsc;
use tracing::debug;

use crate::config::{Backend, OWNER_COLUMN_LEN, SqlConfig, Target, redact_url};
use crate::gate::{Gates, Kind as GateKind, Pass};
use crate::sql::Statements;

#[cfg(feature = "mysql")]
use diesel_async::AsyncMysqlConnection;
#[cfg(feature = "postgres")]
use diesel_async::AsyncPgConnection;
#[cfg(feature = "sqlite")]
type SqliteConn =
    diesel_async::sync_connection_wrapper::SyncConnectionWrapper<diesel::SqliteConnection>;

/// The shortest bound for a migration (DDL may wait for metadata locks).
const MIGRATE_TIMEOUT_MIN: Duration = Duration::from_secs(30);

/// One bound value of a statement.
#[derive(Debug, Clone, Copy)]
enum Arg<'a> {
    Text(&'a str),
    Int(i64),
}

/// The row every owner read returns: the database's time, and the mutex's row if any.
/// It comes from a server: [`owner_reply`] trusts none of it (the fuzz target `sql_row`
/// builds these from fuzz input).
#[derive(Debug, Clone, QueryableByName)]
pub(crate) struct OwnerRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) now_ms: i64,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) owner_id: Option<String>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) acquired_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) ttl_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) transition_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) version: Option<i64>,
}

fn bind_all<'a, DB>(sql: &str, args: &[Arg<'a>]) -> BoxedSqlQuery<'a, DB, SqlQuery>
where
    DB: DieselBackend + HasSqlType<Text> + HasSqlType<BigInt>,
    &'a str: ToSql<Text, DB>,
    i64: ToSql<BigInt, DB>,
{
    let mut q = diesel::sql_query(sql).into_boxed::<DB>();
    for arg in args {
        q = match *arg {
            Arg::Text(s) => q.bind::<Text, _>(s),
            Arg::Int(i) => q.bind::<BigInt, _>(i),
        };
    }
    q
}

/// What the store needs from a connection, whatever the backend.
trait SqlConn: Send {
    fn exec<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = QueryResult<usize>> + Send + 'a;

    fn load_owner<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = QueryResult<Vec<OwnerRow>>> + Send + 'a;

    fn batch<'a>(&'a mut self, sql: &'a str) -> impl Future<Output = QueryResult<()>> + Send + 'a;
}

macro_rules! impl_sql_conn {
    ($conn:ty, $db:ty) => {
        impl SqlConn for $conn {
            fn exec<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [Arg<'a>],
            ) -> impl Future<Output = QueryResult<usize>> + Send + 'a {
                let q = bind_all::<$db>(sql, args);
                async move { diesel_async::RunQueryDsl::execute(q, self).await }
            }

            fn load_owner<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [Arg<'a>],
            ) -> impl Future<Output = QueryResult<Vec<OwnerRow>>> + Send + 'a {
                let q = bind_all::<$db>(sql, args);
                async move { diesel_async::RunQueryDsl::load::<OwnerRow>(q, self).await }
            }

            fn batch<'a>(
                &'a mut self,
                sql: &'a str,
            ) -> impl Future<Output = QueryResult<()>> + Send + 'a {
                SimpleAsyncConnection::batch_execute(self, sql)
            }
        }
    };
}

#[cfg(feature = "mysql")]
impl_sql_conn!(AsyncMysqlConnection, diesel::mysql::Mysql);
#[cfg(feature = "postgres")]
impl_sql_conn!(AsyncPgConnection, diesel::pg::Pg);
#[cfg(feature = "sqlite")]
impl_sql_conn!(SqliteConn, diesel::sqlite::Sqlite);

/// The per-call context the statement functions need.
struct Call<'a> {
    st: &'a Statements,
    mutex: &'a str,
    channel: &'a str,
}

impl Call<'_> {
    async fn select<C: SqlConn>(&self, c: &mut C) -> QueryResult<Option<OwnerRow>> {
        Ok(c.load_owner(&self.st.select, &[Arg::Text(self.mutex)])
            .await?
            .pop())
    }

    /// Acquire: one conditional UPDATE on the database clock, which may take a free row
    /// only with the native lock ([`Pass::Locked`]), then the owner and the database's
    /// time (PostgreSQL: all in one statement). Inserts the row first when it does not
    /// exist yet.
    async fn acquire<C: SqlConn>(
        &self,
        c: &mut C,
        me: &str,
        lease: Lease,
        pass: Pass,
    ) -> QueryResult<Option<OwnerRow>> {
        let ttl = lease.ttl_ms();
        let total = ttl.saturating_add(lease.transition_ms());
        let (sql, gated) = match pass {
            Pass::Locked => (&self.st.acquire_locked, 1),
            Pass::Unlocked => (&self.st.acquire_unlocked, 0),
        };
        let payload;
        let mut args = vec![
            Arg::Text(me),
            Arg::Int(gated),
            Arg::Text(me),
            Arg::Text(me),
            Arg::Int(ttl),
            Arg::Int(total),
            Arg::Text(me),
            Arg::Text(self.mutex),
            Arg::Text(me),
        ];
        if pass == Pass::Unlocked {
            args.push(Arg::Int(total));
        }
        if self.st.notify {
            payload = notify_acquired(self.mutex, me);
            args.push(Arg::Text(self.channel));
            args.push(Arg::Text(&payload));
            args.push(Arg::Text(self.mutex));
        }
        let row = self.run_acquire(c, sql, &args).await?;
        if row.as_ref().is_some_and(|r| r.owner_id.is_some()) {
            return Ok(row);
        }
        // First use of this mutex: create its row (racing inserts are no-ops) and decide again.
        c.exec(&self.st.insert, &[Arg::Text(self.mutex)]).await?;
        self.run_acquire(c, sql, &args).await
    }

    async fn run_acquire<C: SqlConn>(
        &self,
        c: &mut C,
        sql: &str,
        args: &[Arg<'_>],
    ) -> QueryResult<Option<OwnerRow>> {
        if self.st.returns_row {
            return Ok(c.load_owner(sql, args).await?.pop());
        }
        c.exec(sql, args).await?;
        self.select(c).await
    }

    /// Renew: extends the lease only if `me` owns it within its lease; never takes it.
    async fn renew<C: SqlConn>(
        &self,
        c: &mut C,
        me: &str,
        lease: Lease,
    ) -> QueryResult<Option<OwnerRow>> {
        let ttl = lease.ttl_ms();
        let total = ttl.saturating_add(lease.transition_ms());
        let args = [
            Arg::Int(ttl),
            Arg::Int(total),
            Arg::Text(self.mutex),
            Arg::Text(me),
        ];
        c.exec(&self.st.renew, &args).await?;
        self.select(c).await
    }

    /// Release with a hold: one owner-checked UPDATE that hands the ownership to the hold's
    /// id until `now + hold_ms` on the database clock (PostgreSQL: with NOTIFY).
    async fn release_after<C: SqlConn>(
        &self,
        c: &mut C,
        me: &str,
        hold_ms: i64,
    ) -> QueryResult<bool> {
        let holder = held_owner_id(me);
        let payload;
        let mut args = vec![
            Arg::Text(&holder),
            Arg::Int(hold_ms),
            Arg::Int(hold_ms),
            Arg::Text(self.mutex),
            Arg::Text(me),
        ];
        if self.st.notify {
            payload = notify_acquired(self.mutex, &holder);
            args.push(Arg::Text(self.channel));
            args.push(Arg::Text(&payload));
        }
        Ok(c.exec(&self.st.release_after, &args).await? > 0)
    }

    /// Release: owner-checked UPDATE (PostgreSQL: with NOTIFY in the same statement).
    async fn release<C: SqlConn>(&self, c: &mut C, me: &str) -> QueryResult<bool> {
        let payload;
        let mut args = vec![Arg::Text(self.mutex), Arg::Text(me)];
        if self.st.notify {
            payload = notify_released(self.mutex, me);
            args.push(Arg::Text(self.channel));
            args.push(Arg::Text(&payload));
        }
        Ok(c.exec(&self.st.release, &args).await? > 0)
    }
}

#[cfg(feature = "postgres")]
fn notify_acquired(mutex: &str, me: &str) -> String {
    crate::listen::acquired_payload(mutex, me)
}
#[cfg(feature = "postgres")]
fn notify_released(mutex: &str, me: &str) -> String {
    crate::listen::released_payload(mutex, me)
}
#[cfg(not(feature = "postgres"))]
fn notify_acquired(_mutex: &str, _me: &str) -> String {
    String::new()
}
#[cfg(not(feature = "postgres"))]
fn notify_released(_mutex: &str, _me: &str) -> String {
    String::new()
}

/// A pooled connection that is closed, not returned to the pool, unless the call that
/// used it completed: a call cut off by a timeout (or a dropped future) may have left the
/// connection mid-protocol.
struct Checked<C>
where
    AsyncDieselConnectionManager<C>: Manager<Type = C>,
{
    obj: Option<Object<C>>,
    discard: bool,
}

impl<C> Checked<C>
where
    AsyncDieselConnectionManager<C>: Manager<Type = C>,
{
    fn conn(&mut self) -> Option<&mut C> {
        self.obj.as_deref_mut()
    }

    fn reused(&self) -> bool {
        self.obj
            .as_ref()
            .is_some_and(|o| Object::metrics(o).recycle_count > 0)
    }

    fn keep(&mut self) {
        self.discard = false;
    }
}

impl<C> Drop for Checked<C>
where
    AsyncDieselConnectionManager<C>: Manager<Type = C>,
{
    fn drop(&mut self) {
        if self.discard
            && let Some(obj) = self.obj.take()
        {
            drop(Object::take(obj));
        }
    }
}

enum Pool {
    #[cfg(feature = "mysql")]
    Mysql(DeadPool<AsyncMysqlConnection>),
    #[cfg(feature = "postgres")]
    Postgres(DeadPool<AsyncPgConnection>),
    #[cfg(feature = "sqlite")]
    Sqlite(DeadPool<SqliteConn>),
    /// No backend feature is enabled: no store can be built.
    #[cfg(not(any(feature = "mysql", feature = "postgres", feature = "sqlite")))]
    #[allow(dead_code)]
    Never(std::convert::Infallible),
}

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
    ($inner:expr, |$c:ident| $body:expr) => {{
        let inner: &Inner = $inner;
        match &inner.pool {
            #[cfg(feature = "mysql")]
            Pool::Mysql(p) => on_conn!(@run inner, p, |$c| $body),
            #[cfg(feature = "postgres")]
            Pool::Postgres(p) => on_conn!(@run inner, p, |$c| $body),
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(p) => on_conn!(@run inner, p, |$c| $body),
            #[cfg(not(any(feature = "mysql", feature = "postgres", feature = "sqlite")))]
            Pool::Never(never) => match *never {},
        }
    }};
}

/// Runs one store call (`$body` on a connection `$c`) bounded by the statement timeout,
/// its failure described as `$what`: on PostgreSQL's prepared-statement connection when
/// the store has one (`fast`), else on a pooled connection.
macro_rules! run_fast {
    ($inner:expr, $what:expr, |$c:ident| $body:expr) => {{
        let inner: &Inner = $inner;
        #[cfg(feature = "postgres")]
        let done = match &inner.fast {
            Some(fast) => {
                let limit = inner.config.statement_timeout();
                let what = $what;
                let result = inner
                    .bounded(&what, limit, async {
                        let mut handle = fast
                            .handle()
                            .await
                            .map_err(|e| Failure::Connect(e.clone(), e.into()))?;
                        let $c = &mut handle;
                        $body.await.map_err(Failure::Query)
                    })
                    .await;
                if result.is_err() {
                    // Failed or cut off halfway: the next call opens a new connection.
                    fast.reset_any().await;
                }
                Some(result)
            }
            None => None,
        };
        #[cfg(not(feature = "postgres"))]
        let done = None;
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

struct Inner {
    kind: Backend,
    config: SqlConfig,
    pool: Pool,
    st: Statements,
    channel: String,
    /// The native wait queues of this store's mutexes.
    gates: Arc<Gates>,
    /// Close connections whose call failed or was cut off (not SQLite: its calls run to
    /// completion on a blocking thread, and an in-memory database lives in its connection).
    discard: bool,
    #[cfg(feature = "postgres")]
    listener: Option<crate::listen::Listener>,
    /// PostgreSQL: prepared statements for acquire and release.
    #[cfg(feature = "postgres")]
    fast: Option<fast::Fast>,
    /// PostgreSQL: opens every connection of the store (TLS set up once).
    #[cfg(feature = "postgres")]
    pg: Option<Arc<crate::pg::Connector>>,
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
                // A TLS problem is permanent, and says what to fix; the pool's errors lose
                // their source on the way through diesel, so the connector remembers it.
                #[cfg(feature = "postgres")]
                if let Some(tls) = self.pg.as_ref().and_then(|pg| pg.last_failure()) {
                    let text = tls.to_string();
                    let message = if msg.contains(&text) {
                        msg
                    } else {
                        format!("{msg}; {text}")
                    };
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
                // MySQL: the driver's message is all that crosses the pool.
                #[cfg(feature = "mysql")]
                if self.kind == Backend::Mysql
                    && let Some(tls) = crate::my::classify(&msg)
                {
                    return Err(Error::backend_source(
                        backend,
                        format!(
                            "{what}: cannot get a connection to {}: {msg}; {tls}",
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
        let permanent = missing_table || missing_column || lower.contains("syntax");
        let hint = if missing_table {
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

    /// Checks the inputs of a call on `mutex` (by `contender`, if any) before any SQL runs.
    fn start<'a>(&'a self, mutex: &'a str, contender: Option<&str>) -> Result<Call<'a>> {
        self.check_name(mutex)?;
        if let Some(c) = contender {
            self.check_contender(c)?;
        }
        Ok(self.call(mutex))
    }

    fn call<'a>(&'a self, mutex: &'a str) -> Call<'a> {
        Call {
            st: &self.st,
            mutex,
            channel: &self.channel,
        }
    }

    fn check_name(&self, mutex: &str) -> Result<()> {
        check_common_mutex_name(mutex)?;
        let chars = mutex.chars().count();
        let max = self.config.max_name_len();
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
        if contender.chars().count() > OWNER_COLUMN_LEN {
            return Err(Error::InvalidContenderId {
                id: contender.chars().take(64).collect(),
                reason: format!("longer than the `owner_id` column ({OWNER_COLUMN_LEN})"),
            });
        }
        Ok(())
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
    let owner = match row.owner_id {
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
    /// [`Error::InvalidConfig`] for a bad config (see [`SqlConfig::validate`]);
    /// [`Error::Backend`] if the database cannot be reached within the statement timeout
    /// or refuses the connection.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-built store and its connections.
    pub async fn connect(config: SqlConfig) -> Result<SqlStore> {
        let store = SqlStore::connect_lazy(config)?;
        let inner = &*store.inner;
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
        let st = Statements::new(kind, config.table());
        let channel = channel_name(config.table());
        #[cfg(feature = "postgres")]
        let pg = match &target {
            Target::Postgres(url) => Some(Arc::new(crate::pg::Connector::new(url)?)),
            _ => None,
        };
        #[cfg(feature = "postgres")]
        let pool = build_pool(&target, &config, pg.as_ref())?;
        #[cfg(not(feature = "postgres"))]
        let pool = build_pool(&target, &config)?;
        #[cfg(feature = "postgres")]
        let statement_timeout = config.statement_timeout();
        let gates = Arc::new(Gates::new(
            gate_kind(
                &target,
                #[cfg(feature = "postgres")]
                pg.as_ref(),
            ),
            lock_scope(&target, config.table()),
            config.statement_timeout(),
        ));
        #[cfg(feature = "postgres")]
        let listener = pg.as_ref().map(|pg| {
            crate::listen::Listener::new(pg.clone(), channel.clone(), config.statement_timeout())
        });
        Ok(SqlStore {
            inner: Arc::new(Inner {
                kind,
                discard: kind != Backend::Sqlite,
                gates,
                config,
                pool,
                st,
                channel,
                #[cfg(feature = "postgres")]
                listener,
                #[cfg(feature = "postgres")]
                fast: pg
                    .as_ref()
                    .map(|pg| fast::Fast::new(pg.clone(), statement_timeout)),
                #[cfg(feature = "postgres")]
                pg,
            }),
        })
    }

    /// Creates the table if it does not exist (`CREATE TABLE IF NOT EXISTS`, see
    /// [`create_table_sql`](crate::create_table_sql)) and checks that it has every column
    /// the store uses. Idempotent, and safe to run from many processes at once
    /// (PostgreSQL serialises it with an advisory lock).
    ///
    /// # Errors
    /// [`Error::Backend`] if the database fails, denies the DDL, or the existing table lacks
    /// a column. Bounded by the statement timeout, but at least 30 s.
    ///
    /// # Cancel safety
    /// Dropping the future may leave the table created or not; running it again is fine.
    pub async fn migrate(&self) -> Result<()> {
        let inner = &*self.inner;
        let limit = inner.config.statement_timeout().max(MIGRATE_TIMEOUT_MIN);
        let st = &inner.st;
        inner
            .bounded("migrate", limit, async {
                on_conn!(inner, |c| async {
                    c.batch(&st.migrate).await?;
                    c.batch(&st.check).await
                })
            })
            .await
    }

    /// The connector of a PostgreSQL store (its TLS set up).
    #[cfg(feature = "postgres")]
    pub(crate) fn pg_connector(&self) -> Option<Arc<crate::pg::Connector>> {
        self.inner.pg.clone()
    }

    /// A duplicate of the lock file `contender_id` holds for `mutex` (SQLite), see
    /// `simba_core::connect::Connection::owner_anchor`.
    #[cfg(all(unix, feature = "sqlite"))]
    pub(crate) fn anchor(
        &self,
        mutex: &str,
        contender_id: &str,
    ) -> std::io::Result<Option<std::os::fd::OwnedFd>> {
        self.inner.gates.anchor(mutex, contender_id)
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

/// Whether a SQLite error is "database is locked" / "database is busy".
#[cfg(feature = "sqlite")]
fn is_sqlite_busy(e: &diesel::result::Error) -> bool {
    let text = e.to_string();
    text.contains("locked") || text.contains("busy")
}

/// Where the native locks of a store on `target` live.
fn gate_kind(
    target: &Target,
    #[cfg(feature = "postgres")] pg: Option<&Arc<crate::pg::Connector>>,
) -> GateKind {
    #[cfg(feature = "postgres")]
    if let Some(pg) = pg {
        return GateKind::Postgres { pg: pg.clone() };
    }
    match target {
        #[cfg(feature = "mysql")]
        Target::Mysql(url) => GateKind::Mysql { url: url.clone() },
        #[cfg(feature = "sqlite")]
        Target::Sqlite {
            path,
            memory: false,
        } => GateKind::Files {
            prefix: path.clone(),
        },
        _ => GateKind::Local,
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

fn channel_name(table: &str) -> String {
    format!("simba:{table}")
}

fn pool_error(kind: Backend, e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::backend_source(
        kind.name(),
        format!("cannot build the connection pool: {e}"),
        false,
        e,
    )
}

fn build_pool(
    target: &Target,
    config: &SqlConfig,
    #[cfg(feature = "postgres")] pg: Option<&Arc<crate::pg::Connector>>,
) -> Result<Pool> {
    let size = config.pool_size();
    let timeout = config.statement_timeout();
    match target {
        #[cfg(feature = "mysql")]
        Target::Mysql(url) => {
            let max_statement_time = format!(
                "SET SESSION max_statement_time = {:.3}",
                timeout.as_secs_f64()
            );
            let lock_wait = format!(
                "SET SESSION innodb_lock_wait_timeout = {}",
                timeout.as_secs().clamp(1, 1_073_741_824)
            );
            let mut mc = ManagerConfig::<AsyncMysqlConnection>::default();
            mc.recycling_method = RecyclingMethod::Fast;
            mc.custom_setup = Box::new(move |url| {
                let (a, b) = (max_statement_time.clone(), lock_wait.clone());
                Box::pin(async move {
                    // The URL's TLS options and matched-row counts (crate::my).
                    let mut conn = crate::my::diesel(url).await?;
                    // Server-side bounds, best effort: max_statement_time is MariaDB's.
                    if let Err(e) = conn.batch_execute(&a).await {
                        debug!("mysql: server-side statement timeout not set: {e}");
                    }
                    if let Err(e) = conn.batch_execute(&b).await {
                        debug!("mysql: innodb_lock_wait_timeout not set: {e}");
                    }
                    Ok(conn)
                })
            });
            let mgr = AsyncDieselConnectionManager::new_with_config(url.clone(), mc);
            DeadPool::builder(mgr)
                .max_size(size)
                .build()
                .map(Pool::Mysql)
                .map_err(|e| pool_error(Backend::Mysql, e))
        }
        #[cfg(feature = "postgres")]
        Target::Postgres(url) => {
            let setup = format!("SET statement_timeout = {}", timeout.as_millis());
            let pg = match pg {
                Some(pg) => pg.clone(),
                None => Arc::new(crate::pg::Connector::new(url)?),
            };
            let mut mc = ManagerConfig::<AsyncPgConnection>::default();
            mc.recycling_method = RecyclingMethod::Fast;
            // Every connection through the store's connector (its TLS), not the URL.
            mc.custom_setup = Box::new(move |_url| {
                let setup = setup.clone();
                let pg = pg.clone();
                Box::pin(async move {
                    let mut conn = pg.diesel().await?;
                    conn.batch_execute(&setup)
                        .await
                        .map_err(diesel::ConnectionError::CouldntSetupConfiguration)?;
                    Ok(conn)
                })
            });
            let mgr = AsyncDieselConnectionManager::new_with_config(url.clone(), mc);
            DeadPool::builder(mgr)
                .max_size(size)
                .build()
                .map(Pool::Postgres)
                .map_err(|e| pool_error(Backend::Postgres, e))
        }
        #[cfg(feature = "sqlite")]
        Target::Sqlite { path, memory } => {
            // WAL lets readers run beside the one writer; busy_timeout makes writers of
            // other connections and processes wait instead of failing.
            let busy = format!(
                "PRAGMA busy_timeout = {}",
                timeout.as_millis().min(i32::MAX as u128)
            );
            let mut mc = ManagerConfig::<SqliteConn>::default();
            mc.recycling_method = RecyclingMethod::Fast;
            mc.custom_setup = Box::new(move |url| {
                let busy = busy.clone();
                Box::pin(async move {
                    let setup = diesel::ConnectionError::CouldntSetupConfiguration;
                    let mut conn = SqliteConn::establish(url).await?;
                    conn.batch_execute(&busy).await.map_err(setup)?;
                    // Switching a file to WAL needs it to itself for an instant, and fails
                    // at once with "database is locked" (the busy timeout does not apply)
                    // while other connections open it: retry, within the statement timeout.
                    let give_up = tokio::time::Instant::now() + timeout;
                    loop {
                        match conn.batch_execute("PRAGMA journal_mode = WAL").await {
                            Ok(()) => break,
                            Err(e)
                                if is_sqlite_busy(&e) && tokio::time::Instant::now() < give_up =>
                            {
                                tokio::time::sleep(Duration::from_millis(5)).await;
                            }
                            Err(e) => return Err(setup(e)),
                        }
                    }
                    Ok(conn)
                })
            });
            let mgr = AsyncDieselConnectionManager::new_with_config(path.clone(), mc);
            // Every connection to `:memory:` is a database of its own: use exactly one.
            let size = if *memory { 1 } else { size };
            DeadPool::builder(mgr)
                .max_size(size)
                .build()
                .map(Pool::Sqlite)
                .map_err(|e| pool_error(Backend::Sqlite, e))
        }
        #[allow(unreachable_patterns)]
        other => Err(Error::config(
            "url",
            format!(
                "the {} backend is not enabled in this build of simba-jdbc",
                other.backend()
            ),
        )),
    }
}

impl LeaseStore for SqlStore {
    fn backend(&self) -> &'static str {
        self.inner.kind.name()
    }

    /// At most [`SqlConfig::with_max_name_len`] characters (the `mutex` column).
    fn check_mutex_name(&self, mutex: &str) -> Result<()> {
        self.inner.check_name(mutex)
    }

    /// At most [`OWNER_COLUMN_LEN`] characters (the `owner_id` column).
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        self.inner.check_contender(contender_id)
    }

    /// # Cancel safety
    /// Dropping the future may leave the acquisition applied or not (the connection is then
    /// closed); acquiring again is idempotent for the same contender.
    async fn acquire(&self, mutex: &str, contender_id: &str, lease: Lease) -> Result<LeaseReply> {
        let inner = &*self.inner;
        let call = inner.start(mutex, Some(contender_id))?;
        let sent = tokio::time::Instant::now();
        let pass = inner.gates.enter(mutex, contender_id).await;
        let row = run_fast!(inner, format!("acquire mutex {mutex:?}"), |c| call.acquire(
            c,
            contender_id,
            lease,
            pass
        ))?;
        let grace = match pass {
            Pass::Locked => None,
            Pass::Unlocked => Some(lease.ttl_ms().saturating_add(lease.transition_ms())),
        };
        let reply = inner.reply(row, grace)?;
        let owns = reply.owner.is_owned_by_at(contender_id, reply.now);
        inner
            .gates
            .outcome(mutex, contender_id, owns, sent + lease.total());
        Ok(reply)
    }

    /// Renews only: never takes a mutex that `contender_id` does not own within its lease.
    async fn guard(&self, mutex: &str, contender_id: &str, lease: Lease) -> Result<LeaseReply> {
        let inner = &*self.inner;
        let call = inner.start(mutex, Some(contender_id))?;
        let sent = tokio::time::Instant::now();
        let row = run!(inner, format!("renew mutex {mutex:?}"), |c| call.renew(
            c,
            contender_id,
            lease
        ))?;
        let reply = inner.reply(row, None)?;
        let owns = reply.owner.is_owned_by_at(contender_id, reply.now);
        inner
            .gates
            .outcome(mutex, contender_id, owns, sent + lease.total());
        Ok(reply)
    }

    async fn release(&self, mutex: &str, contender_id: &str) -> Result<bool> {
        let inner = &*self.inner;
        let call = inner.start(mutex, Some(contender_id))?;
        let released = run_fast!(inner, format!("release mutex {mutex:?}"), |c| call
            .release(c, contender_id));
        // The row first, then the native lock: the waiter it wakes finds the row free.
        // On failure too: the engine releases only what it no longer believes it owns.
        inner.gates.done(mutex, contender_id, false).await;
        released
    }

    /// One conditional UPDATE on the database clock (see [`LeaseStore::release_after`]).
    async fn release_after(&self, mutex: &str, contender_id: &str, hold: Duration) -> Result<bool> {
        let inner = &*self.inner;
        let call = inner.start(mutex, Some(contender_id))?;
        let ms = hold_millis(hold)?;
        if ms == 0 {
            return self.release(mutex, contender_id).await;
        }
        let held = run!(inner, format!("release mutex {mutex:?} with a hold"), |c| {
            call.release_after(c, contender_id, ms)
        });
        // The next waiter gets the native lock, finds the row held, and waits for the
        // hold's end on the lease clock.
        inner.gates.done(mutex, contender_id, false).await;
        held
    }

    async fn owner(&self, mutex: &str) -> Result<LeaseReply> {
        let inner = &*self.inner;
        let call = inner.start(mutex, None)?;
        let row = run!(inner, format!("read owner of mutex {mutex:?}"), |c| call
            .select(c))?;
        inner.reply(row, None)
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
    /// [`StoreEvent::Released`] when the database (or, on SQLite, the kernel) hands its
    /// process the mutex's native lock, and gets [`StoreEvent::Resync`] when waiting
    /// failed (a lost session). On PostgreSQL a subscriber that does not contend (an
    /// observer) hears every change by LISTEN/NOTIFY; on MySQL and SQLite an observer gets
    /// `None` (the engine reads on its schedule). A contender is one that called
    /// [`LeaseStore::acquire`] on this store and has not released or left since.
    async fn subscribe(
        &self,
        mutex: &str,
        contender_id: &str,
    ) -> Result<Option<mpsc::Receiver<StoreEvent>>> {
        self.inner.check_name(mutex)?;
        #[cfg(feature = "postgres")]
        let observers_hear = self.inner.listener.is_some();
        #[cfg(not(feature = "postgres"))]
        let observers_hear = false;
        if !observers_hear && !self.inner.gates.contends(mutex, contender_id) {
            // An observer on MySQL / SQLite: nothing tells it of other processes'
            // changes, so the engine reads on its own schedule.
            return Ok(None);
        }
        let (rx, tx, contending) = self.inner.gates.subscribe(mutex, contender_id);
        #[cfg(feature = "postgres")]
        if let Some(listener) = &self.inner.listener {
            listener.subscribe(mutex, contender_id, tx.clone(), contending.clone());
        }
        drop((tx, contending));
        Ok(Some(rx))
    }
}

/// PostgreSQL's fast path for the statements of a handoff (acquire, release): one
/// tokio-postgres connection per store whose statements are prepared once and then run
/// in one round trip each, pipelined when several run at once. (diesel's `sql_query`
/// prepares and plans every statement anew on every call.) Any failure closes the
/// connection; the next call opens a new one.
#[cfg(feature = "postgres")]
mod fast {
    use std::collections::HashMap;
    use std::future::Future;
    use std::sync::{Arc, Mutex as StdMutex};
    use std::time::Duration;

    use diesel::result::{DatabaseErrorKind, Error as DieselError, QueryResult};
    use tokio_postgres::types::ToSql;
    use tokio_postgres::{Client, Statement};

    use super::{Arg, OwnerRow, SqlConn};
    use crate::pg::Connector;

    pub(super) struct FastConn {
        client: Client,
        statements: StdMutex<HashMap<String, Statement>>,
        driver: tokio::task::JoinHandle<()>,
    }

    impl Drop for FastConn {
        fn drop(&mut self) {
            self.driver.abort();
        }
    }

    fn failed(e: impl std::fmt::Display) -> DieselError {
        DieselError::DatabaseError(DatabaseErrorKind::Unknown, Box::new(e.to_string()))
    }

    /// The connection of a store, opened on first use.
    pub(super) struct Fast {
        pg: Arc<Connector>,
        setup: String,
        conn: tokio::sync::Mutex<Option<Arc<FastConn>>>,
    }

    impl Fast {
        pub(super) fn new(pg: Arc<Connector>, statement_timeout: Duration) -> Self {
            Fast {
                pg,
                setup: format!("SET statement_timeout = {}", statement_timeout.as_millis()),
                conn: tokio::sync::Mutex::new(None),
            }
        }

        /// The open connection, or a new one.
        pub(super) async fn handle(&self) -> Result<Handle, String> {
            let mut conn = self.conn.lock().await;
            if let Some(c) = conn.as_ref()
                && !c.client.is_closed()
            {
                return Ok(Handle(c.clone()));
            }
            let (client, connection) = self.pg.connect().await.map_err(|e| e.to_string())?;
            let driver = tokio::spawn(async move {
                let _ = connection.await;
            });
            let c = Arc::new(FastConn {
                client,
                statements: StdMutex::new(HashMap::new()),
                driver,
            });
            c.client
                .batch_execute(&self.setup)
                .await
                .map_err(|e| e.to_string())?;
            *conn = Some(c.clone());
            Ok(Handle(c))
        }

        /// Closes the connection (after a failure or a call cut off halfway); calls in
        /// flight on it fail.
        pub(super) async fn reset_any(&self) {
            *self.conn.lock().await = None;
        }
    }

    /// A use of the connection, for the statement functions of the store.
    pub(super) struct Handle(Arc<FastConn>);

    impl Handle {
        async fn statement(&self, sql: &str) -> QueryResult<Statement> {
            let cached = self
                .0
                .statements
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(sql)
                .cloned();
            if let Some(st) = cached {
                return Ok(st);
            }
            let st = self.0.client.prepare(sql).await.map_err(failed)?;
            self.0
                .statements
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(sql.to_owned(), st.clone());
            Ok(st)
        }
    }

    fn params<'a>(args: &'a [Arg<'a>]) -> Vec<&'a (dyn ToSql + Sync)> {
        args.iter()
            .map(|a| match a {
                Arg::Text(s) => s as &(dyn ToSql + Sync),
                Arg::Int(i) => i as &(dyn ToSql + Sync),
            })
            .collect()
    }

    fn get<T>(row: &tokio_postgres::Row, name: &str) -> QueryResult<T>
    where
        T: for<'b> tokio_postgres::types::FromSql<'b>,
    {
        row.try_get(name).map_err(failed)
    }

    // The same signatures as the trait's (and the diesel connections' impls), kept as
    // `impl Future + Send`.
    #[allow(clippy::manual_async_fn)]
    impl SqlConn for Handle {
        fn exec<'a>(
            &'a mut self,
            sql: &'a str,
            args: &'a [Arg<'a>],
        ) -> impl Future<Output = QueryResult<usize>> + Send + 'a {
            async move {
                let st = self.statement(sql).await?;
                let n = self
                    .0
                    .client
                    .execute(&st, &params(args))
                    .await
                    .map_err(failed)?;
                Ok(usize::try_from(n).unwrap_or(usize::MAX))
            }
        }

        fn load_owner<'a>(
            &'a mut self,
            sql: &'a str,
            args: &'a [Arg<'a>],
        ) -> impl Future<Output = QueryResult<Vec<OwnerRow>>> + Send + 'a {
            async move {
                let st = self.statement(sql).await?;
                let rows = self
                    .0
                    .client
                    .query(&st, &params(args))
                    .await
                    .map_err(failed)?;
                rows.iter()
                    .map(|r| {
                        Ok(OwnerRow {
                            now_ms: get(r, "now_ms")?,
                            owner_id: get(r, "owner_id")?,
                            acquired_at: get(r, "acquired_at")?,
                            ttl_at: get(r, "ttl_at")?,
                            transition_at: get(r, "transition_at")?,
                            version: get(r, "version")?,
                        })
                    })
                    .collect()
            }
        }

        fn batch<'a>(
            &'a mut self,
            sql: &'a str,
        ) -> impl Future<Output = QueryResult<()>> + Send + 'a {
            async move { self.0.client.batch_execute(sql).await.map_err(failed) }
        }
    }
}
