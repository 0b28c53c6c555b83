//! Pieces shared by the contend and the retrieval service.

use std::time::Duration;

use simba_core::backend::random_u64;
use simba_core::{Error, MutexOwner};
use tokio::time::{Instant, sleep_until};
use zookeeper_async::Stat;

/// The part of a latch node's name before the sequence number (Curator's LeaderLatch uses
/// the same: `_c_{uuid}-latch-0000000007`).
pub(crate) const LATCH: &str = "latch-";

/// Why a released mutex cannot be kept held on ZooKeeper.
pub(crate) fn hold_unsupported() -> Error {
    Error::unsupported(
        "ZooKeeper",
        "hold-at-least",
        "ownership on ZooKeeper is an ephemeral node of a session, not a lease with an end: \
         a released node is gone at once and a held one lives as long as its session, so \
         there is nothing that could end by itself at a given instant; use a lease backend \
         (Redis, SQL) for holds, or keep the guard until the instant and release then",
    )
}

/// A new random token in UUID form, used in node names to find a node again whose create
/// answer was lost.
pub(crate) fn new_token() -> String {
    let (a, b) = (random_u64(), random_u64());
    // UUID version 4 layout: 8-4-4-4-12 hex digits.
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0x0fff,
        ((b >> 48) & 0x3fff) | 0x8000,
        b & 0xffff_ffff_ffff
    )
}

/// The latch node name prefix for `token`.
pub(crate) fn node_prefix(token: &str) -> String {
    format!("_c_{token}-{LATCH}")
}

/// The latch nodes among `children`, in ownership order: by the text after the last
/// `latch-` (the server's 10-digit sequence number), as Curator sorts them. Children
/// without `latch-` in their name are not latch nodes and are ignored.
pub(crate) fn sort_latch(children: &[String]) -> Vec<&str> {
    let mut nodes: Vec<&str> = children
        .iter()
        .map(String::as_str)
        .filter(|c| c.contains(LATCH))
        .collect();
    nodes.sort_by(|a, b| sort_key(a).cmp(sort_key(b)).then(a.cmp(b)));
    nodes
}

fn sort_key(name: &str) -> &str {
    name.rfind(LATCH).map_or(name, |i| &name[i + LATCH.len()..])
}

/// The owner a latch node names.
///
/// ZooKeeper ownership has no time to live: it lasts as long as the node, that is as long
/// as the owner's session. `ttl_at` and `transition_at` are both set to
/// `acquired_at + session_timeout` (the observer's session timeout): informational only.
pub(crate) fn owner_of(data: &[u8], stat: &Stat, session_timeout: Duration) -> MutexOwner {
    owner_at(
        String::from_utf8_lossy(data).into_owned(),
        stat.ctime,
        stat.czxid,
        session_timeout,
    )
}

/// The owner `owner_id` whose node was created at `ctime` by transaction `czxid`.
pub(crate) fn owner_at(
    owner_id: String,
    ctime: i64,
    czxid: i64,
    session_timeout: Duration,
) -> MutexOwner {
    let ttl = i64::try_from(session_timeout.as_millis()).unwrap_or(i64::MAX);
    let until = ctime.saturating_add(ttl);
    MutexOwner {
        owner_id,
        acquired_at: ctime,
        ttl_at: until,
        transition_at: until,
        fence: u64::try_from(czxid).unwrap_or(0),
    }
}

/// Sleeps until `at`, or forever when `None`.
pub(crate) async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(t) => sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_unique_uuids() {
        let a = new_token();
        let b = new_token();
        assert_ne!(a, b);
        assert_eq!(a.len(), 36, "{a}");
        assert_eq!(a.matches('-').count(), 4, "{a}");
        assert_eq!(&a[14..15], "4", "{a}");
        assert!(node_prefix(&a).starts_with("_c_") && node_prefix(&a).ends_with("-latch-"));
    }

    #[test]
    fn latch_nodes_sort_by_sequence() {
        let children: Vec<String> = [
            "_c_b-latch-0000000010",
            "foreign",
            "_c_a-latch-0000000002",
            "_c_c-latch-0000000007",
            "latch-0000000001",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            sort_latch(&children),
            vec![
                "latch-0000000001",
                "_c_a-latch-0000000002",
                "_c_c-latch-0000000007",
                "_c_b-latch-0000000010"
            ]
        );
    }

    #[test]
    fn owner_from_node() {
        let stat = Stat {
            czxid: 42,
            mzxid: 42,
            ctime: 1_000,
            mtime: 1_000,
            version: 0,
            cversion: 0,
            aversion: 0,
            ephemeral_owner: 7,
            data_length: 2,
            num_children: 0,
            pzxid: 42,
        };
        let o = owner_of(b"me", &stat, Duration::from_secs(2));
        assert_eq!(o.owner_id, "me");
        assert_eq!(o.fence, 42);
        assert_eq!(
            (o.acquired_at, o.ttl_at, o.transition_at),
            (1_000, 3_000, 3_000)
        );
    }
}
