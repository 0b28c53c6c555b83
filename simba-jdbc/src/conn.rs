//! A store's connections, whatever the dialect: the bound values of a statement, the
//! connection trait every dialect's connection implements ([`SqlConn`]) and the pooled
//! connection that is closed unless its call completed ([`Checked`]). The statement
//! functions are `crate::call`'s, the rows `crate::rows`'.

use std::future::Future;

use deadpool::managed::Manager;
use diesel::backend::Backend as DieselBackend;
use diesel::query_builder::{BoxedSqlQuery, SqlQuery};
use diesel::result::QueryResult;
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, HasSqlType, Text};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::pooled_connection::deadpool::Object;

use crate::rows::{BatchRow, OwnerRow, TextRow};

/// One bound value of a statement.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg<'a> {
    Text(&'a str),
    Int(i64),
}

pub(crate) fn bind_all<'a, DB>(sql: &str, args: &[Arg<'a>]) -> BoxedSqlQuery<'a, DB, SqlQuery>
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

/// A statement with `?` placeholders and its bound values, which the connection may
/// prepare once and keep (diesel's statement cache, keyed by the text): unlike diesel's
/// `sql_query`, which is prepared anew on every call. For the statements whose text is
/// fixed (one per kind of call) on MySQL and SQLite; not for the batched renewal, whose
/// text varies with its size, nor for PostgreSQL (its `$n` placeholders: its hot calls
/// have prepared statements of their own, `crate::postgres::fast`).
///
/// The placeholders are written by diesel's query builder as it walks the text (`?` on
/// MySQL and SQLite), one per bound value in order, so the text must hold no `?` outside
/// placeholders (none of `crate::sql`'s does).
#[cfg_attr(not(any(feature = "sqlite", feature = "mysql")), allow(dead_code))]
pub(crate) struct Prepared<'a> {
    pub(crate) sql: &'a str,
    pub(crate) args: &'a [Arg<'a>],
}

impl diesel::query_builder::QueryId for Prepared<'_> {
    type QueryId = ();
    // No type of its own: the statement cache keys it by its text and bind types.
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<DB> diesel::query_builder::QueryFragment<DB> for Prepared<'_>
where
    DB: DieselBackend + HasSqlType<Text> + HasSqlType<BigInt>,
    for<'b> &'b str: ToSql<Text, DB>,
    i64: ToSql<BigInt, DB>,
{
    fn walk_ast<'b>(
        &'b self,
        mut out: diesel::query_builder::AstPass<'_, 'b, DB>,
    ) -> QueryResult<()> {
        let mut parts = self.sql.split('?');
        if let Some(first) = parts.next() {
            out.push_sql(first);
        }
        let mut args = self.args.iter();
        for part in parts {
            match args.next() {
                Some(Arg::Text(s)) => out.push_bind_param::<Text, _>(s)?,
                Some(Arg::Int(i)) => out.push_bind_param::<BigInt, _>(i)?,
                None => {
                    return Err(diesel::result::Error::QueryBuilderError(
                        "more placeholders than bound values".into(),
                    ));
                }
            }
            out.push_sql(part);
        }
        if args.next().is_some() {
            return Err(diesel::result::Error::QueryBuilderError(
                "more bound values than placeholders".into(),
            ));
        }
        Ok(())
    }
}

impl diesel::query_builder::Query for Prepared<'_> {
    type SqlType = diesel::sql_types::Untyped;
}

impl<Conn> diesel::RunQueryDsl<Conn> for Prepared<'_> {}

/// A statement the connection keeps prepared ([`Prepared`]); `DB` only matches
/// [`bind_all`]'s form for `impl_sql_conn!`.
#[allow(clippy::extra_unused_type_parameters)]
#[cfg_attr(not(any(feature = "sqlite", feature = "mysql")), allow(dead_code))]
pub(crate) fn prepared<'a, DB>(sql: &'a str, args: &'a [Arg<'a>]) -> Prepared<'a> {
    Prepared { sql, args }
}

/// A bound value owned, to send to a connection's thread ([`SqlConn::on_thread`]).
#[cfg(feature = "sqlite")]
#[derive(Debug, Clone)]
pub(crate) enum OwnedArg {
    Text(String),
    Int(i64),
}

#[cfg(feature = "sqlite")]
impl OwnedArg {
    pub(crate) fn all(args: &[Arg<'_>]) -> Vec<OwnedArg> {
        args.iter()
            .map(|a| match *a {
                Arg::Text(s) => OwnedArg::Text(s.to_owned()),
                Arg::Int(i) => OwnedArg::Int(i),
            })
            .collect()
    }

    pub(crate) fn borrow(args: &[OwnedArg]) -> Vec<Arg<'_>> {
        args.iter()
            .map(|a| match a {
                OwnedArg::Text(s) => Arg::Text(s),
                OwnedArg::Int(i) => Arg::Int(*i),
            })
            .collect()
    }
}

