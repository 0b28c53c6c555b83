//! Fault tests on a real ZooKeeper: connection cuts, partitions longer than the session
//! timeout, a server restart, digest ACLs across reconnects, unreachable servers.
//!
//! Waits are on status changes, never fixed sleeps, except where the length of an outage
//! is the subject. Bounds are generous (the machine may be loaded by other tests); each
//! says what it is derived from.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{SESSION, private_server, proxied, random_root, server, test_config};
use simba_core::{
    ContendService, Error, Locker, LossReason, RetrievalService, SilentContender, SilentRetriever,
    generate_contender_id,
};
use simba_test_kit::history::History;
use simba_test_kit::proxy::FaultProxy;
use simba_test_kit::support::{expect_status, init_tracing, unique_name};
use simba_zookeeper::{ZkConfig, ZkFactory};
use tokio::time::Instant;
use zookeeper_async::{ZkError, ZooKeeper};

/// A handoff pushed by a watch takes a few round trips; 1.5 s leaves room for a loaded
/// machine while staying far below any session timeout used here.
const HANDOFF: Duration = Duration::from_millis(1500);

/// Acquiring a free mutex: a few round trips (create the path, the node, list).
const ACQUIRE: Duration = Duration::from_secs(5);

async fn raw_client(connect: &str) -> ZooKeeper {
    tokio::time::timeout(
        Duration::from_secs(10),
        ZooKeeper::connect(connect, Duration::from_secs(10), |_e| {}),
    )
    .await
    .expect("raw client connects in time")
    .expect("raw client connects")
}

fn assert_zk_backend_error(e: &Error) {
    assert!(
        matches!(
            e,
            Error::Backend {
                backend: "zookeeper",
                retryable: true,
                ..
            }
        ),
        "expected a retryable zookeeper backend error, got {e:?}"
    );
}

/// zookeeper-async's `connect` never returns while the server is unreachable: the
/// factory bounds the whole set-up with the connect timeout and says what happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_gives_a_typed_error_in_time() {
    init_tracing();
    let connect_timeout = Duration::from_millis(800);
    // The margin covers scheduling and closing a half-made client (bounded to 2 s).
    let bound = connect_timeout + Duration::from_secs(3);

    // Nothing listens on port 1: every TCP connect is refused.
    let t0 = Instant::now();
    let r = ZkFactory::connect(ZkConfig::new("127.0.0.1:1").with_connect_timeout(connect_timeout))
        .await;
    let took = t0.elapsed();
    let e = r.expect_err("nothing listens on 127.0.0.1:1");
    assert_zk_backend_error(&e);
    assert!(e.to_string().contains("within the connect timeout"), "{e}");
    assert!(took >= connect_timeout && took < bound, "took {took:?}");

    // A server that accepts TCP and then never answers (a hung server, a partition).
    let zk = server().await;
    let proxy = FaultProxy::start(zk.socket_addr().expect("address"))
        .await
        .expect("proxy");
    proxy.blackhole(true);
    let t0 = Instant::now();
    let r = ZkFactory::connect(
        ZkConfig::new(zk.url_via(proxy.addr())).with_connect_timeout(connect_timeout),
    )
    .await;
    let took = t0.elapsed();
    let e = r.expect_err("a blackholed server cannot establish a session");
    assert_zk_backend_error(&e);
    assert!(e.to_string().contains("no session was established"), "{e}");
    assert!(took >= connect_timeout && took < bound, "took {took:?}");

    // A server that accepts and closes every connection at once.
    proxy.heal();
    proxy.refuse(true);
    let t0 = Instant::now();
    let r = ZkFactory::connect(
        ZkConfig::new(zk.url_via(proxy.addr())).with_connect_timeout(connect_timeout),
    )
    .await;
    let took = t0.elapsed();
    assert_zk_backend_error(&r.expect_err("refused"));
    assert!(took < bound, "took {took:?}");

    // Bad settings fail at once, before any network traffic.
    let t0 = Instant::now();
    let r = ZkFactory::connect(
        ZkConfig::new("127.0.0.1:1").with_session_timeout(Duration::from_millis(1000)),
    )
    .await;
    assert!(
        matches!(
            r,
            Err(Error::InvalidConfig {
                field: "session_timeout",
                ..
            })
        ),
        "{r:?}"
    );
    assert!(t0.elapsed() < Duration::from_millis(100));

    // A healed proxy works again with the same settings.
    proxy.refuse(false);
    let f = ZkFactory::connect(
        ZkConfig::new(zk.url_via(proxy.addr())).with_connect_timeout(Duration::from_secs(10)),
    )
    .await
    .expect("connect once healed");
    assert!(f.is_connected());
    f.close().await.expect("close");
}

