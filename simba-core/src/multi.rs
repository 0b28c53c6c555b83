//! [`MultiLocker`]: several mutexes taken together, in one canonical order, as one guard.
//!
//! Built on [`Locker`]: each part is the process-wide locker of its name, so a multi-lock
//! and single lockers of the same names exclude each other in the process and on the
//! backend alike. The parts are always taken in ascending byte order of their names,
//! whatever order the caller gave, and a part is only waited for while every part before
//! it in that order is held: two processes asking for the same set (or overlapping sets)
//! in different orders queue behind each other instead of each holding what the other
//! waits for.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{Error, LossReason, Result};
use crate::locker::{LockGuard, Locker};
use crate::service::ContendServiceFactory;

/// The most mutexes one [`MultiLocker`] takes together.
///
/// Each part holds a backend contender (a connection's worth of renewals on some
/// backends) for as long as the guard lives; a set larger than this is more likely a bug
/// than a plan.
pub const MAX_MULTI_LOCK_NAMES: usize = 32;

/// Acquires several mutexes together: all of them, or none.
///
/// The names are deduplicated and taken one after the other in ascending byte order
/// ([`MultiLocker::names`]), each through the process-wide [`Locker`] of its name. That
/// order is the same in every process (it depends on the names only), so two processes
/// that ask for `{a, b}` and `{b, a}` cannot each hold one part and wait for the other.
/// A part is waited for only while every earlier part is held; if an earlier part is
/// found lost meanwhile (a backend outage past its lease), everything held is released
/// and the acquisition starts over.
///
/// ```
/// # async fn demo() -> simba_core::Result<()> {
/// use std::sync::Arc;
/// use std::time::Duration;
/// use simba_core::{LeaseConfig, LeaseServiceFactory, Locker, MemoryStore};
///
/// let factory = Arc::new(LeaseServiceFactory::new(MemoryStore::new(), LeaseConfig::default())?);
/// // Another process may ask for ["orders", "invoices"]: both take "invoices" first.
/// let both = Locker::all(factory.clone(), ["orders", "invoices"])?;
/// assert_eq!(both.names().collect::<Vec<_>>(), ["invoices", "orders"]);
/// let guard = both.acquire_timeout(Duration::from_secs(30)).await?;
/// println!("invoices fence {:?}", guard.fence("invoices"));
/// tokio::select! {
///     lost = guard.lost() => eprintln!("stop: {lost}"),
///     _ = async { /* migrate both tables, sending the fences along */ } => {}
/// }
/// // Any part that ended before the release makes it `Error::Lost`; all are released.
/// guard.release().await?;
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(demo()).unwrap();
/// ```
#[derive(Clone)]
pub struct MultiLocker {
    /// One locker per name, in ascending order of the names, no name twice.
    parts: Vec<Locker>,
}

impl fmt::Debug for MultiLocker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiLocker")
            .field("mutexes", &self.names().collect::<Vec<_>>())
            .finish()
    }
}

/// How long an acquisition may wait.
#[derive(Clone, Copy)]
enum Wait {
    Forever,
    Until(Instant, Duration),
    Once,
}

/// The error for a set of names that is empty or too large.
fn bad_count(reason: String) -> Error {
    Error::InvalidConfig {
        field: "mutexes",
        reason,
    }
}

fn check_count(n: usize) -> Result<()> {
    if n == 0 {
        return Err(bad_count(
            "a multi-lock needs at least one mutex name".to_owned(),
        ));
    }
    if n > MAX_MULTI_LOCK_NAMES {
        return Err(bad_count(format!(
            "{n} distinct mutex names, more than the {MAX_MULTI_LOCK_NAMES} one multi-lock \
             takes; split the set, or guard the group of resources with one mutex of its own"
        )));
    }
    Ok(())
}

impl Locker {
    /// A [`MultiLocker`] of `names` from `factory`: see [`MultiLocker::new`].
    ///
    /// # Errors
    /// As [`MultiLocker::new`].
    pub fn all<I>(factory: Arc<dyn ContendServiceFactory>, names: I) -> Result<MultiLocker>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        MultiLocker::new(factory, names)
    }
}

