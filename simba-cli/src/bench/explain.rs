//! `--explain`: one handoff broken into its hops, p50 per hop.
//!
//! Two contenders (each its own connections) hand one mutex back and forth. Before each
//! release the waiter has queued (its first acquisition was answered); the engine and the
//! backend record the instant of each [`Hop`] of that mutex ([`simba_core::hops`], off
//! outside this scenario), and the bench adds the moment `release()` was called and the
//! moment the waiter's `acquire()` returned to its task. Each hop is timed from the one
//! before it on the path; the release's answer and the push race (a push may arrive before
//! the releaser hears its answer), so both are timed from the release being sent. A hop a
//! backend does not record (PostgreSQL's NOTIFY is received inside simba-jdbc, which
//! records nothing) is folded into the next one.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use serde_json::{Map, Value, json};
use simba_core::Locker;
use simba_core::hops::{self, Hop};
use tokio::time::Instant;

use super::stats::Samples;
use super::{Ctx, Floors, Row, Section, num, us};

/// Bound of one acquisition: a stuck handoff fails the scenario instead of hanging.
const ACQUIRE_LIMIT: Duration = Duration::from_secs(60);

/// How long the scenario waits for the waiter to queue before it gives up on a round.
const QUEUE_LIMIT: Duration = Duration::from_secs(5);

/// Handoffs measured (after a few unmeasured ones): `--iterations`, at most this many.
const MAX_ROUNDS: usize = 500;

/// A point of the handoff path: the bench's own two around the recorded hops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Point {
    /// `release()` was called on the owner's guard.
    ReleaseCalled,
    Hop(Hop),
    /// The waiter's `acquire()` returned to its task.
    AcquireReturned,
}

impl Point {
    fn name(self) -> &'static str {
        match self {
            Point::ReleaseCalled => "release() called",
            Point::Hop(h) => h.name(),
            Point::AcquireReturned => "acquire() returned",
        }
    }
}

/// The instants of one handoff's points, each the first of its kind after the point it
/// follows.
fn points(
    called: Instant,
    marks: &[(Hop, std::time::Instant)],
    returned: Instant,
) -> Vec<(Point, Instant)> {
    let first_after = |hop: Hop, after: Instant| {
        marks
            .iter()
            .map(|&(h, at)| (h, Instant::from_std(at)))
            .find(|&(h, at)| h == hop && at >= after)
            .map(|(_, at)| at)
    };
    let mut out = vec![(Point::ReleaseCalled, called)];
    let mut last = called;
    let mut sent = None;
    for hop in Hop::ALL {
        let after = match hop {
            // Both race from the release being sent.
            Hop::ReleaseAnswered | Hop::PushReceived => sent.unwrap_or(called),
            _ => last,
        };
        if let Some(at) = first_after(hop, after) {
            out.push((Point::Hop(hop), at));
            if hop == Hop::ReleaseSent {
                sent = Some(at);
            }
            if hop != Hop::ReleaseAnswered {
                last = at;
            }
        }
    }
    out.push((Point::AcquireReturned, returned));
    out
}

/// The hop segments of one handoff: (from, to, µs).
fn segments(points: &[(Point, Instant)]) -> Vec<(Point, Point, Duration)> {
    let mut out = Vec::new();
    let mut prev: Option<(Point, Instant)> = None;
    let sent = points
        .iter()
        .find(|(p, _)| *p == Point::Hop(Hop::ReleaseSent))
        .copied();
    for &(p, at) in points {
        let from = match p {
            Point::Hop(Hop::ReleaseAnswered | Hop::PushReceived) => sent.or(prev),
            _ => prev,
        };
        if let Some((f, t)) = from {
            out.push((f, p, at.saturating_duration_since(t)));
        }
        if p != Point::Hop(Hop::ReleaseAnswered) {
            prev = Some((p, at));
        }
    }
    out
}

