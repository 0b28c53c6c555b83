//! Model-checked tests of the locker's in-process concurrency: the per-name turn queue,
//! the honest give-up, guard drop / release / re-acquire and the hold path, run over
//! [`MemoryStore`] with two or three tasks under the [shuttle] model checker.
//!
//! **Why shuttle, not loom.** What is checked here is async code: the `Locker`, its
//! watcher task and the lease engine's driver task talk through `tokio::sync` channels and
//! a `tokio::sync::Mutex`, and race at their `.await`s and around store calls. Loom
//! explores interleavings exhaustively, but only of operations on its own `loom::sync` /
//! `loom::thread` types, and it runs threads (one future per thread with
//! `loom::future::block_on`), not spawned tasks; checking this code with it would mean
//! rewriting the locker and the engine against loom's types, and exhaustive search of
//! this many synchronisation points would not end. Shuttle
//! runs futures on its own executor (`shuttle::future::spawn`), so the code that ships
//! runs unchanged on it once spawning and timers go through the small seam of
//! `crate::rt`. Each scenario runs 2,000 schedules under each of shuttle's DFS scheduler
//! (depth-first from a fixed start: exhaustive only for the schedules it reaches within
//! that cap, not for the whole space), its PCT
//! scheduler (bugs of depth 3 found with a known probability) and its uniform random one,
//! with fixed seeds; a schedule longer than 20,000 steps fails (a livelock). The price,
//! said plainly: shuttle switches tasks only at its own
//! scheduling points — every `.await` that suspends, every spawn, and the yields this test
//! store puts before and after each store call — and treats a `tokio::sync` operation
//! between two such points as atomic (tokio model-checks those primitives itself with
//! loom). Time stands still in the model (see `crate::rt`): leases of an hour never
//! expire, so what is checked is the concurrency, not the clock.
//!
//! Asserted in every explored schedule:
//! - never two guards of one name believing they hold at once, and a guard that believes
//!   it holds is the store's owner with its fence (checked before and after every store
//!   call, and when a task gets, holds and lets go of a guard);
//! - fences of successive guards strictly increase;
//! - a give-up (`try_acquire`, `acquire_timeout`) that returns an error leaves nothing of
//!   its contender owned, and once everything is settled nothing is owned at all;
//! - no lost wake-up: shuttle fails a schedule in which a task waits forever (a deadlock),
//!   so a waiter left waiting while the mutex is free is a failure.
//!
//! `early_turn` re-creates the old same-fence race (the turn passed on before the old
//! ownership's release completed; `locker::mutation`), and the checker must catch it.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::service::ContenderStatus;
use crate::store::{Lease, LeaseReply, LeaseStore};
use crate::{LeaseConfig, LeaseServiceFactory, LockGuard, Locker, MemoryStore};

const MUTEX: &str = "m";

/// Leases so long that nothing expires while a schedule runs (time stands still anyway).
fn config() -> LeaseConfig {
    LeaseConfig {
        ttl: Duration::from_secs(3600),
        transition: Duration::from_secs(600),
        request_timeout: Duration::from_secs(600),
        ..LeaseConfig::default()
    }
}

/// What the tasks of one schedule share: the guards alive now (fence, contender id,
/// status) and the last fence handed out.
#[derive(Default)]
struct World {
    live: Mutex<Vec<(u64, String, watch::Receiver<ContenderStatus>)>>,
    last_fence: Mutex<u64>,
    /// Tasks of the shared-id locker whose acquisition or guard is under way.
    busy: Mutex<usize>,
}

/// Whether the guard behind `status` believes it holds `fence` (as `LockGuard::is_held`).
fn believes(status: &watch::Receiver<ContenderStatus>, fence: u64) -> bool {
    let s = status.borrow();
    s.running
        && s.owns_now()
        && s.held.is_some_and(|h| h.fence == fence)
        && s.last_loss.is_none_or(|l| l.fence != fence)
}

impl World {
    /// At most one live guard believes it holds, and that one is the store's owner.
    fn check(&self, store: &MemoryStore) {
        let owner = owner_now(store);
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let believers: Vec<_> = live
            .iter()
            .filter(|(fence, _, status)| believes(status, *fence))
            .map(|(fence, id, _)| (*fence, id.clone()))
            .collect();
        assert!(
            believers.len() <= 1,
            "two guards believe they hold {MUTEX:?}: {believers:?}"
        );
        for (fence, id) in believers {
            assert!(
                owner.is_owner(&id) && owner.fence == fence,
                "a guard ({id}, fence {fence}) believes it holds, but the store's owner is \
                 {:?} with fence {}",
                owner.owner_id,
                owner.fence
            );
        }
    }

