//! The ZooKeeper retrieval service is driven by watches: idle, it sends the server no
//! requests beyond the session's pings; it sees a release as soon as the node goes.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{private_server, random_root, test_config};
use simba_core::{ContendServiceFactory, Locker, MutexState, SilentRetriever};
use simba_test_kit::servers::TestServer;
use simba_zookeeper::ZkFactory;

/// Packets the server has received from all clients.
async fn received(server: &TestServer) -> u64 {
    common::srvr_number(server, "Received:").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_observer_does_not_poll_and_sees_a_release_at_once() {
    // A private server: its packet count is this test's alone.
    let server = private_server().await;
    let root = random_root();
    let session = Duration::from_secs(6);
    let f = ZkFactory::connect(test_config(server.url(), &root, session))
        .await
        .expect("factory");
    let r = f
        .create_retrieval_service("observed", Arc::new(SilentRetriever))
        .expect("retriever");
    r.start().expect("start");
    let mut state = r.state();
    // Let the first look settle, then count over 3 s on a free mutex: only the session's
    // pings (one per session / 3 = 2 s) and this test's own srvr connections may arrive.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = received(&server).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = received(&server).await - before;
    assert!(idle <= 10, "{idle} packets in 3 s from an idle observer");

    let other: Arc<dyn ContendServiceFactory> = Arc::new(
        ZkFactory::connect(test_config(server.url(), &root, session))
            .await
            .expect("factory"),
    );
    let locker = Locker::new(other, "observed").expect("locker");
    let g = locker.acquire().await.expect("acquire");
    let id = g.contender_id().to_owned();
    // Watches fire at once; 1 s is generous for a loaded machine.
    let bound = Duration::from_secs(1);
    let seen = tokio::time::timeout(
        bound,
        state.wait_for(|s: &MutexState| s.after.owner_id == id),
    );
    assert!(seen.await.is_ok(), "acquisition not seen within {bound:?}");
    g.release().await.expect("release");
    let seen = tokio::time::timeout(bound, state.wait_for(|s: &MutexState| !s.after.has_owner()));
    assert!(seen.await.is_ok(), "release not seen within {bound:?}");
    eprintln!("idle ZooKeeper observer: {idle} packets received by the server in 3 s");
    r.stop().await.expect("stop");
}

/// The connector gives a generic tool a working backend: the kit's connector check (a
/// session backend: no owner read, no hold).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connector_passes_the_kit_check() {
    let server = common::server().await;
    let url = format!("zk://{}{}", server.url(), random_root());
    simba_test_kit::connector::check(
        &simba_zookeeper::CONNECTOR,
        &url,
        None,
        simba_test_kit::connector::Expect {
            ownership: simba_core::connect::Ownership::Session,
            round_trip: "exists",
            counts_connections: false,
            semaphores: true,
        },
    )
    .await;
}
