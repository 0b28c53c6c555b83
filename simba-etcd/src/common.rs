//! Pieces shared by the services: errors, bounded calls, the owner read.

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{GetOptions, KeyValue, SortOrder, SortTarget};
use simba_core::{Error, MutexOwner, Result};

/// The backend name this crate reports.
pub(crate) const BACKEND: &str = "etcd";

/// An etcd client error as a simba error.
pub(crate) fn backend_error(context: impl Into<String>, e: etcd_client::Error) -> Error {
    let retryable = !matches!(
        e,
        etcd_client::Error::InvalidArgs(_) | etcd_client::Error::InvalidUri(_)
    );
    Error::backend_source(BACKEND, context, retryable, e)
}

/// `call`, bounded by `limit`; no answer in time is a retryable backend error.
pub(crate) async fn bounded<T>(
    what: &str,
    limit: Duration,
    call: impl Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(backend_error(what.to_owned(), e)),
        Err(_) => Err(Error::backend(
            BACKEND,
            format!("{what}: no answer within {limit:?}"),
        )),
    }
}

/// The range read of a mutex's first waiter key (the owner): lowest create revision.
pub(crate) fn first_key() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(1)
}

/// Milliseconds since the Unix epoch on this machine's clock.
pub(crate) fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The owner a waiter key names: its value is the contender id, its create revision the
/// fence. etcd keeps no times on keys, so `acquired_at` is `seen_at` (when this process
/// first saw that ownership, on its own clock) and `ttl_at` = `transition_at` =
/// `seen_at + lease_ttl` (the lease TTL, or the time left on it where it was read).
pub(crate) fn owner_of(kv: &KeyValue, seen_at: i64, lease_ttl: Duration) -> MutexOwner {
    let ttl = i64::try_from(lease_ttl.as_millis()).unwrap_or(i64::MAX);
    MutexOwner {
        owner_id: String::from_utf8_lossy(kv.value()).into_owned(),
        acquired_at: seen_at,
        ttl_at: seen_at.saturating_add(ttl),
        transition_at: seen_at.saturating_add(ttl),
        fence: u64::try_from(kv.create_revision()).unwrap_or(0),
    }
}

/// The time bound of one unary call: half the lease (at most 5 s), so that a hung call is
/// given up before the lease ends. (The owner's deadline does not wait for it: it is raced
/// against every call.)
pub(crate) fn call_limit(lease_ttl: Duration) -> Duration {
    (lease_ttl / 2).min(Duration::from_secs(5))
}
