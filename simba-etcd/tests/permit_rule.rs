//! The etcd semaphore recipe against simba-core's admission rule: a differential test on a
//! real etcd (see `simba_test_kit::permit_model`). Seeded random sequences of
//! acquisitions, releases and leaves by five contenders run on one semaphore and on a model
//! that decides with `simba_core::backend::admit_permit`; the holders, each acquisition's
//! outcome and the fences must agree at every step.
//!
//! The lease is 5 minutes and a run takes seconds: nothing expires during a run, so the
//! runs compare the admission rule, not timing (each run is on a new semaphore). This is
//! also why the store and the model agree on holders although they judge a holder's end
//! differently: the model drops a holder at its `transition_at` on the test's clock, the
//! store keeps another contender's holder key until etcd deletes it (its etcd lease ends,
//! `ttl + transition` rounded up to whole seconds after its last take or renewal). Holder
//! expiry is tested against etcd itself in `tests/semaphore.rs`
//! (`a_silent_holders_permit_returns_when_its_key_lease_ends`,
//! `a_renewing_holder_keeps_its_permit_against_a_clock_running_ahead`), not here. A
//! failure names its seed; `SIMBA_PERMIT_SEED=<seed>` runs that one only.

mod common;

use std::time::Duration;

use common::{random_prefix, server, test_config};
use simba_core::backend::Lease;
use simba_etcd::EtcdFactory;
use simba_test_kit::permit_model::{Run, differential};
use simba_test_kit::support::unique_name;

/// Far longer than a run: nothing ends under one.
const LEASE: Lease = Lease {
    ttl: Duration::from_secs(240),
    transition: Duration::from_secs(60),
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
    let etcd = server().await;
    let factory = EtcdFactory::connect(test_config(
        etcd.url(),
        &random_prefix(),
        Duration::from_secs(10),
    ))
    .await
    .unwrap_or_else(|e| panic!("connect: {e}"));
    let store = factory.permit_store();
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
