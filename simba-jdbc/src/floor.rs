//! Floors: a bare database round trip (`SELECT 1`) that a mutex operation can be compared
//! to (`simba bench` reports each figure beside it).
//!
//! The probe opens one connection of the same kind as the store's pool (same driver, same
//! URL, same SQLite file) and keeps it, so that each [`SqlProbe::select_one`] is exactly one
//! round trip (SQLite: one hop to the connection's thread and back).
//!
//! Only with the `bench` feature, as `crate::store`'s `acquisition_floor` and the probe
//! connection of `crate::dialect`.

use std::fmt;
use std::time::Duration;

use simba_core::backend::BoxFuture;
use simba_core::connect::{Floor, Probe, unsupported_floor};
use simba_core::{Error, Result};

use crate::config::Backend;
use crate::dialect::ProbeConn;
use crate::store::SqlStore;

/// One dedicated connection for floor measurements; from [`SqlStore::probe`].
pub(crate) struct SqlProbe {
    conn: ProbeConn,
    kind: Backend,
    timeout: Duration,
}

impl fmt::Debug for SqlProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlProbe")
            .field("backend", &self.kind)
            .finish_non_exhaustive()
    }
}

impl SqlStore {
    /// Opens a connection for floor measurements, of the same kind as the store's pool.
    ///
    /// # Errors
    /// [`Error::Backend`] if the database cannot be reached within the statement timeout.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-open connection.
    pub(crate) async fn probe(&self) -> Result<SqlProbe> {
        self.probe_on(false).await
    }

    /// A probe connection where the store's native locks live: PostgreSQL behind a
    /// transaction pooler, the direct URL's server (a session lock through the pooler would
    /// stay on whichever server connection took it).
    async fn native_probe(&self) -> Result<SqlProbe> {
        self.probe_on(true).await
    }

    async fn probe_on(&self, native: bool) -> Result<SqlProbe> {
        let kind = self.kind();
        let timeout = self.config().statement_timeout();
        let failed = |e: diesel::ConnectionError| {
            Error::backend_source(
                kind.name(),
                format!(
                    "opening a probe connection to {}",
                    self.config().redacted_url()
                ),
                true,
                e,
            )
        };
        let open = self.dialect().probe(native);
        let conn = tokio::time::timeout(timeout, open)
            .await
            .map_err(|_| {
                Error::backend(
                    kind.name(),
                    format!("opening a probe connection: no answer within {timeout:?}"),
                )
            })?
            .map_err(failed)?;
        Ok(SqlProbe {
            conn,
            kind,
            timeout,
        })
    }
}

impl SqlProbe {
    /// Runs `SELECT 1`: one round trip.
    ///
    /// # Errors
    /// [`Error::Backend`] if the statement fails or does not answer within the store's
    /// statement timeout.
    ///
    /// # Cancel safety
    /// Dropping the future halfway leaves the connection in an unknown state: drop the probe
    /// too.
    pub(crate) async fn select_one(&mut self) -> Result<()> {
        let run = self.conn.select_one();
        let kind = self.kind;
        match tokio::time::timeout(self.timeout, run).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Error::backend_source(kind.name(), "SELECT 1", true, e)),
            Err(_) => Err(Error::backend(
                kind.name(),
                format!("SELECT 1: no answer within {:?}", self.timeout),
            )),
        }
    }
}

/// SQLite only: how long the waiter of a handoff floor is given to queue on the lock file
/// before the holder releases. The kernel tells no one that a blocking `fcntl` has
/// started to wait (`/proc/locks` shows it, but reading and parsing it on every handoff
/// costs more than the handoff), so this one stays a pause: the waiter's thread only has
/// to enter the call, and it is not timed. PostgreSQL and MariaDB wait for the event
/// instead (`Queued`).
#[cfg(feature = "sqlite")]
const QUEUE_SETTLE: Duration = Duration::from_millis(3);

/// How the holder of a handoff floor sees that the waiter's session is queued on the
/// server's lock, before it releases: a query that counts the waiter's waiting lock
/// requests.
struct Queued(String);

