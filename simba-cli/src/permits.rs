//! Semaphores from a backend URL, for `simba bench`.
//!
//! `simba_core::connect::Connection` has no semaphore yet, so this opens one through the
//! backend crate of the URL's scheme: Redis (every form of simba-redis), ZooKeeper (a
//! session of its own; the permits' lease is the longest the session allows,
//! `ZkFactory::permit_lease`) and the SQL backends (simba-jdbc's `{table}_permits`); etcd
//! has no semaphores.

use std::time::Duration;

use simba_core::connect::scheme_of;
use simba_core::{Error, LeaseConfig, Result, Semaphore};

/// The error of a backend without semaphores.
fn unsupported(scheme: &str) -> Error {
    Error::Unsupported {
        backend: "simba",
        what: "semaphores",
        reason: format!("no semaphores on `{scheme}` backends"),
    }
}

/// The semaphore `name` of `permits` permits on the backend of `url`, its holders timed
/// by `lease` (ZooKeeper: a session of timeout `session`, or the URL's default, the
/// permits timed by the session).
///
/// # Errors
/// [`Error::Unsupported`] for a backend without semaphores; the backend's connection
/// errors; [`Semaphore::new`]'s.
pub(crate) async fn open(
    url: &str,
    lease: LeaseConfig,
    session: Option<Duration>,
    name: &str,
    permits: u32,
) -> Result<Semaphore> {
    let url = url.trim();
    let scheme = scheme_of(url).unwrap_or_default();
    let _ = (&lease, session, name, permits);
    match scheme.as_str() {
        #[cfg(feature = "redis")]
        s if s.starts_with("redis") || s.starts_with("valkey") => {
            let factory = simba_redis::factory(url, lease).await?;
            Semaphore::from_factory(&factory, name, permits)
        }
        #[cfg(feature = "zookeeper")]
        "zk" | "zookeeper" => {
            let mut config = simba_zookeeper::ZkConfig::from_url(url)?;
            if let Some(timeout) = session {
                config = config.with_session_timeout(timeout);
            }
            let factory = simba_zookeeper::ZkFactory::connect(config).await?;
            factory.semaphore(name, permits)
        }
        #[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
        "sqlite" | "mysql" | "mariadb" | "postgres" | "postgresql" => {
            let factory = simba_jdbc::factory(url, lease).await?;
            Semaphore::from_factory(&factory, name, permits)
        }
        other => Err(unsupported(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn etcd_has_no_semaphores() {
        let e = open("etcd://127.0.0.1:1", LeaseConfig::default(), None, "s", 2)
            .await
            .expect_err("etcd");
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    }
}
