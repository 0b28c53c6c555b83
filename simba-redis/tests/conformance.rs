//! The simba conformance suite, and the kit's store-level, semaphore and read-write lock
//! cases, on a real Redis server.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

simba_test_kit::conformance_tests!(common::RedisHarness::start().await);

simba_test_kit::store_conformance_tests!(common::RedisHarness::start().await);

simba_test_kit::semaphore_tests!(common::RedisHarness::start().await);

simba_test_kit::rw_lock_tests!(common::RedisHarness::start().await);

/// The store contract's property test (the kit's `store_props`): a bounded number of
/// random call sequences on the server's clock, checked against the lease model. Strict:
/// the store never refuses a free mutex (no unnamed holder).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_contract_properties() {
    use simba_test_kit::store_props::{PropertyRun, check_store_contract};
    let source = common::RedisHarness::start().await;
    if let Err(e) = check_store_contract(&source, &PropertyRun::backend(false)).await {
        panic!("{e}");
    }
}
