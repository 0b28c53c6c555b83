//! SQLite: the connections of a store (diesel's `SqliteConnection`, each on a thread of its own),
//! its pool, and its native lock (on Linux byte-range locks on the database file itself,
//! elsewhere a lock file per mutex).

#[cfg(any(target_os = "linux", target_os = "android"))]
mod bell;
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

pub(crate) use crate::lock_error::Refused;
#[cfg(any(target_os = "linux", target_os = "android"))]
pub(crate) use bell::Bells;
pub(crate) use lock::{DbFile, FileKey, FileLock, sweep_earlier};

use crate::config::{Backend, SqlConfig};
use crate::conn::impl_sql_conn;
use crate::pool::{pool_error, pools};

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

/// The `synchronous` setting of every connection of the store's pool: a commit syncs the
/// WAL at checkpoints only (see the crate README, *SQLite*, durability).
pub(crate) const SYNCHRONOUS: &str = "NORMAL";

/// What a SQLite store holds: its pool, and where its database lives.
pub(crate) struct Store {
    pub(crate) pool: DeadPool<SqliteConn>,
    /// The connection of renewal batches (`crate::pool::split_pool`).
    pub(crate) renew: Option<DeadPool<SqliteConn>>,
    /// The database file (its lock files live beside it).
    pub(crate) path: String,
    /// `:memory:`: no other process can reach the database.
    pub(crate) memory: bool,
    /// How the store hears of permits freed by other processes (a file database on Linux).
    #[cfg(any(target_os = "linux", target_os = "android"))]
    pub(crate) bells: Option<Bells>,
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
                    conn.batch_execute(&format!("PRAGMA synchronous = {SYNCHRONOUS}"))
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
            #[cfg(any(target_os = "linux", target_os = "android"))]
            bells: (!memory).then(|| Bells::new(path, config.table())),
        })
    }
}

/// Whether a SQLite error is "database is locked" / "database is busy".
fn is_busy(e: &diesel::result::Error) -> bool {
    let text = e.to_string();
    text.contains("locked") || text.contains("busy")
}

/// Opens (creating it if needed) a lock file (outside Linux). std opens with O_CLOEXEC:
/// a child process (simba exec's command) never inherits the lock.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn open_lock_file(
    path: &std::path::Path,
) -> std::result::Result<std::fs::File, crate::lock_error::LockError> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|source| crate::lock_error::LockError::File {
            path: path.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A statement that runs for a while: SQLite counts to two million.
    const SLOW: &str = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c \
                        WHERE x < 2000000) SELECT count(*) FROM c";

    /// A call gives up on a statement, its connection goes back to the pool while the
    /// statement still runs on the connection's thread, and the pool hands the connection
    /// out again: the dropped answer waited for the statement (without that wait, the
    /// pool's check of the connection panics: "Cannot access shared transaction state").
    async fn a_connection_given_up_on_is_handed_out_after_its_statement() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("given-up.db");
        let path = path.to_str().expect("a UTF-8 path");
        let config = SqlConfig::new(format!("sqlite://{path}")).with_pool_size(1);
        let store = Store::new(path, false, &config).expect("a store");
        let mut conn = store.pool.get().await.expect("a connection");
        let cut = tokio::time::timeout(Duration::from_millis(5), conn.batch_execute(SLOW)).await;
        assert!(cut.is_err(), "the slow statement ended within 5 ms");
        drop(conn);
        let mut conn = store.pool.get().await.expect("the connection, again");
        conn.batch_execute("SELECT 1")
            .await
            .expect("a statement on it");
        assert_eq!(
            deadpool::managed::Object::metrics(&conn).recycle_count,
            1,
            "the connection was replaced, not handed out again"
        );
    }

    #[tokio::test]
    async fn given_up_on_current_thread_runtime() {
        a_connection_given_up_on_is_handed_out_after_its_statement().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_up_on_multi_thread_runtime() {
        a_connection_given_up_on_is_handed_out_after_its_statement().await;
    }
}
