//! Floors: a bare ZooKeeper round trip (`exists`) that a mutex operation can be compared to
//! (`simba bench` reports each figure beside it).
//!
//! [`ZkProbe`] opens a session of its own, with the same client library and the same
//! servers as a [`ZkFactory`](crate::ZkFactory), so that each [`ZkProbe::exists`] is one
//! request and its answer on the same kind of connection.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use simba_core::{Error, Result};
use zookeeper_async::{WatchedEvent, ZooKeeper};

use crate::config::ZkConfig;
use crate::session::BACKEND;

/// A dedicated ZooKeeper session for floor measurements. The session is closed when the
/// probe is dropped (in the background) or by [`ZkProbe::close`].
pub(crate) struct ZkProbe {
    zk: Arc<ZooKeeper>,
    servers: String,
    closed: bool,
}

impl fmt::Debug for ZkProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkProbe")
            .field("servers", &self.servers)
            .finish_non_exhaustive()
    }
}

impl ZkProbe {
    /// Opens a session with the servers of `config` (its chroot is not applied: the probe
    /// only reads `/`), within `config.connect_timeout`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a bad config; [`Error::Backend`] if no session is
    /// established within the connect timeout.
    ///
    /// # Cancel safety
    /// Dropping the future may leave a half-open client that the server expires after the
    /// session timeout.
    pub(crate) async fn connect(config: &ZkConfig) -> Result<ZkProbe> {
        let resolved = config.resolve()?;
        let servers = resolved
            .hosts
            .iter()
            .map(|(h, p)| {
                if h.contains(':') {
                    format!("[{h}]:{p}")
                } else {
                    format!("{h}:{p}")
                }
            })
            .collect::<Vec<_>>()
            .join(",");
        let deadline = tokio::time::Instant::now() + config.connect_timeout;
        let connect = ZooKeeper::connect_with_retry_time(
            &servers,
            config.session_timeout,
            |_event: WatchedEvent| {},
            Duration::from_millis(250),
        );
        let zk = match tokio::time::timeout_at(deadline, connect).await {
            Ok(Ok(zk)) => Arc::new(zk),
            Ok(Err(e)) => {
                return Err(Error::backend_source(
                    BACKEND,
                    format!("probe: connecting to {servers}"),
                    true,
                    e,
                ));
            }
            Err(_) => return Err(no_answer(&servers, "connecting")),
        };
        let probe = ZkProbe {
            zk,
            servers,
            closed: false,
        };
        // The first answered request proves the session is established.
        match tokio::time::timeout_at(deadline, probe.zk.exists("/", false)).await {
            Ok(Ok(_)) => Ok(probe),
            Ok(Err(e)) => Err(Error::backend_source(
                BACKEND,
                format!("probe: establishing a session with {}", probe.servers),
                true,
                e,
            )),
            Err(_) => Err(no_answer(&probe.servers, "establishing a session")),
        }
    }

    /// `exists("/")`: one request and its answer.
    ///
    /// # Errors
    /// [`Error::Backend`] if the request fails or is not answered within `limit`.
    ///
    /// # Cancel safety
    /// Cancel safe (a read).
    pub(crate) async fn exists(&self, limit: Duration) -> Result<()> {
        match tokio::time::timeout(limit, self.zk.exists("/", false)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(Error::backend_source(BACKEND, "probe: exists(/)", true, e)),
            Err(_) => Err(no_answer(&self.servers, "exists(/)")),
        }
    }

    /// Closes the session now.
    ///
    /// # Errors
    /// Never fails: a session the server does not confirm closing expires on its own.
    ///
    /// # Cancel safety
    /// Dropping the future leaves the session to expire on its own.
    pub(crate) async fn close(mut self) -> Result<()> {
        self.closed = true;
        let _ = tokio::time::timeout(Duration::from_secs(2), self.zk.close()).await;
        Ok(())
    }
}

impl Drop for ZkProbe {
    fn drop(&mut self) {
        // Dropping a zookeeper-async client does not close its session.
        if !self.closed
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let zk = self.zk.clone();
            rt.spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(2), zk.close()).await;
            });
        }
    }
}

fn no_answer(servers: &str, what: &str) -> Error {
    Error::backend(
        BACKEND,
        format!("probe: {what} with {servers}: no answer within the connect timeout"),
    )
}
