//! Floors: a bare database round trip (`SELECT 1`) that a mutex operation can be compared
//! to (`simba bench` reports each figure beside it).
//!
//! The probe opens one connection of the same kind as the store's pool (same driver, same
//! URL, same SQLite file) and keeps it, so that each [`SqlProbe::select_one`] is exactly one
//! round trip (SQLite: one hop to a blocking thread and back).

use std::fmt;
use std::time::Duration;

#[cfg(feature = "sqlite")]
use diesel_async::AsyncConnection;
use diesel_async::SimpleAsyncConnection;
use simba_core::{Error, Result};

use crate::config::{Backend, Target};
use crate::store::SqlStore;

/// One dedicated connection for floor measurements; from [`SqlStore::probe`].
pub(crate) struct SqlProbe {
    conn: Conn,
    kind: Backend,
    timeout: Duration,
}

enum Conn {
    #[cfg(feature = "mysql")]
    Mysql(diesel_async::AsyncMysqlConnection),
    #[cfg(feature = "postgres")]
    Postgres(Box<diesel_async::AsyncPgConnection>),
    #[cfg(feature = "sqlite")]
    Sqlite(diesel_async::sync_connection_wrapper::SyncConnectionWrapper<diesel::SqliteConnection>),
    /// No backend feature is enabled: no probe can be opened.
    #[cfg(not(any(feature = "mysql", feature = "postgres", feature = "sqlite")))]
    #[allow(dead_code)]
    Never(std::convert::Infallible),
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
        let target = self.config().target()?;
        let kind = target.backend();
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
        let open = async {
            match &target {
                #[cfg(feature = "mysql")]
                Target::Mysql(url) => crate::mysql::diesel(url).await.map(Conn::Mysql),
                #[cfg(feature = "postgres")]
                // Through the store's connector: its TLS settings.
                Target::Postgres(_) => match self.dialect().pg_connector() {
                    Some(pg) => pg.diesel().await.map(|c| Conn::Postgres(Box::new(c))),
                    None => Err(diesel::ConnectionError::BadConnection(
                        "this store has no PostgreSQL connector".to_owned(),
                    )),
                },
                #[cfg(feature = "sqlite")]
                Target::Sqlite { path, .. } => {
                    diesel_async::sync_connection_wrapper::SyncConnectionWrapper::<
                        diesel::SqliteConnection,
                    >::establish(path)
                    .await
                    .map(Conn::Sqlite)
                }
                #[allow(unreachable_patterns)]
                _ => Err(diesel::ConnectionError::BadConnection(format!(
                    "the {kind} backend is not enabled in this build of simba-jdbc"
                ))),
            }
        };
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
        let run = async {
            match &mut self.conn {
                #[cfg(feature = "mysql")]
                Conn::Mysql(c) => c.batch_execute("SELECT 1").await,
                #[cfg(feature = "postgres")]
                Conn::Postgres(c) => c.batch_execute("SELECT 1").await,
                #[cfg(feature = "sqlite")]
                Conn::Sqlite(c) => c.batch_execute("SELECT 1").await,
                #[cfg(not(any(feature = "mysql", feature = "postgres", feature = "sqlite")))]
                Conn::Never(never) => match *never {},
            }
        };
        #[cfg(not(any(feature = "mysql", feature = "postgres", feature = "sqlite")))]
        let run = async {
            run.await;
            Ok::<(), diesel::result::Error>(())
        };
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
