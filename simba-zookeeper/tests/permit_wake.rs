//! A waiter that stops (a paused process whose session lives on) does not hold up the
//! others: the waiters behind it are pushed when a permit frees, and its own place lasts
//! its lease, not its session. Run on the permit store directly, as the engine would drive
//! it: a contender calls `permit_acquire` again when pushed or at its look-again time.
//!
//! A waiter owed a free permit that does not take it within the claim window
//! (`ZkConfig::permit_claim`) loses its place to the waiter behind it; with the window off,
//! its place lasts its lease.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{random_root, server, test_config};
use simba_core::backend::{Lease, LeaseReply, PERMIT_CLAIM_MS, PermitStore};
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

/// A store on a new session of `session` with the claim window `claim`.
async fn store_with(session: Duration, claim: Option<Duration>) -> (ZkFactory, ZkPermitStore) {
    let zk = server().await;
    let config = test_config(zk.url(), &random_root(), session).with_permit_claim(claim);
    let factory = ZkFactory::connect(config).await.expect("connect");
    let store = factory.permit_store();
    assert_eq!(store.claim(), claim);
    (factory, store)
}

/// A store with the default claim window.
async fn store() -> (ZkFactory, ZkPermitStore) {
    let default = Some(Duration::from_millis(PERMIT_CLAIM_MS.unsigned_abs()));
    store_with(SESSION, default).await
}

async fn acquire(store: &ZkPermitStore, s: &str, who: &str) -> LeaseReply {
    acquire_for(store, s, who, LEASE).await
}

async fn acquire_for(store: &ZkPermitStore, s: &str, who: &str, lease: Lease) -> LeaseReply {
    store
        .permit_acquire(s, who, 2, lease)
        .await
        .unwrap_or_else(|e| panic!("{who} acquire: {e}"))
}

/// The holders of `s`, sorted; never more than its 2 permits.
async fn holder_ids(store: &ZkPermitStore, s: &str) -> Vec<String> {
    let holders = store.permit_owners(s).await.expect("read the holders");
    let mut ids: Vec<String> = holders.holders.into_iter().map(|h| h.owner_id).collect();
    ids.sort_unstable();
    assert!(ids.len() <= 2, "more holders than permits: {ids:?}");
    ids
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
    // The claim window off: this is the bound that holds without it (and for a waiter
    // that is not owed a permit) — the silent waiter's place lasts its lease.
    let (_factory, store) = store_with(SESSION, None).await;
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

/// The session of the claim tests: long enough for [`LONG_LEASE`].
const CLAIM_SESSION: Duration = Duration::from_secs(20);

/// 10 s, half [`CLAIM_SESSION`]: a silent waiter's place lasts far longer than
/// [`CLAIMED_WITHIN`], so only the claim window can hand its permit on in time.
const LONG_LEASE: Lease = Lease {
    ttl: Duration::from_secs(6),
    transition: Duration::from_secs(4),
};

/// The claim window of the claim tests.
const CLAIM: Duration = Duration::from_millis(50);

/// How soon after the permit came free the waiter behind a silent owed one holds it: the
/// claim (50 ms) and a few calls, bounded generously for a loaded two-core machine, and
/// still well below the silent waiter's lease (10 s), which bounds it without the claim.
const CLAIMED_WITHIN: Duration = Duration::from_secs(3);

/// A waiter owed a free permit that stays silent loses its place after the claim window:
/// the waiter behind it gets the permit, and the silent one, when it calls again, has
/// joined again at the back (behind a waiter that came after it), never a third holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_owed_waiter_loses_its_place_after_the_claim() {
    let (_factory, store) = store_with(CLAIM_SESSION, Some(CLAIM)).await;
    let s = unique_name("claim");
    let call = |who: &'static str| acquire_for(&store, &s, who, LONG_LEASE);
    let a = call("a").await;
    let b = call("b").await;
    assert!(holds(&a, "a") && holds(&b, "b"), "{a:?} {b:?}");
    // w waits, then is owed a's permit, and never calls again (a paused process).
    assert!(!holds(&call("w").await, "w"));
    let mut x_events = store
        .permit_subscribe(&s, "x")
        .await
        .unwrap()
        .expect("ZooKeeper pushes");
    assert!(!holds(&call("x").await, "x"));
    assert!(!holds(&call("y").await, "y"));
    assert!(store.permit_release(&s, "a").await.unwrap());
    let released = Instant::now();
    // x, behind w, is pushed and looks: w is owed, x is to look again once w's claim ends.
    let pushed = timeout(PUSHED_WITHIN, x_events.recv()).await;
    assert!(
        matches!(pushed, Ok(Some(_))),
        "x was not pushed: {pushed:?}"
    );
    let mut x = call("x").await;
    assert!(!holds(&x, "x"), "x got ahead of w within w's claim: {x:?}");
    let wait = look_again_in(&x);
    assert!(
        wait <= CLAIM,
        "x is to look again in {wait:?}, after w's claim ({CLAIM:?})"
    );
    // As the engine: x looks again when pushed or when asked.
    while !holds(&x, "x") {
        assert!(
            released.elapsed() < CLAIMED_WITHIN,
            "the silent w held up its permit for {:?} (claim {CLAIM:?})",
            released.elapsed()
        );
        let _ = timeout(look_again_in(&x), x_events.recv()).await;
        x = call("x").await;
        assert_eq!(
            holder_ids(&store, &s).await.len(),
            if holds(&x, "x") { 2 } else { 1 }
        );
    }
    assert!(x.owner.fence > a.owner.fence.max(b.owner.fence));
    assert_eq!(holder_ids(&store, &s).await, ["b", "x"]);
    // w comes back: its take fails (no node), it joins again at the back, behind y.
    let w = call("w").await;
    assert!(!holds(&w, "w"), "a third permit: {w:?}");
    assert_eq!(holder_ids(&store, &s).await, ["b", "x"]);
    assert!(store.permit_release(&s, "b").await.unwrap());
    assert!(!holds(&call("w").await, "w"), "w kept its place ahead of y");
    assert!(holds(&call("y").await, "y"), "y was not next");
    assert_eq!(holder_ids(&store, &s).await, ["x", "y"]);
}

