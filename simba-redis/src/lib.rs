#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod connector;
mod error;
#[cfg(feature = "bench")]
mod floor;
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzzing;
mod keys;
mod server;
mod store;
mod subscriptions;
mod tls;
mod watchdog;

use simba_core::{LeaseConfig, LeaseServiceFactory, Result};

pub use config::{
    DEFAULT_KEY_PREFIX, DEFAULT_REPLICA_ACK_TIMEOUT, MAX_KEY_PREFIX_LEN, RedisConfig, ReplicaAcks,
    TlsOptions, WaitMode, redact_url,
};
pub use connector::{CONNECTOR, RedisConnector};
pub use keys::MESSAGE_SEPARATOR;
pub use store::RedisStore;
pub use tls::{TlsFailure, TlsProblem};

/// Connects to `url` with default settings and returns a contend-service factory with the
/// lease timing `lease`.
///
/// For more settings (key prefix, polling, timeouts, credentials) use
/// [`RedisStore::connect`] with a [`RedisConfig`] and
/// [`LeaseServiceFactory::new`].
///
/// # Errors
/// - [`simba_core::Error::InvalidConfig`] for a bad `lease` or URL (checked before
///   connecting);
/// - [`simba_core::Error::Backend`] if the server cannot be reached or rejects the
///   credentials.
///
/// # Cancel safety
/// Dropping the future closes whatever connections it opened.
pub async fn factory(url: &str, lease: LeaseConfig) -> Result<LeaseServiceFactory<RedisStore>> {
    lease.validate()?;
    let store = RedisStore::connect(RedisConfig::new(url)).await?;
    LeaseServiceFactory::new(store, lease)
}
