//! Shared test support: the conformance harness over a real etcd, and helpers.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use simba_core::ContendServiceFactory;
use simba_core::backend::BoxFuture;
use simba_etcd::{EtcdConfig, EtcdFactory};
use simba_test_kit::proxy::{FaultProxy, ProxyFault};
use simba_test_kit::servers::TestServer;
use simba_test_kit::suite::{
    Fault, Harness, Intrusion, SetupError, SuiteCapabilities, SuiteTiming,
};
use simba_test_kit::support::{init_tracing, unique_name};

/// The lease of the conformance harness: etcd's shortest (the suite's 1.5 s lease is
/// below what etcd grants).
pub const LEASE: Duration = Duration::from_secs(2);

/// A key prefix no other test uses.
pub fn random_prefix() -> String {
    format!("/{}", unique_name("simba-test"))
}

/// The settings tests use for a server URL.
pub fn test_config(url: &str, prefix: &str, lease: Duration) -> EtcdConfig {
    EtcdConfig::from_url(url)
        .unwrap_or_else(|e| panic!("test URL {url}: {e}"))
        .with_prefix(prefix)
        .with_lease_ttl(lease)
        .with_connect_timeout(Duration::from_secs(10))
}

/// The kit's etcd (shared by the harness's factories), with tracing set up.
pub async fn server() -> TestServer {
    init_tracing();
    simba_test_kit::servers::etcd()
        .await
        .unwrap_or_else(|e| panic!("no etcd server for the tests: {e}"))
}

/// A private etcd that the test may stop, pause and start.
pub async fn private_server() -> TestServer {
    init_tracing();
    simba_test_kit::servers::etcd_private()
        .await
        .unwrap_or_else(|e| panic!("no private etcd server for the tests: {e}"))
}

/// A factory on `server` through a new fault proxy.
pub async fn proxied(server: &TestServer, prefix: &str) -> (EtcdFactory, FaultProxy) {
    let proxy = FaultProxy::start(server.socket_addr().expect("server address"))
        .await
        .expect("start a fault proxy");
    let factory = EtcdFactory::connect(test_config(&server.url_via(proxy.addr()), prefix, LEASE))
        .await
        .expect("connect through the proxy");
    (factory, proxy)
}

/// The conformance harness: every factory is a new [`EtcdFactory`] (its own client) on
/// one server, under a key prefix of its own per harness.
pub struct EtcdHarness {
    server: TestServer,
    prefix: String,
}

impl EtcdHarness {
    /// A harness on the kit's etcd server.
    pub async fn start() -> Self {
        EtcdHarness {
            server: server().await,
            prefix: random_prefix(),
        }
    }
}

impl Harness for EtcdHarness {
    fn name(&self) -> String {
        "etcd".to_owned()
    }

    fn capabilities(&self, _timing: SuiteTiming) -> SuiteCapabilities {
        SuiteCapabilities {
            // Waiters watch their predecessor's key.
            pushes_release: true,
            // The leader revokes an expired lease within its 500 ms expiry check, then the
            // next waiter's watch fires: the lease plus a second and a half.
            failover_bound: LEASE + Duration::from_millis(1500),
            // The owner gives up at the last answered keep-alive's send time + lease - margin.
            loss_bound: LEASE + Duration::from_millis(500),
        }
    }

    fn factory(
        &self,
        _timing: SuiteTiming,
    ) -> BoxFuture<'_, Result<Arc<dyn ContendServiceFactory>, SetupError>> {
        Box::pin(async move {
            let f =
                EtcdFactory::connect(test_config(self.server.url(), &self.prefix, LEASE)).await?;
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
            let f = EtcdFactory::connect(test_config(&url, &self.prefix, LEASE)).await?;
            Ok((
                Arc::new(f) as Arc<dyn ContendServiceFactory>,
                Box::new(ProxyFault(proxy)) as Box<dyn Fault>,
            ))
        })
    }

    /// The owner's key rewritten to name the intruder, on its own lease (the owner's
    /// renewals check the key's create revision, which a rewrite keeps).
    fn intrude(&self, mutex: &str, owner_id: &str) -> BoxFuture<'_, Result<Intrusion, SetupError>> {
        let (mutex, owner_id) = (mutex.to_owned(), owner_id.to_owned());
        Box::pin(async move {
            use etcd_client::{GetOptions, PutOptions};
            let f =
                EtcdFactory::connect(test_config(self.server.url(), &self.prefix, LEASE)).await?;
            let prefix = f.mutex_prefix(&mutex)?;
            let mut kv = f.client().kv_client();
            let keys = kv
                .get(prefix.as_bytes(), Some(GetOptions::new().with_prefix()))
                .await?;
            let key = keys
                .kvs()
                .iter()
                // The value is `{fence}\n{id}` (an older build's: `{id}`).
                .find(|k| {
                    k.value() == owner_id.as_bytes()
                        || k.value().ends_with(format!("\n{owner_id}").as_bytes())
                })
                .map(|k| k.key().to_vec())
                .ok_or_else(|| format!("no key of {owner_id} under {prefix}"))?;
            kv.put(
                key,
                simba_test_kit::suite::INTRUDER,
                Some(PutOptions::new().with_ignore_lease()),
            )
            .await?;
            // The key stays the lowest and on the owner's lease until the owner releases.
            Ok(Intrusion::Freed)
        })
    }
}

/// The semaphore harness: every store is a new [`EtcdFactory`]'s permit store (its own
/// client), on one server, under a key prefix of its own per harness.
pub struct EtcdPermitHarness {
    server: TestServer,
    prefix: String,
}

impl EtcdPermitHarness {
    /// A harness on the kit's etcd server.
    pub async fn start() -> Self {
        EtcdPermitHarness {
            server: server().await,
            prefix: random_prefix(),
        }
    }
}

impl simba_test_kit::rw_cases::RwSource for EtcdPermitHarness {
    fn name(&self) -> String {
        "etcd".to_owned()
    }

    /// The gate a mutex of a new factory (its own client), the readers permits of the same.
    fn rwlock<'a>(
        &'a self,
        lock: &'a str,
        config: simba_core::LeaseConfig,
    ) -> BoxFuture<'a, Result<simba_core::RwLock, SetupError>> {
        Box::pin(async move {
            let f =
                EtcdFactory::connect(test_config(self.server.url(), &self.prefix, LEASE)).await?;
            let permits = Arc::new(f.permit_store());
            let gates: Arc<dyn ContendServiceFactory> = Arc::new(f);
            Ok(simba_core::RwLock::from_parts(
                gates, permits, config, lock,
            )?)
        })
    }

    fn pushes_release(&self) -> bool {
        true
    }
}

impl simba_test_kit::semaphore_cases::PermitSource for EtcdPermitHarness {
    type Store = simba_etcd::EtcdPermitStore;

    fn name(&self) -> String {
        "etcd".to_owned()
    }

    fn store(&self) -> BoxFuture<'_, Result<simba_etcd::EtcdPermitStore, SetupError>> {
        Box::pin(async move {
            let f =
                EtcdFactory::connect(test_config(self.server.url(), &self.prefix, LEASE)).await?;
            Ok(f.permit_store())
        })
    }

    fn pushes_release(&self) -> bool {
        // A watch on the semaphore's keys wakes its waiters when a key is deleted.
        true
    }
}
