//! Uncontended: one contender acquires and releases, back to back (through `Locker`, as an
//! application would).

use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;
use simba_core::Locker;
use tokio::time::Instant;

use super::stats::Samples;
use super::{Ctx, Floors, Row, Section, num, ratio, us};
use crate::backend::Backend;

/// Bound of one acquisition (nobody else contends, so this only catches a dead backend).
const ACQUIRE_LIMIT: Duration = Duration::from_secs(30);

pub(super) async fn run(ctx: &Ctx, main: &Backend, floors: &Floors) -> anyhow::Result<Section> {
    let n = ctx.iterations();
    let warm = super::floor::warm_up(n);
    let locker = Locker::new(main.factory(), &ctx.mutex("uncontended"))?;
    let (mut total, mut acquire, mut release) = (
        Samples::with_capacity(n),
        Samples::with_capacity(n),
        Samples::with_capacity(n),
    );
    let mut started = Instant::now();
    for i in 0..warm + n {
        if i == warm {
            started = Instant::now();
        }
        let t0 = Instant::now();
        let guard = locker
            .acquire_timeout(ACQUIRE_LIMIT)
            .await
            .context("acquire")?;
        let t1 = Instant::now();
        guard.release().await.context("release")?;
        let t2 = Instant::now();
        if i >= warm {
            total.push(t2 - t0);
            acquire.push(t1 - t0);
            release.push(t2 - t1);
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let ops = n as f64 / elapsed;

    let mut s = Section::default();
    let raw = floors.raw_lock.as_ref().and_then(Samples::p50);
    let rtt = floors.rtt.p50();
    for (k, v) in [
        ("p50_us", num(total.p50())),
        ("p99_us", num(total.p99())),
        ("ops_per_s", num(Some(ops))),
        ("acquire_p50_us", num(acquire.p50())),
        ("acquire_p99_us", num(acquire.p99())),
        ("release_p50_us", num(release.p50())),
        ("release_p99_us", num(release.p99())),
        ("iterations", json!(n)),
        ("p50_per_rtt", num(ratio(total.p50(), rtt))),
        ("p50_per_raw_lock", num(ratio(total.p50(), raw))),
    ] {
        s.json.insert(k.into(), v);
    }
    let beside = match raw {
        Some(r) => format!(
            "{:.2} × raw lock p50 ({}); {:.1} round trips",
            total.p50().unwrap_or(0.0) / r,
            us(Some(r)),
            ratio(total.p50(), rtt).unwrap_or(0.0)
        ),
        None => format!(
            "{:.1} round trips ({} p50 {})",
            ratio(total.p50(), rtt).unwrap_or(0.0),
            floors.rtt_what,
            us(rtt)
        ),
    };
    s.rows.push(Row::new(
        "acquire + release p50 / p99",
        format!("{} / {}", us(total.p50()), us(total.p99())),
        beside,
    ));
    s.rows.push(Row::new(
        "  acquire p50 / release p50",
        format!("{} / {}", us(acquire.p50()), us(release.p50())),
        "",
    ));
    if let Some(e) = floors.engine_uncontended {
        s.json.insert("engine_p50_us".into(), num(Some(e)));
        s.rows.push(Row::new(
            "  of which the engine (memory floor)",
            us(Some(e)),
            "acquire + release over MemoryStore, same run",
        ));
    }
    s.rows.push(Row::new(
        "cycles per second",
        format!("{ops:.0}"),
        format!("{n} cycles"),
    ));
    Ok(s)
}
