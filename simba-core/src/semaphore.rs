//! [`Semaphore`]: at most N holders of one name, each with its own lease and fence.
//!
//! There is no second engine here. [`Permits`] presents one permit holder of a store's
//! semaphore as the owner of a mutex to the lease engine ([`LeaseServiceFactory`]), through
//! the permit store contract ([`PermitStore`]), and each acquisition runs through a
//! [`Locker`] of its own: the local lease deadline, the suspect/lost logic, renewals, the
//! honest give-up of `acquire_timeout` and the release on drop are the mutex's, unchanged.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::error::{Error, LossReason, Result};
use crate::events::EventReceiver;
use crate::id::generate_contender_id;
use crate::lease::{LeaseConfig, LeaseServiceFactory};
use crate::locker::{LockGuard, Locker};
use crate::owner::MutexOwner;
use crate::permit_store::{PermitHolders, PermitStore};
use crate::service::{ContendServiceFactory, ContenderStatus};
use crate::store::{Lease, LeaseReply, LeaseStore};

/// Why a store refused an acquisition for good (the engine would retry it forever).
#[derive(Debug, Clone)]
enum Refusal {
    /// The holders agreed on this other count.
    Mismatch(u32),
    /// The store cannot do what was asked (ZooKeeper: a lease longer than its session
    /// keeps safe).
    Unsupported {
        backend: &'static str,
        what: &'static str,
        reason: String,
    },
}

/// The refusals seen by the acquisitions under way of one [`Semaphore`], by contender id:
/// the engine retries a failed call, so the refusal is carried to the acquisition beside it.
struct Mismatches {
    seen: StdMutex<HashMap<String, Option<Refusal>>>,
    bump: watch::Sender<u64>,
}

impl Default for Mismatches {
    fn default() -> Self {
        Mismatches {
            seen: StdMutex::default(),
            bump: watch::channel(0).0,
        }
    }
}

impl Mismatches {
    fn seen(&self) -> std::sync::MutexGuard<'_, HashMap<String, Option<Refusal>>> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Notes `error` for `contender_id` if it is a refusal for good.
    fn record(&self, contender_id: &str, error: &Error) {
        let refusal = match error {
            Error::PermitsMismatch { existing, .. } => Refusal::Mismatch(*existing),
            Error::Unsupported {
                backend,
                what,
                reason,
            } => Refusal::Unsupported {
                backend,
                what,
                reason: reason.clone(),
            },
            _ => return,
        };
        if let Some(slot) = self.seen().get_mut(contender_id) {
            *slot = Some(refusal);
            self.bump.send_modify(|n| *n += 1);
        }
    }
}

/// One acquisition's watch on [`Mismatches`]; unregisters when dropped.
struct MismatchWatch {
    mismatches: Arc<Mismatches>,
    contender_id: String,
}

impl MismatchWatch {
    fn new(mismatches: Arc<Mismatches>, contender_id: &str) -> Self {
        mismatches.seen().insert(contender_id.to_owned(), None);
        MismatchWatch {
            mismatches,
            contender_id: contender_id.to_owned(),
        }
    }

    fn refusal(&self) -> Option<Refusal> {
        self.mismatches
            .seen()
            .get(&self.contender_id)
            .cloned()
            .flatten()
    }

