//! PostgreSQL's fast path for the statements of a handoff (acquire, release): tokio-postgres
//! connections of the store whose statements are prepared once and then run in one round
//! trip each, pipelined when several run at once. (diesel's `sql_query` prepares and plans
//! every statement anew on every call.) Any failure, or a call cut off halfway, retires its
//! connection; the next call opens a new one.
//!
//! Behind a transaction pooler (`super::pooler`) nothing is prepared by name: each
//! statement goes unnamed with its arguments' types (still one round trip), and every call
//! of the store runs here: single statements on the shared connections, everything that
//! would have run on the pool (a semaphore's transaction among them) on a connection the
//! call has to itself ([`Fast::exclusive`], at most the pool size at once).
//!
//! One connection carries the statements of a store at ordinary loads. Every acquisition
//! commits, and a commit waits for its WAL flush: statements pipelined on one connection
//! commit one after another, each with a flush of its own. So when every open connection
//! has [`BUSY`] statements in flight, another opens, up to [`MAX_CONNS`]: commits of
//! different connections overlap and share the server's flushes, as long as no NOTIFY
//! serializes them ([`Notifier`]). 10,000 acquisitions at once (`simba bench --scenario
//! scale`, one machine, one day): 6.0–6.3 s on one connection with the NOTIFY in the
//! statement, 6.3 s on one connection with it after the commit, 4.8–5.0 s on up to four
//! with it in the statement, 3.7–4.1 s on up to four with it after the commit (2.0 s on
//! one connection with the server's `synchronous_commit = off`: the flushes were the time).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use diesel::result::{DatabaseErrorKind, Error as DieselError, QueryResult};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Statement};
use tracing::debug;

use super::Connector;
use crate::conn::{Arg, Done, SqlConn, Step};
use crate::rows::{BatchRow, OwnerRow, TextRow};
use crate::schema::ColumnRow;

/// The most connections of a store's fast path.
pub(crate) const MAX_CONNS: usize = 4;
/// The most steps of a pipeline sent at once (`futures_util`'s `join_all` polls up to
/// 30 futures in order itself, more through a queue).
const PIPELINE_CHUNK: usize = 16;
/// Statements in flight on every open connection at which the next call opens another.
const BUSY: usize = 4;

pub(crate) struct FastConn {
    client: Client,
    statements: StdMutex<HashMap<String, Statement>>,
    driver: tokio::task::JoinHandle<()>,
    /// Calls holding a [`Handle`] of this connection.
    in_flight: AtomicUsize,
    /// A call on it failed or was cut off halfway: no new call takes it.
    retired: AtomicBool,
}

