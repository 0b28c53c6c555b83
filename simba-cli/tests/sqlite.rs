//! `simba` against SQLite files: real processes, real signals.

mod common;

use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;
use simba_test_kit::history::{Violation, check};

#[test]
fn concurrent_execs_on_one_sqlite_file_never_overlap() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    concurrent_execs_never_overlap(Some(&url), &[], 3, "0.5", "overlap");
}

/// The check of `concurrent_execs_never_overlap` reads what its scripts write and fails on
/// runs at once and on fences that do not increase: the same scripts, run without simba.
#[test]
fn the_run_check_catches_overlaps_and_stale_fences() {
    let dir = tempdir();
    let log = file(dir.path(), "log");
    let script = |tag: &str, fence: &str| {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(interval_script(&log, tag, "0.3"))
            .env("SIMBA_FENCE", fence)
            .spawn()
            .expect("start sh")
    };
    // a and b at once, then c with b's fence.
    let (mut a, mut b) = (script("a", "1"), script("b", "2"));
    for (child, what) in [(&mut a, "a"), (&mut b, "b")] {
        assert!(wait_for(child, Duration::from_secs(10), what).success());
    }
    assert!(wait_for(&mut script("c", "2"), Duration::from_secs(10), "c").success());
    let runs = logged_runs(&log);
    assert_eq!(runs.len(), 3, "{runs:?}");
    let found = check(&runs);
    let count = |overlap: bool| {
        found
            .iter()
            .filter(|v| matches!(v, Violation::Overlap { .. }) == overlap)
            .count()
    };
    // Whichever of a and b started first, one fence step goes down: b to c, or b to a.
    assert_eq!((count(true), count(false)), (1, 1), "{found:?}");
}

#[test]
fn the_default_backend_is_a_sqlite_file_in_the_state_directory() {
    let home = tempdir();
    let state = home.path().join("state");
    concurrent_execs_never_overlap(
        None,
        &[("XDG_STATE_HOME", &state), ("HOME", home.path())],
        2,
        "0.5",
        "default",
    );
    assert!(state.join("simba").join("simba.db").is_file());

    // Without XDG_STATE_HOME: ~/.local/state/simba/simba.db.
    let out = run(
        simba(None)
            .env_remove("XDG_STATE_HOME")
            .env("HOME", home.path())
            .args(["exec", "default-home", "--", "true"]),
        Duration::from_secs(30),
        "simba exec with HOME only",
    );
    assert!(out.status.success(), "{out:?}");
    assert!(home.path().join(".local/state/simba/simba.db").is_file());
}

#[test]
fn an_unusable_state_directory_is_a_clear_error() {
    let dir = tempdir();
    let blocker = file(dir.path(), "not-a-dir");
    std::fs::write(&blocker, b"").expect("write file");
    let out = run(
        simba(None)
            .env("XDG_STATE_HOME", &blocker)
            .args(["exec", "m", "--", "true"]),
        Duration::from_secs(30),
        "simba exec with a file as state dir",
    );
    assert_eq!(out.status.code(), Some(CANT_CREATE), "{out:?}");
    let err = text(&out.stderr);
    assert!(
        err.contains("cannot create the state directory") && err.contains("XDG_STATE_HOME"),
        "{err}"
    );

    let missing = format!("sqlite://{}/no/such/dir/x.db", dir.path().display());
    let out = run(
        simba(Some(&missing)).args(["owner", "m"]),
        Duration::from_secs(30),
        "simba owner on a missing directory",
    );
    assert_eq!(out.status.code(), Some(CANT_CREATE), "{out:?}");
    assert!(text(&out.stderr).contains("does not exist"), "{out:?}");
}

#[test]
fn exit_status_is_the_commands() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    let mutex = mutex_name("status");
    let status_of = |args: &[&str]| {
        let out = run(
            simba(Some(&url)).arg("exec").arg(&mutex).args(args),
            Duration::from_secs(30),
            "simba exec",
        );
        out.status.code()
    };
    assert_eq!(status_of(&["--", "sh", "-c", "exit 7"]), Some(7));
    assert_eq!(status_of(&["--", "true"]), Some(0));
    assert_eq!(status_of(&["--", "sh", "-c", "kill -9 $$"]), Some(137));
    assert_eq!(status_of(&["--", "sh", "-c", "kill -TERM $$"]), Some(143));
    assert_eq!(status_of(&["--", "/no/such/command"]), Some(127));
    assert_eq!(
        status_of(&["--", dir.path().to_str().expect("utf-8")]),
        Some(126)
    );
    // The mutex is free again after each run.
    assert_eq!(owner_json(&url, &mutex)["owner"], serde_json::Value::Null);
}

