//! The ownership metrics after a scripted scenario on the in-memory store, in paused tokio
//! time (every duration below is exact).
//!
//! Each test installs its own debugging recorder as the *thread-local* default
//! (`metrics::set_default_local_recorder`) and runs on a current-thread runtime, so every
//! task it spawns records into its recorder and nothing of a test running in parallel
//! does: the numbers are exact, not "at least".

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::until;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use simba_core::fault::{Behavior, FaultStore, Op};
use simba_core::metrics as m;
use simba_core::{
    ContendServiceFactory, LeaseConfig, LeaseServiceFactory, LossReason, MemoryStore,
    SilentContender,
};

const TTL: Duration = Duration::from_millis(1000);
const TRANSITION: Duration = Duration::from_millis(500);

/// Every metric recorded so far, by name and labels (`k=v,k=v`, sorted).
#[derive(Debug, Default)]
struct Recorded {
    counters: BTreeMap<(String, String), u64>,
    gauges: BTreeMap<(String, String), f64>,
    histograms: BTreeMap<(String, String), Vec<f64>>,
}

impl Recorded {
    /// Adds what the recorder saw since the last snapshot (a snapshot drains it).
    fn take(&mut self, snapshotter: &Snapshotter) {
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let key = key.key();
            let mut labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            let id = (key.name().to_owned(), labels.join(","));
            match value {
                DebugValue::Counter(n) => *self.counters.entry(id).or_default() += n,
                DebugValue::Gauge(g) => *self.gauges.entry(id).or_default() += g.into_inner(),
                DebugValue::Histogram(v) => self
                    .histograms
                    .entry(id)
                    .or_default()
                    .extend(v.into_iter().map(|f| f.into_inner())),
            }
        }
    }

    fn counter(&self, name: &str, labels: &str) -> u64 {
        self.counters
            .get(&(name.to_owned(), labels.to_owned()))
            .copied()
            .unwrap_or(0)
    }

    fn histogram(&self, name: &str, labels: &str) -> Vec<f64> {
        self.histograms
            .get(&(name.to_owned(), labels.to_owned()))
            .cloned()
            .unwrap_or_default()
    }
}

fn config(mutex_label: bool) -> LeaseConfig {
    LeaseConfig {
        drift_margin: Duration::from_millis(100),
        request_timeout: Duration::from_secs(3),
        retry_interval: Duration::from_millis(100),
        metrics_mutex_label: mutex_label,
        ..LeaseConfig::with_lease(TTL, TRANSITION)
    }
}

