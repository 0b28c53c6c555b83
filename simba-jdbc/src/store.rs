//! [`SqlStore`]: the [`LeaseStore`] over a SQL table.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use simba_core::backend::{Lease, LeaseReply, LeaseStore, PermitStore, hold_millis};
use simba_core::events::EventReceiver;
use simba_core::{Error, Result, check_common_contender_id, check_common_mutex_name};
use tracing::{debug, info, warn};

use crate::call::{Call, Pass};
use crate::config::{Backend, SqlConfig, Target, redact_url};
use crate::conn::{Arg, Checked, SqlConn};
use crate::dialect::{Dialect, notify_acquired, notify_released, on_pool, with_fast};
use crate::gate::Gates;
use crate::rows::{OwnerRow, owner_reply};
use crate::schema::{self, Shape};
use failure::Failure;
use table::Table;

/// The shortest bound for a migration (DDL may wait for metadata locks).
const MIGRATE_TIMEOUT_MIN: Duration = Duration::from_secs(30);

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
        on_conn!(@pooled inner, |$c| $body, on_pool!(renew &inner.dialect, |p| on_conn!(@run inner, p, |$c| $body)))
    }};
    // Behind a transaction pooler, on a connection of PostgreSQL's fast path that the call
    // has to itself (a diesel connection prepares statements by name); else `$else`.
    (@pooled $inner:expr, |$c:ident| $body:expr, $else:expr) => {{
        let pooled = $crate::dialect::with_pooled!(&$inner.dialect, |fast| on_handle!(fast.exclusive(), |$c| $body));
        match pooled {
            Some(result) => result,
            None => $else,
        }
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
        on_conn!(@pooled inner, |$c| $body, on_pool!(&inner.dialect, |p| on_conn!(@run inner, p, |$c| $body)))
    }};
}

/// Runs `$body` on a connection of PostgreSQL's fast path that `$get` hands out (shared,
/// or the call's own), and once more on a new one if the first was found closed (after a
/// restart of the server or of a pooler every open connection is): every call is safe to
/// repeat, as in [`on_conn!`].
// Without PostgreSQL there is no fast path to run on.
#[cfg_attr(not(feature = "postgres"), allow(unused_macros))]
macro_rules! on_handle {
    ($get:expr, |$c:ident| $body:expr) => {{
        let mut tries = 0u32;
        loop {
            tries += 1;
            let mut handle = match $get.await {
                Ok(h) => h,
                Err(e) => break Err(Failure::Connect(e.to_string(), e.into())),
            };
            let result = {
                let $c = &mut handle;
                $body.await
            };
            match result {
                Ok(v) => {
                    handle.finish();
                    break Ok(v);
                }
                Err(e) if tries == 1 && handle.closed() => {
                    debug!("statement failed on a closed connection, retrying on a new one: {e}");
                }
                Err(e) => break Err(Failure::Query(e)),
            }
        }
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
                    on_handle!(fast.handle(), |$c| $body)
                })
                .await
        });
        match done {
            Some(result) => result,
            None => run!(inner, $what, |$c| $body),
        }
    }};
}

/// Runs `$body` (a transaction, or statements that read what one wrote) on a connection
/// the call has to itself: on PostgreSQL one of the fast path's ([`Fast::exclusive`],
/// statements prepared once per connection), elsewhere as [`on_conn!`] does.
///
/// [`Fast::exclusive`]: crate::postgres::Fast::exclusive
macro_rules! on_own {
    ($inner:expr, |$c:ident| $body:expr) => {{
        let inner: &Inner = $inner;
        let own = $crate::dialect::with_fast!(&inner.dialect, |fast| on_handle!(
            fast.exclusive(),
            |$c| $body
        ));
        match own {
            Some(result) => result,
            None => on_conn!(inner, |$c| $body),
        }
    }};
}

/// [`on_own!`] bounded by the statement timeout, its failure described as `$what`.
macro_rules! run_own {
    ($inner:expr, $what:expr, |$c:ident| $body:expr) => {{
        let inner: &Inner = $inner;
        inner
            .bounded(&$what, inner.config.statement_timeout(), async {
                on_own!(inner, |$c| $body)
            })
            .await
    }};
}

/// [`run_own!`] for a call that only reads: on SQLite it does not take the store's turn
/// ([`Inner::turns`]). A read in WAL mode never waits for the write lock, so it need not
/// queue behind the store's calls that wait for it in SQLite's busy handler.
macro_rules! run_read {
    ($inner:expr, $what:expr, |$c:ident| $body:expr) => {{
        let inner: &Inner = $inner;
        inner
            .bounded(&$what, inner.config.statement_timeout(), async {
                let own = $crate::dialect::with_fast!(&inner.dialect, |fast| on_handle!(fast.exclusive(), |$c| $body));
                match own {
                    Some(result) => result,
                    None => on_pool!(&inner.dialect, |p| on_conn!(@run inner, p, |$c| $body)),
                }
            })
            .await
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
mod failure;
mod lease;
mod migrate;
pub(crate) mod permits;
mod renew;
mod table;
#[cfg(test)]
mod tests;

pub use permits::{PERMIT_POLL, create_permits_table_sql, permit_transaction_begin};
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
    /// Mutexes whose row a watcher reads while an owner it watches holds it
    /// (`lease::watch_owner`).
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
        // Permits freed by other stores wake this store's waiters (where the database
        // tells of them). Weak, as above.
        let permits = permits::Permits::new(kind, config.table());
        #[cfg(any(feature = "postgres", feature = "sqlite"))]
        {
            let weak = Arc::downgrade(&permits.waiters);
            dialect.on_permit(Box::new(move |news| {
                if let Some(waiters) = weak.upgrade() {
                    waiters.heard(news);
                }
            }));
        }
        Ok(SqlStore {
            inner: Arc::new(Inner {
                kind,
                discard: kind != Backend::Sqlite,
                renewals: renew::Renewals::new(kind, config.pool_size()),
                turns: (kind == Backend::Sqlite).then(Turns::default),
                permits,
                gates,
                config,
                dialect,
                table: OnceLock::new(),
                default_table,
                foreign: std::sync::Mutex::new(std::collections::HashSet::new()),
            }),
        })
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

/// A backend error that retrying does not heal.
fn permanent(backend: &'static str, message: String) -> Error {
    Error::Backend {
        backend,
        message,
        retryable: false,
        source: None,
    }
}

fn channel_name(table: &str) -> String {
    format!("simba:{table}")
}