impl Queued {
    /// PostgreSQL: the waiter's ungranted advisory lock in `pg_locks`.
    fn postgres(waiter_pid: i64) -> Self {
        Queued(format!(
            "(SELECT COUNT(*) FROM pg_locks WHERE pid = {waiter_pid} AND locktype = 'advisory' \
             AND NOT granted)"
        ))
    }

    /// MariaDB / MySQL: the waiter's connection in `PROCESSLIST`, in the state of a
    /// `GET_LOCK` that waits.
    fn mysql(waiter_id: i64) -> Self {
        Queued(format!(
            "(SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = {waiter_id} \
             AND STATE = 'User lock')"
        ))
    }
}

/// What the lock of a handoff floor is.
enum NativeLock {
    /// `pg_advisory_lock(key)` / `pg_advisory_unlock(key)`.
    Advisory(i64),
    /// `GET_LOCK(name, timeout)` / `RELEASE_LOCK(name)`.
    Named(String),
    /// An OFD byte-range lock in a lock file (the store's own kind of SQLite lock), on two
    /// open file descriptions of the file, which compete like two processes.
    #[cfg(feature = "sqlite")]
    File(crate::sqlite::FileKey, std::path::PathBuf),
}

/// Two dedicated connections (on SQLite, two open descriptions of a lock file) that hand
/// the database's own lock over; from [`SqlStore::handoff_probe`].
pub struct SqlHandoffProbe {
    holder: Option<ProbeConn>,
    waiter: Option<ProbeConn>,
    /// How the holder sees the waiter queued (PostgreSQL, MySQL).
    queued: Option<Queued>,
    lock: NativeLock,
    kind: Backend,
}

impl fmt::Debug for SqlHandoffProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlHandoffProbe")
            .field("backend", &self.kind)
            .finish_non_exhaustive()
    }
}

impl SqlStore {
    /// Opens a probe of the database's own lock handoff, for `simba bench`: PostgreSQL two
    /// sessions handing `pg_advisory_lock` over, MySQL/MariaDB `GET_LOCK`, SQLite two open
    /// file descriptions of a lock file in the temporary directory handing an OFD
    /// byte-range lock over (the kind of lock the store waits on). `name` makes the lock
    /// this probe's own.
    ///
    /// # Errors
    /// [`Error::Backend`] if a connection cannot be opened within the statement timeout.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-open connections.
    #[doc(hidden)]
    pub async fn handoff_probe(&self, name: &str) -> Result<SqlHandoffProbe> {
        let kind = self.kind();
        let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        let lock = match kind {
            Backend::Postgres => NativeLock::Advisory(i64::from_ne_bytes(hash.to_ne_bytes())),
            Backend::Mysql => NativeLock::Named(format!("simba-bench-floor-{hash:016x}")),
            #[cfg(feature = "sqlite")]
            Backend::Sqlite => {
                // A file of its own stands in for the database file.
                let file = std::env::temp_dir().join(format!("simba-bench-floor-{hash:016x}.db"));
                std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&file)
                    .map_err(|e| {
                        Error::backend_source(kind.name(), "handoff floor: lock file", true, e)
                    })?;
                let db = crate::sqlite::DbFile::new(&file.to_string_lossy());
                NativeLock::File(crate::sqlite::FileKey::new(&db, hash), file)
            }
            #[cfg(not(feature = "sqlite"))]
            Backend::Sqlite => {
                return Err(Error::unsupported(
                    kind.name(),
                    "handoff floor",
                    "built without SQLite",
                ));
            }
        };
        let (holder, waiter, queued) = match lock {
            #[cfg(feature = "sqlite")]
            NativeLock::File(..) => (None, None, None),
            _ => {
                let holder = self.native_probe().await?.conn;
                let mut waiter = self.native_probe().await?.conn;
                let failed = |e: diesel::result::Error| {
                    Error::backend_source(kind.name(), "handoff floor: session id", true, e)
                };
                let queued = match kind {
                    Backend::Postgres => Queued::postgres(
                        waiter
                            .scalar("pg_backend_pid()::bigint")
                            .await
                            .map_err(failed)?,
                    ),
                    _ => Queued::mysql(
                        waiter
                            .scalar("CAST(CONNECTION_ID() AS SIGNED)")
                            .await
                            .map_err(failed)?,
                    ),
                };
                (Some(holder), Some(waiter), Some(queued))
            }
        };
        Ok(SqlHandoffProbe {
            holder,
            waiter,
            queued,
            lock,
            kind,
        })
    }
}

