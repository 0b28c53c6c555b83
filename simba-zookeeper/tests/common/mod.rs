//! Shared test support: the conformance harness over a real ZooKeeper, and helpers.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use simba_core::ContendServiceFactory;
use simba_core::backend::BoxFuture;
use simba_test_kit::proxy::{FaultProxy, ProxyFault};
use simba_test_kit::servers::TestServer;
use simba_test_kit::suite::{
    Fault, Harness, Intrusion, SetupError, SuiteCapabilities, SuiteTiming,
};
use simba_test_kit::support::{init_tracing, unique_name};
use simba_zookeeper::{ZkConfig, ZkFactory};

/// The session timeout of the conformance harness (the suite's ttl is ignored: ZooKeeper
/// has sessions, not leases).
pub const SESSION: Duration = Duration::from_secs(2);

/// A root path no other test uses.
pub fn random_root() -> String {
    format!("/{}", unique_name("simba-test"))
}

/// The settings tests use for a connect string.
pub fn test_config(connect: &str, root: &str, session: Duration) -> ZkConfig {
    ZkConfig::new(connect)
        .with_root(root)
        .with_session_timeout(session)
        .with_connect_timeout(Duration::from_secs(10))
}

/// The kit's ZooKeeper (shared by the harness's factories), with tracing set up.
pub async fn server() -> TestServer {
    init_tracing();
    simba_test_kit::servers::zookeeper()
        .await
        .unwrap_or_else(|e| panic!("no ZooKeeper server for the tests: {e}"))
}

/// A private ZooKeeper that the test may stop and start.
pub async fn private_server() -> TestServer {
    init_tracing();
    simba_test_kit::servers::zookeeper_private()
        .await
        .unwrap_or_else(|e| panic!("no private ZooKeeper server for the tests: {e}"))
}

/// A factory on `server` through a new fault proxy.
pub async fn proxied(
    server: &TestServer,
    config: impl FnOnce(&str) -> ZkConfig,
) -> (ZkFactory, FaultProxy) {
    let proxy = FaultProxy::start(server.socket_addr().expect("server address"))
        .await
        .expect("start a fault proxy");
    let factory = ZkFactory::connect(config(&server.url_via(proxy.addr())))
        .await
        .expect("connect through the proxy");
    (factory, proxy)
}

/// The conformance harness: every factory is a new [`ZkFactory`] (its own session) on one
/// server, under a root path of its own per harness.
pub struct ZkHarness {
    server: TestServer,
    root: String,
}

impl ZkHarness {
    /// A harness on the kit's ZooKeeper server.
    pub async fn start() -> Self {
        ZkHarness {
            server: server().await,
            root: random_root(),
        }
    }
}

impl Harness for ZkHarness {
    fn name(&self) -> String {
        "zookeeper".to_owned()
    }

    fn capabilities(&self, _timing: SuiteTiming) -> SuiteCapabilities {
        SuiteCapabilities {
            // Waiters watch their predecessor's node.
            pushes_release: true,
            // The server expires a silent owner's session after the session timeout (plus
            // up to a tick); its node goes, and the next waiter's watch fires.
            failover_bound: SESSION + Duration::from_secs(2),
            // The owner gives up at the last answered request + session timeout - margin.
            loss_bound: SESSION + Duration::from_millis(500),
        }
    }

    fn factory(
        &self,
        _timing: SuiteTiming,
    ) -> BoxFuture<'_, Result<Arc<dyn ContendServiceFactory>, SetupError>> {
        Box::pin(async move {
            let f = ZkFactory::connect(test_config(self.server.url(), &self.root, SESSION)).await?;
            Ok(Arc::new(f) as Arc<dyn ContendServiceFactory>)
        })
    }

    fn faulty_factory(
        &self,
        _timing: SuiteTiming,
    ) -> BoxFuture<'_, Result<(Arc<dyn ContendServiceFactory>, Box<dyn Fault>), SetupError>> {
        Box::pin(async move {
            let proxy = FaultProxy::start(self.server.socket_addr()?).await?;
            let url = self.server.url_via(proxy.addr());
            let f = ZkFactory::connect(test_config(&url, &self.root, SESSION)).await?;
            Ok((
                Arc::new(f) as Arc<dyn ContendServiceFactory>,
                Box::new(ProxyFault(proxy)) as Box<dyn Fault>,
            ))
        })
    }

    /// The owner's latch node rewritten to name the intruder (a node deleted by hand is
    /// seen by the owner's watch on it, often before the release).
    fn intrude(&self, mutex: &str, owner_id: &str) -> BoxFuture<'_, Result<Intrusion, SetupError>> {
        let (mutex, owner_id) = (mutex.to_owned(), owner_id.to_owned());
        Box::pin(async move {
            self.rewrite_owner_node(&mutex, &owner_id, simba_test_kit::suite::INTRUDER)
                .await?;
            // The node stays the lowest and ours until the owner deletes it at the release.
            Ok(Intrusion::Freed)
        })
    }
}