/// A waiter owed a permit that takes it within its claim keeps it: the waiter behind it,
/// looking again when the claim ends, finds it a holder and leaves it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owed_waiter_that_takes_in_time_keeps_its_permit() {
    let (_factory, store) = store_with(CLAIM_SESSION, Some(CLAIM)).await;
    let s = unique_name("claim_in_time");
    let call = |who: &'static str| acquire_for(&store, &s, who, LONG_LEASE);
    assert!(holds(&call("a").await, "a"));
    assert!(holds(&call("b").await, "b"));
    assert!(!holds(&call("w").await, "w"));
    assert!(!holds(&call("x").await, "x"));
    assert!(store.permit_release(&s, "a").await.unwrap());
    // x sees w owed and is asked back at the end of w's claim; w takes before that.
    let x = call("x").await;
    assert!(!holds(&x, "x"));
    let w = call("w").await;
    assert!(holds(&w, "w"), "{w:?}");
    // Time is the subject: x looks at and after the end of w's claim, as the engine would.
    sleep(look_again_in(&x)).await;
    // Whenever x looks, w holds and x waits.
    for _ in 0..3 {
        assert!(!holds(&call("x").await, "x"), "x took w's permit");
        sleep(CLAIM).await;
    }
    let renewed = call("w").await;
    assert!(holds(&renewed, "w"), "w lost its permit: {renewed:?}");
    assert_eq!(renewed.owner.fence, w.owner.fence);
    assert_eq!(holder_ids(&store, &s).await, ["b", "w"]);
}

/// A waiter further back (watching only the node just ahead) runs the claim too: its own
/// sighting of the owed waiter, a claim window old, removes it, even though no waiter near
/// the front (here on another session, with sightings of its own) has looked meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_further_back_runs_the_claim_too() {
    let (factory, front) = store_with(CLAIM_SESSION, Some(CLAIM)).await;
    let back = ZkFactory::connect(factory.config().clone())
        .await
        .expect("connect")
        .permit_store();
    let s = unique_name("claim_back");
    let call = |store: &ZkPermitStore, who: &'static str| {
        let (store, s) = (store.clone(), s.clone());
        async move { acquire_for(&store, &s, who, LONG_LEASE).await }
    };
    assert!(holds(&call(&front, "a").await, "a"));
    assert!(holds(&call(&front, "b").await, "b"));
    for who in ["w", "x", "y"] {
        assert!(!holds(&call(&front, who).await, who));
    }
    // z has four live nodes ahead (2 permits): further back.
    let z = call(&back, "z").await;
    assert!(!holds(&z, "z"));
    assert!(front.permit_release(&s, "a").await.unwrap());
    // w is owed a's permit and stays silent; z looks and is asked back when w's claim ends.
    let z = call(&back, "z").await;
    assert!(!holds(&z, "z"));
    let wait = look_again_in(&z);
    assert!(
        wait <= CLAIM,
        "z is to look again in {wait:?}, after w's claim"
    );
    // Time is the subject: z looks again once w's claim has ended, as the engine would
    // (the server stamps the clock of that look after the sleep, past the claim's end).
    sleep(wait).await;
    assert!(!holds(&call(&back, "z").await, "z"));
    // w's node is gone: x, next, takes its permit at once (x's store never saw w owed).
    let x = call(&front, "x").await;
    assert!(holds(&x, "x"), "w still held up its permit: {x:?}");
    assert!(!holds(&call(&front, "w").await, "w"), "w kept its place");
    assert_eq!(holder_ids(&front, &s).await, ["b", "x"]);
}
