//! Read-write lock cases: what [`RwLock`] must keep on every backend. Each case takes an
//! [`RwSource`] — read-write locks over connections of their own, as separate processes
//! would have — and returns `Ok(())` or a [`CaseError`] saying what went wrong.
//! [`rw_lock_tests!`](crate::rw_lock_tests) expands them into one `#[tokio::test]` each, in
//! a module `rw_lock`; [`RW_CASES`] names them.
//!
//! Waits are bounded generously (a loaded machine's round trips), and each bound says why.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use simba_core::backend::{BoxFuture, PermitStore};
use simba_core::{Error, LeaseConfig, LeaseServiceFactory, RwLock};
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep, timeout};

use crate::store_cases::StoreSource;
use crate::suite::{CaseError, CaseResult, SetupError};
use crate::support::unique_name;

/// A backend's read-write locks as the cases see them. Every [`StoreSource`] whose store is
/// also a [`PermitStore`] is one; a backend whose semaphores are a store of their own
/// (ZooKeeper) implements it directly.
pub trait RwSource: Send + Sync {
    /// The backend's name in failure messages.
    fn name(&self) -> String;

    /// The read-write lock `lock` timed by `config`, over connections of its own.
    fn rwlock<'a>(
        &'a self,
        lock: &'a str,
        config: LeaseConfig,
    ) -> BoxFuture<'a, Result<RwLock, SetupError>>;

    /// Whether the backend pushes releases to waiters, rather than leaving them to poll.
    fn pushes_release(&self) -> bool;
}

impl<T> RwSource for T
where
    T: StoreSource,
    T::Store: PermitStore,
{
    fn name(&self) -> String {
        StoreSource::name(self)
    }

    fn rwlock<'a>(
        &'a self,
        lock: &'a str,
        config: LeaseConfig,
    ) -> BoxFuture<'a, Result<RwLock, SetupError>> {
        Box::pin(async move {
            let store = StoreSource::store(self).await?;
            let factory = LeaseServiceFactory::new(store, config)?;
            Ok(RwLock::from_factory(&factory, lock)?)
        })
    }

    fn pushes_release(&self) -> bool {
        StoreSource::pushes_release(self)
    }
}

/// The names of every read-write lock case, in the order
/// [`rw_lock_tests!`](crate::rw_lock_tests) runs them.
pub const RW_CASES: &[&str] = crate::__rw_cases!(names);

/// Every read-write lock case, written once: `$mode` picks what to expand them into.
#[doc(hidden)]
#[macro_export]
macro_rules! __rw_cases {
    ($($mode:tt)*) => {
        $crate::__expand_cases! { @family rw_lock, rw_cases, RwSource, "read-write lock",
            $($mode)*;
            rw_readers_share, rw_writer_excludes_everyone, rw_readers_exclude_a_writer,
            rw_a_waiting_writer_goes_first, rw_fences_order_readers_and_writers,
            rw_never_a_writer_beside_anyone
        }
    };
}

/// Expands every read-write lock case into one `#[tokio::test]` (in a module `rw_lock`).
///
/// The argument is an expression evaluated inside each (async) test that yields a value
/// implementing [`RwSource`] (every [`StoreSource`] over a [`PermitStore`] does); it may
/// `.await`.
///
/// ```no_run
/// simba_test_kit::rw_lock_tests!(simba_test_kit::memory::MemoryHarness::memory());
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! rw_lock_tests {
    ($source:expr) => {
        $crate::__rw_cases!(tests $source);
    };
}

fn check(cond: bool, what: impl FnOnce() -> String) -> CaseResult {
    if cond { Ok(()) } else { Err(CaseError(what())) }
}

/// A lease long enough that a loaded machine's round trips do not end it halfway through a
/// case.
fn config(pushes: bool) -> LeaseConfig {
    LeaseConfig {
        request_timeout: Duration::from_secs(2),
        retry_interval: Duration::from_millis(100),
        // Backends that cannot push: waiters look every 200 ms.
        waiter_poll: (!pushes).then_some(Duration::from_millis(200)),
        ..LeaseConfig::with_lease(Duration::from_secs(4), Duration::from_secs(2))
    }
}

/// `n` read-write locks of one name, each over connections of its own.
async fn locks<S: RwSource>(src: &S, name: &str, n: usize) -> Result<Vec<RwLock>, CaseError> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(src.rwlock(name, config(src.pushes_release())).await?);
    }
    Ok(v)
}

/// The longest wait for a lock that a case expects to get: many round trips on a loaded
/// machine, far from any lease's end.
const GET: Duration = Duration::from_secs(20);

/// Three readers on three connections hold at once, and the backend lists all three.
pub async fn rw_readers_share<S: RwSource>(src: &S) -> CaseResult {
    let name = unique_name("rw_share");
    let l = locks(src, &name, 3).await?;
    let mut guards = Vec::new();
    for lock in &l {
        guards.push(lock.read_timeout(GET).await?);
    }
    check(guards.iter().all(|g| g.is_held()), || {
        "a reader stopped holding beside the others".into()
    })?;
    let listed = l[0].readers().await?.holders.len();
    check(listed == 3, || {
        format!("the backend lists {listed} readers, not 3")
    })?;
    for g in guards {
        g.release().await?;
    }
    Ok(())
}