/// The server caps session timeouts (the kit's at 60 s): the factory learns the granted
/// value and bases the owner's deadline on it, not on the larger one it asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lowered_session_timeout_is_used() {
    let zk = server().await;
    let f = ZkFactory::connect(test_config(
        zk.url(),
        &random_root(),
        Duration::from_secs(90),
    ))
    .await
    .expect("connect");
    assert_eq!(f.session_timeout(), Duration::from_secs(60));
    f.close().await.expect("close");
    let f = ZkFactory::connect(test_config(zk.url(), &random_root(), SESSION))
        .await
        .expect("connect");
    assert_eq!(f.session_timeout(), SESSION);
    f.close().await.expect("close");
}

/// Connection cuts shorter than the session timeout: the client reconnects to the same
/// session, the owner keeps its ownership (same fence), and nobody else owns meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_cuts_keep_the_ownership() {
    let zk = server().await;
    let root = random_root();
    let m = unique_name("m");
    let history = History::new();
    // 4 s: a reconnect through the proxy (a 250 ms pause, the handshake, a confirming
    // write) fits well inside the owner's deadline (>= 1.4 s after the cut: half of 4 s -
    // 200 ms margin - 400 ms probe interval).
    let session = Duration::from_secs(4);
    let (fa, proxy) = proxied(&zk, |c| test_config(c, &root, session)).await;
    let fb = ZkFactory::connect(test_config(zk.url(), &root, session))
        .await
        .expect("connect");
    let a = fa
        .contend_service(&m, history.contender(generate_contender_id()))
        .expect("service");
    let b = fb
        .contend_service(&m, history.contender(generate_contender_id()))
        .expect("service");
    a.start().expect("start");
    let st = expect_status(&a, "a acquires", ACQUIRE, |s| s.held.is_some()).await;
    let fence = st.held.expect("held").fence;
    b.start().expect("start");
    expect_status(&b, "b waits", ACQUIRE, |s| s.attempts > 0).await;

    for round in 0..5 {
        let before = a.status().borrow().attempts;
        proxy.cut();
        // The reconnect makes `a` check again (re-list, re-watch): wait for that check.
        let st = expect_status(&a, "a checks after the cut", session * 2, |s| {
            s.attempts > before && s.last_error.is_none()
        })
        .await;
        assert_eq!(
            st.held.map(|h| (h.fence, h.suspect)),
            Some((fence, false)),
            "round {round}: ownership not kept across a short cut: {st:?}"
        );
        assert!(!b.is_owner(), "round {round}: the waiter owns");
    }
    assert_eq!(fa.session_expirations(), 0, "the session survived the cuts");

    // The cuts lost no watch: the waiter takes over at once on release.
    a.stop().await.expect("stop");
    expect_status(&b, "handoff after the cuts", HANDOFF, |s| s.held.is_some()).await;
    b.stop().await.expect("stop");
    let v = history.violations();
    assert!(v.is_empty(), "{v:?}");
}

