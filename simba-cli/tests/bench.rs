//! `simba bench --json` smoke runs: tiny counts, every scenario, keys checked. Speed is
//! never asserted (the figures depend on the machine); safety is (`handoff.overlaps`).

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;
use simba_test_kit::servers;

/// Runs blocking test code off the runtime's threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .expect("blocking test code panicked")
}

/// Runs a small `simba bench --json` against `url` and returns the parsed object.
fn bench_json(url: &str) -> Value {
    let out = run(
        simba(Some(url)).args([
            "bench",
            "--json",
            "--explain",
            "--iterations",
            "20",
            "--contenders",
            "3",
            "--failover-runs",
            "1",
            "--failover-ttl",
            "300ms",
            "--scale-mutexes",
            "30",
            "--scale-waiters",
            "5",
            "--scale-ttl",
            "1s",
            "--scale-poll",
            "100ms",
            "--many-mutexes",
            "4",
        ]),
        Duration::from_secs(120),
        "simba bench",
    );
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "simba bench failed: {:?}\nstdout: {stdout}\nstderr: {}",
        out.status,
        text(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one JSON object on stdout: {stdout}");
    serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

/// Asserts that `path` (dot-separated) exists in `v` and is a number.
fn number(v: &Value, path: &str) -> f64 {
    let mut cur = v;
    for key in path.split('.') {
        cur = cur
            .get(key)
            .unwrap_or_else(|| panic!("no `{path}` in {v:#}"));
    }
    cur.as_f64()
        .unwrap_or_else(|| panic!("`{path}` is not a number: {cur} in {v:#}"))
}

/// Asserts that `path` exists (it may be null where the backend cannot tell).
fn present(v: &Value, path: &str) {
    let mut cur = v;
    for key in path.split('.') {
        cur = cur
            .get(key)
            .unwrap_or_else(|| panic!("no `{path}` in {v:#}"));
    }
}

fn check_common(v: &Value, backend: &str) {
    assert_eq!(v["backend"], backend, "{v:#}");
    for key in [
        "floor.rtt_p50_us",
        "uncontended.p50_us",
        "uncontended.p99_us",
        "uncontended.ops_per_s",
        "handoff.p50_us",
        "handoff.p99_us",
        "handoff.barging_pct",
        "handoff.jain",
        "handoff.acq_per_s",
        "many.acq_per_s",
        "many.p50_us",
        "failover.after_lease_p50_ms",
        "scale.renew_ops_per_s",
        "scale.rss_mb",
        "scale.wakeups_per_release",
        "scale.waiter_handoff_p99_us",
    ] {
        number(v, key);
    }
    present(v, "scale.connections");
    // The floors beside the figures: the backend's handoff floor, the engine alone over
    // memory, a bare tokio wake-up.
    for key in [
        "memory.wake_p50_us",
        "memory.uncontended_p50_us",
        "memory.handoff_p50_us",
        "handoff.native_handoff_floor_us",
        "explain.handoff_p50_us",
    ] {
        number(v, key);
    }
    assert_eq!(number(v, "memory.handoff_overlaps"), 0.0, "{v:#}");
    assert_eq!(number(v, "many.overlaps"), 0.0, "{v:#}");
    assert_eq!(number(v, "many.mutexes"), 4.0, "{v:#}");
    // The engine's handoff counts from `release()` called (from its return it is negative
    // over memory: the next owner has the mutex first), and so does `from_call`, which is
    // each hand-over's time from the return plus the release call's own.
    assert!(number(v, "memory.handoff_p50_us") > 0.0, "{v:#}");
    assert!(
        number(v, "handoff.from_call_p50_us") >= number(v, "handoff.p50_us"),
        "{v:#}"
    );
    // `--explain`: the hops of a handoff, each with its p50; every backend records at
    // least its release, the acquisition's answer and the guard returned (where a waiter
    // blocks in the backend, its acquisition was sent before the release).
    let hops = v["explain"]["hops"]
        .as_array()
        .unwrap_or_else(|| panic!("no explain.hops in {v:#}"));
    for (from, to) in [
        (Some("release() called"), "release sent"),
        (Some("release sent"), "release answered"),
        (None, "acquire answered"),
        (Some("acquire answered"), "guard returned"),
        (Some("guard returned"), "acquire() returned"),
    ] {
        let hop = hops
            .iter()
            .find(|h| from.is_none_or(|f| h["from"] == f) && h["to"] == to)
            .unwrap_or_else(|| panic!("no hop {from:?} → {to} in {v:#}"));
        number(hop, "p50_us");
    }
    assert_eq!(number(v, "handoff.overlaps"), 0.0, "{v:#}");
    assert_eq!(number(v, "handoff.fence_regressions"), 0.0, "{v:#}");
    assert_eq!(number(v, "scale.lost"), 0.0, "{v:#}");
}

#[test]
fn bench_json_on_sqlite() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "bench.db");
    let v = bench_json(&url);
    check_common(&v, "sqlite");
    number(&v, "floor.handoff_p50_us");
    // The database file's journal mode, and the store's connections' `synchronous`.
    assert_eq!(v["floor"]["durability"]["journal_mode"], "wal", "{v:#}");
    assert!(
        v["floor"]["durability"]["synchronous"]
            .as_str()
            .is_some_and(|s| s.starts_with("NORMAL")),
        "{v:#}"
    );
    number(&v, "failover.no_jitter.after_lease_p50_ms");
    // simba-jdbc's permits: measured beside the mutex.
    assert_eq!(v["semaphore"]["supported"], true, "{v:#}");
    number(&v, "semaphore.p50_us");
    number(&v, "semaphore.handoff_p50_us");
    assert_eq!(number(&v, "semaphore.overlaps"), 0.0, "{v:#}");
    assert_eq!(number(&v, "semaphore.fence_regressions"), 0.0, "{v:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_json_on_redis() {
    let server = servers::redis().await.expect("a Redis server");
    let url = server.url().to_owned();
    let v = blocking(move || bench_json(&url)).await;
    check_common(&v, "redis");
    number(&v, "floor.pubsub_p50_us");
    // Read from the server: the kit's Redis keeps an append-only file.
    assert_eq!(v["floor"]["durability"]["appendonly"], "yes", "{v:#}");
    assert!(v["floor"]["durability"]["appendfsync"].is_string(), "{v:#}");
    number(&v, "floor.raw_lock_p50_us");
    number(&v, "scale.connections");
    assert_eq!(v["semaphore"]["supported"], true, "{v:#}");
    number(&v, "semaphore.p50_us");
    number(&v, "semaphore.p50_per_mutex");
    number(&v, "semaphore.handoff_p50_us");
    number(&v, "semaphore.handoff_p50_per_mutex");
    assert_eq!(number(&v, "semaphore.overlaps"), 0.0, "{v:#}");
    assert_eq!(number(&v, "semaphore.fence_regressions"), 0.0, "{v:#}");
}

#[test]
fn bench_table_and_bad_scenario() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "table.db");
    let out = run(
        simba(Some(&url)).args(["bench", "--scenario", "uncontended", "--iterations", "5"]),
        Duration::from_secs(60),
        "simba bench (table)",
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains("uncontended") && stdout.contains("SELECT 1"),
        "{stdout}"
    );
    let out = run(
        simba(Some(&url)).args(["bench", "--scenario", "nope"]),
        Duration::from_secs(30),
        "simba bench --scenario nope",
    );
    assert_eq!(out.status.code(), Some(USAGE), "{}", text(&out.stderr));
}
