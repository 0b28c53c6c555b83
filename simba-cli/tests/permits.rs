//! `simba exec --permits N` (a permit of a semaphore) and `simba owner --permits`, on SQLite
//! files and on Redis.

mod common;

use std::process::{Child, Stdio};
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;
use simba_test_kit::servers;

#[test]
fn six_execs_with_two_permits_on_sqlite_run_two_at_a_time() {
    let dir = tempdir();
    six_execs_two_at_a_time(&sqlite_url(dir.path(), "sem.db"), "permits-sqlite");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_execs_with_two_permits_on_redis_run_two_at_a_time() {
    let server = servers::redis().await.expect("a Redis server");
    let url = server.url().to_owned();
    tokio::task::spawn_blocking(move || {
        six_execs_two_at_a_time(&url, "permits-redis");
        holders_are_listed_and_a_full_semaphore_is_not_acquired(&url, "permits-redis-owner");
    })
    .await
    .expect("test body");
}

/// `simba owner --permits S --json` on `url`, parsed.
fn holders_json(url: &str, semaphore: &str) -> serde_json::Value {
    let out = run(
        simba(Some(url)).args(["owner", "--permits", semaphore, "--json"]),
        Duration::from_secs(30),
        "simba owner --permits",
    );
    assert!(out.status.success(), "simba owner --permits: {out:?}");
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("simba owner --permits output {:?}: {e}", text(&out.stdout)))
}

/// Three `simba exec --permits 2` whose commands wait for a file (a minute at most, so
/// that none outlives a failed test for long): two run, each with its
/// semaphore, count, holder id and fence in its environment; `owner --permits` lists
/// exactly those two holders and the count 2; `--no-wait` and `--timeout` are not acquired
/// (75) without running; the third runs once one ends; afterwards nobody holds a permit.
fn holders_are_listed_and_a_full_semaphore_is_not_acquired(url: &str, test: &str) {
    let dir = tempdir();
    let semaphore = mutex_name(test);
    let go = file(dir.path(), "go");
    let ran = file(dir.path(), "ran");
    let script = |i: usize| {
        let seen = file(dir.path(), &format!("seen-{i}"));
        format!(
            "echo \"$SIMBA_SEMAPHORE $SIMBA_PERMITS $SIMBA_PERMIT $SIMBA_FENCE ${{SIMBA_MUTEX:-none}}\" \
             > {seen}.tmp; mv {seen}.tmp {seen}; \
             i=0; while [ ! -e {go} ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done",
            seen = seen.display(),
            go = go.display()
        )
    };
    let start = |i: usize| {
        simba(Some(url))
            // Left by an outer exec of a mutex: must not reach the command.
            .env("SIMBA_MUTEX", "outer")
            .args(["exec", "--permits", "2", &semaphore])
            .args(sh(&script(i)))
            .spawn()
            .expect("start simba exec --permits")
    };
    let mut first: Vec<Child> = (0..2).map(start).collect();
    let seen = |i: usize| lines(&file(dir.path(), &format!("seen-{i}")));
    eventually(Duration::from_secs(60), "two commands run", || {
        (0..2).all(|i| seen(i).len() == 1)
    });
    let mut third = start(2);
    let mut held: Vec<(String, u64)> = Vec::new();
    for i in 0..2 {
        let line = seen(i).remove(0);
        let [name, permits, holder, fence, mutex] = line.split(' ').collect::<Vec<_>>()[..] else {
            panic!("command {i} saw {line:?}");
        };
        assert_eq!(
            (name, permits, mutex),
            (semaphore.as_str(), "2", "none"),
            "{line}"
        );
        assert!(!holder.is_empty(), "{line}");
        held.push((holder.to_owned(), fence.parse().expect("a numeric fence")));
    }
    held.sort();
    let j = holders_json(url, &semaphore);
    assert_eq!(j["semaphore"], semaphore.as_str(), "{j}");
    assert_eq!(j["permits"], 2, "{j}");
    let mut listed: Vec<(String, u64)> = j["holders"]
        .as_array()
        .unwrap_or_else(|| panic!("no holders array: {j}"))
        .iter()
        .map(|h| {
            (
                h["owner_id"].as_str().unwrap_or_default().to_owned(),
                h["fence"].as_u64().unwrap_or_default(),
            )
        })
        .collect();
    listed.sort();
    assert_eq!(listed, held, "the holders are the two commands': {j}");
    let out = run(
        simba(Some(url)).args(["owner", "--permits", &semaphore]),
        Duration::from_secs(30),
        "simba owner --permits (text)",
    );
    let shown = text(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        shown.starts_with(&format!("{semaphore}: 2 of 2 permits held"))
            && held
                .iter()
                .all(|(id, fence)| shown.contains(&format!("{id} (fence {fence})"))),
        "{shown}"
    );
    for args in [&["--no-wait"][..], &["--timeout", "300ms"][..]] {
        let out = run(
            simba(Some(url))
                .args(["exec", "--permits", "2", &semaphore])
                .args(args)
                .args(sh(&format!("touch {}", ran.display()))),
            Duration::from_secs(30),
            "simba exec --permits on a full semaphore",
        );
        assert_eq!(out.status.code(), Some(NOT_ACQUIRED), "{args:?}: {out:?}");
        let said = text(&out.stderr);
        assert!(said.contains(&format!("semaphore {semaphore:?}")), "{said}");
    }
    assert!(!ran.exists(), "a command ran without a permit");
    std::fs::write(&go, b"").expect("write go");
    for (i, c) in first
        .iter_mut()
        .chain(std::iter::once(&mut third))
        .enumerate()
    {
        let status = wait_for(c, Duration::from_secs(60), &format!("exec #{i}"));
        assert_eq!(status.code(), Some(0), "exec #{i}");
    }
    let third_fence: u64 = seen(2)
        .first()
        .and_then(|l| l.split(' ').nth(3).map(str::to_owned))
        .and_then(|f| f.parse().ok())
        .unwrap_or_else(|| panic!("the third command saw {:?}", seen(2)));
    assert!(
        held.iter().all(|(_, f)| *f < third_fence),
        "{held:?} {third_fence}"
    );
    let j = holders_json(url, &semaphore);
    assert_eq!(j["holders"].as_array().map(Vec::len), Some(0), "{j}");
    let out = run(
        simba(Some(url)).args(["owner", "--permits", &semaphore]),
        Duration::from_secs(30),
        "simba owner --permits (none)",
    );
    assert_eq!(text(&out.stdout).trim(), format!("{semaphore}: no holder"));
}

