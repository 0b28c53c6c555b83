//! A give-up leaves nothing owned: after `acquire_timeout` answers `Timeout`, no node of
//! the giving-up contender is left under the mutex, so another session takes it at once.
//!
//! The short waits put the deadline while the latch node's create is in flight; the
//! node that create makes must be gone before the give-up returns, not later when the
//! session cleans up. The check is the kit's ([`give_ups_leave_nothing`]).

mod common;

use std::sync::Arc;

use common::{SESSION, random_root, server, test_config};
use simba_core::ContendServiceFactory;
use simba_test_kit::support::{give_ups_leave_nothing, multi_give_ups_leave_nothing};
use simba_zookeeper::ZkFactory;

async fn factory(connect: &str, root: &str) -> Arc<dyn ContendServiceFactory> {
    Arc::new(
        ZkFactory::connect(test_config(connect, root, SESSION))
            .await
            .expect("connect"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_acquire_leaves_no_node_behind() {
    let zk = server().await;
    let root = random_root();
    let a = factory(zk.url(), &root).await;
    let b = factory(zk.url(), &root).await;
    let timeouts = give_ups_leave_nothing(&a, &b).await;
    assert!(timeouts > 0, "no acquire gave up; the test checked nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_multi_acquire_leaves_no_node_behind() {
    let zk = server().await;
    let root = random_root();
    let a = factory(zk.url(), &root).await;
    let b = factory(zk.url(), &root).await;
    let timeouts = multi_give_ups_leave_nothing(&a, &b).await;
    assert!(
        timeouts > 0,
        "no multi acquire gave up; the test checked nothing"
    );
}
