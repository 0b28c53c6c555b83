//! The semaphore recipe against simba-core's admission rule: a differential test on a real
//! ZooKeeper (see `simba_test_kit::permit_model`). Seeded random sequences of
//! acquisitions, releases and leaves by five contenders run on one semaphore and on a model
//! that decides with `simba_core::backend::admit_permit`; the holders, each acquisition's
//! outcome and the fences must agree at every step.
//!
//! The lease is 25 s, the longest a 60 s session allows (half of it), and a run takes well
//! under that: nothing expires during a run, so the runs compare the admission rule, not
//! timing (each run is on a new semaphore), and the store's claim window is off. A failure names its seed;
//! `SIMBA_PERMIT_SEED=<seed>` runs that one only.

mod common;

use std::time::Duration;

use common::{random_root, server, test_config};
use simba_core::backend::Lease;
use simba_test_kit::permit_model::{Run, differential};
use simba_test_kit::support::unique_name;
use simba_zookeeper::ZkFactory;

const SESSION: Duration = Duration::from_secs(60);

/// Half the session: the longest permit lease ZooKeeper allows.
const LEASE: Lease = Lease {
    ttl: Duration::from_secs(20),
    transition: Duration::from_secs(5),
};

/// Fixed seeds, one seed new every run (printed when it fails), or the one of
/// `SIMBA_PERMIT_SEED`.
fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("SIMBA_PERMIT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return vec![seed];
    }
    let mut seeds: Vec<u64> = (1..=8).collect();
    seeds.push(simba_core::backend::random_u64());
    seeds
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_recipe_follows_the_core_rule() {
    let zk = server().await;
    let factory = ZkFactory::connect(test_config(zk.url(), &random_root(), SESSION))
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"));
    // The claim window off: ZooKeeper removes an owed waiter that does not take in time
    // (it loses its place), which is not the model's pass-over (its `permit_claim` stays
    // `None`); with it off the runs compare the rule, not timing.
    let store = factory.permit_store().with_claim(None);
    for seed in seeds() {
        for permits in [1, 2, 3] {
            let run = Run {
                seed,
                steps: 80,
                contenders: 5,
                permits,
                lease: LEASE,
            };
            if let Err(e) = differential(&store, &unique_name("rule"), run).await {
                panic!("{e} (run again with SIMBA_PERMIT_SEED={seed})");
            }
        }
    }
}