/// A hands over to B at 300 ms; B renews, fails one renewal (suspect), recovers, then
/// hangs (suspect again: unanswered) until its local deadline passes (lease expired),
/// acquires again, and stops.
#[tokio::test(start_paused = true)]
async fn lease_engine_scenario_numbers() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let mut seen = Recorded::default();

    let store = FaultStore::new(MemoryStore::new());
    let faults = store.control();
    let factory = LeaseServiceFactory::new(store, config(false)).expect("config");
    let a = factory
        .create_contend_service("metrics-m", Arc::new(SilentContender))
        .expect("a");
    let b = factory
        .create_contend_service("metrics-m", Arc::new(SilentContender))
        .expect("b");
    let (mut sa, mut sb) = (a.status(), b.status());

    a.start().expect("start a");
    until(&mut sa, "a owns", |s| s.held.is_some()).await;
    b.start().expect("start b");
    until(&mut sb, "b's first answer", |s| s.attempts >= 1).await;
    assert!(sb.borrow().held.is_none());

    tokio::time::sleep(Duration::from_millis(300)).await;
    a.stop().await.expect("stop a");
    until(&mut sb, "b owns", |s| s.held.is_some()).await;
    let fence = sb.borrow().held.map(|h| h.fence);

    // One renewal answered.
    let after = sb.borrow().attempts;
    until(&mut sb, "b renews", |s| s.attempts > after).await;
    assert_eq!(sb.borrow().held.map(|h| h.fence), fence);

    // One renewal fails: suspect; the next one passes.
    faults.set(Op::Guard, Behavior::Fail);
    until(&mut sb, "b suspect", |s| s.held.is_some_and(|h| h.suspect)).await;
    faults.set(Op::Guard, Behavior::Pass);
    until(&mut sb, "b no longer suspect", |s| {
        s.held.is_some_and(|h| !h.suspect)
    })
    .await;

    // Renewals hang: suspect while unanswered, then the local deadline ends the ownership;
    // B, still the owner on the store within its lease, acquires again at once.
    faults.set(Op::Guard, Behavior::Hang);
    until(&mut sb, "b suspect again", |s| {
        s.held.is_some_and(|h| h.suspect)
    })
    .await;
    until(&mut sb, "b's lease expired", |s| {
        s.last_loss
            .is_some_and(|l| l.reason == LossReason::LeaseExpired)
    })
    .await;
    until(&mut sb, "b owns again", |s| s.held.is_some()).await;
    b.stop().await.expect("stop b");

    seen.take(&snapshotter);
    let be = "backend=memory";
    assert_eq!(seen.counter(m::ACQUISITIONS, be), 3, "{seen:#?}");
    assert_eq!(
        seen.counter(m::LOSSES, "backend=memory,reason=released"),
        2,
        "{seen:#?}"
    );
    assert_eq!(
        seen.counter(m::LOSSES, "backend=memory,reason=lease_expired"),
        1
    );
    assert_eq!(
        seen.counter(m::LOSSES, "backend=memory,reason=taken_over"),
        0
    );
    assert_eq!(
        seen.counter(m::SUSPECT, be),
        2,
        "a failed and a hanging renewal"
    );
    assert_eq!(
        seen.counter(m::BACKEND_ERRORS, "backend=memory,kind=retryable"),
        1
    );
    assert_eq!(
        seen.gauges.get(&(m::HELD.to_owned(), be.to_owned())),
        Some(&0.0)
    );

    // A at once; B after 300 ms of waiting; B again right after its loss (its next attempt
    // goes out at once; tokio rounds a timer up to the next millisecond at most).
    let waits = seen.histogram(m::ACQUIRE_WAIT, be);
    assert_eq!(waits.len(), 3, "{waits:?}");
    assert_eq!(&waits[..2], &[0.0, 0.3]);
    assert!(waits[2] <= 0.001, "{waits:?}");
    // Only B's first acquisition followed a pushed release; it went out at once.
    assert_eq!(seen.histogram(m::HANDOFF_WAIT, be), vec![0.0]);
    // Two answered renewals (the first, and the one after the failure); paused time, so
    // each took no time. The hanging one never answered.
    assert_eq!(seen.histogram(m::RENEWAL, be), vec![0.0, 0.0]);
    // No metric names the mutex by default.
    let all = seen
        .counters
        .keys()
        .chain(seen.gauges.keys())
        .chain(seen.histograms.keys());
    for (name, labels) in all {
        assert!(!labels.contains("mutex="), "{name} {labels}");
    }
}

/// With `metrics_mutex_label`, every metric names the mutex; a stop whose release times
/// out is a backend error of kind `timeout`.
#[tokio::test(start_paused = true)]
async fn mutex_label_and_timeout_kind() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let mut seen = Recorded::default();

    let store = FaultStore::new(MemoryStore::new());
    let faults = store.control();
    let factory = LeaseServiceFactory::new(store, config(true)).expect("config");
    let a = factory
        .create_contend_service("labelled", Arc::new(SilentContender))
        .expect("a");
    let mut sa = a.status();
    a.start().expect("start");
    until(&mut sa, "a owns", |s| s.held.is_some()).await;
    faults.set(Op::Release, Behavior::Hang);
    a.stop().await.expect("stop");

    seen.take(&snapshotter);
    let labels = "backend=memory,mutex=labelled";
    assert_eq!(seen.counter(m::ACQUISITIONS, labels), 1, "{seen:#?}");
    assert_eq!(
        seen.counter(m::LOSSES, "backend=memory,mutex=labelled,reason=released"),
        1
    );
    assert_eq!(
        seen.counter(
            m::BACKEND_ERRORS,
            "backend=memory,kind=timeout,mutex=labelled"
        ),
        1
    );
    assert_eq!(seen.histogram(m::ACQUIRE_WAIT, labels), vec![0.0]);
    assert_eq!(
        seen.gauges.get(&(m::HELD.to_owned(), labels.to_owned())),
        Some(&0.0)
    );
}

/// `describe` gives the metrics help texts and units in the installed recorder.
#[test]
fn describe_registers_help_texts() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        m::describe();
        metrics::counter!(m::ACQUISITIONS, "backend" => "memory").increment(1);
    });
    let snap = snapshotter.snapshot().into_vec();
    let (_, unit, help, _) = snap
        .iter()
        .find(|(k, ..)| k.key().name() == m::ACQUISITIONS)
        .expect("recorded");
    assert_eq!(*unit, Some(metrics::Unit::Count));
    assert_eq!(help.as_deref(), Some("ownerships acquired"));
}
