//! The whole conformance suite on simba-core's in-memory store.

simba_test_kit::conformance_tests!(simba_test_kit::memory::MemoryHarness::memory());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_after_contract() {
    let store = simba_core::MemoryStore::new();
    simba_test_kit::store_cases::release_after_contract(&store, &store.clone(), "held")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observer_is_pushed_and_idle() {
    let store = simba_core::MemoryStore::new();
    simba_test_kit::store_cases::observer_is_pushed_and_idle(store.clone(), store, true, "seen")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}