    /// Records a new guard: its fence must be larger than every earlier one.
    fn enter(&self, store: &MemoryStore, guard: &LockGuard) {
        {
            let mut last = self.last_fence.lock().unwrap_or_else(|p| p.into_inner());
            assert!(
                guard.fence() > *last,
                "fence {} handed out after fence {}",
                guard.fence(),
                *last
            );
            *last = guard.fence();
        }
        self.live.lock().unwrap_or_else(|p| p.into_inner()).push((
            guard.fence(),
            guard.contender_id().to_owned(),
            guard.status(),
        ));
        self.check(store);
    }

    /// The guard is about to go (release or drop).
    fn leave(&self, store: &MemoryStore, guard: &LockGuard) {
        self.check(store);
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(f, _, _)| *f != guard.fence());
    }
}

/// The store's owner of the mutex now.
fn owner_now(store: &MemoryStore) -> crate::MutexOwner {
    poll_now(store.owner(MUTEX))
        .expect("the memory store answers")
        .owner
}

/// Polls a future that completes without waiting (the memory store's calls) once.
fn poll_now<F: Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("a memory store call waited"),
    }
}

/// The memory store, with a scheduling point before and after every call (other tasks run
/// while a call is "on the wire") and the world's check at each.
#[derive(Clone)]
struct ModelStore {
    inner: MemoryStore,
    world: Arc<World>,
}

impl ModelStore {
    async fn call<T>(&self, op: impl Future<Output = T>) -> T {
        self.world.check(&self.inner);
        shuttle::future::yield_now().await;
        let out = op.await;
        self.world.check(&self.inner);
        shuttle::future::yield_now().await;
        out
    }
}

impl LeaseStore for ModelStore {
    fn backend(&self) -> &'static str {
        "model"
    }
    async fn acquire(&self, m: &str, c: &str, lease: Lease) -> crate::Result<LeaseReply> {
        self.call(self.inner.acquire(m, c, lease)).await
    }
    async fn guard(&self, m: &str, c: &str, lease: Lease) -> crate::Result<LeaseReply> {
        self.call(self.inner.guard(m, c, lease)).await
    }
    async fn release(&self, m: &str, c: &str) -> crate::Result<bool> {
        self.call(self.inner.release(m, c)).await
    }
    async fn release_after(&self, m: &str, c: &str, hold: Duration) -> crate::Result<bool> {
        self.call(self.inner.release_after(m, c, hold)).await
    }
    async fn owner(&self, m: &str) -> crate::Result<LeaseReply> {
        self.call(self.inner.owner(m)).await
    }
    async fn subscribe(
        &self,
        m: &str,
        c: &str,
    ) -> crate::Result<Option<crate::events::EventReceiver>> {
        self.call(self.inner.subscribe(m, c)).await
    }
}

/// One schedule's setup: the store, the world, and a factory per "process".
struct Setup {
    store: MemoryStore,
    world: Arc<World>,
    factories: Vec<Arc<LeaseServiceFactory<ModelStore>>>,
}

impl Setup {
    fn new(processes: usize) -> Self {
        let store = MemoryStore::new();
        let world = Arc::new(World::default());
        let factories = (0..processes)
            .map(|_| {
                let s = ModelStore {
                    inner: store.clone(),
                    world: world.clone(),
                };
                Arc::new(LeaseServiceFactory::new(s, config()).expect("valid config"))
            })
            .collect();
        Setup {
            store,
            world,
            factories,
        }
    }

    /// The owner's id now (empty when free).
    fn owner(&self) -> String {
        owner_now(&self.store).owner_id
    }
}

/// A task's view: the store and world, to check from the task itself.
#[derive(Clone)]
struct Task {
    store: MemoryStore,
    world: Arc<World>,
}

impl Task {
    fn of(setup: &Setup) -> Self {
        Task {
            store: setup.store.clone(),
            world: setup.world.clone(),
        }
    }

    /// Holds `guard` over a scheduling point, then releases it (or drops it).
    async fn hold_and_end(&self, guard: LockGuard, drop_it: bool) {
        self.world.enter(&self.store, &guard);
        shuttle::future::yield_now().await;
        self.world.check(&self.store);
        self.world.leave(&self.store, &guard);
        if drop_it {
            drop(guard);
        } else {
            guard.release().await.expect("held until released");
        }
    }
}

impl Task {
    fn busy(&self, by: isize) {
        let mut busy = self.world.busy.lock().unwrap_or_else(|p| p.into_inner());
        *busy = busy.checked_add_signed(by).expect("balanced");
    }

    /// After this task's acquisition and guard are done (a give-up included), `id` owns
    /// the mutex only through another task of the locker that is still under way.
    fn nothing_left(&self, id: &str) {
        let owner = owner_now(&self.store);
        let busy = *self.world.busy.lock().unwrap_or_else(|p| p.into_inner());
        assert!(
            !owner.is_owner(id) || busy > 0,
            "{id} owns the mutex (fence {}) after its last attempt returned",
            owner.fence
        );
    }
}

