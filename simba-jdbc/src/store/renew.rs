//! Renewals of many ownerships in one statement: concurrent [`LeaseStore::guard`] calls of a
//! store coalesce into batches.
//!
//! A renewal call queues its `(mutex, contender, lease)` and its reply channel. While fewer
//! than [`Renewals::lanes`] batches run, the call starts a batch task at once (so a lone
//! renewal costs what it did alone, plus one task hop); otherwise it waits in the queue, and
//! the next batch to start takes every queued call of the same lease, up to [`MAX_BATCH`].
//! A batch is two statements on one of the store's renewal connections (the pool keeps one
//! per lane apart for them, `crate::pool::split_pool`, so a batch never waits for a
//! connection behind thousands of acquisitions; on SQLite it also takes the next turn,
//! ahead of the queued calls): one `UPDATE` that renews every pair
//! whose row the contender owns within its lease (the single renewal's `WHERE`, pair by
//! pair), then one read of all the rows with the database's time. Each call gets the reply
//! its own single renewal would have given: its row as it is after the `UPDATE`, judged on
//! the database's time — renewed, or lost (taken over, released, run out) — so one row taken
//! over in a batch makes exactly that call's ownership lost.
//!
//! # The local deadline
//! The engine counts an owner's local deadline from the instant it *called* `guard`
//! (minus its drift margin). A queued call's statement is sent at or after that instant,
//! and the database evaluates `ttl_at = NOW + ttl`, `transition_at = NOW + ttl + transition`
//! when the statement runs, later still: the lease the database records never ends before
//! the engine's local deadline. Waiting in the queue can only make the engine's view more
//! conservative, never less.
//!
//! # How long a call waits
//! A queued call waits for at most the batches already running (each bounded by the
//! statement timeout, and by [`MAX_BATCH`] rows, a few milliseconds on a healthy
//! database) before its own is sent. The engine bounds every renewal by the local
//! deadline and marks the ownership suspect two thirds of the way there (or at the request
//! timeout) if no answer came: a call delayed by the queue is treated exactly like a slow
//! statement, and the deadline ends the ownership whatever the queue does.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};

use simba_core::backend::{Lease, LeaseReply};
use simba_core::{Error, Result};
use tokio::sync::oneshot;

use tracing::debug;

// `Failure`, `Checked`, `on_pool!` and `debug!` are named by the `run!` expansion.
use super::{Failure, Inner, owner_reply};
use crate::config::Backend;
use crate::conn::{Arg, Checked, SqlConn};
use crate::dialect::on_pool;
use crate::pool::renewal_lanes;
use crate::rows::{BatchRow, OwnerRow};

/// The most renewals one statement carries (3 bound values each: far below every
/// database's limit on bound values, and a statement of a few milliseconds).
pub(crate) const MAX_BATCH: usize = 500;

/// How many renewals a store answered, and in how many batched statements.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RenewalCounts {
    /// Renewal calls ([`LeaseStore::guard`](simba_core::backend::LeaseStore::guard)) answered
    /// by a batch (with a reply or an error).
    pub calls: u64,
    /// Batches sent: each is one `UPDATE` of all its rows and one read of them.
    pub batches: u64,
}

/// A renewal waiting for its batch.
struct Pending {
    mutex: String,
    me: String,
    lease: Lease,
    reply: oneshot::Sender<Result<LeaseReply>>,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Pending>,
    /// Batch tasks running.
    running: usize,
}

/// The renewal queue of one store.
pub(super) struct Renewals {
    queue: StdMutex<Queue>,
    /// Batches that may run at once ([`renewal_lanes`]), each on a connection of its own
    /// when the pool is split ([`split_pool`](crate::pool::split_pool)).
    lanes: usize,
    calls: AtomicU64,
    batches: AtomicU64,
}

impl Renewals {
    pub(super) fn new(kind: Backend, pool_size: usize) -> Renewals {
        Renewals {
            queue: StdMutex::new(Queue::default()),
            lanes: renewal_lanes(kind).min(pool_size.max(1)),
            calls: AtomicU64::new(0),
            batches: AtomicU64::new(0),
        }
    }

