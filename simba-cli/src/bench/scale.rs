//! Scale: many mutexes held by one process, and many waiters on one mutex.
//!
//! Held mutexes: `--scale-mutexes` contend services of one factory (one connection set)
//! acquire a mutex each and keep it for two ttls; reported are the connections the
//! factory uses, renewals per second (backend calls counted by the services), and the
//! process's resident memory.
//!
//! Waiters: `--scale-waiters` contend services of one factory wait on one mutex; the
//! owner releases it a number of times. Reported are the wake-ups per release (backend
//! calls the waiters made between a release and the quiet after the next acquisition) and
//! the handoff latency (the release returning to the next owner's `on_acquired`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use futures_util::future::join_all;
use serde_json::json;
use simba_core::connect::Connection;
use simba_core::{ContendService, Contender, MutexState, SilentContender};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::stats::{self, Samples};
use super::{Ctx, Floors, Row, Section, ms, num, us};
use crate::backend::{Backend, LeaseArgs};
use crate::duration::show;

/// Services started at once; the next batch starts when this one is settled.
const BATCH: usize = 250;

/// Bound of one batch settling (all held, or all having made their first call).
const BATCH_LIMIT: Duration = Duration::from_secs(120);

/// Releases measured with many waiters.
const RELEASES: usize = 20;

/// Activity is over when no waiter made a call for this long.
const QUIET: Duration = Duration::from_millis(30);

/// The longest wait for the quiet after a handoff.
const SETTLE_LIMIT: Duration = Duration::from_secs(5);

pub(super) async fn run(ctx: &Ctx, main: &Backend, floors: &Floors) -> anyhow::Result<Section> {
    let mut s = Section::default();
    held(ctx, main, &mut s).await?;
    waiters(ctx, floors, &mut s).await?;
    Ok(s)
}

type Services = Vec<Arc<dyn ContendService>>;

fn attempts(services: &[Arc<dyn ContendService>]) -> u64 {
    services.iter().map(|s| s.status().borrow().attempts).sum()
}

/// The connection count once connections closed by earlier scenarios are gone (closing
/// happens in the background): two reads 100 ms apart that agree, within 3 s.
async fn settled_connections(conn: &dyn Connection) -> Option<usize> {
    let mut last = conn.server_connections().await?;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = conn.server_connections().await?;
        if now == last {
            break;
        }
        last = now;
    }
    Some(last)
}

/// Starts `services` in batches, each settled by `settled` before the next starts.
async fn start_all(
    services: &[Arc<dyn ContendService>],
    settled: impl Fn(&simba_core::ContenderStatus) -> bool + Copy + Send + Sync,
) -> anyhow::Result<()> {
    for batch in services.chunks(BATCH) {
        for s in batch {
            s.start()?;
        }
        let waits = batch.iter().map(|s| async move {
            let mut rx = s.status();
            rx.wait_for(|st| settled(st)).await.map(drop)
        });
        tokio::time::timeout(BATCH_LIMIT, join_all(waits))
            .await
            .context("services did not settle in time")?;
    }
    Ok(())
}

async fn stop_all(services: &[Arc<dyn ContendService>]) {
    for batch in services.chunks(BATCH) {
        join_all(batch.iter().map(|s| s.stop())).await;
    }
}

