//! Store-level cases: behaviours of a [`LeaseStore`] (and of the lease engine over it) that
//! every lease backend must show, called by each backend's tests with two stores that
//! have their own connections to one backend, as two processes would.
//!
//! Time is the subject of these cases (holds, read intervals), so they sleep on the wall
//! clock; their bounds are generous and say why.

use std::sync::Arc;
use std::time::Duration;

use simba_core::backend::{Lease, LeaseStore};
use simba_core::fault::{FaultStore, Op};
use simba_core::{
    ContendServiceFactory, LeaseConfig, LeaseServiceFactory, Locker, MutexState, SilentRetriever,
};
use tokio::time::{Instant, sleep, timeout};

use crate::suite::{CaseError, CaseResult};

fn check(cond: bool, what: impl FnOnce() -> String) -> CaseResult {
    if cond { Ok(()) } else { Err(CaseError(what())) }
}

/// [`LeaseStore::release_after`]: owner-checked; the mutex stays held by the hold's id
/// (fence and `acquired_at` kept) for the time asked, from everyone — the releaser
/// included, which can neither renew nor release nor take it — and is free by itself
/// afterwards; a zero hold is a release.
pub async fn release_after_contract<S: LeaseStore>(a: &S, b: &S, m: &str) -> CaseResult {
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
pub async fn observer_is_pushed_and_idle<S: LeaseStore + Clone>(
    owner: S,
    observer: S,
    pushes: bool,
    m: &str,
) -> CaseResult {
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