#[test]
fn no_wait_and_timeout_on_a_held_mutex_are_not_acquired() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    let mutex = mutex_name("held");
    let ready = file(dir.path(), "ready");
    let mut holder = simba(Some(&url))
        .args(["exec", &mutex])
        .args(sh(&format!("touch {}; sleep 30", ready.display())))
        .spawn()
        .expect("start holder");
    eventually(Duration::from_secs(30), "the holder runs", || {
        ready.exists()
    });

    let ran = file(dir.path(), "ran");
    let started = Instant::now();
    let out = run(
        simba(Some(&url))
            .args(["exec", &mutex, "--no-wait"])
            .args(sh(&format!("touch {}", ran.display()))),
        Duration::from_secs(30),
        "simba exec --no-wait",
    );
    assert_eq!(out.status.code(), Some(NOT_ACQUIRED), "{out:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(
        text(&out.stderr).contains("held by another contender"),
        "{out:?}"
    );

    let started = Instant::now();
    let out = run(
        simba(Some(&url))
            .args(["exec", &mutex, "--timeout", "300ms"])
            .args(sh(&format!("touch {}", ran.display()))),
        Duration::from_secs(30),
        "simba exec --timeout 300ms",
    );
    let waited = started.elapsed();
    assert_eq!(out.status.code(), Some(NOT_ACQUIRED), "{out:?}");
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    assert!(
        text(&out.stderr).contains("not acquired within 300ms"),
        "{out:?}"
    );
    assert!(!ran.exists(), "a command ran without the mutex");

    // A waiter that gets SIGTERM gives up with 128+15 and never runs its command.
    let mut waiter = simba(Some(&url))
        .args(["-vv", "exec", &mutex])
        .args(sh(&format!("touch {}", ran.display())))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start waiter");
    // Signal it once it says it waits (its signal handler is installed before that line).
    // Its stderr is read to the end, so that what it writes after that line finds a reader.
    let stderr = waiter.stderr.take().expect("piped stderr");
    let (said_tx, said) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stderr)).map_while(Result::ok) {
            if line.contains("waiting for the mutex") {
                let _ = said_tx.send(());
            }
        }
    });
    said.recv_timeout(Duration::from_secs(10))
        .expect("the waiter says it waits");
    send(waiter.id(), Signal::SIGTERM);
    let status = wait_for(&mut waiter, Duration::from_secs(10), "waiter after SIGTERM");
    assert_eq!(status.code(), Some(143));
    assert!(!ran.exists(), "a command ran without the mutex");
    reader.join().expect("stderr reader");

    // SIGTERM to the holder reaches `sleep` (the whole group): the holder ends with 143.
    send(holder.id(), Signal::SIGTERM);
    let status = wait_for(&mut holder, Duration::from_secs(10), "holder after SIGTERM");
    assert_eq!(status.code(), Some(143));
}

#[test]
fn signals_sent_to_simba_reach_the_command() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    for (sig, name) in [
        (Signal::SIGTERM, "TERM"),
        (Signal::SIGINT, "INT"),
        (Signal::SIGHUP, "HUP"),
        (Signal::SIGQUIT, "QUIT"),
    ] {
        let ready = file(dir.path(), &format!("ready-{name}"));
        let marker = file(dir.path(), &format!("got-{name}"));
        let script = format!(
            "exec 2>/dev/null; trap 'echo $$ > {marker}; exit 3' {name}; touch {ready}; \
             while :; do sleep 0.05; done",
            marker = marker.display(),
            ready = ready.display()
        );
        let mut exec = simba(Some(&url))
            .args(["exec", &mutex_name(name)])
            .args(sh(&script))
            .spawn()
            .expect("start simba exec");
        eventually(Duration::from_secs(30), "the command runs", || {
            ready.exists()
        });
        send(exec.id(), sig);
        let status = wait_for(
            &mut exec,
            Duration::from_secs(10),
            "simba exec after a signal",
        );
        assert_eq!(status.code(), Some(3), "SIG{name}: the trap's own status");
        assert_eq!(lines(&marker).len(), 1, "SIG{name} reached the command");
    }

    // A command without a trap dies of the signal: 128 + 2.
    let ready = file(dir.path(), "ready-plain");
    let mut exec = simba(Some(&url))
        .args(["exec", &mutex_name("plain")])
        .args(sh(&format!("touch {}; sleep 30", ready.display())))
        .spawn()
        .expect("start simba exec");
    eventually(Duration::from_secs(30), "the command runs", || {
        ready.exists()
    });
    send(exec.id(), Signal::SIGINT);
    let status = wait_for(
        &mut exec,
        Duration::from_secs(10),
        "simba exec after SIGINT",
    );
    assert_eq!(status.code(), Some(130));
}

