//! `simba-chaos soak-worker`: one worker process of a soak.
//!
//! It connects once to the backend (`SIMBA_BACKEND`) and once to the parent's ledger
//! (`SIMBA_SOAK_LEDGER`, as `SIMBA_SOAK_ID`), then runs one task per mutex slot and one
//! observer per `--observe-every` slots, until killed:
//!
//! - slot `i < --shared` contends for the shared mutex `{prefix}_s{i}`, which every worker
//!   contends for too: `acquire_timeout(--acquire-timeout)`, a give-up is counted as a
//!   timeout; holds of `--shared-hold`, pauses of `--shared-idle`;
//! - the other slots churn a mutex of their own (`{prefix}_{worker}_{i}`): acquire, hold
//!   for `--hold`, release, pause for `--idle` (an acquisition that takes a minute is an
//!   error: nobody else contends for it);
//! - an owner tells the ledger `B` with its fence before it acts, writes under its fence
//!   every `--write-every` (checking its guard before each write), and tells `E` before it
//!   releases; a lost ownership is told `E` with its reason;
//! - an observer runs a retrieval service on its slot's mutex for 10–60 s, counting the
//!   owner changes it sees, stops it and starts a new one;
//! - every 5 s it sends its counters and tokio's alive task count (`S`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use simba_core::connect::{ConnectOptions, Connectors};
use simba_core::{
    ContendServiceFactory, Error, LeaseConfig, LockGuard, Locker, LossReason, SilentRetriever,
};
use tokio::time::{Instant, sleep, sleep_until};

use super::ledger::{LedgerClient, reason_word};
use super::{Params, between};

/// The counters a worker reports, by name.
#[derive(Debug, Default)]
struct Counters {
    acquired: AtomicU64,
    timeouts: AtomicU64,
    private_timeouts: AtomicU64,
    lost: AtomicU64,
    release_errors: AtomicU64,
    acquire_errors: AtomicU64,
    ledger_errors: AtomicU64,
    writes_rejected: AtomicU64,
    held: AtomicU64,
    observer_changes: AtomicU64,
    observer_errors: AtomicU64,
    observer_fence_backwards: AtomicU64,
}

impl Counters {
    fn line(&self) -> String {
        let tasks = tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks();
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "S tasks={tasks} held={} acquired={} timeouts={} private_timeouts={} lost={} \
             release_errors={} acquire_errors={} ledger_errors={} writes_rejected={} \
             observer_changes={} observer_errors={} observer_fence_backwards={}",
            get(&self.held),
            get(&self.acquired),
            get(&self.timeouts),
            get(&self.private_timeouts),
            get(&self.lost),
            get(&self.release_errors),
            get(&self.acquire_errors),
            get(&self.ledger_errors),
            get(&self.writes_rejected),
            get(&self.observer_changes),
            get(&self.observer_errors),
            get(&self.observer_fence_backwards),
        )
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

struct Ctx {
    params: Params,
    worker: String,
    factory: Arc<dyn ContendServiceFactory>,
    ledger: LedgerClient,
    counters: Counters,
}

fn var(name: &str) -> Result<String> {
    std::env::var(name)
        .with_context(|| format!("{name} is not set (the worker is started by `simba-chaos soak`)"))
}

/// Runs the worker until killed. Returns only on an error that ends it: the backend or
/// the ledger cannot be reached at the start, or the ledger connection broke.
pub(crate) async fn run(args: &[String]) -> Result<()> {
    let params = Params::parse_worker(args).map_err(anyhow::Error::msg)?;
    let worker = var("SIMBA_SOAK_ID")?;
    let ledger_addr: std::net::SocketAddr = var("SIMBA_SOAK_LEDGER")?
        .parse()
        .context("SIMBA_SOAK_LEDGER must be host:port")?;
    let url = var("SIMBA_BACKEND")?;
    let lease = LeaseConfig {
        request_timeout: params.request_timeout,
        ..LeaseConfig::with_lease(params.ttl, params.transition)
    };
    let connectors = Connectors::new(vec![
        &simba_redis::CONNECTOR,
        &simba_jdbc::CONNECTOR,
        &simba_zookeeper::CONNECTOR,
        &simba_etcd::CONNECTOR,
    ]);
    let connection = connectors
        .connect(&url, &ConnectOptions::new().with_lease(lease))
        .await
        .with_context(|| format!("connecting to {}", connectors.redact(&url)))?;
    let ledger = LedgerClient::connect(ledger_addr, &worker)
        .await
        .context("the ledger")?;
    let ctx = Arc::new(Ctx {
        factory: connection.factory(),
        params,
        worker,
        ledger,
        counters: Counters::default(),
    });
    for i in 0..ctx.params.mutexes {
        tokio::spawn(slot(ctx.clone(), i));
        if ctx.params.observe_every > 0 && i % ctx.params.observe_every == 0 {
            tokio::spawn(observer(ctx.clone(), i));
        }
    }
    loop {
        sleep(Duration::from_secs(5)).await;
        ctx.ledger
            .call(ctx.counters.line())
            .await
            .context("the ledger")?;
        // Keep the connection alive for as long as the process runs.
        let _ = &connection;
    }
}

fn mutex_name(ctx: &Ctx, i: usize) -> String {
    if i < ctx.params.shared {
        format!("{}_s{i}", ctx.params.prefix)
    } else {
        format!("{}_{}_{i}", ctx.params.prefix, ctx.worker)
    }
}

async fn slot(ctx: Arc<Ctx>, i: usize) {
    let shared = i < ctx.params.shared;
    let name = mutex_name(&ctx, i);
    let locker = match Locker::new(ctx.factory.clone(), &name) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(%name, "no locker: {e}");
            bump(&ctx.counters.acquire_errors);
            return;
        }
    };
    let p = &ctx.params;
    let (hold, idle) = if shared {
        (p.shared_hold, p.shared_idle)
    } else {
        (p.hold, p.idle)
    };
    // Spread the first acquisitions over the ramp.
    sleep(between((Duration::ZERO, p.ramp))).await;
    // Nobody else contends for a private mutex: its acquisitions are bounded only against a
    // hang, and one that times out is an error.
    let wait = if shared {
        p.acquire_timeout
    } else {
        PRIVATE_ACQUIRE_BOUND
    };
    loop {
        match locker.acquire_timeout(wait).await {
            Ok(guard) => {
                bump(&ctx.counters.acquired);
                ctx.counters.held.fetch_add(1, Ordering::Relaxed);
                own(&ctx, &name, guard, between(hold)).await;
                ctx.counters.held.fetch_sub(1, Ordering::Relaxed);
            }
            Err(Error::Timeout { .. }) if shared => bump(&ctx.counters.timeouts),
            Err(Error::Timeout { .. }) => {
                tracing::warn!(%name, "an uncontended acquisition timed out");
                bump(&ctx.counters.private_timeouts);
            }
            Err(e) => {
                tracing::warn!(%name, "acquire: {e}");
                bump(&ctx.counters.acquire_errors);
                sleep(Duration::from_secs(1)).await;
            }
        }
        sleep(between(idle)).await;
    }
}