/// A waiter's watch does not survive a reconnect in zookeeper-async; the service sets it
/// again, so a release still reaches the waiter at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_watch_is_restored_after_a_reconnect() {
    let zk = server().await;
    let root = random_root();
    let m = unique_name("m");
    let fa = ZkFactory::connect(test_config(zk.url(), &root, SESSION))
        .await
        .expect("connect");
    let (fb, proxy) = proxied(&zk, |c| test_config(c, &root, SESSION)).await;
    let a = fa
        .contend_service(&m, Arc::new(SilentContender))
        .expect("service");
    let b = fb
        .contend_service(&m, Arc::new(SilentContender))
        .expect("service");
    a.start().expect("start");
    expect_status(&a, "a acquires", ACQUIRE, |s| s.held.is_some()).await;
    b.start().expect("start");
    expect_status(&b, "b waits", ACQUIRE, |s| s.attempts > 0).await;
    for _ in 0..3 {
        let before = b.status().borrow().attempts;
        proxy.cut();
        expect_status(&b, "b checks again after the cut", SESSION * 2, |s| {
            s.attempts > before && s.last_error.is_none()
        })
        .await;
    }
    let t0 = Instant::now();
    a.stop().await.expect("stop");
    expect_status(&b, "handoff to a reconnected waiter", HANDOFF, |s| {
        s.held.is_some()
    })
    .await;
    tracing::info!(took = ?t0.elapsed(), "handoff after reconnects");
    b.stop().await.expect("stop");
}

/// An outage shorter than the session timeout: the owner is suspect while disconnected
/// and continues, with the same fence, once reconnected (its node still exists).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_is_suspect_while_disconnected_and_continues() {
    let zk = server().await;
    let root = random_root();
    let m = unique_name("m");
    // 8 s: an outage of 1.5 s stays well inside the owner's deadline (>= 2.4 s after the
    // outage begins: half of 8 s - 200 ms margin - 800 ms probe interval - 600 ms for a
    // slow answer to the last probe).
    let session = Duration::from_secs(8);
    let (fa, proxy) = proxied(&zk, |c| test_config(c, &root, session)).await;
    let fb = ZkFactory::connect(test_config(zk.url(), &root, session))
        .await
        .expect("connect");
    let history = History::new();
    let a = fa
        .contend_service(&m, history.contender(generate_contender_id()))
        .expect("service");
    let b = fb
        .contend_service(&m, history.contender(generate_contender_id()))
        .expect("service");
    a.start().expect("start");
    let fence = expect_status(&a, "a acquires", ACQUIRE, |s| s.held.is_some())
        .await
        .held
        .expect("held")
        .fence;
    b.start().expect("start");
    expect_status(&b, "b waits", ACQUIRE, |s| s.attempts > 0).await;

    // Cut the connection and refuse new ones: the client sees the loss at once.
    proxy.refuse(true);
    proxy.cut();
    let st = expect_status(&a, "a becomes suspect", Duration::from_secs(1), |s| {
        s.held.is_some_and(|h| h.suspect)
    })
    .await;
    assert_eq!(st.held.map(|h| h.fence), Some(fence));
    assert!(!fa.is_connected());
    // The outage's length is the subject here.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(a.is_owner(), "the owner gave up before its deadline");
    proxy.refuse(false);
    let st = expect_status(&a, "a is no longer suspect", session, |s| {
        s.held.is_none_or(|h| !h.suspect)
    })
    .await;
    assert_eq!(
        st.held.map(|h| (h.fence, h.suspect)),
        Some((fence, false)),
        "ownership did not continue: {st:?}"
    );
    assert!(!b.is_owner());
    assert_eq!(fa.session_expirations(), 0);
    a.stop().await.expect("stop");
    expect_status(&b, "handoff", HANDOFF, |s| s.held.is_some()).await;
    b.stop().await.expect("stop");
    let v = history.violations();
    assert!(v.is_empty(), "{v:?}");
}

