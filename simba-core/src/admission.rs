//! The admission rule of a semaphore, written once: [`admit_permit`].
//!
//! Every store with semaphores decides an acquisition the same way; the in-memory store
//! and the SQL store call this function on the state they read, and the stores whose rule
//! runs where Rust cannot (a Redis script, a ZooKeeper recipe) are tested against it.

use crate::store::Lease;

/// How long a waiter keeps its place beyond the time it was told to look again and one
/// whole lease (milliseconds): a live waiter calls again by then, a dead one loses its
/// place.
pub const WAITER_GRACE_MS: i64 = 2000;

/// How long a waiter woken for the free permit it is owed has to take it (milliseconds,
/// [`PermitRequest::claim_ms`]) on a store that pushes wake-ups: a live waiter takes it
/// within a round trip or two (a permit's hand-over, release to the next holder's
/// acquire, measured 0.45–1.8 ms p50 and 3–5.4 ms p99 on Redis, ZooKeeper and PostgreSQL
/// with `simba bench --scenario semaphore`); a stopped one holds the permit up this long,
/// then the waiters behind it get it. A store whose waiters poll gives them their poll as
/// well. A live waiter slower than this is passed over once and keeps its place.
pub const PERMIT_CLAIM_MS: i64 = 25;

/// A holder of a permit, as the admission rule sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionHolder<'a> {
    /// The holder's contender id.
    pub contender_id: &'a str,
    /// The end of its lease (its `transition_at`, milliseconds on the store's clock): at
    /// and after it, the holder is dropped.
    pub transition_at: i64,
    /// Its fence.
    pub fence: u64,
}

/// A waiter in a semaphore's queue, as the admission rule sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionWaiter<'a> {
    /// The waiter's contender id.
    pub contender_id: &'a str,
    /// Until when it keeps its place without calling again (milliseconds on the store's
    /// clock): at and after it, the waiter is dropped.
    pub keep_until: i64,
    /// Until when it may take a permit it is owed (milliseconds on the store's clock), set
    /// the first time the store found it owed one ([`Admission::claims`]); at and after
    /// it, the waiter is *passed over*: it keeps its place, but the permits go to the
    /// waiters behind it until it calls again. `None`: not owed, or it called since.
    pub claim_by: Option<i64>,
}

/// A semaphore as a store read it, holders past their lease and stale waiters included
/// (the rule says which to drop).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SemaphoreState<'a> {
    /// The permit count on record: the one the holders agreed on while there are holders
    /// (ignored when none holds within its lease).
    pub permits: u32,
    /// The greatest fence any permit of the semaphore has had (`0`: none yet; the holders'
    /// fences count too).
    pub last_fence: u64,
    /// The holders, in the order they acquired.
    pub holders: &'a [AdmissionHolder<'a>],
    /// The waiters, first come first.
    pub waiters: &'a [AdmissionWaiter<'a>],
}

/// One acquisition to decide, and the store's own timing of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PermitRequest<'a> {
    /// Who asks.
    pub contender_id: &'a str,
    /// The permit count it asks with.
    pub permits: u32,
    /// The lease it asks for.
    pub lease: Lease,
    /// The store's clock when it read the state (milliseconds since the Unix epoch).
    pub now: i64,
    /// How soon a waiter whose free permit is owed to earlier waiters looks again
    /// (milliseconds): those were woken and should have taken theirs by then.
    pub turn_ms: i64,
    /// The longest a waiter goes before it looks again, for a store that cannot push to
    /// every waiter (SQL: the waiters of other processes poll); `None`: until the first
    /// lease ends.
    pub poll_ms: Option<i64>,
    /// The least fence the store hands out (a store whose fence counter may be lost floors
    /// it by its clock); `0` for none.
    pub fence_floor: u64,
    /// How long a waiter owed a free permit has to take it, from the first time the store
    /// finds it owed (milliseconds; [`AdmissionWaiter::claim_by`]): a woken live waiter
    /// calls well within it, a stopped one is passed over once it ends.
    pub claim_ms: i64,
}