    /// Resolves once the store refused this acquisition for good.
    async fn refused(&self) -> Refusal {
        let mut bump = self.mismatches.bump.subscribe();
        loop {
            if let Some(refusal) = self.refusal() {
                return refusal;
            }
            if bump.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}

impl Drop for MismatchWatch {
    fn drop(&mut self) {
        self.mismatches.seen().remove(&self.contender_id);
    }
}

/// The permits of a store as a mutex store: the owner of "mutex" `s` is a contender that
/// holds one of the `permits` permits of semaphore `s`.
struct Permits<S> {
    store: Arc<S>,
    permits: u32,
    mismatches: Arc<Mismatches>,
}

impl<S: PermitStore> LeaseStore for Permits<S> {
    fn backend(&self) -> &'static str {
        self.store.backend()
    }

    async fn acquire(
        &self,
        semaphore: &str,
        contender_id: &str,
        lease: Lease,
    ) -> Result<LeaseReply> {
        let reply = self
            .store
            .permit_acquire(semaphore, contender_id, self.permits, lease)
            .await;
        if let Err(e) = &reply {
            self.mismatches.record(contender_id, e);
        }
        reply
    }

    async fn guard(&self, semaphore: &str, contender_id: &str, lease: Lease) -> Result<LeaseReply> {
        self.store
            .permit_guard(semaphore, contender_id, self.permits, lease)
            .await
    }

    async fn release(&self, semaphore: &str, contender_id: &str) -> Result<bool> {
        self.store.permit_release(semaphore, contender_id).await
    }

    async fn release_after(&self, _: &str, _: &str, _: Duration) -> Result<bool> {
        Err(Error::unsupported(
            self.store.backend(),
            "hold-at-least for a semaphore permit",
            "a permit is released at once; hold a mutex for `release_at_least`",
        ))
    }

    /// The holder whose lease ends first (the retrieval side of a semaphore is
    /// [`Semaphore::holders`]).
    async fn owner(&self, semaphore: &str) -> Result<LeaseReply> {
        let holders = self.store.permit_owners(semaphore).await?;
        let owner = holders
            .holders
            .into_iter()
            .min_by_key(|h| h.transition_at)
            .unwrap_or(MutexOwner::NONE);
        Ok(LeaseReply {
            owner,
            now: holders.now,
        })
    }

    async fn subscribe(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> Result<Option<EventReceiver>> {
        self.store.permit_subscribe(semaphore, contender_id).await
    }

    async fn leave(&self, semaphore: &str, contender_id: &str) -> Result<()> {
        self.store.permit_leave(semaphore, contender_id).await
    }

    fn check_mutex_name(&self, semaphore: &str) -> Result<()> {
        self.store.check_semaphore_name(semaphore)
    }

    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        self.store.check_contender_id(contender_id)
    }
}

type HoldersFuture<'a> = Pin<Box<dyn Future<Output = Result<PermitHolders>> + Send + 'a>>;

/// Reads a semaphore's holders without naming the store's type.
trait ReadHolders: Send + Sync {
    fn holders<'a>(&'a self, semaphore: &'a str) -> HoldersFuture<'a>;
}

impl<S: PermitStore> ReadHolders for Permits<S> {
    fn holders<'a>(&'a self, semaphore: &'a str) -> HoldersFuture<'a> {
        Box::pin(self.store.permit_owners(semaphore))
    }
}

/// How long an acquisition may wait.
#[derive(Clone, Copy)]
enum Wait {
    Forever,
    For(Duration),
    Once,
}

/// A counting semaphore across processes: at most `permits` holders of one name at once,
/// each holding a [`PermitGuard`] with its own lease (renewed while held, lost at the local
/// deadline exactly as a mutex ownership is) and its own fence (strictly increasing across
/// all the permits of the semaphore).
///
/// "At most N" counts every holder that believes it holds: a holder that stops renewing
/// stops believing at its local deadline, which comes before the backend frees its permit.
/// A holder that dies frees its permit when its lease ends. Every contender of one name
/// must ask for the same `permits`: while the semaphore has holders, a different count is
/// refused with [`Error::PermitsMismatch`]. Semaphore names are apart from mutex names.
///
/// Backends: any [`PermitStore`] — [`MemoryStore`](crate::MemoryStore), Redis
/// (simba-redis), SQL (simba-jdbc: MariaDB/MySQL, PostgreSQL, SQLite), ZooKeeper
/// (simba-zookeeper's `ZkFactory::semaphore`) and etcd (simba-etcd's
/// `EtcdFactory::semaphore`). A backend without semaphores does not
/// implement [`PermitStore`], so no semaphore can be made over it.
///
/// Waiters queue in the backend first come first served (roughly: a waiter that misses
/// its turn loses its place to the next), and a release wakes one waiter per freed permit
/// where the backend can push; a permit freed by a lease's end is found by the waiters'
/// next look, at that lease's end.
///
/// Each acquisition contends under a new contender id on its own; unlike a [`Locker`],
/// the tasks of one process do not queue in front of the backend.
///
/// ```
/// # async fn demo() -> simba_core::Result<()> {
/// use simba_core::{LeaseConfig, MemoryStore, Semaphore};
///
/// let store = MemoryStore::new();
/// let workers = Semaphore::new(store.clone(), LeaseConfig::default(), "batch-workers", 2)?;
/// let a = workers.acquire().await?;
/// let b = workers.acquire().await?;
/// assert!(b.fence() > a.fence());
/// // Both permits are taken: a third contender is refused at once.
/// assert!(workers.try_acquire().await.is_err());
/// // A contender that asks for another count is refused while the semaphore has holders.
/// let wrong = Semaphore::new(store, LeaseConfig::default(), "batch-workers", 3)?;
/// assert!(matches!(
///     wrong.try_acquire().await,
///     Err(simba_core::Error::PermitsMismatch { asked: 3, existing: 2, .. })
/// ));
/// a.release().await?;
/// let c = workers.acquire().await?;
/// assert!(c.fence() > b.fence());
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(demo()).unwrap();
/// ```
#[derive(Clone)]
pub struct Semaphore {
    name: String,
    permits: u32,
    factory: Arc<dyn ContendServiceFactory>,
    reader: Arc<dyn ReadHolders>,
    mismatches: Arc<Mismatches>,
    backend: &'static str,
}

impl fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Semaphore")
            .field("backend", &self.backend)
            .field("name", &self.name)
            .field("permits", &self.permits)
            .finish()
    }
}

