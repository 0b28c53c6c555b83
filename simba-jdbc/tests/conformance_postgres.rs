//! The simba conformance suite against postgres.
#![allow(missing_docs)]
#![cfg(feature = "postgres")]

mod common;

simba_test_kit::conformance_tests!(common::SqlHarness::postgres().await);

/// The suite on a table the JVM Simba library made (issue #27): what `migrate()` makes of
/// it must behave like simba's own table.
mod jvm_table {
    use super::common;

    simba_test_kit::conformance_tests!(common::SqlHarness::postgres().await.on_jvm_table().await);
}
