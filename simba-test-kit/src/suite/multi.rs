//! Conformance cases of multi-locks: several mutexes taken together, as one guard.
//!
//! Each case runs [`simba_core::MultiLocker`] ([`CoreMultiLock`]) over the backend; its
//! `_with` form takes any [`MultiLockUnderTest`], so the kit's own tests can show that a
//! deliberately broken multi-lock fails it (`tests/broken_multi.rs`).
//!
//! Every party of a case uses a factory of its own, as a separate process would.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use simba_core::backend::BoxFuture;
use simba_core::{
    ContendServiceFactory, Error, Locker, LossReason, MultiGuard, MultiLocker, PartLost,
};
use tokio::time::Instant;

use super::{CaseError, CaseResult, Harness, SuiteTiming, acquire_bound, within};
use crate::support::unique_name;

/// How a multi-lock under test is asked to wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MultiWait {
    /// `acquire`: until every part is held.
    Forever,
    /// `acquire_timeout`: give up after this long.
    Timeout(Duration),
    /// `try_acquire`: one attempt per part.
    Try,
}

/// A multi-lock implementation, as the multi-lock cases drive it.
pub trait MultiLockUnderTest: Send + Sync {
    /// Acquires the mutexes of `parts` (one locker per name, in the caller's order) as
    /// `wait` says.
    fn acquire(
        &self,
        parts: Vec<Locker>,
        wait: MultiWait,
    ) -> BoxFuture<'_, simba_core::Result<Box<dyn MultiHold>>>;
}

/// What a multi-lock under test returns: the cases' view of a [`MultiGuard`].
pub trait MultiHold: Send + Sync {
    /// Each mutex with its fence.
    fn fences(&self) -> Vec<(String, u64)>;
    /// Whether every part stands.
    fn is_held(&self) -> bool;
    /// Resolves when any part ends.
    fn lost(&self) -> BoxFuture<'_, PartLost>;
    /// Releases every part.
    fn release(self: Box<Self>) -> BoxFuture<'static, simba_core::Result<()>>;
}

/// [`simba_core::MultiLocker`], as the cases drive it.
#[derive(Debug, Clone, Copy, Default)]
pub struct CoreMultiLock;

impl MultiLockUnderTest for CoreMultiLock {
    fn acquire(
        &self,
        parts: Vec<Locker>,
        wait: MultiWait,
    ) -> BoxFuture<'_, simba_core::Result<Box<dyn MultiHold>>> {
        Box::pin(async move {
            let multi = MultiLocker::from_lockers(parts)?;
            let guard = match wait {
                MultiWait::Forever => multi.acquire().await,
                MultiWait::Timeout(d) => multi.acquire_timeout(d).await,
                MultiWait::Try => multi.try_acquire().await,
            }?;
            Ok(Box::new(guard) as Box<dyn MultiHold>)
        })
    }
}

impl MultiHold for MultiGuard {
    fn fences(&self) -> Vec<(String, u64)> {
        MultiGuard::fences(self)
            .into_iter()
            .map(|(m, f)| (m.to_owned(), f))
            .collect()
    }
    fn is_held(&self) -> bool {
        MultiGuard::is_held(self)
    }
    fn lost(&self) -> BoxFuture<'_, PartLost> {
        Box::pin(MultiGuard::lost(self))
    }
    fn release(self: Box<Self>) -> BoxFuture<'static, simba_core::Result<()>> {
        Box::pin(MultiGuard::release(*self))
    }
}

/// `count` fresh mutex names that sort in the order they are returned.
fn names(prefix: &str, count: usize) -> Vec<String> {
    let base = unique_name(prefix);
    (0..count)
        .map(|i| format!("{base}_{}", char::from(b'a' + u8::try_from(i).unwrap_or(0))))
        .collect()
}

fn lockers(
    f: &Arc<dyn ContendServiceFactory>,
    names: &[impl AsRef<str>],
) -> Result<Vec<Locker>, CaseError> {
    Ok(names
        .iter()
        .map(|n| Locker::new(f.clone(), n.as_ref()))
        .collect::<simba_core::Result<Vec<_>>>()?)
}

/// Marks `names` in use by `who`; a name already in use is a violation of mutual exclusion.
struct InUse(Vec<(String, AtomicBool)>);