#[test]
fn owner_and_watch_follow_exec_on_sqlite() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    owner_and_watch_follow_exec(&url, "show");
}

#[test]
fn owner_prints_text() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    let out = run(
        simba(Some(&url)).args(["owner", "nobody-here"]),
        Duration::from_secs(30),
        "simba owner",
    );
    assert!(out.status.success(), "{out:?}");
    assert_eq!(text(&out.stdout), "nobody-here: no owner\n");

    let ready = file(dir.path(), "ready");
    let mut exec = simba(Some(&url))
        .args(["exec", "held-one", "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 30", ready.display()))
        .spawn()
        .expect("start simba exec");
    eventually(Duration::from_secs(30), "the command runs", || {
        ready.exists()
    });
    let out = run(
        simba(Some(&url)).args(["owner", "held-one"]),
        Duration::from_secs(30),
        "simba owner",
    );
    let shown = text(&out.stdout);
    assert!(shown.starts_with("held-one: owned by "), "{shown}");
    assert!(
        shown.contains("(fence ") && shown.contains("lease ends:"),
        "{shown}"
    );
    send(exec.id(), Signal::SIGTERM);
    wait_for(
        &mut exec,
        Duration::from_secs(10),
        "simba exec after SIGTERM",
    );
}

#[test]
fn usage_errors_name_the_problem() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    let usage = |cmd: &mut std::process::Command, what: &str| {
        let out = run(cmd, Duration::from_secs(30), what);
        assert_eq!(out.status.code(), Some(USAGE), "{what}: {out:?}");
        text(&out.stderr)
    };

    let err = usage(
        simba(Some(&url)).args(["exec", "m", "--ttl", "10", "--", "true"]),
        "duration without unit",
    );
    assert!(err.contains("`10`") && err.contains("--ttl"), "{err}");
    let err = usage(
        simba(Some(&url)).args(["exec", "m", "--grace", "soon", "--", "true"]),
        "bad grace",
    );
    assert!(err.contains("`soon`"), "{err}");
    let err = usage(
        simba(Some("ftp://example")).args(["owner", "m"]),
        "unknown scheme",
    );
    assert!(
        err.contains("unknown scheme `ftp://`") && err.contains("sqlite://PATH"),
        "{err}"
    );
    let err = usage(
        simba(None)
            .env("SIMBA_BACKEND", "nonsense")
            .args(["owner", "m"]),
        "bad SIMBA_BACKEND",
    );
    assert!(err.contains("not a URL"), "{err}");
    usage(simba(Some(&url)).args(["exec", "m"]), "no command");
    usage(
        simba(Some(&url)).args(["exec", "m", "--no-wait", "--timeout", "1s", "--", "true"]),
        "conflict",
    );
    let err = usage(
        simba(Some(&url)).args(["owner", " spaces "]),
        "bad mutex name",
    );
    assert!(err.contains("mutex name"), "{err}");
    let err = usage(
        simba(Some(&url)).args(["exec", "m", "--ttl", "0s", "--", "true"]),
        "zero ttl",
    );
    assert!(err.contains("ttl"), "{err}");

    // --help documents the exit statuses.
    let out = run(simba(None).arg("--help"), Duration::from_secs(30), "--help");
    assert!(out.status.success());
    let help = text(&out.stdout);
    for needle in ["64", "69", "75", "79", "SIMBA_BACKEND"] {
        assert!(help.contains(needle), "--help lacks {needle}: {help}");
    }
}

