//! An in-memory [`LeaseStore`] and [`PermitStore`]: for unit tests and for coordinating
//! tasks of one process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use crate::admission::{
    AdmissionHolder, AdmissionWaiter, PERMIT_CLAIM_MS, PermitDecision, PermitRequest,
    SemaphoreState, admit_permit, permit_wakes,
};
use crate::error::Error;
use crate::error::Result;
use crate::events::{self, EventReceiver, EventSender, TrySendError};
use crate::owner::{MutexOwner, held_owner_id};
use crate::permit_store::{PermitHolders, PermitStore};
use crate::store::{Lease, LeaseReply, LeaseStore, StoreEvent, hold_millis};

#[derive(Default)]
struct Entry {
    owner: MutexOwner,
    fence: u64,
    subscribers: Vec<(String, EventSender)>,
}

/// One semaphore: its holders (each a mutex owner of its own), the count they agreed on,
/// the last fence, and the wait queue (contender id, when it is dropped unless it calls
/// again), first come first served.
#[derive(Default)]
struct Permits {
    permits: u32,
    holders: Vec<MutexOwner>,
    fence: u64,
    /// Waiters, first come first: id, kept until, claim by.
    queue: Vec<(String, i64, Option<i64>)>,
    subscribers: Vec<(String, EventSender)>,
}

/// How soon a waiter that is not yet first in line for a free permit looks again (the
/// waiters ahead of it were woken and should take theirs by then).
pub(crate) const PERMIT_TURN_MS: i64 = 250;

/// Keeps the items of `items` whose index is not in `drop` (ascending).
fn drop_indices<T>(items: &mut Vec<T>, drop: &[usize]) {
    let mut i = 0;
    items.retain(|_| {
        let keep = drop.binary_search(&i).is_err();
        i += 1;
        keep
    });
}

impl Permits {
    /// Decides and applies `contender_id`'s acquisition by the core rule
    /// ([`admit_permit`]).
    fn acquire(
        &mut self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
        now: i64,
    ) -> Result<LeaseReply> {
        let (holders, waiters) = (self.admission_holders(), self.admission_waiters());
        let state = self.state(&holders, &waiters);
        let request = PermitRequest {
            contender_id,
            permits,
            lease,
            now,
            turn_ms: PERMIT_TURN_MS,
            poll_ms: None,
            fence_floor: 0,
            claim_ms: PERMIT_CLAIM_MS,
        };
        let admission = admit_permit(&state, &request);
        let mut stale = admission.stale_waiters;
        let reply = match admission.decision {
            PermitDecision::Mismatch { existing } => {
                return Err(Error::PermitsMismatch {
                    semaphore: semaphore.to_owned(),
                    asked: permits,
                    existing,
                });
            }
            PermitDecision::Renew {
                holder,
                queued,
                ttl_at,
                transition_at,
            } => {
                let h = &mut self.holders[holder];
                h.ttl_at = ttl_at;
                h.transition_at = transition_at;
                stale.extend(queued);
                LeaseReply {
                    owner: h.clone(),
                    now,
                }
            }
            PermitDecision::Take {
                fence,
                queued,
                ttl_at,
                transition_at,
            } => {
                stale.extend(queued);
                self.fence = fence;
                self.permits = permits;
                let owner = MutexOwner {
                    owner_id: contender_id.to_owned(),
                    acquired_at: now,
                    ttl_at,
                    transition_at,
                    fence,
                };
                self.holders.push(owner.clone());
                LeaseReply { owner, now }
            }
            PermitDecision::Wait {
                queued,
                look_at,
                keep_until,
            } => {
                match queued {
                    Some(i) => {
                        self.queue[i].1 = keep_until;
                        self.queue[i].2 = None;
                    }
                    None => self.queue.push((contender_id.to_owned(), keep_until, None)),
                }
                LeaseReply::look_again_at(look_at, now)
            }
        };
        // The indices are the state's, read before the new holder or waiter was added at
        // the end.
        for (i, claim_by) in admission.claims {
            self.queue[i].2 = Some(claim_by);
        }
        stale.sort_unstable();
        drop_indices(&mut self.holders, &admission.expired_holders);
        drop_indices(&mut self.queue, &stale);
        Ok(reply)
    }