/// A partition longer than the session timeout: the old owner reports the loss before
/// anyone else owns (checked on monotonic timestamps), a new owner is elected, and after
/// the partition heals the old owner's factory notices that its session expired, opens
/// a new one and contends again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_partition_loses_before_anyone_else_owns() {
    let zk = server().await;
    let root = random_root();
    let m = unique_name("m");
    let history = History::new();
    let (fa, proxy) = proxied(&zk, |c| test_config(c, &root, SESSION)).await;
    let fb = ZkFactory::connect(test_config(zk.url(), &root, SESSION))
        .await
        .expect("connect");
    let id_a = generate_contender_id();
    let id_b = generate_contender_id();
    let a = fa
        .contend_service(&m, history.contender(&id_a))
        .expect("service");
    let b = fb
        .contend_service(&m, history.contender(&id_b))
        .expect("service");
    let retriever = fb
        .retrieval_service(&m, Arc::new(SilentRetriever))
        .expect("retriever");
    retriever.start().expect("start");
    a.start().expect("start");
    let fence_a = expect_status(&a, "a acquires", ACQUIRE, |s| s.held.is_some())
        .await
        .held
        .expect("held")
        .fence;
    b.start().expect("start");
    expect_status(&b, "b waits", ACQUIRE, |s| s.attempts > 0).await;

    proxy.blackhole(true);
    let t0 = Instant::now();
    // The owner gives up by its deadline: last answered request + session - margin.
    let st = expect_status(
        &a,
        "a reports the loss",
        SESSION + Duration::from_millis(500),
        |s| s.held.is_none(),
    )
    .await;
    let lost_after = t0.elapsed();
    let reason = st.last_loss.expect("a loss").reason;
    assert!(
        matches!(reason, LossReason::LeaseExpired | LossReason::SessionLost),
        "{reason:?}"
    );
    // The server expires a's session after the session timeout (and a tick); then b's
    // watch on a's node fires.
    let st = expect_status(&b, "b takes over", SESSION + Duration::from_secs(2), |s| {
        s.held.is_some()
    })
    .await;
    let fence_b = st.held.expect("held").fence;
    assert!(
        fence_b > fence_a,
        "fences must increase: {fence_a} then {fence_b}"
    );
    tracing::info!(?lost_after, took_over_after = ?t0.elapsed(), "partition");
    let mut seen = retriever.state();
    tokio::time::timeout(HANDOFF, seen.wait_for(|s| s.after.owner_id == id_b))
        .await
        .expect("the retriever sees b")
        .expect("retriever channel");

    // Heal: the client reconnects, learns that its session expired (NotConnected), and
    // silently opens a new one. The factory notices, and `a` contends again.
    proxy.heal();
    let mut view = a.status();
    tokio::time::timeout(Duration::from_secs(10), async {
        while fa.session_expirations() == 0 || !fa.is_connected() {
            // Status changes are the only signal a test can await here; each check of `a`
            // (counted in `attempts`) follows a session change.
            let _ = tokio::time::timeout(Duration::from_millis(200), view.changed()).await;
        }
    })
    .await
    .expect("the expired session is noticed and replaced");
    let before = a.status().borrow().attempts;
    expect_status(&a, "a contends in the new session", SESSION * 2, |s| {
        s.attempts > before && s.last_error.is_none()
    })
    .await;
    assert!(!a.is_owner() && b.is_owner());
    b.stop().await.expect("stop");
    let st = expect_status(&a, "a owns again after b stops", HANDOFF, |s| {
        s.held.is_some()
    })
    .await;
    assert!(st.held.expect("held").fence > fence_b);
    a.stop().await.expect("stop");
    retriever.stop().await.expect("stop");
    // Every callback has run by now: a's first ownership ended before b's began.
    let iv = history.intervals();
    let a_end = iv
        .iter()
        .find(|i| i.contender == id_a)
        .and_then(|i| i.end)
        .expect("a's interval ended");
    let b_start = iv
        .iter()
        .find(|i| i.contender == id_b)
        .map(|i| i.start)
        .expect("b's interval began");
    assert!(a_end <= b_start, "a still owned when b began: {iv:?}");
    let v = history.violations();
    assert!(v.is_empty(), "{v:?}");
}