impl Semaphore {
    /// The semaphore `name` with `permits` permits over `store`, its holders timed by
    /// `config` (ttl, transition, request timeout… as for a mutex).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for zero permits or a config that does not validate;
    /// [`Error::InvalidName`] for a bad name.
    pub fn new<S: PermitStore>(
        store: S,
        config: LeaseConfig,
        name: &str,
        permits: u32,
    ) -> Result<Self> {
        Self::from_arc(Arc::new(store), config, name, permits)
    }

    /// As [`Semaphore::new`], over the store and config of a mutex factory.
    ///
    /// # Errors
    /// As [`Semaphore::new`].
    pub fn from_factory<S: LeaseStore + PermitStore>(
        factory: &LeaseServiceFactory<S>,
        name: &str,
        permits: u32,
    ) -> Result<Self> {
        Self::from_arc(
            factory.store().clone(),
            factory.config().clone(),
            name,
            permits,
        )
    }

    /// As [`Semaphore::new`], over a shared store.
    ///
    /// # Errors
    /// As [`Semaphore::new`].
    pub fn from_arc<S: PermitStore>(
        store: Arc<S>,
        config: LeaseConfig,
        name: &str,
        permits: u32,
    ) -> Result<Self> {
        if permits == 0 {
            return Err(Error::config(
                "permits",
                "a semaphore needs at least one permit",
            ));
        }
        let mismatches = Arc::new(Mismatches::default());
        let adapter = Arc::new(Permits {
            store,
            permits,
            mismatches: mismatches.clone(),
        });
        let backend = PermitStore::backend(&*adapter.store);
        let factory = LeaseServiceFactory::from_arc(adapter.clone(), config)?;
        let factory: Arc<dyn ContendServiceFactory> = Arc::new(factory);
        factory.check_mutex_name(name)?;
        Ok(Semaphore {
            name: name.to_owned(),
            permits,
            factory,
            reader: adapter,
            mismatches,
            backend,
        })
    }

    /// The semaphore's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The number of permits.
    pub fn permits(&self) -> u32 {
        self.permits
    }

    /// Waits until this contender holds a permit.
    ///
    /// # Errors
    /// [`Error::PermitsMismatch`] when the holders agreed on another count;
    /// [`Error::Unsupported`] when the store cannot do what the config asks (ZooKeeper: a
    /// lease longer than half its session timeout); [`Error::Shutdown`] as for
    /// [`Locker::acquire`]. Other backend errors are retried.
    ///
    /// # Cancel safety
    /// As [`Locker::acquire`]: dropping the future releases what it may have won, in the
    /// background.
    pub async fn acquire(&self) -> Result<PermitGuard> {
        self.acquire_with(Wait::Forever).await
    }

    /// Like [`Semaphore::acquire`], giving up after `wait`; when it gives up, it holds
    /// nothing (what its contention took is released before it returns), as
    /// [`Locker::acquire_timeout`].
    ///
    /// # Errors
    /// [`Error::Timeout`] when `wait` has passed; otherwise as [`Semaphore::acquire`].
    ///
    /// # Cancel safety
    /// As [`Semaphore::acquire`].
    pub async fn acquire_timeout(&self, wait: Duration) -> Result<PermitGuard> {
        self.acquire_with(Wait::For(wait)).await
    }

