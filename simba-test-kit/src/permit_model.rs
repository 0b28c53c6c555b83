//! A model of one semaphore that decides by simba-core's admission rule
//! ([`admit_permit`]), and a differential test that runs a seeded random sequence of
//! acquisitions, releases and leaves on a [`PermitStore`] and on the model side by side
//! ([`differential`]).
//!
//! The stores whose admission runs where Rust cannot (a Redis script, a ZooKeeper recipe)
//! are tested against the rule this way; the stores that call the rule are tested too, for
//! what they do around it.

use std::fmt;

use simba_core::Error;
use simba_core::backend::{
    AdmissionHolder, AdmissionWaiter, Lease, PermitDecision, PermitRequest, PermitStore,
    SemaphoreState, admit_permit,
};

use crate::suite::CaseError;

/// What an acquisition came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A new permit.
    Took,
    /// The permit it held, renewed.
    Renewed,
    /// It waits in the queue.
    Waits,
    /// The holders agreed on this other count.
    Mismatch(u32),
}

#[derive(Debug, Clone)]
struct Holder {
    id: String,
    transition_at: i64,
    fence: u64,
}

/// One semaphore, kept by the rule of [`admit_permit`] at the times it is given.
///
/// Waiters are assumed to hear every wake-up (a store may drop a waiter that no push
/// reaches; the differential test subscribes every contender).
#[derive(Debug, Clone)]
pub struct PermitModel {
    permits: u32,
    last_fence: u64,
    holders: Vec<Holder>,
    /// Id, kept until, claim by.
    waiters: Vec<(String, i64, Option<i64>)>,
    claim_ms: i64,
}

impl Default for PermitModel {
    fn default() -> Self {
        PermitModel::new()
    }
}

/// How soon the model's waiters look again when permits are owed to others; the
/// differential test does not compare it.
const TURN_MS: i64 = 250;

impl PermitModel {
    /// An empty semaphore whose waiters are never passed over (a store without
    /// [`PermitStore::permit_claim`]).
    pub fn new() -> Self {
        PermitModel {
            permits: 0,
            last_fence: 0,
            holders: Vec::new(),
            waiters: Vec::new(),
            claim_ms: i64::MAX,
        }
    }

    /// An empty semaphore of a store that passes over a waiter owed a permit once `claim`
    /// has passed since it was found owed ([`PermitStore::permit_claim`]; `None`: never).
    pub fn with_claim(claim: Option<std::time::Duration>) -> Self {
        PermitModel {
            claim_ms: claim.map_or(i64::MAX, |c| {
                i64::try_from(c.as_millis()).unwrap_or(i64::MAX)
            }),
            ..PermitModel::new()
        }
    }

    /// `who`'s acquisition of a permit of a semaphore of `permits`, at `now`.
    pub fn acquire(&mut self, who: &str, permits: u32, lease: Lease, now: i64) -> Outcome {
        let holders: Vec<AdmissionHolder<'_>> = self
            .holders
            .iter()
            .map(|h| AdmissionHolder {
                contender_id: &h.id,
                transition_at: h.transition_at,
                fence: h.fence,
            })
            .collect();
        let waiters: Vec<AdmissionWaiter<'_>> = self
            .waiters
            .iter()
            .map(|(id, until, claim_by)| AdmissionWaiter {
                contender_id: id,
                keep_until: *until,
                claim_by: *claim_by,
            })
            .collect();
        let state = SemaphoreState {
            permits: self.permits,
            last_fence: self.last_fence,
            holders: &holders,
            waiters: &waiters,
        };
        let admission = admit_permit(
            &state,
            &PermitRequest {
                contender_id: who,
                permits,
                lease,
                now,
                turn_ms: TURN_MS,
                poll_ms: None,
                fence_floor: 0,
                claim_ms: self.claim_ms,
            },
        );
        for &(i, claim_by) in &admission.claims {
            self.waiters[i].2 = Some(claim_by);
        }
        let mut gone_waiters = admission.stale_waiters;
        let outcome = match admission.decision {
            PermitDecision::Mismatch { existing } => return Outcome::Mismatch(existing),
            PermitDecision::Renew {
                holder,
                queued,
                transition_at,
                ..
            } => {
                self.holders[holder].transition_at = transition_at;
                gone_waiters.extend(queued);
                Outcome::Renewed
            }
            PermitDecision::Take {
                fence,
                queued,
                transition_at,
                ..
            } => {
                gone_waiters.extend(queued);
                self.last_fence = fence;
                self.permits = permits;
                self.holders.push(Holder {
                    id: who.to_owned(),
                    transition_at,
                    fence,
                });
                Outcome::Took
            }
            PermitDecision::Wait {
                queued, keep_until, ..
            } => {
                match queued {
                    Some(i) => {
                        self.waiters[i].1 = keep_until;
                        self.waiters[i].2 = None;
                    }
                    None => self.waiters.push((who.to_owned(), keep_until, None)),
                }
                Outcome::Waits
            }
        };
        gone_waiters.sort_unstable();
        remove_at(&mut self.holders, &admission.expired_holders);
        remove_at(&mut self.waiters, &gone_waiters);
        outcome
    }

