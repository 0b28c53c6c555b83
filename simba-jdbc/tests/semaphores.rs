//! The semaphore cases of the kit (issue #28) on every SQL database: MariaDB/MySQL,
//! PostgreSQL and SQLite, each on a table of its own (`{table}_permits` beside it).
#![allow(missing_docs)]
#![cfg(any(feature = "mysql", feature = "postgres", feature = "sqlite"))]

mod common;

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::common;

    simba_test_kit::semaphore_tests!(common::SqlHarness::sqlite());
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::common;

    simba_test_kit::semaphore_tests!(common::SqlHarness::mysql().await);
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::common;

    simba_test_kit::semaphore_tests!(common::SqlHarness::postgres().await);
}