    /// One backend attempt: a permit if one is free for this contender now.
    ///
    /// # Errors
    /// [`Error::WouldBlock`] when every permit is held (or the free ones are owed to
    /// earlier waiters); otherwise as [`Locker::try_acquire`] and [`Semaphore::acquire`].
    ///
    /// # Cancel safety
    /// As [`Semaphore::acquire`].
    pub async fn try_acquire(&self) -> Result<PermitGuard> {
        self.acquire_with(Wait::Once).await
    }

    /// The holders within their lease, read from the backend, and the count they agreed on.
    ///
    /// # Errors
    /// The backend's error.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads (the backend drops holders past their lease as it reads).
    pub async fn holders(&self) -> Result<PermitHolders> {
        self.reader.holders(&self.name).await
    }

    async fn acquire_with(&self, wait: Wait) -> Result<PermitGuard> {
        let contender_id = generate_contender_id();
        // A locker of its own per acquisition (its id is new): permits of one process do
        // not exclude each other.
        let locker = Locker::with_contender_id(self.factory.clone(), &self.name, &contender_id)?;
        let watch = MismatchWatch::new(self.mismatches.clone(), &contender_id);
        let acquiring = async {
            match wait {
                Wait::Forever => locker.acquire().await,
                Wait::For(d) => locker.acquire_timeout(d).await,
                Wait::Once => locker.try_acquire().await,
            }
        };
        // A refusal ends the wait at once; dropping the acquisition then stops its
        // contention in the background (it won nothing: the store refused it).
        let result = tokio::select! {
            r = acquiring => r,
            refusal = watch.refused() => Err(self.refused(refusal)),
        };
        match (result, watch.refusal()) {
            (Ok(guard), Some(refusal)) => {
                drop(guard);
                Err(self.refused(refusal))
            }
            (Err(_), Some(refusal)) => Err(self.refused(refusal)),
            (Ok(guard), None) => Ok(PermitGuard { inner: guard }),
            (Err(e), None) => Err(e),
        }
    }

    fn refused(&self, refusal: Refusal) -> Error {
        match refusal {
            Refusal::Mismatch(existing) => Error::PermitsMismatch {
                semaphore: self.name.clone(),
                asked: self.permits,
                existing,
            },
            Refusal::Unsupported {
                backend,
                what,
                reason,
            } => Error::Unsupported {
                backend,
                what,
                reason,
            },
        }
    }
}

/// Proof of holding one permit of a [`Semaphore`], shaped like a [`LockGuard`] (it is one,
/// for the permit): a lease of its own, renewed in the background, lost at the local
/// deadline.
///
/// Dropping it releases the permit in the background; prefer [`PermitGuard::release`].
pub struct PermitGuard {
    inner: LockGuard,
}

impl fmt::Debug for PermitGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PermitGuard")
            .field("semaphore", &self.semaphore())
            .field("fence", &self.fence())
            .field("held", &self.is_held())
            .finish()
    }
}

impl PermitGuard {
    /// The fencing token of this permit: greater than the fence of every permit of the
    /// semaphore acquired before it. Pass it to the resource you protect.
    pub fn fence(&self) -> u64 {
        self.inner.fence()
    }

    /// The semaphore's name.
    pub fn semaphore(&self) -> &str {
        self.inner.mutex()
    }

    /// The contender id this permit is held under (the backend's holder id).
    pub fn contender_id(&self) -> &str {
        self.inner.contender_id()
    }

    /// Whether the permit is still held; checks the local lease deadline itself (see
    /// [`LockGuard::is_held`]).
    pub fn is_held(&self) -> bool {
        self.inner.is_held()
    }

    /// The time left until the local lease deadline; `Some(ZERO)` once lost.
    pub fn valid_for(&self) -> Option<Duration> {
        self.inner.valid_for()
    }

    /// Whether renewals are failing (held until the local deadline, but suspect).
    pub fn is_suspect(&self) -> bool {
        self.inner.is_suspect()
    }

    /// A receiver of the status of the contender behind this permit.
    pub fn status(&self) -> watch::Receiver<ContenderStatus> {
        self.inner.status()
    }

    /// Resolves when the permit is no longer held, with the reason.
    ///
    /// # Cancel safety
    /// Cancel safe: it only observes.
    pub async fn lost(&self) -> LossReason {
        self.inner.lost().await
    }

