//! PostgreSQL's fast path for the statements of a handoff (acquire, release): one
//! tokio-postgres connection per store whose statements are prepared once and then run
//! in one round trip each, pipelined when several run at once. (diesel's `sql_query`
//! prepares and plans every statement anew on every call.) Any failure closes the
//! connection; the next call opens a new one.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use diesel::result::{DatabaseErrorKind, Error as DieselError, QueryResult};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

use super::Connector;
use crate::conn::{Arg, BatchRow, OwnerRow, SqlConn};
use crate::schema::ColumnRow;

pub(crate) struct FastConn {
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
pub(crate) struct Fast {
    pg: Arc<Connector>,
    setup: String,
    conn: tokio::sync::Mutex<Option<Arc<FastConn>>>,
}

impl Fast {
    pub(crate) fn new(pg: Arc<Connector>, statement_timeout: Duration) -> Self {
        Fast {
            pg,
            setup: format!("SET statement_timeout = {}", statement_timeout.as_millis()),
            conn: tokio::sync::Mutex::new(None),
        }
    }

    /// The open connection, or a new one.
    pub(crate) async fn handle(&self) -> Result<Handle, String> {
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
    pub(crate) async fn reset_any(&self) {
        *self.conn.lock().await = None;
    }
}

/// A use of the connection, for the statement functions of the store.
pub(crate) struct Handle(Arc<FastConn>);

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

impl Handle {
    /// Runs `sql` as sent (no prepared statement) and maps each row with `row`.
    async fn unprepared<T>(
        &mut self,
        sql: &str,
        args: &[Arg<'_>],
        row: impl Fn(&tokio_postgres::Row) -> QueryResult<T>,
    ) -> QueryResult<Vec<T>> {
        let rows = self
            .0
            .client
            .query(sql, &params(args))
            .await
            .map_err(failed)?;
        rows.iter().map(row).collect()
    }

    /// Runs `statement` (prepared, or text prepared unnamed for this call) with `args`:
    /// the rows it changed.
    async fn execute<T>(&self, statement: &T, args: &[Arg<'_>]) -> QueryResult<usize>
    where
        T: tokio_postgres::ToStatement + ?Sized + Sync,
    {
        let n = self
            .0
            .client
            .execute(statement, &params(args))
            .await
            .map_err(failed)?;
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
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
            self.execute(&st, args).await
        }
    }

    /// Not prepared nor cached: the text changes from call to call.
    fn exec_varying<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = QueryResult<usize>> + Send + 'a {
        self.execute(sql, args)
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
        async move { self.0.client.batch_execute(sql).await.map_err(failed) }
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
    /// Not prepared nor cached (semaphores run on the pool, not here).
    fn load_permits<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = QueryResult<Vec<crate::store::permits::PermitRow>>> + Send + 'a {
        self.unprepared(sql, args, |r| {
            Ok(crate::store::permits::PermitRow {
                now_ms: get(r, "now_ms")?,
                contender: get(r, "contender")?,
                permits: get(r, "permits")?,
                ticket: get(r, "ticket")?,
                acquired_at: get(r, "acquired_at")?,
                ttl_at: get(r, "ttl_at")?,
                transition_at: get(r, "transition_at")?,
                fence: get(r, "fence")?,
            })
        })
    }
}
