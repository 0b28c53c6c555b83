//! Semaphores: the [`PermitStore`](simba_core::backend::PermitStore) operations over a
//! second table, `{table}_permits` (see the crate README, *Semaphores*).
//!
//! One row per semaphore (`contender = ''`: the agreed permit count, the last ticket and the
//! last fence) and one row per holder or waiter (its ticket, lease times and fence; a
//! waiter has fence 0 and its `transition_at` is the time its place is kept until). Every
//! acquisition is one transaction that first locks the semaphore's row (`SELECT … FOR
//! UPDATE`; SQLite: `BEGIN IMMEDIATE`, the database's write lock), then reads every row of
//! the semaphore with the database's time and decides with simba-core's admission rule
//! ([`admit_permit`], through [`decide`]), the code the in-memory store runs too: drop the
//! rows past their time, renew, refuse a different count, grant while fewer than N hold and
//! no earlier waiter is owed the free permit, or queue.
//! The transaction runs in a task of its own, so that a caller that gives up never leaves
//! a connection halfway through it.
//!
//! Waiters are woken by push within one store (a release, or a waiter leaving, sends
//! [`StoreEvent::Released`] to the local waiters owed a freed permit); waiters of other
//! stores look again every [`PERMIT_POLL`] at most.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use diesel::QueryableByName;
use diesel::result::QueryResult;
use diesel::sql_types::{BigInt, Nullable, Text};
use simba_core::backend::{
    Admission, AdmissionHolder, AdmissionWaiter, Lease, LeaseReply, PermitDecision, PermitHolders,
    PermitRequest, SemaphoreState, StoreEvent, admit_permit,
};
use simba_core::events::{self, EventReceiver, EventSender};
use simba_core::{Error, MutexOwner, Result};
use tracing::debug;

// `Failure`, `Checked`, `on_pool!` and `debug!` are named by the `run!` expansion.
use super::{Failure, Inner, permanent};
use crate::config::Backend;
use crate::conn::{Arg, Checked, SqlConn};
use crate::dialect::on_pool;
use crate::sql::{lease_clock_sql, numbered, quote_table};

/// The longest a waiter of a semaphore waits before it looks again (a permit freed by
/// another process, or owed to a waiter ahead that took it or left).
pub const PERMIT_POLL: Duration = Duration::from_millis(250);

/// [`PERMIT_POLL`] in milliseconds.
const POLL_MS: i64 = 250;

/// Key of the PostgreSQL advisory lock that serialises concurrent migrations of the
/// permits table.
const PG_MIGRATION_LOCK: i64 = 0x7369_6d62_615f_7065; // "simba_pe"

/// How many times an acquisition that found no row for its semaphore inserts it and tries
/// again (a row is never deleted by simba: the second try finds it).
const HEADER_TRIES: usize = 3;

/// The name of the permits table of the mutex table `table`.
pub(crate) fn permits_table(table: &str) -> String {
    format!("{table}_permits")
}

/// The `CREATE TABLE IF NOT EXISTS` statement of the permits table beside the mutex table
/// `table` (`{table}_permits`), which [`SqlStore::migrate`](crate::SqlStore::migrate)
/// runs, for DBAs who create the tables themselves.
///
/// # Errors
/// [`simba_core::Error::InvalidConfig`] if `table` is not a plain identifier
/// (`[schema.]table`).
pub fn create_permits_table_sql(backend: Backend, table: &str) -> Result<String> {
    crate::config::validate_table(table)?;
    let t = quote_table(backend, &permits_table(table));
    let text = match backend {
        Backend::Mysql => "VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
        Backend::Postgres | Backend::Sqlite => "VARCHAR(200)",
    };
    let engine = match backend {
        Backend::Mysql => " ENGINE = InnoDB",
        Backend::Postgres | Backend::Sqlite => "",
    };
    Ok(format!(
        "CREATE TABLE IF NOT EXISTS {t} (\n    \
         semaphore     {text} NOT NULL,\n    \
         contender     {text} NOT NULL,\n    \
         permits       BIGINT NOT NULL DEFAULT 0,\n    \
         ticket        BIGINT NOT NULL DEFAULT 0,\n    \
         acquired_at   BIGINT NOT NULL DEFAULT 0,\n    \
         ttl_at        BIGINT NOT NULL DEFAULT 0,\n    \
         transition_at BIGINT NOT NULL DEFAULT 0,\n    \
         fence         BIGINT NOT NULL DEFAULT 0,\n    \
         PRIMARY KEY (semaphore, contender)\n)\
         {engine}"
    ))
}