pub(super) async fn run(ctx: &Ctx, floors: &Floors) -> anyhow::Result<Section> {
    let mutex = ctx.mutex("explain");
    let mut lockers = Vec::new();
    for _ in 0..2 {
        let b = ctx.connect(ctx.timing()).await?;
        lockers.push(Locker::new(b.factory(), &mutex)?);
    }
    hops::watch(&mutex);
    let measured = rounds(ctx, &lockers).await;
    hops::stop();
    let (by_segment, handoff) = measured?;

    let mut s = Section::default();
    let mut json_hops = Vec::new();
    for ((from, to), samples) in &by_segment {
        let label = format!("{} → {}", from.name(), to.name());
        let mut j = Map::new();
        j.insert("from".into(), json!(from.name()));
        j.insert("to".into(), json!(to.name()));
        j.insert("p50_us".into(), num(samples.p50()));
        j.insert("p99_us".into(), num(samples.p99()));
        j.insert("samples".into(), json!(samples.len()));
        json_hops.push(Value::Object(j));
        let side = matches!(to, Point::Hop(Hop::ReleaseAnswered))
            || matches!(from, Point::Hop(Hop::ReleaseAnswered));
        s.rows.push(Row::new(
            format!("{}{label}", if side { "  (releaser) " } else { "" }),
            format!("{} / {}", us(samples.p50()), us(samples.p99())),
            format!("p50 / p99 of {} handoffs", samples.len()),
        ));
    }
    s.json.insert("hops".into(), Value::Array(json_hops));
    if let Some(a) = &floors.acquisition {
        s.json
            .insert("acquisition_statement_p50_us".into(), num(a.p50()));
        s.json
            .insert("acquisition_statement_p99_us".into(), num(a.p99()));
        s.rows.push(Row::new(
            "  the acquisition statement alone",
            format!("{} / {}", us(a.p50()), us(a.p99())),
            format!(
                "p50 / p99 of {}: the store's connection path, no engine, no gate (compare with statement sent → statement answered)",
                a.len()
            ),
        ));
    }
    s.json.insert("handoff_p50_us".into(), num(handoff.p50()));
    s.json.insert("handoff_p99_us".into(), num(handoff.p99()));
    s.rows.push(Row::new(
        "handoff (release() returned → acquire() returned)",
        format!("{} / {}", us(handoff.p50()), us(handoff.p99())),
        format!(
            "2 contenders; round trip ({}) p50 {}",
            floors.rtt_what,
            us(floors.rtt.p50())
        ),
    ));
    Ok(s)
}

type Measured = (BTreeMap<(Point, Point), Samples>, Samples);

async fn rounds(ctx: &Ctx, lockers: &[Locker]) -> anyhow::Result<Measured> {
    let n = ctx.iterations().min(MAX_ROUNDS);
    let warm = 5;
    let mut by_segment: BTreeMap<(Point, Point), Samples> = BTreeMap::new();
    let mut handoff = Samples::with_capacity(n);
    let mut holder = 0usize;
    let mut guard = lockers[0]
        .acquire_timeout(ACQUIRE_LIMIT)
        .await
        .context("acquire")?;
    for round in 0..warm + n {
        let waiter = lockers[1 - holder].clone();
        let mut task = tokio::spawn(async move {
            let g = waiter.acquire_timeout(ACQUIRE_LIMIT).await;
            (g, Instant::now())
        });
        // Wait until the waiter has queued: its first acquisition was answered (the
        // mutex held), then a little longer for a subscription made beside it.
        let queued = async {
            loop {
                tokio::time::sleep(Duration::from_millis(1)).await;
                if hops::take().iter().any(|(h, _)| *h == Hop::AcquireAnswered) {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        tokio::select! {
            () = queued => {}
            () = tokio::time::sleep(QUEUE_LIMIT) => {}
            r = &mut task => {
                let (g, _) = r.context("waiter task")?;
                let _ = g?.release().await;
                anyhow::bail!("the waiter acquired while the mutex was held");
            }
        }
        let _ = hops::take();
        let called = Instant::now();
        guard.release().await.context("release")?;
        let released = Instant::now();
        let (g, returned) = task.await.context("waiter task")?;
        guard = g.context("acquire")?;
        let marks = hops::take();
        holder = 1 - holder;
        if round < warm {
            continue;
        }
        handoff.push_between(released.into_std(), returned.into_std());
        for (from, to, d) in segments(&points(called, &marks, returned)) {
            by_segment.entry((from, to)).or_default().push(d);
        }
    }
    guard.release().await.context("release")?;
    Ok((by_segment, handoff))
}
