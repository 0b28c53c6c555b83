//! The store contract's property test on the in-memory store: many random sequences
//! under a paused tokio clock (the store's clock), so times are exact and runs repeatable.

use simba_test_kit::memory::MemoryHarness;
use simba_test_kit::store_props::{PropertyRun, check_store_contract};

#[tokio::test(start_paused = true)]
async fn memory_store_keeps_the_contract() {
    if let Err(e) = check_store_contract(
        &MemoryHarness::memory(),
        &PropertyRun::memory(|d| Box::pin(tokio::time::advance(d))),
    )
    .await
    {
        panic!("{e}");
    }
}