/// What an acquisition does (see [`admit_permit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PermitDecision {
    /// The contender holds a permit within its lease: renew it (same fence, same
    /// `acquired_at`) with these times.
    Renew {
        /// Its index in [`SemaphoreState::holders`].
        holder: usize,
        /// Its index in [`SemaphoreState::waiters`], if it is also queued: it leaves the
        /// queue.
        queued: Option<usize>,
        /// The new `ttl_at`: `now + ttl`.
        ttl_at: i64,
        /// The new `transition_at`: `now + ttl + transition`.
        transition_at: i64,
    },
    /// The holders agreed on another count: refuse with
    /// [`Error::PermitsMismatch`](crate::Error::PermitsMismatch).
    Mismatch {
        /// The holders' count.
        existing: u32,
    },
    /// The contender becomes a holder, `acquired_at = now`; the semaphore's count on
    /// record becomes the asked one (it is already, when anyone holds).
    Take {
        /// Its fence: above [`SemaphoreState::last_fence`] and every holder's, and at
        /// least [`PermitRequest::fence_floor`].
        fence: u64,
        /// Its index in [`SemaphoreState::waiters`], if it was queued: it leaves the queue.
        queued: Option<usize>,
        /// Its `ttl_at`: `now + ttl`.
        ttl_at: i64,
        /// Its `transition_at`: `now + ttl + transition`.
        transition_at: i64,
    },
    /// The contender waits: it keeps its place (or joins the queue at its end) until
    /// `keep_until` with no claim deadline (it called: it is not passed over any more),
    /// and is told to look again at `look_at`
    /// ([`LeaseReply::look_again_at`](crate::backend::LeaseReply::look_again_at)).
    Wait {
        /// Its index in [`SemaphoreState::waiters`] if it was queued (its place is kept);
        /// `None`: it joins at the end.
        queued: Option<usize>,
        /// When to look again unless a push comes first.
        look_at: i64,
        /// Until when its place is kept without another call.
        keep_until: i64,
    },
}

/// The decision of [`admit_permit`] and what the store drops before applying it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    /// What the acquisition does.
    pub decision: PermitDecision,
    /// Indices in [`SemaphoreState::holders`] of the holders past their lease
    /// (`transition_at <= now`), ascending: the store drops them.
    pub expired_holders: Vec<usize>,
    /// Indices in [`SemaphoreState::waiters`] of the waiters past their kept time
    /// (`keep_until <= now`), ascending: the store drops them.
    pub stale_waiters: Vec<usize>,
    /// Waiters other than the contender that are owed a free permit and had no claim
    /// deadline: `(index in `[`SemaphoreState::waiters`]`, claim_by)`, ascending; the store
    /// records each `claim_by` (`now + claim_ms`).
    pub claims: Vec<(usize, i64)>,
}