/// One statement of a [`SqlConn::pipeline`].
pub(crate) enum Step<'a> {
    /// [`SqlConn::exec`]: the rows it changed.
    Exec(&'a str, &'a [Arg<'a>]),
    /// [`SqlConn::batch`] (no arguments, no rows).
    Batch(&'a str),
    /// [`SqlConn::load_permits`].
    Permits(&'a str, &'a [Arg<'a>]),
}

/// What one [`Step`] gave.
pub(crate) enum Done {
    Count(usize),
    Batch,
    Permits(Vec<crate::rows::PermitRow>),
}

impl Done {
    /// The rows a [`Step::Exec`] changed (0 for another step).
    pub(crate) fn count(&self) -> usize {
        match self {
            Done::Count(n) => *n,
            Done::Batch | Done::Permits(_) => 0,
        }
    }

    /// The rows of a [`Step::Permits`] (none for another step).
    pub(crate) fn into_permits(self) -> Vec<crate::rows::PermitRow> {
        match self {
            Done::Permits(rows) => rows,
            Done::Count(_) | Done::Batch => Vec::new(),
        }
    }
}

/// What the store needs from a connection, whatever the backend.
pub(crate) trait SqlConn: Send {
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

    /// `exec` of a statement whose text varies from call to call (the batched renewal):
    /// never kept prepared.
    fn exec_varying<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = QueryResult<usize>> + Send + 'a;

    /// Reads the rows of a batched renewal (a statement whose text varies with the batch:
    /// never kept prepared).
    fn load_batch<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = QueryResult<Vec<BatchRow>>> + Send + 'a;

    fn batch<'a>(&'a mut self, sql: &'a str) -> impl Future<Output = QueryResult<()>> + Send + 'a;

    fn load_columns<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = QueryResult<Vec<crate::schema::ColumnRow>>> + Send + 'a;

    /// Rows of one text column named `value` (a statement run once: never kept prepared).
    fn load_text<'a>(
        &'a mut self,
        sql: &'a str,
    ) -> impl Future<Output = QueryResult<Vec<TextRow>>> + Send + 'a;

    /// Rows of the permits table (semaphores).
    fn load_permits<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = QueryResult<Vec<crate::rows::PermitRow>>> + Send + 'a;

    /// Whether [`SqlConn::pipeline`] sends its steps together (one round trip for all).
    fn pipelines(&self) -> bool {
        false
    }

    /// Runs `steps` in order and returns what each gave. Where the connection pipelines
    /// (PostgreSQL's fast path) they are sent together and answered in one round trip:
    /// the server still runs them one after another, each statement reading what the ones
    /// before it did (every statement of a `READ COMMITTED` transaction takes its own
    /// snapshot when it starts, so a read sent behind a row lock sees the database as it is
    /// once the lock is granted). Elsewhere one after another, stopping at the first
    /// failure. The result is the first failure; on a pipelining connection the steps after
    /// a failed one were sent too, so steps that must not outlive a failure belong in a
    /// transaction (a failed statement aborts it, and its `COMMIT` then rolls back).
    fn pipeline<'a>(
        &'a mut self,
        steps: &'a [Step<'a>],
    ) -> impl Future<Output = QueryResult<Vec<Done>>> + Send + 'a {
        async move {
            let mut done = Vec::with_capacity(steps.len());
            for step in steps {
                done.push(match *step {
                    Step::Exec(sql, args) => Done::Count(self.exec(sql, args).await?),
                    Step::Batch(sql) => {
                        self.batch(sql).await?;
                        Done::Batch
                    }
                    Step::Permits(sql, args) => Done::Permits(self.load_permits(sql, args).await?),
                });
            }
            Ok(done)
        }
    }

    /// Whether the connection runs its statements on a thread of its own (SQLite): then a
    /// call's statements go there together, in one hop ([`SqlConn::on_thread`]).
    // Read only by code that a build without any backend feature leaves out.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    const THREADED: bool = false;

    /// Runs `work` with the SQLite connection on its thread, in one hop; an error where
    /// the connection has no thread (only called when [`SqlConn::THREADED`]).
    #[cfg(feature = "sqlite")]
    fn on_thread<'a, R: Send + 'static>(
        &'a mut self,
        work: impl FnOnce(&mut diesel::SqliteConnection) -> QueryResult<R> + Send + 'static,
    ) -> impl Future<Output = QueryResult<R>> + Send + 'a {
        drop(work);
        std::future::ready(Err(diesel::result::Error::QueryBuilderError(
            "this connection runs no statements on a thread of its own".into(),
        )))
    }
}

