//! The simba conformance suite on a real ZooKeeper server.

mod common;

simba_test_kit::conformance_tests!(common::ZkHarness::start().await);
