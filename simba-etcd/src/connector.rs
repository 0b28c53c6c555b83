//! The etcd [`Connector`]: `etcd://` URLs through [`simba_core::connect`], with the floors
//! `simba bench` compares to.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, EventType, PutOptions, Txn, TxnOp, WatchOptions, WatchStream,
};
use simba_core::backend::{BoxFuture, LeaseReply};
use simba_core::connect::{
    Capabilities, ConnectOptions, Connection, Connector, Floor, Ownership, Probe, unsupported_floor,
};
use simba_core::{ContendServiceFactory, Error, Result};

use crate::common::{BACKEND, bounded, first_key, now_millis, owner_of};
use crate::config::{EtcdConfig, PLAIN_SCHEMES, TLS_SCHEMES, redact_url};
use crate::factory::{EtcdFactory, connect_client};

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

    fn probe<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Box<dyn Probe>>> {
        Box::pin(async move {
            let probe = EtcdProbe::open(self.factory.config(), name).await?;
            Ok(Box::new(probe) as Box<dyn Probe>)
        })
    }

    fn connections(&self) -> String {
        "1 gRPC channel (HTTP/2); per contender 1 keep-alive stream + 1 watch stream while \
         waiting"
            .to_owned()
    }
}

/// etcd's floors, on a client of its own: a `put` (one write through the leader), a
/// watch delivery of a `put`, and the lock a recipe-less client would take (put-if-absent
/// with a lease, then delete).
struct EtcdProbe {
    client: Client,
    key: Vec<u8>,
    lease: i64,
    watch: Option<WatchStream>,
    counter: u64,
}

impl EtcdProbe {
    async fn open(config: &EtcdConfig, name: &str) -> Result<EtcdProbe> {
        let client = connect_client(config).await?;
        let key = format!("{}/.probe/{name}", config.prefix.trim_end_matches('/')).into_bytes();
        let limit = config.connect_timeout;
        let mut leases = client.lease_client();
        let lease = bounded("probe: granting a lease", limit, leases.grant(60, None))
            .await?
            .id();
        let mut watches = client.watch_client();
        let mut watch = bounded(
            "probe: watching",
            limit,
            watches.watch(key.clone(), Some(WatchOptions::new())),
        )
        .await?;
        // The first answer confirms the watch is in place.
        bounded("probe: watch created", limit, watch.message()).await?;
        Ok(EtcdProbe {
            client,
            key,
            lease,
            watch: Some(watch),
            counter: 0,
        })
    }
}

impl Probe for EtcdProbe {
    fn round_trip_name(&self) -> &'static str {
        "put"
    }

    fn floors(&self) -> Vec<Floor> {
        vec![Floor::RoundTrip, Floor::PubSub, Floor::RawLock]
    }

    fn measure(&mut self, floor: Floor, limit: Duration) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let mut kv = self.client.kv_client();
            self.counter += 1;
            let value = self.counter.to_string();
            match floor {
                Floor::RoundTrip => {
                    bounded(
                        "probe: put",
                        limit,
                        kv.put(
                            self.key.clone(),
                            value,
                            Some(PutOptions::new().with_lease(self.lease)),
                        ),
                    )
                    .await?;
                    Ok(())
                }
                Floor::PubSub => {
                    let Some(watch) = self.watch.as_mut() else {
                        return Err(Error::backend(BACKEND, "probe: the watch is closed"));
                    };
                    let t = async {
                        kv.put(
                            self.key.clone(),
                            value.clone(),
                            Some(PutOptions::new().with_lease(self.lease)),
                        )
                        .await?;
                        loop {
                            let Some(resp) = watch.message().await? else {
                                return Err(etcd_client::Error::WatchError(
                                    "watch stream ended".to_owned(),
                                ));
                            };
                            let delivered = resp.events().iter().any(|e| {
                                e.event_type() == EventType::Put
                                    && e.kv().is_some_and(|kv| kv.value() == value.as_bytes())
                            });
                            if delivered {
                                return Ok(());
                            }
                        }
                    };
                    bounded("probe: watch delivery", limit, t).await
                }
                Floor::RawLock => {
                    let lock_key = [self.key.as_slice(), b"/lock"].concat();
                    let t = async {
                        let txn = Txn::new()
                            .when([Compare::create_revision(
                                lock_key.clone(),
                                CompareOp::Equal,
                                0,
                            )])
                            .and_then([TxnOp::put(
                                lock_key.clone(),
                                value.clone(),
                                Some(PutOptions::new().with_lease(self.lease)),
                            )]);
                        kv.txn(txn).await?;
                        kv.delete(lock_key.clone(), None).await?;
                        Ok(())
                    };
                    bounded("probe: put-if-absent + delete", limit, t).await
                }
                // Not in `floors`: the bench's handoff row compares etcd with its watch
                // delivery plus round trips instead.
                Floor::Handoff => Err(unsupported_floor(BACKEND, Floor::Handoff)),
            }
        })
    }

    fn close(mut self: Box<Self>) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move {
            self.watch = None;
            let mut leases = self.client.lease_client();
            // Revoking deletes the probe's keys.
            bounded(
                "probe: revoking",
                Duration::from_secs(5),
                leases.revoke(self.lease),
            )
            .await?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