impl NativeLock {
    /// The lock and unlock statements of a server's lock (`None` for a lock file).
    fn statements(&self) -> Option<(String, String)> {
        match self {
            NativeLock::Advisory(key) => Some((
                format!("SELECT pg_advisory_lock({key})"),
                format!("SELECT pg_advisory_unlock({key})"),
            )),
            NativeLock::Named(name) => Some((
                format!("DO GET_LOCK('{name}', 60)"),
                format!("DO RELEASE_LOCK('{name}')"),
            )),
            #[cfg(feature = "sqlite")]
            NativeLock::File(..) => None,
        }
    }
}

impl SqlHandoffProbe {
    /// What the handoff is (`pg_advisory_lock`, `GET_LOCK`, `OFD lock`).
    pub fn name(&self) -> &'static str {
        match self.lock {
            NativeLock::Advisory(_) => "pg_advisory_lock handoff",
            NativeLock::Named(_) => "GET_LOCK handoff",
            #[cfg(feature = "sqlite")]
            NativeLock::File(..) => "OFD lock handoff (2 descriptions)",
        }
    }

    /// One handoff: the holder takes the lock, the waiter asks for it and queues, the
    /// holder releases. Returns the time from the holder's release being answered until
    /// the waiter's lock call is answered (on SQLite: until the waiter's blocking thread
    /// hands the lock back to its task); the waiter then releases (not timed).
    ///
    /// # Errors
    /// [`Error::Backend`] if a statement fails, the waiter got the lock while it was held,
    /// or the handoff takes longer than `limit`.
    ///
    /// # Cancel safety
    /// Dropping the future halfway may leave the lock held by a probe connection until the
    /// probe is dropped.
    pub async fn handoff(&mut self, limit: Duration) -> Result<Duration> {
        let kind = self.kind;
        let run = async {
            match &self.lock {
                #[cfg(feature = "sqlite")]
                NativeLock::File(key, _) => file_handoff(kind, key).await,
                sql => {
                    let Some((lock, unlock)) = sql.statements() else {
                        return Err(Error::InvalidState(
                            "the handoff probe's lock is not a server's".into(),
                        ));
                    };
                    sql_handoff(
                        kind,
                        self.holder.as_mut(),
                        self.waiter.as_mut(),
                        self.queued.as_ref(),
                        (lock.as_str(), unlock.as_str()),
                    )
                    .await
                }
            }
        };
        tokio::time::timeout(limit, run).await.unwrap_or_else(|_| {
            Err(Error::backend(
                kind.name(),
                format!("a native lock handoff took longer than {limit:?}"),
            ))
        })
    }
}

impl Drop for SqlHandoffProbe {
    fn drop(&mut self) {
        match &self.lock {
            // The probe's own lock file, unlocked: nobody else uses it.
            #[cfg(feature = "sqlite")]
            NativeLock::File(_, path) => {
                let _ = std::fs::remove_file(path);
            }
            NativeLock::Advisory(_) | NativeLock::Named(_) => {}
        }
    }
}