#[test]
fn holders_are_listed_and_a_full_semaphore_is_not_acquired_on_sqlite() {
    let dir = tempdir();
    holders_are_listed_and_a_full_semaphore_is_not_acquired(
        &sqlite_url(dir.path(), "sem.db"),
        "permits-owner",
    );
}

/// What makes no sense is refused before anything runs, with the usage status and a
/// message that names the problem.
#[test]
fn nonsense_with_permits_is_a_usage_error() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "sem.db");
    let ran = file(dir.path(), "ran");
    let touch = format!("touch {}", ran.display());
    for (args, expect) in [
        (&["exec", "--permits", "0", "s"][..], "at least one permit"),
        (&["exec", "--permits", "two", "s"][..], "not a permit count"),
        (
            &["exec", "--permits", "2", "s", "--mutex", "t"][..],
            "--mutex",
        ),
        (&["exec", "--permits", "2", "--mutex", "s"][..], "--mutex"),
        (
            &["exec", "--permits", "2", "s", "--hold-at-least", "1s"][..],
            "--hold-at-least",
        ),
    ] {
        let out = run(
            simba(Some(&url)).args(args).args(sh(&touch)),
            Duration::from_secs(30),
            "simba exec --permits (usage)",
        );
        let said = text(&out.stderr);
        assert_eq!(out.status.code(), Some(USAGE), "{args:?}: {said}");
        assert!(said.contains(expect), "{args:?}: {said}");
    }
    assert!(!ran.exists(), "a refused exec ran its command");
}

