//! ZooKeeper reports the same ownership metrics as the lease engine (they come from the
//! shared `OwnershipTracker`), against the kit's real server.
//!
//! The debugging recorder is this test's thread-local default and the runtime is
//! current-thread, so every service task records into it and no other test does.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::{random_root, server, test_config};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use simba_core::metrics as m;
use simba_core::{ContendServiceFactory, LossReason, SilentContender};
use simba_test_kit::support::expect_status;
use simba_zookeeper::ZkFactory;

/// Generous for a loaded 2-core machine: only turns a hang into a failure.
const BOUND: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "current_thread")]
async fn acquisitions_and_losses_are_counted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);

    let server = server().await;
    let root = random_root();
    let session = Duration::from_secs(4);
    let f1 = ZkFactory::connect(test_config(server.url(), &root, session))
        .await
        .expect("factory 1");
    let f2 = ZkFactory::connect(
        test_config(server.url(), &root, session).with_metrics_mutex_label(true),
    )
    .await
    .expect("factory 2");
    let a = f1
        .create_contend_service("zk-metrics", Arc::new(SilentContender))
        .expect("a");
    let b = f2
        .create_contend_service("zk-metrics", Arc::new(SilentContender))
        .expect("b");

    a.start().expect("start a");
    expect_status(a.as_ref(), "a owns", BOUND, |s| s.held.is_some()).await;
    b.start().expect("start b");
    expect_status(b.as_ref(), "b waits", BOUND, |s| s.attempts >= 1).await;
    a.stop().await.expect("stop a");
    expect_status(b.as_ref(), "b owns", BOUND, |s| s.held.is_some()).await;
    // The session ends under the owner: a loss of reason session_lost.
    f2.close().await.expect("close b's session");
    expect_status(b.as_ref(), "b lost", BOUND, |s| {
        s.last_loss
            .is_some_and(|l| l.reason == LossReason::SessionLost)
    })
    .await;
    b.stop().await.expect("stop b");

    let mut counters = BTreeMap::new();
    let mut gauges = BTreeMap::new();
    let mut histograms = BTreeMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let mut labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        let id = format!("{}{{{}}}", key.name(), labels.join(","));
        match value {
            DebugValue::Counter(n) => {
                counters.insert(id, n);
            }
            DebugValue::Gauge(g) => {
                gauges.insert(id, g.into_inner());
            }
            DebugValue::Histogram(v) => {
                histograms.insert(id, v.len());
            }
        }
    }
    let get = |k: &str| counters.get(k).copied().unwrap_or(0);
    let all = format!("{counters:#?} {gauges:#?} {histograms:#?}");
    // A (no mutex label) acquired and released; B (mutex label on) acquired and lost its
    // session.
    assert_eq!(
        get("simba_acquisitions_total{backend=zookeeper}"),
        1,
        "{all}"
    );
    assert_eq!(
        get("simba_acquisitions_total{backend=zookeeper,mutex=zk-metrics}"),
        1,
        "{all}"
    );
    assert_eq!(
        get("simba_losses_total{backend=zookeeper,reason=released}"),
        1,
        "{all}"
    );
    assert_eq!(
        get("simba_losses_total{backend=zookeeper,mutex=zk-metrics,reason=session_lost}"),
        1,
        "{all}"
    );
    assert_eq!(
        get("simba_losses_total{backend=zookeeper,mutex=zk-metrics,reason=released}"),
        0,
        "{all}"
    );
    assert_eq!(
        gauges.get("simba_held{backend=zookeeper}"),
        Some(&0.0),
        "{all}"
    );
    assert_eq!(
        gauges.get("simba_held{backend=zookeeper,mutex=zk-metrics}"),
        Some(&0.0),
        "{all}"
    );
    // B's acquisition followed the watch on A's node: one handoff wait.
    assert_eq!(
        histograms.get("simba_handoff_wait_seconds{backend=zookeeper,mutex=zk-metrics}"),
        Some(&1),
        "{all}"
    );
    assert_eq!(
        histograms.get("simba_handoff_wait_seconds{backend=zookeeper}"),
        None,
        "{all}"
    );
    // ZooKeeper has no renewals: the session keeps the ownership.
    assert!(
        !histograms.keys().any(|k| k.starts_with(m::RENEWAL)),
        "{all}"
    );
}
