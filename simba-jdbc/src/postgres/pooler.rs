//! PostgreSQL behind a connection pooler (PgBouncer and the poolers of managed services
//! that work like it): the URL options `simba_pooler` and `simba_direct_url`, and what the
//! store does differently in transaction mode.
//!
//! A pooler in *transaction* mode gives a client's transaction to whichever server
//! connection is free, and the next one maybe to another. So in that mode the store keeps
//! no state of a server session past one statement (or one explicit transaction):
//!
//! - no named prepared statements: every statement is sent unnamed with its parameter
//!   types, parsed, bound and run in one round trip (`Fast`, `query_typed`);
//! - no session settings (`SET statement_timeout`): the store's own bound on every call
//!   still holds, and a server-side timeout belongs on the role
//!   (`ALTER ROLE … SET statement_timeout = '5s'`);
//! - no session advisory locks and no `LISTEN` through the pooler: with `simba_direct_url`
//!   the native wait queue and the LISTEN connection use that URL (a direct connection to
//!   the same database); without it, waiters are queued in their own process only and
//!   learn of another process's release by reading the row ([`POLL_MIN`] rising to
//!   [`POLL_MAX`] while one waits), and observers read as on MySQL;
//! - a transaction (a semaphore's acquisition) runs on a connection no other call uses
//!   until it ends.
//!
//! *Session* mode gives a client one server connection for as long as it stays connected:
//! that is a direct connection, except that `simba_pooler=session` sends no cancel request
//! through the pooler (PgBouncer 1.18, Debian 12's, can exit on one: pgbouncer#801): no
//! blocking wait for a native lock runs (`crate::native`, the cap on blocking waits is 0),
//! and waiters try the lock on each NOTIFY of a release and once a second. *Statement*
//! mode allows no transaction of more than one statement: the semaphores' acquisitions and
//! the migration need them, so it is refused when named, and a pooler's refusal of a
//! transaction is explained (see [`hint`]).
//!
//! What is detected without the option: nothing ahead of time (a pooler answers as the
//! server behind it; no cheap statement tells the modes apart). The symptoms of a
//! transaction pooler used as a direct connection are recognised in errors and answered
//! with the option to set ([`hint`]); a pooler that happens to hand a client the same
//! server connection every time shows no symptom until load spreads the clients.

use std::time::Duration;

use simba_core::{Error, Result};

use crate::url_query::{redact_url, take_query_options};

/// The URL option that names the pooler mode.
pub(crate) const POOLER_OPTION: &str = "simba_pooler";
/// The URL option of the direct connection (native wait queue and LISTEN) in transaction
/// mode.
pub(crate) const DIRECT_OPTION: &str = "simba_direct_url";

/// How often a waiter reads a row another process owns, in transaction mode without
/// `simba_direct_url`: first after [`POLL_MIN`], then twice as long each time, at most
/// [`POLL_MAX`]. A release is seen within `POLL_MAX` and one round trip.
pub(crate) const POLL_MIN: Duration = Duration::from_millis(10);
/// See [`POLL_MIN`].
pub(crate) const POLL_MAX: Duration = Duration::from_millis(100);

/// What a URL says of the pooler in front of the server.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Pooler {
    /// `simba_pooler=transaction`.
    pub(crate) transaction: bool,
    /// `simba_pooler=session`: no cancel request is sent through the pooler.
    pub(crate) session: bool,
    /// `simba_direct_url=…` (`%`-decoded).
    pub(crate) direct_url: Option<String>,
}

impl Pooler {
    /// Takes `simba_pooler` and `simba_direct_url` out of `url`: the URL without them, and
    /// what they say.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an unknown or refused mode (`statement`), an option
    /// given twice, a direct URL without transaction mode, or one that is not a
    /// `postgres://` URL or names a pooler itself.
    pub(crate) fn take(url: &str) -> Result<(String, Pooler)> {
        let mut mode: Option<String> = None;
        let mut direct: Option<String> = None;
        let stripped = take_query_options(url, &[POOLER_OPTION, DIRECT_OPTION], |name, value| {
            let slot = if name == POOLER_OPTION {
                &mut mode
            } else {
                &mut direct
            };
            if slot.is_some() {
                return Err(Error::config(
                    name,
                    format!(
                        "{name} is given twice in `{}`: give it once",
                        redact_url(url)
                    ),
                ));
            }
            *slot = Some(value);
            Ok(())
        })?;
        let (transaction, session) = match mode.as_deref() {
            None | Some("none") => (false, false),
            Some("session") => (false, true),
            Some("transaction") => (true, false),
            Some("statement") => {
                return Err(Error::config(
                    POOLER_OPTION,
                    "a pooler in statement mode allows no transaction of more than one \
                     statement, and simba's semaphores and migration need them: give the \
                     pooler's database pool_mode=transaction (then simba_pooler=transaction) \
                     or session",
                ));
            }
            Some(other) => {
                return Err(Error::config(
                    POOLER_OPTION,
                    format!(
                        "`{other}` is not a pooler mode: use simba_pooler=transaction (PgBouncer's \
                         pool_mode=transaction) or session (the same as a direct connection)"
                    ),
                ));
            }
        };
        if let Some(d) = &direct {
            if !transaction {
                return Err(Error::config(
                    DIRECT_OPTION,
                    "simba_direct_url is the direct connection of transaction mode: add \
                     simba_pooler=transaction, or remove it",
                ));
            }
            if !(d.starts_with("postgres://") || d.starts_with("postgresql://")) {
                return Err(Error::config(
                    DIRECT_OPTION,
                    format!(
                        "`{}` is not a postgres:// URL: give the server's own address, \
                         %-encoded (e.g. simba_direct_url=postgres%3A%2F%2Fapp%40db%3A5432%2Fapp)",
                        redact_url(d)
                    ),
                ));
            }
            let (_, inner) = Pooler::take(d)?;
            if inner != Pooler::default() {
                return Err(Error::config(
                    DIRECT_OPTION,
                    "simba_direct_url must reach the server without a pooler: remove \
                     simba_pooler and simba_direct_url from it",
                ));
            }
        }
        Ok((
            stripped,
            Pooler {
                transaction,
                session,
                direct_url: direct,
            },
        ))
    }
}

