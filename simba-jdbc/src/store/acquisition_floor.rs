//! The acquisition statement alone, for `simba bench --explain`: the statement a waiter
//! runs once its native lock is granted, on the store's own connection path (the pool, or
//! PostgreSQL's prepared-statement connections), without the engine, the gate or the
//! reply's checks. Its time beside the hop *statement sent → statement answered* of a
//! handoff tells the statement's own cost from what the handoff adds to it, and the hops
//! around that one tell the store's own work.
//!
//! Only with the `bench` feature.

use std::time::Duration;

use simba_core::backend::Lease;
use simba_core::{Error, Result};
use tracing::debug;

use super::{Failure, Inner, SqlStore};
use crate::call::{Call, Pass};
use crate::conn::Checked;
use crate::dialect::{on_pool, with_fast};
use crate::rows::OwnerRow;

/// The two contenders that take the floor's row from one another.
const OWNERS: [&str; 2] = ["simba-bench-floor-a", "simba-bench-floor-b"];

impl SqlStore {
    /// Times `warm + n` acquisitions of `mutex` (a name of the caller's own, which nobody
    /// else contends for) and returns the last `n`: before each, the row's owner releases
    /// it (not timed), and the other of two contenders acquires it with the statement of
    /// a contender that holds the native lock. Each acquisition commits a change of owner,
    /// as a waiter's does in a handoff. Leaves the row released.
    ///
    /// # Errors
    /// [`Error::Backend`] if a statement fails or does not answer within the statement
    /// timeout; [`Error::InvalidState`] if an acquisition did not take the row.
    ///
    /// # Cancel safety
    /// Dropping the future may leave the row held by one of the floor's contenders until
    /// its lease ends.
    #[doc(hidden)]
    pub async fn acquisition_floor(
        &self,
        mutex: &str,
        lease: Lease,
        warm: usize,
        n: usize,
    ) -> Result<Vec<Duration>> {
        let inner: &Inner = &self.inner;
        let call = inner.start(mutex, Some(OWNERS[0]))?;
        let mut took = Vec::with_capacity(n);
        let mut owner: Option<&str> = None;
        for i in 0..warm + n {
            if let Some(prev) = owner {
                release(inner, &call, mutex, prev).await?;
            }
            let me = OWNERS[i % 2];
            let t0 = tokio::time::Instant::now();
            let row: Option<OwnerRow> = run_fast!(
                inner,
                format!("acquisition floor: acquire {mutex:?}"),
                |c| call.acquire(c, me, lease, Pass::Locked(crate::native::NO_IDENTITY), None)
            )?;
            let elapsed = t0.elapsed();
            // A `CHAR(n)` owner column (a JVM Simba table) pads the id with spaces.
            let got = row
                .as_ref()
                .and_then(|r| r.owner_id.as_deref())
                .map(|id| id.trim_end_matches(' '));
            if got != Some(me) {
                return Err(Error::InvalidState(format!(
                    "acquisition floor: {me} did not take the released row of {mutex:?} \
                     (its owner: {got:?})"
                )));
            }
            owner = Some(me);
            if i >= warm {
                took.push(elapsed);
            }
        }
        if let Some(prev) = owner {
            release(inner, &call, mutex, prev).await?;
        }
        Ok(took)
    }
}

/// The floor's release of `mutex` by `owner`, which must hold it.
async fn release(inner: &Inner, call: &Call<'_>, mutex: &str, owner: &str) -> Result<()> {
    let released: bool = run_fast!(
        inner,
        format!("acquisition floor: release {mutex:?}"),
        |c| call.release(c, owner)
    )?;
    if released {
        Ok(())
    } else {
        Err(Error::InvalidState(format!(
            "acquisition floor: {owner} could not release {mutex:?}: it no longer held it"
        )))
    }
}
