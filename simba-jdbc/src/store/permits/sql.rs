//! The statements of the permits table.

use super::*;

/// PostgreSQL's start of an acquisition, one round trip. A process stopped in the middle
/// of the transaction (SIGSTOP, a frozen VM) would keep the semaphore's row locked, and
/// every acquisition waiting, until it runs again: the server ends such a session (and
/// rolls its transaction back) once it has sent nothing for 50 ms. A live client sends
/// its second (and last) pipeline of statements as soon as the first is answered; one cut
/// off tries again on a new connection.
const PG_BEGIN: &str = "BEGIN; SET LOCAL idle_in_transaction_session_timeout = 50";

/// The statement that starts an acquisition's transaction on `backend` (for a test that
/// stands in for a process stopped in the middle of one).
#[doc(hidden)]
pub fn permit_transaction_begin(backend: Backend) -> &'static str {
    match backend {
        Backend::Mysql => "START TRANSACTION",
        Backend::Postgres => PG_BEGIN,
        // The write lock is taken by BEGIN IMMEDIATE (waiting in the busy handler).
        Backend::Sqlite => "BEGIN IMMEDIATE",
    }
}

/// The statements of the permits table (`?` placeholders, numbered on PostgreSQL).
#[derive(Debug, Clone)]
pub(crate) struct PermitSql {
    pub(super) table: String,
    /// The migration (PostgreSQL: under an advisory lock).
    pub(super) migrate: String,
    /// Fails unless the table has every column.
    pub(super) check: String,
    pub(super) begin: &'static str,
    /// Args: semaphore. Locks and returns the semaphore's row (none if missing).
    pub(super) lock: String,
    /// Args: semaphore. Every row of the semaphore, with the time (one row of `None`s
    /// when it has none).
    pub(super) read: String,
    /// Args: semaphore. Every row of the semaphore, locked (MySQL, PostgreSQL: a locking
    /// read sees the latest commits whatever the isolation level), with the time; inside
    /// the acquisition, after [`PermitSql::lock`] found the semaphore's row.
    pub(super) read_locked: String,
    /// Args: semaphore. Makes the semaphore's row if it is missing.
    pub(super) header: String,
    /// Args: semaphore, now. Drops the holders and waiters whose time has passed.
    pub(super) prune: String,
    /// Args: permits, ticket, fence, semaphore.
    pub(super) set_header: String,
    /// Args: semaphore, contender.
    pub(super) delete: String,
    /// Args: semaphore, contender. Deletes a waiter's row (fence 0).
    pub(super) leave: String,
    /// Args: semaphore, contender, permits, ticket, acquired_at, ttl_at, transition_at, fence.
    pub(super) insert: String,
    /// Args: ttl_at, transition_at, semaphore, contender.
    pub(super) set_times: String,
    /// Args: ttl_at, transition_at, semaphore, contender. A waiter keeps its place: its
    /// times, and no claim deadline (`acquired_at = 0`).
    pub(super) keep_place: String,
    /// Args: claim_by, semaphore, contender. A waiter's claim deadline (in `acquired_at`).
    pub(super) set_claim: String,
    /// Args: ttl, ttl + transition, semaphore, contender. Renews a holder within its lease
    /// on the database clock.
    pub(super) renew: String,
    /// Args: semaphore, contender. Deletes a holder within its lease.
    pub(super) release: String,
}