    /// `who`'s release: frees its permit if it holds one, and takes it out of the queue;
    /// whether it held one.
    pub fn release(&mut self, who: &str) -> bool {
        let held = self.holders.len();
        self.holders.retain(|h| h.id != who);
        self.waiters.retain(|(id, _, _)| id != who);
        self.holders.len() < held
    }

    /// `who` leaves the queue (a permit it holds stays held).
    pub fn leave(&mut self, who: &str) {
        self.waiters.retain(|(id, _, _)| id != who);
    }

    /// The holders' ids, sorted.
    pub fn holders(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.holders.iter().map(|h| h.id.clone()).collect();
        ids.sort_unstable();
        ids
    }

    /// The waiters' ids, first come first.
    pub fn waiters(&self) -> Vec<String> {
        self.waiters.iter().map(|(id, _, _)| id.clone()).collect()
    }
}

fn remove_at<T>(items: &mut Vec<T>, at: &[usize]) {
    let mut i = 0;
    items.retain(|_| {
        let keep = at.binary_search(&i).is_err();
        i += 1;
        keep
    });
}

/// splitmix64: a small seeded generator, so that a failing sequence can be run again.
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    /// The generator of `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number below `n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// One step of a differential run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// `permit_acquire` by this contender.
    Acquire(String),
    /// `permit_release` by this contender.
    Release(String),
    /// `permit_leave` by this contender.
    Leave(String),
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Acquire(c) => write!(f, "acquire {c}"),
            Step::Release(c) => write!(f, "release {c}"),
            Step::Leave(c) => write!(f, "leave {c}"),
        }
    }
}

/// The steps of the run of `seed`: `steps` random acquisitions (about three in five),
/// releases and leaves by `contenders` contenders `c0`, `c1`, …
pub fn steps(seed: u64, steps: usize, contenders: usize) -> Vec<Step> {
    let mut rng = SplitMix::new(seed);
    (0..steps)
        .map(|_| {
            let who = format!("c{}", rng.below(contenders as u64));
            match rng.below(10) {
                0..=5 => Step::Acquire(who),
                6..=8 => Step::Release(who),
                _ => Step::Leave(who),
            }
        })
        .collect()
}

/// A differential run's shape.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    /// The seed of the steps.
    pub seed: u64,
    /// How many steps.
    pub steps: usize,
    /// How many contenders.
    pub contenders: usize,
    /// The permit count every acquisition asks with (fixed: no mismatch).
    pub permits: u32,
    /// The lease every acquisition asks for: long enough that nothing expires during the
    /// run, on the store or in the model (whose clock is the store's, read from its replies), so
    /// that the run compares the admission rule and not timing.
    pub lease: Lease,
}

