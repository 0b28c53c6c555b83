#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
// A build without any backend feature compiles (every URL is then refused with a message
// naming the feature to enable), but most of the crate is unused in it.
#![cfg_attr(
    not(any(feature = "mysql", feature = "postgres", feature = "sqlite")),
    allow(unused)
)]

mod call;
mod config;
mod conn;
#[cfg(any(feature = "mysql", feature = "postgres", feature = "sqlite"))]
mod connector;
mod dialect;
#[cfg(feature = "bench")]
mod floor;
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzzing;
mod gate;
mod hash;
mod lock_error;
#[cfg(feature = "mysql")]
mod mysql;
mod native;
mod pool;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod push;
mod rows;
mod schema;
mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;
mod store;
mod url_query;
#[cfg(any(feature = "mysql", feature = "postgres"))]
mod url_tls;

pub use config::{
    Backend, DEFAULT_FOREIGN_POLL, DEFAULT_POOL_SIZE, DEFAULT_STATEMENT_TIMEOUT, DEFAULT_TABLE,
    MAX_POOL_SIZE, MAX_TABLE_NAME_LEN, MUTEX_COLUMN_LEN, OWNER_COLUMN_LEN, SqlConfig, redact_url,
};
#[cfg(any(feature = "mysql", feature = "postgres", feature = "sqlite"))]
pub use connector::{
    CONNECTOR, OBSERVER_POLL, SqlConnector, URL_DDL_OPTION, URL_ONE_STATEMENT_OPTION,
    URL_TABLE_OPTION,
};
pub use native::{MAX_NATIVE_WAITS, NATIVE_WAIT_POLL};
/// Why a connection failed over TLS (the `source` of the error), for PostgreSQL and MySQL.
pub use simba_core::tls::{TlsFailure, TlsProblem};
pub use sql::{create_table_sql, lease_clock_sql};
pub use store::{
    PERMIT_POLL, RenewalCounts, SqlStore, create_permits_table_sql, permit_transaction_begin,
};

use simba_core::{LeaseConfig, LeaseServiceFactory, Result};

/// Connects to `url` with the default [`SqlConfig`], creates the table if needed
/// ([`SqlStore::migrate`]) and returns a contend-service factory with `lease` timing.
///
/// # Errors
/// [`simba_core::Error::InvalidConfig`] for a bad URL or lease config;
/// [`simba_core::Error::Backend`] if the database cannot be reached or the migration fails.
///
/// # Cancel safety
/// Dropping the future may leave the table created; nothing else persists.
pub async fn factory(url: &str, lease: LeaseConfig) -> Result<LeaseServiceFactory<SqlStore>> {
    lease.validate()?;
    let store = SqlStore::connect(SqlConfig::new(url)).await?;
    store.migrate().await?;
    LeaseServiceFactory::new(store, lease)
}
