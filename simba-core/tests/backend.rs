//! The engine parts a session backend builds on: the ownership tracker's ordering rules
//! (the `ContendService` contract) and the service runner's start / stop / drop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use simba_core::backend::{Reporter, ServiceRunner, ServiceStatus};
use simba_core::{
    Contender, ContenderStatus, Error, LossReason, MutexOwner, MutexRetriever, MutexState,
};
use tokio::sync::watch;
use tokio::time::Instant;

fn owner(id: &str, fence: u64) -> MutexOwner {
    MutexOwner {
        owner_id: id.to_owned(),
        acquired_at: 1_000,
        ttl_at: 2_000,
        transition_at: 3_000,
        fence,
    }
}

/// Records each callback with the status the callback could see at that moment.
struct Probe {
    status: Mutex<Option<watch::Receiver<ContenderStatus>>>,
    log: Mutex<Vec<(String, ContenderStatus)>>,
}

impl Probe {
    fn new() -> Arc<Probe> {
        Arc::new(Probe {
            status: Mutex::new(None),
            log: Mutex::new(Vec::new()),
        })
    }
    fn record(&self, what: String) {
        let seen = self
            .status
            .lock()
            .expect("probe")
            .as_ref()
            .map(|rx| rx.borrow().clone())
            .unwrap_or_default();
        self.log.lock().expect("probe").push((what, seen));
    }
    fn log(&self) -> Vec<(String, ContenderStatus)> {
        self.log.lock().expect("probe").clone()
    }
}

impl Contender for Probe {
    fn on_acquired(&self, s: &MutexState) {
        self.record(format!("acquired {}", s.after.fence));
    }
    fn on_released(&self, s: &MutexState, reason: LossReason) {
        self.record(format!("released {} {reason:?}", s.before.fence));
    }
}

impl MutexRetriever for Probe {
    fn on_changed(&self, s: &MutexState) {
        self.record(format!("changed {}", s.after.owner_id));
    }
}

fn contending() -> (Arc<Probe>, ServiceStatus) {
    let probe = Probe::new();
    let out = ServiceStatus::new(Reporter::Contender(probe.clone()));
    *probe.status.lock().expect("probe") = Some(out.status());
    (probe, out)
}

#[tokio::test(start_paused = true)]
async fn callbacks_run_before_the_status_shows_them() {
    let (probe, out) = contending();
    let mut t = out.begin();
    let deadline = Instant::now() + Duration::from_secs(1);
    assert!(t.hold(owner("me", 7), Some(deadline)), "a new ownership");
    let st = out.current();
    assert_eq!(st.held.map(|h| (h.fence, h.suspect)), Some((7, false)));
    assert_eq!(st.deadline, Some(deadline));
    assert_eq!(st.state.after.fence, 7);
    t.lose(LossReason::TakenOver, owner("other", 8));
    let st = out.current();
    assert!(st.held.is_none() && st.deadline.is_none());
    assert_eq!(
        st.last_loss.map(|l| (l.fence, l.reason)),
        Some((7, LossReason::TakenOver))
    );
    assert_eq!(st.state.after.owner_id, "other");
    let log = probe.log();
    assert_eq!(log.len(), 2, "{log:?}");
    assert_eq!(log[0].0, "acquired 7");
    assert!(
        log[0].1.held.is_none(),
        "on_acquired ran before held was published"
    );
    assert_eq!(log[1].0, "released 7 TakenOver");
    assert!(
        log[1].1.held.is_some() && log[1].1.last_loss.is_none(),
        "on_released ran before the loss was published"
    );
}

