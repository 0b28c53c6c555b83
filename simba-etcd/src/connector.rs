//! The etcd [`Connector`]: `etcd://` URLs through [`simba_core::connect`] (with the
//! `bench` feature, the floors `simba bench` compares to: `crate::floor`).

use std::sync::Arc;
use std::time::Duration;

use simba_core::backend::{BoxFuture, LeaseReply};
use simba_core::connect::{Capabilities, ConnectOptions, Connection, Connector, Ownership};
use simba_core::{ContendServiceFactory, Result, Semaphore};

use crate::common::{bounded, first_key, now_millis, owner_of};
use crate::config::{EtcdConfig, PLAIN_SCHEMES, TLS_SCHEMES, redact_url};
use crate::factory::EtcdFactory;
#[cfg(feature = "bench")]
use crate::floor::EtcdProbe;

/// The etcd connector, for [`Connectors`](simba_core::connect::Connectors).
///
/// It connects a URL with [`EtcdConfig::from_url`]. A chosen lease
/// ([`ConnectOptions::with_lease`]) becomes the etcd lease TTL, `ttl + transition` rounded
/// up to whole seconds (at least 2 s, etcd's shortest lease).
///
/// ```no_run
/// use simba_core::connect::{ConnectOptions, Connectors};
/// # async fn run() -> simba_core::Result<()> {
/// let connectors = Connectors::new(vec![&simba_etcd::CONNECTOR]);
/// let backend = connectors
///     .connect("etcd://127.0.0.1:2379/apps", &ConnectOptions::default())
///     .await?;
/// let locker = simba_core::Locker::new(backend.factory(), "nightly-report")?;
/// # let _ = locker; Ok(()) }
/// ```
pub static CONNECTOR: EtcdConnector = EtcdConnector;

/// See [`CONNECTOR`].
#[derive(Debug, Clone, Copy)]
pub struct EtcdConnector;

#[derive(Debug)]
struct EtcdConnection {
    factory: Arc<EtcdFactory>,
}

impl EtcdConnector {
    fn config(url: &str, options: &ConnectOptions) -> Result<EtcdConfig> {
        let mut config = EtcdConfig::from_url(url)?;
        if let Some(lease) = options.session_timeout() {
            let secs = lease.as_secs() + u64::from(lease.subsec_nanos() > 0);
            config = config.with_lease_ttl(Duration::from_secs(secs.max(2)));
        }
        if let Some(timeout) = options.connect_timeout() {
            config = config.with_connect_timeout(timeout);
        }
        config.validate()?;
        Ok(config)
    }
}

impl Connector for EtcdConnector {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn schemes(&self) -> Vec<&'static str> {
        let mut schemes = PLAIN_SCHEMES.to_vec();
        schemes.extend_from_slice(TLS_SCHEMES);
        schemes
    }

    fn forms(&self) -> Vec<&'static str> {
        vec![
            "etcd://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…][/PREFIX]",
            "etcds://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…][/PREFIX][?tlsCaFile=PATH&tlsCertFile=PATH&tlsKeyFile=PATH&tlsServerName=NAME] (feature `tls`)",
        ]
    }

    fn redact(&self, url: &str) -> String {
        redact_url(url)
    }

    fn validate(&self, url: &str) -> Result<()> {
        EtcdConfig::from_url(url).map(drop)
    }

    fn connect<'a>(
        &'a self,
        url: &'a str,
        options: &'a ConnectOptions,
    ) -> BoxFuture<'a, Result<Box<dyn Connection>>> {
        Box::pin(async move {
            let factory = Arc::new(EtcdFactory::connect(Self::config(url, options)?).await?);
            Ok(Box::new(EtcdConnection { factory }) as Box<dyn Connection>)
        })
    }
}

impl Connection for EtcdConnection {
    fn factory(&self) -> Arc<dyn ContendServiceFactory> {
        self.factory.clone()
    }

    fn capabilities(&self) -> Capabilities {
        // Leases that end by themselves (so holds work); watches wake waiters and observers.
        Capabilities::new(Ownership::Lease, true, true)
    }

    fn read_owner<'a>(&'a self, mutex: &'a str) -> Option<BoxFuture<'a, Result<LeaseReply>>> {
        Some(Box::pin(async move {
            let prefix = self.factory.mutex_prefix(mutex)?;
            let config = self.factory.config();
            let mut kv = self.factory.client().kv_client();
            let resp = bounded(
                "reading the owner",
                config.connect_timeout,
                kv.get(prefix.as_bytes(), Some(first_key())),
            )
            .await?;
            let now = now_millis();
            let Some(kv) = resp.kvs().first() else {
                return Ok(LeaseReply {
                    owner: simba_core::MutexOwner::NONE,
                    now,
                });
            };
            // The time left on the owner key's lease, by the leader (whole seconds).
            let mut leases = self.factory.client().lease_client();
            let left = bounded(
                "reading the owner's lease",
                config.connect_timeout,
                leases.time_to_live(kv.lease(), None),
            )
            .await?
            .ttl();
            let left = Duration::from_secs(u64::try_from(left).unwrap_or(0));
            Ok(LeaseReply {
                owner: owner_of(kv, now, left),
                now,
            })
        }))
    }

    /// A semaphore over [`EtcdFactory::permit_store`], timed by
    /// [`EtcdFactory::permit_lease`].
    fn open_semaphore<'a>(
        &'a self,
        name: &'a str,
        permits: u32,
    ) -> BoxFuture<'a, Result<Semaphore>> {
        Box::pin(async move { self.factory.semaphore(name, permits) })
    }

    #[cfg(feature = "bench")]
    fn probe<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Box<dyn simba_core::connect::Probe>>> {
        Box::pin(async move {
            let probe = EtcdProbe::open(self.factory.config(), name).await?;
            Ok(Box::new(probe) as Box<dyn simba_core::connect::Probe>)
        })
    }

    fn connections(&self) -> String {
        "1 gRPC channel (HTTP/2); per contender 1 keep-alive stream + 1 watch stream while \
         waiting"
            .to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(not(feature = "tls"))]
    use simba_core::Error;
    use simba_core::connect::Connectors;

    #[test]
    fn schemes_and_options() {
        let c = Connectors::new(vec![&CONNECTOR]);
        assert!(c.validate("etcd://h:2379,h2:2379/apps").is_ok());
        assert!(c.validate("etcd:///apps").is_err());
        #[cfg(not(feature = "tls"))]
        match c.validate("etcds://h:2379") {
            Err(Error::InvalidConfig { reason, .. }) => assert!(reason.contains("tunnel")),
            other => panic!("{other:?}"),
        }
        #[cfg(feature = "tls")]
        assert!(c.validate("etcds://h:2379?tlsCaFile=/ca.pem").is_ok());
        assert_eq!(
            c.redact("etcd://u:secret@h:2379/a"),
            "etcd://u:***@h:2379/a"
        );
        let lease = simba_core::LeaseConfig::with_lease(
            Duration::from_millis(1500),
            Duration::from_millis(700),
        );
        let config = EtcdConnector::config("etcd://h/a", &ConnectOptions::new().with_lease(lease))
            .expect("config");
        assert_eq!(config.lease_ttl, Duration::from_secs(3));
    }
}
