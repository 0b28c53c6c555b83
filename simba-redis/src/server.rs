//! Reads of the server's state that the connector offers a generic tool
//! ([`Connection`](simba_core::connect::Connection)): how many clients the server has, and
//! what is left of the restart quarantine.

use std::time::Duration;

use fred::interfaces::ClientLike;
use fred::types::{ClusterHash, CustomCommand};
use simba_core::Result;

use crate::error::backend;
use crate::store::RedisStore;

impl RedisStore {
    /// How long an acquisition of a free mutex with a lease `lease` long (ttl + transition)
    /// would wait now for the restart quarantine (see the crate docs): the whole lease
    /// when the server's boot marker is missing (its data is new: the next acquisition
    /// sets it and waits), what is left of it after the marker otherwise; `None` when the
    /// quarantine is off or over.
    ///
    /// # Errors
    /// [`Error::Backend`](simba_core::Error::Backend) if the server cannot be read.
    pub(crate) async fn restart_quarantine(&self, lease: Duration) -> Result<Option<Duration>> {
        if !self.keeps_restart_quarantine() {
            return Ok(None);
        }
        let boot: Option<String> = self
            .client()
            .custom(
                CustomCommand::new_static("GET", ClusterHash::FirstKey, false),
                vec![self.boot_key()],
            )
            .await
            .map_err(|e| backend("GET of the boot marker", e))?;
        let Some(boot) = boot.and_then(|b| b.parse::<i64>().ok()) else {
            return Ok(Some(lease));
        };
        let time: Vec<String> = self
            .client()
            .custom(
                CustomCommand::new_static("TIME", ClusterHash::Random, false),
                Vec::<String>::new(),
            )
            .await
            .map_err(|e| backend("TIME", e))?;
        let now_ms = match &time[..] {
            [s, us, ..] => match (s.parse::<i64>(), us.parse::<i64>()) {
                (Ok(s), Ok(us)) => s * 1000 + us / 1000,
                _ => return Ok(None),
            },
            _ => return Ok(None),
        };
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
        let left = boot.saturating_add(lease_ms).saturating_sub(now_ms);
        Ok(u64::try_from(left)
            .ok()
            .filter(|&ms| ms > 0)
            .map(Duration::from_millis))
    }

    /// How many client connections the server has now (`CLIENT LIST`, one line each; on
    /// Cluster, of one node).
    ///
    /// # Errors
    /// [`Error::Backend`](simba_core::Error::Backend) if the command fails (e.g. an ACL user without `CLIENT`).
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub(crate) async fn client_count(&self) -> Result<usize> {
        let list: String = self
            .client()
            .custom(
                CustomCommand::new_static("CLIENT", ClusterHash::Random, false),
                vec!["LIST"],
            )
            .await
            .map_err(|e| backend("CLIENT LIST", e))?;
        Ok(list.lines().filter(|l| !l.trim().is_empty()).count())
    }
}