impl MultiLocker {
    /// The multi-lock of `names` (in any order; duplicates count once) through `factory`.
    ///
    /// # Errors
    /// - [`Error::InvalidConfig`] (field `mutexes`) for no name at all, or more than
    ///   [`MAX_MULTI_LOCK_NAMES`] distinct names;
    /// - [`Error::InvalidName`] for a bad name.
    pub fn new<I>(factory: Arc<dyn ContendServiceFactory>, names: I) -> Result<Self>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let mut distinct: Vec<String> = Vec::new();
        for name in names {
            let name = name.as_ref();
            if !distinct.iter().any(|n| n == name) {
                // Counted as they come: a huge iterator is refused without being collected.
                check_count(distinct.len() + 1)?;
                distinct.push(name.to_owned());
            }
        }
        check_count(distinct.len())?;
        let lockers = distinct
            .iter()
            .map(|n| Locker::new(factory.clone(), n))
            .collect::<Result<Vec<_>>>()?;
        Self::from_lockers(lockers)
    }

    /// The multi-lock of the given lockers, which may come from different factories (each
    /// part is acquired through its own). A name given twice counts once (the first
    /// locker of the name is kept).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] (field `mutexes`) for no locker, or more than
    /// [`MAX_MULTI_LOCK_NAMES`] distinct names.
    pub fn from_lockers(lockers: impl IntoIterator<Item = Locker>) -> Result<Self> {
        let mut parts: Vec<Locker> = Vec::new();
        for locker in lockers {
            if !parts.iter().any(|p| p.mutex() == locker.mutex()) {
                check_count(parts.len() + 1)?;
                parts.push(locker);
            }
        }
        check_count(parts.len())?;
        // Stable, and names are distinct: the order depends on the names alone.
        parts.sort_by(|a, b| a.mutex().as_bytes().cmp(b.mutex().as_bytes()));
        Ok(MultiLocker { parts })
    }

    /// The mutex names, in the order they are acquired (ascending bytes).
    pub fn names(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.parts.iter().map(Locker::mutex)
    }

    /// The lockers of the parts, in the order they are acquired.
    pub fn lockers(&self) -> &[Locker] {
        &self.parts
    }

    /// Waits until this process holds every mutex of the set.
    ///
    /// # Errors
    /// [`Error::Shutdown`] if a part's service stopped while waiting (what was held is
    /// released first); nothing else: backend errors are retried.
    ///
    /// # Cancel safety
    /// As [`Locker::acquire`]: dropping the future leaves nothing held, in the
    /// background (the parts already won are released by their dropped guards, the part
    /// being acquired as a dropped `Locker::acquire` is). Await
    /// [`MultiLocker::settled`] before the process exits.
    pub async fn acquire(&self) -> Result<MultiGuard> {
        self.acquire_inner(Wait::Forever).await
    }

    /// Like [`MultiLocker::acquire`], giving up after `wait` in all.
    ///
    /// Honest, as [`Locker::acquire_timeout`]: it returns the guard of every part, or,
    /// when it gives up, it has released every part it had won (and stopped the
    /// acquisition under way, releasing what that may have won) before it returns.
    ///
    /// # Errors
    /// [`Error::Timeout`] naming the part it was waiting for when `wait` passed;
    /// [`Error::Shutdown`] as for `acquire`.
    ///
    /// # Cancel safety
    /// As [`MultiLocker::acquire`].
    pub async fn acquire_timeout(&self, wait: Duration) -> Result<MultiGuard> {
        let mode = match Instant::now().checked_add(wait) {
            Some(at) => Wait::Until(at, wait),
            None => Wait::Forever,
        };
        self.acquire_inner(mode).await
    }

    /// Tries once: one backend attempt per part, in order, without waiting behind
    /// another task of this process. On the first part that cannot be had, the parts won
    /// are released before it returns.
    ///
    /// # Errors
    /// As [`Locker::try_acquire`], for the first part that could not be had
    /// ([`Error::WouldBlock`] names it when another contender holds it).
    ///
    /// # Cancel safety
    /// As [`MultiLocker::acquire`].
    pub async fn try_acquire(&self) -> Result<MultiGuard> {
        self.acquire_inner(Wait::Once).await
    }

    /// Waits until no acquisition or release through any part's locker is under way in
    /// this process (see [`Locker::settled`]): call it before exiting after dropping an
    /// acquire future.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn settled(&self) {
        for part in &self.parts {
            part.settled().await;
        }
    }

    async fn acquire_inner(&self, wait: Wait) -> Result<MultiGuard> {
        let started = Instant::now();
        'round: loop {
            // Dropped with the future if it is cancelled: each guard then releases.
            let mut held: Vec<LockGuard> = Vec::with_capacity(self.parts.len());
            for part in &self.parts {
                let got = match wait {
                    Wait::Forever => part.acquire().await,
                    Wait::Until(at, total) => part
                        .acquire_timeout(at.saturating_duration_since(Instant::now()))
                        .await
                        .map_err(|e| match e {
                            Error::Timeout { mutex, .. } => Error::Timeout {
                                mutex,
                                waited: total,
                            },
                            e => e,
                        }),
                    Wait::Once => part.try_acquire().await,
                };
                match got {
                    Ok(guard) => held.push(guard),
                    Err(e) => {
                        release_all(held).await;
                        return Err(e);
                    }
                }
                // An earlier part may have ended while this one was waited for: never
                // hand out a guard with a dead part, and never take a part out of order.
                if let Some(dead) = held.iter().find(|g| !g.is_held()) {
                    let mutex = dead.mutex().to_owned();
                    tracing::warn!(
                        mutex = %mutex,
                        "multi-lock: a part was lost while a later one was awaited; \
                         releasing every part and starting over"
                    );
                    release_all(held).await;
                    let give_up = match wait {
                        Wait::Forever => None,
                        Wait::Until(at, total) => (Instant::now() >= at).then_some(total),
                        Wait::Once => Some(started.elapsed()),
                    };
                    if let Some(waited) = give_up {
                        return Err(Error::Timeout { mutex, waited });
                    }
                    continue 'round;
                }
            }
            return Ok(MultiGuard {
                parts: held,
                acquired: Instant::now(),
            });
        }
    }
}

