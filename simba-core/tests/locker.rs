//! `Locker` semantics in paused tokio time, over the in-memory store wrapped in a fault
//! store: tasks of one process exclude each other, a re-acquire never overlaps the release of
//! the hold before it, an acquire that gives up leaves nothing owned, and a release tells
//! whether the ownership had already ended.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use simba_core::backend::{Lease, LeaseReply, LeaseStore};
use simba_core::fault::{Behavior, FaultStore, Op};
use simba_core::{
    ContendServiceFactory, Error, LeaseConfig, LeaseServiceFactory, Locker, LossReason, MemoryStore,
};
use tokio::sync::mpsc;
use tokio::time::Instant;

const TTL: Duration = Duration::from_millis(1000);
const TRANSITION: Duration = Duration::from_millis(500);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);

fn config() -> LeaseConfig {
    LeaseConfig {
        drift_margin: Duration::from_millis(100),
        request_timeout: REQUEST_TIMEOUT,
        retry_interval: Duration::from_millis(100),
        ..LeaseConfig::with_lease(TTL, TRANSITION)
    }
}

fn factory_over<S: LeaseStore>(store: S) -> Arc<dyn ContendServiceFactory> {
    Arc::new(LeaseServiceFactory::new(store, config()).expect("config"))
}

/// One backend (`memory`), a fault point in front of it, and a factory through that point,
/// as one process would have.
struct Setup {
    memory: MemoryStore,
    store: FaultStore<MemoryStore>,
    factory: Arc<dyn ContendServiceFactory>,
}

fn setup() -> Setup {
    let memory = MemoryStore::new();
    let store = FaultStore::new(memory.clone());
    let factory = factory_over(store.clone());
    Setup {
        memory,
        store,
        factory,
    }
}

impl Setup {
    /// A factory of another process on the same backend.
    fn other_process(&self) -> Arc<dyn ContendServiceFactory> {
        factory_over(self.memory.clone())
    }

    async fn owner_id(&self) -> String {
        self.memory.owner("m").await.expect("owner").owner.owner_id
    }

    async fn is_free(&self) -> bool {
        !self
            .memory
            .owner("m")
            .await
            .expect("owner")
            .owner
            .has_owner()
    }
}

/// Lets spawned tasks run until they wait on something.
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn tasks_sharing_one_locker_exclude_each_other() {
    let s = setup();
    let locker = Locker::new(s.factory.clone(), "m").expect("locker");
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (locker, inside, most) = (locker.clone(), inside.clone(), most.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..3 {
                let guard = locker.acquire().await.expect("acquire");
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                guard.release().await.expect("release");
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "tasks sharing one locker were inside at once"
    );
}

#[tokio::test(start_paused = true)]
async fn local_waiters_queue_in_order_in_front_of_one_backend_contender() {
    let s = setup();
    let first = Locker::new(s.factory.clone(), "m").expect("locker");
    let guard = first.acquire().await.expect("acquire");
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..5 {
        // Each waiter makes its own Locker for the name: they are one locker of the process.
        let locker = Locker::new(s.factory.clone(), "m").expect("locker");
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let g = locker.acquire().await.expect("acquire");
            order.lock().expect("order").push(i);
            g.release().await.expect("release");
        }));
        settle().await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        s.store.control().calls(Op::Acquire),
        1,
        "five local waiters must wait in this process, not as five backend contenders"
    );
    assert!(guard.is_held());
    guard.release().await.expect("release");
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(*order.lock().expect("order"), vec![0, 1, 2, 3, 4]);
}