/// A row of the permits table with the database's time (all `None` when the semaphore
/// has no row). From a server: [`View::new`] checks what it uses.
#[derive(Debug, Clone, QueryableByName)]
pub(crate) struct PermitRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) now_ms: i64,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) contender: Option<String>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) permits: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) ticket: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) acquired_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) ttl_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) transition_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) fence: Option<i64>,
}

/// The statements of the permits table (`?` placeholders, numbered on PostgreSQL).
#[derive(Debug, Clone)]
pub(crate) struct PermitSql {
    table: String,
    /// The migration (PostgreSQL: under an advisory lock).
    migrate: String,
    /// Fails unless the table has every column.
    check: String,
    begin: &'static str,
    /// Args: semaphore. Locks and returns the semaphore's row (none if missing).
    lock: String,
    /// Args: semaphore. Every row of the semaphore, with the time (one row of `None`s
    /// when it has none).
    read: String,
    /// Args: semaphore. Every row of the semaphore, locked (MySQL, PostgreSQL: a locking
    /// read sees the latest commits whatever the isolation level), with the time; inside
    /// the acquisition, after [`PermitSql::lock`] found the semaphore's row.
    read_locked: String,
    /// Args: semaphore. Makes the semaphore's row if it is missing.
    header: String,
    /// Args: semaphore, now. Drops the holders and waiters whose time has passed.
    prune: String,
    /// Args: permits, ticket, fence, semaphore.
    set_header: String,
    /// Args: semaphore, contender.
    delete: String,
    /// Args: semaphore, contender. Deletes a waiter's row (fence 0).
    leave: String,
    /// Args: semaphore, contender, permits, ticket, acquired_at, ttl_at, transition_at, fence.
    insert: String,
    /// Args: ttl_at, transition_at, semaphore, contender.
    set_times: String,
    /// Args: ttl, ttl + transition, semaphore, contender. Renews a holder within its lease
    /// on the database clock.
    renew: String,
    /// Args: semaphore, contender. Deletes a holder within its lease.
    release: String,
}

impl PermitSql {
    pub(crate) fn new(backend: Backend, table: &str) -> Self {
        let name = permits_table(table);
        let t = quote_table(backend, &name);
        let now = lease_clock_sql(backend);
        let cols = "contender, permits, ticket, acquired_at, ttl_at, transition_at, fence";
        let create = create_permits_table_sql(backend, table).unwrap_or_default();
        let (lock_suffix, begin) = match backend {
            Backend::Mysql => (" FOR UPDATE", "START TRANSACTION"),
            Backend::Postgres => (" FOR UPDATE", "BEGIN"),
            // The write lock is taken by BEGIN IMMEDIATE (waiting in the busy handler).
            Backend::Sqlite => ("", "BEGIN IMMEDIATE"),
        };
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
    fn missing(&self, message: &str) -> bool {
        let lower = message.to_ascii_lowercase();
        let table = self.table.rsplit('.').next().unwrap_or(&self.table);
        lower.contains(&table.to_ascii_lowercase())
            && (lower.contains("no such table")
                || lower.contains("does not exist")
                || lower.contains("doesn't exist"))
    }
}

/// One row of a semaphore as the decision sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Slot {
    contender: String,
    ticket: i64,
    acquired_at: i64,
    ttl_at: i64,
    transition_at: i64,
    fence: i64,
}

impl Slot {
    fn owner(&self) -> Result<MutexOwner> {
        Ok(MutexOwner {
            owner_id: self.contender.clone(),
            acquired_at: self.acquired_at,
            ttl_at: self.ttl_at,
            transition_at: self.transition_at,
            fence: u64::try_from(self.fence).map_err(|_| bad(format!("fence {}", self.fence)))?,
        })
    }
}

fn bad(what: String) -> Error {
    Error::backend(
        "sql",
        format!("the permits table holds a value simba never writes: {what}"),
    )
}

/// The semaphore's row: the agreed count, the last ticket and the last fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Header {
    permits: u32,
    ticket: i64,
    fence: i64,
}

