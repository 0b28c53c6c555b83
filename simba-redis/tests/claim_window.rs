//! The claim window of a semaphore waiter (simba-core's `admit_permit`, issue #50), on a
//! single server and on a 3-primary Cluster: a waiter owed a free permit that stays silent
//! (subscribed, so every wake-up reaches it, but it never calls again: a stopped process)
//! holds the permit up for `PERMIT_CLAIM_MS` only; then the waiter behind it takes it. The
//! silent one keeps its place: when it finally calls, it is first again.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{cmd, raw, test_config};
use simba_core::backend::{Lease, LeaseReply, PERMIT_CLAIM_MS, PermitStore, StoreEvent};
use simba_core::events::EventReceiver;
use simba_redis::RedisStore;
use simba_test_kit::servers::{redis, redis_cluster};
use simba_test_kit::support::{init_tracing, unique_name};
use tokio::time::{Instant, timeout};

/// Long enough that no holder or waiter expires during the test: a waiter that had to wait
/// for the silent one's place to end (lease + 2 s) fails the bounds below.
const LEASE: Lease = Lease {
    ttl: Duration::from_secs(20),
    transition: Duration::from_secs(5),
};

/// A pushed message on loopback, generous for a loaded machine.
const PUSH: Duration = Duration::from_secs(5);

fn holds(reply: &LeaseReply, who: &str) -> bool {
    reply.owner.is_owned_by_at(who, reply.now)
}

async fn woken(rx: &mut EventReceiver, who: &str) {
    match timeout(PUSH, rx.recv()).await {
        Ok(Some(StoreEvent::Released)) => {}
        other => panic!("{who} was not woken: {other:?}"),
    }
}

/// Calls as a live waiter does until `who` takes a permit, each time at the time it was
/// told to look again (time is the subject here: the claim of the waiter ahead has to
/// end); returns the taking reply and the replies it waited on. Panics after 3 s: the
/// claim is `PERMIT_CLAIM_MS` (25 ms), the silent waiter's place 27 s.
async fn take_as_a_live_waiter(
    store: &RedisStore,
    s: &str,
    who: &str,
) -> (LeaseReply, Vec<LeaseReply>) {
    let t0 = Instant::now();
    let mut waits = Vec::new();
    loop {
        let r = store.permit_acquire(s, who, 1, LEASE).await.unwrap();
        if holds(&r, who) {
            return (r, waits);
        }
        assert!(r.owner.owner_id.is_empty(), "{who}: {:?}", r.owner);
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "{who} did not get the permit the silent waiter left: {} waits, the first {:?}, \
             the last {r:?}",
            waits.len() + 1,
            waits.first()
        );
        let look = u64::try_from(r.owner.transition_at - r.now).unwrap_or(0);
        waits.push(r);
        tokio::time::sleep(Duration::from_millis(look.clamp(1, 250))).await;
    }
}

