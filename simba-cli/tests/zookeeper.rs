//! `simba` against ZooKeeper.

mod common;

use common::*;
use simba_test_kit::servers;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_and_watch_follow_exec_on_zookeeper() {
    let server = servers::zookeeper().await.expect("a ZooKeeper server");
    let url = format!("zk://{}", server.url());
    tokio::task::spawn_blocking(move || {
        owner_and_watch_follow_exec(&url, "zk-show");
        concurrent_execs_never_overlap(Some(&url), &[], 2, "0.3", "zk-overlap");
        not_acquired_while_held(&url, "zk-held");
    })
    .await
    .expect("test body");
}

/// ZooKeeper has sessions, not leases: `--hold-at-least` is refused before waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_at_least_is_refused_on_zookeeper() {
    let server = servers::zookeeper().await.expect("a ZooKeeper server");
    let url = format!("zk://{}", server.url());
    tokio::task::spawn_blocking(move || {
        let out = run(
            simba(Some(&url)).args(["exec", "zk-hold", "--hold-at-least", "1m", "--", "true"]),
            std::time::Duration::from_secs(60),
            "simba exec --hold-at-least on zk",
        );
        assert_eq!(out.status.code(), Some(USAGE), "{out:?}");
        assert!(
            text(&out.stderr).contains("hold-at-least is not supported on ZooKeeper"),
            "{out:?}"
        );
    })
    .await
    .expect("test body");
}
