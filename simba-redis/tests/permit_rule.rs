//! The semaphore scripts against simba-core's admission rule: a differential test on a
//! real Redis (see `simba_test_kit::permit_model`). Seeded random sequences of
//! acquisitions, releases and leaves by five contenders run on one semaphore and on a model
//! that decides with `simba_core::backend::admit_permit`; the holders, each acquisition's
//! outcome and the fences must agree at every step.
//!
//! The lease is an hour: nothing expires during a run, so the runs compare the admission
//! rule, not timing. The model's clock is the store's (each reply's `now`), so claim
//! windows (`PermitStore::permit_claim`) must match the rule to the millisecond; a second
//! test paces the acquisitions so that a claim spans a few steps only and waiters owed a
//! permit are passed over often. A failure names its seed; `SIMBA_PERMIT_SEED=<seed>` runs
//! that one only.

mod common;

use std::time::Duration;

use simba_core::backend::{Lease, PERMIT_CLAIM_MS, PermitStore};
use simba_redis::RedisStore;
use simba_test_kit::permit_model::{Paced, Run, differential};
use simba_test_kit::servers::redis;
use simba_test_kit::support::unique_name;

/// Long enough that no holder or waiter expires during a run.
const LEASE: Lease = Lease {
    ttl: Duration::from_secs(3600),
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
    let mut seeds: Vec<u64> = (1..=12).collect();
    seeds.push(simba_core::backend::random_u64());
    seeds
}

/// A store on the Redis at `url`, with a prefix of its own.
async fn store(url: &str) -> RedisStore {
    RedisStore::connect(common::test_config(url, &unique_name("t")))
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"))
}

/// The differential runs of `seeds` with 1, 2 and 3 permits on `store`.
async fn runs<S: PermitStore>(store: &S, seeds: Vec<u64>, name: &str) {
    for seed in seeds {
        for permits in [1, 2, 3] {
            let run = Run {
                seed,
                steps: 120,
                contenders: 5,
                permits,
                lease: LEASE,
            };
            if let Err(e) = differential(store, &unique_name(name), run).await {
                panic!("{e} (run again with SIMBA_PERMIT_SEED={seed})");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sem_acquire_and_release_scripts_follow_the_core_rule() {
    let server = redis().await.unwrap_or_else(|e| panic!("{e}"));
    runs(&store(server.url()).await, seeds(), "rule").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sem_scripts_pass_over_waiters_whose_claim_ended_as_the_core_rule_does() {
    let server = redis().await.unwrap_or_else(|e| panic!("{e}"));
    let pace = Duration::from_millis(PERMIT_CLAIM_MS.unsigned_abs() / 4);
    let paced = Paced {
        store: store(server.url()).await,
        pace,
    };
    let mut seeds = seeds();
    // Fewer runs than the unpaced test: each step takes `pace`.
    if seeds.len() > 4 {
        seeds.drain(3..seeds.len() - 1);
    }
    runs(&paced, seeds, "paced").await;
}