/// Every row of one semaphore at the database's time `now`.
#[derive(Debug, Clone, Default)]
struct View {
    now: i64,
    header: Option<Header>,
    /// Within their lease, in the order they acquired.
    holders: Vec<Slot>,
    /// Within their kept time, by ticket.
    waiters: Vec<Slot>,
    /// Rows whose time has passed (to drop).
    expired: Vec<Slot>,
}

impl View {
    fn new(rows: Vec<PermitRow>) -> Result<View> {
        let mut view = View::default();
        let Some(first) = rows.first() else {
            return Err(Error::backend(
                "sql",
                "the permits query returned no row (it always returns one)",
            ));
        };
        view.now = first.now_ms;
        for row in rows {
            let Some(contender) = row.contender else {
                continue;
            };
            let contender = contender.trim_end_matches(' ').to_owned();
            if contender.is_empty() {
                let permits = row.permits.unwrap_or(0);
                view.header = Some(Header {
                    permits: u32::try_from(permits)
                        .map_err(|_| bad(format!("permit count {permits}")))?,
                    ticket: row.ticket.unwrap_or(0),
                    fence: row.fence.unwrap_or(0),
                });
                continue;
            }
            let slot = Slot {
                contender,
                ticket: row.ticket.unwrap_or(0),
                acquired_at: row.acquired_at.unwrap_or(0),
                ttl_at: row.ttl_at.unwrap_or(0),
                transition_at: row.transition_at.unwrap_or(0),
                fence: row.fence.unwrap_or(0),
            };
            if slot.transition_at <= view.now {
                view.expired.push(slot);
            } else if slot.fence > 0 {
                view.holders.push(slot);
            } else {
                view.waiters.push(slot);
            }
        }
        view.holders.sort_by_key(|h| (h.acquired_at, h.fence));
        view.waiters.sort_by_key(|w| w.ticket);
        Ok(view)
    }

    fn free(&self, permits: u32) -> usize {
        usize::try_from(permits)
            .unwrap_or(usize::MAX)
            .saturating_sub(self.holders.len())
    }

    /// The waiters owed a permit now: the first ones, one per free permit.
    fn owed(&self) -> impl Iterator<Item = &str> {
        let free = self.header.map_or(0, |h| self.free(h.permits));
        self.waiters.iter().take(free).map(|w| w.contender.as_str())
    }
}

fn fence_of(slot: &Slot) -> Result<u64> {
    u64::try_from(slot.fence).map_err(|_| bad(format!("fence {}", slot.fence)))
}

