//! [`EtcdRetrievalService`]: observes a mutex's owner without contending.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, EventType, WatchOptions, WatchStream};
use simba_core::backend::{
    OwnershipTracker, Reporter, RetrievalHandle, ServiceHandle, ServiceStatus,
};
use simba_core::metrics::FailureKind;
use simba_core::{MutexOwner, MutexRetriever, Result};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::common::{
    BACKEND, bounded, call_limit, first_key, now_millis, owner_of, parse_waiter, watch_from_now,
};
use crate::config::EtcdConfig;

/// A retrieval service on etcd: watches the mutex's key range from now, then reads the
/// first waiter key (the owner), and reads again after every change.
/// Pushed: no polling.
pub struct EtcdRetrievalService {
    prefix: String,
    handle: ServiceHandle,
}

impl fmt::Debug for EtcdRetrievalService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdRetrievalService")
            .field("prefix", &self.prefix)
            .field("service", &self.handle)
            .finish()
    }
}

impl EtcdRetrievalService {
    pub(crate) fn new(
        client: Client,
        config: Arc<EtcdConfig>,
        mutex: String,
        prefix: String,
        retriever: Arc<dyn MutexRetriever>,
    ) -> Self {
        let out = ServiceStatus::new(Reporter::Retriever(retriever)).with_identity(
            BACKEND,
            &mutex,
            "",
            config.metrics_mutex_label,
        );
        let key_prefix = prefix.clone();
        let handle = ServiceHandle::new(out, move |tracker, stop| {
            Box::pin(observe(
                client.clone(),
                config.clone(),
                key_prefix.clone(),
                tracker,
                stop,
            ))
        });
        EtcdRetrievalService { prefix, handle }
    }

    /// The key prefix of this mutex's waiter keys.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
}

impl RetrievalHandle for EtcdRetrievalService {
    fn handle(&self) -> &ServiceHandle {
        &self.handle
    }
}

/// The owner now, as `tracker` should see it (the time it was first seen kept).
pub(crate) fn seen_owner(
    tracker: &OwnershipTracker,
    kv: Option<&etcd_client::KeyValue>,
    lease_ttl: Duration,
) -> MutexOwner {
    match kv {
        None => MutexOwner::NONE,
        Some(kv) => {
            let known = tracker.known();
            let (fence, _) = parse_waiter(kv);
            let seen = if known.fence == fence && known.has_owner() {
                known.acquired_at
            } else {
                now_millis()
            };
            owner_of(kv, seen, lease_ttl)
        }
    }
}

/// Opens a watch of the range from now, then reads the owner: a change after the read is
/// in the watch (a change before it, also in the watch, only causes one more read).
async fn read_and_watch(
    client: &Client,
    config: &EtcdConfig,
    prefix: &str,
    tracker: &mut OwnershipTracker,
) -> Result<WatchStream> {
    let limit = call_limit(config.lease_ttl);
    let mut watch = client.watch_client();
    let (stream, _) = watch_from_now(
        &mut watch,
        prefix.as_bytes().to_vec(),
        WatchOptions::new().with_prefix(),
        "watching the mutex",
        limit,
    )
    .await?;
    let mut kv = client.kv_client();
    let resp = bounded(
        "reading the owner",
        limit,
        kv.get(prefix.as_bytes(), Some(first_key())),
    )
    .await?;
    let owner = seen_owner(tracker, resp.kvs().first(), config.lease_ttl);
    tracker.observe(owner);
    Ok(stream)
}

/// Waits for a change in the watched range (or the end of the stream).
pub(crate) async fn next_change(stream: &mut WatchStream) -> std::result::Result<(), String> {
    loop {
        match stream.message().await {
            Ok(Some(resp)) => {
                if resp.canceled() {
                    return Err(format!("watch canceled: {}", resp.cancel_reason()));
                }
                if resp
                    .events()
                    .iter()
                    .any(|e| matches!(e.event_type(), EventType::Delete | EventType::Put))
                {
                    return Ok(());
                }
            }
            Ok(None) => return Err("watch stream ended".to_owned()),
            Err(e) => return Err(format!("watch stream failed: {e}")),
        }
    }
}

async fn observe(
    client: Client,
    config: Arc<EtcdConfig>,
    prefix: String,
    mut tracker: OwnershipTracker,
    stop: CancellationToken,
) {
    let retry = Duration::from_millis(500);
    loop {
        let opened = tokio::select! {
            r = read_and_watch(&client, &config, &prefix, &mut tracker) => r,
            () = stop.cancelled() => break,
        };
        match opened {
            Ok(mut stream) => {
                let changed = tokio::select! {
                    r = next_change(&mut stream) => r,
                    () = stop.cancelled() => break,
                };
                if let Err(why) = changed {
                    debug!("observer: {why}; reading again");
                    tracker.count_failure(FailureKind::Disconnected, why);
                    tokio::select! {
                        () = tokio::time::sleep(retry) => {}
                        () = stop.cancelled() => break,
                    }
                }
            }
            Err(e) => {
                debug!("observer: {e}");
                tracker.count_failure(FailureKind::of(&e), e.to_string());
                tokio::select! {
                    () = tokio::time::sleep(retry) => {}
                    () = stop.cancelled() => break,
                }
            }
        }
    }
    tracker.finish();
}