impl Drop for FastConn {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl FastConn {
    fn usable(&self) -> bool {
        !self.retired.load(Ordering::Relaxed) && !self.client.is_closed()
    }
}

fn failed(e: tokio_postgres::Error) -> DieselError {
    // The driver's own text of a server's error is "db error"; the server's message and
    // SQLSTATE are in the `DbError`, which the store's classification reads (a full JVM
    // `version` column: "integer out of range", 22003).
    let Some(db) = e.as_db_error() else {
        return DieselError::DatabaseError(DatabaseErrorKind::Unknown, Box::new(e.to_string()));
    };
    use tokio_postgres::error::SqlState;
    let kind = match db.code() {
        c if *c == SqlState::UNIQUE_VIOLATION => DatabaseErrorKind::UniqueViolation,
        c if *c == SqlState::FOREIGN_KEY_VIOLATION => DatabaseErrorKind::ForeignKeyViolation,
        c if *c == SqlState::NOT_NULL_VIOLATION => DatabaseErrorKind::NotNullViolation,
        c if *c == SqlState::CHECK_VIOLATION => DatabaseErrorKind::CheckViolation,
        c if *c == SqlState::T_R_SERIALIZATION_FAILURE => DatabaseErrorKind::SerializationFailure,
        c if *c == SqlState::READ_ONLY_SQL_TRANSACTION => DatabaseErrorKind::ReadOnlyTransaction,
        _ => DatabaseErrorKind::Unknown,
    };
    DieselError::DatabaseError(
        kind,
        Box::new(format!(
            "{}: {} (SQLSTATE {})",
            db.severity(),
            db.message(),
            db.code().code()
        )),
    )
}

/// The connections of a store, opened on use.
pub(crate) struct Fast {
    pg: Arc<Connector>,
    /// Each new connection's session setting; none behind a transaction pooler, which
    /// would give it to whichever client gets that server connection next.
    setup: Option<String>,
    /// Behind a transaction pooler (`super::pooler`): no statement is prepared by name.
    unnamed: bool,
    conns: tokio::sync::Mutex<Vec<Arc<FastConn>>>,
    /// The idle connections of calls that have one to themselves ([`Fast::exclusive`]).
    idle: Idle,
    /// At most the pool size of those at once.
    own: Arc<tokio::sync::Semaphore>,
}

type Idle = Arc<StdMutex<Vec<Arc<FastConn>>>>;

impl Fast {
    /// `own`: how many calls may have a connection to themselves at once.
    pub(crate) fn new(
        pg: Arc<Connector>,
        statement_timeout: Duration,
        unnamed: bool,
        own: usize,
    ) -> Self {
        Fast {
            pg,
            setup: (!unnamed)
                .then(|| format!("SET statement_timeout = {}", statement_timeout.as_millis())),
            unnamed,
            conns: tokio::sync::Mutex::new(Vec::new()),
            idle: Arc::default(),
            own: Arc::new(tokio::sync::Semaphore::new(own.max(1))),
        }
    }

    /// The open connection with the fewest calls in flight, or a new one when every open
    /// one has [`BUSY`] in flight (and fewer than [`MAX_CONNS`] are open). Call
    /// [`Handle::finish`] when the call has its answer: a handle dropped before retires
    /// its connection.
    pub(crate) async fn handle(&self) -> Result<Handle, HandleError> {
        let mut conns = self.conns.lock().await;
        conns.retain(|c| c.usable());
        let least = conns
            .iter()
            .min_by_key(|c| c.in_flight.load(Ordering::Relaxed))
            .cloned();
        if let Some(c) = least
            && (c.in_flight.load(Ordering::Relaxed) < BUSY || conns.len() >= MAX_CONNS)
        {
            return Ok(Handle::new(c, self.unnamed));
        }
        let c = self.open().await?;
        conns.push(c.clone());
        Ok(Handle::new(c, self.unnamed))
    }

    /// A connection no other call uses until this call's handle is dropped: for a
    /// transaction, or any call behind a transaction pooler that would otherwise run on
    /// a pooled diesel connection (which prepares by name). Idle ones are kept for the
    /// next call.
    pub(crate) async fn exclusive(&self) -> Result<Handle, HandleError> {
        let place = self
            .own
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| HandleError::Closed)?;
        let idle = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            idle.retain(|c| c.usable());
            idle.pop()
        };
        let conn = match idle {
            Some(c) => c,
            None => self.open().await?,
        };
        let mut handle = Handle::new(conn, self.unnamed);
        handle.back = Some((self.idle.clone(), place));
        Ok(handle)
    }

    /// A new connection, its driver running and its setup done.
    async fn open(&self) -> Result<Arc<FastConn>, HandleError> {
        let (client, connection) = self.pg.connect().await?;
        let driver = tokio::spawn(async move {
            let _ = connection.await;
        });
        let c = Arc::new(FastConn {
            client,
            statements: StdMutex::new(HashMap::new()),
            driver,
            in_flight: AtomicUsize::new(0),
            retired: AtomicBool::new(false),
        });
        if let Some(setup) = &self.setup {
            c.client.batch_execute(setup).await?;
        }
        Ok(c)
    }
}

