//! MySQL / MariaDB: the connections of a store (`mysql_async` through diesel-async, with
//! the URL's TLS options), its pool, and its native lock (`GET_LOCK`).

pub(crate) mod connect;
pub(crate) mod lock;

use diesel_async::pooled_connection::deadpool::Pool as DeadPool;
use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod,
};
use diesel_async::{AsyncMysqlConnection, SimpleAsyncConnection};
use simba_core::Result;
use simba_core::tls::TlsFailure;
use tracing::debug;

pub(crate) use connect::{classify, diesel, opts};

use crate::config::{Backend, SqlConfig};
use crate::conn::impl_sql_conn;
use crate::pool::{pool_error, pools};

// Statements of fixed text stay prepared on their connection: diesel-async prepares and
// closes an uncached one on every call, a round trip more than executing a cached one.
impl_sql_conn!(AsyncMysqlConnection, diesel::mysql::Mysql, prepared {});

/// What a MySQL / MariaDB store holds: its pool, and the URL its lock sessions connect to.
pub(crate) struct Store {
    pub(crate) pool: DeadPool<AsyncMysqlConnection>,
    /// The connections of renewal batches (`crate::pool::split_pool`).
    pub(crate) renew: Option<DeadPool<AsyncMysqlConnection>>,
    pub(crate) url: String,
}

impl Store {
    /// The pool of connections to `url` (no I/O): each connection gets the server-side
    /// bounds of the statement timeout.
    pub(crate) fn new(url: &str, config: &SqlConfig) -> Result<Store> {
        let size = config.pool_size();
        let timeout = config.statement_timeout();
        let max_statement_time = format!(
            "SET SESSION max_statement_time = {:.3}",
            timeout.as_secs_f64()
        );
        let lock_wait = format!(
            "SET SESSION innodb_lock_wait_timeout = {}",
            timeout.as_secs().clamp(1, 1_073_741_824)
        );
        let manager = || {
            let (a, b) = (max_statement_time.clone(), lock_wait.clone());
            let mut mc = ManagerConfig::<AsyncMysqlConnection>::default();
            mc.recycling_method = RecyclingMethod::Fast;
            mc.custom_setup = Box::new(move |url| {
                let (a, b) = (a.clone(), b.clone());
                Box::pin(async move {
                    // The URL's TLS options and matched-row counts (`connect`).
                    let mut conn = diesel(url).await?;
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
            AsyncDieselConnectionManager::new_with_config(url.to_owned(), mc)
        };
        let (pool, renew) = pools(Backend::Mysql, size, |n| {
            DeadPool::builder(manager())
                .max_size(n)
                .build()
                .map_err(|e| pool_error(Backend::Mysql, e))
        })?;
        Ok(Store {
            pool,
            renew,
            url: url.to_owned(),
        })
    }

    /// The TLS failure a connection error `msg` names, and the message to report: only
    /// the driver's message crosses the pool.
    pub(crate) fn tls_failure(&self, msg: &str) -> Option<(String, TlsFailure)> {
        classify(msg).map(|tls| (format!("{msg}; {tls}"), tls))
    }
}
