//! The simba conformance suite, and the kit's store-level cases, on a 3-primary Redis
//! Cluster started by the test kit.
//!
//! Not here: the three cases that need a fault point on one factory's connections
//! (`lost_signal_on_outage`, `failover_after_crash`, `safety_under_partitions`). A cluster
//! client dials the node addresses the cluster announces, so it cannot be routed through
//! the kit's TCP proxy; fred can remap those addresses only with its `dns` feature (a
//! custom resolver), which simba-redis does not enable. They run on standalone Redis
//! (`conformance.rs`) and over TLS (`tls_conformance.rs`).

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

    fn faulty_factory(&self, _timing: Timing) -> BoxFuture<'_, Result<FaultyFactory, SetupError>> {
        Box::pin(async {
            Err("no per-factory fault point on Redis Cluster (see the file's docs)".into())
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

simba_test_kit::conformance_tests!(@cases ClusterHarness::start().await;
    start, restart, guard_past_ttl, multi_contend, schedule, locker_timeout,
    try_acquire, guard_drop_releases, fences_increase, handoff_without_poll,
    in_process_exclusion, reacquire_after_drop, retriever_sees_changes,
    retriever_sees_release, hold_at_least, bad_input);