/// The bound of an acquisition of a private mutex.
const PRIVATE_ACQUIRE_BOUND: Duration = Duration::from_secs(60);

fn valid_ms(guard: &LockGuard) -> u128 {
    guard.valid_for().map_or(0, |d| d.as_millis())
}

/// Holds `guard` for `hold`, writing under its fence, and ends it.
async fn own(ctx: &Ctx, name: &str, guard: LockGuard, hold: Duration) {
    let fence = guard.fence();
    let until = Instant::now() + hold;
    let tell = |line: String| async move {
        if let Err(e) = ctx.ledger.call(line).await {
            tracing::error!("the ledger: {e}");
            bump(&ctx.counters.ledger_errors);
            // Without the ledger nothing is checked: end the worker, the parent sees it.
            std::process::exit(75);
        }
    };
    tell(format!("B {name} {fence} {}", valid_ms(&guard))).await;
    let mut lost: Option<LossReason> = None;
    loop {
        // The check right before the write keeps a stalled owner from writing after its
        // lease: `is_held` looks at the local deadline itself.
        if !guard.is_held() {
            lost = Some(guard.lost().await);
            break;
        }
        let line = format!("W {name} {fence} {}", valid_ms(&guard));
        match ctx.ledger.call(line).await {
            Ok(answer) if answer == "REJECT" => {
                tracing::warn!(%name, fence, "write fenced off by the ledger");
                bump(&ctx.counters.writes_rejected);
            }
            Ok(_) => {}
            Err(e) => {
                tracing::error!("the ledger: {e}");
                std::process::exit(75);
            }
        }
        let now = Instant::now();
        if now >= until {
            break;
        }
        let next = (now + ctx.params.write_every).min(until);
        tokio::select! {
            reason = guard.lost() => {
                lost = Some(reason);
                break;
            }
            () = sleep_until(next) => {}
        }
    }
    match lost {
        Some(reason) => {
            tracing::warn!(%name, fence, %reason, "ownership lost while held");
            bump(&ctx.counters.lost);
            tell(format!("E {name} {fence} {}", reason_word(reason))).await;
            drop(guard);
        }
        None => {
            // Stop believing before the mutex is free for others.
            tell(format!("E {name} {fence} released")).await;
            match guard.release().await {
                Ok(()) => {}
                // Ended between the last check and the release: a loss, found late.
                Err(Error::Lost { reason, .. }) => {
                    tracing::warn!(%name, fence, %reason, "ownership lost before its release");
                    bump(&ctx.counters.lost);
                }
                Err(e) => {
                    tracing::warn!(%name, fence, "release: {e}");
                    bump(&ctx.counters.release_errors);
                }
            }
        }
    }
}

/// Observes slot `i`'s mutex with a retrieval service, restarting it every 10–60 s.
async fn observer(ctx: Arc<Ctx>, i: usize) {
    let name = mutex_name(&ctx, i);
    sleep(between((Duration::ZERO, Duration::from_secs(10)))).await;
    loop {
        let svc = match ctx
            .factory
            .create_retrieval_service(&name, Arc::new(SilentRetriever))
        {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(%name, "observer: {e}");
                bump(&ctx.counters.observer_errors);
                sleep(Duration::from_secs(5)).await;
                continue;
            }
        };
        if let Err(e) = svc.start() {
            tracing::warn!(%name, "observer start: {e}");
            bump(&ctx.counters.observer_errors);
            sleep(Duration::from_secs(5)).await;
            continue;
        }
        let mut rx = svc.state();
        let until = Instant::now() + between((Duration::from_secs(10), Duration::from_secs(60)));
        let mut last_fence = 0;
        loop {
            tokio::select! {
                changed = rx.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let fence = rx.borrow_and_update().after.fence;
                    bump(&ctx.counters.observer_changes);
                    if fence != 0 && fence < last_fence {
                        bump(&ctx.counters.observer_fence_backwards);
                    }
                    last_fence = last_fence.max(fence);
                }
                () = sleep_until(until) => break,
            }
        }
        if let Err(e) = svc.stop().await {
            tracing::warn!(%name, "observer stop: {e}");
            bump(&ctx.counters.observer_errors);
        }
    }
}