#[test]
fn an_unreachable_backend_is_unavailable() {
    // Nothing listens on port 1.
    let out = run(
        simba(Some("redis://127.0.0.1:1")).args(["exec", "m", "--", "true"]),
        Duration::from_secs(60),
        "simba exec on an unreachable Redis",
    );
    assert_eq!(out.status.code(), Some(UNAVAILABLE), "{out:?}");
    assert!(text(&out.stderr).contains("redis://127.0.0.1:1"), "{out:?}");
}

/// `while true; do simba exec job -- …; done` in one shell must not starve a second shell
/// waiting for `job`: on SQLite the waiter that looked keeps first claim on the mutex, so a
/// new `simba exec` of the loop cannot take it past the waiter.
#[test]
fn a_waiter_is_not_starved_by_a_loop_of_execs() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "loop.db");
    let mutex = mutex_name("loop");
    let log = file(dir.path(), "log");
    let looper = {
        let (url, mutex, log) = (url.clone(), mutex.clone(), log.clone());
        std::thread::spawn(move || {
            for i in 1..=6 {
                // Holds of 0.4 s: longer than the waiter's poll (0.1–0.2 s), so that it
                // looks while the loop holds the mutex.
                let script = format!("echo A{i} >> {}; sleep 0.4", log.display());
                let out = run(
                    simba(Some(&url)).args(["exec", &mutex]).args(sh(&script)),
                    Duration::from_secs(30),
                    "a simba exec of the loop",
                );
                assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
            }
        })
    };
    eventually(Duration::from_secs(30), "the loop's first command", || {
        lines(&log).iter().any(|l| l == "A1")
    });
    let script = format!("echo B >> {}", log.display());
    let out = run(
        simba(Some(&url)).args(["exec", &mutex]).args(sh(&script)),
        Duration::from_secs(30),
        "the waiting simba exec",
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    looper.join().expect("the loop");
    let order = lines(&log);
    let b = order.iter().position(|l| l == "B").expect("B ran");
    let a3 = order.iter().position(|l| l == "A3").expect("A3 ran");
    assert!(
        b < a3,
        "the waiter started during A1 and ran after at most one more turn of the loop: \
         {order:?}"
    );
}

/// simba whose stderr reader went away (a pipe closed early) still exits with the status it
/// means: here a waiter given SIGTERM logs that it gives up, to a closed pipe, and ends with
/// 128+15 rather than a panic's 101.
#[test]
fn a_closed_stderr_does_not_change_the_exit_status() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "stderr.db");
    let mutex = mutex_name("stderr");
    let held = file(dir.path(), "held");
    let mut holder = simba(Some(&url))
        .args(["exec", &mutex])
        .args(sh(&format!("touch {}; sleep 30", held.display())))
        .spawn()
        .expect("start holder");
    eventually(Duration::from_secs(30), "the holder runs", || held.exists());
    let mut waiter = simba(Some(&url))
        .args(["-vv", "exec", &mutex, "--", "true"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start waiter");
    let stderr = waiter.stderr.take().expect("piped stderr");
    let said = std::io::BufRead::lines(std::io::BufReader::new(stderr))
        .map_while(Result::ok)
        .any(|line| line.contains("waiting for the mutex"));
    // The reader is dropped here: the pipe is closed before the signal.
    assert!(said, "the waiter says it waits");
    send(waiter.id(), Signal::SIGTERM);
    let status = wait_for(&mut waiter, Duration::from_secs(10), "waiter after SIGTERM");
    assert_eq!(status.code(), Some(143), "{status:?}");
    send(holder.id(), Signal::SIGTERM);
    let status = wait_for(&mut holder, Duration::from_secs(10), "holder after SIGTERM");
    assert_eq!(status.code(), Some(143));
}

#[test]
fn hold_at_least_with_no_wait_runs_once_per_period_on_sqlite() {
    let dir = tempdir();
    hold_at_least_runs_once_per_period(&sqlite_url(dir.path(), "x.db"), "hold", &[]);
}

#[test]
fn hold_at_most_stops_the_command_on_sqlite() {
    let dir = tempdir();
    hold_at_most_stops_the_command(&sqlite_url(dir.path(), "x.db"), "at-most");
}

/// Small edges of the command line, each with what a user should get: one clear message,
/// the right status, no wait.
#[test]
fn an_unreachable_zookeeper_is_reported_quickly_and_once() {
    // Nothing listens on port 1. Before: 10 s and ~40 ERROR lines of the ZooKeeper client
    // before simba's own message.
    let started = Instant::now();
    let out = run(
        simba(Some("zk://127.0.0.1:1")).args(["owner", "m"]),
        Duration::from_secs(60),
        "simba owner on an unreachable ZooKeeper",
    );
    let took = started.elapsed();
    assert_eq!(out.status.code(), Some(UNAVAILABLE), "{out:?}");
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "one message only: {err}");
    assert!(err.contains("127.0.0.1:1") && err.contains("5s"), "{err}");
    // The CLI's connect timeout is 5 s; 8 s leaves room for a loaded machine.
    assert!(took < Duration::from_secs(8), "took {took:?}");
}

