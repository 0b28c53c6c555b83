//! The simba conformance suite on a real etcd server.

mod common;

simba_test_kit::conformance_tests!(common::EtcdHarness::start().await);
