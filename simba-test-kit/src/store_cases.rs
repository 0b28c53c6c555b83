//! Store-level cases: the [`LeaseStore`] contract, call by call, that every lease backend
//! must keep (memory, Redis, MySQL/MariaDB, PostgreSQL, SQLite). Each case takes a
//! [`StoreSource`] — a backend that hands out stores with their own connections, as
//! separate processes would have — and returns `Ok(())` or a [`CaseError`] saying what
//! the store did wrong. [`store_conformance_tests!`](crate::store_conformance_tests)
//! expands them into one `#[tokio::test]` per case; [`STORE_CASES`] names them.
//!
//! Some cases have time as their subject (lease ends, holds, read intervals): they sleep
//! or poll on the wall clock, and their bounds are generous and say why.

use std::sync::Arc;
use std::time::Duration;

use simba_core::backend::{BoxFuture, Lease, LeaseReply, LeaseStore, StoreEvent};
use simba_core::fault::{FaultStore, Op};
use simba_core::{
    ContendServiceFactory, LeaseConfig, LeaseServiceFactory, Locker, MutexState, SilentRetriever,
};
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep, timeout};

use crate::suite::{CaseError, CaseResult, SetupError};
use crate::support::unique_name;

/// A lease backend as the store-level cases see it.
pub trait StoreSource: Send + Sync {
    /// The store type; clones share one store's connections.
    type Store: LeaseStore + Clone + 'static;

    /// The backend's name in failure messages.
    fn name(&self) -> String;

    /// A new store over the same backend and namespace (table, key prefix) as every other
    /// store of this source, with its own connections.
    fn store(&self) -> BoxFuture<'_, Result<Self::Store, SetupError>>;

    /// Whether the backend pushes acquisitions and releases to observers (Redis pub/sub,
    /// PostgreSQL `NOTIFY`, the in-memory store), rather than leaving them to read.
    fn pushes_release(&self) -> bool;
}

/// The names of every store-level case, in the order
/// [`store_conformance_tests!`](crate::store_conformance_tests) runs them.
pub const STORE_CASES: &[&str] = crate::__store_cases!(names);

/// Every store-level case, written once: `$mode` picks what to expand them into.
#[doc(hidden)]
#[macro_export]
macro_rules! __store_cases {
    ($($mode:tt)*) => {
        $crate::__expand_cases! { store_cases, $($mode)*;
            acquire_renew_release, stale_calls_change_nothing, lease_ends_on_backend_clock,
            fences_strictly_increase, acquire_is_atomic, release_after_contract,
            waiter_is_woken_on_release, observer_is_pushed_and_idle
        }
    };
}

/// Expands every store-level case into one `#[tokio::test]`.
///
/// The argument is an expression evaluated inside each (async) test that yields a value
/// implementing [`StoreSource`]; it may `.await`.
///
/// ```no_run
/// # mod my_backend {
/// #     pub struct MySource;
/// #     impl MySource {
/// #         pub async fn start() -> simba_test_kit::memory::MemoryHarness {
/// #             simba_test_kit::memory::MemoryHarness::memory()
/// #         }
/// #     }
/// # }
/// # use my_backend::MySource;
/// simba_test_kit::store_conformance_tests!(MySource::start().await);
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! store_conformance_tests {
    ($source:expr) => {
        $crate::__store_cases!(tests $source);
    };
}

/// The lease most cases ask for: long enough that a loaded machine's round trips do not
/// end it halfway through a case.
const LEASE: Lease = Lease {
    ttl: Duration::from_secs(5),
    transition: Duration::from_secs(2),
};

/// A short lease, for the cases that wait for one to end.
const SHORT: Lease = Lease {
    ttl: Duration::from_millis(1000),
    transition: Duration::from_millis(500),
};

fn check(cond: bool, what: impl FnOnce() -> String) -> CaseResult {
    if cond { Ok(()) } else { Err(CaseError(what())) }
}

async fn two<S: StoreSource>(src: &S) -> Result<(S::Store, S::Store), CaseError> {
    Ok((src.store().await?, src.store().await?))
}

