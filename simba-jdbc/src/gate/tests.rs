//! The wait queue's own tests, on `sqlite::memory:`'s local locks.

use super::*;

fn owner(gates: &Gates, mutex: &str) -> Option<String> {
    gates.existing(mutex).and_then(|g| g.lock().owner.clone())
}

fn queued(gates: &Gates) -> usize {
    gates.expiries.lock().due.len()
}

/// The gates of a store with local locks (SQLite's), statement timeout 5 s.
fn local_gates() -> Arc<Gates> {
    Arc::new(Gates::new(
        Kind::Local,
        "db\ntable".to_owned(),
        Duration::from_secs(5),
    ))
}

/// Lets the expiry task run on the paused clock.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

/// The ownerships of a store end from one queue: at their own ends (a renewal moves
/// one), a sooner end queued while the task sleeps is served on time, a release takes
/// its entry out, and the task ends with the queue.
#[tokio::test(start_paused = true)]
async fn ownerships_expire_from_one_queue() {
    let gates = local_gates();
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    gates.record("late", "a", true, t0 + ms(10_000), false);
    settle().await;
    // The task sleeps until 10 s; a sooner end wakes it.
    for i in 0..100u64 {
        gates.record(&format!("m{i}"), "a", true, t0 + ms(100 + i), false);
    }
    // A renewal moves m0's end; an earlier end than the one queued changes nothing.
    gates.record("m0", "a", true, t0 + ms(5_000), false);
    gates.record("m1", "a", true, t0 + ms(50), false);
    assert_eq!(queued(&gates), 101);
    tokio::time::sleep_until(t0 + ms(99)).await;
    settle().await;
    assert_eq!(owner(&gates, "m1").as_deref(), Some("a"), "ended too early");
    tokio::time::sleep_until(t0 + ms(200)).await;
    settle().await;
    for i in 1..100 {
        assert_eq!(owner(&gates, &format!("m{i}")), None, "m{i} did not end");
    }
    assert_eq!(
        owner(&gates, "m0").as_deref(),
        Some("a"),
        "the renewal was lost"
    );
    assert_eq!(queued(&gates), 2);
    // A lost row and a release take their entries out at once.
    gates.record("m0", "a", false, t0 + ms(6_000), false);
    assert_eq!(owner(&gates, "m0"), None);
    gates.done("late", "a", false).await;
    assert_eq!(queued(&gates), 0);
    tokio::time::sleep_until(t0 + ms(20_000)).await;
    settle().await;
    assert!(
        !gates.expiries.lock().running,
        "the task outlived its queue"
    );
    // And starts again with the next ownership.
    gates.record("again", "b", true, Instant::now() + ms(10), false);
    tokio::time::sleep(ms(20)).await;
    settle().await;
    assert_eq!(owner(&gates, "again"), None);
}

/// An ownership whose end comes while a call of its owner is in flight keeps the native
/// lock for the owner, as a grant (see `Gates::expire`).
#[tokio::test(start_paused = true)]
async fn an_end_during_a_call_keeps_the_lock_as_a_grant() {
    let gates = local_gates();
    gates.record(
        "m",
        "a",
        true,
        Instant::now() + Duration::from_millis(10),
        false,
    );
    let gate = gates.existing("m").expect("gate");
    gate.lock().held = Some(Held::Local);
    gates.calling("m", "a");
    tokio::time::sleep(Duration::from_millis(20)).await;
    settle().await;
    let s = gate.lock();
    assert_eq!(s.owner, None);
    assert_eq!(s.granted.as_deref(), Some("a"));
    assert!(
        s.held.is_some(),
        "the lock was let go under a call in flight"
    );
}

/// An acquisition answered after its contender released (a re-acquisition in flight while
/// the release ran) records nothing: the next contender here gets the lock, not a wait for
/// a stale ownership's end.
#[tokio::test]
async fn an_answer_after_the_release_leaves_no_owner() {
    let gates = local_gates();
    let until = Instant::now() + Duration::from_secs(10);
    // A subscriber keeps the gate in use across the release (as a process's contenders do).
    let _events = gates.subscribe("m", "observer");
    assert!(matches!(gates.enter("m", "a").await, Pass::Locked(_)));
    assert!(gates.outcome("m", "a", true, until));
    gates.done("m", "a", false).await;
    assert!(
        !gates.outcome("m", "a", true, until),
        "a stale answer was recorded"
    );
    assert_eq!(owner(&gates, "m"), None);
    assert!(
        matches!(gates.enter("m", "b").await, Pass::Locked(_)),
        "the next contender waits for a released ownership"
    );
}
