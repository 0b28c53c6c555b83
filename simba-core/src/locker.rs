//! [`Locker`]: acquire a distributed mutex as a guard, with its fence and a loss signal.

use std::fmt;
use std::sync::{Arc, Mutex as StdMutex, Weak};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use crate::error::{Error, LossReason, Result};
use crate::id::{generate_contender_id, validate_contender_id, validate_mutex_name};
use crate::service::{ContendService, ContendServiceFactory, Contender, ContenderStatus};

struct IdContender(String);
impl Contender for IdContender {
    fn contender_id(&self) -> Option<String> {
        Some(self.0.clone())
    }
}

/// Acquires one mutex through a backend's factory.
///
/// Cloning shares the handle: a second `acquire` through the same handle (or a clone) while
/// a guard is alive does not contend again; it adds a hold (reentrancy without thread ids),
/// and the mutex is released when the last guard goes.
///
/// ```
/// # async fn demo() -> simba_core::Result<()> {
/// use std::sync::Arc;
/// use simba_core::{LeaseConfig, LeaseServiceFactory, Locker, MemoryStore};
///
/// let factory = Arc::new(LeaseServiceFactory::new(MemoryStore::new(), LeaseConfig::default())?);
/// let locker = Locker::new(factory, "nightly-report")?;
/// let guard = locker.acquire().await?;
/// println!("writing with fence {}", guard.fence());
/// guard.release().await?;
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(demo()).unwrap();
/// ```
#[derive(Clone)]
pub struct Locker {
    inner: Arc<LockerInner>,
}

struct LockerInner {
    factory: Arc<dyn ContendServiceFactory>,
    mutex: String,
    contender_id: String,
    held: StdMutex<Weak<Hold>>,
    gate: tokio::sync::Mutex<()>,
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locker")
            .field("backend", &self.inner.factory.backend())
            .field("mutex", &self.inner.mutex)
            .field("contender_id", &self.inner.contender_id)
            .finish()
    }
}

struct Hold {
    fence: u64,
    status: watch::Receiver<ContenderStatus>,
    stop: StdMutex<Option<oneshot::Sender<Option<Instant>>>>,
    /// When the acquisition returned (local clock): where `release_at_least` counts from.
    acquired: Instant,
    service: Arc<dyn ContendService>,
    /// The latest instant a holder asked the mutex to stay held until.
    hold_until: StdMutex<Option<Instant>>,
}

impl Hold {
    fn hold_until(&self, until: Instant) -> Instant {
        let mut h = self.hold_until.lock().unwrap_or_else(|p| p.into_inner());
        let until = h.map_or(until, |t| t.max(until));
        *h = Some(until);
        until
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        // The watcher task stops the service (and so releases remotely, or holds).
        let until = self.hold_until.get_mut().ok().and_then(|h| *h);
        if let Some(tx) = self.stop.get_mut().ok().and_then(Option::take) {
            let _ = tx.send(until);
        }
    }
}

/// Proof of ownership of a mutex, from [`Locker::acquire`].
///
/// Dropping it releases in the background (best effort; the lease frees the mutex anyway).
/// Prefer [`LockGuard::release`], which waits for the release.
pub struct LockGuard {
    hold: Option<Arc<Hold>>,
    mutex: String,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("mutex", &self.mutex)
            .field("fence", &self.fence())
            .field("held", &self.is_held())
            .finish()
    }
}

impl Locker {
    /// A locker for `mutex` with a generated contender id.
    ///
    /// # Errors
    /// [`Error::InvalidName`] for a bad mutex name.
    pub fn new(factory: Arc<dyn ContendServiceFactory>, mutex: &str) -> Result<Self> {
        Self::with_contender_id(factory, mutex, generate_contender_id())
    }

