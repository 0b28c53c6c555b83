//! The semaphore scripts on a real Redis: key layout, the fence rule, the FIFO queue and
//! its wake-ups (the waiters owed a freed permit and the next), leaving without releasing,
//! polling mode.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{cmd, raw, test_config};
use fred::types::Value;
use simba_core::backend::{Lease, LeaseStore, PERMIT_CLAIM_MS, PermitStore, StoreEvent};
use simba_core::{LeaseConfig, Semaphore};
use simba_redis::{RedisStore, WaitMode};
use simba_test_kit::servers::redis;
use simba_test_kit::support::{init_tracing, unique_name};
use tokio::time::{Instant, timeout};

const LEASE: Lease = Lease {
    ttl: Duration::from_secs(4),
    transition: Duration::from_secs(2),
};

fn text(v: Value) -> String {
    v.as_string().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_keys_fences_and_fifo_wakeups() {
    init_tracing();
    let server = redis().await.unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    let store = RedisStore::connect(test_config(server.url(), &prefix))
        .await
        .unwrap();
    let client = raw(server.url()).await;
    let s = "pool";

    let a = store.permit_acquire(s, "a", 1, LEASE).await.unwrap();
    assert!(a.owner.is_owned_by_at("a", a.now));
    // The mutex's fence rule: at least the server's clock in microseconds.
    assert!(a.owner.fence >= u64::try_from(a.now).unwrap() * 1000);
    let holders = format!("{prefix}:{{{s}}}:@@sem");
    assert_eq!(cmd(&client, "ZCARD", &[&holders]).await.as_i64(), Some(1));
    let data = format!("{holders}:data");
    assert_eq!(text(cmd(&client, "HGET", &[&data, "permits"]).await), "1");
    // A semaphore is apart from the mutex of the same name.
    let m = store.acquire(s, "z", LEASE).await.unwrap();
    assert!(m.owner.is_owned_by_at("z", m.now));

    // b, c then d queue; each is told when to look again, and holds nothing.
    for who in ["b", "c", "d"] {
        let r = store.permit_acquire(s, who, 1, LEASE).await.unwrap();
        assert!(r.owner.owner_id.is_empty(), "{who}: {:?}", r.owner);
        assert!(r.owner.transition_at > r.now);
    }
    let mut b = store.permit_subscribe(s, "b").await.unwrap().unwrap();
    let mut c = store.permit_subscribe(s, "c").await.unwrap().unwrap();
    let mut d = store.permit_subscribe(s, "d").await.unwrap().unwrap();
    // A holder's leave is no release.
    store.permit_leave(s, "a").await.unwrap();
    let read = store.permit_owners(s).await.unwrap();
    assert_eq!(read.permits, Some(1));
    assert_eq!(read.holders.len(), 1);
    assert_eq!(read.holders[0].owner_id, "a");
    assert_eq!(read.holders[0].fence, a.owner.fence);

    assert!(store.permit_release(s, "a").await.unwrap());
    assert!(
        !store.permit_release(s, "a").await.unwrap(),
        "released twice"
    );
    // One freed permit: a wake-up for the first in line, owed it, and one for the next
    // (it looks again when b's claim ends); none for d. Bound: a pushed message on
    // loopback, generous for a loaded machine.
    for (who, rx) in [("b", &mut b), ("c", &mut c)] {
        let woken = timeout(Duration::from_secs(5), rx.recv()).await.unwrap();
        assert_eq!(woken, Some(StoreEvent::Released), "{who}");
    }
    assert!(
        timeout(Duration::from_millis(300), d.recv()).await.is_err(),
        "the third waiter was woken for one permit"
    );
    // c cannot barge past b while b's claim runs.
    let r = store.permit_acquire(s, "c", 1, LEASE).await.unwrap();
    assert!(!r.owner.is_owner("c"));
    assert_eq!(r.owner.transition_at, r.now + PERMIT_CLAIM_MS);
    let got = store.permit_acquire(s, "b", 1, LEASE).await.unwrap();
    assert!(got.owner.is_owned_by_at("b", got.now));
    assert!(got.owner.fence > a.owner.fence);
    // A renewal keeps the fence and acquired_at; a guard never takes.
    let again = store.permit_guard(s, "b", 1, LEASE).await.unwrap();
    assert_eq!(
        (again.owner.fence, again.owner.acquired_at),
        (got.owner.fence, got.owner.acquired_at)
    );
    let none = store.permit_guard(s, "c", 1, LEASE).await.unwrap();
    assert!(!none.owner.is_owner("c"));
    // Another count is refused while b holds.
    let e = store.permit_acquire(s, "d", 2, LEASE).await.unwrap_err();
    assert!(
        matches!(
            e,
            simba_core::Error::PermitsMismatch {
                asked: 2,
                existing: 1,
                ..
            }
        ),
        "{e}"
    );
    assert!(store.permit_release(s, "b").await.unwrap());
    assert!(store.permit_release(s, "c").await.is_ok());
    assert!(store.permit_release(s, "d").await.is_ok());
}

/// Without pub/sub, waiters poll (every `waiter_poll`) and a release drops nobody from
/// the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_in_polling_mode() {
    init_tracing();
    let server = redis().await.unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    let config = test_config(server.url(), &prefix).with_wait_mode(WaitMode::Polling);
    let store = RedisStore::connect(config).await.unwrap();
    assert!(store.permit_subscribe("s", "a").await.unwrap().is_none());
    let timing = LeaseConfig {
        waiter_poll: Some(Duration::from_millis(200)),
        ..LeaseConfig::with_lease(Duration::from_secs(20), Duration::from_secs(5))
    };
    let sem = Semaphore::new(store.clone(), timing, "s", 1).unwrap();
    let g = sem.acquire().await.unwrap();
    let waiter = tokio::spawn({
        let sem = sem.clone();
        async move {
            let g = sem.acquire_timeout(Duration::from_secs(20)).await;
            (Instant::now(), g)
        }
    });
    // Not a synchronisation: a waiter that comes after the release finds the permit free.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    g.release().await.unwrap();
    let (at, got) = waiter.await.unwrap();
    let got = got.unwrap();
    // Bound: a 200 ms poll; 5 s allows a loaded machine and still fails a waiter that
    // waits for the released lease (25 s).
    assert!(at.duration_since(released) < Duration::from_secs(5));
    got.release().await.unwrap();
}