/// Milliseconds since the Unix epoch on this machine's clock.
fn local_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Polls `store.owner(m)` every 20 ms until `done` says so, for at most `bound`.
async fn poll_owner<S: LeaseStore>(
    store: &S,
    m: &str,
    bound: Duration,
    what: &str,
    mut done: impl FnMut(&LeaseReply) -> bool,
) -> Result<LeaseReply, CaseError> {
    let start = Instant::now();
    loop {
        let r = store.owner(m).await?;
        if done(&r) {
            return Ok(r);
        }
        check(start.elapsed() < bound, || {
            format!("{what}: not within {bound:?}; the owner is {:?}", r.owner)
        })?;
        sleep(Duration::from_millis(20)).await;
    }
}

/// `acquire` makes a contender the owner of a free mutex, with a fence and times on the
/// backend's clock (`ttl_at = acquired_at + ttl`, `transition_at = ttl_at + transition`);
/// another contender's `acquire`, `guard` and `release` leave a held mutex with its owner;
/// the owner's `acquire` again and `guard` renew it, keeping the fence and `acquired_at`;
/// the owner's `release` frees it once (a replayed release frees nothing), and the next
/// owner's fence is larger.
pub async fn acquire_renew_release<S: StoreSource>(src: &S) -> CaseResult {
    let (a, b) = two(src).await?;
    let m = &unique_name("acquire_renew_release");
    let free = a.owner(m).await?;
    check(!free.owner.has_owner(), || {
        format!("a new mutex has an owner: {free:?}")
    })?;
    // The reply's time is the backend's clock in epoch milliseconds; on one machine it is
    // this machine's clock (seconds or microseconds would be far off).
    let skew = (free.now - local_now_ms()).abs();
    check(skew < 5_000, || {
        format!("the reply's time is {skew} ms from this machine's clock: {free:?}")
    })?;

    let first = a.acquire(m, "a", LEASE).await?;
    let o = first.owner.clone();
    check(o.is_owned_by_at("a", first.now) && o.fence > 0, || {
        format!("a did not acquire a free mutex with a fence: {first:?}")
    })?;
    check(
        o.ttl_at - o.acquired_at == LEASE.ttl_ms()
            && o.transition_at - o.ttl_at == LEASE.transition_ms(),
        || format!("the times are not acquired_at + ttl (5 s), + transition (2 s): {o:?}"),
    )?;
    // `acquired_at` is the backend's `now` for the call; the reply's `now` is that or
    // (read in a later statement) a little later.
    let lag = first.now - o.acquired_at;
    check((0..=1000).contains(&lag), || {
        format!("acquired_at is {lag} ms before the reply's time: {first:?}")
    })?;

    let taken = b.acquire(m, "b", LEASE).await?;
    check(
        taken.owner.is_owner("a") && taken.owner.fence == o.fence,
        || format!("b's acquire did not leave a's mutex with a: {taken:?}"),
    )?;
    let guarded = b.guard(m, "b", LEASE).await?;
    check(guarded.owner.is_owner("a"), || {
        format!("b's guard took a mutex a holds: {guarded:?}")
    })?;
    check(!b.release(m, "b").await?, || {
        "b's release freed a mutex a holds".into()
    })?;
    let still = b.owner(m).await?;
    check(still.owner == o, || {
        format!(
            "a's ownership changed under b's calls: {o:?} -> {:?}",
            still.owner
        )
    })?;

    for (how, r) in [
        ("acquire", a.acquire(m, "a", LEASE).await?),
        ("guard", a.guard(m, "a", LEASE).await?),
    ] {
        let n = &r.owner;
        check(
            n.is_owned_by_at("a", r.now)
                && n.fence == o.fence
                && n.acquired_at == o.acquired_at
                && n.ttl_at >= o.ttl_at,
            || format!("renewal by {how} did not keep the fence and acquired_at: {o:?} -> {r:?}"),
        )?;
    }

    check(a.release(m, "a").await?, || {
        "the owner's release said it did not own the mutex".into()
    })?;
    check(!a.release(m, "a").await?, || {
        "a replayed release freed the mutex again".into()
    })?;
    let after = b.owner(m).await?;
    check(!after.owner.has_owner(), || {
        format!("the mutex is not free after the release: {after:?}")
    })?;
    let next = b.acquire(m, "b", LEASE).await?;
    check(
        next.owner.is_owned_by_at("b", next.now) && next.owner.fence > o.fence,
        || {
            format!(
                "b's acquisition after the release: {next:?} (a had fence {})",
                o.fence
            )
        },
    )?;
    check(b.release(m, "b").await?, || "b's release failed".into())
}