/// Why a connection of the executor could not be had (or a statement on it failed).
#[derive(Debug, thiserror::Error)]
pub(crate) enum HandleError {
    /// Connecting failed (the TLS failure, if any, is its source).
    #[error(transparent)]
    Connect(#[from] super::ConnectError),
    /// The new connection's setup failed, or a statement on it.
    #[error(transparent)]
    Statement(#[from] tokio_postgres::Error),
    /// A statement could not be prepared.
    #[error(transparent)]
    Prepare(#[from] diesel::result::Error),
    /// The store is being dropped.
    #[error("the store is closing")]
    Closed,
}

/// The most payloads one NOTIFY statement carries.
const NOTIFY_BATCH: usize = 1000;

/// The NOTIFYs of a store's changes, sent after each change has committed, on the fast
/// path's connections, in the order the changes were made here.
///
/// Not in the changing statement itself: a transaction that notifies takes PostgreSQL's
/// notification lock (one for the whole server) before its commit and keeps it through the
/// commit's WAL flush, so notifying writes commit one after another, each with a flush of
/// its own, even on different connections (seen in `pg_locks`: the store's statements
/// waiting for an `AccessExclusiveLock` on `pg_database` object 0; figures in the module
/// documentation). A statement that only notifies writes nothing but its commit record
/// (40 bytes of WAL per statement on PostgreSQL 15, read with `pg_current_wal_lsn()`), so it
/// too holds the lock through a flush where commits flush; but no change waits behind it,
/// since what it announces has committed already. Payloads queued while one statement is in flight go out together in the
/// next (`pg_notify` over an array).
///
/// A notification is a hint: every subscriber re-reads the row on it, and its order against
/// other processes' notifications is not relied on. One lost (the process ended between the
/// commit and the NOTIFY, or the statement failed) leaves observers to their own reads.
pub(crate) struct Notifier {
    fast: Arc<Fast>,
    channel: String,
    queue: Arc<StdMutex<Queued>>,
    timeout: Duration,
}

#[derive(Default)]
struct Queued {
    payloads: Vec<String>,
    /// A task sends them.
    sending: bool,
}

impl Notifier {
    pub(crate) fn new(fast: Arc<Fast>, channel: String, timeout: Duration) -> Self {
        Notifier {
            fast,
            channel,
            queue: Arc::default(),
            timeout,
        }
    }

    /// Queues `payload`, and starts the task that sends the queue if none runs.
    pub(crate) fn send(&self, payload: String) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        q.payloads.push(payload);
        if q.sending {
            return;
        }
        q.sending = true;
        drop(q);
        let (fast, channel, queue, timeout) = (
            self.fast.clone(),
            self.channel.clone(),
            self.queue.clone(),
            self.timeout,
        );
        tokio::spawn(async move {
            loop {
                let payloads = {
                    let mut q = queue.lock().unwrap_or_else(|p| p.into_inner());
                    if q.payloads.is_empty() {
                        q.sending = false;
                        return;
                    }
                    std::mem::take(&mut q.payloads)
                };
                for chunk in payloads.chunks(NOTIFY_BATCH) {
                    let sent = tokio::time::timeout(timeout, notify_all(&fast, &channel, chunk));
                    match sent.await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => debug!(n = chunk.len(), "NOTIFY not sent: {e}"),
                        Err(_) => debug!(n = chunk.len(), "NOTIFY not sent within {timeout:?}"),
                    }
                }
            }
        });
    }
}

/// One statement that sends every payload of `payloads` on `channel`.
async fn notify_all(fast: &Fast, channel: &str, payloads: &[String]) -> Result<(), HandleError> {
    const SQL: &str = "SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p";
    let handle = fast.handle().await?;
    let client = &handle.conn.client;
    if handle.unnamed {
        client
            .execute_typed(
                SQL,
                &[(&channel, Type::TEXT), (&payloads, Type::TEXT_ARRAY)],
            )
            .await?;
    } else {
        let st = handle.statement(SQL).await?;
        client.execute(&st, &[&channel, &payloads]).await?;
    }
    handle.finish();
    Ok(())
}

/// A call's use of a connection, for the statement functions of the store.
pub(crate) struct Handle {
    conn: Arc<FastConn>,
    finished: bool,
    /// No statement prepared by name (`Fast::unnamed`).
    unnamed: bool,
    /// A handle of [`Fast::exclusive`]: the idle list its connection goes back to, and its
    /// place among those handles.
    back: Option<(Idle, tokio::sync::OwnedSemaphorePermit)>,
}

impl Handle {
    fn new(conn: Arc<FastConn>, unnamed: bool) -> Handle {
        conn.in_flight.fetch_add(1, Ordering::Relaxed);
        Handle {
            conn,
            finished: false,
            unnamed,
            back: None,
        }
    }

