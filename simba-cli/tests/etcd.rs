//! `simba` against etcd.

#![cfg(feature = "etcd")]

mod common;

use common::*;
use simba_test_kit::servers;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_and_watch_follow_exec_on_etcd() {
    let server = servers::etcd().await.expect("an etcd server");
    let url = format!("{}/simba-cli-test", server.url());
    tokio::task::spawn_blocking(move || {
        owner_and_watch_follow_exec(&url, "etcd-show");
        concurrent_execs_never_overlap(Some(&url), &[], 2, "0.3", "etcd-overlap");
        not_acquired_while_held(&url, "etcd-held");
    })
    .await
    .expect("test body");
}

/// Six `simba exec --permits 2` at once on etcd: at most two run at once, six distinct
/// fences (etcd semaphores: `EtcdFactory::semaphore`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_execs_with_two_permits_on_etcd_run_two_at_a_time() {
    let server = servers::etcd().await.expect("an etcd server");
    let url = format!("{}/simba-cli-test", server.url());
    tokio::task::spawn_blocking(move || six_execs_two_at_a_time(&url, "permits-etcd"))
        .await
        .expect("test body");
}

/// etcd leases end by themselves: a hold keeps the mutex after the command, and `simba
/// owner` shows it held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_at_least_keeps_the_mutex_on_etcd() {
    let server = servers::etcd().await.expect("an etcd server");
    let url = format!("{}/simba-cli-test", server.url());
    tokio::task::spawn_blocking(move || {
        let mutex = mutex_name("etcd-hold");
        let once = || {
            run(
                simba(Some(&url)).args([
                    "exec",
                    &mutex,
                    "--no-wait",
                    "--hold-at-least",
                    "20s",
                    "--",
                    "true",
                ]),
                std::time::Duration::from_secs(30),
                "simba exec --hold-at-least on etcd",
            )
        };
        let first = once();
        assert_eq!(first.status.code(), Some(0), "{first:?}");
        let held = owner_json(&url, &mutex);
        let holder = held["owner"]["owner_id"].as_str().unwrap_or_default();
        assert!(holder.starts_with("held@@"), "{held}");
        let again = once();
        assert_eq!(again.status.code(), Some(NOT_ACQUIRED), "{again:?}");
    })
    .await
    .expect("test body");
}

/// etcd has semaphores: `simba bench` measures a permit's cycle and hand-over, with no
/// overlap and no fence going back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_semaphores_are_measured() {
    let server = servers::etcd().await.expect("an etcd server");
    let url = format!("{}/simba-cli-test", server.url());
    tokio::task::spawn_blocking(move || {
        let out = run(
            simba(Some(&url)).args([
                "bench",
                "--json",
                "--scenario",
                "semaphore",
                "--iterations",
                "3",
            ]),
            std::time::Duration::from_secs(60),
            "simba bench --scenario semaphore",
        );
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "{:?}\nstdout: {stdout}\nstderr: {}",
            out.status,
            text(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_str(stdout.trim())
            .unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"));
        assert_eq!(v["semaphore"]["supported"], true, "{v:#}");
        for field in ["overlaps", "fence_regressions"] {
            let n = v["semaphore"][field].as_f64();
            assert_eq!(n, Some(0.0), "{field}: {v:#}");
        }
    })
    .await
    .expect("test body");
}