    fn prune(&mut self, now: i64) {
        self.holders.retain(|h| h.is_in_lease(now));
        self.queue.retain(|(_, until, _)| *until > now);
    }

    /// Wakes the waiters [`permit_wakes`] names: those owed a free permit and the next
    /// one. A waiter that cannot hear it (its receiver is gone) leaves the queue, and the
    /// list is made again without it.
    fn wake(&mut self, now: i64) {
        self.subscribers.retain(|(_, tx)| !tx.is_closed());
        loop {
            let (holders, waiters) = (self.admission_holders(), self.admission_waiters());
            let state = self.state(&holders, &waiters);
            let mut deaf = None;
            for i in permit_wakes(&state, now) {
                let id = &self.queue[i].0;
                let mut heard = false;
                for (_, tx) in self.subscribers.iter().filter(|(who, _)| who == id) {
                    // A full channel already holds an event that makes the waiter look
                    // again.
                    heard |= !matches!(
                        tx.try_send(StoreEvent::Released),
                        Err(TrySendError::Closed(_))
                    );
                }
                if !heard {
                    deaf = Some(i);
                    break;
                }
            }
            match deaf {
                Some(i) => {
                    self.queue.remove(i);
                }
                None => return,
            }
        }
    }

    /// The semaphore as the admission rule sees it, over these holders and waiters.
    fn state<'a>(
        &self,
        holders: &'a [AdmissionHolder<'a>],
        waiters: &'a [AdmissionWaiter<'a>],
    ) -> SemaphoreState<'a> {
        SemaphoreState {
            permits: self.permits,
            last_fence: self.fence,
            holders,
            waiters,
        }
    }

    fn admission_holders(&self) -> Vec<AdmissionHolder<'_>> {
        self.holders
            .iter()
            .map(|h| AdmissionHolder {
                contender_id: &h.owner_id,
                transition_at: h.transition_at,
                fence: h.fence,
            })
            .collect()
    }

    fn admission_waiters(&self) -> Vec<AdmissionWaiter<'_>> {
        self.queue
            .iter()
            .map(|(id, until, claim_by)| AdmissionWaiter {
                contender_id: id,
                keep_until: *until,
                claim_by: *claim_by,
            })
            .collect()
    }

    /// Takes `contender_id` out of the queue and, if `release`, out of the holders;
    /// returns whether it held a permit (now freed). Wakes the waiters owed a permit.
    fn remove(&mut self, contender_id: &str, release: bool, now: i64) -> bool {
        let held = self.holders.len();
        if release {
            self.holders.retain(|h| h.owner_id != contender_id);
        }
        let queued = self.queue.len();
        self.queue.retain(|(id, _, _)| id != contender_id);
        let released = self.holders.len() < held;
        if released || self.queue.len() < queued {
            // A freed permit, or a waiter gone that may have been owed one.
            self.wake(now);
        }
        released
    }
}

