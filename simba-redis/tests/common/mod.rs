//! Shared test support: the conformance harness over a real Redis, and helpers.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use simba_core::backend::{BoxFuture, Lease, LeaseStore};
use simba_core::{ContendServiceFactory, LeaseServiceFactory};
use simba_redis::{RedisConfig, RedisStore};
use simba_test_kit::memory::INTRUDER_LEASE;
use simba_test_kit::memory::{lease_capabilities, lease_config};
use simba_test_kit::proxy::{FaultProxy, ProxyFault};
use simba_test_kit::servers::TestServer;
use simba_test_kit::store_cases::StoreSource;
use simba_test_kit::suite::{
    Fault, Harness, INTRUDER, Intrusion, SetupError, SuiteCapabilities, SuiteTiming,
    intrude_through_store,
};
use simba_test_kit::support::{init_tracing, unique_name};

/// What the kit's connector check expects of Redis, plain or over TLS.
pub const CONNECTOR_EXPECT: simba_test_kit::connector::Expect = simba_test_kit::connector::Expect {
    ownership: simba_core::connect::Ownership::Lease,
    round_trip: "PING",
    counts_connections: true,
    semaphores: true,
};

/// The settings tests use for a URL: short timeouts so that faults are noticed quickly.
///
/// The restart quarantine is off: these tests start fresh servers and would wait a lease
/// before their first acquisition. `faults.rs::restart_with_data_loss` turns it on and
/// shows what it is for.
pub fn test_config(url: &str, prefix: &str) -> RedisConfig {
    RedisConfig::new(url)
        .with_restart_quarantine(false)
        .with_key_prefix(prefix)
        .with_command_timeout(Duration::from_secs(2))
        .with_unresponsive_timeout(Duration::from_secs(1))
        .with_heartbeat_interval(Duration::from_millis(500))
        .with_reconnect_max_delay(Duration::from_millis(500))
}

/// The conformance harness: every factory is a new [`RedisStore`] (its own connections)
/// on one server, under a key prefix of its own per harness.
pub struct RedisHarness {
    server: TestServer,
    prefix: String,
    /// URL options appended to the server's URL (`?tlsCaFile=…`).
    options: String,
    /// Whatever must live as long as the harness (certificates, a cluster's nodes).
    _keep: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl RedisHarness {
    /// A harness on the kit's Redis server.
    pub async fn start() -> Self {
        init_tracing();
        let server = simba_test_kit::servers::redis()
            .await
            .unwrap_or_else(|e| panic!("no Redis server for the tests: {e}"));
        RedisHarness {
            server,
            prefix: unique_name("t"),
            options: String::new(),
            _keep: None,
        }
    }

    /// A harness on `server`, whose URL gets `options` (e.g. `?tlsCaFile=…`) appended;
    /// `keep` lives as long as the harness.
    pub fn on(
        server: TestServer,
        options: impl Into<String>,
        keep: Option<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Self {
        init_tracing();
        RedisHarness {
            server,
            prefix: unique_name("t"),
            options: options.into(),
            _keep: keep,
        }
    }

    fn url(&self, base: &str) -> String {
        format!("{base}{}", self.options)
    }
}

impl Harness for RedisHarness {
    fn name(&self) -> String {
        "redis".to_owned()
    }

    fn capabilities(&self, timing: SuiteTiming) -> SuiteCapabilities {
        lease_capabilities(timing, true)
    }

    fn factory(
        &self,
        timing: SuiteTiming,
    ) -> BoxFuture<'_, Result<Arc<dyn ContendServiceFactory>, SetupError>> {
        Box::pin(async move {
            let url = self.url(self.server.url());
            let store = RedisStore::connect(test_config(&url, &self.prefix)).await?;
            let factory = LeaseServiceFactory::new(store, lease_config(timing))?;
            Ok(Arc::new(factory) as Arc<dyn ContendServiceFactory>)
        })
    }

    fn faulty_factory(
        &self,
        timing: SuiteTiming,
    ) -> BoxFuture<'_, Result<(Arc<dyn ContendServiceFactory>, Box<dyn Fault>), SetupError>> {
        Box::pin(async move {
            let proxy = FaultProxy::start(self.server.socket_addr()?).await?;
            let url = self.url(&self.server.url_via(proxy.addr()));
            let store = RedisStore::connect(test_config(&url, &self.prefix)).await?;
            let factory = LeaseServiceFactory::new(store, lease_config(timing))?;
            Ok((
                Arc::new(factory) as Arc<dyn ContendServiceFactory>,
                Box::new(ProxyFault(proxy)) as Box<dyn Fault>,
            ))
        })
    }