/// How many schedules each scenario runs, per scheduler. Shuttle's DFS scheduler walks
/// schedules in depth-first order from a fixed start (exhaustive for schedules it reaches
/// within the cap); PCT (bug depth 3) and uniform random scheduling sample the rest, with
/// fixed seeds so a run is repeatable. Bounded so that the three scenarios together take
/// well under a minute on a loaded 2-core machine.
const DFS_SCHEDULES: usize = 2_000;
const PCT_SCHEDULES: usize = 2_000;
const RANDOM_SCHEDULES: usize = 2_000;
/// Longer schedules than this fail (a livelock: a task that spins instead of waiting).
const MAX_STEPS: usize = 20_000;

/// Runs `body` under the DFS, PCT and random schedulers (see [`DFS_SCHEDULES`]).
fn explore<F, Fut>(body: F)
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let body = Arc::new(body);
    let mut config = shuttle::Config::new();
    config.max_steps = shuttle::MaxSteps::FailAfter(MAX_STEPS);
    let run = |scheduler: Box<dyn shuttle::scheduler::Scheduler + Send>| {
        let body = body.clone();
        shuttle::Runner::new(scheduler, config.clone())
            .run(move || shuttle::future::block_on(body()));
    };
    run(Box::new(shuttle::scheduler::DfsScheduler::new(
        Some(DFS_SCHEDULES),
        false,
    )));
    run(Box::new(shuttle::scheduler::PctScheduler::new_from_seed(
        0x51_3ba0,
        3,
        PCT_SCHEDULES,
    )));
    run(Box::new(
        shuttle::scheduler::RandomScheduler::new_from_seed(0x5eed_51ba, RANDOM_SCHEDULES),
    ));
}

/// Two tasks of one process, one locker with a fixed contender id: drop a guard and
/// re-acquire at once, against a task that acquires and releases. With a fixed id the
/// old race gave the new acquisition the old fence (a renewal of the ownership whose
/// release was still in flight), and that release then freed it.
async fn drop_and_reacquire() {
    drop_and_reacquire_as(Some("me")).await;
}

/// As [`drop_and_reacquire`], with a contender id generated for each acquisition (what
/// `Locker::new` does).
async fn drop_and_reacquire_generated() {
    drop_and_reacquire_as(None).await;
}

async fn drop_and_reacquire_as(id: Option<&str>) {
    let setup = Setup::new(1);
    let factory = setup.factories[0].clone();
    let locker = match id {
        Some(id) => Locker::with_contender_id(factory, MUTEX, id),
        None => Locker::new(factory, MUTEX),
    }
    .expect("valid locker");
    let (t1, l1) = (Task::of(&setup), locker.clone());
    let a = shuttle::future::spawn(async move {
        let g = l1.acquire().await.expect("acquired");
        t1.hold_and_end(g, true).await;
        let g = l1.acquire().await.expect("re-acquired");
        t1.hold_and_end(g, false).await;
    });
    let (t2, l2) = (Task::of(&setup), locker.clone());
    let b = shuttle::future::spawn(async move {
        let g = l2.acquire().await.expect("acquired");
        t2.hold_and_end(g, false).await;
    });
    a.await.expect("task a");
    b.await.expect("task b");
    locker.settled().await;
    setup.world.check(&setup.store);
    assert_eq!(setup.owner(), "", "owned after everything was released");
}

#[test]
fn model_drop_and_reacquire() {
    explore(drop_and_reacquire);
}

#[test]
fn model_drop_and_reacquire_generated_ids() {
    explore(drop_and_reacquire_generated);
}

/// Re-creates the old race (`locker::mutation::EARLY_TURN`: the turn passes on as soon
/// as the guard goes, before its release completes) and checks that the model finds it.
#[test]
fn model_catches_the_same_fence_race() {
    let caught = std::panic::catch_unwind(|| {
        crate::locker::mutation::EARLY_TURN.set(true);
        explore(drop_and_reacquire);
    });
    crate::locker::mutation::EARLY_TURN.set(false);
    let message = match caught {
        Ok(()) => panic!("the checker missed the same-fence race"),
        Err(e) => e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default(),
    };
    assert!(
        message.contains("fence") || message.contains("believe"),
        "failed for another reason: {message}"
    );
}