/// The decision of `contender`'s acquisition of a semaphore of `permits` by the core rule
/// ([`admit_permit`]; see the [`PermitStore`](simba_core::backend::PermitStore) contract),
/// at the view's time. Its holder and waiter indices below the view's `holders` and
/// `waiters` lengths are theirs (the rows past their time come after them).
fn decide(view: &View, contender: &str, permits: u32, lease: Lease) -> Result<Admission> {
    let header = view.header.unwrap_or_default();
    let (dead_holders, dead_waiters): (Vec<&Slot>, Vec<&Slot>) =
        view.expired.iter().partition(|s| s.fence > 0);
    let holders = view
        .holders
        .iter()
        .chain(dead_holders)
        .map(|h| {
            Ok(AdmissionHolder {
                contender_id: &h.contender,
                transition_at: h.transition_at,
                fence: fence_of(h)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let waiters: Vec<AdmissionWaiter<'_>> = view
        .waiters
        .iter()
        .chain(dead_waiters)
        .map(|w| AdmissionWaiter {
            contender_id: &w.contender,
            keep_until: w.transition_at,
        })
        .collect();
    let last_fence =
        u64::try_from(header.fence).map_err(|_| bad(format!("last fence {}", header.fence)))?;
    let state = SemaphoreState {
        permits: header.permits,
        last_fence,
        holders: &holders,
        waiters: &waiters,
    };
    let request = PermitRequest {
        contender_id: contender,
        permits,
        lease,
        now: view.now,
        // Waiters of other stores are not pushed: every waiter looks again this soon.
        turn_ms: POLL_MS,
        poll_ms: Some(POLL_MS),
        // Floored by the clock, so that a semaphore whose row was deleted never repeats a
        // fence.
        fence_floor: u64::try_from(view.now).unwrap_or(0),
    };
    Ok(admit_permit(&state, &request))
}

/// A decision that does not fit the rows it was made from, as the transaction's failure.
fn misread(what: String) -> diesel::result::Error {
    diesel::result::Error::DeserializationError(Box::new(Error::backend(
        "sql",
        format!("the permit decision does not fit the rows read: {what}"),
    )))
}

/// What an acquisition's transaction returns.
enum Outcome {
    Reply(LeaseReply),
    Mismatch(u32),
    /// The semaphore has no row yet: make it, and try again.
    NoHeader,
}

async fn read<C: SqlConn>(c: &mut C, sql: &PermitSql, semaphore: &str) -> QueryResult<View> {
    let rows = c.load_permits(&sql.read, &[Arg::Text(semaphore)]).await?;
    // A row that is not what simba writes is reported as the query's failure.
    View::new(rows).map_err(|e| diesel::result::Error::DeserializationError(Box::new(e)))
}

/// One acquisition: a transaction on `c` (rolled back on any failure).
async fn acquire_tx<C: SqlConn>(
    c: &mut C,
    sql: &PermitSql,
    semaphore: &str,
    me: &str,
    permits: u32,
    lease: Lease,
) -> QueryResult<Outcome> {
    c.batch(sql.begin).await?;
    let done = acquire_in_tx(c, sql, semaphore, me, permits, lease).await;
    let end = match &done {
        Ok(Outcome::Reply(_) | Outcome::Mismatch(_)) => "COMMIT",
        Ok(Outcome::NoHeader) | Err(_) => "ROLLBACK",
    };
    match (c.batch(end).await, done) {
        (Ok(()), done) => done,
        (Err(e), Ok(_)) => Err(e),
        (Err(_), Err(e)) => Err(e),
    }
}

async fn acquire_in_tx<C: SqlConn>(
    c: &mut C,
    sql: &PermitSql,
    semaphore: &str,
    me: &str,
    permits: u32,
    lease: Lease,
) -> QueryResult<Outcome> {
    if c.load_permits(&sql.lock, &[Arg::Text(semaphore)])
        .await?
        .is_empty()
    {
        return Ok(Outcome::NoHeader);
    }
    let rows = c
        .load_permits(&sql.read_locked, &[Arg::Text(semaphore)])
        .await?;
    let view =
        View::new(rows).map_err(|e| diesel::result::Error::DeserializationError(Box::new(e)))?;
    let now = view.now;
    let admission = decide(&view, me, permits, lease)
        .map_err(|e| diesel::result::Error::DeserializationError(Box::new(e)))?;
    if !admission.expired_holders.is_empty() || !admission.stale_waiters.is_empty() {
        // The rule's drops are exactly the rows past their time (`transition_at <= now`).
        c.exec(&sql.prune, &[Arg::Text(semaphore), Arg::Int(now)])
            .await?;
    }
    let header = view.header.unwrap_or_default();
    let owner = match admission.decision {
        PermitDecision::Renew {
            holder,
            ttl_at,
            transition_at,
            // One row per contender: a holder has no waiter's row.
            queued: _,
        } => {
            c.exec(
                &sql.set_times,
                &[
                    Arg::Int(ttl_at),
                    Arg::Int(transition_at),
                    Arg::Text(semaphore),
                    Arg::Text(me),
                ],
            )
            .await?;
            let mut slot = view
                .holders
                .get(holder)
                .cloned()
                .ok_or_else(|| misread(format!("holder {holder} of {}", view.holders.len())))?;
            slot.ttl_at = ttl_at;
            slot.transition_at = transition_at;
            slot
        }
        PermitDecision::Mismatch { existing } => return Ok(Outcome::Mismatch(existing)),
        PermitDecision::Take {
            fence,
            ttl_at,
            transition_at,
            // Its waiter's row, deleted below.
            queued: _,
        } => {
            let fence =
                i64::try_from(fence).map_err(|_| misread(format!("a fence past i64: {fence}")))?;
            c.exec(
                &sql.set_header,
                &[
                    Arg::Int(i64::from(permits)),
                    Arg::Int(header.ticket),
                    Arg::Int(fence),
                    Arg::Text(semaphore),
                ],
            )
            .await?;
            c.exec(&sql.delete, &[Arg::Text(semaphore), Arg::Text(me)])
                .await?;
            let slot = Slot {
                contender: me.to_owned(),
                ticket: 0,
                acquired_at: now,
                ttl_at,
                transition_at,
                fence,
            };
            insert(c, sql, semaphore, &slot, permits).await?;
            slot
        }
        PermitDecision::Wait {
            queued,
            look_at,
            keep_until,
        } => {
            let ticket = match queued {
                Some(i) => {
                    view.waiters
                        .get(i)
                        .ok_or_else(|| misread(format!("waiter {i} of {}", view.waiters.len())))?
                        .ticket
                }
                None => header.ticket.saturating_add(1),
            };
            let count = if view.holders.is_empty() {
                permits
            } else {
                header.permits
            };
            c.exec(
                &sql.set_header,
                &[
                    Arg::Int(i64::from(count)),
                    Arg::Int(header.ticket.max(ticket)),
                    Arg::Int(header.fence),
                    Arg::Text(semaphore),
                ],
            )
            .await?;
            if queued.is_some() {
                c.exec(
                    &sql.set_times,
                    &[
                        Arg::Int(keep_until),
                        Arg::Int(keep_until),
                        Arg::Text(semaphore),
                        Arg::Text(me),
                    ],
                )
                .await?;
            } else {
                let slot = Slot {
                    contender: me.to_owned(),
                    ticket,
                    acquired_at: 0,
                    ttl_at: keep_until,
                    transition_at: keep_until,
                    fence: 0,
                };
                insert(c, sql, semaphore, &slot, 0).await?;
            }
            return Ok(Outcome::Reply(LeaseReply::look_again_at(look_at, now)));
        }
    };
    let owner = owner
        .owner()
        .map_err(|e| diesel::result::Error::DeserializationError(Box::new(e)))?;
    Ok(Outcome::Reply(LeaseReply { owner, now }))
}

async fn insert<C: SqlConn>(
    c: &mut C,
    sql: &PermitSql,
    semaphore: &str,
    slot: &Slot,
    permits: u32,
) -> QueryResult<usize> {
    c.exec(
        &sql.insert,
        &[
            Arg::Text(semaphore),
            Arg::Text(&slot.contender),
            Arg::Int(i64::from(permits)),
            Arg::Int(slot.ticket),
            Arg::Int(slot.acquired_at),
            Arg::Int(slot.ttl_at),
            Arg::Int(slot.transition_at),
            Arg::Int(slot.fence),
        ],
    )
    .await
}

/// The waiters of one semaphore in a store: (contender, sender).
type Subscribers = Vec<(String, EventSender)>;

/// The store's semaphores: their statements and the local waiters to wake.
pub(crate) struct Permits {
    pub(crate) sql: PermitSql,
    /// Per semaphore, the waiters of this store that subscribed (contender, sender).
    waiters: std::sync::Mutex<HashMap<String, Subscribers>>,
}

impl Permits {
    pub(crate) fn new(backend: Backend, table: &str) -> Self {
        Permits {
            sql: PermitSql::new(backend, table),
            waiters: std::sync::Mutex::new(HashMap::new()),
        }
    }

    fn subscribe(&self, semaphore: &str, contender: &str) -> EventReceiver {
        let (tx, rx) = events::channel(4);
        let mut map = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        let list = map.entry(semaphore.to_owned()).or_default();
        list.retain(|(_, tx)| !tx.is_closed());
        list.push((contender.to_owned(), tx));
        rx
    }

    /// Wakes the local waiters among `owed`; forgets the ones that stopped listening.
    fn wake<'a>(&self, semaphore: &str, owed: impl Iterator<Item = &'a str>) {
        let mut map = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        let Some(list) = map.get_mut(semaphore) else {
            return;
        };
        list.retain(|(_, tx)| !tx.is_closed());
        for who in owed {
            for (_, tx) in list.iter().filter(|(id, _)| id == who) {
                // A full channel already holds an event that makes the waiter look again.
                let _ = tx.try_send(StoreEvent::Released);
            }
        }
        if list.is_empty() {
            map.remove(semaphore);
        }
    }

    fn has_waiters(&self, semaphore: &str) -> bool {
        let map = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        map.get(semaphore)
            .is_some_and(|l| l.iter().any(|(_, tx)| !tx.is_closed()))
    }
}

/// The permit operations of [`SqlStore`](crate::SqlStore).
pub(super) struct Ops<'a> {
    pub(super) inner: &'a Arc<Inner>,
}

impl Ops<'_> {
    fn check(&self, semaphore: &str, contender: Option<&str>) -> Result<()> {
        self.inner.check_name(semaphore)?;
        if let Some(c) = contender {
            self.inner.check_contender(c)?;
        }
        Ok(())
    }

    /// A missing permits table is a permanent error naming the statement that makes it.
    fn explain(&self, e: Error) -> Error {
        match &e {
            Error::Backend { message, .. } if self.inner.permits.sql.missing(message) => {
                let create = create_permits_table_sql(self.inner.kind, self.inner.config.table())
                    .unwrap_or_default();
                permanent(
                    self.inner.kind.name(),
                    format!(
                        "{message}; the semaphores' table {} is missing: call \
                         SqlStore::migrate() with DDL on, or create it: {create}",
                        self.inner.permits.sql.table
                    ),
                )
            }
            _ => e,
        }
    }

    // A build without a backend feature has no connection: the loop's body never ends.
    #[cfg_attr(
        not(any(feature = "mysql", feature = "postgres", feature = "sqlite")),
        allow(clippy::never_loop)
    )]
    pub(crate) async fn acquire(
        &self,
        semaphore: &str,
        me: &str,
        permits: u32,
        lease: Lease,
    ) -> Result<LeaseReply> {
        self.check(semaphore, Some(me))?;
        let what = format!("acquire a permit of semaphore {semaphore:?}");
        for _ in 0..HEADER_TRIES {
            let outcome = self
                .detached(what.clone(), {
                    let (s, me) = (semaphore.to_owned(), me.to_owned());
                    move |inner: Arc<Inner>| async move {
                        let sql = &inner.permits.sql;
                        let inner = &*inner;
                        on_conn!(inner, |c| acquire_tx(c, sql, &s, &me, permits, lease))
                    }
                })
                .await?;
            match outcome {
                Outcome::Reply(reply) => return Ok(reply),
                Outcome::Mismatch(existing) => {
                    return Err(Error::PermitsMismatch {
                        semaphore: semaphore.to_owned(),
                        asked: permits,
                        existing,
                    });
                }
                Outcome::NoHeader => {
                    let inner = &**self.inner;
                    let sql = &inner.permits.sql;
                    run!(inner, what.clone(), |c| c
                        .exec(&sql.header, &[Arg::Text(semaphore)]))
                    .map_err(|e| self.explain(e))?;
                }
            }
        }
        Err(Error::backend(
            self.inner.kind.name(),
            format!("{what}: the semaphore's row is still missing after inserting it"),
        ))
    }

    /// Runs `work` (one transaction) in a task of its own, so that it runs to its end
    /// (commit or rollback) even when the caller gives up; the caller waits for it at most
    /// the statement timeout. MySQL and PostgreSQL bound the work itself too (a
    /// connection cut off is closed, and the server rolls back); SQLite's statements run
    /// to completion on the connection's thread (its busy timeout bounds a lock wait).
    async fn detached<T, F, Fut>(&self, what: String, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(Arc<Inner>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = std::result::Result<T, Failure>> + Send,
    {
        let inner = self.inner.clone();
        let limit = inner.config.statement_timeout();
        let task_what = what.clone();
        let task = tokio::spawn(async move {
            let bound = if inner.discard { limit } else { Duration::MAX };
            let arc = inner.clone();
            inner.bounded(&task_what, bound, work(arc)).await
        });
        match tokio::time::timeout(limit, task).await {
            Ok(Ok(result)) => result.map_err(|e| self.explain(e)),
            Ok(Err(join)) => Err(Error::backend(
                self.inner.kind.name(),
                format!("{what}: the task failed: {join}"),
            )),
            Err(_) => Err(Error::backend(
                self.inner.kind.name(),
                format!(
                    "{what}: no answer within {limit:?} (statement timeout); the transaction \
                     ends on its own"
                ),
            )),
        }
    }

    pub(crate) async fn guard(
        &self,
        semaphore: &str,
        me: &str,
        lease: Lease,
    ) -> Result<LeaseReply> {
        self.check(semaphore, Some(me))?;
        let inner = &**self.inner;
        let sql = &inner.permits.sql;
        let ttl = lease.ttl_ms();
        let total = ttl.saturating_add(lease.transition_ms());
        let view: View = run!(
            inner,
            format!("renew a permit of semaphore {semaphore:?}"),
            |c| async {
                c.exec(
                    &sql.renew,
                    &[
                        Arg::Int(ttl),
                        Arg::Int(total),
                        Arg::Text(semaphore),
                        Arg::Text(me),
                    ],
                )
                .await?;
                read(c, sql, semaphore).await
            }
        )
        .map_err(|e| self.explain(e))?;
        match view.holders.iter().find(|h| h.contender == me) {
            Some(h) => Ok(LeaseReply {
                owner: h.owner()?,
                now: view.now,
            }),
            None => Ok(LeaseReply::look_again_at(view.now, view.now)),
        }
    }

    pub(crate) async fn release(&self, semaphore: &str, me: &str) -> Result<bool> {
        self.check(semaphore, Some(me))?;
        let inner = &**self.inner;
        let sql = &inner.permits.sql;
        let args = [Arg::Text(semaphore), Arg::Text(me)];
        let (released, view): (bool, Option<View>) = run!(
            inner,
            format!("release a permit of semaphore {semaphore:?}"),
            |c| async {
                let released = c.exec(&sql.release, &args).await? > 0;
                // A waiter's place, or a holder past its lease.
                let left = c.exec(&sql.delete, &args).await? > 0;
                let view = if (released || left) && inner.permits.has_waiters(semaphore) {
                    Some(read(c, sql, semaphore).await?)
                } else {
                    None
                };
                Ok::<_, diesel::result::Error>((released, view))
            }
        )
        .map_err(|e| self.explain(e))?;
        if let Some(view) = view {
            inner.permits.wake(semaphore, view.owed());
        }
        Ok(released)
    }

    pub(crate) async fn owners(&self, semaphore: &str) -> Result<PermitHolders> {
        self.check(semaphore, None)?;
        let inner = &**self.inner;
        let sql = &inner.permits.sql;
        let view: View = run!(
            inner,
            format!("read the holders of semaphore {semaphore:?}"),
            |c| read(c, sql, semaphore)
        )
        .map_err(|e| self.explain(e))?;
        let holders = view
            .holders
            .iter()
            .map(Slot::owner)
            .collect::<Result<Vec<_>>>()?;
        Ok(PermitHolders {
            permits: if holders.is_empty() {
                None
            } else {
                view.header.map(|h| h.permits)
            },
            holders,
            now: view.now,
        })
    }

    pub(crate) fn subscribe(&self, semaphore: &str, me: &str) -> Result<Option<EventReceiver>> {
        self.check(semaphore, Some(me))?;
        Ok(Some(self.inner.permits.subscribe(semaphore, me)))
    }

    /// Leaves the queue only: a permit held stays held until its lease ends.
    pub(crate) async fn leave(&self, semaphore: &str, me: &str) -> Result<()> {
        self.check(semaphore, Some(me))?;
        let inner = &**self.inner;
        let sql = &inner.permits.sql;
        let view: Option<View> = run!(
            inner,
            format!("leave the queue of semaphore {semaphore:?}"),
            |c| async {
                // Only a waiter's row (fence 0).
                let args = [Arg::Text(semaphore), Arg::Text(me)];
                let left = c.exec(&sql.leave, &args).await? > 0;
                if left && inner.permits.has_waiters(semaphore) {
                    Ok::<_, diesel::result::Error>(Some(read(c, sql, semaphore).await?))
                } else {
                    Ok(None)
                }
            }
        )
        .map_err(|e| self.explain(e))?;
        if let Some(view) = view {
            inner.permits.wake(semaphore, view.owed());
        }
        Ok(())
    }

    /// Creates the permits table (with DDL on) and checks it has every column.
    pub(crate) async fn migrate(&self, limit: Duration, ddl: bool) -> Result<()> {
        let inner = &**self.inner;
        let sql = &inner.permits.sql;
        if ddl {
            inner
                .bounded::<()>("migrate the permits table", limit, async {
                    on_conn!(inner, |c| async {
                        c.batch(&sql.migrate).await?;
                        c.batch(&sql.check).await
                    })
                })
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(c: &str, ticket: i64, until: i64, fence: i64) -> Slot {
        Slot {
            contender: c.to_owned(),
            ticket,
            acquired_at: 1,
            ttl_at: until,
            transition_at: until,
            fence,
        }
    }

    fn view(holders: Vec<Slot>, waiters: Vec<Slot>, permits: u32) -> View {
        View {
            now: 1000,
            header: Some(Header {
                permits,
                ticket: 7,
                fence: 5000,
            }),
            holders,
            waiters,
            expired: Vec::new(),
        }
    }

    const LEASE: Lease = Lease {
        ttl: Duration::from_secs(1),
        transition: Duration::ZERO,
    };

    fn decided(v: &View, who: &str, permits: u32) -> PermitDecision {
        decide(v, who, permits, LEASE)
            .expect("rows simba writes")
            .decision
    }

    #[test]
    fn a_free_permit_goes_to_the_earliest_waiter() {
        let v = view(
            vec![slot("a", 0, 2000, 10)],
            vec![slot("w1", 3, 9000, 0), slot("w2", 4, 9000, 0)],
            2,
        );
        assert!(matches!(
            decided(&v, "w1", 2),
            PermitDecision::Take {
                fence: 5001,
                queued: Some(0),
                ..
            }
        ));
        assert!(matches!(
            decided(&v, "w2", 2),
            PermitDecision::Wait {
                queued: Some(1),
                look_at: 1250,
                ..
            }
        ));
        assert!(matches!(
            decided(&v, "new", 2),
            PermitDecision::Wait { queued: None, .. }
        ));
        assert_eq!(v.owed().collect::<Vec<_>>(), ["w1"]);
    }

    #[test]
    fn never_more_than_n_and_counts_must_agree() {
        let v = view(
            vec![slot("a", 0, 2000, 10), slot("b", 0, 1100, 11)],
            vec![],
            2,
        );
        // The first lease end is sooner than the poll.
        assert!(matches!(
            decided(&v, "c", 2),
            PermitDecision::Wait { look_at: 1100, .. }
        ));
        assert_eq!(
            decided(&v, "c", 3),
            PermitDecision::Mismatch { existing: 2 }
        );
        assert!(matches!(
            decided(&v, "a", 2),
            PermitDecision::Renew { holder: 0, .. }
        ));
        // No holder: the count is the newcomer's.
        let empty = view(vec![], vec![], 2);
        assert!(matches!(
            decided(&empty, "c", 3),
            PermitDecision::Take { .. }
        ));
    }

    #[test]
    fn rows_past_their_time_are_dropped_and_come_last() {
        let mut v = view(vec![slot("a", 0, 2000, 10)], vec![], 1);
        v.expired = vec![slot("old", 0, 900, 9), slot("gone", 2, 1000, 0)];
        let d = decide(&v, "c", 1, LEASE).expect("rows simba writes");
        assert_eq!((d.expired_holders, d.stale_waiters), (vec![1], vec![0]));
        let mut bad_fence = view(vec![slot("a", 0, 2000, -1)], vec![], 1);
        bad_fence.header = None;
        assert!(decide(&bad_fence, "c", 1, LEASE).is_err());
    }

    #[test]
    fn fences_are_floored_by_the_clock() {
        let mut v = view(vec![], vec![], 1);
        v.header = Some(Header::default());
        assert!(matches!(
            decided(&v, "c", 1),
            PermitDecision::Take { fence: 1000, .. }
        ));
    }

    #[test]
    fn statements_have_their_placeholders() {
        for backend in [Backend::Mysql, Backend::Sqlite] {
            let s = PermitSql::new(backend, "simba_mutex");
            assert_eq!(s.insert.matches('?').count(), 8);
            assert_eq!(s.renew.matches('?').count(), 4);
            assert_eq!(s.set_header.matches('?').count(), 4);
        }
        let pg = PermitSql::new(Backend::Postgres, "simba_mutex");
        assert!(pg.insert.contains("$8") && !pg.insert.contains('?'));
        assert!(pg.lock.ends_with("FOR UPDATE"));
        let ddl = create_permits_table_sql(Backend::Sqlite, "a.locks").expect("valid");
        assert!(ddl.starts_with("CREATE TABLE IF NOT EXISTS \"a\".\"locks_permits\""));
    }
}
