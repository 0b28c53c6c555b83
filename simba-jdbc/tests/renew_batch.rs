//! Renewals in batches, on each database: concurrent `guard` calls share statements, and
//! each call gets its own row's answer (a row taken over is lost, the others renewed).
#![allow(missing_docs)]
#![cfg_attr(
    not(all(feature = "sqlite", feature = "mysql", feature = "postgres")),
    allow(unused)
)]

mod common;

use std::time::Duration;

use common::SqlHarness;
use futures_util::future::join_all;
use simba_core::backend::{Lease, LeaseStore};

/// Ownerships renewed at once.
const N: usize = 50;
/// The one of them another contender takes over.
const TAKEN: usize = 37;

/// The lease of the mutex that is taken over: short, so that it runs out quickly.
const SHORT: Lease = Lease {
    ttl: Duration::from_millis(100),
    transition: Duration::from_millis(100),
};

/// A lease that outlasts the acquisitions of a whole test on a loaded machine.
const LONG: Lease = Lease {
    ttl: Duration::from_secs(60),
    transition: Duration::from_secs(30),
};

async fn one_taken_over_in_a_batch(h: &SqlHarness) {
    let a = h.store().await.expect("store a");
    let b = h.store().await.expect("store b");
    let names: Vec<String> = (0..N).map(|i| format!("batch-{i}")).collect();
    let mut before = Vec::new();
    for (i, m) in names.iter().enumerate() {
        let lease = if i == TAKEN { SHORT } else { LONG };
        let got = a.acquire(m, "a", lease).await.expect("acquire");
        assert!(got.owner.is_owner("a"), "{m}: {got:?}");
        before.push(got.owner);
    }
    // The short lease runs out on the database's clock; then `b` takes the row over.
    let taken = &names[TAKEN];
    let mut waited = 0;
    loop {
        let seen = b.owner(taken).await.expect("owner");
        if !seen.owner.is_in_lease(seen.now) {
            break;
        }
        waited += 1;
        // Bounded generously: the lease is 200 ms of the database's clock.
        assert!(waited < 500, "the short lease did not run out: {seen:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = b.acquire(taken, "b", LONG).await.expect("take over");
    assert!(took.owner.is_owner("b"), "b did not take over: {took:?}");
    // A renewal sets the lease from the database's `now`: let that move past the
    // acquisitions' millisecond, so that a renewed row is told apart by its ttl_at.
    tokio::time::sleep(Duration::from_millis(20)).await;

    let counts0 = a.renewal_counts();
    // Every call is queued before the batch task first runs (this test's runtime has one
    // thread, and each `guard` queues without awaiting): one batch takes them all.
    let replies = join_all(names.iter().map(|m| a.guard(m, "a", LONG))).await;
    let counts1 = a.renewal_counts();
    assert_eq!(
        counts1.calls - counts0.calls,
        N as u64,
        "{counts0:?} {counts1:?}"
    );
    assert_eq!(
        counts1.batches - counts0.batches,
        1,
        "{N} concurrent renewals did not share one statement: {counts0:?} {counts1:?}"
    );
    for (i, (reply, old)) in replies.into_iter().zip(&before).enumerate() {
        let reply = reply.unwrap_or_else(|e| panic!("renew {i}: {e}"));
        if i == TAKEN {
            assert!(
                !reply.owner.is_owned_by_at("a", reply.now),
                "the row taken over was renewed: {reply:?}"
            );
            assert!(reply.owner.is_owner("b"), "{reply:?}");
        } else {
            assert!(
                reply.owner.is_owned_by_at("a", reply.now),
                "renew {i} lost: {reply:?}"
            );
            assert_eq!(reply.owner.fence, old.fence, "renew {i} changed the fence");
            assert_eq!(reply.owner.acquired_at, old.acquired_at);
            assert!(
                reply.owner.ttl_at > old.ttl_at,
                "renew {i} did not extend the lease: {old:?} → {reply:?}"
            );
        }
    }
    // The row taken over stays `b`'s.
    let seen = a.owner(taken).await.expect("owner");
    assert!(seen.owner.is_owner("b"), "{seen:?}");
    // A renewal of a mutex without a row, in a batch, is an answer too: no owner.
    let none = join_all(["batch-none-1", "batch-none-2"].map(|m| a.guard(m, "a", LONG))).await;
    for r in none {
        let r = r.expect("renew a mutex without a row");
        assert!(!r.owner.is_in_lease(r.now), "{r:?}");
    }
}

/// Many renewals from several tasks at once: fewer statements than calls (counted, not
/// timed), every one answered as owned.
async fn many_concurrent_renewals_share_statements(h: &SqlHarness) {
    let a = h.store().await.expect("store a");
    let names: Vec<String> = (0..200).map(|i| format!("many-{i}")).collect();
    for m in &names {
        let got = a.acquire(m, "a", LONG).await.expect("acquire");
        assert!(got.owner.is_owner("a"), "{got:?}");
    }
    let counts0 = a.renewal_counts();
    let tasks: Vec<_> = names
        .iter()
        .map(|m| {
            let a = a.clone();
            let m = m.clone();
            tokio::spawn(async move { a.guard(&m, "a", LONG).await })
        })
        .collect();
    for t in join_all(tasks).await {
        let r = t.expect("task").expect("renew");
        assert!(r.owner.is_owned_by_at("a", r.now), "{r:?}");
    }
    let counts1 = a.renewal_counts();
    let calls = counts1.calls - counts0.calls;
    let batches = counts1.batches - counts0.batches;
    assert_eq!(calls, 200);
    // At most two batches run at once, and every call that arrives meanwhile joins the
    // next: 200 calls from 200 tasks need a handful of statements, never one each.
    assert!(
        batches * 4 <= calls,
        "{calls} renewals took {batches} batched statements"
    );
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;

    #[tokio::test]
    async fn one_taken_over_in_a_batch_is_lost_alone() {
        one_taken_over_in_a_batch(&SqlHarness::sqlite()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_renewals_share_statements() {
        many_concurrent_renewals_share_statements(&SqlHarness::sqlite()).await;
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;

    #[tokio::test]
    async fn one_taken_over_in_a_batch_is_lost_alone() {
        one_taken_over_in_a_batch(&SqlHarness::mysql().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_renewals_share_statements() {
        many_concurrent_renewals_share_statements(&SqlHarness::mysql().await).await;
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;

    #[tokio::test]
    async fn one_taken_over_in_a_batch_is_lost_alone() {
        one_taken_over_in_a_batch(&SqlHarness::postgres().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_renewals_share_statements() {
        many_concurrent_renewals_share_statements(&SqlHarness::postgres().await).await;
    }
}