/// One handoff between two sessions: `ends` are the lock and unlock statements. The
/// holder releases once `queued` shows the waiter's session queued on the server (polled
/// with one query per round trip; not timed).
async fn sql_handoff(
    kind: Backend,
    holder: Option<&mut ProbeConn>,
    waiter: Option<&mut ProbeConn>,
    queued: Option<&Queued>,
    (lock, unlock): (&str, &str),
) -> Result<Duration> {
    let (Some(holder), Some(waiter), Some(queued)) = (holder, waiter, queued) else {
        return Err(Error::InvalidState(
            "the handoff probe has no connections".into(),
        ));
    };
    let failed = |what: &str, e: diesel::result::Error| {
        Error::backend_source(kind.name(), format!("handoff floor: {what}"), true, e)
    };
    holder
        .execute(lock)
        .await
        .map_err(|e| failed("holder lock", e))?;
    let took = {
        let mut wait = std::pin::pin!(waiter.execute(lock));
        loop {
            tokio::select! {
                r = &mut wait => {
                    r.map_err(|e| failed("waiter lock", e))?;
                    return Err(Error::backend(
                        kind.name(),
                        "handoff floor: the waiter got the lock while the holder held it",
                    ));
                }
                n = holder.scalar(&queued.0) => {
                    if n.map_err(|e| failed("is the waiter queued", e))? > 0 {
                        break;
                    }
                }
            }
        }
        holder
            .execute(unlock)
            .await
            .map_err(|e| failed("holder unlock", e))?;
        let released = tokio::time::Instant::now();
        wait.await.map_err(|e| failed("waiter lock", e))?;
        released.elapsed()
    };
    waiter
        .execute(unlock)
        .await
        .map_err(|e| failed("waiter unlock", e))?;
    Ok(took)
}

#[cfg(feature = "sqlite")]
async fn file_handoff(kind: Backend, key: &crate::sqlite::FileKey) -> Result<Duration> {
    let failed =
        |e: &dyn std::fmt::Display| Error::backend(kind.name(), format!("handoff floor: {e}"));
    let Some(held) = key.try_lock().await.map_err(|e| failed(&e))? else {
        return Err(failed(&"the floor's lock file is locked by someone else"));
    };
    let mut wait = key.wait();
    tokio::select! {
        r = &mut wait => {
            drop(r);
            drop(held);
            return Err(failed(&"the waiter got the lock while the holder held it"));
        }
        () = tokio::time::sleep(QUEUE_SETTLE) => {}
    }
    // Closing the holder's description unlocks.
    drop(held);
    let released = tokio::time::Instant::now();
    let got = wait
        .await
        .map_err(|e| failed(&e))?
        .map_err(|e| failed(&e))?;
    let took = released.elapsed();
    drop(got);
    Ok(took)
}

impl ProbeConn {
    /// Selects `expr`, an expression of one `BIGINT` value (a scalar subquery in
    /// parentheses, or a function call): one round trip.
    async fn scalar(&mut self, expr: &str) -> diesel::QueryResult<i64> {
        use diesel::sql_types::BigInt;
        let q = diesel::select(diesel::dsl::sql::<BigInt>(expr));
        let _ = &q;
        match self {
            #[cfg(feature = "mysql")]
            ProbeConn::Mysql(c) => diesel_async::RunQueryDsl::get_result(q, c).await,
            #[cfg(feature = "postgres")]
            ProbeConn::Postgres(c) => diesel_async::RunQueryDsl::get_result(q, &mut **c).await,
            #[cfg(feature = "sqlite")]
            ProbeConn::Sqlite(c) => diesel_async::RunQueryDsl::get_result(q, c).await,
            #[cfg(not(any(feature = "mysql", feature = "postgres", feature = "sqlite")))]
            ProbeConn::Never(never) => match *never {},
        }
    }

    /// The rows of `sql`, a statement of one text column named `value`.
    async fn load_text(&mut self, sql: &str) -> diesel::QueryResult<Vec<String>> {
        use crate::conn::SqlConn;
        let _ = sql;
        let rows = match self {
            #[cfg(feature = "mysql")]
            ProbeConn::Mysql(c) => c.load_text(sql).await?,
            #[cfg(feature = "postgres")]
            ProbeConn::Postgres(c) => c.as_mut().load_text(sql).await?,
            #[cfg(feature = "sqlite")]
            ProbeConn::Sqlite(c) => c.load_text(sql).await?,
            #[cfg(not(any(feature = "mysql", feature = "postgres", feature = "sqlite")))]
            ProbeConn::Never(never) => match *never {},
        };
        Ok(rows.into_iter().map(|r| r.value).collect())
    }

