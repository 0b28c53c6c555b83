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
