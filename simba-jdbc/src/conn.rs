//! The statements of a store on one connection, whatever the dialect: the bound values,
//! the row an owner read returns, the connection trait every dialect's connection
//! implements ([`SqlConn`]), the statement functions ([`Call`]) and the pooled connection
//! that is closed unless its call completed ([`Checked`]).

use std::future::Future;

use deadpool::managed::Manager;
use diesel::QueryableByName;
use diesel::backend::Backend as DieselBackend;
use diesel::query_builder::{BoxedSqlQuery, SqlQuery};
use diesel::result::QueryResult;
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, HasSqlType, Nullable, Text};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::pooled_connection::deadpool::Object;
use simba_core::backend::{Lease, held_owner_id};

use crate::sql::{OneStatement, Statements};

/// How a contender may run its acquisition, as its gate decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// This process holds the native lock for the contender: it may take a free row (and
    /// on SQLite the row of an owner whose process is gone, if that owner's gated flag is
    /// this value: the identity of the database file this lock is on, see
    /// `crate::native::Held::mark`). The contender writes the value to its row's gated flag.
    Locked(i64),
    /// It does not: it may renew its own row, and take a row only when its owner's lease
    /// has run out (never a released one: that belongs to whoever holds the native lock).
    Unlocked,
}

/// One bound value of a statement.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg<'a> {
    Text(&'a str),
    Int(i64),
}

/// The row every owner read returns: the database's time, and the mutex's row if any.
/// It comes from a server: [`owner_reply`](crate::store::owner_reply) trusts none of it (the fuzz target `sql_row`
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
    /// The id simba wrote beside its own ownerships (see `schema`, *foreign owners*): an
    /// owner whose id differs took the row without simba (the JVM library).
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) waiter_id: Option<String>,
}

/// A row of one text column `value` (the server's version).
#[derive(Debug, Clone, QueryableByName)]
pub(crate) struct TextRow {
    #[diesel(sql_type = Text)]
    pub(crate) value: String,
}

/// A row of the batched renewal's read: the database's time, and one row of the batch
/// (all `None` when no row of the batch exists).
#[derive(Debug, Clone, QueryableByName)]
pub(crate) struct BatchRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) now_ms: i64,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) mutex: Option<String>,
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
    ) -> impl Future<Output = QueryResult<Vec<crate::store::permits::PermitRow>>> + Send + 'a;

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
            ) -> impl ::std::future::Future<Output = ::diesel::result::QueryResult<Vec<$crate::conn::OwnerRow>>> + Send + 'a {
                let q = $crate::conn::$query::<$db>(sql, args);
                async move { diesel_async::RunQueryDsl::load::<$crate::conn::OwnerRow>(q, self).await }
            }

            fn load_batch<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [$crate::conn::Arg<'a>],
            ) -> impl ::std::future::Future<Output = ::diesel::result::QueryResult<Vec<$crate::conn::BatchRow>>> + Send + 'a {
                let q = $crate::conn::bind_all::<$db>(sql, args);
                async move { diesel_async::RunQueryDsl::load::<$crate::conn::BatchRow>(q, self).await }
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
            ) -> impl ::std::future::Future<Output = ::diesel::result::QueryResult<Vec<$crate::conn::TextRow>>> + Send + 'a {
                let q = $crate::conn::bind_all::<$db>(sql, &[]);
                async move { diesel_async::RunQueryDsl::load::<$crate::conn::TextRow>(q, self).await }
            }

            fn load_permits<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [$crate::conn::Arg<'a>],
            ) -> impl ::std::future::Future<Output = ::diesel::result::QueryResult<Vec<$crate::store::permits::PermitRow>>> + Send + 'a {
                let q = $crate::conn::$query::<$db>(sql, args);
                async move { diesel_async::RunQueryDsl::load::<$crate::store::permits::PermitRow>(q, self).await }
            }

            $($extra)*
        }
    };
}
pub(crate) use impl_sql_conn;