async fn held(ctx: &Ctx, main: &Backend, s: &mut Section) -> anyhow::Result<()> {
    let n = ctx.args.scale_mutexes as usize;
    let ttl = ctx.args.scale_ttl;
    let transition = Duration::from_millis((ttl / 2).as_millis() as u64);
    ctx.progress(format!("scale: {n} mutexes held by one process"));
    let rss0 = stats::rss_mib();
    let conn0 = settled_connections(main.conn.as_ref()).await;
    let b = ctx
        .connect(LeaseArgs {
            ttl: Some(ttl),
            transition: Some(transition),
            ..ctx.timing()
        })
        .await?;
    let conn_connected = main.conn.server_connections().await;
    let services: Services = (0..n)
        .map(|i| {
            b.factory().create_contend_service(
                &ctx.mutex(&format!("scale-{i}")),
                Arc::new(SilentContender),
            )
        })
        .collect::<simba_core::Result<_>>()?;
    let t0 = Instant::now();
    let started = start_all(&services, |st| st.held.is_some() || !st.running).await;
    if let Err(e) = started {
        stop_all(&services).await;
        return Err(e);
    }
    let acquired_in = t0.elapsed();
    let conn1 = main.conn.server_connections().await;
    let rss1 = stats::rss_mib();

    let window = ttl * 2;
    let a0 = attempts(&services);
    let w0 = Instant::now();
    tokio::time::sleep(window).await;
    let a1 = attempts(&services);
    let window_s = w0.elapsed().as_secs_f64();
    let conn_held = max_of(conn1, main.conn.server_connections().await);
    let rss2 = stats::rss_mib();
    let rss = max_of(rss1, rss2);
    let (mut owning, mut suspect, mut lost) = (0usize, 0usize, 0usize);
    for svc in &services {
        let st = svc.status().borrow().clone();
        if st.owns_now() {
            owning += 1;
        }
        if st.held.is_some_and(|h| h.suspect) {
            suspect += 1;
        }
        if st.last_loss.is_some() {
            lost += 1;
        }
    }
    ctx.progress(format!("scale: stopping {n} services"));
    stop_all(&services).await;
    drop(services);

    let renews = a1.saturating_sub(a0) as f64;
    let renew_per_s = renews / window_s;
    let per_mutex_per_ttl = renews / n as f64 / (window_s / ttl.as_secs_f64());
    let used = match (conn0, conn_held) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    for (k, v) in [
        ("mutexes", json!(n)),
        ("ttl_ms", ms(ttl)),
        ("transition_ms", ms(transition)),
        ("acquire_all_s", num(Some(acquired_in.as_secs_f64()))),
        ("connections", json!(used)),
        ("connections_before", json!(conn0)),
        ("connections_connected", json!(conn_connected)),
        ("connections_after", json!(conn_held)),
        ("connections_configured", json!(b.conn.connections())),
        ("renew_ops_per_s", num(Some(renew_per_s))),
        ("renew_per_mutex_per_ttl", num(Some(per_mutex_per_ttl))),
        ("renew_window_s", num(Some(window_s))),
        ("owning_after_window", json!(owning)),
        ("suspect_after_window", json!(suspect)),
        ("lost", json!(lost)),
        ("rss_mb", num(rss)),
        ("rss_before_mb", num(rss0)),
        ("rss_all_acquired_mb", num(rss1)),
        ("rss_after_window_mb", num(rss2)),
        ("rss_delta_mb", num(rss.zip(rss0).map(|(a, b)| a - b))),
    ] {
        s.json.insert(k.into(), v);
    }
    let mib = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1} MiB"));
    s.rows.push(Row::new(
        format!("{n} held: connections"),
        used.map_or_else(|| "-".to_owned(), |u| u.to_string()),
        match (conn0, conn_held) {
            (Some(a), Some(b)) => format!("CLIENT LIST {a} before, {b} with all held"),
            _ => b.conn.connections(),
        },
    ));
    s.rows.push(Row::new(
        format!("{n} held: renewals per second"),
        format!("{renew_per_s:.0}"),
        format!(
            "{per_mutex_per_ttl:.2} per mutex per ttl ({}); all acquired in {:.1} s; {owning} \
             owning, {suspect} suspect, {lost} lost after {window_s:.1} s",
            show(ttl),
            acquired_in.as_secs_f64()
        ),
    ));
    s.rows.push(Row::new(
        format!("{n} held: resident memory"),
        mib(rss),
        format!("{} before (VmRSS of the bench process)", mib(rss0)),
    ));
    Ok(())
}

