//! The simba conformance suite, and the kit's store-level cases, on a 3-primary Redis
//! Cluster started by the test kit.
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

use std::sync::Arc;

use common::test_config;
use simba_core::backend::BoxFuture;
use simba_core::{ContendServiceFactory, LeaseServiceFactory};
use simba_redis::RedisStore;
use simba_test_kit::memory::{lease_capabilities, lease_config};
use simba_test_kit::servers::{RedisCluster, redis_cluster};
use simba_test_kit::store_cases::StoreSource;
use simba_test_kit::suite::{Capabilities, FaultyFactory, Harness, SetupError, Timing};
use simba_test_kit::support::{init_tracing, unique_name};

struct ClusterHarness {
    cluster: RedisCluster,
    prefix: String,
}

impl ClusterHarness {
    async fn start() -> Self {
        init_tracing();
        ClusterHarness {
            cluster: redis_cluster(3).await.unwrap_or_else(|e| panic!("{e}")),
            prefix: unique_name("t"),
        }
    }
}

impl Harness for ClusterHarness {
    fn name(&self) -> String {
        "redis-cluster".to_owned()
    }

    fn capabilities(&self, timing: Timing) -> Capabilities {
        lease_capabilities(timing, true)
    }

    fn factory(
        &self,
        timing: Timing,
    ) -> BoxFuture<'_, Result<Arc<dyn ContendServiceFactory>, SetupError>> {
        Box::pin(async move {
            let config = test_config(&self.cluster.cluster_url(), &self.prefix);
            let store = RedisStore::connect(config).await?;
            let factory = LeaseServiceFactory::new(store, lease_config(timing))?;
            Ok(Arc::new(factory) as Arc<dyn ContendServiceFactory>)
        })
    }

    fn faulty_factory(&self, timing: Timing) -> BoxFuture<'_, Result<FaultyFactory, SetupError>> {
        let url = self.cluster.cluster_url();
        Box::pin(async move {
            common::cluster_faulty_factory(&self.cluster, &url, &self.prefix, timing).await
        })
    }
}

impl StoreSource for ClusterHarness {
    type Store = RedisStore;

    fn name(&self) -> String {
        "redis-cluster".to_owned()
    }

    fn store(&self) -> BoxFuture<'_, Result<RedisStore, SetupError>> {
        Box::pin(async move {
            let config = test_config(&self.cluster.cluster_url(), &self.prefix);
            Ok(RedisStore::connect(config).await?)
        })
    }

    fn pushes_release(&self) -> bool {
        true
    }
}

simba_test_kit::store_conformance_tests!(ClusterHarness::start().await);

simba_test_kit::conformance_tests!(ClusterHarness::start().await);