#[tokio::test(start_paused = true)]
async fn attempts_follow_effects_and_begin_resets_a_run() {
    let (_probe, out) = contending();
    let mut rx = out.status();
    let mut t = out.begin();
    assert!(rx.has_changed().expect("open"), "begin publishes running");
    let st = rx.borrow_and_update().clone();
    assert!(st.running && st.attempts == 0);
    t.hold(owner("me", 3), None);
    t.count_attempt(None);
    // The update that counts the attempt comes after the one that says held.
    let st = rx.borrow_and_update().clone();
    assert_eq!((st.attempts, st.held.map(|h| h.fence)), (1, Some(3)));
    t.count_attempt(Some("boom".into()));
    assert_eq!(out.current().last_error.as_deref(), Some("boom"));
    t.finish();
    let st = out.current();
    assert!(!st.running && st.held.is_none());
    assert_eq!(st.last_loss.map(|l| l.reason), Some(LossReason::Released));
    // A new run starts clean but remembers the last loss and owner change.
    let _t = out.begin();
    let st = out.current();
    assert!(st.running && st.attempts == 0 && st.last_error.is_none() && st.held.is_none());
    assert_eq!(st.last_loss.map(|l| l.fence), Some(3));
}

#[tokio::test(start_paused = true)]
async fn another_fence_while_owning_reports_the_unseen_loss_first() {
    let (probe, out) = contending();
    let mut t = out.begin();
    assert!(t.hold(owner("me", 1), None));
    assert!(!t.hold(owner("me", 1), None), "same fence: a renewal");
    assert!(t.hold(owner("me", 2), None), "new fence: a new ownership");
    let names: Vec<String> = probe.log().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        ["acquired 1", "released 1 LeaseExpired", "acquired 2"]
    );
}

#[tokio::test(start_paused = true)]
async fn suspect_is_marked_once_and_cleared_by_a_confirmation() {
    let (_probe, out) = contending();
    let mut t = out.begin();
    assert!(
        !t.mark_suspect(&"no answer"),
        "nothing owned: nothing suspect"
    );
    t.hold(owner("me", 4), None);
    assert!(t.mark_suspect(&"no answer"));
    assert!(!t.mark_suspect(&"no answer"), "already suspect");
    assert_eq!(out.current().held.map(|h| h.suspect), Some(true));
    t.hold(owner("me", 4), None);
    assert_eq!(out.current().held.map(|h| h.suspect), Some(false));
}

#[tokio::test(start_paused = true)]
async fn set_deadline_moves_only_a_held_ownership() {
    let (_probe, out) = contending();
    let mut t = out.begin();
    let later = Instant::now() + Duration::from_secs(5);
    t.set_deadline(Some(later));
    assert_eq!(out.current().deadline, None, "not owned");
    t.hold(owner("me", 4), Some(Instant::now()));
    t.set_deadline(Some(later));
    assert_eq!(out.current().deadline, Some(later));
}

#[tokio::test(start_paused = true)]
async fn dropping_a_tracker_ends_the_run_without_a_callback() {
    let (probe, out) = contending();
    let mut t = out.begin();
    t.hold(owner("me", 9), None);
    drop(t);
    let st = out.current();
    assert!(!st.running && st.held.is_none());
    assert_eq!(probe.log().len(), 1, "only on_acquired");
}

#[tokio::test(start_paused = true)]
async fn a_retriever_hears_changes_before_the_state_shows_them() {
    let probe = Probe::new();
    let out = ServiceStatus::new(Reporter::Retriever(probe.clone()));
    *probe.status.lock().expect("probe") = Some(out.status());
    let state = out.owner_state();
    let mut t = out.begin();
    assert!(t.observe(owner("a", 1)).is_changed());
    let mut renewed = owner("a", 1);
    renewed.ttl_at = 9_000;
    assert!(
        !t.observe(renewed).is_changed(),
        "a renewal is not a change"
    );
    assert_eq!(state.borrow().after.ttl_at, 9_000, "but its times are kept");
    t.observe(owner("b", 2));
    let log = probe.log();
    let names: Vec<&str> = log.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["changed a", "changed b"]);
    assert_eq!(
        log[1].1.state.after.owner_id, "a",
        "status showed b only after"
    );
    assert!(!out.contends());
}

