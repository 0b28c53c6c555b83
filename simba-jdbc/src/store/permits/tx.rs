//! An acquisition's transaction: lock the semaphore's row, read, decide, write.

use super::*;
use crate::conn::{Done, Step};

/// What an acquisition's transaction returns.
pub(super) enum Outcome {
    Reply(LeaseReply),
    Mismatch(u32),
    /// The semaphore has no row yet: make it, and try again.
    NoHeader,
}

pub(super) async fn read<C: SqlConn>(
    c: &mut C,
    sql: &PermitSql,
    semaphore: &str,
) -> QueryResult<View> {
    let rows = c.load_permits(&sql.read, &[Arg::Text(semaphore)]).await?;
    // A row that is not what simba writes is reported as the query's failure.
    View::new(rows).map_err(|e| diesel::result::Error::DeserializationError(Box::new(e)))
}

/// The semaphore's rows a [`Step::Permits`] read, as a [`View`].
pub(super) fn viewed(done: Option<Done>) -> QueryResult<View> {
    let rows = done.map(Done::into_permits).unwrap_or_default();
    View::new(rows).map_err(|e| diesel::result::Error::DeserializationError(Box::new(e)))
}

/// One acquisition: a transaction on `c` (rolled back on any failure), in two round trips
/// where the connection pipelines ([`SqlConn::pipeline`]): the start, the semaphore's row
/// locked and every row read; then the writes the rule decided on and the commit.
pub(super) async fn acquire_tx<C: SqlConn>(
    c: &mut C,
    sql: &PermitSql,
    semaphore: &str,
    me: &str,
    permits: u32,
    lease: Lease,
    claim_ms: i64,
) -> QueryResult<Outcome> {
    let name = [Arg::Text(semaphore)];
    let start = c
        .pipeline(&[
            Step::Batch(sql.begin),
            Step::Permits(&sql.lock, &name),
            Step::Permits(&sql.read_locked, &name),
        ])
        .await;
    let decided = start.and_then(|done| {
        let mut done = done.into_iter().skip(1).map(Done::into_permits);
        let (header, rows) = (
            done.next().unwrap_or_default(),
            done.next().unwrap_or_default(),
        );
        if header.is_empty() {
            return Ok(None);
        }
        viewed(Some(Done::Permits(rows))).map(Some)
    });
    let view = match decided {
        Ok(Some(view)) => view,
        Ok(None) => return c.batch("ROLLBACK").await.map(|()| Outcome::NoHeader),
        Err(e) => return rolled_back(c, e).await,
    };
    let (writes, outcome) = match plan(&view, sql, semaphore, me, permits, lease, claim_ms) {
        Ok(planned) => planned,
        Err(e) => return rolled_back(c, e).await,
    };
    let mut steps: Vec<Step<'_>> = writes
        .iter()
        .map(|(sql, args)| Step::Exec(sql, args))
        .collect();
    steps.push(Step::Batch("COMMIT"));
    match c.pipeline(&steps).await {
        Ok(_) => Ok(outcome),
        // A failed write aborted the transaction (its COMMIT, where it was sent, rolled
        // back); elsewhere the transaction is still open.
        Err(e) => rolled_back(c, e).await,
    }
}

/// Rolls the transaction on `c` back and returns `e` (the first failure).
async fn rolled_back<C: SqlConn, T>(c: &mut C, e: diesel::result::Error) -> QueryResult<T> {
    let _ = c.batch("ROLLBACK").await;
    Err(e)
}

/// A statement and its arguments.
type Write<'a> = (&'a str, Vec<Arg<'a>>);

