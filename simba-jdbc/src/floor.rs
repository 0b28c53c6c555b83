//! Floors: a bare database round trip (`SELECT 1`) that a mutex operation can be compared
//! to (`simba bench` reports each figure beside it).
//!
//! The probe opens one connection of the same kind as the store's pool (same driver, same
//! URL, same SQLite file) and keeps it, so that each [`SqlProbe::select_one`] is exactly one
//! round trip (SQLite: one hop to a blocking thread and back).

use std::fmt;
use std::time::Duration;

use simba_core::{Error, Result};

use crate::config::Backend;
use crate::dialect::ProbeConn;
use crate::store::SqlStore;

/// One dedicated connection for floor measurements; from [`SqlStore::probe`].
pub(crate) struct SqlProbe {
    conn: ProbeConn,
    kind: Backend,
    timeout: Duration,
}

impl fmt::Debug for SqlProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlProbe")
            .field("backend", &self.kind)
            .finish_non_exhaustive()
    }
}

impl SqlStore {
    /// Opens a connection for floor measurements, of the same kind as the store's pool.
    ///
    /// # Errors
    /// [`Error::Backend`] if the database cannot be reached within the statement timeout.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-open connection.
    pub(crate) async fn probe(&self) -> Result<SqlProbe> {
        let kind = self.kind();
        let timeout = self.config().statement_timeout();
        let failed = |e: diesel::ConnectionError| {
            Error::backend_source(
                kind.name(),
                format!(
                    "opening a probe connection to {}",
                    self.config().redacted_url()
                ),
                true,
                e,
            )
        };
        let open = self.dialect().probe();
        let conn = tokio::time::timeout(timeout, open)
            .await
            .map_err(|_| {
                Error::backend(
                    kind.name(),
                    format!("opening a probe connection: no answer within {timeout:?}"),
                )
            })?
            .map_err(failed)?;
        Ok(SqlProbe {
            conn,
            kind,
            timeout,
        })
    }
}

impl SqlProbe {
    /// Runs `SELECT 1`: one round trip.
    ///
    /// # Errors
    /// [`Error::Backend`] if the statement fails or does not answer within the store's
    /// statement timeout.
    ///
    /// # Cancel safety
    /// Dropping the future halfway leaves the connection in an unknown state: drop the probe
    /// too.
    pub(crate) async fn select_one(&mut self) -> Result<()> {
        let run = self.conn.select_one();
        let kind = self.kind;
        match tokio::time::timeout(self.timeout, run).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Error::backend_source(kind.name(), "SELECT 1", true, e)),
            Err(_) => Err(Error::backend(
                kind.name(),
                format!("SELECT 1: no answer within {:?}", self.timeout),
            )),
        }
    }
}