/// The owner-state channel is made when first asked for: it starts from what was seen
/// before, renewals refresh its times, later changes reach it, and a clone of the status
/// (the driver's) writes to the same channel.
#[tokio::test(start_paused = true)]
async fn an_owner_state_asked_for_late_starts_from_the_last_change() {
    let out = ServiceStatus::new(Reporter::Retriever(Probe::new()));
    let mut t = out.clone().begin();
    t.observe(owner("a", 1));
    let mut renewed = owner("a", 1);
    renewed.ttl_at = 9_000;
    t.observe(renewed);
    assert_eq!(out.current_owner().after.ttl_at, 9_000);
    let mut state = out.owner_state();
    assert_eq!(state.borrow_and_update().after.owner_id, "a");
    assert_eq!(state.borrow().after.ttl_at, 9_000);
    let mut renewed = owner("a", 1);
    renewed.ttl_at = 10_000;
    t.observe(renewed);
    assert!(
        !state.has_changed().expect("open"),
        "a renewal notifies nobody"
    );
    assert_eq!(
        state.borrow().after.ttl_at,
        10_000,
        "but its times are kept"
    );
    t.observe(owner("b", 2));
    assert!(state.has_changed().expect("open"));
    let seen = state.borrow_and_update().clone();
    assert_eq!(
        (seen.before.owner_id.as_str(), seen.after.owner_id.as_str()),
        ("a", "b")
    );
    let mut second = out.owner_state();
    assert_eq!(second.borrow_and_update().after.owner_id, "b");
    t.observe(owner("c", 3));
    assert!(state.has_changed().expect("open") && second.has_changed().expect("open"));
    assert_eq!(out.current_owner().after.owner_id, "c");
}

#[tokio::test]
async fn runner_starts_once_stops_and_restarts() {
    let runner = ServiceRunner::new();
    let finished = Arc::new(AtomicBool::new(false));
    let f = finished.clone();
    runner
        .start("test service", move |stop| async move {
            stop.cancelled().await;
            f.store(true, Ordering::SeqCst);
        })
        .expect("start");
    let again = runner.start("test service", |_| async {});
    assert!(
        matches!(&again, Err(Error::InvalidState(m)) if m.contains("test service is already running")),
        "{again:?}"
    );
    runner.stop().await.expect("stop");
    assert!(finished.load(Ordering::SeqCst), "stop waits for the driver");
    assert!(!runner.is_running());
    runner.stop().await.expect("stopping twice is fine");
    runner
        .start("test service", |stop| async move { stop.cancelled().await })
        .expect("restart");
    assert!(runner.is_running());
}

#[tokio::test]
async fn dropping_a_runner_or_its_stop_future_still_stops_the_driver() {
    let (tx, rx) = tokio::sync::oneshot::channel();
    {
        let runner = ServiceRunner::new();
        runner
            .start("dropped", move |stop| async move {
                stop.cancelled().await;
                let _ = tx.send(());
            })
            .expect("start");
    }
    tokio::time::timeout(Duration::from_secs(10), rx)
        .await
        .expect("the driver ends after its runner is dropped")
        .expect("sent");
    let runner = ServiceRunner::new();
    let (tx, rx) = tokio::sync::oneshot::channel();
    runner
        .start("stopped", move |stop| async move {
            stop.cancelled().await;
            let _ = tx.send(());
        })
        .expect("start");
    drop(runner.stop());
    tokio::time::timeout(Duration::from_secs(10), rx)
        .await
        .expect("a dropped stop future has still signalled the stop")
        .expect("sent");
}

#[test]
fn runner_needs_a_runtime() {
    let err = ServiceRunner::new()
        .start("outside", |_| async {})
        .expect_err("no runtime");
    assert!(matches!(err, Error::InvalidState(_)), "{err}");
}
