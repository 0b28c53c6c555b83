//! Restart quarantine: after a Redis restart, nobody takes a free mutex until every lease
//! granted before the restart has run out.
//!
//! A Redis without persistence (or with `appendfsync everysec`) can come back from a
//! restart without the owner key of a mutex whose owner still believes, correctly by its
//! own lease, that it owns it. Granting the mutex at once would make two owners. So the
//! store learns when the server started (`INFO server` uptime against `TIME`) on every
//! (re)connection, and the acquire script refuses to take a free mutex before
//! `server start + ttl + transition` (the waiter is queued and told when to look again).
//! An owner from before the restart stops believing by then: its deadline comes at the
//! latest one lease after its last renewal, which the server handled before it stopped.
//!
//! Assumes every contender of a mutex uses the same lease (they should). Not applied on
//! Redis Cluster, where `INFO` answers for one node only.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use fred::clients::Client;
use fred::interfaces::ClientLike;
use fred::types::{ClusterHash, CustomCommand};
use simba_core::{Error, Lease, Result};

use crate::error::backend;

const UNKNOWN: i64 = i64::MIN;

/// When the server started, as far as this store knows.
#[derive(Debug)]
pub(crate) struct Boot {
    enabled: bool,
    started_at_ms: AtomicI64,
    stale: AtomicBool,
}

impl Boot {
    pub(crate) fn new(enabled: bool) -> Self {
        Boot {
            enabled,
            started_at_ms: AtomicI64::new(UNKNOWN),
            stale: AtomicBool::new(true),
        }
    }

    /// The connection was (re)established: the server may have restarted.
    pub(crate) fn mark_stale(&self) {
        self.stale.store(true, Ordering::SeqCst);
    }

    /// The server time (ms) before which a free mutex must not be taken with `lease`;
    /// 0 when the quarantine does not apply.
    pub(crate) async fn not_before(&self, client: &Client, lease: Lease) -> Result<i64> {
        if !self.enabled {
            return Ok(0);
        }
        if self.stale.swap(false, Ordering::SeqCst)
            || self.started_at_ms.load(Ordering::SeqCst) == UNKNOWN
        {
            match started_at(client).await {
                Ok(t) => self.started_at_ms.store(t, Ordering::SeqCst),
                Err(e) => {
                    self.stale.store(true, Ordering::SeqCst);
                    return Err(e);
                }
            }
        }
        let lease_ms = lease.ttl_ms().saturating_add(lease.transition_ms());
        Ok(self
            .started_at_ms
            .load(Ordering::SeqCst)
            .saturating_add(lease_ms))
    }
}

/// Server start in server-clock milliseconds: `TIME` minus `uptime_in_seconds`. The
/// uptime is whole seconds (rounded down), so this is the latest the start can have been.
async fn started_at(client: &Client) -> Result<i64> {
    let info: String = client
        .custom(
            CustomCommand::new_static("INFO", ClusterHash::Random, false),
            vec!["server"],
        )
        .await
        .map_err(|e| backend("reading the server's uptime (INFO server)", e))?;
    let uptime_s = parse_uptime(&info)
        .ok_or_else(|| Error::backend("redis", "INFO server did not report uptime_in_seconds"))?;
    let time: Vec<i64> = client
        .custom(
            CustomCommand::new_static("TIME", ClusterHash::Random, false),
            Vec::<String>::new(),
        )
        .await
        .map_err(|e| backend("reading the server clock (TIME)", e))?;
    let [secs, micros] = time[..] else {
        return Err(Error::backend("redis", format!("TIME answered {time:?}")));
    };
    let now_ms = secs.saturating_mul(1000).saturating_add(micros / 1000);
    Ok(now_ms.saturating_sub(uptime_s.saturating_mul(1000)))
}

fn parse_uptime(info: &str) -> Option<i64> {
    info.lines()
        .find_map(|l| l.trim().strip_prefix("uptime_in_seconds:"))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uptime_is_parsed() {
        let info =
            "# Server\r\nredis_version:7.0.15\r\nuptime_in_seconds:42\r\nuptime_in_days:0\r\n";
        assert_eq!(parse_uptime(info), Some(42));
        assert_eq!(parse_uptime("# Server\r\n"), None);
        assert_eq!(parse_uptime("uptime_in_seconds:x\r\n"), None);
    }
}
