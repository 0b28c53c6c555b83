//! `simba chaos-contender`: one contender process of `simba-chaos` (simba-test-kit).
//!
//! It loops: acquire, report the ownership to the fenced resource, write under its fence
//! for a few milliseconds (checking before every write that it still owns), then release
//! — or, now and then, exit without releasing, as a crashing process would.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::SocketAddr;
use std::time::Duration;

use simba_core::{LockGuard, Locker, LossReason};
use simba_test_kit::chaos::ResourceClient;

use crate::backend::{Backend, Timing};
use crate::status::{Failure, Outcome, Status};

fn var(name: &str) -> Result<String, Failure> {
    std::env::var(name).map_err(|_| {
        Failure::usage(format!(
            "{name} is not set (chaos-contender is run by simba-chaos)"
        ))
    })
}

fn ms_var(name: &str) -> Result<Duration, Failure> {
    var(name)?
        .parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| Failure::usage(format!("{name} must be a number of milliseconds")))
}

/// The lease timing ordered by `simba-chaos`.
pub(crate) fn timing() -> Result<Timing, Failure> {
    Ok(Timing {
        ttl: Some(ms_var("SIMBA_CHAOS_TTL_MS")?),
        transition: Some(ms_var("SIMBA_CHAOS_TRANSITION_MS")?),
        // Waiters on backends without push look again every 50 ms, so that handoffs happen
        // often enough to test.
        waiter_poll: Some(Duration::from_millis(50)),
        jitter: None,
    })
}

fn roll(n: u64) -> u64 {
    RandomState::new().hash_one(std::time::SystemTime::now()) % n.max(1)
}

fn io_failure(e: std::io::Error) -> Failure {
    Failure::with(Status::Unavailable, e, "the fenced resource")
}

/// What the holder may still count on; an unsafe contender claims an hour.
fn valid(guard: &LockGuard, lease: Duration, unsafe_mode: bool) -> Duration {
    if unsafe_mode {
        Duration::from_secs(3600)
    } else {
        guard.valid_for().unwrap_or(lease)
    }
}

/// Runs the contender loop until killed.
pub(crate) async fn contend(backend: Backend) -> Outcome {
    let addr: SocketAddr = var("SIMBA_CHAOS_RESOURCE")?
        .parse()
        .map_err(|_| Failure::usage("SIMBA_CHAOS_RESOURCE must be host:port"))?;
    let id = var("SIMBA_CHAOS_ID")?;
    let mutex = var("SIMBA_CHAOS_MUTEX")?;
    let unsafe_mode = var("SIMBA_CHAOS_UNSAFE").is_ok_and(|v| v == "1");
    let t = timing()?;
    let lease = t.ttl.unwrap_or_default() + t.transition.unwrap_or_default();
    let mut resource = ResourceClient::connect(addr, &id)
        .await
        .map_err(io_failure)?;
    let locker =
        Locker::new(backend.factory.clone(), &mutex).map_err(|e| Failure::simba(e, "bad mutex"))?;
    loop {
        let guard = locker
            .acquire()
            .await
            .map_err(|e| Failure::simba(e, "acquire"))?;
        let fence = guard.fence();
        resource
            .begin(fence, valid(&guard, lease, unsafe_mode))
            .await
            .map_err(io_failure)?;
        let until = tokio::time::Instant::now() + Duration::from_millis(5 + roll(40));
        let mut lost: Option<LossReason> = None;
        while tokio::time::Instant::now() < until {
            // The check right before the write is what keeps a woken, paused process
            // from writing after its lease: `is_held` looks at the local deadline itself.
            if !unsafe_mode && !guard.is_held() {
                lost = Some(guard.lost().await);
                break;
            }
            let accepted = resource
                .write(fence, valid(&guard, lease, unsafe_mode))
                .await
                .map_err(io_failure)?;
            if !accepted {
                tracing::warn!(fence, "write fenced off by the resource");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        match lost {
            Some(reason) => {
                resource.end(fence, reason).await.map_err(io_failure)?;
                drop(guard);
            }
            None if roll(100) < 3 => {
                // Crash while owning: no release, no END.
                std::process::exit(3);
            }
            None => {
                // Stop believing before the mutex is free for others.
                resource
                    .end(fence, LossReason::Released)
                    .await
                    .map_err(io_failure)?;
                let _ = guard.release().await;
            }
        }
        tokio::time::sleep(Duration::from_millis(roll(20))).await;
    }
}