/// Calls by a previous owner change nothing once another contender owns: its `release`,
/// `release_after`, `guard` and `acquire` leave the new ownership as it was.
pub async fn stale_calls_change_nothing<S: StoreSource>(src: &S) -> CaseResult {
    let (a, b) = two(src).await?;
    let m = &unique_name("stale_calls_change_nothing");
    let first = a.acquire(m, "a", LEASE).await?;
    check(first.owner.is_owner("a"), || {
        format!("a did not acquire: {first:?}")
    })?;
    check(a.release(m, "a").await?, || "a's release failed".into())?;
    let second = b.acquire(m, "b", LEASE).await?.owner;
    check(
        second.is_owner("b") && second.fence > first.owner.fence,
        || format!("b did not acquire after a's release with a larger fence: {second:?}"),
    )?;
    check(!a.release(m, "a").await?, || {
        "a stale release said it freed the mutex".into()
    })?;
    check(
        !a.release_after(m, "a", Duration::from_secs(1)).await?,
        || "a stale release_after said it held the mutex".into(),
    )?;
    let g = a.guard(m, "a", LEASE).await?;
    check(g.owner == second, || {
        format!("a stale guard changed b's ownership: {second:?} -> {g:?}")
    })?;
    let r = a.acquire(m, "a", LEASE).await?;
    check(r.owner == second, || {
        format!("a's acquire changed b's ownership: {second:?} -> {r:?}")
    })?;
    let now = b.owner(m).await?;
    check(now.owner == second, || {
        format!("b's ownership changed under a's stale calls: {second:?} -> {now:?}")
    })?;
    check(b.release(m, "b").await?, || "b's release failed".into())
}

/// A lease nobody renews ends at its `transition_at` on the backend's clock, not before;
/// then anyone may acquire, with a larger fence — the old owner too: taking back one's
/// own ended lease is a new acquisition (new fence, new `acquired_at`), and a `guard` does
/// not quietly revive it under the old fence.
pub async fn lease_ends_on_backend_clock<S: StoreSource>(src: &S) -> CaseResult {
    let (a, b) = two(src).await?;
    let m = &unique_name("lease_ends_on_backend_clock");
    let first = a.acquire(m, "a", SHORT).await?;
    let o = first.owner.clone();
    check(o.is_owner("a"), || format!("a did not acquire: {first:?}"))?;
    // 1.5 s leases; 10 s is generous for a loaded machine's reads.
    let ended = poll_owner(&b, m, Duration::from_secs(10), "the lease's end", |r| {
        !r.owner.is_owner("a")
    })
    .await?;
    check(!ended.owner.has_owner(), || {
        format!("someone else owns an unrenewed lease: {ended:?}")
    })?;
    check(ended.now >= o.transition_at, || {
        format!(
            "the lease ended {} ms before its transition_at (backend clock): {o:?}",
            o.transition_at - ended.now
        )
    })?;
    let g = a.guard(m, "a", SHORT).await?;
    check(!g.owner.is_owner("a") || g.owner.fence > o.fence, || {
        format!("a's guard revived an ended lease under its old fence: {g:?}")
    })?;
    let again = a.acquire(m, "a", SHORT).await?.owner;
    check(
        again.is_owner("a") && again.fence > o.fence && again.acquired_at > o.acquired_at,
        || format!("taking back an ended lease is not a new acquisition: {o:?} -> {again:?}"),
    )?;
    check(a.release(m, "a").await?, || "a's release failed".into())?;
    let next = b.acquire(m, "b", SHORT).await?.owner;
    check(next.is_owner("b") && next.fence > again.fence, || {
        format!("b's acquisition: {next:?} after fence {}", again.fence)
    })?;
    check(b.release(m, "b").await?, || "b's release failed".into())
}