/// A server restart shorter than the session timeout: the session survives (ZooKeeper
/// persists sessions), the owner continues with its fence, the waiter's watch is set
/// again and the handoff still happens at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_keeps_the_session_and_ownership() {
    let zk = private_server().await;
    let root = random_root();
    let m = unique_name("m");
    // Long enough to cover a JVM restart (typically 1-3 s here).
    let session = Duration::from_secs(15);
    let fa = ZkFactory::connect(test_config(zk.url(), &root, session))
        .await
        .expect("connect");
    let fb = ZkFactory::connect(test_config(zk.url(), &root, session))
        .await
        .expect("connect");
    let history = History::new();
    let a = fa
        .contend_service(&m, history.contender(generate_contender_id()))
        .expect("service");
    let b = fb
        .contend_service(&m, history.contender(generate_contender_id()))
        .expect("service");
    a.start().expect("start");
    let fence = expect_status(&a, "a acquires", ACQUIRE, |s| s.held.is_some())
        .await
        .held
        .expect("held")
        .fence;
    b.start().expect("start");
    expect_status(&b, "b waits", ACQUIRE, |s| s.attempts > 0).await;

    let before = a.status().borrow().attempts;
    let before_b = b.status().borrow().attempts;
    let t0 = Instant::now();
    zk.restart().await.expect("restart the server");
    let restart_took = t0.elapsed();
    // The stop closed every connection: `a` checks again once the session is back, and
    // finds its node still the lowest.
    let st = expect_status(&a, "a continues after the restart", session, |s| {
        s.attempts > before && s.last_error.is_none() && s.held.is_some_and(|h| !h.suspect)
    })
    .await;
    tracing::info!(?restart_took, "server restart");
    assert_eq!(
        st.held.map(|h| h.fence),
        Some(fence),
        "ownership changed: {st:?}"
    );
    assert!(!b.is_owner());
    assert_eq!(fa.session_expirations(), 0);
    expect_status(&b, "b checks after the restart", session, |s| {
        s.attempts > before_b && s.last_error.is_none()
    })
    .await;
    a.stop().await.expect("stop");
    expect_status(&b, "handoff after the restart", HANDOFF, |s| {
        s.held.is_some()
    })
    .await;
    b.stop().await.expect("stop");
    let v = history.violations();
    assert!(v.is_empty(), "{v:?}");
}

/// Nodes get a digest ACL; after a reconnect (which drops zookeeper-async's auth) the
/// session authenticates again, so the owner can still read, watch and delete them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn digest_acl_nodes_stay_usable_after_a_reconnect() {
    let zk = server().await;
    let root = random_root();
    let m = unique_name("m");
    // Long enough for the owner to ride out a reconnect (see short_cuts_keep_the_ownership).
    let session = Duration::from_secs(4);
    let secured = |c: &str| test_config(c, &root, session).with_digest("simba", "s3cret");
    let (fa, proxy) = proxied(&zk, secured).await;
    let fb = ZkFactory::connect(secured(zk.url()))
        .await
        .expect("connect");
    let a = fa
        .contend_service(&m, Arc::new(SilentContender))
        .expect("service");
    let b = fb
        .contend_service(&m, Arc::new(SilentContender))
        .expect("service");
    a.start().expect("start");
    let fence = expect_status(&a, "a acquires", ACQUIRE, |s| s.held.is_some())
        .await
        .held
        .expect("held")
        .fence;
    b.start().expect("start");
    expect_status(&b, "b waits", ACQUIRE, |s| s.attempts > 0).await;

    // Without credentials the mutex node cannot even be listed.
    let path = fa.mutex_path(&m).expect("path");
    let raw = raw_client(zk.url()).await;
    assert_eq!(
        raw.get_children(&path, false).await,
        Err(ZkError::NoAuth),
        "the mutex node must not be readable without credentials"
    );

    // Wrong credentials: every check fails with NoAuth, and nothing is owned.
    let wrong =
        ZkFactory::connect(test_config(zk.url(), &root, SESSION).with_digest("simba", "wrong"))
            .await
            .expect("connect");
    let locker = Locker::new(Arc::new(wrong.clone()), &m).expect("locker");
    let r = locker.try_acquire().await;
    match r {
        Err(Error::Backend { message, .. }) => {
            assert!(message.contains("NoAuth"), "{message}")
        }
        other => panic!("expected a NoAuth backend error, got {other:?}"),
    }
    wrong.close().await.expect("close");

    for _ in 0..3 {
        let before = a.status().borrow().attempts;
        proxy.cut();
        let st = expect_status(&a, "a checks again after the cut", session * 2, |s| {
            s.attempts > before
        })
        .await;
        assert_eq!(st.last_error, None, "the check after the reconnect failed");
        assert_eq!(st.held.map(|h| (h.fence, h.suspect)), Some((fence, false)));
    }
    // Deleting the node needs the credentials too: the handoff shows it worked.
    a.stop().await.expect("stop");
    expect_status(&b, "handoff", HANDOFF, |s| s.held.is_some()).await;
    b.stop().await.expect("stop");
    raw.close().await.expect("close");
}

