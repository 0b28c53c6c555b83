//! Floors: the bare Redis operations that a mutex operation can be compared to (`simba
//! bench` reports each figure beside them). Every probe runs on the store's own
//! connections, so that it pays what the store pays and nothing more.
//!
//! Only with the `bench` feature.

use std::fmt;
use std::time::Duration;

use fred::clients::{Client, SubscriberClient};
use fred::interfaces::{ClientLike, EventInterface, PubsubInterface};
use fred::types::{ClusterHash, CustomCommand, Message, Value};
use simba_core::backend::BoxFuture;
use simba_core::connect::{Floor, Probe, unsupported_floor};
use simba_core::{Error, Result};
use tokio::sync::broadcast::{self, error::RecvError};

use crate::config::WaitMode;
use crate::error::{BACKEND, backend};
use crate::store::RedisStore;

/// The key-name segment under the store's key prefix that floor probes use.
const FLOOR_SEGMENT: &str = "bench-floor";

impl RedisStore {
    /// One `PING` on the command connection: a bare round trip.
    ///
    /// # Errors
    /// [`Error::Backend`] if the server does not answer within the command timeout.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub(crate) async fn ping(&self) -> Result<()> {
        self.client()
            .ping::<Value>(None)
            .await
            .map(drop)
            .map_err(|e| backend("PING", e))
    }

    /// The lock a script-less client would take: `SET key 1 NX PX ttl`, then `DEL key` (two
    /// round trips on the command connection), on the key `{prefix}:bench-floor:{name}`.
    /// Returns whether the `SET` took the key.
    ///
    /// # Errors
    /// [`Error::Backend`] if a command fails or times out.
    ///
    /// # Cancel safety
    /// Dropping the future may leave the key set; it expires after `ttl`.
    pub(crate) async fn raw_lock(&self, name: &str, ttl: Duration) -> Result<bool> {
        let key = self.floor_key(name);
        let px = ttl.as_millis().max(1).to_string();
        let set: Value = self
            .client()
            .custom(
                CustomCommand::new_static("SET", ClusterHash::FirstKey, false),
                vec![key.as_str(), "1", "NX", "PX", px.as_str()],
            )
            .await
            .map_err(|e| backend("SET NX PX", e))?;
        let _: Value = self
            .client()
            .custom(
                CustomCommand::new_static("DEL", ClusterHash::FirstKey, false),
                vec![key.as_str()],
            )
            .await
            .map_err(|e| backend("DEL", e))?;
        Ok(!matches!(set, Value::Null))
    }

    /// A probe of pub/sub delivery: subscribes the channel `{prefix}:bench-floor:{name}` on
    /// the store's subscriber connection (the one that delivers handoffs), so that
    /// [`PubSubProbe::round_trip`] can publish on the command connection and wait for the
    /// message to arrive.
    ///
    /// # Errors
    /// [`Error::InvalidState`] when the store has no subscriber connection
    /// ([`WaitMode::Polling`](crate::WaitMode::Polling)); [`Error::Backend`] if the
    /// subscription fails.
    ///
    /// # Cancel safety
    /// Dropping the future may leave the channel subscribed until the store closes.
    pub(crate) async fn pubsub_probe(&self, name: &str) -> Result<PubSubProbe> {
        let Some(subscriber) = self.subscriber().cloned() else {
            return Err(Error::InvalidState(
                "the pub/sub floor needs a store in WaitMode::PubSub".into(),
            ));
        };
        let channel = self.floor_key(name);
        let sharded = self.sharded();
        // Listen before subscribing, so that nothing published after the SUBSCRIBE is missed.
        let messages = subscriber.message_rx();
        let subscribed = if sharded {
            subscriber.ssubscribe(channel.as_str()).await
        } else {
            subscriber.subscribe(channel.as_str()).await
        };
        subscribed.map_err(|e| backend("subscribing the floor channel", e))?;
        Ok(PubSubProbe {
            publisher: self.client().clone(),
            subscriber,
            sharded,
            channel,
            messages,
            sent: 0,
        })
    }

    fn floor_key(&self, name: &str) -> String {
        format!("{}:{FLOOR_SEGMENT}:{name}", self.config().key_prefix)
    }
}

/// Publishes on a store's command connection and waits for the message on its subscriber
/// connection; from [`RedisStore::pubsub_probe`]. Unsubscribes when dropped.
pub(crate) struct PubSubProbe {
    publisher: Client,
    subscriber: SubscriberClient,
    sharded: bool,
    channel: String,
    messages: broadcast::Receiver<Message>,
    sent: u64,
}