/// The per-call context the statement functions need.
pub(crate) struct Call<'a> {
    pub(crate) st: &'a Statements,
    pub(crate) mutex: &'a str,
    /// The acquisition in one statement, where the server runs it (MariaDB ≥ 10.5).
    pub(crate) one: Option<&'a OneStatement>,
}

impl Call<'_> {
    pub(crate) async fn select<C: SqlConn>(&self, c: &mut C) -> QueryResult<Option<OwnerRow>> {
        Ok(c.load_owner(&self.st.select, &[Arg::Text(self.mutex)])
            .await?
            .pop())
    }

    /// Acquire: one conditional UPDATE on the database clock, which may take a free row
    /// only with the native lock ([`Pass::Locked`]), then the owner and the database's
    /// time (PostgreSQL and MariaDB: all in one statement, MariaDB's inserting the row of a
    /// first use too). Inserts the row first when it does not exist yet. On SQLite a
    /// contender without the native lock reads first and writes only when its UPDATE could
    /// change the row. `job`: on SQLite, the gated flag of the rows whose owner's job still
    /// runs (`Statements::file_marks`), if one does.
    pub(crate) async fn acquire<C: SqlConn>(
        &self,
        c: &mut C,
        me: &str,
        lease: Lease,
        pass: Pass,
        job: Option<i64>,
    ) -> QueryResult<Option<OwnerRow>> {
        let ttl = lease.ttl_ms();
        let total = ttl.saturating_add(lease.transition_ms());
        let (sql, gated) = match pass {
            Pass::Locked(mark) => (&self.st.acquire_locked, mark),
            Pass::Unlocked => (&self.st.acquire_unlocked, 0),
        };
        let mut args = Vec::with_capacity(12);
        if self.st.waiter_columns {
            args.extend([Arg::Text(me), Arg::Text(me), Arg::Int(gated)]);
        }
        args.extend([
            Arg::Text(me),
            Arg::Text(me),
            Arg::Int(ttl),
            Arg::Int(total),
            Arg::Text(me),
            Arg::Text(self.mutex),
            Arg::Text(me),
        ]);
        match pass {
            Pass::Unlocked => args.push(Arg::Int(total)),
            // SQLite: the gated rows this lock may take over at once.
            Pass::Locked(mark) if self.st.file_marks => args.push(Arg::Int(mark)),
            Pass::Locked(_) => {}
        }
        if self.st.file_marks {
            // The gated flag of the rows a running job keeps; -1 matches no row.
            args.push(Arg::Int(job.unwrap_or(-1)));
        }
        if self.st.returns_row {
            args.push(Arg::Text(self.mutex));
        }
        let first = OwnedRow {
            ttl,
            total,
            gated,
            waiter_columns: self.st.waiter_columns,
        };
        if let Some(one) = self.one {
            // MariaDB: the insert of a first use, the UPDATE and the read, in one statement.
            let (sql, graces) = match pass {
                Pass::Locked(_) => (&one.locked, 0),
                Pass::Unlocked => (&one.unlocked, one.grace_args),
            };
            let mut args = first.args(self.mutex, me);
            args.extend(std::iter::repeat_n(Arg::Int(total), graces));
            return Ok(c.load_owner(sql, &args).await?.pop());
        }
        #[cfg(feature = "sqlite")]
        if C::THREADED && !self.st.returns_row {
            // All of it on the connection's thread, in one hop (a hop costs more than
            // SQLite's work on a statement, and the store's turn is held meanwhile).
            let statements = AcquireOnThread {
                acquire: sql.clone(),
                insert_owned: self.st.insert_owned.clone(),
                select: self.st.select.clone(),
                mutex: self.mutex.to_owned(),
                me: me.to_owned(),
                args: OwnedArg::all(&args),
                first,
                unlocked_grace: (pass == Pass::Unlocked).then_some(total),
            };
            return c.on_thread(move |conn| statements.run(conn)).await;
        }
        let row = self.run_acquire(c, sql, &args).await?;
        if row.as_ref().is_some_and(|r| r.owner_id.is_some()) {
            return Ok(row);
        }
        // First use of this mutex: its row inserted already owned (one commit). A racing
        // insert that came first leaves its row, which the UPDATE then decides on.
        c.exec(&self.st.insert_owned, &first.args(self.mutex, me))
            .await?;
        let row = self.select(c).await?;
        if owned_by(&row, me) {
            return Ok(row);
        }
        self.run_acquire(c, sql, &args).await
    }

    pub(crate) async fn run_acquire<C: SqlConn>(
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

    /// Release with a hold: one owner-checked UPDATE that hands the ownership to the hold's
    /// id until `now + hold_ms` on the database clock.
    pub(crate) async fn release_after<C: SqlConn>(
        &self,
        c: &mut C,
        me: &str,
        hold_ms: i64,
    ) -> QueryResult<bool> {
        let holder = held_owner_id(me);
        let args = [
            Arg::Text(&holder),
            Arg::Int(hold_ms),
            Arg::Int(hold_ms),
            Arg::Text(self.mutex),
            Arg::Text(me),
        ];
        Ok(c.exec(&self.st.release_after, &args).await? > 0)
    }

    /// Release: owner-checked UPDATE.
    pub(crate) async fn release<C: SqlConn>(&self, c: &mut C, me: &str) -> QueryResult<bool> {
        let args = [Arg::Text(self.mutex), Arg::Text(me)];
        Ok(c.exec(&self.st.release, &args).await? > 0)
    }
}