/// Dropping a zookeeper-async client does not end its session; closing the factory
/// does, so the mutex is free at once, not after the session timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_factory_frees_the_mutex_at_once() {
    let zk = server().await;
    let root = random_root();
    let m = unique_name("m");
    let session = Duration::from_secs(20);
    let fa = ZkFactory::connect(test_config(zk.url(), &root, session))
        .await
        .expect("connect");
    let fb = ZkFactory::connect(test_config(zk.url(), &root, session))
        .await
        .expect("connect");
    let a = fa
        .contend_service(&m, Arc::new(SilentContender))
        .expect("service");
    let b = fb
        .contend_service(&m, Arc::new(SilentContender))
        .expect("service");
    a.start().expect("start");
    expect_status(&a, "a acquires", ACQUIRE, |s| s.held.is_some()).await;
    b.start().expect("start");
    expect_status(&b, "b waits", ACQUIRE, |s| s.attempts > 0).await;
    fa.close().await.expect("close");
    let st = expect_status(&a, "a learns the session is gone", HANDOFF, |s| {
        s.held.is_none()
    })
    .await;
    assert_eq!(
        st.last_loss.map(|l| l.reason),
        Some(LossReason::SessionLost)
    );
    expect_status(&b, "b owns at once", HANDOFF, |s| s.held.is_some()).await;
    a.stop().await.expect("stop");
    b.stop().await.expect("stop");

    // Dropping the last handle closes the session in the background as well: the server
    // counts one connection less (polling the server's count is the only way to see it).
    let fc = ZkFactory::connect(test_config(zk.url(), &root, session))
        .await
        .expect("connect");
    let svc = fc
        .contend_service(&m, Arc::new(SilentContender))
        .expect("service");
    let with_fc = common::connection_count(&zk).await;
    drop(fc);
    drop(svc);
    let t0 = Instant::now();
    while common::connection_count(&zk).await >= with_fc {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the dropped factory's connection is still open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A service stopped while disconnected cannot delete its node; the session deletes it
/// as soon as it is connected again, so the mutex is not blocked until the session ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_left_by_a_stop_while_disconnected_is_deleted_on_reconnect() {
    let zk = server().await;
    let root = random_root();
    let m = unique_name("m");
    // Long, so that only the clean-up (not an expiry) can free the mutex in time.
    let session = Duration::from_secs(20);
    let (fa, proxy) = proxied(&zk, |c| test_config(c, &root, session)).await;
    let fb = ZkFactory::connect(test_config(zk.url(), &root, session))
        .await
        .expect("connect");
    let a = fa
        .contend_service(&m, Arc::new(SilentContender))
        .expect("service");
    let b = fb
        .contend_service(&m, Arc::new(SilentContender))
        .expect("service");
    a.start().expect("start");
    expect_status(&a, "a acquires", ACQUIRE, |s| s.held.is_some()).await;
    b.start().expect("start");
    expect_status(&b, "b waits", ACQUIRE, |s| s.attempts > 0).await;
    proxy.refuse(true);
    proxy.cut();
    expect_status(&a, "a becomes suspect", Duration::from_secs(1), |s| {
        s.held.is_some_and(|h| h.suspect)
    })
    .await;
    let t0 = Instant::now();
    a.stop().await.expect("stop");
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "stop hung while disconnected"
    );
    let st = a.status().borrow().clone();
    assert_eq!(st.last_loss.map(|l| l.reason), Some(LossReason::Released));
    assert!(!b.is_owner(), "the node is still there");
    proxy.refuse(false);
    expect_status(
        &b,
        "b owns once a's session is back",
        Duration::from_secs(5),
        |s| s.held.is_some(),
    )
    .await;
    assert_eq!(fa.session_expirations(), 0);
    b.stop().await.expect("stop");
}

