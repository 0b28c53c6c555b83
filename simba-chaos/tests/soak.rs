//! The 3-minute soak of the test command: `simba-chaos soak` on every backend at once
//! (SQLite, Redis, MariaDB, PostgreSQL, ZooKeeper, etcd; the servers of `SIMBA_TEST_*`,
//! else private local ones), each with 3 worker processes × 100 mutexes (4 of them
//! contended by every process). The full soak is 8 × 1,000 for 60 minutes
//! (docs/testing.md); here the six backends share a 2-core machine with the rest of the
//! test command, so each gets a tenth of the mutexes and the run checks the same things at
//! a smaller scale.
//!
//! Each run must pass its verdict: no overlap, no fence regression, no accepted stale
//! write, no error, no worker death, hand-overs between processes, and the summed peaks of
//! RSS, descriptors, connections to the server and tokio tasks at minute 3 within the bound
//! below of those at minute 1. Ownerships lost while held are counted and printed but not
//! judged here (`--max-lost` is out of reach): with leases of 5 s + 5 s, a process that the
//! loaded machine stalls for seconds loses some, which is the lease doing its job, not a
//! leak nor a safety failure (the ledger still bounds each lost owner's belief). The
//! 60-minute runs judge losses (none allowed).
//!
//! The bound: minute 1 is barely past the start (the slots begin within the first 10 s,
//! the ramp; pools, caches and the allocator's arenas still fill: RSS grew by 12 % on
//! SQLite and 7 % on ZooKeeper from minute 1 to 3 in runs on a loaded machine), so the
//! growth allowed is 25 % instead of the long run's 5 %, and counts may grow by a few more
//! ([`count_slack`]: 4, and 100 on the SQL servers, whose wait sessions come and go). It
//! can fail without a leak when the machine is so loaded that the workers only reach their
//! steady state after minute 1; it catches gross leaks only (a descriptor, connection or
//! task per ownership: thousands per minute, or memory growing by a quarter in two
//! minutes). The 60-minute runs are the real measure (docs/testing.md, *Soak*).

use std::time::Duration;

use simba_test_kit::servers::{self, ServerKind};
use tokio::process::Command;

/// The flags of every backend's run.
const FLAGS: &[&str] = &[
    "--processes",
    "3",
    "--mutexes",
    "100",
    "--shared",
    "4",
    "--duration",
    "3m",
    "--sample-every",
    "60s",
    "--warmup",
    "1",
    "--max-growth",
    "25",
    "--ttl",
    "5s",
    "--transition",
    "5s",
    "--hold",
    "1s..10s",
    "--idle",
    "0s..2s",
    "--shared-hold",
    "100ms..1s",
    "--acquire-timeout",
    "1s",
    "--write-every",
    "1s",
    "--ramp",
    "10s",
    "--max-lost",
    "1000000",
];

/// How much more than `--max-growth` the counts (descriptors, connections, tasks) may grow.
fn count_slack(backend: &str) -> &'static str {
    match backend {
        // A process waits on a session of its own per mutex whose native lock is taken
        // (simba-jdbc's README, *Waiting*), also its own private mutexes when a release
        // timed out on the loaded machine and the lock is kept until the lease ends: the
        // connection count of 3 processes swings by dozens from one minute's peak to the
        // next (156, 140, 195 in one run).
        "mysql" | "postgres" => "100",
        _ => "4",
    }
}

async fn soak(backend: &'static str, url: Option<String>) -> (String, bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_simba-chaos"));
    cmd.arg("soak")
        .args(["--backend", backend])
        .args(FLAGS)
        .args(["--count-slack", count_slack(backend)]);
    if let Some(url) = url {
        cmd.args(["--url", &url]);
    }
    cmd.kill_on_drop(true);
    match cmd.output().await {
        Ok(out) => (
            backend.to_owned(),
            out.status.success(),
            format!(
                "{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        ),
        Err(e) => (backend.to_owned(), false, format!("not started: {e}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_every_backend_three_minutes() {
    let mut runs = vec![tokio::spawn(soak("sqlite", None))];
    // Kept until the runs end: a private server stops when dropped.
    let mut held = Vec::new();
    for (backend, kind) in [
        ("redis", ServerKind::Redis),
        ("mysql", ServerKind::Mysql),
        ("postgres", ServerKind::Postgres),
        ("zookeeper", ServerKind::Zookeeper),
        ("etcd", ServerKind::Etcd),
    ] {
        let server = servers::server(kind)
            .await
            .unwrap_or_else(|e| panic!("a {backend} server: {e}"));
        runs.push(tokio::spawn(soak(backend, Some(server.url().to_owned()))));
        held.push(server);
    }
    let mut failed = Vec::new();
    for run in runs {
        let (backend, passed, output) = tokio::time::timeout(Duration::from_secs(600), run)
            .await
            .expect("a 3-minute soak ended within 10 minutes")
            .expect("the run's task");
        println!("--- {backend} ---\n{output}");
        let verdict = output
            .lines()
            .rev()
            .find(|l| l.starts_with("soak backend="))
            .unwrap_or("");
        if !passed || !verdict.ends_with("verdict=pass") {
            failed.push(backend);
        }
    }
    assert!(failed.is_empty(), "soaks failed: {failed:?} (output above)");
}
