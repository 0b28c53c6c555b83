//! [`RwLock`]: a fenced, leased read-write lock, made of a mutex and a semaphore of one name.
//!
//! The mutex is the *gate*, the semaphore holds the *readers*:
//! - a reader takes the gate, then a permit, checks that the gate is still held, and lets
//!   the gate go: it holds its permit only. Its fence is the gate's fence it passed with.
//! - a writer takes the gate and keeps it, then waits until the semaphore has no holder
//!   within its lease. Its fence is the gate's.
//!
//! While a writer holds the gate or waits for the readers to leave, no new reader gets
//! past the gate: writers are preferred, and never starve. Readers and writers queue on
//! the gate in the order the backend's mutex keeps (first come, first served on every
//! backend simba has).
//!
//! **Why a reader and a writer never hold at once.** The reader's permit is taken while
//! it holds the gate, and it checks that it still holds the gate *after* the permit is
//! taken (the local lease deadline, which ends before the backend's lease). A writer
//! takes the gate later, so the reader's permit is on the backend when the writer reads
//! the holders, and the writer waits until it is released or its lease ends. A reader
//! whose gate ended before that check lets its permit go and starts again.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::{Error, LossReason, Result};
use crate::lease::{LeaseConfig, LeaseServiceFactory};
use crate::locker::{LockGuard, Locker};
use crate::permit_store::{PermitHolders, PermitStore};
use crate::semaphore::{PermitGuard, Semaphore};
use crate::service::{ContendServiceFactory, ContenderStatus};
use crate::store::LeaseStore;

/// The most readers at once of a read-write lock made by [`RwLock::from_factory`] or
/// [`Connection::open_rwlock`](crate::connect::Connection::open_rwlock): the permits of its
/// readers' semaphore.
pub const MAX_READERS: u32 = 1 << 16;

/// The first pause of a writer waiting for the readers to leave; it doubles up to
/// [`DRAIN_POLL_MAX`].
const DRAIN_POLL_MIN: Duration = Duration::from_millis(2);

/// The longest pause of a writer waiting for the readers to leave: a writer starts at most
/// this long (and a round trip) after the last reader left.
pub const DRAIN_POLL_MAX: Duration = Duration::from_millis(50);

#[derive(Clone, Copy)]
enum Wait {
    Forever,
    Until(Instant, Duration),
    Once,
}

/// A read-write lock over a backend: any number of readers (up to its semaphore's
/// permits) or one writer, each with a lease of its own, a fence and an honest release.
///
/// Fences come from the gate, one sequence for readers and writers: they increase from
/// writer to writer, and every reader's fence is greater than the fence of every writer
/// that held before it and smaller than the fence of every writer after it. A resource
/// that refuses a write carrying a smaller fence than one it has seen thus refuses a
/// stale writer, and can tell a reader's view from before or after a write.
///
/// ```
/// # async fn demo() -> simba_core::Result<()> {
/// use simba_core::{LeaseConfig, LeaseServiceFactory, MemoryStore, RwLock};
///
/// let factory = LeaseServiceFactory::new(MemoryStore::new(), LeaseConfig::default())?;
/// let lock = RwLock::from_factory(&factory, "catalog")?;
/// let a = lock.read().await?;
/// let b = lock.read().await?; // readers share
/// assert!(lock.try_write().await.is_err()); // a writer waits for them
/// let read_fence = b.fence();
/// a.release().await?;
/// b.release().await?;
/// let w = lock.write().await?;
/// assert!(w.fence() > read_fence);
/// w.release().await?;
/// # Ok(())
/// # }
/// ```
pub struct RwLock {
    gate: Locker,
    readers: Semaphore,
}

impl fmt::Debug for RwLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RwLock")
            .field("name", &self.name())
            .field("max_readers", &self.max_readers())
            .finish()
    }
}

impl RwLock {
    /// The read-write lock made of the mutex `gate` locks and the semaphore `readers`,
    /// which must have the same name (a semaphore and a mutex of one name are apart on
    /// every backend). The semaphore's permits are the most readers at once.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the names differ.
    pub fn new(gate: Locker, readers: Semaphore) -> Result<RwLock> {
        if gate.mutex() != readers.name() {
            return Err(Error::config(
                "readers",
                format!(
                    "the readers' semaphore {:?} is not named as the gate {:?}",
                    readers.name(),
                    gate.mutex()
                ),
            ));
        }
        Ok(RwLock { gate, readers })
    }