/// A chroot in the connect string is created if missing and prefixes every path; mutex
/// names with `/` stay one node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chroot_and_odd_names() {
    let zk = server().await;
    let chroot = format!("{}/nested", random_root());
    let connect = format!("{}{chroot}", zk.url());
    let f = ZkFactory::connect(test_config(&connect, "/locks", SESSION))
        .await
        .expect("connect");
    let m = "reports/daily 100%";
    let path = f.mutex_path(m).expect("path");
    assert_eq!(path, format!("{chroot}/locks/reports%2Fdaily 100%25"));
    let locker = Locker::new(Arc::new(f.clone()), m).expect("locker");
    let guard = tokio::time::timeout(ACQUIRE, locker.acquire())
        .await
        .expect("in time")
        .expect("acquire");
    let raw = raw_client(zk.url()).await;
    let children = raw.get_children(&path, false).await.expect("list");
    assert_eq!(children.len(), 1, "{children:?}");
    assert!(children[0].starts_with("_c_") && children[0].contains("-latch-"));
    let (data, stat) = raw
        .get_data(&format!("{path}/{}", children[0]), false)
        .await
        .expect("data");
    assert_eq!(data, guard.contender_id().as_bytes());
    assert_eq!(u64::try_from(stat.czxid).ok(), Some(guard.fence()));
    guard.release().await.expect("release");
    let children = raw.get_children(&path, false).await.expect("list");
    assert!(
        children.is_empty(),
        "release deletes the node: {children:?}"
    );
    raw.close().await.expect("close");
    f.close().await.expect("close");
}

/// The guard checks the published local deadline itself: it stays valid while the session
/// answers, and goes invalid by the deadline when the server stops answering, even before
/// the service's task reports the loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_validity_follows_the_session_deadline() {
    let server = server().await;
    let root = random_root();
    let (factory, proxy) = proxied(&server, |c| test_config(c, &root, SESSION)).await;
    let locker = Locker::new(Arc::new(factory), &unique_name("m")).expect("locker");
    let guard = tokio::time::timeout(ACQUIRE, locker.acquire())
        .await
        .expect("acquired in time")
        .expect("acquired");
    // Past several probe periods the deadline keeps moving: still valid.
    tokio::time::sleep(SESSION).await;
    let left = guard.valid_for().expect("ZooKeeper publishes a deadline");
    assert!(guard.is_held(), "held while the session answers");
    assert!(left > Duration::ZERO && left <= SESSION, "{left:?}");
    proxy.blackhole(true);
    let t0 = Instant::now();
    // Time is the subject: validity must end within half the session timeout of the
    // last confirmed write (sent before the blackhole began), plus scheduling slack.
    while guard.is_held() {
        assert!(
            t0.elapsed() < SESSION / 2 + Duration::from_millis(500),
            "still held after {:?}",
            t0.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(guard.valid_for(), Some(Duration::ZERO));
    proxy.blackhole(false);
}