/// Give-ups in one process while another process holds or takes the mutex: a
/// `try_acquire` and an `acquire_timeout` (whose deadline the scheduler places, so it may
/// fall while the contention is winning on the store) through one locker, and a second process's locker that
/// acquires and releases. An attempt that gives up leaves its contender owning nothing
/// when it returns.
async fn give_ups() {
    let setup = Setup::new(2);
    let here =
        Locker::with_contender_id(setup.factories[0].clone(), MUTEX, "here").expect("valid locker");
    let there = Locker::with_contender_id(setup.factories[1].clone(), MUTEX, "there")
        .expect("valid locker");
    let (t1, l1) = (Task::of(&setup), here.clone());
    let a = shuttle::future::spawn(async move {
        t1.busy(1);
        match l1.try_acquire().await {
            Ok(g) => t1.hold_and_end(g, false).await,
            Err(e) => assert!(matches!(e, crate::Error::WouldBlock { .. }), "{e}"),
        }
        t1.busy(-1);
        t1.nothing_left("here");
    });
    let (t2, l2) = (Task::of(&setup), here.clone());
    let b = shuttle::future::spawn(async move {
        t2.busy(1);
        match l2.acquire_timeout(Duration::from_secs(1)).await {
            Ok(g) => t2.hold_and_end(g, false).await,
            Err(e) => assert!(matches!(e, crate::Error::Timeout { .. }), "{e}"),
        }
        t2.busy(-1);
        t2.nothing_left("here");
    });
    let (t3, l3) = (Task::of(&setup), there.clone());
    let c = shuttle::future::spawn(async move {
        let g = l3.acquire().await.expect("acquired");
        t3.hold_and_end(g, false).await;
    });
    a.await.expect("task a");
    b.await.expect("task b");
    c.await.expect("task c");
    here.settled().await;
    there.settled().await;
    setup.world.check(&setup.store);
    assert_eq!(setup.owner(), "", "owned after everything was settled");
}

#[test]
fn model_give_ups() {
    explore(give_ups);
}

/// Completes after the task has been scheduled `n` times: a cancellation whose moment,
/// relative to the other tasks, the scheduler chooses.
async fn after_polls(n: usize) {
    for _ in 0..n {
        shuttle::future::yield_now().await;
    }
}

/// The hold path and a dropped acquisition: one task releases holding the mutex (for an
/// hour: past the end of the schedule), a second task of the same process starts an
/// acquisition and drops it part-way, and another process tries once. The hold keeps the
/// fence and bars everyone; the dropped acquisition leaves nothing owned once settled.
async fn hold_and_cancel() {
    let setup = Setup::new(2);
    let here =
        Locker::with_contender_id(setup.factories[0].clone(), MUTEX, "here").expect("valid locker");
    let there = Locker::with_contender_id(setup.factories[1].clone(), MUTEX, "there")
        .expect("valid locker");
    let held_fence = Arc::new(Mutex::new(None::<u64>));
    let (t1, l1, hf) = (Task::of(&setup), here.clone(), held_fence.clone());
    let a = shuttle::future::spawn(async move {
        let g = l1.acquire().await.expect("acquired");
        t1.world.enter(&t1.store, &g);
        shuttle::future::yield_now().await;
        t1.world.leave(&t1.store, &g);
        let fence = g.fence();
        let until = tokio::time::Instant::now() + Duration::from_secs(3600);
        g.release_holding_until(until).await.expect("held");
        let owner = owner_now(&t1.store);
        assert_eq!(
            (owner.held_after_release_by(), owner.fence),
            (Some("here"), fence),
            "not held with the guard's fence after release_holding_until"
        );
        *hf.lock().unwrap_or_else(|p| p.into_inner()) = Some(fence);
    });
    let (t2, l2) = (Task::of(&setup), here.clone());
    let b = shuttle::future::spawn(async move {
        tokio::select! {
            biased;
            r = l2.acquire() => {
                let g = r.expect("acquired");
                t2.hold_and_end(g, false).await;
            }
            () = after_polls(3) => {}
        }
    });
    let (t3, l3) = (Task::of(&setup), there.clone());
    let c = shuttle::future::spawn(async move {
        match l3.try_acquire().await {
            Ok(g) => t3.hold_and_end(g, false).await,
            Err(e) => assert!(matches!(e, crate::Error::WouldBlock { .. }), "{e}"),
        }
    });
    a.await.expect("task a");
    b.await.expect("task b");
    c.await.expect("task c");
    here.settled().await;
    there.settled().await;
    setup.world.check(&setup.store);
    let owner = owner_now(&setup.store);
    match *held_fence.lock().unwrap_or_else(|p| p.into_inner()) {
        Some(fence) => assert_eq!(
            (owner.held_after_release_by(), owner.fence),
            (Some("here"), fence),
            "the hold did not last, or someone took the mutex during it"
        ),
        None => assert_eq!(owner.owner_id, "", "owned after everything was settled"),
    }
}

#[test]
fn model_hold_and_cancel() {
    explore(hold_and_cancel);
}
