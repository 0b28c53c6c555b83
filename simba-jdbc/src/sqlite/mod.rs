//! SQLite: the connections of a store (diesel's `SqliteConnection`, each on a thread of its own),
//! its pool, and its native lock (on Linux byte-range locks in one lock file per
//! database, elsewhere a lock file per mutex).

#[cfg(any(target_os = "linux", target_os = "android"))]
pub(crate) mod lock;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
#[path = "lock_files.rs"]
pub(crate) mod lock;
mod thread;

use std::time::Duration;

use diesel_async::pooled_connection::deadpool::Pool as DeadPool;
use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod,
};
use diesel_async::{AsyncConnection, SimpleAsyncConnection};
use simba_core::Result;

pub(crate) use lock::{FileKey, FileLock, sweep_earlier};

use crate::config::{Backend, SqlConfig};
use crate::conn::impl_sql_conn;
use crate::dialect::{pool_error, pools};

/// A SQLite connection, its statements run on a thread of its own ([`thread`]) and kept
/// prepared.
pub(crate) type SqliteConn = diesel_async::sync_connection_wrapper::SyncConnectionWrapper<
    diesel::SqliteConnection,
    thread::ConnThread,
>;

impl_sql_conn!(SqliteConn, diesel::sqlite::Sqlite, prepared {
    const THREADED: bool = true;

    fn on_thread<'a, R: Send + 'static>(
        &'a mut self,
        work: impl FnOnce(&mut diesel::SqliteConnection) -> diesel::QueryResult<R> + Send + 'static,
    ) -> impl std::future::Future<Output = diesel::QueryResult<R>> + Send + 'a {
        self.spawn_blocking(work)
    }
});

/// Each connection's page cache: 256 KiB (`cache_size` in negative KiB), not SQLite's
/// 2 MiB. A lock table is small and hot (10,000 rows are 1.6 MB), every connection of the
/// pool and the renewal connection cached all of it, and pages it does not cache come from
/// the operating system's cache. `simba bench --scenario scale` (10,000 held mutexes,
/// release build, idle machine): RSS 59.6–59.8 MiB with 2 MiB, 56.1–56.7 MiB with 256 KiB,
/// with the same renewals (1.00 per mutex per ttl) and acquire-all time (2.3–2.7 s); the
/// uncontended and handoff p50s did not move (docs/performance.md).
const CACHE_SIZE: &str = "PRAGMA cache_size = -256";

/// What a SQLite store holds: its pool, and where its database lives.
pub(crate) struct Store {
    pub(crate) pool: DeadPool<SqliteConn>,
    /// The connection of renewal batches (`crate::dialect::split_pool`).
    pub(crate) renew: Option<DeadPool<SqliteConn>>,
    /// The database file (its lock files live beside it).
    pub(crate) path: String,
    /// `:memory:`: no other process can reach the database.
    pub(crate) memory: bool,
}

impl Store {
    /// The pool of connections to the database at `path` (no I/O): WAL with
    /// `synchronous = NORMAL`, a busy timeout of the statement timeout and a page cache of
    /// [`CACHE_SIZE`].
    pub(crate) fn new(path: &str, memory: bool, config: &SqlConfig) -> Result<Store> {
        let size = config.pool_size();
        let timeout = config.statement_timeout();
        // WAL lets readers run beside the one writer; busy_timeout makes writers of
        // other connections and processes wait instead of failing.
        let busy = format!(
            "PRAGMA busy_timeout = {}",
            timeout.as_millis().min(i32::MAX as u128)
        );
        let manager = || {
            let busy = busy.clone();
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
                            Err(e) if is_busy(&e) && tokio::time::Instant::now() < give_up => {
                                tokio::time::sleep(Duration::from_millis(5)).await;
                            }
                            Err(e) => return Err(setup(e)),
                        }
                    }
                    // A commit syncs the WAL only at checkpoints, not every time: see the
                    // crate README (*SQLite*, durability) for why a lock table may lose its
                    // last commits in a power loss.
                    conn.batch_execute("PRAGMA synchronous = NORMAL")
                        .await
                        .map_err(setup)?;
                    conn.batch_execute(CACHE_SIZE).await.map_err(setup)?;
                    Ok(conn)
                })
            });
            AsyncDieselConnectionManager::new_with_config(path.to_owned(), mc)
        };
        // Every connection to `:memory:` is a database of its own: use exactly one, shared.
        let (pool, renew) = pools(Backend::Sqlite, if memory { 1 } else { size }, |n| {
            DeadPool::builder(manager())
                .max_size(n)
                .build()
                .map_err(|e| pool_error(Backend::Sqlite, e))
        })?;
        Ok(Store {
            pool,
            renew,
            path: path.to_owned(),
            memory,
        })
    }
}

/// Whether a SQLite error is "database is locked" / "database is busy".
fn is_busy(e: &diesel::result::Error) -> bool {
    let text = e.to_string();
    text.contains("locked") || text.contains("busy")
}

/// Opens (creating it if needed) a lock file. std opens with O_CLOEXEC: a child process
/// (simba exec's command) never inherits the lock.
fn open_lock_file(path: &std::path::Path) -> std::result::Result<std::fs::File, String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| format!("lock file {}: {e}", path.display()))
}
