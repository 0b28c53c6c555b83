//! The futures of a store's calls stay small: a contender's driver future holds the future
//! of the call it may make for its whole life, so at 10,000 contenders every kilobyte here
//! is 10 MB of resident memory (the statement futures of the three dialects, unboxed, took
//! about 4.5 KB: issue #31's memory goal).
#![allow(missing_docs)]

use std::time::Duration;

use simba_core::backend::{Lease, LeaseStore};
use simba_jdbc::{SqlConfig, SqlStore};

/// Bound of a call's future, in bytes: a boxed body plus the arguments (88 bytes for
/// `acquire` in a release build; debug builds lay futures out larger).
const MAX_FUTURE: usize = 512;

#[tokio::test]
async fn store_call_futures_are_small() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("s.db").display());
    let store = SqlStore::connect_lazy(SqlConfig::new(&url)).expect("store");
    let lease = Lease {
        ttl: Duration::from_secs(3),
        transition: Duration::from_secs(1),
    };
    let sizes = [
        ("acquire", size_of_val(&store.acquire("m", "c", lease))),
        ("guard", size_of_val(&store.guard("m", "c", lease))),
        ("release", size_of_val(&store.release("m", "c"))),
        (
            "release_after",
            size_of_val(&store.release_after("m", "c", Duration::from_secs(1))),
        ),
        ("owner", size_of_val(&store.owner("m"))),
        ("subscribe", size_of_val(&store.subscribe("m", "c"))),
        ("leave", size_of_val(&store.leave("m", "c"))),
    ];
    for (call, size) in sizes {
        assert!(
            size <= MAX_FUTURE,
            "the future of {call} takes {size} bytes (bound {MAX_FUTURE}): box its body"
        );
    }
}