#[test]
fn a_malformed_postgres_url_is_a_usage_error_said_once() {
    for (url, says) in [
        ("postgres://u@/db", "names no host"),
        ("postgres://", "names no host"),
        ("postgres://u@h:99999/db", "`port`"),
    ] {
        let out = run(
            simba(Some(url)).args(["owner", "m"]),
            Duration::from_secs(30),
            url,
        );
        assert_eq!(out.status.code(), Some(USAGE), "{url}: {out:?}");
        let err = text(&out.stderr);
        assert!(err.contains(says), "{url}: {err}");
        assert!(
            err.matches("invalid configuration").count() <= 1,
            "{url}: said more than once: {err}"
        );
    }
}

#[test]
fn a_sqlite_path_that_is_no_file_is_refused_at_once_with_a_hint() {
    let dir = tempdir();
    for (path, says) in [
        ("/dev/null".to_owned(), "not a regular file"),
        (dir.path().display().to_string(), "is a directory"),
    ] {
        let url = format!("sqlite://{path}");
        let started = Instant::now();
        let out = run(
            simba(Some(&url)).args(["owner", "m"]),
            Duration::from_secs(30),
            &url,
        );
        assert_eq!(out.status.code(), Some(CANT_CREATE), "{url}: {out:?}");
        let err = text(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{url}: {err}");
        assert!(
            err.contains(says) && err.contains("regular file"),
            "{url}: {err}"
        );
        assert!(!err.contains("disk I/O error"), "{url}: {err}");
        assert!(started.elapsed() < Duration::from_secs(3), "{url}: no wait");
    }
}

#[test]
fn a_lease_over_a_year_is_refused() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    let out = run(
        simba(Some(&url)).args([
            "exec",
            "m",
            "--ttl",
            "8760h",
            "--transition",
            "8760h",
            "--",
            "true",
        ]),
        Duration::from_secs(30),
        "a two-year lease",
    );
    assert_eq!(out.status.code(), Some(USAGE), "{out:?}");
    let err = text(&out.stderr);
    assert!(
        err.contains("ttl + transition") && err.contains("one year"),
        "{err}"
    );
}

#[test]
fn invisible_and_text_direction_characters_in_names_are_refused() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    // U+202E shows `deploy\u{202E}gol` as "deploylog"; U+200B is a zero-width space.
    for name in ["deploy\u{202E}gol", "dep\u{200B}loy"] {
        let out = run(
            simba(Some(&url)).args(["owner", name]),
            Duration::from_secs(30),
            "an invisible character",
        );
        assert_eq!(out.status.code(), Some(USAGE), "{name:?}: {out:?}");
        let err = text(&out.stderr);
        assert!(err.contains("mutex name") && err.contains("U+20"), "{err}");
    }
}

#[test]
fn a_sqlite_file_that_cannot_be_opened_gets_a_hint() {
    // A regular file in a directory where nothing can be created (even as root): SQLite
    // says only "unable to open database file".
    let out = run(
        simba(Some("sqlite:///proc/version")).args(["owner", "m"]),
        Duration::from_secs(30),
        "sqlite:///proc/version",
    );
    assert_eq!(out.status.code(), Some(UNAVAILABLE), "{out:?}");
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("unable to open database file") && err.contains("writable"),
        "{err}"
    );
}

