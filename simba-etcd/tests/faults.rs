//! Fault tests on a real etcd: connection cuts and delays through the kit's proxy, a
//! partition longer than the lease, a paused and a restarted server, an unreachable
//! server, the connector check.
//!
//! Waits are on status changes, never fixed sleeps, except where the length of an outage
//! is the subject. Bounds are generous (the machine may be loaded by other tests); each
//! says what it is derived from.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{LEASE, private_server, proxied, random_prefix, server, test_config};
use simba_core::{
    ContendService, Error, LossReason, RetrievalService, SilentRetriever, generate_contender_id,
};
use simba_etcd::{EtcdConfig, EtcdFactory};
use simba_test_kit::history::History;
use simba_test_kit::support::{expect_status, init_tracing, unique_name};
use tokio::time::Instant;

/// A handoff pushed by a watch takes a few round trips; 1.5 s leaves room for a loaded
/// machine while staying below the 2 s lease.
const HANDOFF: Duration = Duration::from_millis(1500);

/// Acquiring a free mutex: a grant, a keep-alive, a put, a read.
const ACQUIRE: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connector_passes_the_kits_check() {
    let etcd = server().await;
    let url = format!("{}{}", etcd.url(), random_prefix());
    simba_test_kit::connector::check(
        &simba_etcd::CONNECTOR,
        &url,
        None,
        simba_test_kit::connector::Expect {
            ownership: simba_core::connect::Ownership::Lease,
            round_trip: "put",
            counts_connections: false,
            semaphores: true,
        },
    )
    .await;
}

/// Nothing listens: connecting fails with a typed, retryable error within the connect
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_gives_a_typed_error_in_time() {
    init_tracing();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let config = EtcdConfig::from_url(&format!("etcd://127.0.0.1:{port}/x"))
        .expect("url")
        .with_connect_timeout(Duration::from_secs(2));
    let t0 = Instant::now();
    let r = EtcdFactory::connect(config).await;
    // The connect timeout (2 s) plus scheduling slack.
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    match r {
        Err(Error::Backend {
            backend: "etcd",
            retryable: true,
            ..
        }) => {}
        other => panic!("expected a retryable etcd error, got {other:?}"),
    }
}

/// A cut shorter than the lease: the owner is suspect meanwhile and continues with the
/// same fence once the connection is back; nobody else owns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_cut_keeps_the_ownership() {
    let etcd = server().await;
    let prefix = random_prefix();
    let m = unique_name("m");
    // 6 s: a cut of 1.5 s stays well inside the owner's deadline (at least 6 s - 2 s
    // between keep-alives - 200 ms margin after the cut begins).
    let lease = Duration::from_secs(6);
    let proxy = simba_test_kit::proxy::FaultProxy::start(etcd.socket_addr().expect("addr"))
        .await
        .expect("proxy");
    let fa = EtcdFactory::connect(test_config(&etcd.url_via(proxy.addr()), &prefix, lease))
        .await
        .expect("connect");
    let fb = EtcdFactory::connect(test_config(etcd.url(), &prefix, lease))
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

    proxy.refuse(true);
    proxy.cut();
    // Suspect within two keep-alive periods (2 s each) plus slack.
    expect_status(&a, "a becomes suspect", Duration::from_secs(6), |s| {
        s.held.is_some_and(|h| h.suspect)
    })
    .await;
    assert!(a.is_owner(), "the owner gave up before its deadline");
    proxy.refuse(false);
    let st = expect_status(&a, "a is no longer suspect", lease, |s| {
        s.held.is_none_or(|h| !h.suspect)
    })
    .await;
    assert_eq!(
        st.held.map(|h| (h.fence, h.suspect)),
        Some((fence, false)),
        "ownership did not continue: {st:?}"
    );
    assert!(!b.is_owner());
    a.stop().await.expect("stop");
    expect_status(&b, "handoff", HANDOFF, |s| s.held.is_some()).await;
    b.stop().await.expect("stop");
    let v = history.violations();
    assert!(v.is_empty(), "{v:?}");
}

/// Every chunk of the owner's connection delayed by 100 ms each way (a slow link; the
/// proxy delays chunks one after the other, so it also limits the rate): it keeps owning,
/// and its release still reaches the waiter promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_connection_keeps_the_ownership() {
    let etcd = server().await;
    let prefix = random_prefix();
    let m = unique_name("m");
    let history = History::new();
    let (fa, proxy) = proxied(&etcd, &prefix).await;
    let fb = EtcdFactory::connect(test_config(etcd.url(), &prefix, LEASE))
        .await
        .expect("connect");
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
    proxy.set_latency(Duration::from_millis(100));
    // Three leases long: the length of the slow period is the subject.
    tokio::time::sleep(LEASE * 3).await;
    let st = a.status().borrow().clone();
    assert_eq!(st.held.map(|h| h.fence), Some(fence), "{st:?}");
    assert!(st.last_loss.is_none(), "{st:?}");
    assert!(!b.is_owner());
    a.stop().await.expect("stop");
    // The revoke goes through the slow link: the handoff plus one delayed round trip.
    expect_status(&b, "handoff", HANDOFF + Duration::from_millis(400), |s| {
        s.held.is_some()
    })
    .await;
    b.stop().await.expect("stop");
    let v = history.violations();
    assert!(v.is_empty(), "{v:?}");
}

