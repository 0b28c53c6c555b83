//! Redis Sentinel: the store finds the primary through a sentinel.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use common::{cmd, lease, random_prefix, raw, test_config, wait_status};
use simba_core::{ContendService, Lease, LeaseServiceFactory, LeaseStore, SilentContender};
use simba_redis::RedisStore;
use simba_test_kit::servers::redis_private;
use tokio::time::Instant;

/// A sentinel process (`redis-server --sentinel`) watching one primary; killed on drop.
struct Sentinel {
    _child: tokio::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

async fn start_sentinel(primary_port: u16) -> Sentinel {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap();
    let conf = dir.path().join("sentinel.conf");
    let text = format!(
        "port {port}\nbind 127.0.0.1\ndir {}\n\
         sentinel monitor simba-primary 127.0.0.1 {primary_port} 1\n\
         sentinel down-after-milliseconds simba-primary 10000\n",
        dir.path().display()
    );
    tokio::fs::write(&conf, text).await.unwrap();
    let child = tokio::process::Command::new("redis-server")
        .arg(&conf)
        .arg("--sentinel")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("starting redis-server --sentinel: {e}"));
    let sentinel = Sentinel {
        _child: child,
        port,
        _dir: dir,
    };
    // Wait until the sentinel answers with the primary's address (no event to await).
    let t0 = Instant::now();
    loop {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            let r = raw(&format!("redis://127.0.0.1:{port}")).await;
            let addr = cmd(
                &r,
                "SENTINEL",
                &["get-master-addr-by-name", "simba-primary"],
            )
            .await;
            if let fred::types::Value::Array(v) = addr
                && v.len() == 2
            {
                break;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "sentinel never became ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sentinel
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_finds_the_primary() {
    common::init_tracing();
    let primary = redis_private().await.unwrap_or_else(|e| panic!("{e}"));
    let sentinel = start_sentinel(primary.port()).await;
    let url = format!(
        "redis-sentinel://127.0.0.1:{}?sentinelServiceName=simba-primary",
        sentinel.port
    );
    let prefix = random_prefix();
    let store = RedisStore::connect(test_config(&url, &prefix))
        .await
        .unwrap();
    let lease_of = Lease {
        ttl: Duration::from_secs(2),
        transition: Duration::from_secs(1),
    };
    let a = store.acquire("s", "a", lease_of).await.unwrap();
    assert_eq!(a.owner.owner_id, "a");
    // The key is on the primary the sentinel names.
    let direct = raw(primary.url()).await;
    let value = cmd(&direct, "GET", &[&store.owner_key("s")]).await;
    assert_eq!(value.as_string().as_deref(), Some("a"));
    assert!(store.release("s", "a").await.unwrap());

    // Pub/sub handoff through the sentinel-found primary.
    let timing = lease(5000, 2000);
    let o = LeaseServiceFactory::new(store, timing.clone())
        .unwrap()
        .contend_service("s", Arc::new(SilentContender))
        .unwrap();
    let w = LeaseServiceFactory::new(
        RedisStore::connect(test_config(&url, &prefix))
            .await
            .unwrap(),
        timing,
    )
    .unwrap()
    .contend_service("s", Arc::new(SilentContender))
    .unwrap();
    o.start().unwrap();
    wait_status(&o, "owner", Duration::from_secs(5), |s| s.held.is_some()).await;
    w.start().unwrap();
    wait_status(&w, "waiter", Duration::from_secs(5), |s| s.attempts > 0).await;
    o.stop().await.unwrap();
    // A poll would come ~7 s later; 1.5 s shows the push.
    wait_status(&w, "handoff", Duration::from_millis(1500), |s| {
        s.held.is_some()
    })
    .await;
    w.stop().await.unwrap();
}
