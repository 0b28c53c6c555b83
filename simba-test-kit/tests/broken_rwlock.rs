//! Proof that the read-write lock cases can fail: a store with one flaw, in its mutexes
//! (the gate) or its permits (the readers), must be reported by the case that covers it.

use std::time::Duration;

use simba_core::backend::{Lease, LeaseReply, LeaseStore, PermitHolders, PermitStore};
use simba_core::events::EventReceiver;
use simba_core::{MemoryStore, Result};
use simba_test_kit::memory::StoreHarness;
use simba_test_kit::rw_cases;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flaw {
    /// Every contender owns the mutex at once: the gate shuts nobody out.
    GateAdmitsAll,
    /// Every ownership of a mutex gets the same fence.
    ReusesGateFences,
    /// The holders of a semaphore are never listed: a writer sees no reader.
    HidesReaders,
    /// A semaphore has one permit whatever is asked: readers cannot share.
    OnePermit,
}

#[derive(Clone)]
struct Flawed {
    flaw: Flaw,
    inner: MemoryStore,
}

impl Flawed {
    /// The mutex a contender really takes: its own, when the gate admits everyone.
    fn mutex(&self, m: &str, id: &str) -> String {
        if self.flaw == Flaw::GateAdmitsAll {
            format!("{m}.{id}")
        } else {
            m.to_owned()
        }
    }
}

impl LeaseStore for Flawed {
    fn backend(&self) -> &'static str {
        "flawed"
    }
    async fn acquire(&self, m: &str, id: &str, lease: Lease) -> Result<LeaseReply> {
        let mut r = self.inner.acquire(&self.mutex(m, id), id, lease).await?;
        if self.flaw == Flaw::ReusesGateFences && r.owner.is_owner(id) {
            r.owner.fence = 7;
        }
        Ok(r)
    }
    async fn release(&self, m: &str, id: &str) -> Result<bool> {
        self.inner.release(&self.mutex(m, id), id).await
    }
    async fn release_after(&self, m: &str, id: &str, hold: Duration) -> Result<bool> {
        self.inner.release_after(&self.mutex(m, id), id, hold).await
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
        let n = if self.flaw == Flaw::OnePermit { 1 } else { n };
        self.inner.permit_acquire(s, id, n, lease).await
    }
    async fn permit_release(&self, s: &str, id: &str) -> Result<bool> {
        self.inner.permit_release(s, id).await
    }
    async fn permit_owners(&self, s: &str) -> Result<PermitHolders> {
        let mut h = self.inner.permit_owners(s).await?;
        if self.flaw == Flaw::HidesReaders {
            h.holders.clear();
            h.permits = None;
        }
        Ok(h)
    }
    async fn permit_subscribe(&self, s: &str, id: &str) -> Result<Option<EventReceiver>> {
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
    };
    StoreHarness::new(format!("{flaw:?}"), store, true)
}

/// Runs the read-write lock case `case` (by name) on a store with `flaw`.
async fn run(flaw: Flaw, case: &str) -> std::result::Result<(), String> {
    let h = harness(flaw);
    let r = match case {
        "rw_readers_share" => rw_cases::rw_readers_share(&h).await,
        "rw_writer_excludes_everyone" => rw_cases::rw_writer_excludes_everyone(&h).await,
        "rw_readers_exclude_a_writer" => rw_cases::rw_readers_exclude_a_writer(&h).await,
        "rw_a_waiting_writer_goes_first" => rw_cases::rw_a_waiting_writer_goes_first(&h).await,
        "rw_fences_order_readers_and_writers" => {
            rw_cases::rw_fences_order_readers_and_writers(&h).await
        }
        "rw_never_a_writer_beside_anyone" => rw_cases::rw_never_a_writer_beside_anyone(&h).await,
        other => panic!("no read-write lock case {other}"),
    };
    r.map_err(|e| e.to_string())
}

async fn caught(flaw: Flaw, case: &str) {
    match run(flaw, case).await {
        Ok(()) => panic!("read-write lock case {case} passed on a store with flaw {flaw:?}"),
        Err(e) => eprintln!("{flaw:?} caught by {case}: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_that_cannot_share_are_caught() {
    caught(Flaw::OnePermit, "rw_readers_share").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_that_admits_everyone_is_caught() {
    caught(Flaw::GateAdmitsAll, "rw_writer_excludes_everyone").await;
    caught(Flaw::GateAdmitsAll, "rw_a_waiting_writer_goes_first").await;
    caught(Flaw::GateAdmitsAll, "rw_never_a_writer_beside_anyone").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hidden_readers_are_caught() {
    caught(Flaw::HidesReaders, "rw_readers_exclude_a_writer").await;
    caught(Flaw::HidesReaders, "rw_readers_share").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_gate_fences_are_caught() {
    caught(
        Flaw::ReusesGateFences,
        "rw_fences_order_readers_and_writers",
    )
    .await;
}