/// Implements [`SqlConn`] for a diesel-async connection type `$conn` of backend `$db`
/// (each dialect module for its own connection), its statements of fixed text built by
/// `$query` ([`bind_all`]: prepared on every call; [`prepared`]: kept prepared by the
/// connection), with the `$extra` items (SQLite's thread) in the impl.
macro_rules! impl_sql_conn {
    ($conn:ty, $db:ty, $query:ident { $($extra:item)* }) => {
        impl $crate::conn::SqlConn for $conn {
            fn exec<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [$crate::conn::Arg<'a>],
            ) -> impl ::std::future::Future<Output = ::diesel::result::QueryResult<usize>> + Send + 'a {
                let q = $crate::conn::$query::<$db>(sql, args);
                async move { diesel_async::RunQueryDsl::execute(q, self).await }
            }

            fn exec_varying<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [$crate::conn::Arg<'a>],
            ) -> impl ::std::future::Future<Output = ::diesel::result::QueryResult<usize>> + Send + 'a {
                let q = $crate::conn::bind_all::<$db>(sql, args);
                async move { diesel_async::RunQueryDsl::execute(q, self).await }
            }

            fn load_owner<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [$crate::conn::Arg<'a>],
            ) -> impl ::std::future::Future<Output = ::diesel::result::QueryResult<Vec<$crate::rows::OwnerRow>>> + Send + 'a {
                let q = $crate::conn::$query::<$db>(sql, args);
                async move { diesel_async::RunQueryDsl::load::<$crate::rows::OwnerRow>(q, self).await }
            }

            fn load_batch<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [$crate::conn::Arg<'a>],
            ) -> impl ::std::future::Future<Output = ::diesel::result::QueryResult<Vec<$crate::rows::BatchRow>>> + Send + 'a {
                let q = $crate::conn::bind_all::<$db>(sql, args);
                async move { diesel_async::RunQueryDsl::load::<$crate::rows::BatchRow>(q, self).await }
            }

            fn batch<'a>(
                &'a mut self,
                sql: &'a str,
            ) -> impl ::std::future::Future<Output = ::diesel::result::QueryResult<()>> + Send + 'a {
                ::diesel_async::SimpleAsyncConnection::batch_execute(self, sql)
            }

            fn load_columns<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [$crate::conn::Arg<'a>],
            ) -> impl ::std::future::Future<Output = ::diesel::result::QueryResult<Vec<$crate::schema::ColumnRow>>> + Send + 'a {
                let q = $crate::conn::bind_all::<$db>(sql, args);
                async move { diesel_async::RunQueryDsl::load::<$crate::schema::ColumnRow>(q, self).await }
            }

            fn load_text<'a>(
                &'a mut self,
                sql: &'a str,
            ) -> impl ::std::future::Future<Output = ::diesel::result::QueryResult<Vec<$crate::rows::TextRow>>> + Send + 'a {
                let q = $crate::conn::bind_all::<$db>(sql, &[]);
                async move { diesel_async::RunQueryDsl::load::<$crate::rows::TextRow>(q, self).await }
            }

            fn load_permits<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [$crate::conn::Arg<'a>],
            ) -> impl ::std::future::Future<Output = ::diesel::result::QueryResult<Vec<$crate::rows::PermitRow>>> + Send + 'a {
                let q = $crate::conn::$query::<$db>(sql, args);
                async move { diesel_async::RunQueryDsl::load::<$crate::rows::PermitRow>(q, self).await }
            }

            $($extra)*
        }
    };
}
pub(crate) use impl_sql_conn;

/// A pooled connection that is closed, not returned to the pool, unless the call that
/// used it completed: a call cut off by a timeout (or a dropped future) may have left the
/// connection mid-protocol.
pub(crate) struct Checked<C>
where
    AsyncDieselConnectionManager<C>: Manager<Type = C>,
{
    pub(crate) obj: Option<Object<C>>,
    pub(crate) discard: bool,
}

impl<C> Checked<C>
where
    AsyncDieselConnectionManager<C>: Manager<Type = C>,
{
    pub(crate) fn conn(&mut self) -> Option<&mut C> {
        self.obj.as_deref_mut()
    }

    pub(crate) fn reused(&self) -> bool {
        self.obj
            .as_ref()
            .is_some_and(|o| Object::metrics(o).recycle_count > 0)
    }

    pub(crate) fn keep(&mut self) {
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
