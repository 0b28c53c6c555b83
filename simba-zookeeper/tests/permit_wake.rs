//! A waiter that stops (a paused process whose session lives on) does not hold up the
//! others: the waiters behind it are pushed when a permit frees, and its own place lasts
//! its lease, not its session. Run on the permit store directly, as the engine would drive
//! it: a contender calls `permit_acquire` again when pushed or at its look-again time.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{random_root, server, test_config};
use simba_core::backend::{Lease, LeaseReply, PermitStore};
use simba_test_kit::support::unique_name;
use simba_zookeeper::{ZkFactory, ZkPermitStore};
use tokio::time::{Instant, sleep, timeout};

/// Long enough that no session ends during a test: the silent waiter's node lives on.
const SESSION: Duration = Duration::from_secs(10);

/// 1.5 s in all, within half the session.
const LEASE: Lease = Lease {
    ttl: Duration::from_millis(1000),
    transition: Duration::from_millis(500),
};

/// A push comes within milliseconds; 5 s covers a loaded two-core machine and is still far
/// below the session (10 s), the only bound a waiter behind a silent one had before.
const PUSHED_WITHIN: Duration = Duration::from_secs(5);

async fn store() -> (ZkFactory, ZkPermitStore) {
    let zk = server().await;
    let factory = ZkFactory::connect(test_config(zk.url(), &random_root(), SESSION))
        .await
        .expect("connect");
    let store = factory.permit_store();
    (factory, store)
}

async fn acquire(store: &ZkPermitStore, s: &str, who: &str) -> LeaseReply {
    store
        .permit_acquire(s, who, 2, LEASE)
        .await
        .unwrap_or_else(|e| panic!("{who} acquire: {e}"))
}

fn holds(reply: &LeaseReply, who: &str) -> bool {
    reply.owner.owner_id == who
}

/// How long after `reply` the store asks to be looked at again.
fn look_again_in(reply: &LeaseReply) -> Duration {
    let ms = reply.owner.transition_at.saturating_sub(reply.now).max(0);
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_waiter_holds_up_nobody_past_its_lease() {
    let (_factory, store) = store().await;
    let s = unique_name("silent");
    let a = acquire(&store, &s, "a").await;
    let b = acquire(&store, &s, "b").await;
    assert!(holds(&a, "a") && holds(&b, "b"), "{a:?} {b:?}");
    // w waits once and is never heard of again (its session lives on).
    let w = acquire(&store, &s, "w").await;
    assert!(!holds(&w, "w"));
    let silent_since = Instant::now();
    let mut x_events = store
        .permit_subscribe(&s, "x")
        .await
        .unwrap()
        .expect("ZooKeeper pushes");
    assert!(!holds(&acquire(&store, &s, "x").await, "x"));
    assert!(!holds(&acquire(&store, &s, "y").await, "y"));
    // a's permit is w's turn; b's is x's.
    assert!(store.permit_release(&s, "a").await.unwrap());
    assert!(store.permit_release(&s, "b").await.unwrap());
    let released = Instant::now();
    // x is pushed, looks again, and holds (a push for a's release, when w became first,
    // may come first: x then looks again and waits for the next one).
    let x = loop {
        let pushed = timeout(PUSHED_WITHIN, x_events.recv()).await;
        assert!(
            matches!(pushed, Ok(Some(_))),
            "x was not pushed within {PUSHED_WITHIN:?} of the free permit (w, ahead of it, \
             is silent)"
        );
        let x = acquire(&store, &s, "x").await;
        if holds(&x, "x") {
            break x;
        }
        assert!(
            released.elapsed() < PUSHED_WITHIN,
            "x still waits {:?} after both releases",
            released.elapsed()
        );
    };
    assert!(x.owner.fence > b.owner.fence.max(a.owner.fence));
    // y is behind w, whose place lasts its lease from its last write: y looks again when
    // asked (the first time no later than w's lease end), and gets w's permit then.
    let mut y = acquire(&store, &s, "y").await;
    assert!(!holds(&y, "y"), "w's place was kept while its lease lasted");
    let wait = look_again_in(&y);
    assert!(
        wait <= LEASE.total(),
        "y is to look again in {wait:?}, later than w's lease ({:?})",
        LEASE.total()
    );
    // Bound: w's lease (1.5 s) after its last write, plus calls on a loaded machine.
    let bound = LEASE.total() + Duration::from_secs(3);
    while !holds(&y, "y") {
        assert!(
            silent_since.elapsed() < bound,
            "w held up y for {:?}",
            silent_since.elapsed()
        );
        sleep(look_again_in(&y)).await;
        // x renews meanwhile, as a holder does (its lease is as short as w's).
        assert!(holds(&acquire(&store, &s, "x").await, "x"));
        y = acquire(&store, &s, "y").await;
    }
    assert!(y.owner.fence > x.owner.fence);
    // w comes back: it lost its place, and finds both permits held.
    let w = acquire(&store, &s, "w").await;
    assert!(!holds(&w, "w"), "a third permit: {w:?}");
    let holders = store.permit_owners(&s).await.unwrap();
    let mut ids: Vec<&str> = holders
        .holders
        .iter()
        .map(|h| h.owner_id.as_str())
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, ["x", "y"]);
}

/// A waiter that keeps looking again when asked keeps its place past its lease: a later
/// contender does not get ahead of it, and it gets the next free permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_waiter_keeps_its_place_past_its_lease() {
    let (_factory, store) = store().await;
    let s = unique_name("keep");
    let a = acquire(&store, &s, "a").await;
    let b = acquire(&store, &s, "b").await;
    assert!(holds(&a, "a") && holds(&b, "b"));
    let mut v = acquire(&store, &s, "v").await;
    assert!(!holds(&v, "v"));
    // Two leases of waiting: the holders renew every 300 ms, v looks again when asked.
    let until = Instant::now() + LEASE.total() * 2;
    let mut v_at = Instant::now() + look_again_in(&v);
    while Instant::now() < until {
        sleep(Duration::from_millis(300)).await;
        assert!(holds(&acquire(&store, &s, "a").await, "a"));
        assert!(holds(&acquire(&store, &s, "b").await, "b"));
        if Instant::now() >= v_at {
            v = acquire(&store, &s, "v").await;
            assert!(!holds(&v, "v"));
            let wait = look_again_in(&v);
            // It is asked back well before its place could lapse (half its ttl after its
            // last write, which came a few milliseconds after the reply's clock).
            assert!(wait < LEASE.ttl, "{wait:?}");
            v_at = Instant::now() + wait;
        }
    }
    assert!(!holds(&acquire(&store, &s, "u").await, "u"));
    assert!(store.permit_release(&s, "b").await.unwrap());
    assert!(
        !holds(&acquire(&store, &s, "u").await, "u"),
        "u got ahead of v"
    );
    // v's node was written as a waiter before: the write that made it a holder is its
    // fence, above every earlier permit's, and its renewals keep it.
    let v = acquire(&store, &s, "v").await;
    assert!(holds(&v, "v"), "{v:?}");
    assert!(v.owner.fence > a.owner.fence.max(b.owner.fence), "{v:?}");
    let renewed = acquire(&store, &s, "v").await;
    assert!(holds(&renewed, "v"));
    assert_eq!(renewed.owner.fence, v.owner.fence);
    assert_eq!(renewed.owner.acquired_at, v.owner.acquired_at);
}