    /// `SET <owner key> intruder XX PX 60000` on a plain client; over TLS (the plain
    /// client has no certificates), the owner's release and the intruder's acquisition
    /// by a store of its own.
    fn intrude(&self, mutex: &str, owner_id: &str) -> BoxFuture<'_, Result<Intrusion, SetupError>> {
        let (mutex, owner_id) = (mutex.to_owned(), owner_id.to_owned());
        Box::pin(async move {
            let url = self.url(self.server.url());
            let store = RedisStore::connect(test_config(&url, &self.prefix)).await?;
            if !self.options.is_empty() {
                let take = Some(INTRUDER_LEASE);
                return intrude_through_store(&store, &mutex, &owner_id, take).await;
            }
            let key = store.owner_key(&mutex);
            let r = raw(self.server.url()).await;
            let was = cmd(&r, "GET", &[&key]).await;
            if was.as_string().as_deref() != Some(owner_id.as_str()) {
                return Err(format!("intruding: {key} holds {was:?}, not {owner_id}").into());
            }
            cmd(&r, "SET", &[&key, INTRUDER, "XX", "PX", "60000"]).await;
            Ok(Intrusion::TakenOver)
        })
    }
}

impl StoreSource for RedisHarness {
    type Store = RedisStore;

    fn name(&self) -> String {
        "redis".to_owned()
    }

    fn store(&self) -> BoxFuture<'_, Result<RedisStore, SetupError>> {
        Box::pin(async move {
            let url = self.url(self.server.url());
            Ok(RedisStore::connect(test_config(&url, &self.prefix)).await?)
        })
    }

    fn pushes_release(&self) -> bool {
        true
    }
}

/// A plain fred client for inspecting and manipulating the server in tests.
pub async fn raw(url: &str) -> fred::clients::Client {
    use fred::interfaces::ClientLike;
    let config = fred::types::config::Config::from_url(url)
        .unwrap_or_else(|e| panic!("bad test URL {url}: {e}"));
    let client = fred::types::Builder::from_config(config)
        .build()
        .unwrap_or_else(|e| panic!("building a raw client: {e}"));
    client
        .init()
        .await
        .unwrap_or_else(|e| panic!("connecting a raw client to {url}: {e}"));
    client
}