/// Decides `request`'s acquisition of a permit of the semaphore read as `state` — the rule
/// of the [`PermitStore`](crate::backend::PermitStore) contract, with no I/O and no clock
/// of its own (everything is at `request.now`):
///
/// 1. Holders with `transition_at <= now` and waiters with `keep_until <= now` are dropped
///    ([`Admission::expired_holders`], [`Admission::stale_waiters`]); what follows looks at
///    the others only.
/// 2. A holder asking again renews ([`PermitDecision::Renew`]), whatever count it asks with.
/// 3. While anyone holds, a count other than theirs is refused
///    ([`PermitDecision::Mismatch`]); with no holder, the asked count becomes the count.
/// 4. A waiter whose `claim_by` has come (`claim_by <= now`) is *passed over*: it keeps its
///    place but does not count, unless it is the contender (it called, so it is not
///    stopped). With `free = permits - holders`, the first `free` waiters that count are
///    *owed* a permit; a contender whose place among the waiters that count (their number
///    for a newcomer) is below `free` takes one ([`PermitDecision::Take`]): a free permit
///    goes to the earliest waiters first, one each, so nobody jumps the queue. Its fence is
///    `max(last + 1, fence_floor)`, `last` the greatest of `last_fence` and the holders'
///    fences.
/// 5. Otherwise it waits ([`PermitDecision::Wait`]), keeping its place or joining at the
///    end. When permits are free but owed to earlier waiters it looks again when the first
///    of their claims ends, and after `turn_ms` at the latest; else when the first holder's
///    lease ends — no later than `poll_ms`, if set. Its place is kept until
///    `max(look_at, now) + ttl + transition + `[`WAITER_GRACE_MS`].
/// 6. Every other waiter owed a permit that has no claim deadline gets one, `now +
///    claim_ms` ([`Admission::claims`]): a stopped waiter holds a free permit up for
///    `claim_ms` at most, not for its whole kept place.
///
/// The rule never admits more than `permits` holders within their lease, and never makes
/// a waiter that calls wait behind someone who came later.
///
/// ```
/// use std::time::Duration;
/// use simba_core::backend::{
///     admit_permit, AdmissionHolder, AdmissionWaiter, Lease, PermitDecision, PermitRequest,
///     SemaphoreState,
/// };
///
/// let holders = [AdmissionHolder { contender_id: "a", transition_at: 5_000, fence: 7 }];
/// let waiters = [AdmissionWaiter { contender_id: "w", keep_until: 9_000, claim_by: None }];
/// let state = SemaphoreState { permits: 2, last_fence: 7, holders: &holders, waiters: &waiters };
/// let ask = |who, now| PermitRequest {
///     contender_id: who,
///     permits: 2,
///     lease: Lease { ttl: Duration::from_secs(1), transition: Duration::ZERO },
///     now,
///     turn_ms: 250,
///     poll_ms: None,
///     fence_floor: 0,
///     claim_ms: 50,
/// };
/// // One permit is free and owed to `w`: a newcomer waits behind it, and `w` has until
/// // 1,050 to take it.
/// let newcomer = admit_permit(&state, &ask("new", 1_000));
/// assert!(matches!(newcomer.decision, PermitDecision::Wait { queued: None, look_at: 1_050, .. }));
/// assert_eq!(newcomer.claims, [(0, 1_050)]);
/// let first = admit_permit(&state, &ask("w", 1_000)).decision;
/// assert!(matches!(first, PermitDecision::Take { fence: 8, queued: Some(0), .. }));
/// // `w` stopped and did not take it by then: it is passed over.
/// let waiters = [AdmissionWaiter { contender_id: "w", keep_until: 9_000, claim_by: Some(1_050) }];
/// let state = SemaphoreState { waiters: &waiters, ..state };
/// let newcomer = admit_permit(&state, &ask("new", 1_050)).decision;
/// assert!(matches!(newcomer, PermitDecision::Take { fence: 8, queued: None, .. }));
/// ```
pub fn admit_permit(state: &SemaphoreState<'_>, request: &PermitRequest<'_>) -> Admission {
    let now = request.now;
    let me = request.contender_id;
    let expired_holders: Vec<usize> = (0..state.holders.len())
        .filter(|&i| state.holders[i].transition_at <= now)
        .collect();
    let stale_waiters: Vec<usize> = (0..state.waiters.len())
        .filter(|&i| state.waiters[i].keep_until <= now)
        .collect();
    let holders: Vec<usize> = (0..state.holders.len())
        .filter(|&i| state.holders[i].transition_at > now)
        .collect();
    let live: Vec<usize> = (0..state.waiters.len())
        .filter(|&i| state.waiters[i].keep_until > now)
        .collect();
    let queued = live
        .iter()
        .copied()
        .find(|&i| state.waiters[i].contender_id == me);
    // The waiters that count, in order: the contender always does.
    let counting: Vec<usize> = live
        .iter()
        .copied()
        .filter(|&i| Some(i) == queued || counts(&state.waiters[i], now))
        .collect();
    let place = queued.map_or(counting.len(), |q| {
        counting.iter().take_while(|&&i| i != q).count()
    });
    let mine = holders
        .iter()
        .copied()
        .find(|&i| state.holders[i].contender_id == me);
    let agreed = mine.is_some() || holders.is_empty() || state.permits == request.permits;
    // The count in force: the holders' while anyone holds, else the asked one.
    let count = if holders.is_empty() {
        request.permits
    } else {
        state.permits
    };
    let free = free_permits(count, holders.len());
    // The others owed a permit (none is, when the counts disagree: nothing is decided).
    let owed: Vec<usize> = if agreed {
        counting
            .iter()
            .copied()
            .take(free)
            .filter(|&i| Some(i) != queued)
            .collect()
    } else {
        Vec::new()
    };
    let claims: Vec<(usize, i64)> = owed
        .iter()
        .filter(|&&i| state.waiters[i].claim_by.is_none())
        .map(|&i| (i, now.saturating_add(request.claim_ms)))
        .collect();
    let ttl_at = now.saturating_add(request.lease.ttl_ms());
    let transition_at = ttl_at.saturating_add(request.lease.transition_ms());
    let decision = 'decide: {
        if let Some(holder) = mine {
            break 'decide PermitDecision::Renew {
                holder,
                queued,
                ttl_at,
                transition_at,
            };
        }
        if !agreed {
            break 'decide PermitDecision::Mismatch {
                existing: state.permits,
            };
        }
        if place < free {
            break 'decide PermitDecision::Take {
                fence: state
                    .holders
                    .iter()
                    .map(|h| h.fence)
                    .fold(state.last_fence, u64::max)
                    .saturating_add(1)
                    .max(request.fence_floor),
                queued,
                ttl_at,
                transition_at,
            };
        }
        let mut look_at = if free > 0 {
            owed.iter()
                .map(|&i| {
                    state.waiters[i]
                        .claim_by
                        .unwrap_or_else(|| now.saturating_add(request.claim_ms))
                })
                .min()
                .map_or(now, |c| c.max(now))
                .min(now.saturating_add(request.turn_ms))
        } else {
            holders
                .iter()
                .map(|&i| state.holders[i].transition_at)
                .min()
                .unwrap_or(now)
        };
        if let Some(poll) = request.poll_ms {
            look_at = look_at.min(now.saturating_add(poll));
        }
        let keep_until = look_at
            .max(now)
            .saturating_add(request.lease.ttl_ms())
            .saturating_add(request.lease.transition_ms())
            .saturating_add(WAITER_GRACE_MS);
        PermitDecision::Wait {
            queued,
            look_at,
            keep_until,
        }
    };
    Admission {
        decision,
        expired_holders,
        stale_waiters,
        claims,
    }
}

