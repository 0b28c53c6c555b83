//! PostgreSQL: the one connector of a store (the URL's TLS options), its pool, its fast
//! path for the statements of a handoff, its push (LISTEN/NOTIFY), its native lock
//! (advisory locks), and what changes behind a connection pooler ([`pooler`]).

pub(crate) mod connect;
mod fast;
mod listen;
pub(crate) mod lock;
pub(crate) mod pooler;

use std::sync::Arc;

use diesel_async::pooled_connection::deadpool::Pool as DeadPool;
use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod,
};
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use simba_core::Result;
use simba_core::tls::TlsFailure;

pub(crate) use connect::{ConnectError, Connector};
pub(crate) use fast::{Fast, Notifier};
pub(crate) use listen::{Listener, acquired_payload, permit_payload, released_payload};

use crate::config::{Backend, SqlConfig};
use crate::conn::impl_sql_conn;
use crate::pool::{pool_error, pools};

impl_sql_conn!(AsyncPgConnection, diesel::pg::Pg, bind_all {});

/// What a PostgreSQL store holds.
pub(crate) struct Store {
    pub(crate) pool: DeadPool<AsyncPgConnection>,
    /// The connections of renewal batches (`crate::pool::split_pool`).
    pub(crate) renew: Option<DeadPool<AsyncPgConnection>>,
    /// Opens every connection of the store (TLS set up once).
    pub(crate) pg: Arc<Connector>,
    /// Opens the sessions of the native wait queue: the URL's, or behind a transaction
    /// pooler the direct URL's (none without one: waiters queue in this process only).
    pub(crate) native: Option<Arc<Connector>>,
    /// Behind a transaction pooler (`simba_pooler=transaction`): every call on the fast
    /// path's connections, none on the pool.
    pub(crate) pooled: bool,
    /// The LISTEN side (none behind a transaction pooler without a direct URL).
    pub(crate) listener: Option<Listener>,
    /// Prepared statements for acquire and release.
    pub(crate) fast: Arc<Fast>,
    /// The NOTIFYs of the store's changes, sent after they commit.
    pub(crate) notifier: Notifier,
}

impl Store {
    /// The connector, pool, listener and fast path of a store on `url` (no I/O).
    pub(crate) fn new(url: &str, config: &SqlConfig, channel: &str) -> Result<Store> {
        let pg = Arc::new(Connector::new(url)?);
        let pooled = pg.pooler().transaction;
        let native = match &pg.pooler().direct_url {
            Some(direct) => Some(Arc::new(Connector::new(direct)?)),
            None if pooled => None,
            None => Some(pg.clone()),
        };
        let size = config.pool_size();
        let timeout = config.statement_timeout();
        let setup = format!("SET statement_timeout = {}", timeout.as_millis());
        let manager = || {
            let mut mc = ManagerConfig::<AsyncPgConnection>::default();
            mc.recycling_method = RecyclingMethod::Fast;
            // Every connection through the store's connector (its TLS), not the URL.
            let connector = pg.clone();
            let setup = setup.clone();
            mc.custom_setup = Box::new(move |_url| {
                let setup = setup.clone();
                let pg = connector.clone();
                Box::pin(async move {
                    let mut conn = pg.diesel().await?;
                    conn.batch_execute(&setup)
                        .await
                        .map_err(diesel::ConnectionError::CouldntSetupConfiguration)?;
                    Ok(conn)
                })
            });
            AsyncDieselConnectionManager::new_with_config(url.to_owned(), mc)
        };
        let (pool, renew) = pools(Backend::Postgres, size, |n| {
            DeadPool::builder(manager())
                .max_size(n)
                .build()
                .map_err(|e| pool_error(Backend::Postgres, e))
        })?;
        let listener = native
            .as_ref()
            .map(|n| Listener::new(n.clone(), channel.to_owned(), timeout));
        let fast = Arc::new(Fast::new(pg.clone(), timeout, pooled, size));
        let notifier = Notifier::new(fast.clone(), channel.to_owned(), timeout);
        Ok(Store {
            pool,
            renew,
            pg,
            native,
            pooled,
            listener,
            fast,
            notifier,
        })
    }

    /// The TLS failure of the last connection attempt, and the message to report: the
    /// pool's errors lose their source on the way through diesel, so the connector
    /// remembers it.
    pub(crate) fn tls_failure(&self, msg: &str) -> Option<(String, TlsFailure)> {
        let tls = self.pg.last_failure()?;
        let text = tls.to_string();
        let message = if msg.contains(&text) {
            msg.to_owned()
        } else {
            format!("{msg}; {text}")
        };
        Some((message, tls))
    }
}