    /// The read-write lock `name` over the store and config of a mutex factory, with
    /// [`MAX_READERS`] readers at most.
    ///
    /// # Errors
    /// [`Error::InvalidName`] for a bad name.
    pub fn from_factory<S: LeaseStore + PermitStore>(
        factory: &LeaseServiceFactory<S>,
        name: &str,
    ) -> Result<RwLock> {
        let gates: Arc<dyn ContendServiceFactory> = Arc::new(LeaseServiceFactory::from_arc(
            factory.store().clone(),
            factory.config().clone(),
        )?);
        Self::from_parts(
            gates,
            factory.store().clone(),
            factory.config().clone(),
            name,
        )
    }

    /// The read-write lock `name`: its gate a mutex of `gates`, its readers permits of
    /// `permits` timed by `config`, [`MAX_READERS`] at most.
    ///
    /// # Errors
    /// [`Error::InvalidName`] for a bad name; [`Error::InvalidConfig`] for a config that
    /// does not validate.
    pub fn from_parts<S: PermitStore>(
        gates: Arc<dyn ContendServiceFactory>,
        permits: Arc<S>,
        config: LeaseConfig,
        name: &str,
    ) -> Result<RwLock> {
        let gate = Locker::new(gates, name)?;
        let readers = Semaphore::from_arc(permits, config, name, MAX_READERS)?;
        RwLock::new(gate, readers)
    }

    /// The lock's name (its gate's and its readers' semaphore's).
    pub fn name(&self) -> &str {
        self.gate.mutex()
    }

    /// The most readers at once.
    pub fn max_readers(&self) -> u32 {
        self.readers.permits()
    }

    /// Waits until this contender reads: no writer holds or waits ahead of it.
    ///
    /// # Errors
    /// As [`Semaphore::acquire`] ([`Error::PermitsMismatch`] when the readers' semaphore
    /// was opened with another count elsewhere) and [`Locker::acquire`].
    ///
    /// # Cancel safety
    /// As [`Locker::acquire`]: dropping the future releases what it may have won, in the
    /// background.
    pub async fn read(&self) -> Result<ReadGuard> {
        self.read_with(Wait::Forever).await
    }

    /// Like [`RwLock::read`], giving up after `wait` holding nothing.
    ///
    /// # Errors
    /// [`Error::Timeout`] when `wait` has passed; otherwise as [`RwLock::read`].
    ///
    /// # Cancel safety
    /// As [`RwLock::read`].
    pub async fn read_timeout(&self, wait: Duration) -> Result<ReadGuard> {
        self.read_with(until(wait)).await
    }

    /// One attempt to read now.
    ///
    /// # Errors
    /// [`Error::WouldBlock`] when a writer holds or waits; otherwise as [`RwLock::read`].
    ///
    /// # Cancel safety
    /// As [`RwLock::read`].
    pub async fn try_read(&self) -> Result<ReadGuard> {
        self.read_with(Wait::Once).await
    }

    /// Waits until this contender writes: it holds the gate and no reader holds.
    ///
    /// # Errors
    /// As [`Locker::acquire`]; a backend error while reading the readers is retried.
    ///
    /// # Cancel safety
    /// As [`Locker::acquire`].
    pub async fn write(&self) -> Result<WriteGuard> {
        self.write_with(Wait::Forever).await
    }

    /// Like [`RwLock::write`], giving up after `wait` holding nothing.
    ///
    /// # Errors
    /// [`Error::Timeout`] when `wait` has passed; otherwise as [`RwLock::write`].
    ///
    /// # Cancel safety
    /// As [`RwLock::write`].
    pub async fn write_timeout(&self, wait: Duration) -> Result<WriteGuard> {
        self.write_with(until(wait)).await
    }

    /// One attempt to write now.
    ///
    /// # Errors
    /// [`Error::WouldBlock`] when a writer holds or waits or a reader holds; the
    /// backend's error when reading the readers fails; otherwise as [`RwLock::write`].
    ///
    /// # Cancel safety
    /// As [`RwLock::write`].
    pub async fn try_write(&self) -> Result<WriteGuard> {
        self.write_with(Wait::Once).await
    }

