//! A database restart (or a hung database) while a contender owns: the owner reports the loss by its local
//! deadline while the database is down, a contender owns again once it is back, and fences
//! keep increasing. Uses private server instances (the test stops and starts them).
#![allow(missing_docs)]
// With only some backend features, parts of this file are unused.
#![cfg_attr(
    not(all(feature = "sqlite", feature = "mysql", feature = "postgres")),
    allow(unused)
)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use simba_core::{ContendService, LeaseConfig, LeaseServiceFactory, LossReason, SilentContender};
use simba_test_kit::servers::TestServer;
use tokio::time::{Instant, timeout};

use common::SqlHarness;

fn lease() -> LeaseConfig {
    LeaseConfig {
        request_timeout: Duration::from_secs(1),
        retry_interval: Duration::from_millis(200),
        ..LeaseConfig::with_lease(Duration::from_secs(1), Duration::from_secs(1))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outage {
    /// Graceful stop, then start: connections are closed.
    Stop,
    /// SIGSTOP, then SIGCONT: connections stay open and nothing answers (a hung server).
    Pause,
}

async fn restart_case(name: &'static str, server: TestServer, outage: Outage) {
    let h = SqlHarness::on_server(name, server, false);
    let fa = LeaseServiceFactory::new(h.store().await.expect("store a"), lease()).expect("factory");
    let fb = LeaseServiceFactory::new(h.store().await.expect("store b"), lease()).expect("factory");
    let m = "restart-while-owning";
    let a = fa.contend_service(m, Arc::new(SilentContender)).expect("a");
    let b = fb.contend_service(m, Arc::new(SilentContender)).expect("b");
    a.start().expect("start a");
    let first = timeout(
        Duration::from_secs(10),
        a.status().wait_for(|s| s.held.is_some()),
    )
    .await
    .expect("a owns")
    .expect("status")
    .clone();
    let f1 = first.held.map_or(0, |h| h.fence);
    b.start().expect("start b");
    timeout(
        Duration::from_secs(10),
        b.status().wait_for(|s| s.attempts > 0),
    )
    .await
    .expect("b contends")
    .expect("status");

    let server = h.server().expect("server");
    match outage {
        Outage::Stop => server.stop().await.expect("stop the database"),
        Outage::Pause => server.pause().await.expect("pause the database"),
    }
    let stopped = Instant::now();
    // The owner's last successful renewal was sent before `stop` returned, so its local
    // deadline (sent + ttl + transition - drift) is at most 2 s after `stopped`. One more
    // second covers scheduling on a loaded 2-core machine; the loss must come while the
    // database is still down, without any answer from it.
    let bound = Duration::from_secs(3);
    let lost = timeout(bound, a.status().wait_for(|s| s.held.is_none()))
        .await
        .unwrap_or_else(|_| {
            panic!("{name}: owner still believes it owns {bound:?} after the database stopped")
        })
        .expect("status")
        .clone();
    let took = stopped.elapsed();
    let loss = lost.last_loss.expect("a loss is recorded");
    assert_eq!(loss.reason, LossReason::LeaseExpired, "{name}: {lost:?}");
    assert_eq!(loss.fence, f1);
    assert!(
        !b.is_owner(),
        "{name}: nobody can own while the database is down"
    );
    eprintln!("{name}: owner reported the loss {took:?} after the database {outage:?}");

    match outage {
        Outage::Stop => server.start().await.expect("start the database"),
        Outage::Pause => {
            // Resuming right away may let the owner's queued renewal through while its
            // lease still runs on the database's clock: it then owns again with the same
            // fence, which is correct (its ownership never ended there) but does not show a
            // new acquisition. Waiting out a whole lease first makes the next owner new.
            tokio::time::sleep(lease().ttl + lease().transition).await;
            server.resume().await.expect("resume the database");
        }
    }
    let restarted = Instant::now();
    // Pools hold dead connections now: they must be replaced. 30 s is generous: a contender
    // retries every 200 ms and the lease in the table ended long ago.
    let mut sa = a.status();
    let mut sb = b.status();
    let owner_fence = timeout(Duration::from_secs(30), async {
        loop {
            if let Some(h) = sa.borrow().held.or(sb.borrow().held) {
                return h.fence;
            }
            tokio::select! {
                _ = sa.changed() => {}
                _ = sb.changed() => {}
            }
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "{name}: nobody owns 30 s after the restart: a={:?} b={:?}",
            *a.status().borrow(),
            *b.status().borrow()
        )
    });
    eprintln!(
        "{name}: owned again {:?} after the database came back from {outage:?}",
        restarted.elapsed()
    );
    assert!(
        owner_fence > f1,
        "{name}: fences increase across a restart: {f1} then {owner_fence}"
    );
    assert!(!(a.is_owner() && b.is_owner()), "two owners");
    a.stop().await.expect("stop a");
    b.stop().await.expect("stop b");
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_restart_while_owning() {
    let server = simba_test_kit::servers::mysql_private()
        .await
        .expect("private MariaDB");
    restart_case("mysql", server, Outage::Stop).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_hung_while_owning() {
    let server = simba_test_kit::servers::mysql_private()
        .await
        .expect("private MariaDB");
    restart_case("mysql", server, Outage::Pause).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_while_owning() {
    let server = simba_test_kit::servers::postgres_private()
        .await
        .expect("private PostgreSQL");
    restart_case("postgres", server, Outage::Stop).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_hung_while_owning() {
    let server = simba_test_kit::servers::postgres_private()
        .await
        .expect("private PostgreSQL");
    restart_case("postgres", server, Outage::Pause).await;
}

#[cfg(feature = "postgres")]
async fn next(
    rx: &mut simba_core::events::EventReceiver,
    bound: Duration,
) -> Option<simba_core::backend::StoreEvent> {
    timeout(bound, rx.recv()).await.ok().flatten()
}

/// The LISTEN connection comes back after a restart, says so with a Resync (notifications
/// sent while it was down are lost), and pushes releases again.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_listener_resyncs_after_restart() {
    use simba_core::backend::{LeaseStore, StoreEvent};
    let server = simba_test_kit::servers::postgres_private()
        .await
        .expect("private PostgreSQL");
    let h = SqlHarness::on_server("postgres", server, true);
    let waiter = h.store().await.expect("store");
    let owner = h.store().await.expect("store");
    let mut rx = waiter
        .subscribe("listen-restart", "waiter")
        .await
        .expect("subscribe")
        .expect("postgres pushes");
    assert_eq!(
        next(&mut rx, Duration::from_secs(10)).await,
        Some(StoreEvent::Resync)
    );

    let server = h.server().expect("server");
    server.restart().await.expect("restart the database");
    // The listener notices within its 2 s heartbeat (or at once, when the server closes
    // the connection) and reconnects with a backoff of at most 2 s: 15 s is generous.
    assert_eq!(
        next(&mut rx, Duration::from_secs(15)).await,
        Some(StoreEvent::Resync),
        "a Resync after the LISTEN connection came back"
    );
    // Pushes work again: the owner's pool reconnects by itself.
    let mut acquired = None;
    for _ in 0..50 {
        match owner
            .acquire("listen-restart", "owner", common::LEASE)
            .await
        {
            Ok(r) => {
                acquired = Some(r);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    assert!(
        acquired
            .expect("acquire after restart")
            .owner
            .is_owner("owner")
    );
    assert_eq!(
        next(&mut rx, Duration::from_secs(5)).await,
        Some(StoreEvent::Acquired {
            owner_id: "owner".into()
        })
    );
    assert!(
        owner
            .release("listen-restart", "owner")
            .await
            .expect("release")
    );
    assert_eq!(
        next(&mut rx, Duration::from_secs(5)).await,
        Some(StoreEvent::Released)
    );
}