impl InUse {
    fn new(names: &[String]) -> Self {
        InUse(
            names
                .iter()
                .map(|n| (n.clone(), AtomicBool::new(false)))
                .collect(),
        )
    }

    fn enter(&self, who: &str, names: &[String]) -> CaseResult {
        for (name, flag) in &self.0 {
            if names.contains(name) && flag.swap(true, Ordering::SeqCst) {
                return Err(CaseError(format!(
                    "{who} holds mutex {name:?} while another party holds it"
                )));
            }
        }
        Ok(())
    }

    fn leave(&self, names: &[String]) {
        for (name, flag) in &self.0 {
            if names.contains(name) {
                flag.store(false, Ordering::SeqCst);
            }
        }
    }
}

/// A third party's `try_acquire` through `locker` succeeds (and is released); `failed`
/// says what it means when it does not.
async fn takes_at_once(locker: &Locker, failed: impl FnOnce(Error) -> String) -> CaseResult {
    match within(
        "a third party's try_acquire",
        Duration::from_secs(10),
        locker.try_acquire(),
    )
    .await?
    {
        Ok(g) => Ok(g.release().await?),
        Err(e) => Err(CaseError(failed(e))),
    }
}

/// The bound for one multi-lock acquisition behind one other holder: two handoffs, each
/// at most a failover (a handoff that found no push waits for the lease), generous for a
/// loaded machine. A deadlock never ends, so it exceeds any bound.
fn round_bound(h: &dyn Harness) -> Duration {
    acquire_bound(&h.capabilities(SuiteTiming::SHORT)) * 2 + Duration::from_secs(5)
}

/// Two processes ask for the same two mutexes in opposite orders, at the same instant,
/// round after round: every round completes (no deadlock) and they never hold at once.
pub async fn multi_lock_no_deadlock(h: &dyn Harness) -> CaseResult {
    multi_lock_no_deadlock_with(h, &CoreMultiLock).await
}

/// [`multi_lock_no_deadlock`] for any multi-lock.
pub async fn multi_lock_no_deadlock_with(
    h: &dyn Harness,
    imp: &dyn MultiLockUnderTest,
) -> CaseResult {
    const ROUNDS: usize = 20;
    let set = names("multi_order", 2);
    let in_use = InUse::new(&set);
    let barrier = tokio::sync::Barrier::new(2);
    let bound = round_bound(h);
    let f1 = h.factory(SuiteTiming::SHORT).await?;
    let f2 = h.factory(SuiteTiming::SHORT).await?;
    let contender = |f: Arc<dyn ContendServiceFactory>, order: Vec<String>| {
        let (in_use, barrier, set) = (&in_use, &barrier, &set);
        async move {
            let who = format!("the contender asking for {order:?}");
            for round in 0..ROUNDS {
                within("waiting for the other contender", bound, barrier.wait()).await?;
                let hold = within(
                    &format!(
                        "round {round}: {who} did not get both mutexes (a deadlock between \
                         the two orders?)"
                    ),
                    bound,
                    imp.acquire(lockers(&f, &order)?, MultiWait::Forever),
                )
                .await??;
                in_use.enter(&who, set)?;
                tokio::task::yield_now().await;
                in_use.leave(set);
                hold.release().await?;
            }
            Ok::<(), CaseError>(())
        }
    };
    tokio::try_join!(
        contender(f1, vec![set[0].clone(), set[1].clone()]),
        contender(f2, vec![set[1].clone(), set[0].clone()]),
    )?;
    Ok(())
}

/// A multi-lock that times out waiting for its last part leaves none held: a third party
/// takes the first part at once. The same after a `try_acquire` that would block.
pub async fn multi_lock_no_partial_hold(h: &dyn Harness) -> CaseResult {
    multi_lock_no_partial_hold_with(h, &CoreMultiLock).await
}