/// `drop(guard); locker.acquire()`: the dropped guard's release is still in flight when the
/// next acquisition starts. It must not come back as an ownership that the release then
/// frees for someone else.
#[tokio::test(start_paused = true)]
async fn a_reacquire_never_holds_what_the_previous_release_freed() {
    let s = setup();
    let locker = Locker::new(s.factory.clone(), "m").expect("locker");
    let other = Locker::new(s.other_process(), "m").expect("other");
    let first = locker.acquire().await.expect("acquire");
    let fence = first.fence();
    s.store
        .control()
        .set(Op::Release, Behavior::Delay(Duration::from_millis(100)));
    drop(first);
    let again = locker.acquire().await.expect("acquire again");
    // Whatever happened to the release, it has landed by now.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let theirs = other.try_acquire().await;
    assert!(
        !(again.is_held() && theirs.is_ok()),
        "two owners: the re-acquired guard (fence {}) and another locker ({theirs:?})",
        again.fence()
    );
    assert!(again.is_held(), "the re-acquired guard lost the mutex");
    assert!(
        matches!(theirs, Err(Error::WouldBlock { .. })),
        "{theirs:?}"
    );
    assert!(
        again.fence() > fence,
        "a new ownership needs a new fence: {} after {fence}",
        again.fence()
    );
    again.release().await.expect("release");
}

/// `release()` in one task while a clone acquires: the clone's ownership begins after the
/// release, never inside it.
#[tokio::test(start_paused = true)]
async fn a_clone_acquiring_during_a_release_gets_its_own_ownership() {
    let s = setup();
    let locker = Locker::new(s.factory.clone(), "m").expect("locker");
    let other = Locker::new(s.other_process(), "m").expect("other");
    let first = locker.acquire().await.expect("acquire");
    s.store
        .control()
        .set(Op::Release, Behavior::Delay(Duration::from_millis(100)));
    let clone = locker.clone();
    let releasing = tokio::spawn(first.release());
    settle().await;
    let second = clone.acquire().await.expect("acquire through the clone");
    releasing.await.expect("task").expect("release");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(second.is_held());
    let theirs = other.try_acquire().await;
    assert!(
        matches!(theirs, Err(Error::WouldBlock { .. })),
        "the clone holds the mutex, yet: {theirs:?}"
    );
    second.release().await.expect("release");
}

#[tokio::test(start_paused = true)]
async fn try_acquire_right_after_a_drop_waits_for_that_release_only() {
    let s = setup();
    let locker = Locker::new(s.factory.clone(), "m").expect("locker");
    let g = locker.acquire().await.expect("acquire");
    drop(g);
    let again = locker.try_acquire().await;
    assert!(again.is_ok(), "{again:?}");
    if let Ok(g) = again {
        g.release().await.expect("release");
    }
}

/// The acquisition reaches the backend but its answer never comes: when `acquire_timeout`
/// returns `Timeout`, the mutex is already free again (no background release that a
/// process exit would cut short).
#[tokio::test(start_paused = true)]
async fn a_timed_out_acquire_has_released_before_it_returns() {
    let s = setup();
    let locker = Locker::new(s.factory.clone(), "m").expect("locker");
    s.store.control().set(Op::Acquire, Behavior::ApplyThenHang);
    let r = locker.acquire_timeout(Duration::from_millis(50)).await;
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    assert!(
        s.is_free().await,
        "Timeout was returned while the mutex is owned by {:?}",
        s.owner_id().await
    );
    // Bounded: the unanswered call counts for at most one request timeout.
    s.store.control().set_all(Behavior::Pass);
}

/// A store whose acquisition, once sent, completes even if the caller stops waiting (as a
/// statement on a blocking thread or on the wire does): it lands `delay` after the call.
#[derive(Clone)]
struct Detached {
    inner: MemoryStore,
    delay: Duration,
}