/// A lease store in this process's memory.
///
/// Its clock is tokio's (`tokio::time::Instant`), so tests that pause and advance tokio time
/// control lease expiry. It pushes [`StoreEvent`]s: waiters hear of a release at once.
/// Cloning shares the store.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Mutex<HashMap<String, Entry>>>,
    semaphores: Arc<Mutex<HashMap<String, Permits>>>,
    base_ms: i64,
    base: Instant,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").finish_non_exhaustive()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        let base_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 2))
            .unwrap_or(0);
        MemoryStore {
            inner: Arc::new(Mutex::new(HashMap::new())),
            semaphores: Arc::new(Mutex::new(HashMap::new())),
            base_ms,
            base: Instant::now(),
        }
    }

    /// The store's clock, in epoch milliseconds.
    pub fn now(&self) -> i64 {
        let elapsed = Instant::now()
            .saturating_duration_since(self.base)
            .as_millis();
        self.base_ms + i64::try_from(elapsed).unwrap_or(i64::MAX / 2)
    }

    /// Test support (feature `test-util`): rewrites the owner id of `mutex`'s record from
    /// `owner_id` to `new_owner`, keeping its fence and lease, and tells nobody: what a hand
    /// editing a backend's data does (SQL's `UPDATE … SET owner_id`). Returns whether
    /// `owner_id` owned the mutex within its lease (otherwise nothing changes).
    #[cfg(feature = "test-util")]
    pub fn overwrite_owner(&self, mutex: &str, owner_id: &str, new_owner: &str) -> bool {
        self.with(mutex, |e, now| {
            if !e.owner.is_owned_by_at(owner_id, now) {
                return false;
            }
            e.owner.owner_id = new_owner.to_owned();
            true
        })
    }

    fn with<T>(&self, mutex: &str, f: impl FnOnce(&mut Entry, i64) -> T) -> T {
        let now = self.now();
        let mut map = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let entry = map.entry(mutex.to_owned()).or_default();
        f(entry, now)
    }

    fn with_permits<T>(&self, semaphore: &str, f: impl FnOnce(&mut Permits, i64) -> T) -> T {
        self.with_semaphore(semaphore, |p, now| {
            p.prune(now);
            f(p, now)
        })
    }

    /// As `with_permits`, without dropping what is past its time first.
    fn with_semaphore<T>(&self, semaphore: &str, f: impl FnOnce(&mut Permits, i64) -> T) -> T {
        let now = self.now();
        let mut map = self.semaphores.lock().unwrap_or_else(|p| p.into_inner());
        let entry = map.entry(semaphore.to_owned()).or_default();
        f(entry, now)
    }

    fn renew_permit(
        p: &mut Permits,
        contender_id: &str,
        lease: Lease,
        now: i64,
    ) -> Option<MutexOwner> {
        let holder = p.holders.iter_mut().find(|h| h.owner_id == contender_id)?;
        holder.ttl_at = now + lease.ttl_ms();
        holder.transition_at = holder.ttl_at + lease.transition_ms();
        Some(holder.clone())
    }
}

fn notify(entry: &mut Entry, except: &str, event: &StoreEvent) {
    entry.subscribers.retain(|(_, tx)| !tx.is_closed());
    for (id, tx) in &entry.subscribers {
        if id != except {
            // A full channel already holds an event that makes the receiver look again.
            let _ = tx.try_send(event.clone());
        }
    }
}

