//! The exact condition under which a fence can go back when a mutex's row is made again
//! (README, *Fences*): acquisitions faster than one per millisecond make `version` lead
//! the database clock; a row made again while that lead lasts starts below the last
//! fence, one made after it does not. The lead is what a user reads from the row:
//! `version − NOW`.
#![allow(missing_docs)]
#![cfg(feature = "sqlite")]

mod common;

use std::time::Duration;

use common::{LEASE, SqlHarness};
use simba_core::backend::LeaseStore;
use simba_test_kit::support::unique_name;

/// Acquisitions in the burst at most; it stops once the counter leads by [`LEAD`].
const BURST: usize = 3_000;

/// The lead the burst must reach: far more than one acquisition on a fresh database takes.
const LEAD: i64 = 50;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_made_again_starts_below_the_last_fence_only_while_the_counter_leads() {
    let m = unique_name("burst");
    let old = SqlHarness::sqlite();
    let a = old.store().await.expect("store");
    // The databases that stand in for the row made again, ready before the burst ends.
    let within = SqlHarness::sqlite();
    let b = within.store().await.expect("store");
    let after = SqlHarness::sqlite();
    let c = after.store().await.expect("store");

    let mut lead = 0;
    let mut last = 0;
    for _ in 0..BURST {
        // The reply holds the row's version and the database's clock of the statement:
        // their difference is the lead (`version − NOW`).
        let got = a.acquire(&m, "a", LEASE).await.expect("acquire");
        assert!(a.release(&m, "a").await.expect("release"));
        last = got.owner.fence;
        lead = i64::try_from(last).expect("fence fits i64") - got.now;
        if lead >= LEAD {
            break;
        }
    }
    assert!(
        lead >= LEAD,
        "{BURST} acquisitions did not make the counter lead the clock by {LEAD} ms (lead {lead} ms)"
    );

    // Within the lead: the new row's first fence is the clock, below the last fence.
    let got = b.acquire(&m, "b", LEASE).await.expect("acquire");
    assert!(
        i64::try_from(last).expect("fits") > got.now,
        "the acquisition came after the lead ended; the test needs a larger LEAD"
    );
    assert!(
        got.owner.fence < last,
        "within the lead a new row's fence {} should be below the last {last}",
        got.owner.fence
    );

    // After the lead (the database clock past the last fence): greater again. The wait is
    // the subject here: the clock must pass the last fence.
    let ahead = u64::try_from(i64::try_from(last).expect("fits") - got.now).unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(ahead + 2)).await;
    let got = c.acquire(&m, "c", LEASE).await.expect("acquire");
    assert!(
        got.owner.fence > last,
        "after the lead a new row's fence {} should exceed the last {last}",
        got.owner.fence
    );
}
