//! Proof that the multi-lock cases can fail: deliberately broken multi-locks, built from
//! single lockers the way a hand-written multi-lock goes wrong, are each reported by the
//! case made for their flaw (and `simba_core::MultiLocker` passes them all, in
//! `memory_conformance.rs`).

use std::sync::{Arc, Mutex};

use simba_core::backend::BoxFuture;
use simba_core::{Error, LockGuard, Locker, PartLost, Result};
use simba_test_kit::memory::MemoryHarness;
use simba_test_kit::suite::{self, MultiHold, MultiLockUnderTest, MultiWait};

/// What a broken multi-lock gets wrong.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Flaw {
    /// Takes the parts in the caller's order, not one canonical order.
    CallerOrder,
    /// On a give-up, forgets the parts it had won instead of releasing them.
    KeepsPartsOnGiveUp,
    /// Its loss signal watches only the first part.
    WatchesFirstPartOnly,
    /// Its release frees only the first part.
    ReleasesFirstPartOnly,
    /// Takes only the first part, and says it holds them all.
    TakesFirstPartOnly,
}

/// A multi-lock with one flaw; what it forgets stays held until the test ends.
#[derive(Clone)]
struct Broken {
    flaw: Flaw,
    forgotten: Arc<Mutex<Vec<LockGuard>>>,
}

impl Broken {
    fn new(flaw: Flaw) -> Self {
        Broken {
            flaw,
            forgotten: Arc::default(),
        }
    }

    fn forget(&self, guards: impl IntoIterator<Item = LockGuard>) {
        self.forgotten
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(guards);
    }

    async fn take(&self, mut parts: Vec<Locker>, wait: MultiWait) -> Result<Box<dyn MultiHold>> {
        if self.flaw != Flaw::CallerOrder {
            parts.sort_by(|a, b| a.mutex().cmp(b.mutex()));
            parts.dedup_by(|a, b| a.mutex() == b.mutex());
        }
        if self.flaw == Flaw::TakesFirstPartOnly {
            parts.truncate(1);
        }
        let mut held = Vec::new();
        for part in &parts {
            let got = match wait {
                MultiWait::Forever => part.acquire().await,
                MultiWait::Timeout(d) => part.acquire_timeout(d).await,
                MultiWait::Try => part.try_acquire().await,
            };
            match got {
                Ok(g) => held.push(g),
                Err(e) => {
                    if self.flaw == Flaw::KeepsPartsOnGiveUp {
                        self.forget(held);
                    } else {
                        for g in held {
                            let _ = g.release().await;
                        }
                    }
                    return Err(e);
                }
            }
        }
        Ok(Box::new(Hold {
            owner: self.clone(),
            parts: held,
        }))
    }
}

impl MultiLockUnderTest for Broken {
    fn acquire(
        &self,
        parts: Vec<Locker>,
        wait: MultiWait,
    ) -> BoxFuture<'_, Result<Box<dyn MultiHold>>> {
        Box::pin(self.take(parts, wait))
    }
}

struct Hold {
    owner: Broken,
    parts: Vec<LockGuard>,
}

impl MultiHold for Hold {
    fn fences(&self) -> Vec<(String, u64)> {
        let mut fences: Vec<(String, u64)> = self
            .parts
            .iter()
            .map(|g| (g.mutex().to_owned(), g.fence()))
            .collect();
        if self.owner.flaw == Flaw::TakesFirstPartOnly {
            // Claims the names it never took, with the first part's fence.
            let fence = fences.first().map_or(1, |f| f.1);
            for other in claimed(&self.parts) {
                fences.push((other, fence));
            }
        }
        fences
    }

    fn is_held(&self) -> bool {
        self.parts.iter().all(LockGuard::is_held)
    }

    fn lost(&self) -> BoxFuture<'_, PartLost> {
        Box::pin(async move {
            let watched: &[LockGuard] = match self.owner.flaw {
                Flaw::WatchesFirstPartOnly => &self.parts[..1],
                _ => &self.parts,
            };
            loop {
                for g in watched {
                    if !g.is_held() {
                        return PartLost {
                            mutex: g.mutex().to_owned(),
                            reason: g.lost().await,
                        };
                    }
                }
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        })
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move {
            let Hold { owner, mut parts } = *self;
            if owner.flaw == Flaw::ReleasesFirstPartOnly {
                owner.forget(parts.drain(1..));
            }
            let mut first: Result<()> = Ok(());
            for g in parts {
                let r = g.release().await;
                if first.is_ok() {
                    first = r;
                }
            }
            first
        })
    }
}

/// The names the `TakesFirstPartOnly` flaw claims: the suite names parts `<base>_a`,
/// `<base>_b`, …; it claims the next two.
fn claimed(parts: &[LockGuard]) -> Vec<String> {
    let Some(first) = parts.first() else {
        return Vec::new();
    };
    let base = first
        .mutex()
        .trim_end_matches(|c: char| c.is_ascii_lowercase());
    ["b", "c"].iter().map(|s| format!("{base}{s}")).collect()
}

fn harness() -> MemoryHarness {
    MemoryHarness::memory()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caller_order_deadlocks_and_is_caught() {
    let e = suite::multi_lock_no_deadlock_with(&harness(), &Broken::new(Flaw::CallerOrder))
        .await
        .expect_err("a multi-lock that takes parts in the caller's order must deadlock");
    assert!(e.to_string().contains("deadlock"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_kept_on_give_up_are_caught() {
    let e =
        suite::multi_lock_no_partial_hold_with(&harness(), &Broken::new(Flaw::KeepsPartsOnGiveUp))
            .await
            .expect_err("a multi-lock that keeps what it won on a give-up must fail");
    assert!(e.to_string().contains("a part stayed held"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loss_signal_of_the_first_part_only_is_caught() {
    let e = suite::multi_lock_lost_part_with(&harness(), &Broken::new(Flaw::WatchesFirstPartOnly))
        .await
        .expect_err("a multi-lock whose loss signal misses a part must fail");
    assert!(e.to_string().contains("loss signal"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_of_the_first_part_only_is_caught() {
    let e = suite::multi_lock_release_frees_all_with(
        &harness(),
        &Broken::new(Flaw::ReleasesFirstPartOnly),
    )
    .await
    .expect_err("a multi-lock whose release forgets parts must fail");
    assert!(e.to_string().contains("still held after"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holding_the_first_part_only_is_caught() {
    let broken = Broken::new(Flaw::TakesFirstPartOnly);
    let e = suite::multi_lock_release_frees_all_with(&harness(), &broken)
        .await
        .expect_err("a multi-lock that takes one part only must fail");
    assert!(
        e.to_string().contains("while the multi-lock held it"),
        "{e}"
    );
    let e = suite::multi_lock_with_singles_with(&harness(), &broken)
        .await
        .expect_err("and a single locker of the other part meets it");
    assert!(
        e.to_string().contains("while another party holds it"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_core_multi_lock_passes_the_cases_through_the_same_trait() {
    let core = suite::CoreMultiLock;
    suite::multi_lock_no_partial_hold_with(&harness(), &core)
        .await
        .expect("MultiLocker");
    suite::multi_lock_release_frees_all_with(&harness(), &core)
        .await
        .expect("MultiLocker");
    assert!(matches!(
        core.acquire(Vec::new(), MultiWait::Try).await,
        Err(Error::InvalidConfig { .. })
    ));
}