/// The waiters a store wakes when permits may have come free (a release, a waiter that
/// left), indices in [`SemaphoreState::waiters`], first come first: each waiter owed a free
/// permit by [`admit_permit`] (passed-over waiters do not count), and the waiter that counts
/// after them — it looks again when their claims end, so that a stopped waiter among them
/// is passed over without waiting for another release.
///
/// Uses the holders, waiters and count of `state` at `now`, after the release.
///
/// ```
/// use simba_core::backend::{permit_wakes, AdmissionWaiter, SemaphoreState};
///
/// let w = |id, claim_by| AdmissionWaiter { contender_id: id, keep_until: 9_000, claim_by };
/// // One permit, free; `p` was owed it and did not take it by 1,050.
/// let waiters = [w("p", Some(1_050)), w("a", None), w("b", None), w("c", None)];
/// let state = SemaphoreState { permits: 1, last_fence: 7, holders: &[], waiters: &waiters };
/// assert_eq!(permit_wakes(&state, 1_000), [0, 1]);
/// assert_eq!(permit_wakes(&state, 1_050), [1, 2]);
/// ```
pub fn permit_wakes(state: &SemaphoreState<'_>, now: i64) -> Vec<usize> {
    let holders = state
        .holders
        .iter()
        .filter(|h| h.transition_at > now)
        .count();
    let free = free_permits(state.permits, holders);
    if free == 0 {
        return Vec::new();
    }
    (0..state.waiters.len())
        .filter(|&i| state.waiters[i].keep_until > now && counts(&state.waiters[i], now))
        .take(free.saturating_add(1))
        .collect()
}

/// Whether waiter `w` counts at `now`: it is not passed over (no claim, or one not ended).
fn counts(w: &AdmissionWaiter<'_>, now: i64) -> bool {
    w.claim_by.is_none_or(|c| c > now)
}

