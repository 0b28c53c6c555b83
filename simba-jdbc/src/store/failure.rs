//! How a store call's failure becomes an [`Error`]: the statement timeout, the context,
//! whether a retry may heal it, and what to fix.

use std::future::Future;
use std::time::Duration;

use simba_core::{Error, Result};

use super::Inner;
use crate::config::Backend;
use crate::schema;

/// What to do about an error that a connection pooler the URL does not name would give
/// (PostgreSQL: `crate::postgres::pooler::hint`).
fn pooler_hint(kind: Backend, lower: &str) -> Option<&'static str> {
    #[cfg(feature = "postgres")]
    if kind == Backend::Postgres {
        return crate::postgres::pooler::hint(lower);
    }
    let _ = (kind, lower);
    None
}

/// Why a call failed, before it gets its context.
pub(super) enum Failure {
    Connect(String, Box<dyn std::error::Error + Send + Sync>),
    Query(diesel::result::Error),
}

impl Inner {
    /// Bounds `work` by the statement timeout and gives its failure a context.
    pub(super) async fn bounded<T>(
        &self,
        what: &str,
        limit: Duration,
        work: impl Future<Output = std::result::Result<T, Failure>>,
    ) -> Result<T> {
        let backend = self.kind.name();
        match tokio::time::timeout(limit, work).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(Failure::Connect(msg, source))) => {
                // A TLS problem is permanent, and says what to fix (each dialect finds it
                // its own way: see `Dialect::tls_failure`).
                if let Some((message, tls)) = self.dialect.tls_failure(&msg) {
                    return Err(Error::backend_source(
                        backend,
                        format!(
                            "{what}: cannot get a connection to {}: {message}",
                            self.config.redacted_url()
                        ),
                        false,
                        tls,
                    ));
                }
                let hint = pooler_hint(self.kind, &msg.to_ascii_lowercase()).unwrap_or_default();
                Err(Error::Backend {
                    backend,
                    message: format!(
                        "{what}: cannot get a connection to {}: {msg}{hint}",
                        self.config.redacted_url()
                    ),
                    retryable: true,
                    source: Some(source),
                })
            }
            Ok(Err(Failure::Query(e))) => Err(self.query_error(what, e)),
            Err(_) => Err(Error::backend(
                backend,
                if self.discard {
                    format!(
                        "{what}: no answer within {limit:?} (statement timeout); its connection \
                         was closed"
                    )
                } else {
                    format!("{what}: no answer within {limit:?} (statement timeout)")
                },
            )),
        }
    }

    pub(super) fn query_error(&self, what: &str, e: diesel::result::Error) -> Error {
        let text = e.to_string();
        let lower = text.to_ascii_lowercase();
        let missing_table = lower.contains("no such table")
            || (lower.contains("does not exist") && lower.contains("relation"))
            || (lower.contains("doesn't exist") && lower.contains("table"));
        let missing_column = lower.contains("no such column")
            || lower.contains("unknown column")
            || (lower.contains("column") && lower.contains("does not exist"));
        let fence_full = self.table().counter_fence() && schema::fence_exhausted(&text);
        let permanent = missing_table || missing_column || fence_full || lower.contains("syntax");
        let hint = if fence_full {
            format!(
                "; the `version` column of {} (the fence, narrower than 64 bits in a JVM Simba \
                 table) is at its largest value: the database refuses `version + 1` rather \
                 than let a fence wrap; widen it to BIGINT (MySQL: ALTER TABLE … MODIFY \
                 version BIGINT UNSIGNED NOT NULL; PostgreSQL: ALTER TABLE … ALTER COLUMN \
                 version TYPE BIGINT)",
                self.config.table()
            )
        } else if missing_table {
            format!(
                "; the table {} is missing: call SqlStore::migrate() or create it with the SQL \
                 in the simba-jdbc README",
                self.config.table()
            )
        } else if missing_column {
            format!(
                "; the table {} lacks a column this version of simba-jdbc uses (made by an \
                 older version?): compare it with create_table_sql() and add the column, or \
                 drop the table while no contender runs and let migrate() create it",
                self.config.table()
            )
        } else {
            pooler_hint(self.kind, &lower)
                .unwrap_or_default()
                .to_owned()
        };
        Error::backend_source(
            self.kind.name(),
            format!("{what}: {text}{hint}"),
            !permanent,
            e,
        )
    }
}