    /// A locker for `mutex` contending as `contender_id`.
    ///
    /// # Errors
    /// [`Error::InvalidName`] / [`Error::InvalidContenderId`] for bad input.
    pub fn with_contender_id(
        factory: Arc<dyn ContendServiceFactory>,
        mutex: &str,
        contender_id: impl Into<String>,
    ) -> Result<Self> {
        validate_mutex_name(mutex)?;
        let contender_id = contender_id.into();
        validate_contender_id(&contender_id)?;
        Ok(Locker {
            inner: Arc::new(LockerInner {
                factory,
                mutex: mutex.to_owned(),
                contender_id,
                held: StdMutex::new(Weak::new()),
                gate: tokio::sync::Mutex::new(()),
            }),
        })
    }

    /// The mutex.
    pub fn mutex(&self) -> &str {
        &self.inner.mutex
    }

    /// The contender id this locker contends as.
    pub fn contender_id(&self) -> &str {
        &self.inner.contender_id
    }

    /// How many guards of this handle hold the mutex now (0 when not held).
    pub fn hold_count(&self) -> usize {
        let held = self.inner.held.lock().unwrap_or_else(|p| p.into_inner());
        match held.upgrade() {
            Some(h) if is_held(&h) => Weak::strong_count(&held).saturating_sub(1),
            _ => 0,
        }
    }

    fn reenter(&self) -> Option<LockGuard> {
        let held = self.inner.held.lock().unwrap_or_else(|p| p.into_inner());
        let hold = held.upgrade().filter(|h| is_held(h))?;
        Some(LockGuard {
            hold: Some(hold),
            mutex: self.inner.mutex.clone(),
        })
    }

    /// Waits until this process owns the mutex.
    ///
    /// # Errors
    /// [`Error::Shutdown`] if the service stopped while waiting; backend errors are retried,
    /// not returned (bound the wait with [`Locker::acquire_timeout`]).
    ///
    /// # Cancel safety
    /// Dropping the future leaves no ownership behind: the contention is stopped and, if it
    /// won in the meantime, released in the background.
    pub async fn acquire(&self) -> Result<LockGuard> {
        self.acquire_inner(false).await
    }

    /// Like [`Locker::acquire`], giving up after `wait`.
    ///
    /// # Errors
    /// [`Error::Timeout`] when `wait` passes first.
    ///
    /// # Cancel safety
    /// As [`Locker::acquire`].
    pub async fn acquire_timeout(&self, wait: Duration) -> Result<LockGuard> {
        match tokio::time::timeout(wait, self.acquire_inner(false)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                mutex: self.inner.mutex.clone(),
                waited: wait,
            }),
        }
    }

    /// Tries once: returns a guard if the mutex could be taken by one backend call.
    ///
    /// # Errors
    /// [`Error::WouldBlock`] when another contender owns it; the backend's error when the
    /// call failed.
    ///
    /// # Cancel safety
    /// As [`Locker::acquire`].
    pub async fn try_acquire(&self) -> Result<LockGuard> {
        self.acquire_inner(true).await
    }

    async fn acquire_inner(&self, once: bool) -> Result<LockGuard> {
        if let Some(g) = self.reenter() {
            return Ok(g);
        }
        let _gate = self.inner.gate.lock().await;
        if let Some(g) = self.reenter() {
            return Ok(g);
        }
        let contender = Arc::new(IdContender(self.inner.contender_id.clone()));
        let service = self
            .inner
            .factory
            .create_contend_service(&self.inner.mutex, contender)?;
        let mut status = service.status();
        service.start()?;
        // If this future is dropped from here on, `service` is dropped with it, which stops
        // the contention and releases whatever it may have won.
        let outcome = status
            .wait_for(|s| s.held.is_some() || !s.running || (once && s.attempts > 0))
            .await
            .map(|s| (s.held, s.running, s.last_error.clone()));
        let (held, running, last_error) = outcome.unwrap_or_default();
        let Some(held) = held else {
            let _ = service.stop().await;
            return Err(match (running, last_error) {
                (false, _) => Error::Shutdown {
                    mutex: self.inner.mutex.clone(),
                },
                (true, Some(message)) => Error::Backend {
                    backend: self.inner.factory.backend(),
                    message,
                    retryable: true,
                    source: None,
                },
                (true, None) => Error::WouldBlock {
                    mutex: self.inner.mutex.clone(),
                },
            });
        };
        let (stop_tx, stop_rx) = oneshot::channel();
        let hold = Arc::new(Hold {
            fence: held.fence,
            status: status.clone(),
            stop: StdMutex::new(Some(stop_tx)),
            acquired: Instant::now(),
            service: service.clone(),
            hold_until: StdMutex::new(None),
        });
        tokio::spawn(watch_hold(service, status, held.fence, stop_rx));
        *self.inner.held.lock().unwrap_or_else(|p| p.into_inner()) = Arc::downgrade(&hold);
        Ok(LockGuard {
            hold: Some(hold),
            mutex: self.inner.mutex.clone(),
        })
    }
}