impl PermitSql {
    pub(crate) fn new(backend: Backend, table: &str) -> Self {
        let name = permits_table(table);
        let t = quote_table(backend, &name);
        let now = lease_clock_sql(backend);
        let cols = "contender, permits, ticket, acquired_at, ttl_at, transition_at, fence";
        let create = create_permits_table_sql(backend, table).unwrap_or_default();
        let lock_suffix = match backend {
            Backend::Mysql | Backend::Postgres => " FOR UPDATE",
            Backend::Sqlite => "",
        };
        let begin = permit_transaction_begin(backend);
        let header = match backend {
            Backend::Mysql => format!(
                "INSERT INTO {t} (semaphore, contender) VALUES (?, '') \
                 ON DUPLICATE KEY UPDATE semaphore = semaphore"
            ),
            Backend::Postgres | Backend::Sqlite => format!(
                "INSERT INTO {t} (semaphore, contender) VALUES (?, '') \
                 ON CONFLICT (semaphore, contender) DO NOTHING"
            ),
        };
        let n = |sql: String| match backend {
            Backend::Postgres => numbered(&sql),
            Backend::Mysql | Backend::Sqlite => sql,
        };
        PermitSql {
            migrate: match backend {
                Backend::Postgres => {
                    format!("SELECT pg_advisory_xact_lock({PG_MIGRATION_LOCK}); {create}")
                }
                Backend::Mysql | Backend::Sqlite => create,
            },
            table: name,
            check: format!("SELECT semaphore, {cols} FROM {t} WHERE 1 = 0"),
            begin,
            lock: n(format!(
                "SELECT {now} AS now_ms, {cols} FROM {t} \
                 WHERE semaphore = ? AND contender = ''{lock_suffix}"
            )),
            read: n(format!(
                "SELECT n.now_ms AS now_ms, p.contender AS contender, p.permits AS permits, \
                 p.ticket AS ticket, p.acquired_at AS acquired_at, p.ttl_at AS ttl_at, \
                 p.transition_at AS transition_at, p.fence AS fence \
                 FROM (SELECT {now} AS now_ms) n LEFT JOIN {t} p ON p.semaphore = ?"
            )),
            read_locked: n(format!(
                "SELECT {now} AS now_ms, {cols} FROM {t} WHERE semaphore = ?{lock_suffix}"
            )),
            header: n(header),
            prune: n(format!(
                "DELETE FROM {t} WHERE semaphore = ? AND contender <> '' AND transition_at <= ?"
            )),
            set_header: n(format!(
                "UPDATE {t} SET permits = ?, ticket = ?, fence = ? \
                 WHERE semaphore = ? AND contender = ''"
            )),
            delete: n(format!(
                "DELETE FROM {t} WHERE semaphore = ? AND contender = ?"
            )),
            leave: n(format!(
                "DELETE FROM {t} WHERE semaphore = ? AND contender = ? AND fence = 0"
            )),
            insert: n(format!(
                "INSERT INTO {t} (semaphore, {cols}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            )),
            set_times: n(format!(
                "UPDATE {t} SET ttl_at = ?, transition_at = ? \
                 WHERE semaphore = ? AND contender = ?"
            )),
            keep_place: n(format!(
                "UPDATE {t} SET ttl_at = ?, transition_at = ?, acquired_at = 0 \
                 WHERE semaphore = ? AND contender = ? AND fence = 0"
            )),
            set_claim: n(format!(
                "UPDATE {t} SET acquired_at = ? \
                 WHERE semaphore = ? AND contender = ? AND fence = 0"
            )),
            renew: n(format!(
                "UPDATE {t} SET ttl_at = {now} + ?, transition_at = {now} + ? \
                 WHERE semaphore = ? AND contender = ? AND fence > 0 AND transition_at > {now}"
            )),
            release: n(format!(
                "DELETE FROM {t} WHERE semaphore = ? AND contender = ? AND fence > 0 \
                 AND transition_at > {now}"
            )),
        }
    }

    /// Whether the text of a database error says that the permits table is missing.
    pub(super) fn missing(&self, message: &str) -> bool {
        let lower = message.to_ascii_lowercase();
        let table = self.table.rsplit('.').next().unwrap_or(&self.table);
        lower.contains(&table.to_ascii_lowercase())
            && (lower.contains("no such table")
                || lower.contains("does not exist")
                || lower.contains("doesn't exist"))
    }
}