    /// Releases the permit and waits for that (a waiter is woken).
    ///
    /// # Errors
    /// [`Error::Lost`] when the permit had already ended before this call (the lease
    /// expired), or when the release finds it no longer this holder's on the backend
    /// (taken away, deleted or changed by hand: [`LossReason::TakenOver`], see
    /// [`LockGuard::release`]): the work done under it may have run beside N others. Never
    /// `Ok` then; a release that fails or gets no answer proves nothing and is `Ok`.
    ///
    /// # Cancel safety
    /// Dropping the future still releases, in the background.
    pub async fn release(self) -> Result<()> {
        self.inner.release().await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use tokio::time::Instant;

    use super::*;
    use crate::MemoryStore;
    use crate::admission::PERMIT_CLAIM_MS;
    use crate::store::StoreEvent;

    fn config() -> LeaseConfig {
        LeaseConfig {
            request_timeout: Duration::from_millis(500),
            retry_interval: Duration::from_millis(100),
            ..LeaseConfig::with_lease(Duration::from_millis(1000), Duration::from_millis(500))
        }
    }

    fn sem(store: &MemoryStore, name: &str, permits: u32) -> Semaphore {
        Semaphore::new(store.clone(), config(), name, permits).expect("semaphore")
    }

    #[test]
    fn zero_permits_is_a_config_error() {
        let e = Semaphore::new(MemoryStore::new(), config(), "s", 0).expect_err("zero");
        assert!(
            matches!(
                e,
                Error::InvalidConfig {
                    field: "permits",
                    ..
                }
            ),
            "{e}"
        );
        let e = Semaphore::new(MemoryStore::new(), config(), "", 1).expect_err("empty name");
        assert!(matches!(e, Error::InvalidName { .. }), "{e}");
    }

    #[tokio::test(start_paused = true)]
    async fn never_more_than_n_and_fences_increase() {
        let store = MemoryStore::new();
        let s = sem(&store, "s", 3);
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let fences = Arc::new(StdMutex::new(Vec::new()));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let (s, inside, most, fences) =
                (s.clone(), inside.clone(), most.clone(), fences.clone());
            tasks.spawn(async move {
                for _ in 0..5 {
                    let g = s.acquire().await.expect("acquire");
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    fences.lock().expect("fences").push(g.fence());
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    g.release().await.expect("release");
                }
            });
        }
        while let Some(r) = tasks.join_next().await {
            r.expect("task");
        }
        assert_eq!(
            most.load(Ordering::SeqCst),
            3,
            "at most (and here exactly) 3 at once"
        );
        let mut fences = fences.lock().expect("fences").clone();
        let n = fences.len();
        fences.sort_unstable();
        fences.dedup();
        assert_eq!(fences.len(), n, "a fence was handed out twice");
        assert_eq!(n, 40);
    }

    #[tokio::test(start_paused = true)]
    async fn mismatch_is_refused_with_a_typed_error() {
        let store = MemoryStore::new();
        let two = sem(&store, "s", 2);
        let held = two.acquire().await.expect("acquire");
        let three = sem(&store, "s", 3);
        for e in [
            three.try_acquire().await.expect_err("try"),
            three.acquire().await.expect_err("acquire"),
            three
                .acquire_timeout(Duration::from_secs(5))
                .await
                .expect_err("timeout"),
        ] {
            assert!(
                matches!(e, Error::PermitsMismatch { asked: 3, existing: 2, ref semaphore } if semaphore == "s"),
                "{e}"
            );
            assert!(!e.is_retryable());
        }
        // Once nobody holds, the count is whoever asks first.
        held.release().await.expect("release");
        let g = three.acquire().await.expect("3 now");
        assert_eq!(two.holders().await.expect("holders").permits, Some(3));
        g.release().await.expect("release");
    }

    #[tokio::test(start_paused = true)]
    async fn try_acquire_full_and_timeout_hold_nothing() {
        let store = MemoryStore::new();
        let s = sem(&store, "s", 1);
        let g = s.acquire().await.expect("acquire");
        let started = Instant::now();
        let e = s.try_acquire().await.expect_err("full");
        assert!(matches!(e, Error::WouldBlock { .. }), "{e}");
        assert!(started.elapsed() < Duration::from_millis(100), "at once");
        let e = s
            .acquire_timeout(Duration::from_millis(700))
            .await
            .expect_err("full");
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        let holders = s.holders().await.expect("holders").holders;
        assert_eq!(holders.len(), 1);
        assert_eq!(holders[0].owner_id, g.contender_id());
        // The give-ups left the queue: a release finds nobody queued ahead of a newcomer.
        g.release().await.expect("release");
        s.try_acquire()
            .await
            .expect("free")
            .release()
            .await
            .expect("release");
    }

