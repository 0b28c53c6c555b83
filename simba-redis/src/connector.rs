//! The Redis [`Connector`]: `redis://`, `rediss://`, `-cluster` and `-sentinel` URLs (and
//! their `valkey…` spellings) through [`simba_core::connect`].

use std::sync::Arc;
use std::time::Duration;

use simba_core::backend::{BoxFuture, LeaseReply, LeaseStore};
use simba_core::connect::{Capabilities, ConnectOptions, Connection, Connector, Ownership};
use simba_core::{ContendServiceFactory, LeaseServiceFactory, Result, Semaphore};

use crate::config::{RedisConfig, SCHEMES, WaitMode, redact_url};
#[cfg(feature = "bench")]
use crate::floor::RedisProbe;
use crate::store::RedisStore;

/// The Redis connector, for [`Connectors`](simba_core::connect::Connectors).
///
/// It connects a URL with [`RedisConfig::new`]'s defaults (the URL's options apply, see
/// [`RedisConfig`]'s URL list) and [`ConnectOptions`]'s lease timing and connect timeout.
///
/// ```no_run
/// use simba_core::connect::{ConnectOptions, Connectors};
/// # async fn run() -> simba_core::Result<()> {
/// let connectors = Connectors::new(vec![&simba_redis::CONNECTOR]);
/// let backend = connectors
///     .connect("redis://127.0.0.1:6379", &ConnectOptions::default())
///     .await?;
/// let locker = simba_core::Locker::new(backend.factory(), "nightly-report")?;
/// # let _ = locker; Ok(()) }
/// ```
pub static CONNECTOR: RedisConnector = RedisConnector;

/// See [`CONNECTOR`].
#[derive(Debug, Clone, Copy)]
pub struct RedisConnector;

/// A Redis store's factory, from [`RedisConnector`].
#[derive(Debug)]
struct RedisConnection {
    factory: Arc<LeaseServiceFactory<RedisStore>>,
}

impl Connector for RedisConnector {
    fn name(&self) -> &'static str {
        "Redis"
    }

    fn schemes(&self) -> Vec<&'static str> {
        SCHEMES.to_vec()
    }

    fn forms(&self) -> Vec<&'static str> {
        let mut forms = vec![
            "redis://HOST[:PORT][/DB]",
            "redis-cluster://HOST:PORT[?node=HOST:PORT…]",
            "redis-sentinel://HOST[:PORT][/DB]?sentinelServiceName=NAME",
        ];
        if cfg!(feature = "tls") {
            forms.push("rediss://… (TLS)");
        }
        forms
    }

    fn redact(&self, url: &str) -> String {
        redact_url(url)
    }

    fn validate(&self, url: &str) -> Result<()> {
        RedisConfig::new(url).validate()
    }

    fn connect<'a>(
        &'a self,
        url: &'a str,
        options: &'a ConnectOptions,
    ) -> BoxFuture<'a, Result<Box<dyn Connection>>> {
        Box::pin(async move {
            let lease = options.lease().clone();
            lease.validate()?;
            let mut config = RedisConfig::new(url);
            if let Some(timeout) = options.connect_timeout() {
                config = config.with_connect_timeout(timeout);
            }
            let store = RedisStore::connect(config).await?;
            let factory = Arc::new(LeaseServiceFactory::new(store, lease)?);
            Ok(Box::new(RedisConnection { factory }) as Box<dyn Connection>)
        })
    }
}

impl Connection for RedisConnection {
    fn factory(&self) -> Arc<dyn ContendServiceFactory> {
        self.factory.clone()
    }

    fn capabilities(&self) -> Capabilities {
        let pushes = self.factory.store().config().wait_mode == WaitMode::PubSub;
        Capabilities::new(Ownership::Lease, pushes, pushes)
    }

    fn read_owner<'a>(&'a self, mutex: &'a str) -> Option<BoxFuture<'a, Result<LeaseReply>>> {
        Some(Box::pin(self.factory.store().owner(mutex)))
    }

    fn open_semaphore<'a>(
        &'a self,
        name: &'a str,
        permits: u32,
    ) -> BoxFuture<'a, Result<Semaphore>> {
        Box::pin(async move { Semaphore::from_factory(&self.factory, name, permits) })
    }

    #[cfg(feature = "bench")]
    fn probe<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Box<dyn simba_core::connect::Probe>>> {
        Box::pin(async move {
            let store = (**self.factory.store()).clone();
            Ok(Box::new(RedisProbe::open(store, name).await?)
                as Box<dyn simba_core::connect::Probe>)
        })
    }

    fn connections(&self) -> String {
        match self.factory.store().config().wait_mode {
            WaitMode::PubSub => "1 command + 1 subscriber connection".to_owned(),
            WaitMode::Polling => "1 command connection".to_owned(),
        }
    }

    fn server_connections(&self) -> BoxFuture<'_, Option<usize>> {
        Box::pin(async { self.factory.store().client_count().await.ok() })
    }

    fn restart_quarantine(&self) -> BoxFuture<'_, Option<Duration>> {
        Box::pin(async {
            let lease = self.factory.config().lease().total();
            self.factory
                .store()
                .restart_quarantine(lease)
                .await
                .ok()
                .flatten()
        })
    }
}