/// Runs one command on a raw client.
pub async fn cmd(client: &fred::clients::Client, name: &str, args: &[&str]) -> fred::types::Value {
    use fred::interfaces::ClientLike;
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    client
        .custom(fred::cmd!(name.to_owned()), args)
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// How many clients subscribe to `channel` (`PUBSUB NUMSUB`).
pub async fn numsub(client: &fred::clients::Client, channel: &str) -> i64 {
    match cmd(client, "PUBSUB", &["NUMSUB", channel]).await {
        fred::types::Value::Array(v) if v.len() == 2 => v[1].as_i64().unwrap_or(-1),
        other => panic!("PUBSUB NUMSUB: {other:?}"),
    }
}

/// Polls the server until `numsub(channel) == want` (the server's subscription state has
/// no event to await); panics after `bound`.
pub async fn wait_numsub(
    client: &fred::clients::Client,
    channel: &str,
    want: i64,
    bound: Duration,
) {
    let t0 = tokio::time::Instant::now();
    loop {
        let n = numsub(client, channel).await;
        if n == want {
            return;
        }
        assert!(
            t0.elapsed() < bound,
            "{channel}: {n} subscribers, wanted {want}, after {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Acquires `mutex` for `id`, retrying while the store refuses (a replica check that
/// missed its window); panics after 15 s or if another owner holds it. Returns the fence.
pub async fn retry_acquire_for(store: &RedisStore, mutex: &str, id: &str, lease: Lease) -> u64 {
    // A replica's confirmation can miss the 500 ms WAIT window: right after a failover
    // the new replica may still be syncing, and on a loaded machine (the cold CI run) a
    // healthy replica answered late. Neither has an event to await, so retry, bounded.
    let t0 = tokio::time::Instant::now();
    loop {
        match store.acquire(mutex, id, lease).await {
            Ok(r) if r.owner.owner_id == id => return r.owner.fence,
            Ok(r) => panic!("{mutex} is owned by {}", r.owner.owner_id),
            Err(e) => assert!(
                t0.elapsed() < Duration::from_secs(15),
                "no confirmed acquisition: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Mutual TLS with the kit's test certificates: the servers' settings (client
/// certificates required), and the URL options a client gives (`tlsCaFile`, `tlsCertFile`,
/// `tlsKeyFile`), without a leading `?` or `&`.
pub fn mutual_tls(
    certs: &simba_test_kit::servers::TestCerts,
) -> (simba_test_kit::servers::RedisTls, String) {
    let client = certs.client();
    let options = format!(
        "tlsCaFile={}&tlsCertFile={}&tlsKeyFile={}",
        certs.ca().display(),
        client.cert.display(),
        client.key.display()
    );
    let tls = simba_test_kit::servers::RedisTls {
        server: certs.server(),
        ca: certs.ca(),
        require_client_cert: true,
    };
    (tls, options)
}

/// A fault point for one store's connections to a Redis Cluster: a [`FaultProxy`] in
/// front of every node, and a resolver ([`NodeProxies::resolver`], for
/// `RedisConfig::with_resolver`) that sends each node's address — the seeds of the URL
/// and the addresses the nodes announce alike — to that node's proxy. Addresses it does
/// not know fail to resolve, so no connection can go around the fault point.
///
/// As a [`Fault`] it acts on all proxies at once: `partition` blackholes every node.
#[derive(Debug)]
pub struct NodeProxies {
    proxies: Vec<FaultProxy>,
}

impl NodeProxies {
    /// A proxy for each of `nodes`.
    pub async fn start(nodes: &[std::net::SocketAddr]) -> std::io::Result<Self> {
        let mut proxies = Vec::with_capacity(nodes.len());
        for node in nodes {
            proxies.push(FaultProxy::start(*node).await?);
        }
        Ok(NodeProxies { proxies })
    }

    /// The proxies, in the order of the nodes.
    pub fn proxies(&self) -> &[FaultProxy] {
        &self.proxies
    }

    /// Fails unless every proxy carries a connection: a store connects to every primary,
    /// so after `RedisStore::connect` with [`resolver`](Self::resolver) an idle proxy
    /// means a node that is not behind the fault point.
    pub fn check_used(&self) -> Result<(), SetupError> {
        let idle: Vec<_> = self
            .proxies
            .iter()
            .filter(|p| p.connection_count() == 0)
            .map(FaultProxy::upstream)
            .collect();
        if idle.is_empty() {
            Ok(())
        } else {
            Err(format!("no connection through the proxies of {idle:?}").into())
        }
    }

    /// The resolver that maps each node's address to its proxy.
    pub fn resolver(&self) -> Arc<dyn fred::types::Resolve> {
        Arc::new(ProxyResolver {
            routes: self
                .proxies
                .iter()
                .map(|p| (p.upstream(), p.addr()))
                .collect(),
        })
    }
}

impl Fault for NodeProxies {
    fn partition(&self) -> BoxFuture<'_, Result<(), SetupError>> {
        for proxy in &self.proxies {
            proxy.blackhole(true);
        }
        Box::pin(async { Ok(()) })
    }

    fn heal(&self) -> BoxFuture<'_, Result<(), SetupError>> {
        for proxy in &self.proxies {
            proxy.heal();
        }
        Box::pin(async { Ok(()) })
    }
}

/// Resolves a node's `host:port` to the address of its proxy.
#[derive(Debug)]
struct ProxyResolver {
    /// (node address, proxy address).
    routes: Vec<(std::net::SocketAddr, std::net::SocketAddr)>,
}

#[async_trait::async_trait]
impl fred::types::Resolve for ProxyResolver {
    async fn resolve(
        &self,
        host: fred::bytes_utils::Str,
        port: u16,
    ) -> Result<Vec<std::net::SocketAddr>, fred::error::Error> {
        let ip: Option<std::net::IpAddr> = match &*host {
            "localhost" => Some(std::net::Ipv4Addr::LOCALHOST.into()),
            other => other.parse().ok(),
        };
        self.routes
            .iter()
            .find(|(node, _)| Some(node.ip()) == ip && node.port() == port)
            .map(|(_, proxy)| vec![*proxy])
            .ok_or_else(|| {
                fred::error::Error::new(
                    fred::error::ErrorKind::IO,
                    format!("no proxy for {host}:{port}"),
                )
            })
    }
}

/// The conformance harness on a Redis Cluster reached by `url` (plain or TLS): every
/// factory is a new [`RedisStore`] under one key prefix; the faulty one reaches the nodes
/// through a [`NodeProxies`], which is its [`Fault`].
pub struct ClusterHarness {
    cluster: simba_test_kit::servers::RedisCluster,
    url: String,
    prefix: String,
    /// Whatever must live as long as the harness (certificates).
    _keep: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl ClusterHarness {
    /// A harness on `cluster`, whose clients use `url`; `keep` lives as long as it.
    pub fn on(
        cluster: simba_test_kit::servers::RedisCluster,
        url: String,
        keep: Option<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Self {
        init_tracing();
        ClusterHarness {
            cluster,
            url,
            prefix: unique_name("t"),
            _keep: keep,
        }
    }
}

impl Harness for ClusterHarness {
    fn name(&self) -> String {
        let kind = if self.cluster.is_tls() { "-tls" } else { "" };
        format!("redis-cluster{kind}({} nodes)", self.cluster.nodes().len())
    }

    fn capabilities(&self, timing: SuiteTiming) -> SuiteCapabilities {
        lease_capabilities(timing, true)
    }

    fn factory(
        &self,
        timing: SuiteTiming,
    ) -> BoxFuture<'_, Result<Arc<dyn ContendServiceFactory>, SetupError>> {
        Box::pin(async move {
            let store = RedisStore::connect(test_config(&self.url, &self.prefix)).await?;
            let factory = LeaseServiceFactory::new(store, lease_config(timing))?;
            Ok(Arc::new(factory) as Arc<dyn ContendServiceFactory>)
        })
    }

    fn faulty_factory(
        &self,
        timing: SuiteTiming,
    ) -> BoxFuture<'_, Result<simba_test_kit::suite::FaultyFactory, SetupError>> {
        Box::pin(async move {
            let nodes = self
                .cluster
                .nodes()
                .iter()
                .map(|n| n.socket_addr())
                .collect::<Result<Vec<_>, _>>()?;
            let proxies = NodeProxies::start(&nodes).await?;
            let config = test_config(&self.url, &self.prefix).with_resolver(proxies.resolver());
            let store = RedisStore::connect(config).await?;
            proxies.check_used()?;
            let factory = LeaseServiceFactory::new(store, lease_config(timing))?;
            Ok((
                Arc::new(factory) as Arc<dyn ContendServiceFactory>,
                Box::new(proxies) as Box<dyn Fault>,
            ))
        })
    }

    /// The owner's release and the intruder's acquisition by a store of its own.
    fn intrude(&self, mutex: &str, owner_id: &str) -> BoxFuture<'_, Result<Intrusion, SetupError>> {
        let (mutex, owner_id) = (mutex.to_owned(), owner_id.to_owned());
        Box::pin(async move {
            let store = RedisStore::connect(test_config(&self.url, &self.prefix)).await?;
            intrude_through_store(&store, &mutex, &owner_id, Some(INTRUDER_LEASE)).await
        })
    }
}

impl StoreSource for ClusterHarness {
    type Store = RedisStore;

    fn name(&self) -> String {
        Harness::name(self)
    }

    fn store(&self) -> BoxFuture<'_, Result<RedisStore, SetupError>> {
        Box::pin(
            async move { Ok(RedisStore::connect(test_config(&self.url, &self.prefix)).await?) },
        )
    }

    fn pushes_release(&self) -> bool {
        true
    }
}