    /// The call got its answer: the connection is in a known state.
    pub(crate) fn finish(mut self) {
        self.finished = true;
    }

    /// Whether the connection is closed (the server, or a pooler, went away): a call that
    /// failed on it may be tried again on a new one.
    pub(crate) fn closed(&self) -> bool {
        self.conn.client.is_closed()
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.conn.in_flight.fetch_sub(1, Ordering::Relaxed);
        if !self.finished {
            // Failed, or cut off halfway: the next call opens a new connection.
            self.conn.retired.store(true, Ordering::Relaxed);
        }
        if let Some((idle, _place)) = self.back.take()
            && self.conn.usable()
        {
            idle.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(self.conn.clone());
        }
    }
}

impl Handle {
    async fn statement(&self, sql: &str) -> QueryResult<Statement> {
        let cached = self
            .conn
            .statements
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(sql)
            .cloned();
        if let Some(st) = cached {
            return Ok(st);
        }
        let st = self.conn.client.prepare(sql).await.map_err(failed)?;
        self.conn
            .statements
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(sql.to_owned(), st.clone());
        Ok(st)
    }
}

impl Handle {
    /// The rows of `sql` with `args`: prepared once per connection when `cached`, else
    /// prepared for this call only; behind a transaction pooler sent unnamed with the
    /// arguments' types instead (parsed, bound and run in one round trip, nothing left on
    /// the server connection).
    async fn rows(
        &self,
        sql: &str,
        args: &[Arg<'_>],
        cached: bool,
    ) -> QueryResult<Vec<tokio_postgres::Row>> {
        let client = &self.conn.client;
        let rows = if self.unnamed {
            client.query_typed(sql, &typed(args)).await
        } else if cached {
            let st = self.statement(sql).await?;
            client.query(&st, &params(args)).await
        } else {
            client.query(sql, &params(args)).await
        };
        rows.map_err(failed)
    }

    /// Runs `sql` with `args` as [`Handle::rows`] does: the rows it changed.
    async fn execute(&self, sql: &str, args: &[Arg<'_>], cached: bool) -> QueryResult<usize> {
        let client = &self.conn.client;
        let n = if self.unnamed {
            client.execute_typed(sql, &typed(args)).await
        } else if cached {
            let st = self.statement(sql).await?;
            client.execute(&st, &params(args)).await
        } else {
            client.execute(sql, &params(args)).await
        };
        Ok(usize::try_from(n.map_err(failed)?).unwrap_or(usize::MAX))
    }

    /// One step of a pipeline, as [`SqlConn`]'s method of the same kind runs it.
    async fn step(&self, step: &Step<'_>) -> QueryResult<Done> {
        Ok(match *step {
            Step::Exec(sql, args) => Done::Count(self.execute(sql, args, true).await?),
            Step::Batch(sql) => {
                self.conn.client.batch_execute(sql).await.map_err(failed)?;
                Done::Batch
            }
            Step::Permits(sql, args) => Done::Permits(
                self.rows(sql, args, true)
                    .await?
                    .iter()
                    .map(permit_row)
                    .collect::<QueryResult<_>>()?,
            ),
        })
    }

    /// Runs `sql` uncached and maps each row with `row`.
    async fn unprepared<T>(
        &mut self,
        sql: &str,
        args: &[Arg<'_>],
        row: impl Fn(&tokio_postgres::Row) -> QueryResult<T>,
    ) -> QueryResult<Vec<T>> {
        self.mapped(sql, args, false, row).await
    }

    /// Runs `sql` (prepared once per connection when `cached`) and maps each row with `row`.
    async fn mapped<T>(
        &mut self,
        sql: &str,
        args: &[Arg<'_>],
        cached: bool,
        row: impl Fn(&tokio_postgres::Row) -> QueryResult<T>,
    ) -> QueryResult<Vec<T>> {
        self.rows(sql, args, cached)
            .await?
            .iter()
            .map(row)
            .collect()
    }
}

/// The arguments with their types, as the diesel connections bind them (`BIGINT`, `TEXT`).
fn typed<'a>(args: &'a [Arg<'a>]) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
    args.iter()
        .map(|a| match a {
            Arg::Text(s) => (s as &(dyn ToSql + Sync), Type::TEXT),
            Arg::Int(i) => (i as &(dyn ToSql + Sync), Type::INT8),
        })
        .collect()
}

fn params<'a>(args: &'a [Arg<'a>]) -> Vec<&'a (dyn ToSql + Sync)> {
    args.iter()
        .map(|a| match a {
            Arg::Text(s) => s as &(dyn ToSql + Sync),
            Arg::Int(i) => i as &(dyn ToSql + Sync),
        })
        .collect()
}

fn permit_row(r: &tokio_postgres::Row) -> QueryResult<crate::rows::PermitRow> {
    Ok(crate::rows::PermitRow {
        now_ms: get(r, "now_ms")?,
        contender: get(r, "contender")?,
        permits: get(r, "permits")?,
        ticket: get(r, "ticket")?,
        acquired_at: get(r, "acquired_at")?,
        ttl_at: get(r, "ttl_at")?,
        transition_at: get(r, "transition_at")?,
        fence: get(r, "fence")?,
    })
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
        self.execute(sql, args, true)
    }

    /// Not prepared nor cached: the text changes from call to call.
    fn exec_varying<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = QueryResult<usize>> + Send + 'a {
        self.execute(sql, args, false)
    }

    fn load_owner<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = QueryResult<Vec<OwnerRow>>> + Send + 'a {
        async move {
            let rows = self.rows(sql, args, true).await?;
            rows.iter()
                .map(|r| {
                    Ok(OwnerRow {
                        now_ms: get(r, "now_ms")?,
                        owner_id: get(r, "owner_id")?,
                        acquired_at: get(r, "acquired_at")?,
                        ttl_at: get(r, "ttl_at")?,
                        transition_at: get(r, "transition_at")?,
                        version: get(r, "version")?,
                        waiter_id: get(r, "waiter_id")?,
                    })
                })
                .collect()
        }
    }

    /// Not prepared nor cached: a batch's text changes with its size.
    fn load_batch<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = QueryResult<Vec<BatchRow>>> + Send + 'a {
        self.unprepared(sql, args, |r| {
            Ok(BatchRow {
                now_ms: get(r, "now_ms")?,
                mutex: get(r, "mutex")?,
                owner_id: get(r, "owner_id")?,
                acquired_at: get(r, "acquired_at")?,
                ttl_at: get(r, "ttl_at")?,
                transition_at: get(r, "transition_at")?,
                version: get(r, "version")?,
            })
        })
    }

    fn batch<'a>(&'a mut self, sql: &'a str) -> impl Future<Output = QueryResult<()>> + Send + 'a {
        async move { self.conn.client.batch_execute(sql).await.map_err(failed) }
    }

    /// Not prepared nor cached: run once per migration.
    fn load_columns<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = QueryResult<Vec<ColumnRow>>> + Send + 'a {
        self.unprepared(sql, args, |r| {
            Ok(ColumnRow {
                name: get(r, "name")?,
                data_type: get(r, "data_type")?,
                width: get(r, "width")?,
                is_unsigned: get(r, "is_unsigned")?,
            })
        })
    }

