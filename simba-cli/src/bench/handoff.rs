//! Handoff: contenders on separate connections (one factory each) take turns, each holding
//! the mutex for `--hold`.
//!
//! Latency is measured from the previous owner's `release()` returning to the next
//! owner's `acquire()` returning, and counted only when the next owner is another
//! contender. A contender that gets the mutex again right after releasing it, while the
//! others wait, *barged*.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::json;
use simba_core::{LockGuard, Locker, PermitGuard, Semaphore};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::stats::{self, Ownership, Samples};
use super::{Ctx, Floors, Row, Section, num, num4, ratio, us};

/// Bound of one acquisition: a stuck handoff fails the scenario instead of hanging.
const ACQUIRE_LIMIT: Duration = Duration::from_secs(60);

/// Holds for `d`: on a blocking thread, because tokio's timers round up to the next
/// millisecond (a 1 ms sleep would hold for 1-2 ms); no worker thread spins.
async fn hold_for(d: Duration) {
    if d.is_zero() {
        return;
    }
    if tokio::task::spawn_blocking(move || std::thread::sleep(d))
        .await
        .is_err()
    {
        tokio::time::sleep(d).await;
    }
}

/// What a contender takes turns on: a mutex, or a permit of a semaphore.
pub(super) enum Contestant {
    /// A mutex.
    Lock(Locker),
    /// One permit of a semaphore (a contender of its own per acquisition).
    Permit(Semaphore),
}

impl From<Locker> for Contestant {
    fn from(l: Locker) -> Self {
        Contestant::Lock(l)
    }
}

/// What a [`Contestant`] holds.
pub(super) enum Held {
    Lock(LockGuard),
    Permit(PermitGuard),
}

impl Contestant {
    pub(super) async fn acquire_timeout(&self, wait: Duration) -> simba_core::Result<Held> {
        match self {
            Contestant::Lock(l) => l.acquire_timeout(wait).await.map(Held::Lock),
            Contestant::Permit(s) => s.acquire_timeout(wait).await.map(Held::Permit),
        }
    }
}

impl Held {
    pub(super) fn fence(&self) -> u64 {
        match self {
            Held::Lock(g) => g.fence(),
            Held::Permit(g) => g.fence(),
        }
    }

