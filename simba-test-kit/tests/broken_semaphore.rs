//! Proof that the semaphore cases can fail: a store with one flaw in its permit operations
//! must be reported by the case that covers it.

use std::time::Duration;

use simba_core::backend::{Lease, LeaseReply, LeaseStore, PermitHolders, PermitStore};
use simba_core::events::{self, EventReceiver, EventSender};
use simba_core::{Error, MemoryStore, MutexOwner, Result};
use simba_test_kit::memory::StoreHarness;
use simba_test_kit::semaphore_cases;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flaw {
    /// Grants twice the permits asked for.
    IgnoresCount,
    /// Hands every permit the same fence.
    ReusesFences,
    /// A contender with another count waits instead of being refused.
    SilentMismatch,
    /// Permits never expire: a dead holder's permit never returns.
    NeverExpire,
    /// Waiters subscribe but are never pushed.
    DeafWaiters,
    /// A renewal hands out a new fence.
    RenewalNewFence,
    /// A release by a contender that holds nothing frees the first holder's permit.
    StaleReleaseFrees,
    /// A waiter keeps no place in the queue: whoever asks when a permit is free gets it.
    NoQueue,
}

#[derive(Clone)]
struct Flawed {
    flaw: Flaw,
    inner: MemoryStore,
    deaf: std::sync::Arc<std::sync::Mutex<Vec<EventSender>>>,
}

impl LeaseStore for Flawed {
    fn backend(&self) -> &'static str {
        "flawed"
    }
    async fn acquire(&self, m: &str, id: &str, lease: Lease) -> Result<LeaseReply> {
        self.inner.acquire(m, id, lease).await
    }
    async fn release(&self, m: &str, id: &str) -> Result<bool> {
        self.inner.release(m, id).await
    }
    async fn release_after(&self, m: &str, id: &str, hold: Duration) -> Result<bool> {
        self.inner.release_after(m, id, hold).await
    }
    async fn owner(&self, m: &str) -> Result<LeaseReply> {
        self.inner.owner(m).await
    }
}

impl PermitStore for Flawed {
    fn backend(&self) -> &'static str {
        "flawed"
    }
    fn permit_claim(&self) -> Option<std::time::Duration> {
        self.inner.permit_claim()
    }
    async fn permit_acquire(&self, s: &str, id: &str, n: u32, lease: Lease) -> Result<LeaseReply> {
        let held = self.flaw == Flaw::RenewalNewFence
            && (self.inner.permit_owners(s).await?.holders)
                .iter()
                .any(|h| h.owner_id == id);
        let r = match self.flaw {
            Flaw::IgnoresCount => self.inner.permit_acquire(s, id, n * 2, lease).await,
            Flaw::NeverExpire => {
                let hour = Lease {
                    ttl: Duration::from_secs(3600),
                    transition: Duration::ZERO,
                };
                self.inner.permit_acquire(s, id, n, hour).await
            }
            _ => self.inner.permit_acquire(s, id, n, lease).await,
        };
        match (self.flaw, r) {
            (Flaw::ReusesFences, Ok(mut r)) => {
                if r.owner.is_owner(id) {
                    r.owner.fence = 7;
                }
                Ok(r)
            }
            (Flaw::RenewalNewFence, Ok(mut r)) => {
                if held && r.owner.is_owner(id) {
                    r.owner.fence += 1;
                }
                Ok(r)
            }
            (Flaw::NoQueue, Ok(r)) => {
                if r.owner.owner_id.is_empty() {
                    self.inner.permit_leave(s, id).await?;
                }
                Ok(r)
            }
            (Flaw::SilentMismatch, Err(Error::PermitsMismatch { .. })) => {
                let now = self.inner.now();
                Ok(LeaseReply {
                    owner: MutexOwner {
                        ttl_at: now + 100,
                        transition_at: now + 100,
                        ..MutexOwner::NONE
                    },
                    now,
                })
            }
            (_, r) => r,
        }
    }
    async fn permit_guard(&self, s: &str, id: &str, n: u32, lease: Lease) -> Result<LeaseReply> {
        let n = if self.flaw == Flaw::IgnoresCount {
            n * 2
        } else {
            n
        };
        let mut r = self.inner.permit_guard(s, id, n, lease).await?;
        if self.flaw == Flaw::ReusesFences && r.owner.is_owner(id) {
            r.owner.fence = 7;
        }
        Ok(r)
    }
    async fn permit_release(&self, s: &str, id: &str) -> Result<bool> {
        if self.flaw == Flaw::StaleReleaseFrees {
            let holders = self.inner.permit_owners(s).await?.holders;
            if !holders.iter().any(|h| h.owner_id == id)
                && let Some(first) = holders.first()
            {
                return self.inner.permit_release(s, &first.owner_id).await;
            }
        }
        self.inner.permit_release(s, id).await
    }
    async fn permit_owners(&self, s: &str) -> Result<PermitHolders> {
        self.inner.permit_owners(s).await
    }
    async fn permit_subscribe(&self, s: &str, id: &str) -> Result<Option<EventReceiver>> {
        if self.flaw == Flaw::DeafWaiters {
            let (tx, rx) = events::channel(4);
            self.deaf.lock().unwrap_or_else(|p| p.into_inner()).push(tx);
            return Ok(Some(rx));
        }
        self.inner.permit_subscribe(s, id).await
    }
    async fn permit_leave(&self, s: &str, id: &str) -> Result<()> {
        self.inner.permit_leave(s, id).await
    }
}