/// The writes of an acquisition that read `view` (inside its transaction, the semaphore's
/// row locked) and what it returns once they commit.
fn plan<'a>(
    view: &'a View,
    sql: &'a PermitSql,
    semaphore: &'a str,
    me: &'a str,
    permits: u32,
    lease: Lease,
    claim_ms: i64,
) -> QueryResult<(Vec<Write<'a>>, Outcome)> {
    let now = view.now;
    let admission = decide(view, me, permits, lease, claim_ms)
        .map_err(|e| diesel::result::Error::DeserializationError(Box::new(e)))?;
    let mut writes: Vec<Write<'a>> = Vec::new();
    for &(i, claim_by) in &admission.claims {
        // Only waiters within their kept time are owed: their index is the view's.
        let waiter = view
            .waiters
            .get(i)
            .ok_or_else(|| misread(format!("owed waiter {i} of {}", view.waiters.len())))?;
        writes.push((
            &sql.set_claim,
            vec![
                Arg::Int(claim_by),
                Arg::Text(semaphore),
                Arg::Text(&waiter.contender),
            ],
        ));
    }
    if !admission.expired_holders.is_empty() || !admission.stale_waiters.is_empty() {
        // The rule's drops are exactly the rows past their time (`transition_at <= now`).
        writes.push((&sql.prune, vec![Arg::Text(semaphore), Arg::Int(now)]));
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
            writes.push((
                &sql.set_times,
                vec![
                    Arg::Int(ttl_at),
                    Arg::Int(transition_at),
                    Arg::Text(semaphore),
                    Arg::Text(me),
                ],
            ));
            let mut slot = view
                .holders
                .get(holder)
                .cloned()
                .ok_or_else(|| misread(format!("holder {holder} of {}", view.holders.len())))?;
            slot.ttl_at = ttl_at;
            slot.transition_at = transition_at;
            slot
        }
        PermitDecision::Mismatch { existing } => {
            return Ok((writes, Outcome::Mismatch(existing)));
        }
        PermitDecision::Take {
            fence,
            ttl_at,
            transition_at,
            // Its waiter's row, deleted below.
            queued: _,
        } => {
            let fence =
                i64::try_from(fence).map_err(|_| misread(format!("a fence past i64: {fence}")))?;
            writes.push((
                &sql.set_header,
                vec![
                    Arg::Int(i64::from(permits)),
                    Arg::Int(header.ticket),
                    Arg::Int(fence),
                    Arg::Text(semaphore),
                ],
            ));
            writes.push((&sql.delete, vec![Arg::Text(semaphore), Arg::Text(me)]));
            let slot = Slot {
                contender: me.to_owned(),
                ticket: 0,
                acquired_at: now,
                ttl_at,
                transition_at,
                fence,
            };
            writes.push(insert(sql, semaphore, me, &slot, permits));
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
            writes.push((
                &sql.set_header,
                vec![
                    Arg::Int(i64::from(count)),
                    Arg::Int(header.ticket.max(ticket)),
                    Arg::Int(header.fence),
                    Arg::Text(semaphore),
                ],
            ));
            if queued.is_some() {
                // Its place kept, its claim (if any) cleared: it called.
                writes.push((
                    &sql.keep_place,
                    vec![
                        Arg::Int(keep_until),
                        Arg::Int(keep_until),
                        Arg::Text(semaphore),
                        Arg::Text(me),
                    ],
                ));
            } else {
                let slot = Slot {
                    contender: me.to_owned(),
                    ticket,
                    acquired_at: 0,
                    ttl_at: keep_until,
                    transition_at: keep_until,
                    fence: 0,
                };
                writes.push(insert(sql, semaphore, me, &slot, 0));
            }
            let reply = LeaseReply::look_again_at(look_at, now);
            return Ok((writes, Outcome::Reply(reply)));
        }
    };
    let owner = owner
        .owner()
        .map_err(|e| diesel::result::Error::DeserializationError(Box::new(e)))?;
    Ok((writes, Outcome::Reply(LeaseReply { owner, now })))
}

/// The insert of `me`'s row of `semaphore` as `slot` says.
fn insert<'a>(
    sql: &'a PermitSql,
    semaphore: &'a str,
    me: &'a str,
    slot: &Slot,
    permits: u32,
) -> Write<'a> {
    (
        &sql.insert,
        vec![
            Arg::Text(semaphore),
            Arg::Text(me),
            Arg::Int(i64::from(permits)),
            Arg::Int(slot.ticket),
            Arg::Int(slot.acquired_at),
            Arg::Int(slot.ttl_at),
            Arg::Int(slot.transition_at),
            Arg::Int(slot.fence),
        ],
    )
}

/// The waiters of one semaphore in a store: (contender, sender).
pub(super) type Subscribers = Vec<(String, EventSender)>;
