//! Proof that the suite can fail: deliberately unsafe stores must be reported.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use simba_core::backend::{Lease, LeaseReply, LeaseStore};
use simba_core::{MemoryStore, MutexOwner, Result};
use simba_test_kit::memory::StoreHarness;
use simba_test_kit::suite;

/// Grants every acquire to whoever asks: no mutual exclusion at all.
#[derive(Clone, Default)]
struct GrantAll {
    fence: Arc<AtomicU64>,
    clock: MemoryStore,
}

impl LeaseStore for GrantAll {
    fn backend(&self) -> &'static str {
        "grant-all"
    }
    async fn acquire(&self, _m: &str, id: &str, lease: Lease) -> Result<LeaseReply> {
        let now = self.clock.now();
        Ok(LeaseReply {
            owner: MutexOwner {
                owner_id: id.to_owned(),
                acquired_at: now,
                ttl_at: now + lease.ttl_ms(),
                transition_at: now + lease.ttl_ms() + lease.transition_ms(),
                fence: self.fence.fetch_add(1, Ordering::SeqCst) + 1,
            },
            now,
        })
    }
    async fn release(&self, _m: &str, _id: &str) -> Result<bool> {
        Ok(true)
    }
    async fn release_after(&self, _m: &str, _id: &str, _hold: Duration) -> Result<bool> {
        Ok(true)
    }
    async fn owner(&self, _m: &str) -> Result<LeaseReply> {
        Ok(LeaseReply {
            owner: MutexOwner::NONE,
            now: self.clock.now(),
        })
    }
}

/// A correct store except that leases never expire: a silent owner keeps the mutex forever.
#[derive(Clone, Default)]
struct NeverExpire(MemoryStore);

impl LeaseStore for NeverExpire {
    fn backend(&self) -> &'static str {
        "never-expire"
    }
    async fn acquire(&self, m: &str, id: &str, _lease: Lease) -> Result<LeaseReply> {
        let forever = Lease {
            ttl: std::time::Duration::from_secs(3600),
            transition: std::time::Duration::ZERO,
        };
        self.0.acquire(m, id, forever).await
    }
    async fn release(&self, m: &str, id: &str) -> Result<bool> {
        self.0.release(m, id).await
    }
    async fn release_after(&self, m: &str, id: &str, hold: Duration) -> Result<bool> {
        self.0.release_after(m, id, hold).await
    }
    async fn owner(&self, m: &str) -> Result<LeaseReply> {
        self.0.owner(m).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grant_all_fails_mutual_exclusion() {
    let h = StoreHarness::new("grant-all", GrantAll::default(), false);
    let r = suite::multi_contend(&h).await;
    let e = r.expect_err("a store that grants everyone must fail multi_contend");
    assert!(e.to_string().contains("several owners"), "{e}");
    let e = suite::failover_after_crash(&h)
        .await
        .expect_err("and the failover case, which checks the history");
    assert!(
        e.to_string().contains("two owners at once") || e.to_string().contains("still believes"),
        "{e}"
    );
    assert!(
        suite::try_acquire(&h).await.is_err(),
        "try_acquire on a held mutex must say WouldBlock"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_expiring_store_fails_failover() {
    let h = StoreHarness::new("never-expire", NeverExpire::default(), true);
    let e = suite::failover_after_crash(&h)
        .await
        .expect_err("a store whose leases never expire must fail failover");
    assert!(e.to_string().contains("failover"), "{e}");
}

#[test]
fn suite_has_at_least_fifteen_cases() {
    assert!(suite::CASES.len() >= 15, "{}", suite::CASES.len());
}
