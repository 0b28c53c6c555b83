//! The whole conformance suite, and the store-level cases, on simba-core's in-memory store.

simba_test_kit::conformance_tests!(simba_test_kit::memory::MemoryHarness::memory());

simba_test_kit::store_conformance_tests!(simba_test_kit::memory::MemoryHarness::memory());

simba_test_kit::semaphore_tests!(simba_test_kit::memory::MemoryHarness::memory());

simba_test_kit::rw_lock_tests!(simba_test_kit::memory::MemoryHarness::memory());
