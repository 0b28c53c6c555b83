//! Faults: ownership lost while `simba exec` runs its command.
//!
//! The binary is named `faults` so that the workspace's nextest configuration runs it in
//! the serial fault group (its timing must not be starved by other tests).

mod common;

use std::time::{Duration, Instant};

use common::*;
use simba_test_kit::proxy::FaultProxy;
use simba_test_kit::servers;

/// Runs blocking test code off the runtime's threads (the proxy runs on them).
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .expect("blocking test code panicked")
}

/// What happened after the network to Redis was cut under a running `simba exec`.
struct AfterCut {
    status: std::process::ExitStatus,
    stderr: String,
    took: Duration,
    group: Vec<i32>,
}

/// Runs `simba exec --ttl 2s --transition 1s --grace GRACE` through a fault proxy with a
/// command whose process group has a shell, a `sleep` child and, if `stubborn`, a `sleep`
/// that ignores SIGTERM; cuts the network (blackhole: connections stay open, nothing
/// answers) once the command runs, and waits for simba to end.
async fn cut_under_exec(grace: &str, stubborn: bool, test: &str) -> AfterCut {
    let server = servers::redis().await.expect("a Redis server");
    let proxy = FaultProxy::start(server.socket_addr().expect("Redis address"))
        .await
        .expect("start the proxy");
    let url = server.url_via(proxy.addr());
    let dir = tempdir();
    let pids = file(dir.path(), "pids");
    let p = pids.display();
    let extra = if stubborn {
        format!("(trap '' TERM; exec sleep 1000) & echo $! >> {p}; ")
    } else {
        String::new()
    };
    let script = format!("sleep 1000 & echo $! >> {p}; {extra}echo $$ >> {p}; wait");
    let expected = if stubborn { 3 } else { 2 };
    let mutex = mutex_name(test);
    let mut exec = simba(Some(&url))
        .args([
            "exec",
            &mutex,
            "--ttl",
            "2s",
            "--transition",
            "1s",
            "--grace",
            grace,
        ])
        .args(sh(&script))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start simba exec");
    let group: Vec<i32> = blocking(move || {
        eventually(
            Duration::from_secs(30),
            "the command's processes start",
            || lines(&pids).len() == expected,
        );
        lines(&pids)
            .iter()
            .map(|l| l.trim().parse().expect("a pid"))
            .collect()
    })
    .await;
    assert!(group.iter().all(|&pid| alive(pid)), "{group:?}");

    // Let it renew once or twice, then cut the network without closing connections.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        matches!(exec.try_wait(), Ok(None)),
        "simba exec ended early"
    );
    proxy.blackhole(true);
    let cut = Instant::now();
    let (status, stderr) = blocking(move || {
        // lease (3 s) + grace + the bounded release and shutdown (2 s) + slack.
        let status = wait_for(
            &mut exec,
            Duration::from_secs(40),
            "simba exec after the cut",
        );
        let mut err = String::new();
        if let Some(mut e) = exec.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        (status, err)
    })
    .await;
    let took = cut.elapsed();
    eprintln!("simba exec ended {took:?} after the cut; its stderr:\n{stderr}");
    proxy.heal();
    AfterCut {
        status,
        stderr,
        took,
        group,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_ownership_stops_the_whole_process_group() {
    let after = cut_under_exec("1s", true, "lost").await;
    assert_eq!(after.status.code(), Some(LOST), "stderr: {}", after.stderr);
    assert!(after.stderr.contains("lost"), "{}", after.stderr);
    // The TERM-ignoring grandchild made simba wait for the grace period, then SIGKILL it.
    assert!(after.took >= Duration::from_secs(1), "{:?}", after.took);
    assert!(after.took < Duration::from_secs(10), "{:?}", after.took);
    let survivors: Vec<i32> = after.group.iter().copied().filter(|&p| alive(p)).collect();
    assert!(
        survivors.is_empty(),
        "processes of the group survived: {survivors:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_that_obeys_sigterm_is_not_kept_for_the_grace_period() {
    let after = cut_under_exec("60s", false, "lost-quick").await;
    assert_eq!(after.status.code(), Some(LOST), "stderr: {}", after.stderr);
    // Lease (3 s) + release bound + shutdown, far below the 60 s grace.
    assert!(after.took < Duration::from_secs(10), "{:?}", after.took);
    let survivors: Vec<i32> = after.group.iter().copied().filter(|&p| alive(p)).collect();
    assert!(
        survivors.is_empty(),
        "processes of the group survived: {survivors:?}"
    );
}