/// `simba exec --timeout 1ms` gives up almost at once, often while its acquisition is
/// winning on the database: whatever it answers, it must leave the mutex free when it
/// exits (before, a run that exited 75 left the mutex owned by a dead contender for a whole
/// lease in about a third of the runs).
#[test]
fn a_timed_out_exec_leaves_the_mutex_free() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "timeout.db");
    let mutex = mutex_name("timeout");
    let mut gave_up = 0;
    for i in 0..40 {
        let out = run(
            simba(Some(&url)).args(["exec", &mutex, "--timeout", "1ms", "--", "true"]),
            Duration::from_secs(30),
            "simba exec --timeout 1ms",
        );
        let code = out.status.code();
        assert!(
            code == Some(0) || code == Some(NOT_ACQUIRED),
            "run {i}: {out:?}"
        );
        if code == Some(NOT_ACQUIRED) {
            gave_up += 1;
        }
        let owner = owner_json(&url, &mutex);
        assert!(
            owner["owner"].is_null(),
            "run {i} exited with {code:?} and left the mutex owned: {owner}"
        );
    }
    eprintln!("{gave_up} of 40 runs gave up");
    // With nothing left owned, a no-wait exec gets the mutex at once.
    let out = run(
        simba(Some(&url)).args(["exec", &mutex, "--no-wait", "--", "true"]),
        Duration::from_secs(30),
        "simba exec --no-wait",
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}

/// simba paused (SIGSTOP) past its lease while the command finishes: when it resumes, the
/// command has ended and the ownership with it. The release finds the loss, and simba
/// must say so with 79 rather than pass the command's 0 on as if it had run protected.
#[test]
fn a_loss_found_at_the_release_is_ownership_lost() {
    // Time is the subject: simba stays stopped past its 0.5 s lease and past the end of
    // the command's 1 s sleep, with room for a loaded machine.
    let (_, status, stderr) = exec_stopped_for(&[], "paused", 1, Duration::from_millis(2500));
    assert_eq!(status.code(), Some(LOST), "{stderr}");
}

/// The mutex's row changed by hand while `simba exec` holds it (issue #45): the command
/// ends with 0, the release finds the row no longer simba's, and simba must exit with 79
/// and say so in one line, not pass the command's 0 on as if it had run protected.
#[test]
fn a_row_changed_by_hand_is_found_by_the_release_and_is_ownership_lost() {
    use diesel::{Connection, RunQueryDsl};
    let dir = tempdir();
    let db = dir.path().join("hand.db");
    let url = sqlite_url(dir.path(), "hand.db");
    let mutex = mutex_name("hand");
    let (seen, go) = (file(dir.path(), "seen"), file(dir.path(), "go"));
    let script = format!(
        "echo \"$SIMBA_OWNER_ID\" > {seen}; while [ ! -e {go} ]; do sleep 0.05; done",
        seen = seen.display(),
        go = go.display()
    );
    // A 30 s lease: no renewal comes before the release to notice the change first.
    let mut exec = simba(Some(&url))
        .args(["exec", "--ttl", "30s", &mutex])
        .args(sh(&script))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start simba exec");
    let stderr = line_channel(exec.stderr.take().expect("stderr"));
    eventually(Duration::from_secs(30), "the command starts", || {
        lines(&seen).len() == 1
    });
    let owner = lines(&seen).remove(0);
    let mut c = diesel::SqliteConnection::establish(&db.display().to_string()).expect("open");
    diesel::connection::SimpleConnection::batch_execute(&mut c, "PRAGMA busy_timeout = 5000")
        .expect("busy timeout");
    let changed = diesel::sql_query(format!(
        "UPDATE simba_mutex SET owner_id = 'intruder' WHERE mutex = '{mutex}' \
         AND owner_id = '{owner}'"
    ))
    .execute(&mut c)
    .expect("UPDATE by hand");
    assert_eq!(changed, 1, "the row of {mutex} owned by {owner}");
    std::fs::write(&go, b"").expect("write go");
    let status = wait_for(&mut exec, Duration::from_secs(30), "simba exec");
    let said: Vec<String> = stderr.iter().collect();
    assert_eq!(status.code(), Some(LOST), "{said:#?}");
    let simba_lines: Vec<&String> = said.iter().filter(|l| l.starts_with("simba: ")).collect();
    assert_eq!(simba_lines.len(), 1, "one line from simba: {said:#?}");
    let line = simba_lines[0];
    assert!(
        line.contains(&format!("mutex {mutex:?}"))
            && line.contains("no longer this contender's")
            && line.contains("taken over")
            && line.contains("status 0"),
        "{line}"
    );
}