impl LeaseStore for Detached {
    fn backend(&self) -> &'static str {
        "memory"
    }

    async fn acquire(
        &self,
        mutex: &str,
        contender_id: &str,
        lease: Lease,
    ) -> simba_core::Result<LeaseReply> {
        let (inner, delay) = (self.inner.clone(), self.delay);
        let (m, id) = (mutex.to_owned(), contender_id.to_owned());
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            inner.acquire(&m, &id, lease).await
        })
        .await
        .map_err(|e| Error::backend("memory", e.to_string()))?
    }

    async fn guard(
        &self,
        mutex: &str,
        contender_id: &str,
        lease: Lease,
    ) -> simba_core::Result<LeaseReply> {
        self.inner.guard(mutex, contender_id, lease).await
    }

    async fn release(&self, mutex: &str, contender_id: &str) -> simba_core::Result<bool> {
        self.inner.release(mutex, contender_id).await
    }

    async fn release_after(
        &self,
        mutex: &str,
        contender_id: &str,
        hold: Duration,
    ) -> simba_core::Result<bool> {
        self.inner.release_after(mutex, contender_id, hold).await
    }

    async fn owner(&self, mutex: &str) -> simba_core::Result<LeaseReply> {
        self.inner.owner(mutex).await
    }

    async fn subscribe(
        &self,
        mutex: &str,
        contender_id: &str,
    ) -> simba_core::Result<Option<simba_core::events::EventReceiver>> {
        self.inner.subscribe(mutex, contender_id).await
    }
}

/// The acquisition wins on the backend after the caller gave up (the `simba exec --timeout
/// 1ms` leak): the give-up must wait for it and release it, not leave a dead owner.
#[tokio::test(start_paused = true)]
async fn an_acquisition_that_lands_after_the_timeout_is_released() {
    let memory = MemoryStore::new();
    let store = Detached {
        inner: memory.clone(),
        delay: Duration::from_millis(30),
    };
    let locker = Locker::new(factory_over(store), "m").expect("locker");
    let t0 = Instant::now();
    let r = locker.acquire_timeout(Duration::from_millis(1)).await;
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    assert!(
        Instant::now() - t0 < REQUEST_TIMEOUT,
        "gave up only after {:?}",
        Instant::now() - t0
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let owner = memory.owner("m").await.expect("owner").owner;
    assert!(
        !owner.has_owner(),
        "a timed-out acquire left the mutex owned by {:?}",
        owner.owner_id
    );
}

#[tokio::test(start_paused = true)]
async fn try_acquire_on_a_held_mutex_leaves_nothing_behind() {
    let memory = MemoryStore::new();
    let owner = Locker::new(factory_over(memory.clone()), "m").expect("owner");
    let held = owner.acquire().await.expect("acquire");
    let store = Detached {
        inner: memory.clone(),
        delay: Duration::from_millis(30),
    };
    let locker = Locker::new(factory_over(store), "m").expect("locker");
    let r = locker.try_acquire().await;
    assert!(matches!(r, Err(Error::WouldBlock { .. })), "{r:?}");
    held.release().await.expect("release");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !memory.owner("m").await.expect("owner").owner.has_owner(),
        "the failed try left a contender that took the mutex later"
    );
}

