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
//! no earlier waiter is owed the free permit, or queue. A waiter owed a permit gets a claim
//! deadline ([`claim_ms`], kept in its row's `acquired_at`); once it has passed, the waiter
//! is passed over until it calls again (a stopped process does not hold a permit up).
//! The transaction runs in a task of its own, so that a caller that gives up never leaves
//! a connection halfway through it.
//!
//! Waiters are woken by push: a release, or a waiter leaving, sends
//! [`StoreEvent::Released`] to the store's own waiters owed a freed permit and to the next
//! one ([`permit_wakes`]), and tells the
//! other stores where the database lets it (PostgreSQL: a NOTIFY naming the waiters owed;
//! SQLite on Linux: the semaphore's bell file, see `crate::sqlite::Bells`), whose waiters
//! are woken the same way. MySQL has no push: waiters of other stores look again every
//! [`PERMIT_POLL`] at most, as every waiter does should a push be missed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use diesel::result::QueryResult;
use simba_core::backend::{
    Admission, AdmissionHolder, AdmissionWaiter, Lease, LeaseReply, PERMIT_CLAIM_MS,
    PermitDecision, PermitHolders, PermitRequest, SemaphoreState, StoreEvent, admit_permit,
    permit_wakes,
};
use simba_core::events::{self, EventReceiver, EventSender};
use simba_core::{Error, MutexOwner, Result};
use tracing::debug;

// `Failure`, `Checked`, `on_pool!` and `debug!` are named by the `run!` expansion.
use super::{Failure, Inner, permanent};
use crate::config::Backend;
use crate::conn::{Arg, Checked, SqlConn, Step};
use crate::dialect::on_pool;
use crate::rows::PermitRow;
use crate::sql::{lease_clock_sql, numbered, quote_table};

mod sql;
#[cfg(test)]
mod tests;
mod tx;
mod view;

pub(crate) use sql::PermitSql;
pub use sql::permit_transaction_begin;
use tx::{Outcome, Subscribers, acquire_tx, read, viewed};
use view::{Slot, View, decide, misread};

/// The longest a waiter of a semaphore waits before it looks again (a permit freed by
/// another process, or owed to a waiter ahead that took it or left).
pub const PERMIT_POLL: Duration = Duration::from_millis(250);

/// [`PERMIT_POLL`] in milliseconds.
const POLL_MS: i64 = 250;

/// How long a waiter owed a permit has to take it before the waiters behind it get it (see
/// [`admit_permit`]): [`PERMIT_CLAIM_MS`] where every waiter is pushed, two polls where
/// the waiters of other stores poll (MySQL, PostgreSQL without LISTEN).
pub(crate) fn claim_ms(pushed: bool) -> i64 {
    if pushed { PERMIT_CLAIM_MS } else { 2 * POLL_MS }
}

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

/// The store's semaphores: their statements and the local waiters to wake.
pub(crate) struct Permits {
    pub(crate) sql: PermitSql,
    /// This store's waiters that subscribed.
    pub(crate) waiters: Arc<Waiters>,
}

impl Permits {
    pub(crate) fn new(backend: Backend, table: &str) -> Self {
        Permits {
            sql: PermitSql::new(backend, table),
            waiters: Arc::default(),
        }
    }
}

/// Per semaphore, a store's waiters that subscribed (contender, sender).
#[derive(Default)]
pub(crate) struct Waiters(std::sync::Mutex<HashMap<String, Subscribers>>);

impl Waiters {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Subscribers>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn subscribe(&self, semaphore: &str, contender: &str) -> EventReceiver {
        let (tx, rx) = events::channel(4);
        let mut map = self.lock();
        let list = map.entry(semaphore.to_owned()).or_default();
        list.retain(|(_, tx)| !tx.is_closed());
        list.push((contender.to_owned(), tx));
        rx
    }