    pub(super) async fn release(self) -> simba_core::Result<()> {
        match self {
            Held::Lock(g) => g.release().await,
            Held::Permit(g) => g.release().await,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Record {
    own: Ownership,
    /// When `release()` was called.
    release_called: Instant,
    /// When `release()` returned.
    released: Instant,
}

/// What contenders taking turns on one mutex measured.
pub(super) struct Contended {
    pub(super) contenders: usize,
    /// Release returned → the next owner's acquire returned, when another contender won.
    /// Negative when the next owner had the mutex before the releaser's `release()`
    /// returned.
    pub(super) handoff: Samples,
    /// Release called → the next owner's acquire returned (the same hand-overs): the whole
    /// path, never negative.
    pub(super) from_call: Samples,
    pub(super) per: Vec<u64>,
    pub(super) barged: usize,
    pub(super) transitions: usize,
    pub(super) jain: Option<f64>,
    pub(super) acq_per_s: Option<f64>,
    pub(super) ideal: Option<f64>,
    pub(super) hold_mean: Option<f64>,
    pub(super) measured: usize,
    pub(super) owns: usize,
    pub(super) safety: stats::Safety,
}

/// Runs `lockers` (one per contender, each on its own factory) in turns until
/// `--iterations` acquisitions after a warm-up, each holding for `--hold`.
pub(super) async fn contend(
    ctx: &Ctx,
    lockers: Vec<impl Into<Contestant>>,
) -> anyhow::Result<Contended> {
    contend_for(ctx, lockers, ctx.iterations()).await
}

/// [`contend`] until `target` acquisitions after the warm-up.
pub(super) async fn contend_for(
    ctx: &Ctx,
    lockers: Vec<impl Into<Contestant>>,
    target: usize,
) -> anyhow::Result<Contended> {
    let lockers: Vec<Contestant> = lockers.into_iter().map(Into::into).collect();
    let contenders = lockers.len();
    let warm = (target / 20).clamp(contenders, 100);
    let hold = ctx.args.hold;
    let records = Arc::new(Mutex::new(Vec::with_capacity(warm + target + contenders)));
    let count = Arc::new(AtomicUsize::new(0));
    let stop = CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    for (c, locker) in lockers.into_iter().enumerate() {
        let (records, count, stop) = (records.clone(), count.clone(), stop.clone());
        tasks.spawn(async move {
            loop {
                let guard = tokio::select! {
                    biased;
                    () = stop.cancelled() => return anyhow::Ok(()),
                    g = locker.acquire_timeout(ACQUIRE_LIMIT) => g.context("acquire")?,
                };
                let start = Instant::now();
                let fence = guard.fence();
                hold_for(hold).await;
                let end = Instant::now();
                if count.fetch_add(1, Ordering::SeqCst) + 1 >= warm + target {
                    stop.cancel();
                }
                let release_called = Instant::now();
                guard.release().await.context("release")?;
                let released = Instant::now();
                records.lock().await.push(Record {
                    own: Ownership {
                        contender: c,
                        fence,
                        start,
                        end,
                    },
                    release_called,
                    released,
                });
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        if let Err(e) = r.context("contender task").and_then(|r| r) {
            tasks.abort_all();
            return Err(e);
        }
    }
    let mut records = Arc::try_unwrap(records)
        .map_err(|_| anyhow::anyhow!("records still shared"))?
        .into_inner();
    records.sort_by_key(|r| r.own.start);

    let owns: Vec<Ownership> = records.iter().map(|r| r.own).collect();
    let safety = stats::check(&owns);
    let measured = &records[warm.min(records.len())..];
    let mut handoff = Samples::with_capacity(measured.len());
    let mut from_call = Samples::with_capacity(measured.len());
    let mut holds = Samples::with_capacity(measured.len());
    let mut barged = 0usize;
    for pair in records[warm.saturating_sub(1).min(records.len())..].windows(2) {
        let (prev, next) = (&pair[0], &pair[1]);
        if prev.own.contender == next.own.contender {
            barged += 1;
        } else {
            handoff.push_between(prev.released, next.own.start);
            from_call.push_between(prev.release_called, next.own.start);
        }
    }
    let mut per = vec![0u64; contenders];
    for r in measured {
        per[r.own.contender] += 1;
        holds.push(r.own.end - r.own.start);
    }
    let transitions = barged + handoff.len();
    let jain = stats::jain(&per);
    let window = match (measured.first(), measured.last()) {
        (Some(a), Some(b)) => (b.released - a.own.start).as_secs_f64(),
        _ => 0.0,
    };
    let acq_per_s = (window > 0.0).then(|| measured.len() as f64 / window);
    let hold_mean = holds.mean();
    let ideal = hold_mean.map(|h| 1e6 / h);
    Ok(Contended {
        contenders,
        handoff,
        from_call,
        per,
        barged,
        transitions,
        jain,
        acq_per_s,
        ideal,
        hold_mean,
        measured: measured.len(),
        owns: owns.len(),
        safety,
    })
}

pub(super) async fn run(ctx: &Ctx, floors: &Floors) -> anyhow::Result<Section> {
    let contenders = ctx.args.contenders as usize;
    let hold = ctx.args.hold;
    let mutex = ctx.mutex("handoff");
    let mut lockers = Vec::new();
    let mut polls = false;
    for _ in 0..contenders {
        let b = ctx.connect(ctx.timing()).await?;
        polls = b.polls();
        lockers.push(Locker::new(b.factory(), &mutex)?);
    }
    let Contended {
        contenders,
        handoff,
        from_call,
        per,
        barged,
        transitions,
        jain,
        acq_per_s,
        ideal,
        hold_mean,
        measured,
        owns,
        safety,
    } = contend(ctx, lockers).await?;
    let barging = barged as f64 * 100.0 / transitions.max(1) as f64;
    let native = floors.handoff_floor();
    let goal = native.map(|(f, _)| f + 1.5 * floors.rtt.p50().unwrap_or(0.0));

    let mut s = Section {
        unsafe_: safety.overlaps > 0 || safety.fence_regressions > 0,
        ..Section::default()
    };
    for (k, v) in [
        ("contenders", json!(contenders)),
        ("hold_us", num(Some(hold.as_secs_f64() * 1e6))),
        ("hold_mean_us", num(hold_mean)),
        ("acquisitions", json!(measured)),
        ("handoffs", json!(handoff.len())),
        ("p50_us", num(handoff.p50())),
        ("p99_us", num(handoff.p99())),
        ("max_us", num(handoff.max())),
        ("from_call_p50_us", num(from_call.p50())),
        ("from_call_p99_us", num(from_call.p99())),
        ("barging_pct", num(Some(barging))),
        ("jain", num4(jain)),
        ("acq_per_s", num(acq_per_s)),
        ("ideal_acq_per_s", num(ideal)),
        (
            "acq_pct_of_ideal",
            num(ratio(acq_per_s, ideal).map(|r| r * 100.0)),
        ),
        ("per_contender", json!(per)),
        ("overlaps", json!(safety.overlaps)),
        ("fence_regressions", json!(safety.fence_regressions)),
        ("native_handoff_floor_us", num(native.map(|n| n.0))),
        ("native_handoff_floor", json!(native.map(|n| n.1))),
        ("goal_p50_us", num(goal)),
        (
            "p50_minus_floor_per_rtt",
            num(match (handoff.p50(), native, floors.rtt.p50()) {
                (Some(p), Some((f, _)), Some(r)) if r > 0.0 => Some((p - f) / r),
                _ => None,
            }),
        ),
        ("p99_per_p50", num(ratio(handoff.p99(), handoff.p50()))),
        (
            "waiters_poll_ms",
            if polls {
                json!(ctx.args.poll.as_millis() as u64)
            } else {
                json!(null)
            },
        ),
    ] {
        s.json.insert(k.into(), v);
    }
    let poll_note = if polls {
        format!(
            "; waiters poll every {}",
            crate::duration::show(ctx.args.poll)
        )
    } else {
        String::new()
    };
    let beside = match (native, goal) {
        (Some((f, what)), Some(g)) => format!(
            "floor {} ({what}); goal ≤ floor + 1.5 round trips = {}; {:.1} round trips over the floor{poll_note}",
            us(Some(f)),
            us(Some(g)),
            handoff
                .p50()
                .zip(floors.rtt.p50())
                .map_or(0.0, |(p, r)| (p - f) / r),
        ),
        _ => format!(
            "{:.1} round trips ({} p50 {}){poll_note}",
            ratio(handoff.p50(), floors.rtt.p50()).unwrap_or(0.0),
            floors.rtt_what,
            us(floors.rtt.p50()),
        ),
    };
    s.rows.push(Row::new(
        "handoff p50 / p99",
        format!("{} / {}", us(handoff.p50()), us(handoff.p99())),
        beside,
    ));
    if let Some(e) = floors.engine_handoff {
        s.json.insert("engine_p50_us".into(), num(Some(e)));
        s.rows.push(Row::new(
            "  the engine alone (memory floor)",
            us(Some(e)),
            "handoff over MemoryStore from release() called, same run",
        ));
    }
    s.rows.push(Row::new(
        "barging",
        format!("{barging:.1} %"),
        format!("{barged} of {transitions} acquisitions by the releaser"),
    ));
    s.rows.push(Row::new(
        "Jain fairness",
        jain.map_or("-".into(), |j| format!("{j:.4}")),
        format!("acquisitions per contender {per:?}"),
    ));
    s.rows.push(Row::new(
        "acquisitions per second",
        acq_per_s.map_or("-".into(), |a| format!("{a:.0}")),
        format!(
            "{:.0} % of 1/hold ({} held {} on average)",
            ratio(acq_per_s, ideal).unwrap_or(0.0) * 100.0,
            contenders,
            us(hold_mean)
        ),
    ));
    s.rows.push(Row::new(
        "overlaps / fence regressions",
        format!("{} / {}", safety.overlaps, safety.fence_regressions),
        format!("{owns} ownerships checked (must be 0)"),
    ));
    Ok(s)
}
