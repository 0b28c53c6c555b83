//! The whole conformance suite on simba-core's in-memory store.

simba_test_kit::conformance_tests!(simba_test_kit::memory::MemoryHarness::memory());
