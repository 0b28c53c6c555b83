//! `simba` against Redis (the fault tests are in `faults.rs`).

mod common;

use common::*;
use simba_test_kit::servers;
use std::time::Duration;

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

/// A fresh server keeps free mutexes from everyone for one lease of the acquirer (the
/// restart quarantine, see simba-redis): one exec with the `lease` options the test uses
/// waits it out, so that the timing of the test that follows is its own.
fn past_the_quarantine(url: &str, lease: &[&str]) {
    let out = run(
        simba(Some(url))
            .args(["exec", "warm-up"])
            .args(lease)
            .args(["--", "true"]),
        Duration::from_secs(60),
        "warm-up exec",
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_at_least_on_redis() {
    let server = servers::redis().await.expect("a Redis server");
    let url = server.url().to_owned();
    blocking(move || {
        // A lease of 2 s, shorter than the 3 s hold: the hold outlasts it.
        let lease = ["--ttl", "1s", "--transition", "1s"];
        past_the_quarantine(&url, &lease);
        hold_at_least_runs_once_per_period(&url, "redis-hold", &lease)
    })
    .await;
}

/// `simba watch` is pushed on Redis: with reads only every 30 s it still reports an
/// acquisition and a release (16 s before the lease would end) within 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_is_pushed_on_redis() {
    let server = servers::redis().await.expect("a Redis server");
    let url = server.url().to_owned();
    blocking(move || {
        past_the_quarantine(&url, &[]);
        let dir = tempdir();
        let mutex = mutex_name("redis-watch-push");
        let go = file(dir.path(), "go");
        let watcher = Watcher::start_with(&url, &mutex, "30s");
        let first = watcher.next(Duration::from_secs(30));
        assert_eq!(first["event"], "current", "{first}");
        let mut exec = simba(Some(&url))
            .args(["exec", &mutex])
            .args(sh(&format!(
                "while [ ! -e {go} ]; do sleep 0.05; done",
                go = go.display()
            )))
            .spawn()
            .expect("start simba exec");
        let acquired = watcher.next(Duration::from_secs(2));
        assert_eq!(acquired["event"], "acquired", "{acquired}");
        std::fs::write(&go, b"").expect("write go");
        let status = wait_for(&mut exec, Duration::from_secs(30), "simba exec");
        assert_eq!(status.code(), Some(0));
        let released = watcher.next(Duration::from_secs(2));
        assert_eq!(released["event"], "released", "{released}");
        assert_eq!(watcher.interrupt().code(), Some(0));
    })
    .await;
}