/// A partition longer than the lease: the old owner reports the loss before anyone else
/// owns, the lease ends on the server and the waiter takes over with a greater fence; after
/// the partition heals the old owner contends again with a new lease and key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_partition_loses_before_anyone_else_owns() {
    let etcd = server().await;
    let prefix = random_prefix();
    let m = unique_name("m");
    let history = History::new();
    let (fa, proxy) = proxied(&etcd, &prefix).await;
    let fb = EtcdFactory::connect(test_config(etcd.url(), &prefix, LEASE))
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
    // The owner gives up by its deadline: last answered keep-alive + lease - margin.
    let st = expect_status(
        &a,
        "a reports the loss",
        LEASE + Duration::from_millis(500),
        |s| s.held.is_none(),
    )
    .await;
    assert_eq!(
        st.last_loss.map(|l| l.reason),
        Some(LossReason::LeaseExpired)
    );
    // The leader revokes the lease (checked every 500 ms), then b's watch fires.
    let st = expect_status(&b, "b takes over", LEASE + Duration::from_secs(2), |s| {
        s.held.is_some()
    })
    .await;
    let fence_b = st.held.expect("held").fence;
    assert!(
        fence_b > fence_a,
        "fences must increase: {fence_a} then {fence_b}"
    );
    tracing::info!(took_over_after = ?t0.elapsed(), "partition");
    let mut seen = retriever.state();
    tokio::time::timeout(HANDOFF, seen.wait_for(|s| s.after.owner_id == id_b))
        .await
        .expect("the retriever sees b")
        .expect("retriever channel");

    proxy.heal();
    let before = a.status().borrow().attempts;
    expect_status(&a, "a contends again", Duration::from_secs(10), |s| {
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

/// The server paused (SIGSTOP) past the lease: the owner reports the loss by its deadline
/// without an answer; after the server resumes, the leader finds every lease it had expire
/// (etcd 3.4 restarts none), and the contenders contend again; fences still increase.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_server_past_the_lease_ends_the_ownership_in_time() {
    let etcd = private_server().await;
    let prefix = random_prefix();
    let m = unique_name("m");
    let history = History::new();
    let fa = EtcdFactory::connect(test_config(etcd.url(), &prefix, LEASE))
        .await
        .expect("connect");
    let a = fa
        .contend_service(&m, history.contender(generate_contender_id()))
        .expect("service");
    a.start().expect("start");
    let fence = expect_status(&a, "a acquires", ACQUIRE, |s| s.held.is_some())
        .await
        .held
        .expect("held")
        .fence;
    etcd.pause().await.expect("pause");
    expect_status(
        &a,
        "a reports the loss",
        LEASE + Duration::from_millis(500),
        |s| s.held.is_none(),
    )
    .await;
    etcd.resume().await.expect("resume");
    let st = expect_status(&a, "a owns again", Duration::from_secs(15), |s| {
        s.held.is_some()
    })
    .await;
    assert!(st.held.expect("held").fence > fence);
    a.stop().await.expect("stop");
    let v = history.violations();
    assert!(v.is_empty(), "{v:?}");
}

/// A server restart: the data directory keeps the revision, so fences keep increasing
/// across it; the owner is suspect while the server is down and either continues or
/// contends again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_keeps_fences_increasing() {
    let etcd = private_server().await;
    let prefix = random_prefix();
    let m = unique_name("m");
    let history = History::new();
    let fa = EtcdFactory::connect(test_config(etcd.url(), &prefix, LEASE))
        .await
        .expect("connect");
    let a = fa
        .contend_service(&m, history.contender(generate_contender_id()))
        .expect("service");
    a.start().expect("start");
    let fence = expect_status(&a, "a acquires", ACQUIRE, |s| s.held.is_some())
        .await
        .held
        .expect("held")
        .fence;
    a.stop().await.expect("stop");
    etcd.restart().await.expect("restart");
    a.start().expect("start again");
    let st = expect_status(
        &a,
        "a owns after the restart",
        Duration::from_secs(15),
        |s| s.held.is_some(),
    )
    .await;
    assert!(st.held.expect("held").fence > fence);
    a.stop().await.expect("stop");
    let v = history.violations();
    assert!(v.is_empty(), "{v:?}");
}

/// A release with a hold keeps the key, held by `held@@…`, and an observer sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_is_visible_to_observers() {
    let etcd = server().await;
    let prefix = random_prefix();
    let m = unique_name("m");
    let f = EtcdFactory::connect(test_config(etcd.url(), &prefix, LEASE))
        .await
        .expect("connect");
    let id = generate_contender_id();
    let history = History::new();
    let a = f
        .contend_service(&m, history.contender(&id))
        .expect("service");
    a.start().expect("start");
    expect_status(&a, "a acquires", ACQUIRE, |s| s.held.is_some()).await;
    a.stop_holding_until(Instant::now() + Duration::from_secs(4))
        .await
        .expect("hold");
    let r = f
        .retrieval_service(&m, Arc::new(SilentRetriever))
        .expect("retriever");
    r.start().expect("start");
    let mut state = r.state();
    let seen = tokio::time::timeout(
        ACQUIRE,
        state.wait_for(|s| s.after.held_after_release_by() == Some(id.as_str())),
    )
    .await
    .is_ok();
    assert!(seen, "{:?}", r.state().borrow());
    // After the hold the key is gone: the observer sees no owner (4 s hold, up to 500 ms
    // for the leader's expiry check, slack for a loaded machine).
    tokio::time::timeout(
        Duration::from_secs(8),
        state.wait_for(|s| !s.after.has_owner()),
    )
    .await
    .expect("the hold ends")
    .expect("channel");
    r.stop().await.expect("stop");
}
