//! A give-up leaves nothing owned: after `acquire_timeout` answers `Timeout`, another
//! client takes the mutex at once. The short waits put the deadline while the lease grant
//! or the waiter key's put is in flight; the stop revokes the lease, which deletes a key
//! put with it (and a put that comes after the revoke fails: its lease is gone). The check
//! is the kit's ([`give_ups_leave_nothing`]).

mod common;

use std::sync::Arc;

use common::{LEASE, random_prefix, server, test_config};
use simba_core::ContendServiceFactory;
use simba_etcd::EtcdFactory;
use simba_test_kit::support::{give_ups_leave_nothing, multi_give_ups_leave_nothing};

async fn factory(url: &str, prefix: &str) -> Arc<dyn ContendServiceFactory> {
    Arc::new(
        EtcdFactory::connect(test_config(url, prefix, LEASE))
            .await
            .expect("connect"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_acquire_leaves_no_key_behind() {
    let etcd = server().await;
    let prefix = random_prefix();
    let a = factory(etcd.url(), &prefix).await;
    let b = factory(etcd.url(), &prefix).await;
    let timeouts = give_ups_leave_nothing(&a, &b).await;
    assert!(timeouts > 0, "no acquire gave up; the test checked nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_multi_acquire_leaves_no_key_behind() {
    let etcd = server().await;
    let prefix = random_prefix();
    let a = factory(etcd.url(), &prefix).await;
    let b = factory(etcd.url(), &prefix).await;
    let timeouts = multi_give_ups_leave_nothing(&a, &b).await;
    assert!(
        timeouts > 0,
        "no multi acquire gave up; the test checked nothing"
    );
}