    /// Wakes the waiters of `semaphore` that `named` names.
    fn wake<'a>(&self, semaphore: &str, named: impl Iterator<Item = &'a str>) {
        let named: Vec<&str> = named.collect();
        self.wake_where(semaphore, |id| named.contains(&id));
    }

    /// Wakes every waiter of `semaphore`.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    fn wake_all(&self, semaphore: &str) {
        self.wake_where(semaphore, |_| true);
    }

    /// Wakes the waiters of `semaphore` whose id passes `test`; forgets the ones that
    /// stopped listening.
    fn wake_where(&self, semaphore: &str, test: impl Fn(&str) -> bool) {
        let mut map = self.lock();
        let Some(list) = map.get_mut(semaphore) else {
            return;
        };
        list.retain(|(_, tx)| !tx.is_closed());
        for (_, tx) in list.iter().filter(|(id, _)| test(id)) {
            // A full channel already holds an event that makes the waiter look again.
            let _ = tx.try_send(StoreEvent::Released);
        }
        if list.is_empty() {
            map.remove(semaphore);
        }
    }

    /// Wakes the waiters that news of freed permits from another store concerns.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) fn heard(&self, news: crate::push::Freed<'_>) {
        use crate::push::Freed;
        match news {
            Freed::Owed(semaphore, owed) => self.wake(semaphore, owed.iter().copied()),
            Freed::Matching(test) => {
                let names: Vec<String> = self.lock().keys().filter(|s| test(s)).cloned().collect();
                for semaphore in &names {
                    self.wake_all(semaphore);
                }
            }
        }
    }

    fn has_waiters(&self, semaphore: &str) -> bool {
        let map = self.lock();
        map.get(semaphore)
            .is_some_and(|l| l.iter().any(|(_, tx)| !tx.is_closed()))
    }

    /// Whether `contender` is one of this store's waiters of `semaphore`.
    fn has(&self, semaphore: &str, contender: &str) -> bool {
        let map = self.lock();
        map.get(semaphore)
            .is_some_and(|l| l.iter().any(|(id, tx)| id == contender && !tx.is_closed()))
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
                        let claim = claim_ms(inner.dialect.pushes_permits());
                        let inner = &*inner;
                        on_own!(inner, |c| acquire_tx(
                            c, sql, &s, &me, permits, lease, claim
                        ))
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
        let args = [
            Arg::Int(ttl),
            Arg::Int(total),
            Arg::Text(semaphore),
            Arg::Text(me),
        ];
        let name = [Arg::Text(semaphore)];
        let view: View = run_own!(
            inner,
            format!("renew a permit of semaphore {semaphore:?}"),
            |c| async {
                let done = c
                    .pipeline(&[
                        Step::Exec(&sql.renew, &args),
                        Step::Permits(&sql.read, &name),
                    ])
                    .await?;
                viewed(done.into_iter().nth(1))
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
        let name = [Arg::Text(semaphore)];
        let wakes = self.wakes(semaphore);
        let (released, view): (bool, Option<View>) = run_own!(
            inner,
            format!("release a permit of semaphore {semaphore:?}"),
            |c| async {
                // The read that tells whom to wake goes with the deletes where that costs
                // no round trip of its own.
                let ahead = wakes && c.pipelines();
                let mut steps = vec![
                    Step::Exec(&sql.release, &args),
                    // A waiter's place, or a holder past its lease.
                    Step::Exec(&sql.delete, &args),
                ];
                if ahead {
                    steps.push(Step::Permits(&sql.read, &name));
                }
                let mut done = c.pipeline(&steps).await?.into_iter();
                let released = done.next().is_some_and(|d| d.count() > 0);
                let left = done.next().is_some_and(|d| d.count() > 0);
                let view = if !(released || left) || !wakes {
                    None
                } else if ahead {
                    Some(viewed(done.next())?)
                } else {
                    Some(read(c, sql, semaphore).await?)
                };
                Ok::<_, diesel::result::Error>((released, view))
            }
        )
        .map_err(|e| self.explain(e))?;
        if let Some(view) = view {
            self.woken(semaphore, &view);
        }
        Ok(released)
    }

    pub(crate) async fn owners(&self, semaphore: &str) -> Result<PermitHolders> {
        self.check(semaphore, None)?;
        let inner = &**self.inner;
        let sql = &inner.permits.sql;
        let view: View = run_read!(
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
        let rx = self.inner.permits.waiters.subscribe(semaphore, me);
        self.inner.dialect.hear_permits();
        Ok(Some(rx))
    }

    /// Whether freeing a permit of `semaphore` wakes anyone: a waiter of this store, or
    /// (where the store pushes to others) one of another store.
    fn wakes(&self, semaphore: &str) -> bool {
        self.inner.dialect.pushes_permits() || self.inner.permits.waiters.has_waiters(semaphore)
    }

    /// Wakes the waiters owed the permits freed, as `view` (read after the change) shows:
    /// this store's, and the other stores' through the database.
    fn woken(&self, semaphore: &str, view: &View) {
        let waiters = &self.inner.permits.waiters;
        let wakes = view.wakes();
        waiters.wake(semaphore, wakes.iter().copied());
        let elsewhere: Vec<&str> = wakes
            .iter()
            .copied()
            .filter(|w| !waiters.has(semaphore, w))
            .collect();
        self.inner.dialect.permits_freed(semaphore, &elsewhere);
    }

    /// Leaves the queue only: a permit held stays held until its lease ends.
    pub(crate) async fn leave(&self, semaphore: &str, me: &str) -> Result<()> {
        self.check(semaphore, Some(me))?;
        let inner = &**self.inner;
        let sql = &inner.permits.sql;
        let view: Option<View> = run_own!(
            inner,
            format!("leave the queue of semaphore {semaphore:?}"),
            |c| async {
                // Only a waiter's row (fence 0).
                let args = [Arg::Text(semaphore), Arg::Text(me)];
                let name = [Arg::Text(semaphore)];
                let wakes = self.wakes(semaphore);
                let ahead = wakes && c.pipelines();
                let mut steps = vec![Step::Exec(&sql.leave, &args)];
                if ahead {
                    steps.push(Step::Permits(&sql.read, &name));
                }
                let mut done = c.pipeline(&steps).await?.into_iter();
                let left = done.next().is_some_and(|d| d.count() > 0);
                if !left || !wakes {
                    Ok::<_, diesel::result::Error>(None)
                } else if ahead {
                    Ok(Some(viewed(done.next())?))
                } else {
                    Ok(Some(read(c, sql, semaphore).await?))
                }
            }
        )
        .map_err(|e| self.explain(e))?;
        if let Some(view) = view {
            self.woken(semaphore, &view);
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