/// While a writer holds, another connection can neither read nor write: a try fails at
/// once, a timed read gives up holding nothing; once the writer releases, a reader gets in.
pub async fn rw_writer_excludes_everyone<S: RwSource>(src: &S) -> CaseResult {
    let name = unique_name("rw_excl");
    let l = locks(src, &name, 2).await?;
    let w = l[0].write_timeout(GET).await?;
    match l[1].try_read().await {
        Err(Error::WouldBlock { .. }) => {}
        Ok(_) => return Err(CaseError("a reader got in beside a writer".into())),
        Err(e) => return Err(CaseError(format!("try_read beside a writer: {e}"))),
    }
    match l[1].try_write().await {
        Err(Error::WouldBlock { .. }) => {}
        Ok(_) => return Err(CaseError("a second writer got in".into())),
        Err(e) => return Err(CaseError(format!("try_write beside a writer: {e}"))),
    }
    match l[1].read_timeout(Duration::from_millis(300)).await {
        Err(Error::Timeout { .. }) => {}
        Ok(_) => return Err(CaseError("a timed reader got in beside a writer".into())),
        Err(e) => return Err(CaseError(format!("read_timeout beside a writer: {e}"))),
    }
    let readers = l[0].readers().await?.holders.len();
    check(readers == 0, || {
        format!("{readers} readers listed while a writer holds")
    })?;
    check(w.is_held(), || "the writer stopped holding".into())?;
    w.release().await?;
    let r = l[1].read_timeout(GET).await?;
    r.release().await?;
    Ok(())
}

/// While a reader holds, a writer cannot get in: a try fails at once, and a writer that
/// waits gets in only after the reader released.
pub async fn rw_readers_exclude_a_writer<S: RwSource>(src: &S) -> CaseResult {
    let name = unique_name("rw_wait");
    let mut l = locks(src, &name, 2).await?;
    let writer_lock = l.pop().ok_or_else(|| CaseError("no lock".into()))?;
    let reader_lock = l.pop().ok_or_else(|| CaseError("no lock".into()))?;
    let r = reader_lock.read_timeout(GET).await?;
    match writer_lock.try_write().await {
        Err(Error::WouldBlock { .. }) => {}
        Ok(_) => return Err(CaseError("a writer got in beside a reader".into())),
        Err(e) => return Err(CaseError(format!("try_write beside a reader: {e}"))),
    }
    let released = Arc::new(AtomicBool::new(false));
    let seen = released.clone();
    let writer = tokio::spawn(async move {
        let w = writer_lock.write_timeout(GET).await?;
        let after = seen.load(Ordering::SeqCst);
        w.release().await?;
        Ok::<_, Error>(after)
    });
    // Long enough for the writer to be well into its wait (taken the gate, reading the
    // readers); what is checked is that it is not in.
    sleep(Duration::from_millis(300)).await;
    check(!writer.is_finished(), || {
        "the writer finished while a reader held".into()
    })?;
    released.store(true, Ordering::SeqCst);
    r.release().await?;
    let after = writer
        .await
        .map_err(|e| CaseError(format!("writer task: {e}")))??;
    check(after, || {
        "the writer got in before the reader released".into()
    })
}

/// A writer waiting for a reader to leave goes before every reader that comes after it:
/// a new reader is refused while the writer waits, and a reader that waits gets in only
/// after the writer released (writers never starve).
pub async fn rw_a_waiting_writer_goes_first<S: RwSource>(src: &S) -> CaseResult {
    let name = unique_name("rw_pref");
    let mut l = locks(src, &name, 3).await?;
    let late = l.pop().ok_or_else(|| CaseError("no lock".into()))?;
    let writer_lock = l.pop().ok_or_else(|| CaseError("no lock".into()))?;
    let first = l.pop().ok_or_else(|| CaseError("no lock".into()))?;
    let r1 = first.read_timeout(GET).await?;
    let writer_done = Arc::new(AtomicBool::new(false));
    let done = writer_done.clone();
    let writer = tokio::spawn(async move {
        let w = writer_lock.write_timeout(GET).await?;
        // Held a little, so that a reader let in beside it would be seen.
        sleep(Duration::from_millis(100)).await;
        done.store(true, Ordering::SeqCst);
        w.release().await
    });
    // Until the writer has taken the gate, a new reader still gets in (and leaves at once);
    // after, it is refused. Bounded: the gate is taken within a few round trips.
    let deadline = Instant::now() + GET;
    loop {
        match late.try_read().await {
            Ok(g) => g.release().await?,
            Err(Error::WouldBlock { .. }) => break,
            Err(e) => return Err(CaseError(format!("try_read: {e}"))),
        }
        check(Instant::now() < deadline, || {
            "the waiting writer never kept new readers out".into()
        })?;
        sleep(Duration::from_millis(10)).await;
    }
    check(!writer.is_finished(), || {
        "the writer got in while a reader held".into()
    })?;
    let reader = tokio::spawn(async move {
        let g = late.read_timeout(GET).await?;
        let after = writer_done.load(Ordering::SeqCst);
        g.release().await?;
        Ok::<_, Error>(after)
    });
    r1.release().await?;
    writer
        .await
        .map_err(|e| CaseError(format!("writer task: {e}")))??;
    let after = reader
        .await
        .map_err(|e| CaseError(format!("reader task: {e}")))??;
    check(after, || {
        "a reader that came after a waiting writer got in before it".into()
    })
}

