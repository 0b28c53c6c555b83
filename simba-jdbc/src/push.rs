//! What a store does with the news, heard from another store, that permits were freed:
//! PostgreSQL's NOTIFY (`crate::postgres::Listener`) and SQLite's bells on Linux
//! (`crate::sqlite::Bells`) hand it to the store's [`OnPermit`], which wakes the waiters.

/// News of freed permits.
#[derive(Clone, Copy)]
pub(crate) enum Freed<'a> {
    /// Permits of the semaphore were freed; they are owed to these waiters (of any store).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Owed(&'a str, &'a [&'a str]),
    /// Permits of some semaphores were freed, to whom is not said: every semaphore that
    /// the test accepts may be one of them.
    #[cfg_attr(
        not(all(feature = "sqlite", any(target_os = "linux", target_os = "android"))),
        allow(dead_code)
    )]
    Matching(&'a (dyn Fn(&str) -> bool + Sync)),
}

/// Wakes a store's permit waiters that [`Freed`] concerns.
pub(crate) type OnPermit = Box<dyn Fn(Freed<'_>) + Send + Sync>;