/// What [`Statements::insert_owned`] writes besides the names: the ttl and the
/// ttl+transition in ms, the gated flag, and whether the table has the waiter columns.
#[derive(Debug, Clone, Copy)]
struct OwnedRow {
    ttl: i64,
    total: i64,
    gated: i64,
    waiter_columns: bool,
}

impl OwnedRow {
    /// The arguments of [`Statements::insert_owned`].
    fn args<'b>(&self, mutex: &'b str, me: &'b str) -> Vec<Arg<'b>> {
        let mut args = vec![
            Arg::Text(mutex),
            Arg::Int(self.ttl),
            Arg::Int(self.total),
            Arg::Text(me),
        ];
        if self.waiter_columns {
            args.extend([Arg::Text(me), Arg::Int(self.gated)]);
        }
        args
    }
}

/// Whether the row read after the owned insert is `me`'s: the insert made it, else
/// another contender's insert came first and the acquire `UPDATE` decides.
fn owned_by(row: &Option<OwnerRow>, me: &str) -> bool {
    row.as_ref()
        .is_some_and(|r| r.owner_id.as_deref() == Some(me))
}

/// [`Call::acquire`]'s statements on a SQLite connection's thread: the conditional
/// UPDATE and the owner read, and on a mutex's first use the owned insert of its row, the
/// read, and when another's insert came first both again.
#[cfg(feature = "sqlite")]
struct AcquireOnThread {
    acquire: String,
    insert_owned: String,
    select: String,
    mutex: String,
    me: String,
    args: Vec<OwnedArg>,
    first: OwnedRow,
    /// Without the native lock ([`Pass::Unlocked`]): the grace of a released row.
    unlocked_grace: Option<i64>,
}