/// `simba -v exec` says when the ownership was lost, with the fence: simba is stopped
/// past its lease while the command runs, and on waking it sees the lease expired.
#[test]
fn verbose_exec_narrates_a_loss() {
    // Time is the subject: simba stays stopped well past its 0.5 s lease, with room for
    // a loaded machine.
    let (mutex, status, stderr) =
        exec_stopped_for(&["-v"], "narrated", 30, Duration::from_millis(1500));
    assert_eq!(status.code(), Some(LOST), "{stderr}");
    let line = |what: &str| {
        stderr
            .lines()
            .find(|l| l.starts_with("simba: ") && l.contains(&format!("mutex {mutex:?} {what}")))
            .map(str::to_owned)
    };
    let acquired = line("acquired (fence ").unwrap_or_else(|| panic!("{stderr}"));
    let fence = acquired
        .split("(fence ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap_or_else(|| panic!("{acquired}"));
    let lost = line(&format!("lost (fence {fence})")).unwrap_or_else(|| panic!("{stderr}"));
    // Whichever saw it first names the same end: the engine ("lease expired") or the
    // guardian, which kills the command at the local lease deadline.
    assert!(
        lost.contains("lease expired") || lost.contains("the local lease deadline passed"),
        "{lost}"
    );
}

/// SIGTERM to a `simba exec` early in its acquisition, on a free mutex: whether it got the
/// mutex or not, it must leave nothing owned when it exits (the acquisition it gives up
/// may be winning on the database at that moment).
#[test]
fn an_exec_stopped_while_acquiring_leaves_the_mutex_free() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "term.db");
    let mutex = mutex_name("term");
    let ready = file(dir.path(), "ready");
    // Create the database first, so that each run is quick to reach the acquisition.
    let out = run(
        simba(Some(&url)).args(["exec", &mutex, "--", "true"]),
        Duration::from_secs(30),
        "a first simba exec",
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    for i in 0..30u64 {
        let mut exec = simba(Some(&url))
            .args(["-vv", "exec", &mutex])
            .args(sh(&format!("touch {}", ready.display())))
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start simba exec");
        // Signal it once it says it waits (its handler is installed before that line), at
        // a point that moves through the first milliseconds of the acquisition.
        let stderr = exec.stderr.take().expect("piped stderr");
        let (said_tx, said) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in
                std::io::BufRead::lines(std::io::BufReader::new(stderr)).map_while(Result::ok)
            {
                if line.contains("waiting for the mutex") {
                    let _ = said_tx.send(());
                }
            }
        });
        said.recv_timeout(Duration::from_secs(10))
            .expect("simba exec says it waits");
        std::thread::sleep(Duration::from_micros(300 * (i % 10)));
        send(exec.id(), Signal::SIGTERM);
        let status = wait_for(
            &mut exec,
            Duration::from_secs(30),
            "simba exec after SIGTERM",
        );
        reader.join().expect("stderr reader");
        assert!(
            matches!(status.code(), Some(0 | 143)),
            "run {i}: {status:?}"
        );
        let owner = owner_json(&url, &mutex);
        assert!(
            owner["owner"].is_null(),
            "run {i} ended with {status:?} and left the mutex owned: {owner}"
        );
    }
}

/// Runs `simba [global] exec` with a 0.3 s + 0.2 s lease on a fresh SQLite file, a command
/// that sleeps `command_secs`, stops simba with SIGSTOP for `stopped` once the command runs,
/// and returns the mutex, simba's exit status and its stderr.
fn exec_stopped_for(
    global: &[&str],
    name: &str,
    command_secs: u32,
    stopped: Duration,
) -> (String, std::process::ExitStatus, String) {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), &format!("{name}.db"));
    let mutex = mutex_name(name);
    let ready = file(dir.path(), "ready");
    let mut exec = simba(Some(&url))
        .args(global)
        .args(["exec", &mutex, "--ttl", "300ms", "--transition", "200ms"])
        .args(sh(&format!(
            "touch {}; sleep {command_secs}",
            ready.display()
        )))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start simba exec");
    eventually(Duration::from_secs(30), "the command runs", || {
        ready.exists()
    });
    send(exec.id(), Signal::SIGSTOP);
    std::thread::sleep(stopped);
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
    (mutex, status, stderr)
}

/// Drives an interactive bash on a pseudo-terminal (python3's `pty`): the command reads
/// the terminal. Every wait is bounded; the script exits 1 with what it saw on a timeout.
const JOB_CONTROL: &str = r#"
import os, pty, sys, time, select
simba, url = sys.argv[1], sys.argv[2]
pid, fd = pty.fork()
if pid == 0:
    os.environ['PS1'] = 'PROMPT> '
    os.environ['SIMBA_BACKEND'] = url
    os.execvp('bash', ['bash', '--norc', '--noprofile', '-i'])
