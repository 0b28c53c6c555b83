//! How a store's connections are split between its pool and its renewal batches, and the
//! error of a pool that cannot be built: what every dialect's pool shares.

use simba_core::{Error, Result};

use crate::config::Backend;

/// The error of a pool that cannot be built.
pub(crate) fn pool_error(
    kind: Backend,
    e: impl std::error::Error + Send + Sync + 'static,
) -> Error {
    Error::backend_source(
        kind.name(),
        format!("cannot build the connection pool: {e}"),
        false,
        e,
    )
}

/// How many renewal batches of a store may run at once: 1 on SQLite (one writer at a time
/// anyway: more would only wait for its lock), 2 elsewhere (a slow statement does not
/// hold every renewal up).
pub(crate) fn renewal_lanes(kind: Backend) -> usize {
    match kind {
        Backend::Sqlite => 1,
        Backend::Mysql | Backend::Postgres => 2,
    }
}

/// How a store's `size` connections are split: the pool of every other call, and the
/// connections of its renewal batches (one per lane, [`renewal_lanes`]), so that a batch
/// never waits for a pooled connection behind thousands of acquisitions. At least one
/// connection stays with the others; a pool of one is shared (`None`).
pub(crate) fn split_pool(kind: Backend, size: usize) -> (usize, Option<usize>) {
    let size = size.max(1);
    if size == 1 {
        return (1, None);
    }
    let renew = renewal_lanes(kind).min(size - 1);
    (size - renew, Some(renew))
}

/// The pool of a store of `kind` with `size` connections, and its renewal connections
/// ([`split_pool`]); `build` builds a pool of the given size.
pub(crate) fn pools<P>(
    kind: Backend,
    size: usize,
    build: impl Fn(usize) -> Result<P>,
) -> Result<(P, Option<P>)> {
    let (main, renewals) = split_pool(kind, size);
    Ok((build(main)?, renewals.map(&build).transpose()?))
}