/// Fences: a writer's is greater than every earlier reader's and writer's; a reader's is
/// greater than every earlier writer's.
pub async fn rw_fences_order_readers_and_writers<S: RwSource>(src: &S) -> CaseResult {
    let name = unique_name("rw_fence");
    let l = locks(src, &name, 2).await?;
    let w1 = l[0].write_timeout(GET).await?;
    let f_w1 = w1.fence();
    w1.release().await?;
    let r1 = l[0].read_timeout(GET).await?;
    let r2 = l[1].read_timeout(GET).await?;
    let (f_r1, f_r2) = (r1.fence(), r2.fence());
    r1.release().await?;
    r2.release().await?;
    let w2 = l[1].write_timeout(GET).await?;
    let f_w2 = w2.fence();
    w2.release().await?;
    check(f_r1 > f_w1 && f_r2 > f_w1, || {
        format!("readers' fences {f_r1}, {f_r2} not above the earlier writer's {f_w1}")
    })?;
    check(f_w2 > f_r1 && f_w2 > f_r2, || {
        format!("the writer's fence {f_w2} not above the earlier readers' {f_r1}, {f_r2}")
    })
}

/// Six tasks on three connections read and write at random, holding a little each time; a
/// checker counts who believes it holds (from the return of the acquisition to just before
/// the release): never a writer beside a reader or another writer, and every reader's
/// fence above the last writer's it could have followed.
pub async fn rw_never_a_writer_beside_anyone<S: RwSource>(src: &S) -> CaseResult {
    let name = unique_name("rw_inv");
    let l: Vec<Arc<RwLock>> = locks(src, &name, 3)
        .await?
        .into_iter()
        .map(Arc::new)
        .collect();
    let readers = Arc::new(AtomicUsize::new(0));
    let writers = Arc::new(AtomicUsize::new(0));
    let violations = Arc::new(AtomicUsize::new(0));
    let last_write = Arc::new(AtomicU64::new(0));
    let reads = Arc::new(AtomicUsize::new(0));
    let mut tasks = JoinSet::new();
    for i in 0..6usize {
        let lock = l[i % l.len()].clone();
        let (readers, writers, violations, last_write, reads) = (
            readers.clone(),
            writers.clone(),
            violations.clone(),
            last_write.clone(),
            reads.clone(),
        );
        tasks.spawn(async move {
            for round in 0..6usize {
                // A fixed mix: every task writes twice and reads four times.
                if (i + round) % 3 == 0 {
                    let w = lock.write_timeout(Duration::from_secs(60)).await?;
                    let others = readers.load(Ordering::SeqCst);
                    if writers.fetch_add(1, Ordering::SeqCst) > 0 || others > 0 {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                    last_write.fetch_max(w.fence(), Ordering::SeqCst);
                    sleep(Duration::from_millis(15)).await;
                    writers.fetch_sub(1, Ordering::SeqCst);
                    w.release().await?;
                } else {
                    let r = lock.read_timeout(Duration::from_secs(60)).await?;
                    readers.fetch_add(1, Ordering::SeqCst);
                    if writers.load(Ordering::SeqCst) > 0
                        || r.fence() < last_write.load(Ordering::SeqCst)
                    {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                    reads.fetch_add(1, Ordering::SeqCst);
                    sleep(Duration::from_millis(15)).await;
                    readers.fetch_sub(1, Ordering::SeqCst);
                    r.release().await?;
                }
            }
            Ok::<_, Error>(())
        });
    }
    // Bound: 36 acquisitions, each a few round trips and a 15 ms hold; minutes are only a
    // guard against a hang.
    let all = timeout(Duration::from_secs(180), async {
        while let Some(r) = tasks.join_next().await {
            r.map_err(|e| CaseError(format!("task: {e}")))??;
        }
        Ok::<_, CaseError>(())
    })
    .await;
    all.map_err(|_| CaseError("the tasks did not finish in 3 minutes".into()))??;
    let v = violations.load(Ordering::SeqCst);
    check(v == 0, || {
        format!(
            "{v} times a writer held beside another holder, or a reader's fence was below the last writer's"
        )
    })?;
    let n = reads.load(Ordering::SeqCst);
    check(n == 24, || format!("{n} reads of 24"))
}