/// Stops the service when the last guard goes or when the ownership is lost, so that a
/// locker never re-acquires behind its user's back.
async fn watch_hold(
    service: Arc<dyn ContendService>,
    mut status: watch::Receiver<ContenderStatus>,
    fence: u64,
    stop: oneshot::Receiver<Option<Instant>>,
) {
    let hold = tokio::select! {
        until = stop => until.ok().flatten(),
        _ = status.wait_for(|s| !held_with(s, fence)) => None,
    };
    if let Some(until) = hold {
        match service.stop_holding_until(until).await {
            Ok(()) => return,
            Err(e) => tracing::warn!("keeping the mutex held failed: {e}"),
        }
    }
    let _ = service.stop().await;
}

/// Whether the ownership with `fence` stands. Once it was reported lost it stays lost for
/// the guard, even if the engine re-acquires with the same fence right after.
fn held_with(s: &ContenderStatus, fence: u64) -> bool {
    s.running
        && s.owns_now()
        && s.held.is_some_and(|h| h.fence == fence)
        && s.last_loss.is_none_or(|l| l.fence != fence)
}

fn is_held(h: &Hold) -> bool {
    held_with(&h.status.borrow(), h.fence)
}

impl LockGuard {
    fn hold(&self) -> Option<&Arc<Hold>> {
        self.hold.as_ref()
    }

    /// The fencing token of this ownership: pass it to the resource you protect, which
    /// should reject writes carrying a smaller token than one it has seen.
    pub fn fence(&self) -> u64 {
        self.hold().map_or(0, |h| h.fence)
    }

    /// The mutex.
    pub fn mutex(&self) -> &str {
        &self.mutex
    }

    /// Whether the ownership still stands. Checks the local lease deadline itself, so a
    /// process that was paused past its lease sees `false` at once on waking, before its
    /// background task has run. Check it right before each write to a shared resource,
    /// and send the [fence](LockGuard::fence) along.
    pub fn is_held(&self) -> bool {
        self.hold().is_some_and(|h| is_held(h))
    }

    /// How much longer this process may act as owner without another successful renewal:
    /// the time left until the local lease deadline. `Some(ZERO)` once lost; `None` when
    /// the backend gives no deadline.
    pub fn valid_for(&self) -> Option<Duration> {
        let h = self.hold()?;
        let status = h.status.borrow();
        if !held_with(&status, h.fence) {
            return Some(Duration::ZERO);
        }
        status
            .deadline
            .map(|d| d.saturating_duration_since(tokio::time::Instant::now()))
    }

    /// Whether renewals are failing (the ownership stands until its local deadline, but
    /// the holder should not start new work).
    pub fn is_suspect(&self) -> bool {
        self.hold().is_some_and(|h| {
            h.status
                .borrow()
                .held
                .is_some_and(|x| x.fence == h.fence && x.suspect)
        })
    }

    /// Resolves when the ownership ends, with the reason.
    ///
    /// # Cancel safety
    /// Cancel safe: it only observes.
    pub async fn lost(&self) -> LossReason {
        let Some(h) = self.hold() else {
            return LossReason::Released;
        };
        let mut status = h.status.clone();
        let fence = h.fence;
        match status.wait_for(|s| !held_with(s, fence)).await {
            Ok(s) => match (s.last_loss, s.held) {
                (Some(loss), _) if loss.fence == fence => loss.reason,
                // The deadline passed before the background task said so.
                (_, Some(h)) if h.fence == fence && s.running => LossReason::LeaseExpired,
                (_, Some(_)) => LossReason::TakenOver,
                _ => LossReason::Released,
            },
            Err(_) => LossReason::Released,
        }
    }