/// Runs [`steps`] of `run.seed` on `store`'s semaphore `semaphore` (new, unused) and on a
/// [`PermitModel`], and fails at the first difference: after an acquisition, the same
/// outcome (took / renewed / waits); after a release, the same answer; after every step, the
/// same holders ([`PermitStore::permit_owners`] against the model's). Every new permit's
/// fence is greater than every fence before it, and a renewal keeps its fence.
///
/// Every contender subscribes first (as the engine does for a waiter), so that a store
/// that drops a waiter no push reaches keeps them all. The error names the seed, the step
/// and the steps so far.
///
/// # Errors
/// A [`CaseError`] describing the first difference, or a store error.
pub async fn differential<S: PermitStore>(
    store: &S,
    semaphore: &str,
    run: Run,
) -> Result<(), CaseError> {
    let steps = steps(run.seed, run.steps, run.contenders);
    let fail = |i: usize, what: String| {
        let done: Vec<String> = steps[..=i].iter().map(ToString::to_string).collect();
        CaseError(format!(
            "differential run of seed {} ({} permits), step {i} ({}): {what}; steps: [{}]",
            run.seed,
            run.permits,
            steps[i],
            done.join(", ")
        ))
    };
    let mut receivers = Vec::new();
    for c in 0..run.contenders {
        let id = format!("c{c}");
        receivers.push(
            store
                .permit_subscribe(semaphore, &id)
                .await
                .map_err(|e| CaseError(format!("seed {}: subscribing {id}: {e}", run.seed)))?,
        );
    }
    let mut model = PermitModel::with_claim(store.permit_claim());
    // The model's clock is the store's, from its replies: a store that passes over a
    // waiter whose claim ended does so at the same times as the model.
    let mut now = 0;
    let mut fences: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    let mut last_fence = 0u64;
    for (i, step) in steps.iter().enumerate() {
        match step {
            Step::Acquire(who) => {
                let answer = store
                    .permit_acquire(semaphore, who, run.permits, run.lease)
                    .await;
                if let Ok(reply) = &answer {
                    now = reply.now;
                }
                let expected = model.acquire(who, run.permits, run.lease, now);
                let got = match answer {
                    Ok(reply) if reply.owner.owner_id == *who => {
                        let fence = reply.owner.fence;
                        match fences.get(who) {
                            Some(&held) => {
                                if fence != held {
                                    return Err(fail(
                                        i,
                                        format!("a renewal changed the fence {held} to {fence}"),
                                    ));
                                }
                                Outcome::Renewed
                            }
                            None => {
                                if fence <= last_fence {
                                    return Err(fail(
                                        i,
                                        format!(
                                            "a new permit's fence {fence} is not above the \
                                             last one, {last_fence}"
                                        ),
                                    ));
                                }
                                last_fence = fence;
                                fences.insert(who.clone(), fence);
                                Outcome::Took
                            }
                        }
                    }
                    Ok(reply) if reply.owner.owner_id.is_empty() => Outcome::Waits,
                    Ok(reply) => {
                        return Err(fail(
                            i,
                            format!("the reply names another holder: {:?}", reply.owner),
                        ));
                    }
                    Err(Error::PermitsMismatch { existing, .. }) => Outcome::Mismatch(existing),
                    Err(e) => return Err(fail(i, format!("the store failed: {e}"))),
                };
                if got != expected {
                    return Err(fail(
                        i,
                        format!(
                            "the store says {got:?}, the rule {expected:?} (the model after \
                             it: holders {:?}, waiters {:?})",
                            model.holders(),
                            model.waiters()
                        ),
                    ));
                }
            }
            Step::Release(who) => {
                let expected = model.release(who);
                let got = store
                    .permit_release(semaphore, who)
                    .await
                    .map_err(|e| fail(i, format!("the store failed: {e}")))?;
                if got != expected {
                    return Err(fail(
                        i,
                        format!("the store's release says {got}, the rule's {expected}"),
                    ));
                }
                fences.remove(who);
            }
            Step::Leave(who) => {
                model.leave(who);
                store
                    .permit_leave(semaphore, who)
                    .await
                    .map_err(|e| fail(i, format!("the store failed: {e}")))?;
            }
        }
        for rx in receivers.iter_mut().flatten() {
            // Wake-ups are not compared: they only make waiters call again sooner.
            while rx.try_recv().is_ok() {}
        }
        let read = store
            .permit_owners(semaphore)
            .await
            .map_err(|e| fail(i, format!("reading the holders failed: {e}")))?;
        let mut holders: Vec<String> = read.holders.iter().map(|h| h.owner_id.clone()).collect();
        holders.sort_unstable();
        let expected = model.holders();
        if holders != expected {
            return Err(fail(
                i,
                format!(
                    "the store's holders are {holders:?}, the rule's {expected:?} (model \
                     waiters {:?})",
                    model.waiters()
                ),
            ));
        }
        let count = (!expected.is_empty()).then_some(run.permits);
        if read.permits != count {
            return Err(fail(
                i,
                format!(
                    "the store's count is {:?}, expected {count:?}",
                    read.permits
                ),
            ));
        }
    }
    // Leave nothing behind for the store's next user.
    for c in 0..run.contenders {
        let id = format!("c{c}");
        store
            .permit_release(semaphore, &id)
            .await
            .map_err(|e| CaseError(format!("seed {}: cleaning up {id}: {e}", run.seed)))?;
    }
    Ok(())
}