/// Releases every guard at once and waits for all the releases.
async fn release_all(held: Vec<LockGuard>) -> Vec<Result<()>> {
    join_all(held.into_iter().map(LockGuard::release).collect()).await
}

type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Polls every future until all are done; the outputs in the order of the futures.
async fn join_all<'a, T, F>(futures: Vec<F>) -> Vec<T>
where
    F: Future<Output = T> + Send + 'a,
{
    let mut pending: Vec<Option<Boxed<'a, T>>> = futures
        .into_iter()
        .map(|f| Some(Box::pin(f) as Boxed<'a, T>))
        .collect();
    let mut done: Vec<Option<T>> = pending.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut left = false;
        for (slot, out) in pending.iter_mut().zip(done.iter_mut()) {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => {
                        *out = Some(v);
                        *slot = None;
                    }
                    Poll::Pending => left = true,
                }
            }
        }
        if left { Poll::Pending } else { Poll::Ready(()) }
    })
    .await;
    done.into_iter().flatten().collect()
}

/// Which part of a [`MultiGuard`] ended, and why: what [`MultiGuard::lost`] resolves to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartLost {
    /// The mutex whose ownership ended.
    pub mutex: String,
    /// Why it ended.
    pub reason: LossReason,
}

impl fmt::Display for PartLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ownership of mutex {:?} lost: {}",
            self.mutex, self.reason
        )
    }
}

/// Proof of ownership of every mutex of a [`MultiLocker`].
///
/// It stands while every part stands: [`is_held`](MultiGuard::is_held) is false, and
/// [`lost`](MultiGuard::lost) resolves, as soon as any one part ends. Dropping it releases
/// every part in the background; prefer [`release`](MultiGuard::release).
pub struct MultiGuard {
    /// One guard per name, in acquisition order.
    parts: Vec<LockGuard>,
    acquired: Instant,
}

impl fmt::Debug for MultiGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiGuard")
            .field("fences", &self.fences())
            .field("held", &self.is_held())
            .finish()
    }
}

impl MultiGuard {
    /// The guard of each part, in acquisition order (ascending names): for the per-part
    /// status, contender id and local deadline.
    pub fn parts(&self) -> &[LockGuard] {
        &self.parts
    }

