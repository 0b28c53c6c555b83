//! The simba conformance suite, and the kit's store-level, semaphore and read-write lock
//! cases, on a 3-primary Redis Cluster started by the test kit.
//!
//! The cases that need a fault point on one factory's connections
//! (`lost_signal_on_outage`, `failover_after_crash`, `safety_under_partitions`) run too. A
//! cluster client dials the node addresses the cluster announces, so one proxy in front of
//! the seed is not enough: the faulty factory gets a [`FaultProxy`] in front of every node
//! and a resolver (simba-redis feature `resolver`, on for the tests) that sends each node's
//! address to its proxy (`common::NodeProxies`); its fault blackholes all of them at once.
//!
//! [`FaultProxy`]: simba_test_kit::proxy::FaultProxy

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use common::ClusterHarness;
use simba_test_kit::servers::redis_cluster;

async fn harness() -> ClusterHarness {
    let cluster = redis_cluster(3).await.unwrap_or_else(|e| panic!("{e}"));
    let url = cluster.cluster_url();
    ClusterHarness::on(cluster, url, None)
}

simba_test_kit::store_conformance_tests!(harness().await);

simba_test_kit::semaphore_tests!(harness().await);

simba_test_kit::rw_lock_tests!(harness().await);

simba_test_kit::conformance_tests!(harness().await);

/// The store contract's property test (the kit's `store_props`) on the Cluster: random
/// call sequences on the server's clock, checked against the lease model (strict, as on a
/// single server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_contract_properties() {
    use simba_test_kit::store_props::{PropertyRun, check_store_contract};
    let source = harness().await;
    if let Err(e) = check_store_contract(&source, &PropertyRun::backend(false)).await {
        panic!("{e}");
    }
}
