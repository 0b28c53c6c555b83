//! Task hops of the acquisition path, counted over `MemoryStore` so that they cannot
//! silently grow back (unit tests: they count through the runtime seam, `crate::rt`).
//!
//! Two counts, on a current-thread tokio runtime where nothing else runs and the memory
//! store answers without I/O, so both are exact:
//! - the wake-ups of the future the caller polls (`acquire()`, `release()`): each is a
//!   wait for another task;
//! - the polls of the engine's tasks (the service's driver, the guard's watcher), counted
//!   by `crate::rt::TASK_POLLS`: each is a task hop.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Wake, Waker};

use crate::rt::TASK_POLLS;
use crate::{LeaseConfig, LeaseServiceFactory, Locker, MemoryStore};

/// A waker that counts its wakes and passes them on.
struct Counting {
    inner: Waker,
    wakes: Arc<AtomicUsize>,
}

impl Wake for Counting {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        self.inner.wake_by_ref();
    }
}

/// Polls `fut` to completion; returns its output, how many times it was woken, and how
/// many times the engine's tasks ran meanwhile.
async fn counted<F: Future>(fut: F) -> (F::Output, usize, usize) {
    let wakes = Arc::new(AtomicUsize::new(0));
    let polls_before = TASK_POLLS.with(std::cell::Cell::get);
    let mut fut = std::pin::pin!(fut);
    let out = std::future::poll_fn(|cx: &mut Context<'_>| {
        let waker = Waker::from(Arc::new(Counting {
            inner: cx.waker().clone(),
            wakes: wakes.clone(),
        }));
        Pin::as_mut(&mut fut).poll(&mut Context::from_waker(&waker))
    })
    .await;
    let polls = TASK_POLLS.with(std::cell::Cell::get) - polls_before;
    (out, wakes.load(Ordering::SeqCst), polls)
}

fn locker(store: &MemoryStore, mutex: &str) -> Locker {
    let factory = LeaseServiceFactory::new(store.clone(), LeaseConfig::default())
        .unwrap_or_else(|e| panic!("factory: {e}"));
    Locker::new(Arc::new(factory), mutex).unwrap_or_else(|e| panic!("locker: {e}"))
}

/// An uncontended acquisition wakes its caller once (the driver's answer) and runs the
/// driver once; its release wakes the caller once (the release done) and runs the
/// driver and the guard's watcher.
#[tokio::test(flavor = "current_thread")]
async fn uncontended_acquire_and_release_hops() {
    let store = MemoryStore::new();
    let locker = locker(&store, "hops-uncontended");
    for _ in 0..10 {
        let (guard, acquire_wakes, acquire_polls) = counted(locker.acquire()).await;
        let guard = guard.unwrap_or_else(|e| panic!("acquire: {e}"));
        let (released, release_wakes, release_polls) = counted(guard.release()).await;
        released.unwrap_or_else(|e| panic!("release: {e}"));
        eprintln!(
            "acquire: {acquire_wakes} wake-ups, {acquire_polls} task polls; \
             release: {release_wakes} wake-ups, {release_polls} task polls"
        );
        assert!(
            acquire_wakes <= 1,
            "acquire woke its caller {acquire_wakes} times"
        );
        assert!(
            acquire_polls <= 1,
            "acquire ran engine tasks {acquire_polls} times"
        );
        assert!(
            release_wakes <= 1,
            "release woke its caller {release_wakes} times"
        );
        assert!(
            release_polls <= 3,
            "release ran engine tasks {release_polls} times"
        );
    }
}

/// A handoff over memory: from the owner's `release()` to the waiter's `acquire()`
/// returning, the waiter is woken once and the engine's tasks run a bounded number of
/// times.
#[tokio::test(flavor = "current_thread")]
async fn handoff_hops() {
    let store = MemoryStore::new();
    let owner = locker(&store, "hops-handoff");
    let waiter = locker(&store, "hops-handoff");
    for _ in 0..10 {
        let guard = owner
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("acquire: {e}"));
        let wakes = Arc::new(AtomicUsize::new(0));
        let (w, counter) = (waiter.clone(), wakes.clone());
        let task = tokio::spawn(async move {
            let (g, n, _) = counted(w.acquire()).await;
            counter.store(n, Ordering::SeqCst);
            g
        });
        // Let the waiter queue: on this one thread, yields run its tasks until each
        // waits (the mutex is held, so nothing else can happen).
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(!task.is_finished(), "the waiter got a held mutex");
        let before = TASK_POLLS.with(std::cell::Cell::get);
        let waiting_wakes = wakes.load(Ordering::SeqCst);
        guard
            .release()
            .await
            .unwrap_or_else(|e| panic!("release: {e}"));
        let g = task
            .await
            .unwrap_or_else(|e| panic!("waiter task: {e}"))
            .unwrap_or_else(|e| panic!("waiter acquire: {e}"));
        let polls = TASK_POLLS.with(std::cell::Cell::get) - before;
        let woken = wakes.load(Ordering::SeqCst) - waiting_wakes;
        eprintln!("handoff: waiter woken {woken} times, engine tasks ran {polls} times");
        assert!(woken <= 1, "the waiter was woken {woken} times");
        assert!(
            polls <= 6,
            "the engine's tasks ran {polls} times in a handoff"
        );
        g.release().await.unwrap_or_else(|e| panic!("release: {e}"));
    }
}