/// A store whose acquisitions each start `pace` late, for a [`differential`] run in which
/// claims ([`PermitStore::permit_claim`]) end between steps: with a pace of a quarter of
/// the claim, a waiter owed a permit that is not among the next few callers is passed over.
#[derive(Debug, Clone)]
pub struct Paced<S> {
    /// The store.
    pub store: S,
    /// How late each acquisition starts.
    pub pace: std::time::Duration,
}

impl<S: PermitStore> PermitStore for Paced<S> {
    fn backend(&self) -> &'static str {
        self.store.backend()
    }
    fn permit_claim(&self) -> Option<std::time::Duration> {
        self.store.permit_claim()
    }
    async fn permit_acquire(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> simba_core::Result<simba_core::backend::LeaseReply> {
        // Time is the subject: the pace makes claims end between steps.
        tokio::time::sleep(self.pace).await;
        self.store
            .permit_acquire(semaphore, contender_id, permits, lease)
            .await
    }
    async fn permit_release(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> simba_core::Result<bool> {
        self.store.permit_release(semaphore, contender_id).await
    }
    async fn permit_owners(
        &self,
        semaphore: &str,
    ) -> simba_core::Result<simba_core::backend::PermitHolders> {
        self.store.permit_owners(semaphore).await
    }
    async fn permit_subscribe(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> simba_core::Result<Option<simba_core::events::EventReceiver>> {
        self.store.permit_subscribe(semaphore, contender_id).await
    }
    async fn permit_leave(&self, semaphore: &str, contender_id: &str) -> simba_core::Result<()> {
        self.store.permit_leave(semaphore, contender_id).await
    }
    fn check_semaphore_name(&self, semaphore: &str) -> simba_core::Result<()> {
        self.store.check_semaphore_name(semaphore)
    }
    fn check_contender_id(&self, contender_id: &str) -> simba_core::Result<()> {
        self.store.check_contender_id(contender_id)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const LEASE: Lease = Lease {
        ttl: Duration::from_secs(3600),
        transition: Duration::ZERO,
    };

    #[test]
    fn the_model_keeps_the_queue_first_come_first_served() {
        let mut m = PermitModel::new();
        assert_eq!(m.acquire("a", 1, LEASE, 0), Outcome::Took);
        assert_eq!(m.acquire("b", 1, LEASE, 1), Outcome::Waits);
        assert_eq!(m.acquire("c", 1, LEASE, 2), Outcome::Waits);
        assert_eq!(m.acquire("a", 1, LEASE, 3), Outcome::Renewed);
        assert_eq!(m.acquire("a", 2, LEASE, 3), Outcome::Renewed);
        assert_eq!(m.acquire("d", 2, LEASE, 3), Outcome::Mismatch(1));
        assert!(m.release("a"));
        assert!(!m.release("a"));
        assert_eq!(m.acquire("c", 1, LEASE, 4), Outcome::Waits);
        assert_eq!(m.acquire("b", 1, LEASE, 5), Outcome::Took);
        m.leave("c");
        assert_eq!(m.waiters(), Vec::<String>::new());
        assert_eq!(m.holders(), ["b"]);
    }

    #[test]
    fn steps_are_the_seed_s() {
        assert_eq!(steps(7, 30, 4), steps(7, 30, 4));
        assert_ne!(steps(7, 30, 4), steps(8, 30, 4));
    }
}
