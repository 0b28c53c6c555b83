//! `simba exec` with several `--mutex` names, on SQLite files: all or none, one order for
//! every exec, each mutex's fence in the environment, the guardian guarding every part.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;

/// The `SIMBA_*` variables a command saw, from `env` output.
fn simba_vars(out: &[u8]) -> BTreeMap<String, String> {
    text(out)
        .lines()
        .filter(|l| l.starts_with("SIMBA_"))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// Execs asking for the same two mutexes in opposite orders, all at once: every one runs
/// (no deadlock), never two at once (the kit's checker over their logged runs, with the
/// fence of the first mutex, which must increase).
#[test]
fn execs_asking_in_opposite_orders_never_overlap_nor_deadlock() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    let base = mutex_name("orders");
    let (a, b) = (format!("{base}_a"), format!("{base}_b"));
    let log = file(dir.path(), "log");
    let mut children = Vec::new();
    for i in 0..6 {
        // Half ask for (a, b), half for (b, a); each logs a's fence.
        let (first, second, a_index) = if i % 2 == 0 { (&a, &b, 1) } else { (&b, &a, 2) };
        let script = interval_script(&log, &format!("c{i}"), "0.2")
            .replace("$SIMBA_FENCE", &format!("$SIMBA_FENCE_{a_index}"));
        children.push(
            simba(Some(&url))
                .args(["exec", "--mutex", first, "--mutex", second])
                .args(sh(&script))
                .spawn()
                .expect("start simba exec"),
        );
    }
    // Six runs of 0.2 s one after the other, on a loaded machine: a deadlock never ends.
    for (i, c) in children.iter_mut().enumerate() {
        let status = wait_for(c, Duration::from_secs(90), &format!("simba exec #{i}"));
        assert_eq!(status.code(), Some(0), "simba exec #{i}");
    }
    let runs = logged_runs(&log);
    assert_eq!(runs.len(), 6, "every command ran once: {runs:?}");
    assert_safe(&runs);
}

