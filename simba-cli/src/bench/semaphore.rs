//! Semaphore: a permit's acquire + release by one contender (a semaphore of 3 permits),
//! and the hand-over of a one-permit semaphore between `--contenders` contenders on
//! separate connections, measured exactly as the mutex's `handoff` (release returned →
//! the next holder's acquire returned), each beside the mutex's figure of the same run.
//!
//! A backend without semaphores gets a row saying so, not a failure.

use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;
use simba_core::{Error, Semaphore};
use tokio::time::Instant;

use super::handoff::{self, Contended, Contestant};
use super::stats::Samples;
use super::{Ctx, Row, Section, num, ratio, us};

/// Bound of one acquisition (nobody else contends in the uncontended part).
const ACQUIRE_LIMIT: Duration = Duration::from_secs(30);

/// Permits of the uncontended part's semaphore.
const PERMITS: u32 = 3;

/// The mutex's figures of the same run, to print beside.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct MutexFigures {
    /// `uncontended.p50_us`.
    pub(super) uncontended_p50: Option<f64>,
    /// `handoff.p50_us`.
    pub(super) handoff_p50: Option<f64>,
}

/// The semaphore `what` of this run, on connections of its own with the bench's timing
/// (the default lease, waiters polling every `--poll` where nothing pushes).
async fn open(ctx: &Ctx, what: &str, permits: u32) -> simba_core::Result<Semaphore> {
    crate::permits::open(&ctx.url, ctx.timing(), &ctx.mutex(what), permits).await
}

/// The section of a backend without semaphores.
fn none(reason: &str) -> Section {
    let mut s = Section::default();
    s.json.insert("supported".into(), json!(false));
    s.json.insert("reason".into(), json!(reason));
    s.rows.push(Row::new("semaphores", "no semaphores", reason));
    s
}

pub(super) async fn run(ctx: &Ctx, mutex: MutexFigures) -> anyhow::Result<Section> {
    let sem = match open(ctx, "sem-uncontended", PERMITS).await {
        Ok(s) => s,
        Err(Error::Unsupported { reason, .. }) => return Ok(none(&reason)),
        Err(e) => return Err(e).context("the semaphore"),
    };
    let n = ctx.iterations();
    let warm = super::floor::warm_up(n);
    let (mut total, mut acquire, mut release) = (
        Samples::with_capacity(n),
        Samples::with_capacity(n),
        Samples::with_capacity(n),
    );
    for i in 0..warm + n {
        let t0 = Instant::now();
        let guard = match sem.acquire_timeout(ACQUIRE_LIMIT).await {
            Ok(g) => g,
            // The store refuses this semaphore's terms at the first acquisition
            // (ZooKeeper: a lease longer than half its session).
            Err(Error::Unsupported { reason, .. }) if i == 0 => return Ok(none(&reason)),
            Err(e) => return Err(e).context("acquire a permit"),
        };
        let t1 = Instant::now();
        guard.release().await.context("release a permit")?;
        let t2 = Instant::now();
        if i >= warm {
            total.push(t2 - t0);
            acquire.push(t1 - t0);
            release.push(t2 - t1);
        }
    }
    let mut contestants = Vec::new();
    for _ in 0..ctx.args.contenders {
        contestants.push(Contestant::Permit(
            open(ctx, "sem-handoff", 1).await.context("the semaphore")?,
        ));
    }
    let Contended {
        handoff,
        measured,
        owns,
        safety,
        ..
    } = handoff::contend(ctx, contestants).await?;

    let mut s = Section {
        unsafe_: safety.overlaps > 0 || safety.fence_regressions > 0,
        ..Section::default()
    };
    for (k, v) in [
        ("supported", json!(true)),
        ("permits", json!(PERMITS)),
        ("p50_us", num(total.p50())),
        ("p99_us", num(total.p99())),
        ("acquire_p50_us", num(acquire.p50())),
        ("acquire_p99_us", num(acquire.p99())),
        ("release_p50_us", num(release.p50())),
        ("release_p99_us", num(release.p99())),
        (
            "p50_per_mutex",
            num(ratio(total.p50(), mutex.uncontended_p50)),
        ),
        ("handoff_contenders", json!(ctx.args.contenders)),
        ("handoff_acquisitions", json!(measured)),
        ("handoff_p50_us", num(handoff.p50())),
        ("handoff_p99_us", num(handoff.p99())),
        (
            "handoff_p50_per_mutex",
            num(ratio(handoff.p50(), mutex.handoff_p50)),
        ),
        ("overlaps", json!(safety.overlaps)),
        ("fence_regressions", json!(safety.fence_regressions)),
    ] {
        s.json.insert(k.into(), v);
    }
    let beside = |mine: Option<f64>, theirs: Option<f64>, what: &str| match theirs {
        Some(m) => format!(
            "{:.2} × the mutex's {what} p50 ({})",
            mine.unwrap_or(0.0) / m,
            us(Some(m))
        ),
        None => format!("the mutex's {what} was not measured in this run"),
    };
    s.rows.push(Row::new(
        format!("permit acquire + release p50 / p99 ({PERMITS} permits)"),
        format!("{} / {}", us(total.p50()), us(total.p99())),
        beside(total.p50(), mutex.uncontended_p50, "uncontended"),
    ));
    s.rows.push(Row::new(
        "  acquire p50 / release p50",
        format!("{} / {}", us(acquire.p50()), us(release.p50())),
        "",
    ));
    s.rows.push(Row::new(
        "permit hand-over p50 / p99 (1 permit)",
        format!("{} / {}", us(handoff.p50()), us(handoff.p99())),
        beside(handoff.p50(), mutex.handoff_p50, "handoff"),
    ));
    s.rows.push(Row::new(
        "overlaps / fence regressions",
        format!("{} / {}", safety.overlaps, safety.fence_regressions),
        format!("{owns} holdings of the one permit checked (must be 0)"),
    ));
    Ok(s)
}