#[cfg(feature = "sqlite")]
impl AcquireOnThread {
    fn run(&self, conn: &mut diesel::SqliteConnection) -> QueryResult<Option<OwnerRow>> {
        use diesel::RunQueryDsl;
        let key = [Arg::Text(&self.mutex)];
        let read = |conn: &mut diesel::SqliteConnection| -> QueryResult<Option<OwnerRow>> {
            Ok(Prepared {
                sql: &self.select,
                args: &key,
            }
            .load::<OwnerRow>(conn)?
            .pop())
        };
        let args = OwnedArg::borrow(&self.args);
        let attempt = |conn: &mut diesel::SqliteConnection| -> QueryResult<Option<OwnerRow>> {
            Prepared {
                sql: &self.acquire,
                args: &args,
            }
            .execute(conn)?;
            read(conn)
        };
        if let Some(grace) = self.unlocked_grace {
            // Without the native lock a contender mostly loses (it renews, or takes a row
            // whose lease ran out): read first, and write only when the UPDATE could
            // change the row. An UPDATE that changes nothing still takes SQLite's one
            // write lock, and the contender that holds the native lock, writing at the
            // same instant, would find it busy and sleep in SQLite's busy handler (1 ms
            // first), which is most of a handoff's tail. When the UPDATE runs, it decides.
            let row = read(conn)?;
            if let Some(r) = &row
                && r.owner_id.is_some()
                && !unlocked_may_change(r, &self.me, grace)
            {
                return Ok(row);
            }
        }
        let row = attempt(conn)?;
        if row.as_ref().is_some_and(|r| r.owner_id.is_some()) {
            return Ok(row);
        }
        // First use of this mutex, as in `Call::acquire`.
        Prepared {
            sql: &self.insert_owned,
            args: &self.first.args(&self.mutex, &self.me),
        }
        .execute(conn)?;
        let row = read(conn)?;
        if owned_by(&row, &self.me) {
            return Ok(row);
        }
        attempt(conn)
    }
}

/// Whether the acquire `UPDATE` without the native lock ([`Pass::Unlocked`]) would change
/// `row` as read at its `now_ms`: `me` owns it within its lease (a renewal), or its lease
/// is over and it is not a row released less than `grace` ms ago (the `WHERE` of
/// `Statements::acquire_unlocked`). `true` when a column is missing: the `UPDATE` decides.
#[cfg(feature = "sqlite")]
fn unlocked_may_change(row: &OwnerRow, me: &str, grace: i64) -> bool {
    let (Some(owner), Some(transition_at)) = (row.owner_id.as_deref(), row.transition_at) else {
        return true;
    };
    let now = row.now_ms;
    let own = owner == me && transition_at > now;
    let take =
        transition_at <= now && (!owner.is_empty() || transition_at <= now.saturating_sub(grace));
    own || take
}

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

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::{OwnerRow, unlocked_may_change};

    fn row(owner: &str, transition_at: i64) -> OwnerRow {
        OwnerRow {
            now_ms: 10_000,
            owner_id: Some(owner.to_owned()),
            acquired_at: Some(1),
            ttl_at: Some(transition_at),
            transition_at: Some(transition_at),
            version: Some(1),
            waiter_id: Some(owner.to_owned()),
        }
    }

    #[test]
    fn an_unlocked_acquire_writes_only_where_its_update_would_change_the_row() {
        let grace = 3_000;
        // Its own row within the lease: a renewal.
        assert!(unlocked_may_change(&row("me", 10_001), "me", grace));
        // Another's row within its lease: nothing to do.
        assert!(!unlocked_may_change(&row("other", 10_001), "me", grace));
        // Another's lease ran out (at now exactly, too): a takeover.
        assert!(unlocked_may_change(&row("other", 10_000), "me", grace));
        // Its own lease ran out: taken again like any other.
        assert!(unlocked_may_change(&row("me", 9_000), "me", grace));
        // Released less than the grace ago: the native lock's holder's.
        assert!(!unlocked_may_change(&row("", 9_000), "me", grace));
        // Released the grace ago or more: anyone's.
        assert!(unlocked_may_change(&row("", 7_000), "me", grace));
        // A column missing: the UPDATE decides.
        let mut missing = row("other", 10_001);
        missing.transition_at = None;
        assert!(unlocked_may_change(&missing, "me", grace));
    }
}