/// The test on `url`; `inspect`: a raw client on a single server, to read the claims key.
async fn silent_owed_waiter_is_passed_over(url: &str, inspect: bool) {
    let prefix = unique_name("t");
    let store = RedisStore::connect(test_config(url, &prefix))
        .await
        .unwrap();
    assert_eq!(
        store.permit_claim(),
        Some(Duration::from_millis(PERMIT_CLAIM_MS.unsigned_abs()))
    );
    let s = "claim";
    let claims = format!("{prefix}:{{{s}}}:@@sem:claims");
    let client = if inspect { Some(raw(url).await) } else { None };

    // `a` holds the one permit; the silent `p`, then `w` and `x`, queue behind it.
    let a = store.permit_acquire(s, "a", 1, LEASE).await.unwrap();
    assert!(holds(&a, "a"));
    let mut rx = Vec::new();
    for who in ["p", "w", "x"] {
        rx.push(store.permit_subscribe(s, who).await.unwrap().unwrap());
    }
    for who in ["p", "w", "x"] {
        let r = store.permit_acquire(s, who, 1, LEASE).await.unwrap();
        assert!(!holds(&r, who), "{who} took a held permit");
    }

    // The release wakes the waiter owed the permit (`p`) and the next (`w`), not `x`.
    assert!(store.permit_release(s, "a").await.unwrap());
    woken(&mut rx[0], "p").await;
    woken(&mut rx[1], "w").await;
    assert!(
        timeout(Duration::from_millis(300), rx[2].recv())
            .await
            .is_err(),
        "x, behind the owed waiter and the next, was woken"
    );

    // `w` calls: the permit is owed to `p`, whose claim starts now; `w` is told to look
    // again when it ends.
    let first = store.permit_acquire(s, "w", 1, LEASE).await.unwrap();
    assert!(!holds(&first, "w"), "w jumped ahead of p");
    let claim_by = first.now + PERMIT_CLAIM_MS;
    assert_eq!(first.owner.transition_at, claim_by, "{first:?}");
    if let Some(c) = &client {
        let score = cmd(c, "ZSCORE", &[&claims, "p"]).await;
        assert_eq!(score.as_i64(), Some(claim_by), "p's claim on the server");
        let pttl = cmd(c, "PTTL", &[&claims]).await.as_i64().unwrap_or(-3);
        assert!(pttl > 0, "the claims key has no expiry: {pttl}");
    }

    // `p` stays silent; once its claim has ended, `w` takes the permit.
    let (took, waits) = take_as_a_live_waiter(&store, s, "w").await;
    assert!(
        took.now >= claim_by,
        "w took at {} before p's claim ended at {claim_by}",
        took.now
    );
    tracing::info!(waits = waits.len() + 1, "w took after p's claim");

    // `x` queues again; `p` finally calls (w holds: it waits, and counts again at its place).
    let r = store.permit_acquire(s, "x", 1, LEASE).await.unwrap();
    assert!(!holds(&r, "x"));
    let r = store.permit_acquire(s, "p", 1, LEASE).await.unwrap();
    assert!(!holds(&r, "p"));
    if let Some(c) = &client {
        let score = cmd(c, "ZSCORE", &[&claims, "p"]).await;
        assert!(score.is_null(), "p called, yet its claim stays: {score:?}");
    }
    // `w` releases: `p` is first again, ahead of `x`, though `x` calls first.
    assert!(store.permit_release(s, "w").await.unwrap());
    let r = store.permit_acquire(s, "x", 1, LEASE).await.unwrap();
    assert!(!holds(&r, "x"), "x took the permit owed to p");
    let r = store.permit_acquire(s, "p", 1, LEASE).await.unwrap();
    assert!(holds(&r, "p"), "p was not first again: {r:?}");
    if let Some(c) = &client {
        // A waiter that takes leaves no claim behind.
        let score = cmd(c, "ZSCORE", &[&claims, "p"]).await;
        assert!(score.is_null(), "p took, yet its claim stays: {score:?}");
    }
    assert!(store.permit_release(s, "p").await.unwrap());
    for who in ["x", "w"] {
        store.permit_release(s, who).await.unwrap();
    }
    if let Some(c) = &client {
        let left = cmd(c, "ZCARD", &[&claims]).await.as_i64();
        assert_eq!(left, Some(0), "claims left behind");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_owed_waiter_is_passed_over_after_its_claim() {
    init_tracing();
    let server = redis().await.unwrap_or_else(|e| panic!("{e}"));
    silent_owed_waiter_is_passed_over(server.url(), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_owed_waiter_is_passed_over_after_its_claim_on_the_cluster() {
    init_tracing();
    let cluster = redis_cluster(3).await.unwrap_or_else(|e| panic!("{e}"));
    silent_owed_waiter_is_passed_over(&cluster.cluster_url(), false).await;
}

/// A holder's renewal, by `permit_acquire` or `permit_guard`, starts the claim of a waiter
/// owed a free permit, as every decision but a mismatch does (`Admission::claims`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_starts_the_claim_of_an_owed_waiter() {
    init_tracing();
    let server = redis().await.unwrap_or_else(|e| panic!("{e}"));
    let prefix = unique_name("t");
    let store = RedisStore::connect(test_config(server.url(), &prefix))
        .await
        .unwrap();
    let client = raw(server.url()).await;
    let s = "renew";
    let claims = format!("{prefix}:{{{s}}}:@@sem:claims");
    for who in ["a", "b"] {
        assert!(holds(
            &store.permit_acquire(s, who, 2, LEASE).await.unwrap(),
            who
        ));
    }
    // Subscribed, or a release drops them from the queue as gone.
    let _w_events = store.permit_subscribe(s, "w").await.unwrap().unwrap();
    let _y_events = store.permit_subscribe(s, "y").await.unwrap().unwrap();
    let w = store.permit_acquire(s, "w", 2, LEASE).await.unwrap();
    assert!(!holds(&w, "w"));
    // Full: nobody is owed a permit, no claim.
    let r = store.permit_guard(s, "a", 2, LEASE).await.unwrap();
    assert!(holds(&r, "a"));
    assert!(cmd(&client, "ZSCORE", &[&claims, "w"]).await.is_null());
    // b's release frees a permit owed to w (the release starts no claim); a's renewal by
    // guard starts w's claim.
    assert!(store.permit_release(s, "b").await.unwrap());
    assert!(cmd(&client, "ZSCORE", &[&claims, "w"]).await.is_null());
    let r = store.permit_guard(s, "a", 2, LEASE).await.unwrap();
    assert!(holds(&r, "a"));
    let started = cmd(&client, "ZSCORE", &[&claims, "w"]).await.as_i64();
    assert_eq!(started, Some(r.now + PERMIT_CLAIM_MS), "by guard");
    // w takes, and its claim goes with it.
    assert!(holds(
        &store.permit_acquire(s, "w", 2, LEASE).await.unwrap(),
        "w"
    ));
    assert!(cmd(&client, "ZSCORE", &[&claims, "w"]).await.is_null());
    // The same by a renewal through permit_acquire.
    assert!(store.permit_release(s, "w").await.unwrap());
    let x = store.permit_acquire(s, "x", 2, LEASE).await.unwrap();
    assert!(holds(&x, "x"));
    let y = store.permit_acquire(s, "y", 2, LEASE).await.unwrap();
    assert!(!holds(&y, "y"));
    assert!(store.permit_release(s, "x").await.unwrap());
    let r = store.permit_acquire(s, "a", 2, LEASE).await.unwrap();
    assert!(holds(&r, "a"));
    let started = cmd(&client, "ZSCORE", &[&claims, "y"]).await.as_i64();
    assert_eq!(started, Some(r.now + PERMIT_CLAIM_MS), "by acquire");
    for who in ["a", "y"] {
        store.permit_release(s, who).await.unwrap();
    }
}