fn harness(flaw: Flaw) -> StoreHarness<Flawed> {
    let store = Flawed {
        flaw,
        inner: MemoryStore::new(),
        deaf: Default::default(),
    };
    StoreHarness::new(format!("{flaw:?}"), store, true)
}

/// Runs the semaphore case `case` (by name) on a store with `flaw`.
async fn run(flaw: Flaw, case: &str) -> std::result::Result<(), String> {
    let h = harness(flaw);
    let r = match case {
        "never_more_than_n" => semaphore_cases::never_more_than_n(&h).await,
        "dead_holder_permit_returns" => semaphore_cases::dead_holder_permit_returns(&h).await,
        "fences_increase_across_permits" => {
            semaphore_cases::fences_increase_across_permits(&h).await
        }
        "permits_mismatch_refused" => semaphore_cases::permits_mismatch_refused(&h).await,
        "try_acquire_full_fails_at_once" => {
            semaphore_cases::try_acquire_full_fails_at_once(&h).await
        }
        "timeout_gives_up_holding_nothing" => {
            semaphore_cases::timeout_gives_up_holding_nothing(&h).await
        }
        "release_wakes_a_waiter" => semaphore_cases::release_wakes_a_waiter(&h).await,
        "store_renewal_keeps_the_fence" => semaphore_cases::store_renewal_keeps_the_fence(&h).await,
        "store_mismatch_until_all_released" => {
            semaphore_cases::store_mismatch_until_all_released(&h).await
        }
        "store_queue_is_first_come_first_served" => {
            semaphore_cases::store_queue_is_first_come_first_served(&h).await
        }
        "store_release_by_a_non_holder_changes_nothing" => {
            semaphore_cases::store_release_by_a_non_holder_changes_nothing(&h).await
        }
        "store_fences_increase_across_permits" => {
            semaphore_cases::store_fences_increase_across_permits(&h).await
        }
        "store_admission_follows_the_rule" => {
            semaphore_cases::store_admission_follows_the_rule(&h).await
        }
        other => panic!("no semaphore case {other}"),
    };
    r.map_err(|e| e.to_string())
}

async fn caught(flaw: Flaw, case: &str) {
    match run(flaw, case).await {
        Ok(()) => panic!("semaphore case {case} passed on a store with flaw {flaw:?}"),
        Err(e) => eprintln!("{flaw:?} caught by {case}: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignoring_the_count_is_caught() {
    caught(Flaw::IgnoresCount, "never_more_than_n").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_fences_are_caught() {
    caught(Flaw::ReusesFences, "fences_increase_across_permits").await;
    caught(Flaw::ReusesFences, "never_more_than_n").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_mismatch_is_caught() {
    caught(Flaw::SilentMismatch, "permits_mismatch_refused").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_that_never_expire_are_caught() {
    caught(Flaw::NeverExpire, "dead_holder_permit_returns").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deaf_waiters_are_caught() {
    caught(Flaw::DeafWaiters, "release_wakes_a_waiter").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_flaws_are_caught_by_the_store_cases() {
    caught(Flaw::RenewalNewFence, "store_renewal_keeps_the_fence").await;
    caught(Flaw::RenewalNewFence, "store_admission_follows_the_rule").await;
    caught(Flaw::ReusesFences, "store_fences_increase_across_permits").await;
    caught(Flaw::ReusesFences, "store_admission_follows_the_rule").await;
    caught(Flaw::SilentMismatch, "store_mismatch_until_all_released").await;
    caught(
        Flaw::StaleReleaseFrees,
        "store_release_by_a_non_holder_changes_nothing",
    )
    .await;
    caught(Flaw::StaleReleaseFrees, "store_admission_follows_the_rule").await;
    caught(Flaw::NoQueue, "store_queue_is_first_come_first_served").await;
    caught(Flaw::NoQueue, "store_admission_follows_the_rule").await;
}