/// Holders of a semaphore agree on its count: an exec asking for another one while it
/// has holders is refused with the usage status, naming both counts.
#[test]
fn another_count_than_the_holders_is_refused() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "sem.db");
    let semaphore = mutex_name("permits-mismatch");
    let ready = file(dir.path(), "ready");
    let mut holder = simba(Some(&url))
        .args(["exec", "--permits", "2", &semaphore])
        .args(sh(&format!("touch {}; sleep 30", ready.display())))
        .spawn()
        .expect("start the holder");
    eventually(Duration::from_secs(30), "the holder runs", || {
        ready.exists()
    });
    let out = run(
        simba(Some(&url)).args(["exec", "--permits", "3", &semaphore, "--", "true"]),
        Duration::from_secs(30),
        "simba exec --permits 3",
    );
    let said = text(&out.stderr);
    assert_eq!(out.status.code(), Some(USAGE), "{said}");
    assert!(
        said.contains("has 2 permits") && said.contains("not 3"),
        "{said}"
    );
    send(holder.id(), Signal::SIGTERM);
    let status = wait_for(&mut holder, Duration::from_secs(10), "holder after SIGTERM");
    assert_eq!(status.code(), Some(143));
}

/// simba stopped (SIGSTOP) well past its permit's 0.5 s lease while the command runs: the
/// permit is lost, the command's process group is killed and simba exits with 79, saying
/// which permit was lost, as for a mutex.
#[test]
fn a_lost_permit_stops_the_command() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "lost.db");
    let semaphore = mutex_name("permits-lost");
    let pid_file = file(dir.path(), "pid");
    let mut exec = simba(Some(&url))
        .args(["exec", "--permits", "2", &semaphore])
        .args(["--ttl", "300ms", "--transition", "200ms"])
        .args(sh(&format!(
            "echo $$ > {p}.tmp; mv {p}.tmp {p}; exec sleep 30",
            p = pid_file.display()
        )))
        .stderr(Stdio::piped())
        .spawn()
        .expect("start simba exec --permits");
    eventually(Duration::from_secs(30), "the command runs", || {
        lines(&pid_file).len() == 1
    });
    let pid: i32 = lines(&pid_file)[0].parse().expect("a pid");
    send(exec.id(), Signal::SIGSTOP);
    // Time is the subject: stopped for three leases, with room for a loaded machine.
    std::thread::sleep(Duration::from_millis(1500));
    send(exec.id(), Signal::SIGCONT);
    let status = wait_for(
        &mut exec,
        Duration::from_secs(30),
        "simba exec after SIGCONT",
    );
    let mut stderr = String::new();
    if let Some(mut pipe) = exec.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
    }
    assert_eq!(status.code(), Some(LOST), "{stderr}");
    assert!(
        stderr.contains(&format!("a permit of semaphore {semaphore:?} (fence "))
            && stderr.contains("killed"),
        "{stderr}"
    );
    // The guardian killed the group at the deadline (or simba on waking): bounded, since
    // the kill may land a moment after simba's exit on a loaded machine.
    eventually(Duration::from_secs(10), "the command is gone", || {
        !alive(pid)
    });
}

/// `--hold-at-most` stops the command of a permit as it does a mutex's: SIGTERM after the
/// time given, exit 79, a message naming the permit.
#[test]
fn hold_at_most_stops_the_command_of_a_permit() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "most.db");
    let semaphore = mutex_name("permits-most");
    let started = std::time::Instant::now();
    let out = run(
        simba(Some(&url))
            .args(["exec", "--permits", "1", &semaphore, "--hold-at-most", "1s"])
            .args(["--", "sleep", "30"]),
        Duration::from_secs(25),
        "simba exec --permits --hold-at-most",
    );
    let took = started.elapsed();
    let said = text(&out.stderr);
    assert_eq!(out.status.code(), Some(LOST), "{said}");
    assert!(took >= Duration::from_secs(1), "{took:?}");
    assert!(
        said.contains(&format!("held a permit of semaphore {semaphore:?} (fence "))
            && said.contains("--hold-at-most 1s"),
        "{said}"
    );
}