#[tokio::test(start_paused = true)]
async fn release_after_the_lease_expired_says_so() {
    let s = setup();
    let locker = Locker::new(s.factory.clone(), "m").expect("locker");
    let guard = locker.acquire().await.expect("acquire");
    s.store.control().set(Op::Guard, Behavior::Fail);
    s.store.control().set(Op::Acquire, Behavior::Fail);
    assert_eq!(guard.lost().await, LossReason::LeaseExpired);
    s.store.control().set_all(Behavior::Pass);
    let r = guard.release().await;
    assert!(
        matches!(
            r,
            Err(Error::Lost {
                reason: LossReason::LeaseExpired,
                ..
            })
        ),
        "a release after the loss must say the work ran unprotected: {r:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn release_after_a_takeover_says_so() {
    let s = setup();
    let locker = Locker::new(s.factory.clone(), "m").expect("locker");
    let guard = locker.acquire().await.expect("acquire");
    // Someone frees the mutex behind the owner's back and another contender takes it.
    let mine = s.owner_id().await;
    assert!(s.memory.release("m", &mine).await.expect("release"));
    let lease = Lease {
        ttl: TTL,
        transition: TRANSITION,
    };
    let theirs = s
        .memory
        .acquire("m", "intruder", lease)
        .await
        .expect("take");
    assert!(theirs.owner.is_owner("intruder"));
    assert_eq!(guard.lost().await, LossReason::TakenOver);
    let r = guard.release().await;
    assert!(
        matches!(
            r,
            Err(Error::Lost {
                reason: LossReason::TakenOver,
                ..
            })
        ),
        "{r:?}"
    );
    assert_eq!(
        s.owner_id().await,
        "intruder",
        "release freed someone else's"
    );
}

#[tokio::test(start_paused = true)]
async fn release_of_a_held_guard_frees_the_mutex_before_it_returns() {
    let s = setup();
    let locker = Locker::new(s.factory.clone(), "m").expect("locker");
    let guard = locker.acquire().await.expect("acquire");
    guard.release().await.expect("release");
    assert!(s.is_free().await);
}

/// A store that tells [`pause_after_grants`] of every acquisition it grants to the caller,
/// right before the answer goes back.
///
/// It grants only when the pausing task is ready to pause: it takes a permit of `ready`
/// first (a closed `ready`: no more pauses, grant without telling).
#[derive(Clone)]
struct TellsGrants {
    inner: MemoryStore,
    ready: Arc<tokio::sync::Semaphore>,
    granted: mpsc::UnboundedSender<()>,
}

impl LeaseStore for TellsGrants {
    fn backend(&self) -> &'static str {
        "memory"
    }

    async fn acquire(
        &self,
        mutex: &str,
        contender_id: &str,
        lease: Lease,
    ) -> simba_core::Result<LeaseReply> {
        let tell = match self.ready.acquire().await {
            Ok(permit) => {
                permit.forget();
                true
            }
            Err(_) => false,
        };
        let reply = self.inner.acquire(mutex, contender_id, lease).await?;
        if tell && reply.owner.is_owned_by_at(contender_id, reply.now) {
            let _ = self.granted.send(());
        } else if tell {
            // Not granted: the pause is still to come.
            self.ready.add_permits(1);
        }
        Ok(reply)
    }

    async fn guard(
        &self,
        mutex: &str,
        contender_id: &str,
        lease: Lease,
    ) -> simba_core::Result<LeaseReply> {
        self.inner.guard(mutex, contender_id, lease).await
    }

    async fn release(&self, mutex: &str, contender_id: &str) -> simba_core::Result<bool> {
        self.inner.release(mutex, contender_id).await
    }

    async fn release_after(
        &self,
        mutex: &str,
        contender_id: &str,
        hold: Duration,
    ) -> simba_core::Result<bool> {
        self.inner.release_after(mutex, contender_id, hold).await
    }

    async fn owner(&self, mutex: &str) -> simba_core::Result<LeaseReply> {
        self.inner.owner(mutex).await
    }

    async fn subscribe(
        &self,
        mutex: &str,
        contender_id: &str,
    ) -> simba_core::Result<Option<simba_core::events::EventReceiver>> {
        self.inner.subscribe(mutex, contender_id).await
    }
}

/// A factory over `memory` whose process "pauses" for `pause` right after the backend
/// granted an acquisition, for the first `pauses` grants: the engine has published the
/// ownership, and the clock jumps before anything else runs, as when a SIGSTOP or a long
/// stall hits the process between the grant and the acquire call returning.
///
/// How: the store waits until the pausing task is ready, then signals the grant (which
/// wakes the pausing task) before it answers; the
/// engine then publishes the ownership (which wakes the acquiring task) and waits on its
/// timers. Tokio's current-thread scheduler runs woken tasks in order, so the pausing task
/// moves the clock (`tokio::time::advance`) before the acquiring task looks, and before
/// the engine's timers are processed: the acquiring task finds its ownership held and its
/// local deadline passed, as a process waking from a pause does.
fn pause_after_grants(
    memory: &MemoryStore,
    pause: Duration,
    pauses: usize,
) -> Arc<dyn ContendServiceFactory> {
    let (granted, mut grants) = mpsc::unbounded_channel();
    let ready = Arc::new(tokio::sync::Semaphore::new(0));
    let pauser = ready.clone();
    tokio::spawn(async move {
        for _ in 0..pauses {
            pauser.add_permits(1);
            if grants.recv().await.is_none() {
                break;
            }
            tokio::time::advance(pause).await;
        }
        pauser.close();
    });
    factory_over(TellsGrants {
        inner: memory.clone(),
        ready,
        granted,
    })
}

