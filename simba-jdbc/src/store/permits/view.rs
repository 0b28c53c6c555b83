//! A semaphore's rows as the admission rule sees them, and its decision.

use super::*;

/// One row of a semaphore as the decision sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Slot {
    pub(super) contender: String,
    pub(super) ticket: i64,
    /// A holder's `acquired_at`; a waiter's claim deadline (`0`: none, see
    /// [`Slot::claim_by`]).
    pub(super) acquired_at: i64,
    pub(super) ttl_at: i64,
    pub(super) transition_at: i64,
    pub(super) fence: i64,
}

impl Slot {
    /// A waiter's claim deadline ([`AdmissionWaiter::claim_by`]), kept in its row's
    /// `acquired_at` (a waiter acquired nothing): `0` is none.
    pub(super) fn claim_by(&self) -> Option<i64> {
        (self.acquired_at > 0).then_some(self.acquired_at)
    }

    pub(super) fn owner(&self) -> Result<MutexOwner> {
        Ok(MutexOwner {
            owner_id: self.contender.clone(),
            acquired_at: self.acquired_at,
            ttl_at: self.ttl_at,
            transition_at: self.transition_at,
            fence: u64::try_from(self.fence).map_err(|_| bad(format!("fence {}", self.fence)))?,
        })
    }
}

pub(super) fn bad(what: String) -> Error {
    Error::backend(
        "sql",
        format!("the permits table holds a value simba never writes: {what}"),
    )
}

/// The semaphore's row: the agreed count, the last ticket and the last fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Header {
    pub(super) permits: u32,
    pub(super) ticket: i64,
    pub(super) fence: i64,
}

/// Every row of one semaphore at the database's time `now`.
#[derive(Debug, Clone, Default)]
pub(super) struct View {
    pub(super) now: i64,
    pub(super) header: Option<Header>,
    /// Within their lease, in the order they acquired.
    pub(super) holders: Vec<Slot>,
    /// Within their kept time, by ticket.
    pub(super) waiters: Vec<Slot>,
    /// Rows whose time has passed (to drop).
    pub(super) expired: Vec<Slot>,
}

impl View {
    pub(super) fn new(rows: Vec<PermitRow>) -> Result<View> {
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

    /// The waiters to wake now ([`permit_wakes`]): those owed a free permit (passed-over
    /// ones not counted), and the next one.
    pub(super) fn wakes(&self) -> Vec<&str> {
        let Some(header) = self.header else {
            return Vec::new();
        };
        let holders: Vec<AdmissionHolder<'_>> = self
            .holders
            .iter()
            .map(|h| AdmissionHolder {
                contender_id: &h.contender,
                transition_at: h.transition_at,
                fence: 0,
            })
            .collect();
        let waiters: Vec<AdmissionWaiter<'_>> = self.waiters.iter().map(Slot::waiter).collect();
        let state = SemaphoreState {
            permits: header.permits,
            last_fence: 0,
            holders: &holders,
            waiters: &waiters,
        };
        permit_wakes(&state, self.now)
            .into_iter()
            .filter_map(|i| self.waiters.get(i).map(|w| w.contender.as_str()))
            .collect()
    }
}

impl Slot {
    fn waiter(&self) -> AdmissionWaiter<'_> {
        AdmissionWaiter {
            contender_id: &self.contender,
            keep_until: self.transition_at,
            claim_by: self.claim_by(),
        }
    }
}

pub(super) fn fence_of(slot: &Slot) -> Result<u64> {
    u64::try_from(slot.fence).map_err(|_| bad(format!("fence {}", slot.fence)))
}

/// The decision of `contender`'s acquisition of a semaphore of `permits` by the core rule
/// ([`admit_permit`]; see the [`PermitStore`](simba_core::backend::PermitStore) contract),
/// at the view's time. Its holder and waiter indices below the view's `holders` and
/// `waiters` lengths are theirs (the rows past their time come after them).
pub(super) fn decide(
    view: &View,
    contender: &str,
    permits: u32,
    lease: Lease,
    claim_ms: i64,
) -> Result<Admission> {
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
        .map(Slot::waiter)
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
        claim_ms,
        // Floored by the clock, so that a semaphore whose row was deleted never repeats a
        // fence.
        fence_floor: u64::try_from(view.now).unwrap_or(0),
    };
    Ok(admit_permit(&state, &request))
}

/// A decision that does not fit the rows it was made from, as the transaction's failure.
pub(super) fn misread(what: String) -> diesel::result::Error {
    diesel::result::Error::DeserializationError(Box::new(Error::backend(
        "sql",
        format!("the permit decision does not fit the rows read: {what}"),
    )))
}
