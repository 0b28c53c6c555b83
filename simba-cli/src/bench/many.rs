//! Many mutexes at once: `--many-mutexes` mutexes, each handed between `--contenders`
//! contenders (one per connection, every connection contending for every mutex), each
//! holding `--hold`: the throughput of many independent locks, where `handoff` measures one
//! hot mutex.

use futures_util::future::join_all;
use serde_json::json;
use simba_core::Locker;

use super::handoff::{Contended, contend_for};
use super::stats::Samples;
use super::{Ctx, Row, Section, num, ratio, us};

pub(super) async fn run(ctx: &Ctx) -> anyhow::Result<Section> {
    let mutexes = ctx.args.many_mutexes as usize;
    let contenders = ctx.args.contenders as usize;
    let mut factories = Vec::with_capacity(contenders);
    for _ in 0..contenders {
        factories.push(ctx.connect(ctx.timing()).await?.factory());
    }
    // `--iterations` acquisitions in all, shared by the mutexes (each at least a few
    // rounds of its contenders).
    let per_mutex = (ctx.iterations() / mutexes).max(2 * contenders);
    let mut runs = Vec::with_capacity(mutexes);
    for i in 0..mutexes {
        let name = ctx.mutex(&format!("many-{i}"));
        let lockers = factories
            .iter()
            .map(|f| Locker::new(f.clone(), &name))
            .collect::<simba_core::Result<Vec<_>>>()?;
        runs.push(contend_for(ctx, lockers, per_mutex));
    }
    let done: Vec<Contended> = join_all(runs)
        .await
        .into_iter()
        .collect::<anyhow::Result<_>>()?;

    let mut handoff = Samples::default();
    let (mut measured, mut owns, mut barged, mut transitions) = (0, 0, 0, 0);
    let (mut overlaps, mut regressions) = (0, 0);
    let mut acq_per_s = 0.0;
    let mut holds = Samples::default();
    for c in &done {
        handoff.extend(&c.handoff);
        measured += c.measured;
        owns += c.owns;
        barged += c.barged;
        transitions += c.transitions;
        overlaps += c.safety.overlaps;
        regressions += c.safety.fence_regressions;
        acq_per_s += c.acq_per_s.unwrap_or(0.0);
        if let Some(h) = c.hold_mean {
            holds.push_value(h);
        }
    }
    let hold_mean = holds.mean();
    // Every mutex held back to back by someone: `mutexes` acquisitions per hold.
    let ideal = hold_mean.map(|h| mutexes as f64 * 1e6 / h);
    let barging = barged as f64 * 100.0 / transitions.max(1) as f64;
    let mut s = Section {
        unsafe_: overlaps > 0 || regressions > 0,
        ..Section::default()
    };
    for (k, v) in [
        ("mutexes", json!(mutexes)),
        ("contenders", json!(contenders)),
        ("hold_us", num(Some(ctx.args.hold.as_secs_f64() * 1e6))),
        ("hold_mean_us", num(hold_mean)),
        ("acquisitions", json!(measured)),
        ("handoffs", json!(handoff.len())),
        ("p50_us", num(handoff.p50())),
        ("p99_us", num(handoff.p99())),
        ("barging_pct", num(Some(barging))),
        ("acq_per_s", num(Some(acq_per_s))),
        ("ideal_acq_per_s", num(ideal)),
        (
            "acq_pct_of_ideal",
            num(ratio(Some(acq_per_s), ideal).map(|r| r * 100.0)),
        ),
        ("overlaps", json!(overlaps)),
        ("fence_regressions", json!(regressions)),
    ] {
        s.json.insert(k.into(), v);
    }
    s.rows.push(Row::new(
        "acquisitions per second, all mutexes",
        format!("{acq_per_s:.0}"),
        format!(
            "{:.0} % of {mutexes} / hold ({contenders} contenders each, held {} on average)",
            ratio(Some(acq_per_s), ideal).unwrap_or(0.0) * 100.0,
            us(hold_mean)
        ),
    ));
    s.rows.push(Row::new(
        "handoff p50 / p99",
        format!("{} / {}", us(handoff.p50()), us(handoff.p99())),
        format!(
            "{} hand-overs between contenders of one mutex",
            handoff.len()
        ),
    ));
    s.rows.push(Row::new(
        "barging",
        format!("{barging:.1} %"),
        format!("{barged} of {transitions} acquisitions by the releaser"),
    ));
    s.rows.push(Row::new(
        "overlaps / fence regressions",
        format!("{overlaps} / {regressions}"),
        format!("{owns} ownerships checked, per mutex (must be 0)"),
    ));
    Ok(s)
}