    /// Runs `sql` (one statement, its result discarded): one round trip.
    async fn execute(&mut self, sql: &str) -> diesel::QueryResult<()> {
        use diesel_async::SimpleAsyncConnection;
        let _ = sql;
        match self {
            #[cfg(feature = "mysql")]
            ProbeConn::Mysql(c) => c.batch_execute(sql).await,
            #[cfg(feature = "postgres")]
            ProbeConn::Postgres(c) => c.batch_execute(sql).await,
            #[cfg(feature = "sqlite")]
            ProbeConn::Sqlite(c) => c.batch_execute(sql).await,
            #[cfg(not(any(feature = "mysql", feature = "postgres", feature = "sqlite")))]
            ProbeConn::Never(never) => match *never {},
        }
    }
}

/// What each database says about its durability: one statement of `name=value` rows.
fn durability_sql(kind: Backend) -> &'static str {
    match kind {
        Backend::Postgres => {
            "SELECT name || '=' || setting AS value FROM pg_settings \
             WHERE name IN ('fsync', 'synchronous_commit', 'full_page_writes') ORDER BY name"
        }
        Backend::Mysql => {
            "SELECT CONCAT('innodb_flush_log_at_trx_commit=', \
             @@innodb_flush_log_at_trx_commit) AS value \
             UNION ALL SELECT CONCAT('sync_binlog=', @@sync_binlog) \
             UNION ALL SELECT CONCAT('log_bin=', @@log_bin)"
        }
        // The journal mode is the database file's; `synchronous` is each connection's, and
        // simba-jdbc sets it on its own (see `crate::sqlite`), not the probe's.
        Backend::Sqlite => {
            "SELECT 'journal_mode=' || journal_mode AS value FROM pragma_journal_mode"
        }
    }
}

/// `name=value` rows as pairs (a row without `=` is kept whole as the name).
fn pairs(rows: Vec<String>) -> Vec<(String, String)> {
    rows.into_iter()
        .map(|r| match r.split_once('=') {
            Some((name, value)) => (name.to_owned(), value.to_owned()),
            None => (r, String::new()),
        })
        .collect()
}

/// A SQL database's floor: `SELECT 1` on a connection of the pool's kind.
pub(crate) struct SqlFloors {
    pub(crate) probe: SqlProbe,
    pub(crate) kind: Backend,
}

impl Probe for SqlFloors {
    fn round_trip_name(&self) -> &'static str {
        "SELECT 1"
    }

    fn durability(&mut self) -> BoxFuture<'_, Result<Vec<(String, String)>>> {
        Box::pin(async move {
            let kind = self.kind;
            let sql = durability_sql(kind);
            let limit = self.probe.timeout;
            let rows = tokio::time::timeout(limit, self.probe.conn.load_text(sql))
                .await
                .map_err(|_| {
                    Error::backend(
                        kind.name(),
                        format!("reading the durability settings: no answer within {limit:?}"),
                    )
                })?
                .map_err(|e| {
                    Error::backend_source(kind.name(), "reading the durability settings", true, e)
                })?;
            let mut settings = pairs(rows);
            if kind == Backend::Sqlite {
                settings.push((
                    "synchronous".to_owned(),
                    format!("{} (simba-jdbc sets it)", crate::sqlite::SYNCHRONOUS),
                ));
            }
            Ok(settings)
        })
    }

    fn floors(&self) -> Vec<Floor> {
        vec![Floor::RoundTrip]
    }

    fn measure(&mut self, floor: Floor, limit: Duration) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            if floor != Floor::RoundTrip {
                return Err(unsupported_floor(self.kind.name(), floor));
            }
            let kind = self.kind.name();
            tokio::time::timeout(limit, self.probe.select_one())
                .await
                .unwrap_or_else(|_| {
                    Err(Error::backend(
                        kind,
                        format!("SELECT 1: no answer within {limit:?}"),
                    ))
                })
        })
    }
}
