//! Semaphores from a backend URL, for `simba bench`: on a connection of their own through
//! the URL's connector ([`Connection::open_semaphore`](simba_core::connect::Connection::open_semaphore)),
//! whatever the backend. Redis and the SQL backends time the permits with the lease of
//! `timing`; ZooKeeper holds them on the connection's session (its timeout chosen by
//! `timing` as for a mutex, or the URL's default), with the longest lease that session
//! allows; etcd with the connection's lease (the URL's `lease_ttl`, or the one `timing`
//! chooses).

use simba_core::{Result, Semaphore};

use crate::backend::{LeaseArgs, connectors};

/// The semaphore `name` of `permits` permits on the backend of `url`, on a connection of
/// its own made with `timing`.
///
/// # Errors
/// [`simba_core::Error::Unsupported`] for a backend without semaphores; the connector's
/// errors (a bad URL, a backend that cannot be reached); [`Semaphore::new`]'s.
pub(crate) async fn open(
    url: &str,
    timing: LeaseArgs,
    name: &str,
    permits: u32,
) -> Result<Semaphore> {
    let connection = connectors().connect(url.trim(), &timing.options()).await?;
    connection.open_semaphore(name, permits).await
}
