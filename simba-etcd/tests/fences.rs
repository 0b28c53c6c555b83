//! Fences never go back, even when the cluster loses its data: a private etcd whose data
//! directory is emptied starts its revision again at 1, and the next fence must still be
//! greater than every fence given before.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{LEASE, private_server, random_prefix, test_config};
use simba_core::{ContendServiceFactory, Locker};
use simba_etcd::EtcdFactory;
use simba_test_kit::support::unique_name;

/// Acquiring a free mutex: a lease grant, a put and a read.
const ACQUIRE: Duration = Duration::from_secs(10);

async fn fences(factory: Arc<dyn ContendServiceFactory>, mutex: &str, n: usize) -> Vec<u64> {
    let locker = Locker::new(factory, mutex).expect("locker");
    let mut out = Vec::new();
    for _ in 0..n {
        let guard = locker.acquire_timeout(ACQUIRE).await.expect("acquire");
        out.push(guard.fence());
        guard.release().await.expect("release");
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_increase_across_a_wiped_data_directory() {
    let etcd = private_server().await;
    let prefix = random_prefix();
    let m = unique_name("m");
    let before = {
        let f = EtcdFactory::connect(test_config(etcd.url(), &prefix, LEASE))
            .await
            .expect("connect");
        let f: Arc<dyn ContendServiceFactory> = Arc::new(f);
        // Other keys raise the revision as well, as on a shared cluster.
        let noise = fences(f.clone(), &unique_name("noise"), 3).await;
        let before = fences(f.clone(), &m, 3).await;
        assert!(noise.windows(2).all(|w| w[0] < w[1]), "{noise:?}");
        assert!(before.windows(2).all(|w| w[0] < w[1]), "{before:?}");
        before
    };
    etcd.stop().await.expect("stop");
    let data = etcd
        .dir()
        .expect("a private server's directory")
        .join("data");
    std::fs::remove_dir_all(&data).expect("empty the data directory");
    std::fs::create_dir_all(&data).expect("make the data directory again");
    etcd.start()
        .await
        .expect("start on an empty data directory");

    let f = EtcdFactory::connect(test_config(etcd.url(), &prefix, LEASE))
        .await
        .expect("connect after the wipe");
    let after = fences(Arc::new(f), &m, 2).await;
    let last = before.last().copied().unwrap_or(0);
    assert!(
        after.iter().all(|&a| a > last),
        "fences went back after the wipe: before {before:?}, after {after:?}"
    );
    assert!(after[0] < after[1], "{after:?}");
}

/// A cluster restored from an older snapshot holds an older fence key (and a lower
/// revision): the next fence must still be greater than every fence given before. The
/// restore is stood in for by writing an old value to the fence key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_increase_when_the_fence_key_goes_back() {
    let etcd = common::server().await;
    let prefix = random_prefix();
    let m = unique_name("m");
    let f = EtcdFactory::connect(test_config(etcd.url(), &prefix, LEASE))
        .await
        .expect("connect");
    let fence_key = f
        .mutex_prefix(&m)
        .expect("mutex prefix")
        .trim_end_matches('/')
        .to_owned();
    let f: Arc<dyn ContendServiceFactory> = Arc::new(f);
    let before = fences(f.clone(), &m, 3).await;
    let endpoint = format!("http://{}", etcd.socket_addr().expect("address"));
    let mut raw = etcd_client::Client::connect([endpoint], None)
        .await
        .expect("connect a raw client");
    let old = raw
        .get(fence_key.as_str(), None)
        .await
        .expect("read the fence key");
    let kept = old
        .kvs()
        .first()
        .map(|kv| String::from_utf8_lossy(kv.value()).into_owned());
    assert_eq!(
        kept,
        before.last().map(u64::to_string),
        "the fence key holds the last fence"
    );
    raw.put(fence_key.as_str(), "5", None)
        .await
        .expect("put an old fence");
    let after = fences(f, &m, 2).await;
    let last = before.last().copied().unwrap_or(0);
    assert!(
        after.iter().all(|&a| a > last),
        "fences went back after the fence key did: before {before:?}, after {after:?}"
    );
}
