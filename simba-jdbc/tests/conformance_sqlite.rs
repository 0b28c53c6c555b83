//! The simba conformance suite against sqlite.
#![allow(missing_docs)]
#![cfg(feature = "sqlite")]

mod common;

simba_test_kit::conformance_tests!(common::SqlHarness::sqlite());