    /// The readers within their lease, read from the backend.
    ///
    /// # Errors
    /// The backend's error.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn readers(&self) -> Result<PermitHolders> {
        self.readers.holders().await
    }

    /// The error of a wait that ended without the lock.
    fn timeout(&self, wait: Wait) -> Error {
        let mutex = self.name().to_owned();
        match wait {
            Wait::Once => Error::WouldBlock { mutex },
            Wait::Until(_, waited) => Error::Timeout { mutex, waited },
            // A wait without end does not time out; a part's timeout cannot come here.
            Wait::Forever => Error::Timeout {
                mutex,
                waited: Duration::MAX,
            },
        }
    }

    /// The time left of `wait`; the timeout error once none is left.
    fn left(&self, wait: Wait) -> Result<Option<Duration>> {
        match wait {
            Wait::Forever | Wait::Once => Ok(None),
            Wait::Until(at, _) => match at.checked_duration_since(Instant::now()) {
                Some(d) if !d.is_zero() => Ok(Some(d)),
                _ => Err(self.timeout(wait)),
            },
        }
    }

    async fn gate_with(&self, wait: Wait) -> Result<LockGuard> {
        let r = match (wait, self.left(wait)?) {
            (Wait::Once, _) => self.gate.try_acquire().await,
            (_, Some(d)) => self.gate.acquire_timeout(d).await,
            (_, None) => self.gate.acquire().await,
        };
        r.map_err(|e| self.restate(e, wait))
    }

    async fn permit_with(&self, wait: Wait) -> Result<PermitGuard> {
        let r = match (wait, self.left(wait)?) {
            (Wait::Once, _) => self.readers.try_acquire().await,
            (_, Some(d)) => self.readers.acquire_timeout(d).await,
            (_, None) => self.readers.acquire().await,
        };
        r.map_err(|e| self.restate(e, wait))
    }

    /// A gate's or a permit's timeout is the lock's, for the whole wait.
    fn restate(&self, e: Error, wait: Wait) -> Error {
        match e {
            Error::Timeout { .. } | Error::WouldBlock { .. } => self.timeout(wait),
            e => e,
        }
    }

    async fn read_with(&self, wait: Wait) -> Result<ReadGuard> {
        loop {
            let gate = self.gate_with(wait).await?;
            let permit = match self.permit_with(wait).await {
                Ok(p) => p,
                Err(e) => {
                    let _ = gate.release().await;
                    return Err(e);
                }
            };
            // The gate must stand after the permit is taken (see the module docs).
            if gate.is_held() {
                let fence = gate.fence();
                // A gate found ended by its release (taken over by hand) proves nothing
                // about when it ended: start again rather than trust the permit.
                if gate.release().await.is_ok() {
                    return Ok(ReadGuard { permit, fence });
                }
            } else {
                drop(gate);
            }
            let _ = permit.release().await;
            if let Wait::Once = wait {
                return Err(self.timeout(wait));
            }
        }
    }

    async fn write_with(&self, wait: Wait) -> Result<WriteGuard> {
        'gate: loop {
            let gate = self.gate_with(wait).await?;
            let mut pause = DRAIN_POLL_MIN;
            loop {
                let readers = self.readers.holders().await;
                if !gate.is_held() {
                    if let Wait::Once = wait {
                        return Err(self.timeout(wait));
                    }
                    continue 'gate;
                }
                match readers {
                    Ok(r) if r.holders.is_empty() => return Ok(WriteGuard { gate }),
                    Ok(_) => {}
                    Err(e) if matches!(wait, Wait::Once) => {
                        let _ = gate.release().await;
                        return Err(e);
                    }
                    Err(e) => tracing::debug!(lock = self.name(), "reading the readers: {e}"),
                }
                let nap = match (wait, self.left(wait)) {
                    (Wait::Once, _) | (_, Err(_)) => {
                        let _ = gate.release().await;
                        return Err(self.timeout(wait));
                    }
                    (_, Ok(Some(left))) => pause.min(left),
                    (_, Ok(None)) => pause,
                };
                tokio::select! {
                    () = tokio::time::sleep(nap) => {}
                    _ = gate.lost() => {}
                }
                pause = (pause * 2).min(DRAIN_POLL_MAX);
            }
        }
    }
}

