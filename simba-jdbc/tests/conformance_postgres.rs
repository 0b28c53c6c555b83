//! The simba conformance suite against postgres.
#![allow(missing_docs)]
#![cfg(feature = "postgres")]

mod common;

simba_test_kit::conformance_tests!(common::SqlHarness::postgres().await);