impl fmt::Debug for PubSubProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PubSubProbe")
            .field("channel", &self.channel)
            .field("sent", &self.sent)
            .finish_non_exhaustive()
    }
}

impl PubSubProbe {
    /// Publishes one message (`PUBLISH`, or `SPUBLISH` on Cluster) and returns when the
    /// subscriber connection has delivered it.
    ///
    /// # Errors
    /// [`Error::Backend`] if publishing fails, nobody received the message, or it does not
    /// arrive within `limit`.
    ///
    /// # Cancel safety
    /// Cancel safe; a message that arrives after a cancelled call is skipped by the next.
    pub(crate) async fn round_trip(&mut self, limit: Duration) -> Result<()> {
        self.sent += 1;
        let payload = format!("floor@@{}", self.sent);
        let receivers: i64 = if self.sharded {
            self.publisher
                .spublish(self.channel.as_str(), payload.as_str())
                .await
        } else {
            self.publisher
                .publish(self.channel.as_str(), payload.as_str())
                .await
        }
        .map_err(|e| backend("PUBLISH", e))?;
        if receivers < 1 {
            return Err(Error::backend(
                BACKEND,
                "PUBLISH reached no subscriber (the floor channel is not subscribed)",
            ));
        }
        let wait = async {
            loop {
                match self.messages.recv().await {
                    Ok(m) if *m.channel == *self.channel && is_payload(&m.value, &payload) => {
                        return Ok(());
                    }
                    Ok(_) | Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => {
                        return Err(Error::backend(BACKEND, "the subscriber connection closed"));
                    }
                }
            }
        };
        tokio::time::timeout(limit, wait).await.unwrap_or_else(|_| {
            Err(Error::backend(
                BACKEND,
                format!("a published message did not arrive within {limit:?}"),
            ))
        })
    }
}

fn is_payload(v: &Value, payload: &str) -> bool {
    match v {
        Value::String(s) => &**s == payload,
        Value::Bytes(b) => &b[..] == payload.as_bytes(),
        _ => false,
    }
}

impl Drop for PubSubProbe {
    fn drop(&mut self) {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (subscriber, channel, sharded) =
                (self.subscriber.clone(), self.channel.clone(), self.sharded);
            rt.spawn(async move {
                let _ = if sharded {
                    subscriber.sunsubscribe(channel).await
                } else {
                    subscriber.unsubscribe(channel).await
                };
            });
        }
    }
}

/// Redis's floors: `PING`, pub/sub delivery, and a script-less `SET NX PX` + `DEL`, on
/// the store's own connections (`Connection::probe` of the connector).
pub(crate) struct RedisProbe {
    store: RedisStore,
    raw_lock_key: String,
    pubsub: Option<PubSubProbe>,
}

/// How long the raw lock's key lives if a probe is cut off between its `SET` and `DEL`.
const RAW_LOCK_TTL: Duration = Duration::from_secs(10);

impl RedisProbe {
    /// The probe of `store`, its keys and channel named after `name`: the pub/sub floor
    /// subscribes at once where the store has a subscriber connection.
    ///
    /// # Errors
    /// [`Error::Backend`] if the subscription fails.
    pub(crate) async fn open(store: RedisStore, name: &str) -> Result<RedisProbe> {
        let pubsub = match store.config().wait_mode {
            WaitMode::PubSub => Some(store.pubsub_probe(&format!("{name}-pubsub")).await?),
            WaitMode::Polling => None,
        };
        Ok(RedisProbe {
            store,
            raw_lock_key: format!("{name}-raw-lock"),
            pubsub,
        })
    }
}

impl Probe for RedisProbe {
    fn round_trip_name(&self) -> &'static str {
        "PING"
    }

    fn durability(&mut self) -> BoxFuture<'_, Result<Vec<(String, String)>>> {
        Box::pin(async move {
            let mut settings = Vec::new();
            // One name per `CONFIG GET` (several at once need Redis 7).
            for name in ["appendonly", "appendfsync", "save"] {
                let reply: std::collections::HashMap<String, String> = self
                    .store
                    .client()
                    .custom(
                        CustomCommand::new_static("CONFIG", ClusterHash::Random, false),
                        vec!["GET", name],
                    )
                    .await
                    .map_err(|e| backend("CONFIG GET", e))?;
                if let Some(value) = reply.get(name) {
                    settings.push((name.to_owned(), value.clone()));
                }
            }
            Ok(settings)
        })
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
            let bounded =
                |what: &str| Error::backend(BACKEND, format!("{what}: no answer within {limit:?}"));
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