impl ZkHarness {
    /// Rewrites the data of `owner_id`'s latch node under `mutex` to `to` on a plain client
    /// of its own: the node then names another owner.
    pub async fn rewrite_owner_node(
        &self,
        mutex: &str,
        owner_id: &str,
        to: &str,
    ) -> Result<(), SetupError> {
        let f = ZkFactory::connect(test_config(self.server.url(), &self.root, SESSION)).await?;
        let parent = f.mutex_path(mutex)?;
        let zk = tokio::time::timeout(
            Duration::from_secs(10),
            zookeeper_async::ZooKeeper::connect(
                self.server.url(),
                Duration::from_secs(10),
                |_e| {},
            ),
        )
        .await??;
        let mut found = None;
        for child in zk.get_children(&parent, false).await? {
            let path = format!("{parent}/{child}");
            let (data, _) = zk.get_data(&path, false).await?;
            if data == owner_id.as_bytes() {
                found = Some(path);
                break;
            }
        }
        let path = found.ok_or_else(|| format!("no node of {owner_id} under {parent}"))?;
        zk.set_data(&path, to.as_bytes().to_vec(), None).await?;
        let _ = zk.close().await;
        let _ = f.close().await;
        Ok(())
    }
}

/// A number the server reports under `field` (e.g. `Connections:`, `Received:`) in its
/// answer to the four-letter word `srvr`.
pub async fn srvr_number(server: &TestServer, field: &str) -> u64 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(server.socket_addr().expect("address"))
        .await
        .expect("connect for srvr");
    s.write_all(b"srvr").await.expect("send srvr");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read srvr");
    out.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in {out:?}"))
}

/// The number of client connections `server` reports.
pub async fn connection_count(server: &TestServer) -> usize {
    usize::try_from(srvr_number(server, "Connections:").await).unwrap_or(usize::MAX)
}

/// The session timeout of the semaphore harness: the server's most (60 s), so that the
/// kit's longest permit lease (25 s) fits in half of it (the store refuses longer leases).
pub const PERMIT_SESSION: Duration = Duration::from_secs(60);

/// The kit's semaphore cases' source: every store is a new [`ZkFactory`] (its own
/// session) on one server, under a root path of its own per harness; the semaphore
/// cases' stores have the claim window off, the read-write locks' the default.
pub struct ZkPermitHarness {
    server: TestServer,
    root: String,
}

impl ZkPermitHarness {
    /// A harness on the kit's ZooKeeper server.
    pub async fn start() -> Self {
        ZkPermitHarness {
            server: server().await,
            root: random_root(),
        }
    }
}

impl simba_test_kit::rw_cases::RwSource for ZkPermitHarness {
    fn name(&self) -> String {
        "zookeeper".to_owned()
    }

    /// The gate a mutex of a new session, the readers permits of the same session.
    fn rwlock<'a>(
        &'a self,
        lock: &'a str,
        config: simba_core::LeaseConfig,
    ) -> BoxFuture<'a, Result<simba_core::RwLock, SetupError>> {
        Box::pin(async move {
            let session = test_config(self.server.url(), &self.root, PERMIT_SESSION);
            let factory = ZkFactory::connect(session).await?;
            let permits = Arc::new(factory.permit_store());
            let gates: Arc<dyn ContendServiceFactory> = Arc::new(factory);
            Ok(simba_core::RwLock::from_parts(
                gates, permits, config, lock,
            )?)
        })
    }

    fn pushes_release(&self) -> bool {
        true
    }
}

impl simba_test_kit::semaphore_cases::PermitSource for ZkPermitHarness {
    type Store = simba_zookeeper::ZkPermitStore;

    fn name(&self) -> String {
        "zookeeper".to_owned()
    }

    fn store(&self) -> BoxFuture<'_, Result<simba_zookeeper::ZkPermitStore, SetupError>> {
        Box::pin(async move {
            // The claim window off: these cases include the differential run against the
            // model (`store_admission_follows_the_rule`), whose pass-over keeps a waiter's
            // place; ZooKeeper's claim removes the waiter instead (tests/permit_wake.rs
            // tests it). Off, the cases compare the rule, not timing.
            let config =
                test_config(self.server.url(), &self.root, PERMIT_SESSION).with_permit_claim(None);
            Ok(ZkFactory::connect(config).await?.permit_store())
        })
    }

    fn pushes_release(&self) -> bool {
        // Waiters watch (the first in line the children, the others the node ahead).
        true
    }
}