    /// The mutex names, in acquisition order.
    pub fn names(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.parts.iter().map(LockGuard::mutex)
    }

    /// Each mutex with the fencing token of its ownership, in acquisition order. Pass each
    /// to the resource the mutex protects.
    pub fn fences(&self) -> Vec<(&str, u64)> {
        self.parts.iter().map(|g| (g.mutex(), g.fence())).collect()
    }

    /// The fencing token of `mutex`'s ownership; `None` if it is not part of the set.
    pub fn fence(&self, mutex: &str) -> Option<u64> {
        self.part(mutex).map(LockGuard::fence)
    }

    /// The guard of `mutex`, if it is part of the set.
    pub fn part(&self, mutex: &str) -> Option<&LockGuard> {
        self.parts.iter().find(|g| g.mutex() == mutex)
    }

    /// Whether every part still stands (each checks its local lease deadline itself).
    pub fn is_held(&self) -> bool {
        self.parts.iter().all(LockGuard::is_held)
    }

    /// Whether renewals of any part are failing.
    pub fn is_suspect(&self) -> bool {
        self.parts.iter().any(LockGuard::is_suspect)
    }

    /// The time left until the earliest local lease deadline of the parts: how much
    /// longer this process may act as owner of the whole set without another renewal.
    /// `Some(ZERO)` once any part is lost; `None` when the backend gives no deadline.
    pub fn valid_for(&self) -> Option<Duration> {
        self.parts.iter().filter_map(LockGuard::valid_for).min()
    }

    /// Resolves when any part ends, with which one and why (the first in acquisition
    /// order if several have).
    ///
    /// # Cancel safety
    /// Cancel safe: it only observes.
    pub async fn lost(&self) -> PartLost {
        let mut watches: Vec<Boxed<'_, LossReason>> = self
            .parts
            .iter()
            .map(|g| Box::pin(g.lost()) as Boxed<'_, LossReason>)
            .collect();
        std::future::poll_fn(|cx| {
            for (guard, watch) in self.parts.iter().zip(watches.iter_mut()) {
                if let Poll::Ready(reason) = watch.as_mut().poll(cx) {
                    return Poll::Ready(PartLost {
                        mutex: guard.mutex().to_owned(),
                        reason,
                    });
                }
            }
            Poll::Pending
        })
        .await
    }

    /// Releases every part on the backend, all at once, and waits for that (each bounded
    /// as [`LockGuard::release`]).
    ///
    /// # Errors
    /// [`Error::Lost`] for the first part (in acquisition order) whose ownership had
    /// ended before this call, or whose release found the mutex no longer this
    /// contender's (taken over, deleted or changed by hand: see [`LockGuard::release`]):
    /// the work done under this guard may have overlapped another owner's. Never `Ok`
    /// then. Every part is released all the same.
    ///
    /// # Cancel safety
    /// Dropping the future still releases every part, in the background.
    pub async fn release(self) -> Result<()> {
        first_error(release_all(self.parts).await)
    }

    /// Releases every part so that it stays held until `at_least` after the multi-lock
    /// was acquired (see [`LockGuard::release_at_least`]).
    ///
    /// # Errors
    /// The first error (in acquisition order) of the parts' releases, as
    /// [`LockGuard::release_holding_until`] gives them; every part is released or held
    /// as that says all the same.
    ///
    /// # Cancel safety
    /// As [`LockGuard::release_holding_until`], for every part.
    pub async fn release_at_least(self, at_least: Duration) -> Result<()> {
        let until = self
            .acquired
            .checked_add(at_least)
            .unwrap_or_else(|| Instant::now() + crate::MAX_DURATION * 2);
        let releases = self
            .parts
            .into_iter()
            .map(|g| g.release_holding_until(until))
            .collect();
        first_error(join_all(releases).await)
    }

    /// When the multi-lock's acquisition returned, on this process's monotonic clock.
    pub fn acquired_at(&self) -> Instant {
        self.acquired
    }
}

fn first_error(results: Vec<Result<()>>) -> Result<()> {
    results.into_iter().find(Result::is_err).unwrap_or(Ok(()))
}