impl LeaseStore for MemoryStore {
    fn backend(&self) -> &'static str {
        "memory"
    }

    async fn acquire(&self, mutex: &str, contender_id: &str, lease: Lease) -> Result<LeaseReply> {
        Ok(self.with(mutex, |e, now| {
            let free = !e.owner.is_in_lease(now);
            let renew = e.owner.is_owned_by_at(contender_id, now);
            if free || renew {
                let acquired_at = if renew { e.owner.acquired_at } else { now };
                if !renew {
                    e.fence += 1;
                }
                e.owner = MutexOwner {
                    owner_id: contender_id.to_owned(),
                    acquired_at,
                    ttl_at: now + lease.ttl_ms(),
                    transition_at: now + lease.ttl_ms() + lease.transition_ms(),
                    fence: e.fence,
                };
                if !renew {
                    let ev = StoreEvent::Acquired {
                        owner_id: contender_id.to_owned(),
                    };
                    notify(e, contender_id, &ev);
                }
            }
            LeaseReply {
                owner: visible(&e.owner, now),
                now,
            }
        }))
    }

    async fn guard(&self, mutex: &str, contender_id: &str, lease: Lease) -> Result<LeaseReply> {
        Ok(self.with(mutex, |e, now| {
            if e.owner.is_owned_by_at(contender_id, now) {
                e.owner.ttl_at = now + lease.ttl_ms();
                e.owner.transition_at = now + lease.ttl_ms() + lease.transition_ms();
            }
            LeaseReply {
                owner: visible(&e.owner, now),
                now,
            }
        }))
    }

    async fn release(&self, mutex: &str, contender_id: &str) -> Result<bool> {
        Ok(self.with(mutex, |e, now| {
            if e.owner.is_owned_by_at(contender_id, now) {
                e.owner = MutexOwner::NONE;
                #[cfg(feature = "bench")]
                crate::hops::record(crate::hops::Hop::PushReceived, mutex);
                notify(e, contender_id, &StoreEvent::Released);
                true
            } else {
                false
            }
        }))
    }

    async fn release_after(&self, mutex: &str, contender_id: &str, hold: Duration) -> Result<bool> {
        let ms = hold_millis(hold)?;
        if ms == 0 {
            return self.release(mutex, contender_id).await;
        }
        Ok(self.with(mutex, |e, now| {
            if !e.owner.is_owned_by_at(contender_id, now) {
                return false;
            }
            let holder = held_owner_id(contender_id);
            e.owner.owner_id = holder.clone();
            e.owner.ttl_at = now.saturating_add(ms);
            e.owner.transition_at = e.owner.ttl_at;
            // Observers re-read on it; waiters ignore an acquisition by someone else.
            notify(e, contender_id, &StoreEvent::Acquired { owner_id: holder });
            true
        }))
    }

    async fn owner(&self, mutex: &str) -> Result<LeaseReply> {
        Ok(self.with(mutex, |e, now| LeaseReply {
            owner: visible(&e.owner, now),
            now,
        }))
    }

    async fn subscribe(&self, mutex: &str, contender_id: &str) -> Result<Option<EventReceiver>> {
        let (tx, rx) = events::channel(4);
        self.with(mutex, |e, _| {
            e.subscribers.push((contender_id.to_owned(), tx))
        });
        Ok(Some(rx))
    }
}

