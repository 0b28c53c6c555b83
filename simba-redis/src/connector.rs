//! The Redis [`Connector`]: `redis://`, `rediss://`, `-cluster` and `-sentinel` URLs (and
//! their `valkey…` spellings) through [`simba_core::connect`].

use std::sync::Arc;
use std::time::Duration;

use simba_core::backend::{BoxFuture, LeaseReply, LeaseStore};
use simba_core::connect::{
    Capabilities, ConnectOptions, Connection, Connector, Floor, Ownership, Probe, unsupported_floor,
};
use simba_core::{ContendServiceFactory, LeaseServiceFactory, Result};

use crate::config::{RedisConfig, SCHEMES, WaitMode, redact_url};
use crate::error::BACKEND;
use crate::floor::PubSubProbe;
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

    fn probe<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Box<dyn Probe>>> {
        Box::pin(async move {
            let store = (**self.factory.store()).clone();
            let pubsub = match store.config().wait_mode {
                WaitMode::PubSub => Some(store.pubsub_probe(&format!("{name}-pubsub")).await?),
                WaitMode::Polling => None,
            };
            Ok(Box::new(RedisProbe {
                store,
                raw_lock_key: format!("{name}-raw-lock"),
                pubsub,
            }) as Box<dyn Probe>)
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

/// Redis's floors: `PING`, pub/sub delivery, and a script-less `SET NX PX` + `DEL`.
struct RedisProbe {
    store: RedisStore,
    raw_lock_key: String,
    pubsub: Option<PubSubProbe>,
}

/// How long the raw lock's key lives if a probe is cut off between its `SET` and `DEL`.
const RAW_LOCK_TTL: Duration = Duration::from_secs(10);

impl Probe for RedisProbe {
    fn round_trip_name(&self) -> &'static str {
        "PING"
    }

    fn floors(&self) -> Vec<Floor> {
        let mut floors = vec![Floor::RoundTrip, Floor::RawLock];
        if self.pubsub.is_some() {
            floors.push(Floor::PubSub);
        }
        floors
    }

    fn measure(&mut self, floor: Floor, limit: Duration) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let bounded = |what: &str| {
                simba_core::Error::backend(BACKEND, format!("{what}: no answer within {limit:?}"))
            };
            match floor {
                Floor::RoundTrip => tokio::time::timeout(limit, self.store.ping())
                    .await
                    .map_err(|_| bounded("PING"))?,
                Floor::RawLock => tokio::time::timeout(
                    limit,
                    self.store.raw_lock(&self.raw_lock_key, RAW_LOCK_TTL),
                )
                .await
                .map_err(|_| bounded("SET NX PX + DEL"))?
                .map(drop),
                Floor::PubSub => match self.pubsub.as_mut() {
                    Some(p) => p.round_trip(limit).await,
                    None => Err(unsupported_floor(BACKEND, floor)),
                },
                // Redis has no wait queue of its own: the bench adds the pub/sub delivery
                // and a round trip instead.
                Floor::Handoff => Err(unsupported_floor(BACKEND, floor)),
            }
        })
    }
}
