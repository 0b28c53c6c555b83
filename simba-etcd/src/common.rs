//! Pieces shared by the services: errors, bounded calls, the owner read.

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{
    GetOptions, KeyValue, SortOrder, SortTarget, WatchClient, WatchOptions, WatchStream,
};
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

/// Microseconds since the Unix epoch on this machine's clock (the floor of a new fence).
pub(crate) fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The key holding a mutex's last fence: its waiter prefix `{prefix}/{m}/` without the
/// final `/`, so no mutex's waiter range holds it.
pub(crate) fn fence_key(mutex_prefix: &str) -> Vec<u8> {
    mutex_prefix
        .strip_suffix('/')
        .unwrap_or(mutex_prefix)
        .as_bytes()
        .to_vec()
}

/// The value of a waiter key: the fence in decimal, a line break, the contender id.
pub(crate) fn waiter_value(fence: u64, contender_id: &str) -> String {
    format!("{fence}\n{contender_id}")
}

/// The fence and the owner id a waiter key holds. A value without a fence line (a key put
/// by a simba-etcd before fences were floored by time) has its create revision as fence.
pub(crate) fn parse_waiter(kv: &KeyValue) -> (u64, String) {
    parse_value(kv.value(), kv.create_revision())
}

fn parse_value(value: &[u8], create_revision: i64) -> (u64, String) {
    let value = String::from_utf8_lossy(value);
    if let Some((fence, id)) = value.split_once('\n')
        && let Ok(fence) = fence.parse::<u64>()
    {
        return (fence, id.to_owned());
    }
    (
        u64::try_from(create_revision).unwrap_or(0),
        value.into_owned(),
    )
}

/// The owner a waiter key names ([`parse_waiter`]: its fence and contender id). etcd
/// keeps no times on keys, so `acquired_at` is `seen_at` (when this process first saw
/// that ownership, on its own clock) and `ttl_at` = `transition_at` = `seen_at +
/// lease_ttl` (the lease TTL, or the time left on it where it was read).
pub(crate) fn owner_of(kv: &KeyValue, seen_at: i64, lease_ttl: Duration) -> MutexOwner {
    let ttl = i64::try_from(lease_ttl.as_millis()).unwrap_or(i64::MAX);
    let (fence, owner_id) = parse_waiter(kv);
    MutexOwner {
        owner_id,
        acquired_at: seen_at,
        ttl_at: seen_at.saturating_add(ttl),
        transition_at: seen_at.saturating_add(ttl),
        fence,
    }
}

/// The time bound of one unary call: half the lease (at most 5 s), so that a hung call is
/// given up before the lease ends. (The owner's deadline does not wait for it: it is raced
/// against every call.)
pub(crate) fn call_limit(lease_ttl: Duration) -> Duration {
    (lease_ttl / 2).min(Duration::from_secs(5))
}

/// Opens a watch that starts now and waits for etcd's answer that it exists: the watch then
/// delivers every change with a revision above the one returned (etcd's revision when it
/// created the watch; 0 if the answer carried none).
///
/// Why not ask for a start revision: a watch whose start revision the store has already
/// passed goes to etcd's *unsynced* watchers, which a background loop catches up every
/// 100 ms, so one write anywhere between a read and the watch would delay the wake-up by
/// up to 100 ms (a handoff p99 near 90 ms in `simba bench`). A watch from now is served
/// as writes are applied, unless a write commits while etcd creates it (etcd reads its
/// revision, then registers the watch), which still lands it with the unsynced ones now and
/// then. What changed between an earlier read and the revision returned is the caller's to
/// check.
pub(crate) async fn watch_from_now(
    watches: &mut WatchClient,
    key: Vec<u8>,
    options: WatchOptions,
    what: &str,
    limit: Duration,
) -> Result<(WatchStream, i64)> {
    let created = async {
        let mut stream = watches.watch(key, Some(options)).await?;
        let first = stream.message().await?;
        Ok((stream, first))
    };
    let (stream, first) = bounded(what, limit, created).await?;
    match first {
        Some(r) if r.created() && !r.canceled() => {
            Ok((stream, r.header().map_or(0, |h| h.revision())))
        }
        Some(r) => Err(Error::backend(
            BACKEND,
            format!(
                "{what}: etcd did not create the watch: {}",
                r.cancel_reason()
            ),
        )),
        None => Err(Error::backend(
            BACKEND,
            format!("{what}: the watch stream ended before etcd created the watch"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::{fence_key, parse_value, waiter_value};

    #[test]
    fn waiter_values_round_trip() {
        let v = waiter_value(1_764_000_000_000_123, "3:41@web-1:abc");
        assert_eq!(
            parse_value(v.as_bytes(), 7),
            (1_764_000_000_000_123, "3:41@web-1:abc".to_owned())
        );
        // An id may hold a line break: only the first one ends the fence.
        let v = waiter_value(9, "held@@a\nb");
        assert_eq!(parse_value(v.as_bytes(), 7), (9, "held@@a\nb".to_owned()));
        // A key without a fence line is fenced by its create revision.
        assert_eq!(
            parse_value(b"3:41@web-1:abc", 7),
            (7, "3:41@web-1:abc".to_owned())
        );
        assert_eq!(parse_value(b"x\ny", 7), (7, "x\ny".to_owned()));
        assert_eq!(parse_value(b"", -1), (0, String::new()));
    }

    #[test]
    fn the_fence_key_is_outside_the_waiter_range() {
        assert_eq!(fence_key("/simba/m/"), b"/simba/m".to_vec());
        assert!(!fence_key("/simba/m/").starts_with(b"/simba/m/"));
    }
}