/// [`multi_lock_no_partial_hold`] for any multi-lock.
pub async fn multi_lock_no_partial_hold_with(
    h: &dyn Harness,
    imp: &dyn MultiLockUnderTest,
) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let set = names("multi_partial", 2);
    let holder = Locker::new(h.factory(SuiteTiming::SHORT).await?, &set[1])?;
    let multi = h.factory(SuiteTiming::SHORT).await?;
    let third = Locker::new(h.factory(SuiteTiming::SHORT).await?, &set[0])?;
    let held = within(
        "acquire the last part",
        acquire_bound(&caps),
        holder.acquire(),
    )
    .await??;
    for wait in [
        MultiWait::Timeout(Duration::from_millis(600)),
        MultiWait::Try,
    ] {
        let t0 = Instant::now();
        let r = within(
            &format!("{wait:?} on a set with a held part"),
            acquire_bound(&caps) + Duration::from_secs(10),
            imp.acquire(lockers(&multi, &[&set[0], &set[1]])?, wait),
        )
        .await?;
        let took = t0.elapsed();
        match (wait, r) {
            (MultiWait::Timeout(d), Err(Error::Timeout { .. })) => {
                ensure!(
                    took >= d,
                    "gave up after {took:?}, before the wait of {d:?}"
                );
            }
            (MultiWait::Try, Err(Error::WouldBlock { .. })) => {}
            (_, Ok(hold)) => {
                let fences = hold.fences();
                let _ = hold.release().await;
                return Err(CaseError(format!(
                    "{wait:?} acquired {fences:?} although {:?} is held by another",
                    set[1]
                )));
            }
            (_, Err(e)) => {
                return Err(CaseError(format!("{wait:?}: unexpected error {e}")));
            }
        }
        takes_at_once(&third, |e| {
            format!(
                "after the multi-lock gave up ({wait:?}), a third party could not take {:?}: \
                 {e} (a part stayed held)",
                set[0]
            )
        })
        .await?;
    }
    ensure!(held.is_held(), "the holder lost its mutex meanwhile");
    held.release().await?;
    Ok(())
}

/// When one part is lost (its backend connection goes silent), the multi-lock's loss
/// signal fires naming it, the guard is no longer held, its release says so, and the
/// other part is released.
pub async fn multi_lock_lost_part(h: &dyn Harness) -> CaseResult {
    multi_lock_lost_part_with(h, &CoreMultiLock).await
}

/// [`multi_lock_lost_part`] for any multi-lock.
pub async fn multi_lock_lost_part_with(
    h: &dyn Harness,
    imp: &dyn MultiLockUnderTest,
) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let set = names("multi_lost", 2);
    let fa = h.factory(SuiteTiming::SHORT).await?;
    // The last part goes through the fault point: a multi-lock that watches only its
    // first part misses the loss.
    let (fb, fault) = h.faulty_factory(SuiteTiming::SHORT).await?;
    let parts = vec![Locker::new(fa, &set[0])?, Locker::new(fb, &set[1])?];
    let hold = within(
        "acquire a free set",
        acquire_bound(&caps) * 2,
        imp.acquire(parts, MultiWait::Forever),
    )
    .await??;
    ensure!(hold.is_held(), "not held right after the acquisition");
    fault.partition().await?;
    let t0 = Instant::now();
    let lost = within(
        "the loss signal after one part's backend went silent",
        caps.loss_bound + Duration::from_secs(2),
        hold.lost(),
    )
    .await;
    let took = t0.elapsed();
    fault.heal().await?;
    let lost = lost?;
    ensure!(
        lost.mutex == set[1],
        "the loss signal named {:?}, not the part that was lost ({:?})",
        lost.mutex,
        set[1]
    );
    ensure!(
        matches!(
            lost.reason,
            LossReason::LeaseExpired | LossReason::SessionLost
        ),
        "loss reported as {:?}",
        lost.reason
    );
    ensure!(
        took <= caps.loss_bound,
        "loss reported after {took:?}, beyond {:?}",
        caps.loss_bound
    );
    ensure!(!hold.is_held(), "still held after a part was lost");
    let r = within("release", Duration::from_secs(10), hold.release()).await?;
    ensure!(
        matches!(&r, Err(Error::Lost { mutex, .. }) if *mutex == set[1]),
        "release after a lost part must say Error::Lost for it, got {r:?}"
    );
    let third = Locker::new(h.factory(SuiteTiming::SHORT).await?, &set[0])?;
    takes_at_once(&third, |e| {
        format!(
            "the part that was still held ({:?}) was not released: {e}",
            set[0]
        )
    })
    .await
}

/// While a multi-lock holds, nobody else can take any part; its fences are positive and
/// name every part; its release frees every part at once.
pub async fn multi_lock_release_frees_all(h: &dyn Harness) -> CaseResult {
    multi_lock_release_frees_all_with(h, &CoreMultiLock).await
}