impl PermitStore for MemoryStore {
    fn backend(&self) -> &'static str {
        "memory"
    }

    fn permit_claim(&self) -> Option<Duration> {
        Some(Duration::from_millis(PERMIT_CLAIM_MS.unsigned_abs()))
    }

    async fn permit_acquire(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> Result<LeaseReply> {
        self.with_semaphore(semaphore, |p, now| {
            p.acquire(semaphore, contender_id, permits, lease, now)
        })
    }

    async fn permit_guard(
        &self,
        semaphore: &str,
        contender_id: &str,
        _permits: u32,
        lease: Lease,
    ) -> Result<LeaseReply> {
        Ok(self.with_permits(semaphore, |p, now| {
            match Self::renew_permit(p, contender_id, lease, now) {
                Some(owner) => LeaseReply { owner, now },
                None => LeaseReply::look_again_at(now, now),
            }
        }))
    }

    async fn permit_release(&self, semaphore: &str, contender_id: &str) -> Result<bool> {
        Ok(self.with_permits(semaphore, |p, now| p.remove(contender_id, true, now)))
    }

    async fn permit_owners(&self, semaphore: &str) -> Result<PermitHolders> {
        Ok(self.with_permits(semaphore, |p, now| PermitHolders {
            permits: (!p.holders.is_empty()).then_some(p.permits),
            holders: p.holders.clone(),
            now,
        }))
    }

    async fn permit_subscribe(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> Result<Option<EventReceiver>> {
        let (tx, rx) = events::channel(4);
        self.with_permits(semaphore, |p, _| {
            p.subscribers.push((contender_id.to_owned(), tx))
        });
        Ok(Some(rx))
    }

    /// Leaves the queue only: a permit held stays held until its lease ends (the engine
    /// leaves when it lost track of its permit).
    async fn permit_leave(&self, semaphore: &str, contender_id: &str) -> Result<()> {
        self.with_permits(semaphore, |p, now| p.remove(contender_id, false, now));
        Ok(())
    }
}

/// The owner as readers see it: an ownership past its lease is no ownership.
fn visible(owner: &MutexOwner, now: i64) -> MutexOwner {
    if owner.is_in_lease(now) {
        owner.clone()
    } else {
        MutexOwner::NONE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const LEASE: Lease = Lease {
        ttl: Duration::from_millis(1000),
        transition: Duration::from_millis(500),
    };

    #[tokio::test(start_paused = true)]
    async fn acquire_renew_expire_release() {
        let s = MemoryStore::new();
        let a = s.acquire("m", "a", LEASE).await.expect("acquire");
        assert!(a.owner.is_owner("a"));
        assert_eq!(a.owner.fence, 1);
        let b = s.acquire("m", "b", LEASE).await.expect("acquire");
        assert!(b.owner.is_owner("a"), "a still owns");
        tokio::time::advance(Duration::from_millis(1200)).await;
        // In transition: only a may renew, and renewal keeps the fence.
        assert!(
            s.acquire("m", "b", LEASE)
                .await
                .expect("b")
                .owner
                .is_owner("a")
        );
        let renewed = s.guard("m", "a", LEASE).await.expect("guard");
        assert_eq!(
            (renewed.owner.fence, renewed.owner.acquired_at),
            (1, a.owner.acquired_at)
        );
        tokio::time::advance(Duration::from_millis(1600)).await;
        let b = s.acquire("m", "b", LEASE).await.expect("b");
        assert!(b.owner.is_owner("b"));
        assert_eq!(b.owner.fence, 2);
        assert!(!s.release("m", "a").await.expect("stale release"));
        assert!(s.owner("m").await.expect("owner").owner.is_owner("b"));
        assert!(s.release("m", "b").await.expect("release"));
        assert!(!s.owner("m").await.expect("owner").owner.has_owner());
        assert_eq!(s.acquire("m", "a", LEASE).await.expect("a").owner.fence, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn release_after_keeps_it_held_from_everyone() {
        let s = MemoryStore::new();
        let a = s.acquire("m", "a", LEASE).await.expect("a").owner;
        assert!(
            !s.release_after("m", "b", Duration::from_secs(5))
                .await
                .expect("not b's")
        );
        assert!(
            s.release_after("m", "a", Duration::from_secs(5))
                .await
                .expect("a's")
        );
        let held = s.owner("m").await.expect("owner").owner;
        assert_eq!(held.held_after_release_by(), Some("a"));
        assert_eq!((held.fence, held.acquired_at), (a.fence, a.acquired_at));
        // Past a's old lease (1.5 s): still held, from a too, and nobody can renew it.
        tokio::time::advance(Duration::from_millis(4990)).await;
        for who in ["a", "b"] {
            let r = s.acquire("m", who, LEASE).await.expect("acquire");
            assert!(!r.owner.is_owner(who), "{who} took a held mutex");
            let r = s.guard("m", who, LEASE).await.expect("guard");
            assert!(!r.owner.is_owner(who));
        }
        assert!(
            !s.release_after("m", "a", Duration::from_secs(5))
                .await
                .expect("twice")
        );
        tokio::time::advance(Duration::from_millis(10)).await;
        let b = s.acquire("m", "b", LEASE).await.expect("b").owner;
        assert!(b.is_owner("b"));
        assert_eq!(b.fence, a.fence + 1);
        assert!(
            s.release_after("m", "b", Duration::ZERO)
                .await
                .expect("zero")
        );
        assert!(!s.owner("m").await.expect("owner").owner.has_owner());
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_hear_release() {
        let s = MemoryStore::new();
        s.acquire("m", "a", LEASE).await.expect("a");
        let mut rx = s.subscribe("m", "b").await.expect("sub").expect("push");
        assert!(s.release("m", "a").await.expect("release"));
        assert_eq!(rx.recv().await, Some(StoreEvent::Released));
    }
}
