//! An in-memory [`LeaseStore`]: for unit tests and for coordinating tasks of one process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::error::Result;
use crate::owner::{MutexOwner, held_owner_id};
use crate::store::{Lease, LeaseReply, LeaseStore, StoreEvent, hold_millis};

#[derive(Default)]
struct Entry {
    owner: MutexOwner,
    fence: u64,
    subscribers: Vec<(String, mpsc::Sender<StoreEvent>)>,
}

/// A lease store in this process's memory.
///
/// Its clock is tokio's (`tokio::time::Instant`), so tests that pause and advance tokio time
/// control lease expiry. It pushes [`StoreEvent`]s: waiters hear of a release at once.
/// Cloning shares the store.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Mutex<HashMap<String, Entry>>>,
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

    fn with<T>(&self, mutex: &str, f: impl FnOnce(&mut Entry, i64) -> T) -> T {
        let now = self.now();
        let mut map = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let entry = map.entry(mutex.to_owned()).or_default();
        f(entry, now)
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

    async fn subscribe(
        &self,
        mutex: &str,
        contender_id: &str,
    ) -> Result<Option<mpsc::Receiver<StoreEvent>>> {
        let (tx, rx) = mpsc::channel(4);
        self.with(mutex, |e, _| {
            e.subscribers.push((contender_id.to_owned(), tx))
        });
        Ok(Some(rx))
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