/// [`multi_lock_release_frees_all`] for any multi-lock.
pub async fn multi_lock_release_frees_all_with(
    h: &dyn Harness,
    imp: &dyn MultiLockUnderTest,
) -> CaseResult {
    let caps = h.capabilities(SuiteTiming::SHORT);
    let set = names("multi_release", 3);
    let f = h.factory(SuiteTiming::SHORT).await?;
    let others = h.factory(SuiteTiming::SHORT).await?;
    let hold = within(
        "acquire a free set",
        acquire_bound(&caps) * 3,
        imp.acquire(
            lockers(&f, &[&set[2], &set[0], &set[1], &set[0]])?,
            MultiWait::Forever,
        ),
    )
    .await??;
    let fences = hold.fences();
    let mut named: Vec<&str> = fences.iter().map(|(m, _)| m.as_str()).collect();
    named.sort_unstable();
    ensure!(
        named == set.iter().map(String::as_str).collect::<Vec<_>>(),
        "fences {fences:?} do not name each of {set:?} once"
    );
    ensure!(
        fences.iter().all(|(_, f)| *f > 0),
        "a fence of 0: {fences:?}"
    );
    ensure!(hold.is_held(), "not held right after the acquisition");
    let third = lockers(&others, &set.iter().collect::<Vec<_>>())?;
    for locker in &third {
        let r = within(
            "a third party's try_acquire",
            Duration::from_secs(10),
            locker.try_acquire(),
        )
        .await?;
        if let Ok(g) = r {
            let _ = g.release().await;
            return Err(CaseError(format!(
                "a third party took {:?} while the multi-lock held it",
                locker.mutex()
            )));
        }
    }
    within("release", Duration::from_secs(10), hold.release()).await??;
    for locker in &third {
        takes_at_once(locker, |e| {
            format!(
                "{:?} was still held after the multi-lock's release: {e}",
                locker.mutex()
            )
        })
        .await?;
    }
    Ok(())
}

/// Two multi-locks (in opposite orders) and a single locker on each part contend round
/// after round: nobody shares a mutex with anybody, and everybody gets through.
pub async fn multi_lock_with_singles(h: &dyn Harness) -> CaseResult {
    multi_lock_with_singles_with(h, &CoreMultiLock).await
}

/// [`multi_lock_with_singles`] for any multi-lock.
pub async fn multi_lock_with_singles_with(
    h: &dyn Harness,
    imp: &dyn MultiLockUnderTest,
) -> CaseResult {
    const ROUNDS: usize = 8;
    let set = names("multi_singles", 2);
    let in_use = InUse::new(&set);
    // Four parties, each possibly behind the three others.
    let bound = round_bound(h) * 2;
    // A short hold, so that the parties' holds can meet: the work, not a synchronisation.
    let hold_for = Duration::from_millis(10);
    let multi = |order: Vec<String>| {
        let in_use = &in_use;
        let set = &set;
        async move {
            let f = h.factory(SuiteTiming::SHORT).await?;
            let who = format!("the multi-lock of {order:?}");
            for round in 0..ROUNDS {
                let hold = within(
                    &format!("round {round}: {who}"),
                    bound,
                    imp.acquire(lockers(&f, &order)?, MultiWait::Forever),
                )
                .await??;
                in_use.enter(&who, set)?;
                tokio::time::sleep(hold_for).await;
                in_use.leave(set);
                hold.release().await?;
            }
            Ok::<(), CaseError>(())
        }
    };
    let single = |name: &String| {
        let in_use = &in_use;
        let name = name.clone();
        async move {
            let locker = Locker::new(h.factory(SuiteTiming::SHORT).await?, &name)?;
            let who = format!("the single locker of {name:?}");
            let mine = [name];
            for round in 0..ROUNDS {
                let g = within(&format!("round {round}: {who}"), bound, locker.acquire()).await??;
                in_use.enter(&who, &mine)?;
                tokio::time::sleep(hold_for).await;
                in_use.leave(&mine);
                g.release().await?;
            }
            Ok::<(), CaseError>(())
        }
    };
    tokio::try_join!(
        multi(vec![set[0].clone(), set[1].clone()]),
        multi(vec![set[1].clone(), set[0].clone()]),
        single(&set[0]),
        single(&set[1]),
    )?;
    Ok(())
}
