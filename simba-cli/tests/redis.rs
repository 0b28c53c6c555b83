//! `simba` against Redis (the fault tests are in `faults.rs`).

mod common;

use common::*;
use simba_test_kit::servers;

/// Runs blocking test code off the runtime's threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .expect("blocking test code panicked")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_and_watch_follow_exec_on_redis() {
    let server = servers::redis().await.expect("a Redis server");
    let url = server.url().to_owned();
    blocking(move || owner_and_watch_follow_exec(&url, "redis-show")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_execs_on_redis_never_overlap() {
    let server = servers::redis().await.expect("a Redis server");
    let url = server.url().to_owned();
    blocking(move || concurrent_execs_never_overlap(Some(&url), &[], 3, "0.3", "redis-overlap"))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_acquired_while_held_on_redis() {
    let server = servers::redis().await.expect("a Redis server");
    let url = server.url().to_owned();
    blocking(move || not_acquired_while_held(&url, "redis-held")).await;
}