    /// Releases so that the mutex stays held until `until` (ShedLock's `lockAtLeastFor`):
    /// nobody — this process included — can take it before then, and nothing renews it.
    /// Typical use: a job that several hosts run on a schedule, which must run once per
    /// period even when it finishes early and the hosts' clocks disagree. An `until` that
    /// has passed is a plain [`release`](LockGuard::release).
    ///
    /// The backend is told the time left (`until - now` on this process's monotonic
    /// clock) and adds it to its own clock, so no wall clock of this process matters.
    /// When other holds of the same handle remain, the mutex is kept held from the last
    /// one's release until the latest instant any of them asked for.
    ///
    /// # Errors
    /// - [`Error::Lost`] when the ownership had ended before: nothing was held;
    /// - [`Error::Unsupported`] on ZooKeeper (sessions, not leases): the mutex is then
    ///   released as by [`release`](LockGuard::release);
    /// - [`Error::Backend`] when the backend call failed: the ownership then ends with its
    ///   current lease, maybe before `until`;
    /// - [`Error::InvalidConfig`] for a hold longer than a year (the mutex is then
    ///   released as by [`release`](LockGuard::release)).
    ///
    /// # Cancel safety
    /// Dropping the future after the first poll still applies the hold, in the background.
    pub async fn release_holding_until(mut self, until: Instant) -> Result<()> {
        let Some(hold) = self.hold.take() else {
            return Ok(());
        };
        let until = hold.hold_until(until);
        if Arc::strong_count(&hold) > 1 {
            // Another hold of the handle releases (and holds) later.
            return Ok(());
        }
        let outcome = hold.service.stop_holding_until(until).await;
        // Stops the service if the hold could not be applied (ZooKeeper): a release.
        *hold.hold_until.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let mut status = hold.status.clone();
        drop(hold);
        let _ = status.wait_for(|s| !s.running).await;
        outcome
    }

    /// Releases so that the mutex stays held until `at_least` after it was acquired
    /// (counted from when [`Locker::acquire`] returned, on this process's clock), like
    /// ShedLock's `lockAtLeastFor`. See [`release_holding_until`](LockGuard::release_holding_until).
    ///
    /// # Errors
    /// As [`release_holding_until`](LockGuard::release_holding_until).
    ///
    /// # Cancel safety
    /// As [`release_holding_until`](LockGuard::release_holding_until).
    pub async fn release_at_least(self, at_least: Duration) -> Result<()> {
        let Some(acquired) = self.hold().map(|h| h.acquired) else {
            return Ok(());
        };
        // An `at_least` so long that the instant overflows is over a year: the store's
        // check of the hold rejects it.
        let until = acquired
            .checked_add(at_least)
            .unwrap_or_else(|| Instant::now() + crate::MAX_DURATION * 2);
        self.release_holding_until(until).await
    }

    /// When this guard's acquisition returned, on this process's monotonic clock.
    pub fn acquired_at(&self) -> Option<Instant> {
        self.hold().map(|h| h.acquired)
    }

    /// Releases this hold; when it is the last hold of the handle, releases the mutex on
    /// the backend and waits for that (bounded by the backend's request timeout).
    ///
    /// # Errors
    /// Never fails today (a failed remote release is logged; the lease frees the mutex).
    ///
    /// # Cancel safety
    /// Dropping the future still releases, in the background.
    pub async fn release(mut self) -> Result<()> {
        let Some(hold) = self.hold.take() else {
            return Ok(());
        };
        let mut status = hold.status.clone();
        let last = Arc::strong_count(&hold) == 1;
        drop(hold);
        if last {
            let _ = status.wait_for(|s| !s.running).await;
        }
        Ok(())
    }
}