/// The permits of `count` that `holders` leave free.
fn free_permits(count: u32, holders: usize) -> usize {
    usize::try_from(count)
        .unwrap_or(usize::MAX)
        .saturating_sub(holders)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const LEASE: Lease = Lease {
        ttl: Duration::from_millis(1000),
        transition: Duration::from_millis(500),
    };

    fn ask(who: &str, permits: u32) -> PermitRequest<'_> {
        PermitRequest {
            contender_id: who,
            permits,
            lease: LEASE,
            now: 1000,
            turn_ms: 250,
            poll_ms: None,
            fence_floor: 0,
            claim_ms: 50,
        }
    }

    fn h(id: &str, until: i64) -> AdmissionHolder<'_> {
        AdmissionHolder {
            contender_id: id,
            transition_at: until,
            fence: 1,
        }
    }

    fn w(id: &str, until: i64) -> AdmissionWaiter<'_> {
        AdmissionWaiter {
            contender_id: id,
            keep_until: until,
            claim_by: None,
        }
    }

    #[test]
    fn a_holder_renews_and_leaves_the_queue() {
        let holders = [h("x", 900), h("a", 2000)];
        let waiters = [w("a", 5000)];
        let s = SemaphoreState {
            permits: 2,
            last_fence: 3,
            holders: &holders,
            waiters: &waiters,
        };
        // Whatever count it asks with: it holds.
        let d = admit_permit(&s, &ask("a", 9));
        assert_eq!(
            d.decision,
            PermitDecision::Renew {
                holder: 1,
                queued: Some(0),
                ttl_at: 2000,
                transition_at: 2500
            }
        );
        assert_eq!(d.expired_holders, [0]);
        assert!(d.stale_waiters.is_empty());
    }

    #[test]
    fn counts_must_agree_while_anyone_holds() {
        let holders = [h("a", 2000)];
        let s = SemaphoreState {
            permits: 2,
            last_fence: 3,
            holders: &holders,
            waiters: &[],
        };
        assert_eq!(
            admit_permit(&s, &ask("b", 3)).decision,
            PermitDecision::Mismatch { existing: 2 }
        );
        // Its holder past its lease: no holder, the count is the asker's.
        let gone = [h("a", 1000)];
        let s = SemaphoreState {
            holders: &gone,
            ..s
        };
        let d = admit_permit(&s, &ask("b", 3));
        assert!(
            matches!(d.decision, PermitDecision::Take { fence: 4, .. }),
            "{d:?}"
        );
        assert_eq!(d.expired_holders, [0]);
    }

    #[test]
    fn free_permits_go_to_the_earliest_waiters() {
        let holders = [h("a", 2000)];
        let waiters = [w("gone", 1000), w("w1", 9000), w("w2", 9000)];
        let s = SemaphoreState {
            permits: 2,
            last_fence: 10,
            holders: &holders,
            waiters: &waiters,
        };
        let d = admit_permit(&s, &ask("w1", 2));
        assert!(matches!(
            d.decision,
            PermitDecision::Take {
                fence: 11,
                queued: Some(1),
                ..
            }
        ));
        assert_eq!(d.stale_waiters, [0]);
        assert!(d.claims.is_empty(), "{d:?}");
        // One free permit, owed to w1: w2 and a newcomer wait and look again when w1's
        // claim ends; w1 gets its claim deadline.
        for (who, queued) in [("w2", Some(2)), ("new", None)] {
            let d = admit_permit(&s, &ask(who, 2));
            assert_eq!(
                d.decision,
                PermitDecision::Wait {
                    queued,
                    look_at: 1050,
                    keep_until: 1050 + 1500 + WAITER_GRACE_MS
                },
                "{who}"
            );
            assert_eq!(d.claims, [(1, 1050)], "{who}");
        }
        // A holder's renewal starts w1's claim too.
        assert_eq!(admit_permit(&s, &ask("a", 2)).claims, [(1, 1050)]);
        // A claim already running is not started again; the waiter behind looks at its end,
        // or after turn_ms at the latest.
        let waiters = [w("w1", 9000), w("w2", 9000)];
        let ticking = [
            AdmissionWaiter {
                claim_by: Some(1020),
                ..waiters[0]
            },
            waiters[1],
        ];
        let s = SemaphoreState {
            waiters: &ticking,
            ..s
        };
        let d = admit_permit(&s, &ask("w2", 2));
        assert!(d.claims.is_empty(), "{d:?}");
        assert!(matches!(
            d.decision,
            PermitDecision::Wait { look_at: 1020, .. }
        ));
        let slow = PermitRequest {
            claim_ms: 5000,
            ..ask("w2", 2)
        };
        let s = SemaphoreState {
            waiters: &waiters,
            ..s
        };
        assert!(matches!(
            admit_permit(&s, &slow).decision,
            PermitDecision::Wait { look_at: 1250, .. }
        ));
    }

    #[test]
    fn a_waiter_that_does_not_claim_in_time_is_passed_over_until_it_calls() {
        let waiters = [
            AdmissionWaiter {
                claim_by: Some(1000),
                ..w("p", 9000)
            },
            w("a", 9000),
            w("b", 9000),
        ];
        let s = SemaphoreState {
            permits: 1,
            last_fence: 4,
            holders: &[],
            waiters: &waiters,
        };
        // `p`'s claim ended at 1000: `a` is first of those that count and takes; `b`
        // still waits behind `a`, and `a` is not given a claim (it is the taker).
        let d = admit_permit(&s, &ask("a", 1));
        assert!(
            matches!(
                d.decision,
                PermitDecision::Take {
                    fence: 5,
                    queued: Some(1),
                    ..
                }
            ),
            "{d:?}"
        );
        assert!(d.claims.is_empty() && d.stale_waiters.is_empty(), "{d:?}");
        let d = admit_permit(&s, &ask("b", 1));
        assert!(matches!(
            d.decision,
            PermitDecision::Wait {
                queued: Some(2),
                ..
            }
        ));
        assert_eq!(d.claims, [(1, 1050)]);
        // `p` keeps its place: when it calls, it is first again.
        let d = admit_permit(&s, &ask("p", 1));
        assert!(matches!(
            d.decision,
            PermitDecision::Take {
                queued: Some(0),
                ..
            }
        ));
        assert!(d.claims.is_empty(), "{d:?}");
        // Before its claim ends, nobody gets ahead of it.
        let early = PermitRequest {
            now: 999,
            ..ask("a", 1)
        };
        assert!(matches!(
            admit_permit(&s, &early).decision,
            PermitDecision::Wait {
                queued: Some(1),
                look_at: 1000,
                ..
            }
        ));
    }

    #[test]
    fn a_mismatch_starts_no_claim() {
        let holders = [h("x", 5000)];
        let waiters = [w("w", 9000)];
        let s = SemaphoreState {
            permits: 2,
            last_fence: 4,
            holders: &holders,
            waiters: &waiters,
        };
        let d = admit_permit(&s, &ask("m", 3));
        assert_eq!(d.decision, PermitDecision::Mismatch { existing: 2 });
        assert!(d.claims.is_empty());
    }

    #[test]
    fn a_release_wakes_the_owed_and_the_next() {
        let holders = [h("x", 5000), h("gone", 900)];
        let waiters = [
            w("stale", 900),
            AdmissionWaiter {
                claim_by: Some(950),
                ..w("p", 9000)
            },
            w("a", 9000),
            w("b", 9000),
            w("c", 9000),
        ];
        let s = SemaphoreState {
            permits: 3,
            last_fence: 4,
            holders: &holders,
            waiters: &waiters,
        };
        // Two free (gone's lease ended): a, b owed; c looks when their claims end.
        assert_eq!(permit_wakes(&s, 1000), [2, 3, 4]);
        let full = SemaphoreState {
            permits: 2,
            holders: &[h("x", 5000), h("y", 5000)],
            ..s
        };
        assert!(permit_wakes(&full, 1000).is_empty());
    }

    #[test]
    fn full_waits_for_the_first_lease_end_or_the_poll() {
        let holders = [h("a", 3000), h("b", 2000)];
        let s = SemaphoreState {
            permits: 2,
            last_fence: 10,
            holders: &holders,
            waiters: &[],
        };
        let d = admit_permit(&s, &ask("c", 2));
        assert!(matches!(
            d.decision,
            PermitDecision::Wait { look_at: 2000, .. }
        ));
        let polled = PermitRequest {
            poll_ms: Some(250),
            ..ask("c", 2)
        };
        assert!(matches!(
            admit_permit(&s, &polled).decision,
            PermitDecision::Wait { look_at: 1250, .. }
        ));
    }

    #[test]
    fn fences_are_floored() {
        let s = SemaphoreState {
            permits: 1,
            last_fence: 5,
            holders: &[],
            waiters: &[],
        };
        let floored = PermitRequest {
            fence_floor: 1000,
            ..ask("c", 1)
        };
        assert!(matches!(
            admit_permit(&s, &floored).decision,
            PermitDecision::Take { fence: 1000, .. }
        ));
    }
}
