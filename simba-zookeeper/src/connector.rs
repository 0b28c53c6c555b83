//! The ZooKeeper [`Connector`]: `zk://` and `zookeeper://` URLs through
//! [`simba_core::connect`] (and the TLS spellings, refused with what to do instead).

use std::sync::Arc;

use simba_core::backend::{BoxFuture, LeaseReply};
use simba_core::connect::{Capabilities, ConnectOptions, Connection, Connector, Ownership};
use simba_core::{ContendServiceFactory, Result, Semaphore};

use crate::config::{TLS_SCHEMES, ZkConfig, redact_url};
use crate::factory::ZkFactory;
#[cfg(feature = "bench")]
use crate::floor::{ZkFloors, ZkProbe};

/// The ZooKeeper connector, for [`Connectors`](simba_core::connect::Connectors).
///
/// It connects a URL with [`ZkConfig::from_url`]. ZooKeeper keeps an ownership as long as
/// the owner's session, not by leases: [`ConnectOptions::session_timeout`] (which
/// [`ConnectOptions::with_lease`] sets to `ttl + transition`) is how long a silent owner
/// keeps the mutex; without one, the URL's or [`ZkConfig`]'s default applies.
///
/// ```no_run
/// use simba_core::connect::{ConnectOptions, Connectors};
/// # async fn run() -> simba_core::Result<()> {
/// let connectors = Connectors::new(vec![&simba_zookeeper::CONNECTOR]);
/// let backend = connectors
///     .connect("zk://127.0.0.1:2181/apps", &ConnectOptions::default())
///     .await?;
/// let locker = simba_core::Locker::new(backend.factory(), "nightly-report")?;
/// # let _ = locker; Ok(()) }
/// ```
pub static CONNECTOR: ZkConnector = ZkConnector;

/// See [`CONNECTOR`].
#[derive(Debug, Clone, Copy)]
pub struct ZkConnector;

/// A ZooKeeper session's factory, from [`ZkConnector`].
#[derive(Debug)]
struct ZkConnection {
    factory: Arc<ZkFactory>,
}

impl ZkConnector {
    fn config(url: &str, options: &ConnectOptions) -> Result<ZkConfig> {
        let mut config = ZkConfig::from_url(url)?;
        if let Some(timeout) = options.session_timeout() {
            config = config.with_session_timeout(timeout);
        }
        if let Some(timeout) = options.connect_timeout() {
            config = config.with_connect_timeout(timeout);
        }
        config.validate()?;
        Ok(config)
    }
}

impl Connector for ZkConnector {
    fn name(&self) -> &'static str {
        "ZooKeeper"
    }

    fn schemes(&self) -> Vec<&'static str> {
        let mut schemes = vec!["zk", "zookeeper"];
        schemes.extend_from_slice(TLS_SCHEMES);
        schemes
    }

    fn forms(&self) -> Vec<&'static str> {
        vec!["zk://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…][/CHROOT]"]
    }

    fn redact(&self, url: &str) -> String {
        redact_url(url)
    }

    fn validate(&self, url: &str) -> Result<()> {
        ZkConfig::from_url(url)?.validate()
    }

    fn connect<'a>(
        &'a self,
        url: &'a str,
        options: &'a ConnectOptions,
    ) -> BoxFuture<'a, Result<Box<dyn Connection>>> {
        Box::pin(async move {
            let factory = Arc::new(ZkFactory::connect(Self::config(url, options)?).await?);
            Ok(Box::new(ZkConnection { factory }) as Box<dyn Connection>)
        })
    }
}

impl Connection for ZkConnection {
    fn factory(&self) -> Arc<dyn ContendServiceFactory> {
        self.factory.clone()
    }

    fn capabilities(&self) -> Capabilities {
        // Watches wake waiters and tell observers.
        Capabilities::new(Ownership::Session, true, true)
    }

    fn read_owner<'a>(&'a self, _mutex: &'a str) -> Option<BoxFuture<'a, Result<LeaseReply>>> {
        None
    }

    /// On this connection's session, timed by [`ZkFactory::permit_lease`] (the longest
    /// lease the session allows; the session timeout is the options').
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
            let probe = ZkProbe::connect(self.factory.config(), name).await?;
            Ok(Box::new(ZkFloors(probe)) as Box<dyn simba_core::connect::Probe>)
        })
    }

    fn connections(&self) -> String {
        "1 session (one TCP connection)".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use simba_core::connect::Connectors;

    #[test]
    fn tls_spellings_are_owned_and_refused_with_the_way_round() {
        let c = Connectors::new(vec![&CONNECTOR]);
        for url in ["zks://h:2281", "ZooKeeper+TLS://h:2281/a", "zookeepers://h"] {
            match c.validate(url) {
                Err(simba_core::Error::InvalidConfig { reason, .. }) => {
                    assert!(reason.contains("tunnel"), "{url}: {reason}");
                }
                other => panic!("{url}: {other:?}"),
            }
        }
        assert!(c.validate("zk://h:2181,h2:2181/apps").is_ok());
        assert!(c.validate("zk:///apps").is_err());
        assert_eq!(c.redact("zk://u:secret@h:2181/a"), "zk://u:***@h:2181/a");
    }

    #[test]
    fn a_chosen_lease_becomes_the_session_timeout() {
        let lease =
            simba_core::LeaseConfig::with_lease(Duration::from_secs(8), Duration::from_secs(2));
        let options = ConnectOptions::new()
            .with_lease(lease)
            .with_connect_timeout(Duration::from_secs(3));
        let config = ZkConnector::config("zk://h:2181/a", &options).expect("config");
        assert_eq!(config.session_timeout, Duration::from_secs(10));
        assert_eq!(config.connect_timeout, Duration::from_secs(3));
        let default = ZkConnector::config("zk://h:2181/a", &ConnectOptions::new()).expect("config");
        assert_eq!(
            default.session_timeout,
            ZkConfig::new("h:2181").session_timeout
        );
    }
}