/// Twenty acquisitions by three contenders over two stores: each fence is larger than
/// every one before, and renewals keep it.
pub async fn fences_strictly_increase<S: StoreSource>(src: &S) -> CaseResult {
    let (a, b) = two(src).await?;
    let m = &unique_name("fences_strictly_increase");
    let mut last = 0;
    for i in 0..20_usize {
        let s = if i.is_multiple_of(2) { &a } else { &b };
        let id = format!("c{}", i % 3);
        let r = s.acquire(m, &id, LEASE).await?.owner;
        check(r.is_owner(&id) && r.fence > last, || {
            format!("acquisition {i} by {id}: {r:?} after fence {last}")
        })?;
        let g = s.guard(m, &id, LEASE).await?.owner;
        check(g.is_owner(&id) && g.fence == r.fence, || {
            format!("the renewal changed the fence: {r:?} -> {g:?}")
        })?;
        last = r.fence;
        check(s.release(m, &id).await?, || {
            format!("{id}'s release failed")
        })?;
    }
    Ok(())
}

/// Eight contenders over two stores acquire a free mutex at once, five times (a new mutex
/// each time): exactly
/// one wins each time, and no reply names another owner than the winner. The losers
/// then `leave`.
pub async fn acquire_is_atomic<S: StoreSource>(src: &S) -> CaseResult {
    let (a, b) = two(src).await?;
    for round in 0..5 {
        // A new mutex each round: a store with a wait queue may still be handing the last
        // round's mutex to a queued loser (SQLite cannot cancel a lock-file wait at once).
        let m = unique_name("acquire_is_atomic");
        let mut racers = JoinSet::new();
        for i in 0..8_usize {
            let s = if i.is_multiple_of(2) {
                a.clone()
            } else {
                b.clone()
            };
            let (m, id) = (m.clone(), format!("r{round}-{i}"));
            racers.spawn(async move {
                let reply = s.acquire(&m, &id, LEASE).await;
                (id, s, reply)
            });
        }
        // Each racer's id, the store it raced on, and the owner its reply named.
        let mut replies = Vec::new();
        while let Some(joined) = racers.join_next().await {
            let (id, s, reply) = joined.map_err(|e| CaseError(format!("a racer panicked: {e}")))?;
            replies.push((id, s, reply?.owner));
        }
        let winners: Vec<_> = replies.iter().filter(|(id, _, o)| o.is_owner(id)).collect();
        check(winners.len() == 1, || {
            let ids: Vec<&str> = winners.iter().map(|(id, _, _)| id.as_str()).collect();
            format!("round {round}: {} winners: {ids:?}", winners.len())
        })?;
        let (winner, winner_store, _) = winners[0];
        // A store with a wait queue may answer a loser with an unnamed holder instead.
        check(
            replies
                .iter()
                .all(|(_, _, o)| o.is_owner(winner) || o.owner_id.is_empty()),
            || {
                let replies: Vec<_> = replies.iter().map(|(id, _, o)| (id, o)).collect();
                format!("round {round}: replies name other owners than {winner}: {replies:?}")
            },
        )?;
        // The losers stop waiting (a store with a wait queue would hand them the mutex
        // next), then the winner releases.
        for (id, s, _) in replies.iter().filter(|(id, _, _)| id != winner) {
            s.leave(&m, id).await?;
        }
        check(winner_store.release(&m, winner).await?, || {
            format!("round {round}: the winner's release failed")
        })?;
    }
    Ok(())
}