/// Longer than the local lease deadline (`ttl + transition - drift_margin` = 1.4 s after
/// the request was sent) and than the backend's lease (1.5 s).
const PAST_THE_LEASE: Duration = Duration::from_secs(2);

/// Asserts that `guard` holds the mutex on `memory` under its own contender id and fence.
async fn assert_owns(memory: &MemoryStore, guard: &simba_core::LockGuard) {
    assert!(guard.is_held(), "the returned guard is not held: {guard:?}");
    let owner = memory.owner("m").await.expect("owner").owner;
    assert_eq!(owner.owner_id, guard.contender_id(), "the backend's owner");
    assert_eq!(owner.fence, guard.fence(), "the backend's fence");
}

/// The process pauses between the backend granting `acquire()` and the call returning,
/// past the lease: its own expired win is no other contender's hold. `acquire()` has no
/// deadline, so it goes on waiting and returns a guard that holds the mutex.
#[tokio::test(start_paused = true)]
async fn acquire_paused_after_winning_goes_on_waiting() {
    let memory = MemoryStore::new();
    let locker = Locker::new(pause_after_grants(&memory, PAST_THE_LEASE, 1), "m").expect("locker");
    let t0 = Instant::now();
    let acquiring = tokio::spawn(async move { locker.acquire().await });
    let r = tokio::time::timeout(Duration::from_secs(60), acquiring)
        .await
        .expect("acquire() hangs after a paused win")
        .expect("task");
    let guard = r.unwrap_or_else(|e| {
        panic!(
            "acquire() failed {:?} in, after its win expired during a pause: {e:?}",
            Instant::now() - t0
        )
    });
    assert_owns(&memory, &guard).await;
    guard.release().await.expect("release");
}

/// A pause after the grant that ends before the local deadline: the win still stands, and
/// `acquire()` returns it.
#[tokio::test(start_paused = true)]
async fn acquire_paused_briefly_after_winning_returns_that_win() {
    let memory = MemoryStore::new();
    let factory = pause_after_grants(&memory, Duration::from_millis(1000), 1);
    let locker = Locker::new(factory, "m").expect("locker");
    let guard = tokio::spawn(async move { locker.acquire().await })
        .await
        .expect("task")
        .expect("acquire");
    assert_eq!(guard.fence(), 1, "the first win is the one returned");
    assert_owns(&memory, &guard).await;
    guard.release().await.expect("release");
}

/// As `acquire_paused_after_winning_goes_on_waiting`, with a deadline far off:
/// `acquire_timeout` goes on waiting too, and neither says another contender holds it
/// nor gives up before its deadline.
#[tokio::test(start_paused = true)]
async fn acquire_timeout_paused_after_winning_goes_on_waiting() {
    let memory = MemoryStore::new();
    let locker = Locker::new(pause_after_grants(&memory, PAST_THE_LEASE, 1), "m").expect("locker");
    let t0 = Instant::now();
    let r = tokio::spawn(async move { locker.acquire_timeout(Duration::from_secs(30)).await })
        .await
        .expect("task");
    let guard = r.unwrap_or_else(|e| {
        panic!(
            "acquire_timeout(30s) failed {:?} in, after its win expired during a pause: {e:?}",
            Instant::now() - t0
        )
    });
    assert_owns(&memory, &guard).await;
    guard.release().await.expect("release");
}

