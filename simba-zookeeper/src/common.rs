//! Pieces shared by the contend and the retrieval service.

use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex as StdMutex;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use simba_core::{Error, MutexOwner, Result};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tracing::warn;
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
    static STATE: OnceLock<RandomState> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let word = || {
        let mut h = STATE.get_or_init(RandomState::new).build_hasher();
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        h.write_u32(std::process::id());
        if let Ok(t) = SystemTime::now().duration_since(UNIX_EPOCH) {
            h.write_u128(t.as_nanos());
        }
        h.finish()
    };
    let (a, b) = (word(), word());
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

struct Running {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// The background task of a service: start once, stop, restart.
#[derive(Default)]
pub(crate) struct Runner {
    running: StdMutex<Option<Running>>,
}

impl Runner {
    /// Spawns `make(stop_receiver)` unless a task is already running.
    pub(crate) fn start<F, Fut>(&self, what: &str, make: F) -> Result<()>
    where
        F: FnOnce(watch::Receiver<bool>) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::InvalidState("start() must be called inside a tokio runtime".into())
        })?;
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if running.as_ref().is_some_and(|r| !r.task.is_finished()) {
            return Err(Error::InvalidState(format!("{what} is already running")));
        }
        let (stop, stop_rx) = watch::channel(false);
        let task = handle.spawn(make(stop_rx));
        *running = Some(Running { stop, task });
        Ok(())
    }

    /// Signals the task to stop; returns it so the caller can wait for it.
    pub(crate) fn signal_stop(&self) -> Option<JoinHandle<()>> {
        let running = self
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        let _ = running.stop.send(true);
        Some(running.task)
    }

    /// Signals the task to stop without waiting (for `Drop`).
    pub(crate) fn signal_stop_on_drop(&mut self) {
        if let Some(running) = self.running.get_mut().ok().and_then(Option::take) {
            let _ = running.stop.send(true);
        }
    }
}

/// Waits for a stopped task.
pub(crate) async fn join(task: Option<JoinHandle<()>>, mutex: &str) {
    if let Some(task) = task
        && let Err(e) = task.await
    {
        warn!(%mutex, "zookeeper service task ended abnormally: {e}");
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