    pub(super) fn counts(&self) -> RenewalCounts {
        RenewalCounts {
            calls: self.calls.load(Ordering::Relaxed),
            batches: self.batches.load(Ordering::Relaxed),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a renewal and returns its answer (see the module's documentation).
    ///
    /// # Cancel safety
    /// Dropping the future leaves the renewal queued; a batch skips a call whose caller
    /// is gone if it has not started yet, and otherwise applies it (a renewal of a row the
    /// contender owns, which the engine tolerates like any call dropped halfway).
    pub(super) async fn renew(
        inner: &Arc<Inner>,
        mutex: &str,
        me: &str,
        lease: Lease,
    ) -> Result<LeaseReply> {
        inner.gates.calling(mutex, me);
        let (tx, rx) = oneshot::channel();
        let pending = Pending {
            mutex: mutex.to_owned(),
            me: me.to_owned(),
            lease,
            reply: tx,
        };
        let start = {
            let mut q = inner.renewals.lock();
            q.waiting.push_back(pending);
            let start = q.running < inner.renewals.lanes;
            if start {
                q.running += 1;
            }
            start
        };
        if start {
            tokio::spawn(run(inner.clone()));
        }
        match rx.await {
            Ok(reply) => reply,
            Err(_) => Err(Error::backend(
                inner.kind.name(),
                format!("renew mutex {mutex:?}: the renewal batch ended without an answer"),
            )),
        }
    }

    /// The next batch: the first live call, and every later one of the same lease, up to
    /// [`MAX_BATCH`]; `None` (and one task fewer) when nothing waits.
    fn take(&self) -> Option<Vec<Pending>> {
        let mut q = self.lock();
        while q.waiting.front().is_some_and(|p| p.reply.is_closed()) {
            q.waiting.pop_front();
        }
        let Some(lease) = q.waiting.front().map(|p| p.lease) else {
            q.running = q.running.saturating_sub(1);
            return None;
        };
        let mut batch = Vec::new();
        let mut rest = VecDeque::with_capacity(q.waiting.len());
        for p in q.waiting.drain(..) {
            if p.reply.is_closed() {
                continue;
            }
            if batch.len() < MAX_BATCH && p.lease == lease {
                batch.push(p);
            } else {
                rest.push_back(p);
            }
        }
        q.waiting = rest;
        Some(batch)
    }
}

/// A batch task: runs batches while calls wait.
async fn run(inner: Arc<Inner>) {
    while let Some(batch) = inner.renewals.take() {
        renew_batch(&inner, batch).await;
    }
}

/// Renews `batch` (one lease) in one `UPDATE`, reads the rows, and answers each call.
async fn renew_batch(inner: &Inner, batch: Vec<Pending>) {
    let n = batch.len();
    let Some(lease) = batch.first().map(|p| p.lease) else {
        return;
    };
    let ttl = lease.ttl_ms();
    let total = ttl.saturating_add(lease.transition_ms());
    let (update, select) = inner.table().st.renew_batch(n);
    let mut update_args = Vec::with_capacity(2 + 3 * n);
    update_args.push(Arg::Int(ttl));
    update_args.push(Arg::Int(total));
    update_args.extend(batch.iter().map(|p| Arg::Text(&p.mutex)));
    for p in &batch {
        update_args.push(Arg::Text(&p.mutex));
        update_args.push(Arg::Text(&p.me));
    }
    let select_args: Vec<Arg<'_>> = batch.iter().map(|p| Arg::Text(&p.mutex)).collect();
    let what = if n == 1 {
        format!("renew mutex {:?}", batch[0].mutex)
    } else {
        format!("renew {n} mutexes (mutex {:?} among them)", batch[0].mutex)
    };
    inner.renewals.batches.fetch_add(1, Ordering::Relaxed);
    // The statement is sent now: after every call of the batch was made (see the
    // module's documentation on the local deadline).
    let rows: Result<Vec<BatchRow>> = inner
        .bounded(&what, inner.config.statement_timeout(), async {
            on_conn!(@renewal inner, |c| renew_statements(c, &update, &update_args, &select, &select_args))
        })
        .await;
    inner
        .renewals
        .calls
        .fetch_add(u64::try_from(n).unwrap_or(u64::MAX), Ordering::Relaxed);
    let rows = match rows {
        Ok(rows) => rows,
        Err(e) => {
            let retryable = e.is_retryable();
            let message = e.to_string();
            for p in batch {
                let _ = p.reply.send(Err(Error::Backend {
                    backend: inner.kind.name(),
                    message: message.clone(),
                    retryable,
                    source: None,
                }));
            }
            return;
        }
    };
    let now = rows.first().map(|r| r.now_ms);
    let by_mutex: HashMap<&str, &BatchRow> = rows
        .iter()
        .filter_map(|r| r.mutex.as_deref().map(|m| (m, r)))
        .collect();
    for p in batch {
        let reply = match now {
            None => Err(Error::backend(
                inner.kind.name(),
                "the batched owner read returned no row (it always returns one)",
            )),
            Some(now_ms) => {
                let row = match by_mutex.get(p.mutex.as_str()) {
                    Some(r) => OwnerRow {
                        now_ms,
                        owner_id: r.owner_id.clone(),
                        acquired_at: r.acquired_at,
                        ttl_at: r.ttl_at,
                        transition_at: r.transition_at,
                        version: r.version,
                        waiter_id: None,
                    },
                    None => OwnerRow {
                        now_ms,
                        owner_id: None,
                        acquired_at: None,
                        ttl_at: None,
                        transition_at: None,
                        version: None,
                        waiter_id: None,
                    },
                };
                owner_reply(inner.kind, Some(row), None)
            }
        };
        // The native lock is kept until the whole lease from now, after the answer: the
        // database stamped the row's lease during the call, so that is never before the
        // row's lease ends (see `Gates::outcome`).
        let answered = tokio::time::Instant::now();
        if let Ok(r) = &reply {
            let owns = r.owner.is_owned_by_at(&p.me, r.now);
            inner
                .gates
                .outcome(&p.mutex, &p.me, owns, answered + p.lease.total());
        }
        let _ = p.reply.send(reply);
    }
}

/// The two statements of a batch: on SQLite together on the connection's thread, in one
/// hop (see `SqlConn::on_thread`).
async fn renew_statements<C: SqlConn>(
    c: &mut C,
    update: &str,
    update_args: &[Arg<'_>],
    select: &str,
    select_args: &[Arg<'_>],
) -> diesel::QueryResult<Vec<BatchRow>> {
    #[cfg(feature = "sqlite")]
    if C::THREADED {
        use crate::conn::OwnedArg;
        use diesel::RunQueryDsl;
        let (update, select) = (update.to_owned(), select.to_owned());
        let (update_args, select_args) = (OwnedArg::all(update_args), OwnedArg::all(select_args));
        return c
            .on_thread(move |conn| {
                let update_args = OwnedArg::borrow(&update_args);
                let select_args = OwnedArg::borrow(&select_args);
                crate::conn::bind_all::<diesel::sqlite::Sqlite>(&update, &update_args)
                    .execute(conn)?;
                crate::conn::bind_all::<diesel::sqlite::Sqlite>(&select, &select_args)
                    .load::<BatchRow>(conn)
            })
            .await;
    }
    c.exec_varying(update, update_args).await?;
    c.load_batch(select, select_args).await
}
