//! The simba conformance suite against mysql.
#![allow(missing_docs)]
#![cfg(feature = "mysql")]

mod common;

simba_test_kit::conformance_tests!(common::SqlHarness::mysql().await);
