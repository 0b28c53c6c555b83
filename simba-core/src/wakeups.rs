//! Task hops of the acquisition path, counted over `MemoryStore` so that they cannot
//! silently grow back (unit tests: they count through the runtime seam, `crate::rt`).
//!
//! Two counts, on a current-thread tokio runtime where nothing else runs and the memory
//! store answers without I/O, so both are exact:
//! - how many times the future the caller polls (`acquire()`, `release()`) ran again
//!   after it waited: each is a wait for another task;
//! - the polls of the engine's tasks (the service's driver, the guard's watcher), counted
//!   by `crate::rt::TASK_POLLS`: each is a task hop.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Context;

use crate::rt::TASK_POLLS;
use crate::{LeaseConfig, LeaseServiceFactory, Locker, MemoryStore};

/// Polls `fut` to completion; returns its output, how many times it ran again after
/// waiting (its polls after the first: each one a wait for another task), and how many
/// times the engine's tasks ran meanwhile.
async fn counted<F: Future>(fut: F) -> (F::Output, usize, usize) {
    let mut polls = 0usize;
    let polls_before = TASK_POLLS.with(std::cell::Cell::get);
    let mut fut = std::pin::pin!(fut);
    let out = std::future::poll_fn(|cx: &mut Context<'_>| {
        polls += 1;
        Pin::as_mut(&mut fut).poll(cx)
    })
    .await;
    let engine = TASK_POLLS.with(std::cell::Cell::get) - polls_before;
    (out, polls - 1, engine)
}

fn locker(store: &MemoryStore, mutex: &str) -> Locker {
    let factory = LeaseServiceFactory::new(store.clone(), LeaseConfig::default())
        .unwrap_or_else(|e| panic!("factory: {e}"));
    Locker::new(Arc::new(factory), mutex).unwrap_or_else(|e| panic!("locker: {e}"))
}

/// An uncontended acquisition and its release: task runs and wake-ups of the caller.
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
/// returning, the waiter's future runs once and the engine's tasks four times.
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
        let (w, counter) = (waiter.clone(), Arc::new(AtomicUsize::new(0)));
        let waiter_polls = counter.clone();
        let task = tokio::spawn(async move {
            let mut fut = std::pin::pin!(w.acquire());
            std::future::poll_fn(|cx: &mut Context<'_>| {
                counter.fetch_add(1, Ordering::SeqCst);
                Pin::as_mut(&mut fut).poll(cx)
            })
            .await
        });
        // Let the waiter queue: on this one thread, yields run its tasks until each
        // waits (the mutex is held, so nothing else can happen).
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(!task.is_finished(), "the waiter got a held mutex");
        let engine_before = TASK_POLLS.with(std::cell::Cell::get);
        let waiter_before = waiter_polls.load(Ordering::SeqCst);
        guard
            .release()
            .await
            .unwrap_or_else(|e| panic!("release: {e}"));
        let g = task
            .await
            .unwrap_or_else(|e| panic!("waiter task: {e}"))
            .unwrap_or_else(|e| panic!("waiter acquire: {e}"));
        let engine = TASK_POLLS.with(std::cell::Cell::get) - engine_before;
        let woken = waiter_polls.load(Ordering::SeqCst) - waiter_before;
        eprintln!("handoff: waiter woken {woken} times, engine tasks ran {engine} times");
        // The waiter's acquire runs once more: when its guard is ready.
        assert!(woken <= 1, "the waiter was woken {woken} times");
        // The releaser's driver (stop, release), its guard's watcher (stop heard, then
        // the release done), the waiter's driver (push, acquisition): 4 task runs, one
        // hop on each side of the backend between the release and the guard.
        assert!(
            engine <= 4,
            "the engine's tasks ran {engine} times in a handoff"
        );
        g.release().await.unwrap_or_else(|e| panic!("release: {e}"));
    }
}
