//! Proof that the suites can fail: deliberately unsafe stores must be reported, by the
//! service-level cases and by the store-level cases.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use simba_core::backend::{Lease, LeaseReply, LeaseStore};
use simba_core::events::{self, EventReceiver, EventSender};
use simba_core::{MemoryStore, MutexOwner, Result};
use simba_test_kit::memory::StoreHarness;
use simba_test_kit::{store_cases, suite};

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
fn suites_have_their_cases() {
    assert!(suite::CASES.len() >= 15, "{}", suite::CASES.len());
    assert!(
        store_cases::STORE_CASES.len() >= 8,
        "{:?}",
        store_cases::STORE_CASES
    );
    for name in suite::CASES.iter().chain(store_cases::STORE_CASES) {
        assert!(!name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c == '_'));
    }
}

/// One way a store breaks the [`LeaseStore`] contract, over a correct in-memory store.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Flaw {
    /// None: the store is correct.
    None,
    /// A renewal reports a new fence.
    RenewalBumpsFence,
    /// `release` frees the mutex whoever asks.
    UncheckedRelease,
    /// Leases last an hour, whatever was asked.
    NeverExpire,
    /// Every acquisition gets fence 1.
    ConstantFence,
    /// `acquire` is a read, then a write: two racers can both win.
    ReadThenWrite,
    /// `release_after` releases at once.
    HoldIsRelease,
    /// `subscribe` gives a channel that never carries anything.
    DeafSubscribe,
    /// `guard` takes the mutex like `acquire`, held or not.
    GuardTakes,
}

#[derive(Clone)]
struct Flawed {
    flaw: Flaw,
    inner: MemoryStore,
    deaf: Arc<Mutex<Vec<EventSender>>>,
}

impl Flawed {
    fn harness(flaw: Flaw) -> StoreHarness<Flawed> {
        let store = Flawed {
            flaw,
            inner: MemoryStore::new(),
            deaf: Arc::default(),
        };
        StoreHarness::new(format!("{flaw:?}"), store, true)
    }
}

impl LeaseStore for Flawed {
    fn backend(&self) -> &'static str {
        "flawed"
    }
    async fn acquire(&self, m: &str, id: &str, lease: Lease) -> Result<LeaseReply> {
        match self.flaw {
            Flaw::NeverExpire => {
                let hour = Lease {
                    ttl: Duration::from_secs(3600),
                    transition: Duration::ZERO,
                };
                self.inner.acquire(m, id, hour).await
            }
            Flaw::RenewalBumpsFence => {
                let before = self.inner.owner(m).await?;
                let mut r = self.inner.acquire(m, id, lease).await?;
                if before.owner.is_owned_by_at(id, before.now) {
                    r.owner.fence += 1;
                }
                Ok(r)
            }
            Flaw::ConstantFence => {
                let mut r = self.inner.acquire(m, id, lease).await?;
                r.owner.fence = 1;
                Ok(r)
            }
            Flaw::ReadThenWrite => {
                let before = self.inner.owner(m).await?;
                if before.owner.has_owner() && !before.owner.is_owner(id) {
                    return Ok(before);
                }
                // The window between the read and the write.
                tokio::time::sleep(Duration::from_millis(20)).await;
                let current = self.inner.owner(m).await?.owner.owner_id;
                if !current.is_empty() && current != id {
                    self.inner.release(m, &current).await?;
                }
                self.inner.acquire(m, id, lease).await
            }
            _ => self.inner.acquire(m, id, lease).await,
        }
    }
    async fn guard(&self, m: &str, id: &str, lease: Lease) -> Result<LeaseReply> {
        match self.flaw {
            Flaw::GuardTakes => {
                let current = self.inner.owner(m).await?.owner.owner_id;
                self.inner.release(m, &current).await?;
                self.inner.acquire(m, id, lease).await
            }
            Flaw::RenewalBumpsFence => {
                let mut r = self.inner.guard(m, id, lease).await?;
                if r.owner.is_owner(id) {
                    r.owner.fence += 1;
                }
                Ok(r)
            }
            _ => self.inner.guard(m, id, lease).await,
        }
    }
    async fn release(&self, m: &str, id: &str) -> Result<bool> {
        if self.flaw == Flaw::UncheckedRelease {
            let current = self.inner.owner(m).await?.owner.owner_id;
            return self.inner.release(m, &current).await;
        }
        self.inner.release(m, id).await
    }
    async fn release_after(&self, m: &str, id: &str, hold: Duration) -> Result<bool> {
        if self.flaw == Flaw::HoldIsRelease {
            return self.inner.release(m, id).await;
        }
        self.inner.release_after(m, id, hold).await
    }
    async fn owner(&self, m: &str) -> Result<LeaseReply> {
        self.inner.owner(m).await
    }
    async fn subscribe(&self, m: &str, id: &str) -> Result<Option<EventReceiver>> {
        if self.flaw == Flaw::DeafSubscribe {
            let (tx, rx) = events::channel(4);
            self.deaf.lock().unwrap_or_else(|p| p.into_inner()).push(tx);
            return Ok(Some(rx));
        }
        self.inner.subscribe(m, id).await
    }
}

