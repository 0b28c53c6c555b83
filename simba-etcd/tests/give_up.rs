//! A give-up leaves nothing owned: after `acquire_timeout` answers `Timeout`, another
//! client takes the mutex at once. The short waits put the deadline while the lease grant
//! or the waiter key's put is in flight; the stop revokes the lease, which deletes a key
//! put with it (and a put that comes after the revoke fails: its lease is gone).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{LEASE, random_prefix, server, test_config};
use simba_core::{ContendServiceFactory, Error, Locker, MultiLocker};
use simba_etcd::EtcdFactory;
use simba_test_kit::support::unique_name;

/// Tries per wait.
const TRIES: usize = 25;

async fn factory(url: &str, prefix: &str) -> Arc<dyn ContendServiceFactory> {
    Arc::new(
        EtcdFactory::connect(test_config(url, prefix, LEASE))
            .await
            .expect("connect"),
    )
}

/// `other` takes `name` in one attempt, then lets it go.
async fn taken_at_once(other: &Arc<dyn ContendServiceFactory>, name: &str, what: &str) {
    let locker = Locker::new(other.clone(), name).expect("locker");
    match locker.try_acquire().await {
        Ok(guard) => guard.release().await.expect("release"),
        Err(e) => panic!("{what}: another client could not take the mutex at once: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_acquire_leaves_no_key_behind() {
    let etcd = server().await;
    let prefix = random_prefix();
    let a = factory(etcd.url(), &prefix).await;
    let b = factory(etcd.url(), &prefix).await;
    let mut timeouts = 0;
    for wait in [0, 5, 50].map(Duration::from_millis) {
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
    assert!(timeouts > 0, "no acquire gave up; the test checked nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_multi_acquire_leaves_no_key_behind() {
    let etcd = server().await;
    let prefix = random_prefix();
    let a = factory(etcd.url(), &prefix).await;
    let b = factory(etcd.url(), &prefix).await;
    let names = [unique_name("multi-a"), unique_name("multi-b")];
    let mut timeouts = 0;
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