/// A waiter that subscribed and was refused is woken when the owner releases — well
/// before the lease would end. Stores that cannot push (`subscribe` gives `None`) poll
/// instead and pass, unless the source says it pushes.
pub async fn waiter_is_woken_on_release<S: StoreSource>(src: &S) -> CaseResult {
    let (a, b) = two(src).await?;
    let m = &unique_name("waiter_is_woken_on_release");
    // A long lease: a waiter that only looked again when the lease ends would wait 16 s.
    let long = Lease {
        ttl: Duration::from_secs(10),
        transition: Duration::from_secs(6),
    };
    let got = a.acquire(m, "a", long).await?;
    check(got.owner.is_owner("a"), || {
        format!("a did not acquire: {got:?}")
    })?;
    let Some(mut rx) = b.subscribe(m, "w").await? else {
        return check(!src.pushes_release(), || {
            format!("{} pushes, but subscribe gave no channel", src.name())
        });
    };
    let refused = b.acquire(m, "w", long).await?;
    check(refused.owner.is_owner("a"), || {
        format!("the waiter's acquire did not leave the mutex with a: {refused:?}")
    })?;
    check(a.release(m, "a").await?, || "a's release failed".into())?;
    // A push or a native lock grant arrives in milliseconds; 5 s is generous for a loaded
    // machine and still far below the lease's 16 s.
    let bound = Duration::from_secs(5);
    let woken = timeout(bound, async {
        loop {
            match rx.recv().await {
                Some(StoreEvent::Released) => return Ok(()),
                // Read-again notices and others' acquisitions are not the wake-up.
                Some(_) => continue,
                None => return Err(CaseError("the waiter's channel closed".into())),
            }
        }
    })
    .await
    .map_err(|_| CaseError(format!("the waiter was not woken within {bound:?}")))?;
    woken?;
    let r = b.acquire(m, "w", long).await?;
    check(r.owner.is_owner("w"), || {
        format!("the woken waiter could not acquire: {r:?}")
    })?;
    check(b.release(m, "w").await?, || {
        "the waiter's release failed".into()
    })
}

/// [`LeaseStore::release_after`]: owner-checked; the mutex stays held by the hold's id
/// (fence and `acquired_at` kept) for the time asked, from everyone — the releaser
/// included, which can neither renew nor release nor take it — and is free by itself
/// afterwards; a zero hold is a release.
pub async fn release_after_contract<S: StoreSource>(src: &S) -> CaseResult {
    let (a, b) = two(src).await?;
    let (a, b, m) = (&a, &b, &unique_name("release_after_contract"));
    let lease = Lease {
        ttl: Duration::from_secs(2),
        transition: Duration::from_secs(1),
    };
    let hold = Duration::from_millis(1500);
    let got = a.acquire(m, "a", lease).await?.owner;
    check(got.is_owner("a"), || format!("a did not acquire: {got:?}"))?;
    check(!b.release_after(m, "b", hold).await?, || {
        "a non-owner's release_after succeeded".into()
    })?;
    let sent = Instant::now();
    check(a.release_after(m, "a", hold).await?, || {
        "the owner's release_after said it did not own the mutex".into()
    })?;
    let reply = b.owner(m).await?;
    let held = &reply.owner;
    check(held.held_after_release_by() == Some("a"), || {
        format!("not held for a after the release: {held:?}")
    })?;
    check(
        held.fence == got.fence && held.acquired_at == got.acquired_at,
        || format!("the hold changed the fence or acquired_at: {got:?} -> {held:?}"),
    )?;
    let left = held.transition_at - reply.now;
    // The hold ends 1500 ms after the store evaluated the call; this read came a little
    // later (a round trip at most, bounded generously for a loaded machine).
    check(
        held.ttl_at == held.transition_at && (500..=1500).contains(&left),
        || format!("the hold ends in {left} ms, not ~1500 ms: {held:?}"),
    )?;
    for (who, s) in [("a", a), ("b", b)] {
        let r = s.acquire(m, who, lease).await?.owner;
        check(!r.is_owner(who), || {
            format!("{who} took a held mutex: {r:?}")
        })?;
        let r = s.guard(m, who, lease).await?.owner;
        check(!r.is_owner(who), || {
            format!("{who} renewed a held mutex: {r:?}")
        })?;
    }
    check(!a.release(m, "a").await?, || {
        "the releaser released its hold".into()
    })?;
    check(!a.release_after(m, "a", hold).await?, || {
        "release_after ran twice".into()
    })?;
    // Free by itself when the hold ends, not before.
    let free_at = loop {
        let r = b.owner(m).await?;
        if !r.owner.has_owner() {
            break sent.elapsed();
        }
        check(sent.elapsed() < Duration::from_secs(10), || {
            format!("still held 10 s after a 1.5 s hold: {:?}", r.owner)
        })?;
        sleep(Duration::from_millis(20)).await;
    };
    check(free_at >= hold - Duration::from_millis(20), || {
        format!("free {free_at:?} after a hold of {hold:?}")
    })?;
    let next = b.acquire(m, "b", lease).await?.owner;
    check(next.is_owner("b") && next.fence > got.fence, || {
        format!("b could not take the mutex after the hold: {next:?}")
    })?;
    check(b.release_after(m, "b", Duration::ZERO).await?, || {
        "a zero hold by the owner failed".into()
    })?;
    let after = a.owner(m).await?.owner;
    check(!after.has_owner(), || {
        format!("a zero hold did not release: {after:?}")
    })?;
    Ok(())
}