/// Runs the store-level case `case` (by name) on a store with `flaw`.
async fn run(flaw: Flaw, case: &str) -> std::result::Result<(), String> {
    let h = Flawed::harness(flaw);
    let r = match case {
        "acquire_renew_release" => store_cases::acquire_renew_release(&h).await,
        "stale_calls_change_nothing" => store_cases::stale_calls_change_nothing(&h).await,
        "lease_ends_on_backend_clock" => store_cases::lease_ends_on_backend_clock(&h).await,
        "fences_strictly_increase" => store_cases::fences_strictly_increase(&h).await,
        "acquire_is_atomic" => store_cases::acquire_is_atomic(&h).await,
        "release_after_contract" => store_cases::release_after_contract(&h).await,
        "waiter_is_woken_on_release" => store_cases::waiter_is_woken_on_release(&h).await,
        "observer_is_pushed_and_idle" => store_cases::observer_is_pushed_and_idle(&h).await,
        other => panic!("no store case {other}"),
    };
    r.map_err(|e| e.to_string())
}

/// Each flaw is reported by the case written for it, with a message that names the fault.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_cases_report_each_flaw() {
    let expected = [
        (
            Flaw::RenewalBumpsFence,
            "acquire_renew_release",
            "keep the fence",
        ),
        (
            Flaw::RenewalBumpsFence,
            "fences_strictly_increase",
            "changed the fence",
        ),
        (
            Flaw::UncheckedRelease,
            "acquire_renew_release",
            "b's release freed",
        ),
        (
            Flaw::UncheckedRelease,
            "stale_calls_change_nothing",
            "stale release",
        ),
        (
            Flaw::NeverExpire,
            "acquire_renew_release",
            "the times are not",
        ),
        (
            Flaw::NeverExpire,
            "lease_ends_on_backend_clock",
            "the lease's end",
        ),
        (
            Flaw::ConstantFence,
            "fences_strictly_increase",
            "after fence",
        ),
        (
            Flaw::ConstantFence,
            "stale_calls_change_nothing",
            "larger fence",
        ),
        (Flaw::ReadThenWrite, "acquire_is_atomic", "winners"),
        (
            Flaw::HoldIsRelease,
            "release_after_contract",
            "not held for a",
        ),
        (
            Flaw::DeafSubscribe,
            "waiter_is_woken_on_release",
            "not woken",
        ),
        (Flaw::GuardTakes, "acquire_renew_release", "guard took"),
        (
            Flaw::GuardTakes,
            "stale_calls_change_nothing",
            "stale guard",
        ),
    ];
    let mut missed = Vec::new();
    for (flaw, case, says) in expected {
        match run(flaw, case).await {
            Ok(()) => missed.push(format!("{case} passed on a store with {flaw:?}")),
            Err(e) if !e.contains(says) => {
                missed.push(format!("{case} on {flaw:?} failed for another reason: {e}"))
            }
            Err(_) => {}
        }
    }
    assert!(missed.is_empty(), "{missed:#?}");
}

/// Every store-level case is named in the list, and passes on the wrapper without a
/// flaw, so a failure above is the flaw's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_cases_pass_without_the_flaws() {
    for case in store_cases::STORE_CASES {
        if let Err(e) = run(Flaw::None, case).await {
            panic!("{case} failed on the store without flaws: {e}");
        }
    }
}

/// The store contract's property test (`store_props`) reports every flaw a sequence of
/// calls by one client can show, and passes on the wrapper without a flaw. (A racy
/// acquire and a deaf subscription need concurrent callers and pushes: the store cases
/// above catch those.)
#[tokio::test(start_paused = true)]
async fn property_test_reports_each_sequential_flaw() {
    use simba_test_kit::store_props::{PropertyRun, check_store_contract};
    let run = PropertyRun::memory(|d| Box::pin(tokio::time::advance(d)));
    if let Err(e) = check_store_contract(&Flawed::harness(Flaw::None), &run).await {
        panic!("the property test failed on the store without flaws: {e}");
    }
    let mut missed = Vec::new();
    for flaw in [
        Flaw::RenewalBumpsFence,
        Flaw::UncheckedRelease,
        Flaw::NeverExpire,
        Flaw::ConstantFence,
        Flaw::HoldIsRelease,
        Flaw::GuardTakes,
    ] {
        match check_store_contract(&Flawed::harness(flaw), &run).await {
            Ok(()) => missed.push(format!("{flaw:?} passed")),
            Err(e) => eprintln!("{flaw:?}: {e}\n"),
        }
    }
    assert!(missed.is_empty(), "{missed:#?}");
}

/// The case of a release after an intrusion fails on a store whose release frees the mutex
/// whoever asks (and so says "released" to an owner changed by hand), and passes on the
/// store without the flaw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_after_intrusion_reports_an_unchecked_release() {
    // The owner rewritten in place, as a hand does: no push tells the owner before its
    // release.
    let harness = |flaw| {
        Flawed::harness(flaw)
            .with_intruder(|s, m, owner| s.inner.overwrite_owner(m, owner, suite::INTRUDER))
    };
    if let Err(e) = suite::release_after_intrusion_is_lost(&harness(Flaw::None)).await {
        panic!("failed on the store without flaws: {e}");
    }
    let e = suite::release_after_intrusion_is_lost(&harness(Flaw::UncheckedRelease))
        .await
        .expect_err("a release that frees whoever's mutex must fail the case");
    assert!(e.to_string().contains("returned Ok"), "{e}");
}
