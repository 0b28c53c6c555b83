//! The simba conformance suite, and the kit's store-level cases, on a real Redis server.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

simba_test_kit::conformance_tests!(common::RedisHarness::start().await);

simba_test_kit::store_conformance_tests!(common::RedisHarness::start().await);