    #[tokio::test(start_paused = true)]
    async fn release_wakes_a_waiter_at_once() {
        let store = MemoryStore::new();
        let s = sem(&store, "s", 1);
        let g = s.acquire().await.expect("acquire");
        let waiter = tokio::spawn({
            let s = s.clone();
            async move { s.acquire().await.map(|g| (g, Instant::now())) }
        });
        // Let the waiter queue (time is paused: this only runs the other tasks).
        tokio::time::sleep(Duration::from_millis(50)).await;
        let released = Instant::now();
        g.release().await.expect("release");
        let (g2, at) = waiter.await.expect("task").expect("acquire");
        // Pushed: the waiter does not wait for the end of the released lease (1.5 s).
        assert!(at.duration_since(released) < Duration::from_millis(100));
        g2.release().await.expect("release");
    }

    /// A store whose permit calls hang once `frozen` is set: the holder's process is cut
    /// off from the backend.
    struct Frozen {
        inner: MemoryStore,
        frozen: Arc<AtomicBool>,
    }

    impl PermitStore for Frozen {
        fn backend(&self) -> &'static str {
            "memory"
        }
        async fn permit_acquire(&self, s: &str, c: &str, n: u32, l: Lease) -> Result<LeaseReply> {
            if self.frozen.load(Ordering::SeqCst) {
                return std::future::pending().await;
            }
            self.inner.permit_acquire(s, c, n, l).await
        }
        async fn permit_guard(&self, s: &str, c: &str, n: u32, l: Lease) -> Result<LeaseReply> {
            if self.frozen.load(Ordering::SeqCst) {
                return std::future::pending().await;
            }
            self.inner.permit_guard(s, c, n, l).await
        }
        async fn permit_release(&self, s: &str, c: &str) -> Result<bool> {
            if self.frozen.load(Ordering::SeqCst) {
                return std::future::pending().await;
            }
            self.inner.permit_release(s, c).await
        }
        async fn permit_owners(&self, s: &str) -> Result<PermitHolders> {
            self.inner.permit_owners(s).await
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_cut_off_holder_stops_believing_before_its_permit_returns() {
        let store = MemoryStore::new();
        let frozen = Arc::new(AtomicBool::new(false));
        let cut = Frozen {
            inner: store.clone(),
            frozen: frozen.clone(),
        };
        let cut = Semaphore::new(cut, config(), "s", 1).expect("semaphore");
        let g = cut.acquire().await.expect("acquire");
        frozen.store(true, Ordering::SeqCst);
        let other = sem(&store, "s", 1);
        let taken = tokio::spawn(async move {
            let g = other.acquire().await.expect("acquire");
            (Instant::now(), g)
        });
        let reason = g.lost().await;
        let lost_at = Instant::now();
        assert_eq!(reason, LossReason::LeaseExpired);
        let (taken_at, g2) = taken.await.expect("task");
        assert!(
            lost_at <= taken_at,
            "the new holder got in before the old one stopped"
        );
        assert!(g2.fence() > g.fence());
        assert!(matches!(g.release().await, Err(Error::Lost { .. })));
        drop(g2);
    }

    /// A store that cannot do what is asked of it (as ZooKeeper refuses a lease longer than
    /// its session keeps safe).
    struct Refuses;

    impl PermitStore for Refuses {
        fn backend(&self) -> &'static str {
            "refuses"
        }
        async fn permit_acquire(&self, _: &str, _: &str, _: u32, _: Lease) -> Result<LeaseReply> {
            Err(Error::unsupported("refuses", "this lease", "too long"))
        }
        async fn permit_release(&self, _: &str, _: &str) -> Result<bool> {
            Ok(false)
        }
        async fn permit_owners(&self, _: &str) -> Result<PermitHolders> {
            Ok(PermitHolders {
                permits: None,
                holders: Vec::new(),
                now: 0,
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_for_good_ends_the_wait_typed() {
        let s = Semaphore::new(Refuses, config(), "s", 2).expect("semaphore");
        let started = Instant::now();
        for e in [
            s.acquire().await.expect_err("acquire"),
            s.try_acquire().await.expect_err("try"),
        ] {
            assert!(
                matches!(
                    e,
                    Error::Unsupported {
                        backend: "refuses",
                        what: "this lease",
                        ..
                    }
                ),
                "{e}"
            );
        }
        // Not retried until some timeout: the engine's first answer ends it.
        assert!(started.elapsed() < Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn store_queue_is_first_come_first_served() {
        let store = MemoryStore::new();
        let lease = config().lease();
        let a = store.permit_acquire("q", "a", 1, lease).await.expect("a");
        assert!(a.owner.is_owner("a"));
        for who in ["b", "c"] {
            let r = store
                .permit_acquire("q", who, 1, lease)
                .await
                .expect("queue");
            assert!(!r.owner.has_owner() || r.owner.owner_id.is_empty());
        }
        let mut c_events = store
            .permit_subscribe("q", "c")
            .await
            .expect("sub")
            .expect("push");
        let mut b_events = store
            .permit_subscribe("q", "b")
            .await
            .expect("sub")
            .expect("push");
        assert!(store.permit_release("q", "a").await.expect("release"));
        // One wake-up for the one freed permit, to the first in line, and one to the next
        // (it looks again when b's claim ends).
        assert_eq!(b_events.try_recv().ok(), Some(StoreEvent::Released));
        assert_eq!(c_events.try_recv().ok(), Some(StoreEvent::Released));
        // c may not barge past b.
        let r = store.permit_acquire("q", "c", 1, lease).await.expect("c");
        assert!(!r.owner.is_owner("c"));
        assert_eq!(r.owner.transition_at, r.now + PERMIT_CLAIM_MS);
        let b = store.permit_acquire("q", "b", 1, lease).await.expect("b");
        assert!(b.owner.is_owner("b"));
        assert!(b.owner.fence > a.owner.fence);
        // A renewal keeps the fence; a stale release frees nothing.
        let again = store.permit_guard("q", "b", 1, lease).await.expect("renew");
        assert_eq!(
            (again.owner.fence, again.owner.acquired_at),
            (b.owner.fence, b.owner.acquired_at)
        );
        assert!(!store.permit_release("q", "a").await.expect("stale"));
        assert_eq!(
            store
                .permit_owners("q")
                .await
                .expect("owners")
                .holders
                .len(),
            1
        );
        // Leaving the queue never frees a permit held (the engine leaves when it lost
        // track of its permit: the lease frees it).
        store.permit_leave("q", "b").await.expect("leave");
        assert_eq!(
            store.permit_owners("q").await.expect("owners").holders[0].owner_id,
            "b"
        );
        // Semaphores and mutexes of one name are apart.
        assert!(
            store
                .acquire("q", "z", lease)
                .await
                .expect("mutex")
                .owner
                .is_owner("z")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_stopped_waiter_is_passed_over_once_its_claim_ends() {
        let store = MemoryStore::new();
        let lease = config().lease();
        store.permit_acquire("q", "a", 1, lease).await.expect("a");
        let mut events = Vec::new();
        for who in ["b", "c"] {
            store
                .permit_acquire("q", who, 1, lease)
                .await
                .expect("queue");
            events.push(store.permit_subscribe("q", who).await.expect("sub"));
        }
        assert!(store.permit_release("q", "a").await.expect("release"));
        // b is owed the permit and does not call (stopped); c, woken as the next, waits
        // until b's claim ends, then takes it.
        let r = store.permit_acquire("q", "c", 1, lease).await.expect("c");
        assert!(!r.owner.is_owner("c"));
        let look = u64::try_from(r.owner.transition_at - r.now).expect("ms");
        assert!(look <= u64::try_from(PERMIT_CLAIM_MS).expect("ms"));
        tokio::time::advance(Duration::from_millis(look)).await;
        let c = store.permit_acquire("q", "c", 1, lease).await.expect("c");
        assert!(c.owner.is_owner("c"), "{c:?}");
        // b kept its place: once c releases, b is first again.
        assert!(store.permit_release("q", "c").await.expect("release"));
        let b = store.permit_acquire("q", "b", 1, lease).await.expect("b");
        assert!(b.owner.is_owner("b"), "{b:?}");
        drop(events);
    }
}