/// What to do about an error whose text (lower case) is `lower`, if it is a symptom of a
/// pooler the URL does not name: a transaction pooler's other server connection that
/// lacks (or already has) a prepared statement of this client, or a statement-mode
/// pooler's refusal of a transaction.
pub(crate) fn hint(lower: &str) -> Option<&'static str> {
    let statement = lower.contains("prepared statement \"")
        && (lower.contains("already exists") || lower.contains("does not exist"));
    if statement {
        return Some(
            "; this is what a connection pooler in transaction mode (PgBouncer's \
             pool_mode=transaction) does to prepared statements: add \
             simba_pooler=transaction to the URL (and simba_direct_url=… for pushed \
             wake-ups)",
        );
    }
    if lower.contains("not allowed in statement mode") {
        return Some(
            "; a pooler in statement mode refuses transactions, which simba needs: use \
             pool_mode=transaction with simba_pooler=transaction, or session",
        );
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::url_query::invalid_config as field;

    #[test]
    fn options_are_taken_out_and_read() {
        let (url, p) = Pooler::take("postgres://u:pw@h:6432/db?sslmode=disable").expect("ok");
        assert_eq!(url, "postgres://u:pw@h:6432/db?sslmode=disable");
        assert_eq!(p, Pooler::default());
        let (url, p) = Pooler::take(
            "postgres://u@h:6432/db?simba_pooler=transaction&sslmode=disable\
             &simba_direct_url=postgres%3A%2F%2Fu%40h%3A5432%2Fdb%3Fsslmode%3Ddisable",
        )
        .expect("ok");
        assert_eq!(url, "postgres://u@h:6432/db?sslmode=disable");
        assert!(p.transaction);
        assert_eq!(
            p.direct_url.as_deref(),
            Some("postgres://u@h:5432/db?sslmode=disable")
        );
        let (_, p) = Pooler::take("postgres://h/db?simba_pooler=session").expect("ok");
        assert!(!p.transaction && p.session);
    }

    #[test]
    fn bad_options_are_refused_with_the_option_named() {
        for (url, want, says) in [
            (
                "postgres://h/db?simba_pooler=statement",
                POOLER_OPTION,
                "statement mode",
            ),
            (
                "postgres://h/db?simba_pooler=txn",
                POOLER_OPTION,
                "not a pooler mode",
            ),
            (
                "postgres://h/db?simba_pooler=transaction&simba_pooler=session",
                POOLER_OPTION,
                "twice",
            ),
            (
                "postgres://h/db?simba_direct_url=postgres%3A%2F%2Fh%2Fdb",
                DIRECT_OPTION,
                "add",
            ),
            (
                "postgres://h/db?simba_pooler=transaction&simba_direct_url=mysql%3A%2F%2Fh",
                DIRECT_OPTION,
                "not a postgres",
            ),
            (
                "postgres://h/db?simba_pooler=transaction&simba_direct_url=\
                 postgres%3A%2F%2Fh%2Fdb%3Fsimba_pooler%3Dtransaction",
                DIRECT_OPTION,
                "without a pooler",
            ),
        ] {
            let (f, reason) = field(Pooler::take(url).expect_err(url));
            assert_eq!(f, want, "{url}");
            assert!(reason.contains(says), "{url}: {reason}");
        }
    }

    #[test]
    fn the_symptoms_of_an_unnamed_pooler_are_explained() {
        let h = hint("db error: error: prepared statement \"s0\" already exists");
        assert!(h.is_some_and(|h| h.contains("simba_pooler=transaction")));
        assert!(hint("error: prepared statement \"s4\" does not exist").is_some());
        assert!(hint("transaction blocks not allowed in statement mode").is_some());
        assert!(hint("relation \"simba_mutex\" does not exist").is_none());
    }
}