fn until(wait: Duration) -> Wait {
    Instant::now()
        .checked_add(wait)
        .map_or(Wait::Forever, |at| Wait::Until(at, wait))
}

/// A reader's hold of a [`RwLock`]: a permit of its readers' semaphore, with a lease of
/// its own renewed in the background, and the fence of the gate it passed.
///
/// Dropping it releases in the background; prefer [`ReadGuard::release`].
pub struct ReadGuard {
    permit: PermitGuard,
    fence: u64,
}

impl fmt::Debug for ReadGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadGuard")
            .field("lock", &self.permit.semaphore())
            .field("fence", &self.fence)
            .field("held", &self.is_held())
            .finish()
    }
}

impl ReadGuard {
    /// The fencing token of this read: greater than every earlier writer's, smaller than
    /// every later writer's (see [`RwLock`]).
    pub fn fence(&self) -> u64 {
        self.fence
    }

    /// The contender id this read is held under (its permit's holder id).
    pub fn contender_id(&self) -> &str {
        self.permit.contender_id()
    }

    /// Whether the read still stands (the local lease deadline, as
    /// [`PermitGuard::is_held`]).
    pub fn is_held(&self) -> bool {
        self.permit.is_held()
    }

    /// The time left until the local lease deadline; `Some(ZERO)` once lost.
    pub fn valid_for(&self) -> Option<Duration> {
        self.permit.valid_for()
    }

    /// Whether renewals are failing.
    pub fn is_suspect(&self) -> bool {
        self.permit.is_suspect()
    }

    /// A receiver of the status of the contender behind this read.
    pub fn status(&self) -> watch::Receiver<ContenderStatus> {
        self.permit.status()
    }

    /// Resolves when the read is no longer held, with the reason.
    ///
    /// # Cancel safety
    /// Cancel safe: it only observes.
    pub async fn lost(&self) -> LossReason {
        self.permit.lost().await
    }

    /// Ends the read and waits for that.
    ///
    /// # Errors
    /// [`Error::Lost`] when the read had ended before (see [`PermitGuard::release`]).
    ///
    /// # Cancel safety
    /// Dropping the future still releases, in the background.
    pub async fn release(self) -> Result<()> {
        self.permit.release().await
    }
}

/// A writer's hold of a [`RwLock`]: its gate, which no reader passes meanwhile.
///
/// Dropping it releases in the background; prefer [`WriteGuard::release`].
pub struct WriteGuard {
    gate: LockGuard,
}

impl fmt::Debug for WriteGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WriteGuard")
            .field("lock", &self.gate.mutex())
            .field("fence", &self.gate.fence())
            .field("held", &self.is_held())
            .finish()
    }
}

impl WriteGuard {
    /// The fencing token of this write: greater than every earlier reader's and writer's.
    pub fn fence(&self) -> u64 {
        self.gate.fence()
    }

    /// The contender id this write is held under (the gate's owner id).
    pub fn contender_id(&self) -> &str {
        self.gate.contender_id()
    }

    /// Whether the write still stands (see [`LockGuard::is_held`]).
    pub fn is_held(&self) -> bool {
        self.gate.is_held()
    }

    /// The time left until the local lease deadline; `Some(ZERO)` once lost.
    pub fn valid_for(&self) -> Option<Duration> {
        self.gate.valid_for()
    }

    /// Whether renewals are failing.
    pub fn is_suspect(&self) -> bool {
        self.gate.is_suspect()
    }

    /// A receiver of the status of the contender behind this write.
    pub fn status(&self) -> watch::Receiver<ContenderStatus> {
        self.gate.status()
    }

    /// Resolves when the write is no longer held, with the reason.
    ///
    /// # Cancel safety
    /// Cancel safe: it only observes.
    pub async fn lost(&self) -> LossReason {
        self.gate.lost().await
    }

    /// Ends the write and waits for that.
    ///
    /// # Errors
    /// [`Error::Lost`] when the write had ended before (see [`LockGuard::release`]).
    ///
    /// # Cancel safety
    /// Dropping the future still releases, in the background.
    pub async fn release(self) -> Result<()> {
        self.gate.release().await
    }
}
