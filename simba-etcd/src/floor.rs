//! Floors: the bare etcd operations that a mutex operation can be compared to (`simba
//! bench` reports each figure beside them), on a client of their own.
//!
//! Only with the `bench` feature.

use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, EventType, PutOptions, Txn, TxnOp, WatchOptions, WatchStream,
};
use simba_core::backend::BoxFuture;
use simba_core::connect::{Floor, Probe, unsupported_floor};
use simba_core::{Error, Result};

use crate::common::{BACKEND, bounded};
use crate::config::EtcdConfig;
use crate::factory::connect_client;

/// etcd's floors, on a client of its own: a `put` (one write through the leader), a
/// watch delivery of a `put`, and the lock a recipe-less client would take (put-if-absent
/// with a lease, then delete).
pub(crate) struct EtcdProbe {
    client: Client,
    key: Vec<u8>,
    lease: i64,
    watch: Option<WatchStream>,
    counter: u64,
}

impl EtcdProbe {
    pub(crate) async fn open(config: &EtcdConfig, name: &str) -> Result<EtcdProbe> {
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
