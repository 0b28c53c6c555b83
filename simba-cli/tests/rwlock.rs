//! `simba exec --read` / `--write` (a read-write lock) and `simba owner --rwlock`, on a
//! SQLite file and on Redis.

mod common;

use std::path::Path;
use std::process::Child;
use std::time::Duration;

use common::*;
use simba_test_kit::servers;

/// A command that logs its start (with SIMBA_RW_MODE and SIMBA_FENCE), waits for `go` (a
/// minute at most, so that none outlives a failed test for long), and logs its end.
fn waiting_script(log: &Path, go: &Path, tag: &str) -> String {
    let (log, go) = (log.display(), go.display());
    format!(
        "echo \"start {tag} $SIMBA_RW_MODE $SIMBA_FENCE $(date +%s%N)\" >> {log}; \
         i=0; while [ ! -e {go} ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; \
         echo \"end {tag} $SIMBA_RW_MODE $SIMBA_FENCE $(date +%s%N)\" >> {log}"
    )
}

fn exec(url: &str, mode: &str, lock: &str, script: &str) -> Child {
    simba(Some(url))
        .args(["exec", mode, lock])
        .args(sh(script))
        .spawn()
        .expect("start simba exec")
}

/// Three `--read` run at once and hold together; `owner --rwlock` lists the three readers;
/// a `--write` started meanwhile waits for all of them, then runs alone, with a fence above
/// theirs; a `--read --no-wait` while the writer waits or holds is not acquired (75).
fn three_reads_overlap_and_a_write_runs_alone(url: &str, test: &str) {
    let dir = tempdir();
    let lock = mutex_name(test);
    let log = file(dir.path(), "log");
    let go = file(dir.path(), "go");
    let mut readers: Vec<Child> = (0..3)
        .map(|i| {
            exec(
                url,
                "--read",
                &lock,
                &waiting_script(&log, &go, &format!("r{i}")),
            )
        })
        .collect();
    // Connecting (and, on Redis, a restart quarantine of one default lease, 16 s) on a
    // loaded machine: a minute is ample.
    eventually(Duration::from_secs(60), "three readers started", || {
        lines(&log)
            .iter()
            .filter(|l| l.starts_with("start"))
            .count()
            == 3
    });
    let out = run(
        simba(Some(url)).args(["owner", "--rwlock", &lock, "--json"]),
        Duration::from_secs(30),
        "simba owner --rwlock",
    );
    assert!(out.status.success(), "simba owner --rwlock: {out:?}");
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("owner --rwlock output {:?}: {e}", text(&out.stdout)));
    assert_eq!(
        listed["readers"].as_array().map(Vec::len),
        Some(3),
        "three readers listed: {listed}"
    );
    let wlog = file(dir.path(), "wlog");
    let mut writer = exec(
        url,
        "--write",
        &lock,
        &format!(
            "echo \"start w $SIMBA_RW_MODE $SIMBA_FENCE $(date +%s%N)\" >> {l}; sleep 0.2; \
             echo \"end w $SIMBA_RW_MODE $SIMBA_FENCE $(date +%s%N)\" >> {l}",
            l = wlog.display()
        ),
    );
    // Once the writer holds the gate (it waits there for the readers), a new reader is
    // refused at once. Until then it gets in and leaves: each try is logged, then ends.
    eventually(Duration::from_secs(60), "a new reader refused", || {
        let out = run(
            simba(Some(url)).args(["exec", "--read", "--no-wait", &lock, "--", "true"]),
            Duration::from_secs(30),
            "simba exec --read --no-wait",
        );
        out.status.code() == Some(75)
    });
    assert!(lines(&wlog).is_empty(), "the writer ran beside readers");
    std::fs::write(&go, b"").expect("write go");
    for (i, r) in readers.iter_mut().enumerate() {
        let status = wait_for(r, Duration::from_secs(90), &format!("reader #{i}"));
        assert_eq!(status.code(), Some(0), "reader #{i}");
    }
    let status = wait_for(&mut writer, Duration::from_secs(90), "writer");
    assert_eq!(status.code(), Some(0), "writer");
    let reads = runs(&log);
    let write = runs(&wlog);
    assert_eq!(reads.len(), 3, "{reads:?}");
    assert!(reads.iter().all(|r| r.mode == "read"), "{reads:?}");
    let [w] = &write[..] else {
        panic!("one write: {write:?}");
    };
    assert_eq!(w.mode, "write");
    // The three reads held together: each started before any ended.
    let last_start = reads.iter().map(|r| r.start).max().unwrap_or(0);
    let first_end = reads.iter().map(|r| r.end).min().unwrap_or(0);
    assert!(
        last_start < first_end,
        "the reads did not overlap: {reads:#?}"
    );
    let last_end = reads.iter().map(|r| r.end).max().unwrap_or(0);
    assert!(
        w.start > last_end,
        "the write began before every read ended: {reads:#?} {w:?}"
    );
    assert!(
        reads.iter().all(|r| w.fence > r.fence),
        "the write's fence is not above the reads': {reads:#?} {w:?}"
    );
}

#[test]
fn three_reads_overlap_and_a_write_runs_alone_on_sqlite() {
    let dir = tempdir();
    three_reads_overlap_and_a_write_runs_alone(&sqlite_url(dir.path(), "rw.db"), "rw-sqlite");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_reads_overlap_and_a_write_runs_alone_on_redis() {
    let server = servers::redis().await.expect("a Redis server");
    let url = server.url().to_owned();
    tokio::task::spawn_blocking(move || {
        three_reads_overlap_and_a_write_runs_alone(&url, "rw-redis")
    })
    .await
    .expect("test body");
}

/// `--read` and `--write` with another lock option, or with several names, are usage
/// errors (64), and the command does not run.
#[test]
fn read_and_write_refuse_what_means_nothing_for_them() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "rw.db");
    let ran = file(dir.path(), "ran");
    let touch = format!("touch {}", ran.display());
    for args in [
        &["--read", "--write", "l"][..],
        &["--read", "--permits", "2", "l"][..],
        &["--write", "--mutex", "a", "--mutex", "b"][..],
        &["--read", "--hold-at-least", "1s", "l"][..],
    ] {
        let out = run(
            simba(Some(&url)).arg("exec").args(args).args(sh(&touch)),
            Duration::from_secs(30),
            "simba exec",
        );
        assert_eq!(out.status.code(), Some(64), "{args:?}: {out:?}");
        assert!(!ran.exists(), "{args:?}: the command ran");
    }
}