buf = b''
def expect(pat, limit=30):
    global buf
    end = time.time() + limit
    while pat.encode() not in buf:
        left = end - time.time()
        if left <= 0:
            print('timeout waiting for', repr(pat), 'after', repr(buf[-400:]))
            os.kill(pid, 9)
            sys.exit(1)
        r, _, _ = select.select([fd], [], [], left)
        if r:
            try:
                buf += os.read(fd, 4096)
            except OSError:
                break
    buf = buf[buf.index(pat.encode()) + len(pat):]
def send(s):
    os.write(fd, s.encode())
def stopped_then(cmd):
    # Ctrl-Z once the command waits in `read` (not while its shell forks: dash's vfork
    # leaves the parent unstoppable while a child stopped before its exec, with or
    # without simba): the shell reports the job stopped.
    expect('ready-' + cmd)
    send('\x1a'); expect('Stopped'); expect('PROMPT> ')
def until_stopped():
    # Polled by the shell: the job stops when its command reads from the background.
    send("until jobs | grep -q Stopped; do sleep 0.05; done; jobs\n")
    expect('Stopped'); expect('PROMPT> ')
# After `fg` the driver gives bash a moment to set the job's terminal modes before it
# types (input typed while they change may be dropped); nothing it can read says when.
expect('PROMPT> ')
# 1. started in the background, reads the terminal (SIGTTIN), then `fg`.
send(f"{simba} exec m -- sh -c 'read x; echo got-$x' &\n")
expect('PROMPT> ')
until_stopped()
send("fg\n"); expect('simba exec m')
time.sleep(0.5)
send("one\n"); expect('got-one'); expect('PROMPT> ')
send("echo rc=$?\n"); expect('rc=0')
# 2. Ctrl-Z, then `fg`.
send(f"{simba} exec m -- sh -c 'echo ready-$0; read x; echo got-$x' a\n")
stopped_then('a')
send("fg\n"); expect('simba exec m')
time.sleep(0.5)
send("two\n"); expect('got-two'); expect('PROMPT> ')
send("echo rc=$?\n"); expect('rc=0')
# 3. Ctrl-Z, `bg` (it reads: stopped again), then `fg`.
send(f"{simba} exec m -- sh -c 'echo ready-$0; read x; echo got-$x' b\n")
stopped_then('b')
send("bg\n"); expect('PROMPT> ')
until_stopped()
send("fg\n"); expect('simba exec m')
time.sleep(0.5)
send("three\n"); expect('got-three'); expect('PROMPT> ')
send("echo rc=$?\n"); expect('rc=0')
# 4. Ctrl-C reaches the command.
send(f"{simba} exec m -- sh -c 'echo ready-$0; sleep 30' c\n")
expect('ready-c'); time.sleep(0.3)
send('\x03'); expect('PROMPT> ')
send("echo rc=$?\n"); expect('rc=130')
send("exit\n")
os.waitpid(pid, 0)
print('OK')
"#;

/// Job control at an interactive shell, as for the command run alone: `simba exec … &`
/// whose command reads the terminal stops, `fg` continues it with the terminal; Ctrl-Z
/// stops the job (the shell says so) and `fg` or `bg` continue it; Ctrl-C reaches the
/// command. After each, the mutex is free again (the next exec gets it at once).
#[test]
fn job_control_at_an_interactive_shell_works_as_for_the_command_alone() {
    let have = |p: &str| {
        std::process::Command::new(p)
            .arg("--version")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !have("python3") || !have("bash") {
        eprintln!("python3 or bash missing: skipped");
        return;
    }
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    let out = run(
        std::process::Command::new("python3")
            .args(["-c", JOB_CONTROL, SIMBA, &url])
            .stdin(std::process::Stdio::null()),
        Duration::from_secs(120),
        "the pty driver",
    );
    assert!(
        out.status.success() && text(&out.stdout).contains("OK"),
        "{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    // Nothing left holding the mutex.
    let free = run(
        simba(Some(&url)).args(["exec", "m", "--no-wait", "--", "true"]),
        Duration::from_secs(30),
        "exec after the session",
    );
    assert!(free.status.success(), "{free:?}");
}