fn max_of<T: PartialOrd>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if b > a { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// Tells the scenario which waiter acquired, and when.
struct Probe {
    index: usize,
    tx: mpsc::UnboundedSender<(usize, Instant)>,
}

impl Contender for Probe {
    fn on_acquired(&self, _state: &MutexState) {
        let _ = self.tx.send((self.index, Instant::now()));
    }
}

async fn waiters(ctx: &Ctx, floors: &Floors, s: &mut Section) -> anyhow::Result<()> {
    let w = ctx.args.scale_waiters as usize;
    ctx.progress(format!("scale: {w} waiters on one mutex"));
    let b = ctx
        .connect(LeaseArgs {
            waiter_poll: Some(ctx.args.scale_poll),
            ..LeaseArgs::default()
        })
        .await?;
    let mutex = ctx.mutex("scale-waiters");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let owner: Arc<dyn ContendService> = b.factory().create_contend_service(
        &mutex,
        Arc::new(Probe {
            index: usize::MAX,
            tx: tx.clone(),
        }),
    )?;
    start_all(std::slice::from_ref(&owner), |st| {
        st.held.is_some() || !st.running
    })
    .await?;
    if rx.recv().await.map(|(i, _)| i) != Some(usize::MAX) {
        bail!("the first owner did not acquire");
    }
    let waiters: Services = (0..w)
        .map(|index| {
            b.factory().create_contend_service(
                &mutex,
                Arc::new(Probe {
                    index,
                    tx: tx.clone(),
                }),
            )
        })
        .collect::<simba_core::Result<_>>()?;
    // Background calls are counted over a whole poll period where waiters poll.
    let idle = if b.polls() {
        ctx.args.scale_poll + Duration::from_millis(100)
    } else {
        Duration::from_millis(300)
    };
    let result = handoffs(owner, &waiters, &mut rx, idle, b.polls()).await;
    stop_all(&waiters).await;
    let (wakeups, handoff, background) = result?;

    let polls = b.polls();
    for (k, v) in [
        ("waiters", json!(w)),
        ("releases", json!(handoff.len())),
        ("wakeups_per_release", num(wakeups.mean())),
        ("wakeups_per_release_max", num(wakeups.max())),
        ("background_calls_per_s", num(Some(background))),
        ("waiter_handoff_p50_us", num(handoff.p50())),
        ("waiter_handoff_p99_us", num(handoff.p99())),
        (
            "waiters_poll_ms",
            if polls {
                json!(ctx.args.scale_poll.as_millis() as u64)
            } else {
                json!(null)
            },
        ),
    ] {
        s.json.insert(k.into(), v);
    }
    s.rows.push(Row::new(
        format!("{w} waiters: wake-ups per release"),
        wakeups.mean().map_or("-".to_owned(), |m| {
            format!("{m:.1} (max {:.0})", wakeups.max().unwrap_or(0.0))
        }),
        if polls {
            format!(
                "{} releases; waiters poll every {} ({background:.0} calls/s without \
                 releases): calls from the release to the next acquisition",
                handoff.len(),
                show(ctx.args.scale_poll)
            )
        } else {
            format!("{} releases; 1 is ideal", handoff.len())
        },
    ));
    s.rows.push(Row::new(
        format!("{w} waiters: handoff p50 / p99"),
        format!("{} / {}", us(handoff.p50()), us(handoff.p99())),
        format!(
            "release returned → next owner's on_acquired; {} p50 {}",
            floors.rtt_what,
            us(floors.rtt.p50())
        ),
    ));
    Ok(())
}

/// Waits until the waiters made no call for [`QUIET`] (at most [`SETTLE_LIMIT`]); returns
/// their call count then.
async fn settle(waiters: &[Arc<dyn ContendService>]) -> u64 {
    let from = Instant::now();
    let mut last = attempts(waiters);
    let mut quiet_since = Instant::now();
    while quiet_since.elapsed() < QUIET && from.elapsed() < SETTLE_LIMIT {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let now = attempts(waiters);
        if now != last {
            last = now;
            quiet_since = Instant::now();
        }
    }
    last
}

/// Releases `RELEASES` times; returns wake-ups per release, handoff latencies (µs) and the
/// background call rate of the waiters (polling backends).
async fn handoffs(
    first_owner: Arc<dyn ContendService>,
    waiters: &[Arc<dyn ContendService>],
    rx: &mut mpsc::UnboundedReceiver<(usize, Instant)>,
    idle: Duration,
    polls: bool,
) -> anyhow::Result<(Samples, Samples, f64)> {
    // Every waiter has made its first call (and queued, where the backend has a queue),
    // and, where the backend pushes, its look right after subscribing.
    start_all(waiters, |st| st.attempts > 0 || !st.running).await?;
    if !polls {
        settle(waiters).await;
    }
    let quiet_from = Instant::now();
    let a0 = attempts(waiters);
    tokio::time::sleep(idle).await;
    let background = (attempts(waiters) - a0) as f64 / quiet_from.elapsed().as_secs_f64();

    let mut owner = first_owner;
    let (mut wakeups, mut handoff) = (Samples::default(), Samples::default());
    let releases = RELEASES.min(waiters.len() - 1);
    for round in 0..releases {
        let before = attempts(waiters);
        owner.stop().await?;
        let released = Instant::now();
        let (index, at) = tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .with_context(|| format!("no waiter acquired within 60 s after release {round}"))?
            .context("probe channel closed")?;
        handoff.push_between(released.into_std(), at.into_std());
        // Calls until the acquisition where waiters poll (they never go quiet); where the
        // backend pushes, until the waiters are quiet again (so that a herd is counted).
        let after = if polls {
            attempts(waiters)
        } else {
            settle(waiters).await
        };
        wakeups.push_value((after - before) as f64);
        owner = waiters
            .get(index)
            .cloned()
            .with_context(|| format!("unknown waiter {index} acquired"))?;
    }
    owner.stop().await?;
    Ok((wakeups, handoff, background))
}