#[test]
fn the_command_gets_each_mutex_and_fence_in_the_order_given() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    let base = mutex_name("env");
    let (a, b) = (format!("{base}_a"), format!("{base}_b"));
    let out = run(
        simba(Some(&url))
            // Left by an outer exec: must not reach the command.
            .env("SIMBA_MUTEX", "outer")
            .env("SIMBA_FENCE", "1")
            .env("SIMBA_FENCE_3", "1")
            // The positional name and --mutex together; a repeated name counts once.
            .args(["exec", &b, "--mutex", &a, "--mutex", &b, "--", "env"]),
        Duration::from_secs(30),
        "simba exec env",
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let vars = simba_vars(&out.stdout);
    let get = |k: &str| vars.get(k).cloned().unwrap_or_default();
    assert_eq!(get("SIMBA_MUTEX_COUNT"), "2", "{vars:?}");
    assert_eq!(get("SIMBA_MUTEX_1"), b, "{vars:?}");
    assert_eq!(get("SIMBA_MUTEX_2"), a, "{vars:?}");
    let fences: Vec<u64> = ["SIMBA_FENCE_1", "SIMBA_FENCE_2"]
        .iter()
        .map(|k| get(k).parse().unwrap_or_else(|_| panic!("{k} in {vars:?}")))
        .collect();
    assert!(fences.iter().all(|&f| f > 0), "{vars:?}");
    assert_eq!(
        get("SIMBA_FENCES"),
        format!("{},{}", fences[0], fences[1]),
        "{vars:?}"
    );
    assert!(!get("SIMBA_OWNER_ID_1").is_empty() && !get("SIMBA_OWNER_ID_2").is_empty());
    for gone in [
        "SIMBA_MUTEX",
        "SIMBA_FENCE",
        "SIMBA_OWNER_ID",
        "SIMBA_FENCE_3",
    ] {
        assert!(
            !vars.contains_key(gone),
            "{gone} set for a multi-lock: {vars:?}"
        );
    }

    // One mutex: the variables of today, plus the numbered ones.
    let out = run(
        simba(Some(&url)).args(["exec", "--mutex", &a, "--", "env"]),
        Duration::from_secs(30),
        "simba exec env",
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let vars = simba_vars(&out.stdout);
    assert_eq!(vars.get("SIMBA_MUTEX"), Some(&a), "{vars:?}");
    assert_eq!(vars.get("SIMBA_MUTEX_1"), Some(&a), "{vars:?}");
    assert_eq!(vars.get("SIMBA_MUTEX_COUNT").map(String::as_str), Some("1"));
    let fence = vars.get("SIMBA_FENCE").cloned().unwrap_or_default();
    assert!(
        fence.parse::<u64>().is_ok_and(|f| f > fences[1]),
        "{vars:?}"
    );
    assert_eq!(vars.get("SIMBA_FENCES"), Some(&fence), "{vars:?}");
    assert!(vars.contains_key("SIMBA_OWNER_ID"), "{vars:?}");
}

/// While one exec holds the second mutex, a multi exec gives up (timeout, no-wait) with
/// 75, without running, and leaves the first mutex free at once.
#[test]
fn a_multi_exec_that_gives_up_leaves_no_mutex_held() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    let base = mutex_name("giveup");
    let (a, b) = (format!("{base}_a"), format!("{base}_b"));
    let ready = file(dir.path(), "ready");
    let ran = file(dir.path(), "ran");
    let mut holder = simba(Some(&url))
        .args(["exec", &b])
        .args(sh(&format!("touch {}; sleep 30", ready.display())))
        .spawn()
        .expect("start the holder");
    eventually(Duration::from_secs(30), "the holder runs", || {
        ready.exists()
    });
    for wait in [&["--timeout", "500ms"][..], &["--no-wait"][..]] {
        let started = Instant::now();
        let out = run(
            simba(Some(&url))
                .args(["exec", "--mutex", &a, "--mutex", &b])
                .args(wait)
                .args(sh(&format!("touch {}", ran.display()))),
            Duration::from_secs(30),
            "simba exec of a held set",
        );
        assert_eq!(out.status.code(), Some(NOT_ACQUIRED), "{wait:?}: {out:?}");
        assert!(
            text(&out.stderr).contains(&b),
            "the message names the held mutex: {out:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(10), "{wait:?}");
        let free = run(
            simba(Some(&url)).args(["exec", "--no-wait", &a, "--", "true"]),
            Duration::from_secs(30),
            "simba exec --no-wait of the first mutex",
        );
        assert_eq!(
            free.status.code(),
            Some(0),
            "{wait:?}: the first mutex stayed held: {free:?}"
        );
    }
    assert!(!ran.exists(), "a command ran without every mutex");
    send(holder.id(), Signal::SIGTERM);
    let status = wait_for(&mut holder, Duration::from_secs(10), "holder after SIGTERM");
    assert_eq!(status.code(), Some(143));
}

#[test]
fn too_many_or_no_mutexes_are_usage_errors() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    let mut args = vec!["exec".to_owned()];
    for i in 0..33 {
        args.extend(["--mutex".to_owned(), format!("m{i}")]);
    }
    args.extend(["--".to_owned(), "true".to_owned()]);
    let out = run(
        simba(Some(&url)).args(&args),
        Duration::from_secs(30),
        "33 mutexes",
    );
    assert_eq!(out.status.code(), Some(USAGE), "{out:?}");
    assert!(text(&out.stderr).contains("at most 32"), "{out:?}");
    let out = run(
        simba(Some(&url)).args(["exec", "--", "true"]),
        Duration::from_secs(30),
        "no mutex",
    );
    assert_eq!(out.status.code(), Some(USAGE), "{out:?}");
}

/// simba holding (a, b) is killed while an exec waits for b alone: the guardian held both
/// lock files, so b's next owner starts only once the first command's group is gone.
#[test]
fn a_killed_multi_exec_keeps_every_part_until_its_group_is_gone() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    let base = mutex_name("multi-kill");
    let first = Holding {
        mutexes: vec![format!("{base}_a"), format!("{base}_b")],
        fence_var: "SIMBA_FENCE_2",
    };
    let next = Holding {
        mutexes: vec![format!("{base}_b")],
        fence_var: "SIMBA_FENCE",
    };
    let h = group_gone_before_next_owner_of(
        &url,
        &["--ttl", "10s", "--transition", "5s"],
        Fault::Kill,
        &first,
        &next,
    );
    // A dead owner's lock files free the mutexes, not the 15 s lease.
    assert!(h.next_started < Duration::from_secs(5), "{h:?}");
}

/// simba holding (a, b) is stopped past its lease while an exec waits for (b, a): the
/// guardian kills the group at the earliest local deadline, before the next owner starts.
#[test]
fn a_stopped_multi_exec_loses_its_group_at_the_deadline() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    let base = mutex_name("multi-stop");
    let (a, b) = (format!("{base}_a"), format!("{base}_b"));
    let first = Holding {
        mutexes: vec![a.clone(), b.clone()],
        fence_var: "SIMBA_FENCE_1",
    };
    let next = Holding {
        mutexes: vec![b, a],
        fence_var: "SIMBA_FENCE_2",
    };
    let h = group_gone_before_next_owner_of(
        &url,
        &["--ttl", "1s", "--transition", "1s"],
        Fault::Stop,
        &first,
        &next,
    );
    // The group runs on while the lease protects it, and is gone at the local deadline.
    assert!(h.first_last_seen < Duration::from_millis(2500), "{h:?}");
}
