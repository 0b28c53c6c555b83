//! A give-up leaves nothing owned: after `acquire_timeout` answers `Timeout`, no node of
//! the giving-up contender is left under the mutex, so another session takes it at once.
//!
//! The short waits put the deadline while the latch node's create is in flight; the
//! node that create makes must be gone before the give-up returns, not later when the
//! session cleans up.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{SESSION, random_root, server, test_config};
use simba_core::{ContendServiceFactory, Error, Locker, MultiLocker};
use simba_test_kit::support::unique_name;
use simba_zookeeper::ZkFactory;

/// Tries per wait.
const TRIES: usize = 25;

async fn factory(connect: &str, root: &str) -> Arc<dyn ContendServiceFactory> {
    Arc::new(
        ZkFactory::connect(test_config(connect, root, SESSION))
            .await
            .expect("connect"),
    )
}

/// `other` takes `name` in one attempt, then lets it go.
async fn taken_at_once(other: &Arc<dyn ContendServiceFactory>, name: &str, what: &str) {
    let locker = Locker::new(other.clone(), name).expect("locker");
    match locker.try_acquire().await {
        Ok(guard) => guard.release().await.expect("release"),
        Err(e) => panic!("{what}: another session could not take the mutex at once: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_acquire_leaves_no_node_behind() {
    let zk = server().await;
    let root = random_root();
    let a = factory(zk.url(), &root).await;
    let b = factory(zk.url(), &root).await;
    let mut timeouts = 0;
    for wait in [0, 5, 50].map(Duration::from_millis) {
        // One name per wait: its parent node exists after the first try, as in a long
        // running service, so the deadline falls on the latch node's create.
        let name = unique_name("give-up");
        for i in 0..TRIES {
            let locker = Locker::new(a.clone(), &name).expect("locker");
            match locker.acquire_timeout(wait).await {
                Ok(guard) => guard.release().await.expect("release"),
                Err(Error::Timeout { .. }) => {
                    timeouts += 1;
                    taken_at_once(&b, &name, &format!("wait {wait:?}, try {i}")).await;
                }
                Err(e) => panic!("wait {wait:?}, try {i}: {e}"),
            }
        }
    }
    // The check means something only if some tries gave up.
    assert!(timeouts > 0, "no acquire gave up; the test checked nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_multi_acquire_leaves_no_node_behind() {
    let zk = server().await;
    let root = random_root();
    let a = factory(zk.url(), &root).await;
    let b = factory(zk.url(), &root).await;
    let mut timeouts = 0;
    let names = [unique_name("multi-a"), unique_name("multi-b")];
    for i in 0..TRIES {
        let multi = MultiLocker::new(a.clone(), names.iter().map(String::as_str)).expect("multi");
        match multi.acquire_timeout(Duration::ZERO).await {
            Ok(guard) => guard.release().await.expect("release"),
            Err(Error::Timeout { .. }) => {
                timeouts += 1;
                for name in &names {
                    taken_at_once(&b, name, &format!("multi try {i}")).await;
                }
            }
            Err(e) => panic!("multi try {i}: {e}"),
        }
    }
    assert!(
        timeouts > 0,
        "no multi acquire gave up; the test checked nothing"
    );
}