    /// Not prepared nor cached: run once.
    fn load_text<'a>(
        &'a mut self,
        sql: &'a str,
    ) -> impl Future<Output = QueryResult<Vec<TextRow>>> + Send + 'a {
        self.unprepared(sql, &[], |r| {
            Ok(TextRow {
                value: get(r, "value")?,
            })
        })
    }

    /// Prepared once per connection, as every statement of a semaphore's is.
    fn load_permits<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = QueryResult<Vec<crate::rows::PermitRow>>> + Send + 'a {
        self.mapped(sql, args, true, permit_row)
    }

    /// Behind a transaction pooler the steps go one after another: a pooler may hand
    /// statements outside a transaction to different server connections.
    fn pipelines(&self) -> bool {
        !self.unnamed
    }

    /// Every step sent at once: tokio-postgres sends a request when its future is first
    /// polled, and `join_all` polls them first in the steps' order.
    fn pipeline<'a>(
        &'a mut self,
        steps: &'a [Step<'a>],
    ) -> impl Future<Output = QueryResult<Vec<Done>>> + Send + 'a {
        async move {
            let this = &*self;
            if this.unnamed {
                let mut done = Vec::with_capacity(steps.len());
                for step in steps {
                    done.push(this.step(step).await?);
                }
                return Ok(done);
            }
            // Prepared first, all of them: a step whose statement is still to be prepared
            // would send its execution a round trip after the steps behind it sent theirs,
            // out of order.
            let texts = steps.iter().filter_map(|s| match *s {
                Step::Exec(sql, _) | Step::Permits(sql, _) => Some(sql),
                Step::Batch(_) => None,
            });
            futures_util::future::join_all(texts.map(|sql| this.statement(sql)))
                .await
                .into_iter()
                .collect::<QueryResult<Vec<_>>>()?;
            let mut done = Vec::with_capacity(steps.len());
            // `join_all` polls more than a few futures through a queue: in chunks, each
            // chunk's steps first polled in order.
            for chunk in steps.chunks(PIPELINE_CHUNK) {
                let results = futures_util::future::join_all(chunk.iter().map(|s| this.step(s)));
                for result in results.await {
                    done.push(result?);
                }
            }
            Ok(done)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A pipeline runs its steps in their order, also when a step's statement is not
    /// prepared yet and a later one's is (a step that had to prepare first would otherwise
    /// run after the steps behind it): the `UPDATE` finds the row the `INSERT` before it
    /// made.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pipeline_runs_its_steps_in_order_when_some_are_not_prepared_yet() {
        let server = simba_test_kit::servers::postgres()
            .await
            .unwrap_or_else(|e| panic!("no PostgreSQL for the tests: {e}"));
        let pg = Arc::new(Connector::new(server.url()).expect("connector"));
        let fast = Fast::new(pg, Duration::from_secs(10), false, 1);
        let mut c = fast.exclusive().await.expect("a connection");
        c.batch("CREATE TEMPORARY TABLE pipeline_order (n BIGINT)")
            .await
            .expect("table");
        let (insert, update) = (
            "INSERT INTO pipeline_order (n) VALUES ($1)",
            "UPDATE pipeline_order SET n = n + 1 WHERE n = $1",
        );
        // Only the later statement is prepared (and cached) before the pipeline.
        assert_eq!(
            c.exec(update, &[Arg::Int(1)]).await.expect("update"),
            0,
            "no row yet"
        );
        let one = [Arg::Int(1)];
        let done = c
            .pipeline(&[
                Step::Batch("BEGIN"),
                Step::Exec(insert, &one),
                Step::Exec(update, &one),
                Step::Batch("COMMIT"),
            ])
            .await
            .expect("pipeline");
        let counts: Vec<usize> = done.iter().map(Done::count).collect();
        assert_eq!(counts, [0, 1, 1, 0], "the update ran before the insert");
        c.finish();
    }
}
