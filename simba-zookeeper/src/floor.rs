//! Floors: a bare ZooKeeper round trip (`exists`) that a mutex operation can be compared to
//! (`simba bench` reports each figure beside it).
//!
//! [`ZkProbe`] opens a session of its own, with the same client library and the same
//! servers as a [`ZkFactory`](crate::ZkFactory), so that each [`ZkProbe::exists`] is one
//! request and its answer on the same kind of connection; [`ZkProbe::handoff`] hands an
//! ephemeral node over to a second session through a watch, ZooKeeper's own wait queue.
//!
//! Only with the `bench` feature.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use simba_core::backend::BoxFuture;
use simba_core::connect::{Floor, Probe, unsupported_floor};
use simba_core::{Error, Result};
use tokio::sync::oneshot;
use tokio::time::Instant;
use zookeeper_async::{Acl, CreateMode, WatchedEvent, ZkError, ZooKeeper};

use crate::config::ZkConfig;
use crate::session::BACKEND;

/// A dedicated ZooKeeper session for floor measurements. The session is closed when the
/// probe is dropped (in the background) or by [`ZkProbe::close`].
pub(crate) struct ZkProbe {
    zk: Arc<ZooKeeper>,
    /// The second session of the handoff floor, opened by the first [`ZkProbe::handoff`].
    waiter: Option<Arc<ZooKeeper>>,
    servers: String,
    session_timeout: Duration,
    /// The ephemeral node the handoff floor hands over.
    node: String,
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
    pub(crate) async fn connect(config: &ZkConfig, name: &str) -> Result<ZkProbe> {
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
        let zk = session(&servers, config.session_timeout, config.connect_timeout).await?;
        Ok(ZkProbe {
            zk,
            waiter: None,
            servers,
            session_timeout: config.session_timeout,
            node: format!("/simba-bench-floor-{name}"),
            closed: false,
        })
    }

    /// One handoff of an ephemeral node between two sessions, the way a lock recipe hands
    /// over: the first session creates the node, the second sets a watch on it, the first
    /// deletes it, and when the watch fires the second creates it. Returns the time from
    /// the delete being answered until the second create is answered; the second session
    /// then deletes the node (not timed). The node is `/simba-bench-floor-{name}`, open to
    /// all (the probe's sessions carry no credentials).
    ///
    /// # Errors
    /// [`Error::Backend`] if a request fails, or the handoff takes longer than `limit`.
    ///
    /// # Cancel safety
    /// Dropping the future may leave the ephemeral node until the probe's sessions close.
    pub(crate) async fn handoff(&mut self, limit: Duration) -> Result<Duration> {
        let waiter = match &self.waiter {
            Some(w) => w.clone(),
            None => {
                let w = session(&self.servers, self.session_timeout, limit).await?;
                self.waiter = Some(w.clone());
                w
            }
        };
        let holder = self.zk.clone();
        let node = self.node.clone();
        let failed = |what: &str, e: ZkError| {
            Error::backend_source(BACKEND, format!("probe: {what} {node}"), true, e)
        };
        let run = async {
            let create = |zk: Arc<ZooKeeper>| {
                let node = node.clone();
                async move {
                    zk.create(
                        &node,
                        Vec::new(),
                        Acl::open_unsafe().clone(),
                        CreateMode::Ephemeral,
                    )
                    .await
                }
            };
            create(holder.clone())
                .await
                .map_err(|e| failed("create", e))?;
            let (fired_tx, fired) = oneshot::channel();
            let watched = waiter
                .exists_w(&node, move |_e: WatchedEvent| {
                    let _ = fired_tx.send(());
                })
                .await
                .map_err(|e| failed("exists_w", e))?;
            if watched.is_none() {
                return Err(Error::backend(
                    BACKEND,
                    format!("probe: {node} vanished before the watch was set"),
                ));
            }
            holder
                .delete(&node, None)
                .await
                .map_err(|e| failed("delete", e))?;
            let released = Instant::now();
            fired.await.map_err(|_| {
                Error::backend(BACKEND, format!("probe: the watch on {node} never fired"))
            })?;
            create(waiter.clone())
                .await
                .map_err(|e| failed("create (waiter)", e))?;
            let took = released.elapsed();
            waiter
                .delete(&node, None)
                .await
                .map_err(|e| failed("delete (waiter)", e))?;
            Ok(took)
        };
        tokio::time::timeout(limit, run)
            .await
            .unwrap_or_else(|_| Err(no_answer(&self.servers, "a handoff")))
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
        if let Some(w) = self.waiter.take() {
            let _ = tokio::time::timeout(Duration::from_secs(2), w.close()).await;
        }
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
            let waiter = self.waiter.take();
            rt.spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(2), zk.close()).await;
                if let Some(w) = waiter {
                    let _ = tokio::time::timeout(Duration::from_secs(2), w.close()).await;
                }
            });
        }
    }
}

/// A session with `servers`, established (one request answered) within `connect_timeout`.
async fn session(
    servers: &str,
    session_timeout: Duration,
    connect_timeout: Duration,
) -> Result<Arc<ZooKeeper>> {
    let deadline = tokio::time::Instant::now() + connect_timeout;
    let connect = ZooKeeper::connect_with_retry_time(
        servers,
        session_timeout,
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
        Err(_) => return Err(no_answer(servers, "connecting")),
    };
    // The first answered request proves the session is established.
    match tokio::time::timeout_at(deadline, zk.exists("/", false)).await {
        Ok(Ok(_)) => Ok(zk),
        Ok(Err(e)) => Err(Error::backend_source(
            BACKEND,
            format!("probe: establishing a session with {servers}"),
            true,
            e,
        )),
        Err(_) => Err(no_answer(servers, "establishing a session")),
    }
}

fn no_answer(servers: &str, what: &str) -> Error {
    Error::backend(
        BACKEND,
        format!("probe: {what} with {servers}: no answer within the connect timeout"),
    )
}

/// ZooKeeper's floors: `exists("/")` on a session of its own, and a handoff between it
/// and a second session.
pub(crate) struct ZkFloors(pub(crate) ZkProbe);

impl Probe for ZkFloors {
    fn round_trip_name(&self) -> &'static str {
        "exists"
    }

    fn floors(&self) -> Vec<Floor> {
        vec![Floor::RoundTrip, Floor::Handoff]
    }

    fn handoff_name(&self) -> &'static str {
        "watch on a deleted node + create"
    }

    fn handoff(&mut self, limit: Duration) -> BoxFuture<'_, Result<Duration>> {
        Box::pin(self.0.handoff(limit))
    }

    fn measure(&mut self, floor: Floor, limit: Duration) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            match floor {
                Floor::RoundTrip => self.0.exists(limit).await,
                Floor::Handoff => self.0.handoff(limit).await.map(drop),
                other => Err(unsupported_floor(BACKEND, other)),
            }
        })
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, Result<()>> {
        Box::pin(self.0.close())
    }
}