/// A retrieval service (observer) over `observer`: on a free mutex it reads a few times,
/// not in a loop; it sees an acquisition and an early release by a contender over `owner`
/// at once where the store pushes (`pushes`), else within its read interval.
pub async fn observer_is_pushed_and_idle<S: StoreSource>(src: &S) -> CaseResult {
    let (owner, observer) = two(src).await?;
    let (pushes, m) = (
        src.pushes_release(),
        &unique_name("observer_is_pushed_and_idle"),
    );
    // Long leases: an observer that only looked when a lease ends would see the release
    // 16 s late.
    let config = LeaseConfig {
        request_timeout: Duration::from_secs(2),
        ..LeaseConfig::with_lease(Duration::from_secs(10), Duration::from_secs(6))
    };
    let counted = FaultStore::new(observer);
    let calls = counted.control();
    let f = LeaseServiceFactory::new(counted, config.clone())?;
    let r = f.create_retrieval_service(m, Arc::new(SilentRetriever))?;
    r.start()?;
    let mut state = r.state();
    sleep(Duration::from_secs(2)).await;
    let idle = calls.calls(Op::Owner);
    // A read at the start, one after subscribing, then one per max(ttl / 2, 500 ms) = 5 s.
    check(idle <= 4, || {
        format!("{idle} owner reads in 2 s on a free mutex (a loop?)")
    })?;
    // Pushed: a few hundred ms is generous for a message on a loaded machine. Else the
    // observer reads every 5 s.
    let bound = if pushes {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(5) + Duration::from_millis(1500)
    };
    let of: Arc<dyn ContendServiceFactory> = Arc::new(LeaseServiceFactory::new(owner, config)?);
    let locker = Locker::new(of, m)?;
    let guard = locker.acquire().await?;
    let id = guard.contender_id().to_owned();
    let seen = |pred: Box<dyn FnMut(&MutexState) -> bool + Send>| {
        let mut state = state.clone();
        async move { timeout(bound, state.wait_for(pred)).await.is_ok() }
    };
    let t0 = Instant::now();
    let acquired = seen(Box::new(move |s| s.after.owner_id == id)).await;
    check(acquired, || {
        format!("the observer did not see the acquisition within {bound:?}")
    })?;
    let took_acquired = t0.elapsed();
    guard.release().await?;
    let t0 = Instant::now();
    let released = seen(Box::new(|s| !s.after.has_owner())).await;
    check(released, || {
        format!(
            "the observer did not see the release within {bound:?} (the lease would end \
             16 s later)"
        )
    })?;
    let took_released = t0.elapsed();
    let total = calls.calls(Op::Owner);
    tracing::info!(
        pushes,
        idle_reads_2s = idle,
        reads = total,
        ?took_acquired,
        ?took_released,
        "observer"
    );
    let _ = state.borrow_and_update();
    r.stop().await?;
    Ok(())
}
