//! An acquisition's transaction: lock the semaphore's row, read, decide, write.

use super::*;

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

/// One acquisition: a transaction on `c` (rolled back on any failure).
pub(super) async fn acquire_tx<C: SqlConn>(
    c: &mut C,
    sql: &PermitSql,
    semaphore: &str,
    me: &str,
    permits: u32,
    lease: Lease,
    claim_ms: i64,
) -> QueryResult<Outcome> {
    c.batch(sql.begin).await?;
    let done = acquire_in_tx(c, sql, semaphore, me, permits, lease, claim_ms).await;
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

pub(super) async fn acquire_in_tx<C: SqlConn>(
    c: &mut C,
    sql: &PermitSql,
    semaphore: &str,
    me: &str,
    permits: u32,
    lease: Lease,
    claim_ms: i64,
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
    let admission = decide(&view, me, permits, lease, claim_ms)
        .map_err(|e| diesel::result::Error::DeserializationError(Box::new(e)))?;
    for &(i, claim_by) in &admission.claims {
        // Only waiters within their kept time are owed: their index is the view's.
        let waiter = view
            .waiters
            .get(i)
            .ok_or_else(|| misread(format!("owed waiter {i} of {}", view.waiters.len())))?;
        c.exec(
            &sql.set_claim,
            &[
                Arg::Int(claim_by),
                Arg::Text(semaphore),
                Arg::Text(&waiter.contender),
            ],
        )
        .await?;
    }
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
                // Its place kept, its claim (if any) cleared: it called.
                c.exec(
                    &sql.keep_place,
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

pub(super) async fn insert<C: SqlConn>(
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
pub(super) type Subscribers = Vec<(String, EventSender)>;