/// Every win comes back expired: `acquire_timeout` says `Timeout`, and only once its
/// deadline has passed; nothing stays owned.
#[tokio::test(start_paused = true)]
async fn acquire_timeout_whose_wins_all_expire_times_out_at_its_deadline() {
    let memory = MemoryStore::new();
    let factory = pause_after_grants(&memory, PAST_THE_LEASE, usize::MAX);
    let locker = Locker::new(factory, "m").expect("locker");
    let wait = Duration::from_secs(5);
    let t0 = Instant::now();
    let r = tokio::spawn(async move { locker.acquire_timeout(wait).await })
        .await
        .expect("task");
    let waited = Instant::now() - t0;
    assert!(
        matches!(r, Err(Error::Timeout { .. })),
        "expected Timeout after {wait:?}, got {r:?} after {waited:?}"
    );
    assert!(waited >= wait, "gave up after {waited:?}, before {wait:?}");
    let owner = memory.owner("m").await.expect("owner").owner;
    assert!(
        !owner.has_owner(),
        "the timed-out acquire left the mutex owned by {:?}",
        owner.owner_id
    );
}

/// `try_acquire` whose one attempt won, paused past the lease before it looked: it gives
/// up (it tries once), but says it did not acquire in time, not that another contender
/// holds the mutex; nothing stays owned.
#[tokio::test(start_paused = true)]
async fn try_acquire_paused_after_winning_blames_no_other_contender() {
    let memory = MemoryStore::new();
    let locker = Locker::new(pause_after_grants(&memory, PAST_THE_LEASE, 1), "m").expect("locker");
    let r = tokio::spawn(async move { locker.try_acquire().await })
        .await
        .expect("task");
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    let owner = memory.owner("m").await.expect("owner").owner;
    assert!(
        !owner.has_owner(),
        "the failed try left the mutex owned by {:?}",
        owner.owner_id
    );
}

/// A release that fails or never answers proves nothing about the ownership: it is not a
/// loss (the lease frees the mutex), and `release()` says `Ok`.
#[tokio::test(start_paused = true)]
async fn a_release_that_fails_or_hangs_is_not_a_loss() {
    let s = setup();
    let locker = Locker::new(s.factory.clone(), "m").expect("locker");
    let control = s.store.control();
    for behavior in [Behavior::Fail, Behavior::Hang] {
        let guard = locker.acquire().await.expect("acquire");
        let (fence, status) = (guard.fence(), guard.status());
        control.set(Op::Release, behavior);
        let r = guard.release().await;
        assert!(r.is_ok(), "{behavior:?}: {r:?}");
        let last = status.borrow().last_loss;
        assert_eq!(
            last.map(|l| (l.fence, l.reason)),
            Some((fence, LossReason::Released)),
            "{behavior:?}"
        );
        control.set(Op::Release, Behavior::Pass);
        // The lease frees what the release did not.
        tokio::time::sleep(TTL + TRANSITION).await;
    }
}

/// A release with a hold that finds the mutex changed by hand is a loss, as a plain
/// release's is, and the guard's status says so.
#[tokio::test(start_paused = true)]
async fn a_hold_that_finds_the_owner_changed_is_lost() {
    let s = setup();
    let guard = Locker::new(s.factory.clone(), "m")
        .expect("locker")
        .acquire()
        .await
        .expect("acquire");
    let (fence, status) = (guard.fence(), guard.status());
    assert!(
        s.memory
            .overwrite_owner("m", guard.contender_id(), "intruder")
    );
    let r = guard.release_at_least(Duration::from_secs(60)).await;
    assert!(
        matches!(
            r,
            Err(Error::Lost {
                reason: LossReason::TakenOver,
                ..
            })
        ),
        "{r:?}"
    );
    let last = status.borrow().last_loss;
    assert_eq!(
        last.map(|l| (l.fence, l.reason)),
        Some((fence, LossReason::TakenOver))
    );
    assert_eq!(
        s.owner_id().await,
        "intruder",
        "the stale release freed nothing"
    );
}
