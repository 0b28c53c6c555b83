//! `simba bench`: uncontended, handoff, failover and scale measurements against any backend
//! URL (the repository's `docs/performance.md` lists the figures it gave).
//!
//! Every figure is reported beside the floor it compares to, measured in the same run:
//! one bare round trip of the backend (`PING`, `SELECT 1`, `exists`); the backend's own
//! lock handed over between two sessions where it has one (PostgreSQL
//! `pg_advisory_lock`, MySQL/MariaDB `GET_LOCK`, SQLite an OFD lock, ZooKeeper a watch on
//! a deleted node + create); on Redis the pub/sub delivery and a raw `SET NX PX` + `DEL`
//! lock; and the `memory` floor, the engine alone over `MemoryStore` beside a bare tokio
//! wake-up. `--explain` breaks a handoff into its hops. The `semaphore` scenario measures
//! a permit's acquire and hand-over beside the mutex's (backends without semaphores: a row
//! saying so). Timing uses the monotonic clock;
//! percentiles are nearest-rank over the sorted samples.

mod explain;
mod failover;
mod floor;
mod handoff;
mod many;
mod memory;
mod scale;
mod semaphore;
mod stats;
mod uncontended;

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{Map, Value, json};

use crate::backend::{self, Backend, LeaseArgs};
use crate::cli::{BenchArgs, Scenario};
use crate::status::{Failure, Outcome, Status};

pub(crate) use self::floor::Floors;

/// What every scenario needs.
pub(crate) struct Ctx {
    /// The backend URL.
    pub(crate) url: String,
    /// The options.
    pub(crate) args: BenchArgs,
    /// The prefix of every mutex name of this run.
    pub(crate) run: String,
    /// The backend's name (`redis`, `postgres`, …).
    pub(crate) kind: &'static str,
}

impl Ctx {
    /// Connects anew (own connections) with `timing`.
    pub(crate) async fn connect(&self, timing: LeaseArgs) -> anyhow::Result<Backend> {
        backend::connect(&self.url, timing)
            .await
            .map_err(|f| f.error)
    }

    /// The default lease, with waiters polling every `--poll` where the backend cannot
    /// push a release.
    pub(crate) fn timing(&self) -> LeaseArgs {
        LeaseArgs {
            waiter_poll: Some(self.args.poll),
            ..LeaseArgs::default()
        }
    }

    /// A mutex name of this run.
    pub(crate) fn mutex(&self, what: &str) -> String {
        format!("{}-{what}", self.run)
    }

    /// `n` of `--iterations`.
    pub(crate) fn iterations(&self) -> usize {
        self.args.iterations as usize
    }

    /// Whether this is the ZooKeeper backend (sessions, not leases).
    pub(crate) fn is_zookeeper(&self) -> bool {
        self.kind == "zookeeper"
    }

    /// Progress on stderr.
    pub(crate) fn progress(&self, what: impl std::fmt::Display) {
        say!("simba bench: {what}");
    }
}

/// One line of the table: figure, value, and what it compares to.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) figure: String,
    pub(crate) value: String,
    pub(crate) beside: String,
}

impl Row {
    pub(crate) fn new(
        figure: impl Into<String>,
        value: impl Into<String>,
        beside: impl Into<String>,
    ) -> Self {
        Row {
            figure: figure.into(),
            value: value.into(),
            beside: beside.into(),
        }
    }
}

/// What a scenario reports.
#[derive(Debug, Default)]
pub(crate) struct Section {
    pub(crate) json: Map<String, Value>,
    pub(crate) rows: Vec<Row>,
    /// A safety check failed (two owners at once).
    pub(crate) unsafe_: bool,
}

/// `µs` with no decimals, or `-`.
pub(crate) fn us(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0} µs"))
}

/// A JSON number rounded to one decimal, or null.
pub(crate) fn num(v: Option<f64>) -> Value {
    v.filter(|v| v.is_finite())
        .map_or(Value::Null, |v| json!((v * 10.0).round() / 10.0))
}

/// A JSON number rounded to four decimals, or null.
pub(crate) fn num4(v: Option<f64>) -> Value {
    v.filter(|v| v.is_finite())
        .map_or(Value::Null, |v| json!((v * 1e4).round() / 1e4))
}

/// Milliseconds of a duration, as a JSON number.
pub(crate) fn ms(d: Duration) -> Value {
    json!(d.as_millis() as u64)
}

/// `a / b` when both are known and `b` is not zero.
pub(crate) fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b != 0.0 => Some(a / b),
        _ => None,
    }
}

/// Runs `simba bench`.
pub(crate) async fn run(url: String, args: BenchArgs) -> Outcome {
    let mut scenarios = args.scenarios.clone();
    if scenarios.is_empty() {
        scenarios = vec![
            Scenario::Scale,
            Scenario::Uncontended,
            Scenario::Handoff,
            Scenario::Many,
            Scenario::Semaphore,
            Scenario::Failover,
        ];
    }
    scenarios.sort();
    scenarios.dedup();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mut ctx = Ctx {
        url,
        args,
        run: format!("bench-{}-{nanos:x}", std::process::id()),
        kind: "",
    };
    let main = ctx.connect(ctx.timing()).await.map_err(|e| Failure {
        status: Status::Unavailable,
        error: e,
    })?;
    ctx.kind = main.factory().backend();
    let shown = main.shown.clone();

    let mut out = Map::new();
    out.insert("backend".into(), json!(ctx.kind));
    out.insert("url".into(), json!(shown));
    out.insert("simba_version".into(), json!(env!("CARGO_PKG_VERSION")));
    out.insert("iterations".into(), json!(ctx.args.iterations));
    let mut table: Vec<(&'static str, Result<Section, String>)> = Vec::new();

    ctx.progress(format!("{shown} ({}): floors", ctx.kind));
    let floors = match floor::measure(main.conn.as_ref(), ctx.iterations(), &ctx.run).await {
        Ok(f) => Some(f),
        Err(e) => {
            table.push(("floor", Err(format!("{e:#}"))));
            None
        }
    };
    let mut floors = floors;
    if let Some(f) = floors.as_mut()
        && is_sql(ctx.kind)
    {
        match sql_handoff(&ctx).await {
            Ok(Some((what, samples))) => {
                f.handoff_what = what;
                f.handoff = Some(samples);
            }
            Ok(None) => {}
            Err(e) => ctx.progress(format!("the native handoff floor failed: {e:#}")),
        }
        if ctx.args.explain {
            match sql_acquisition(&ctx).await {
                Ok(samples) => f.acquisition = samples,
                Err(e) => ctx.progress(format!("the acquisition statement floor failed: {e:#}")),
            }
        }
    }
    let timed = |s: &Scenario| matches!(s, Scenario::Uncontended | Scenario::Handoff);
    if scenarios.iter().any(timed) || ctx.args.explain {
        ctx.progress("memory floor (the engine over MemoryStore)");
        match memory::measure(&ctx, scenarios.contains(&Scenario::Handoff)).await {
            Ok(m) => {
                if let Some(f) = floors.as_mut() {
                    f.engine_uncontended = m.uncontended.p50();
                    f.engine_handoff = m.handoff.as_ref().and_then(|h| h.from_call.p50());
                }
                table.push(("memory", Ok(memory::section(&m))));
            }
            Err(e) => table.push(("memory", Err(format!("{e:#}")))),
        }
    }
    if let Some(f) = &floors {
        table.insert(0, ("floor", Ok(floor_section(f))));
    }
    // One acquisition before the scenarios: a fresh Redis keeps every free mutex for one
    // lease after its first use (the restart quarantine), which no scenario should time.
    match first_acquisition(&ctx, &main).await {
        Ok(took) => {
            out.insert(
                "first_acquire_ms".into(),
                num(Some(took.as_secs_f64() * 1e3)),
            );
            if took > Duration::from_secs(1) {
                ctx.progress(format!(
                    "the first acquisition took {:.1} s (a fresh server's restart quarantine?)",
                    took.as_secs_f64()
                ));
            }
        }
        Err(e) => table.push(("first_acquire", Err(format!("{e:#}")))),
    }
    let empty = Floors::default();
    let floors_ref = floors.as_ref().unwrap_or(&empty);

    for scenario in scenarios {
        let name = match scenario {
            Scenario::Uncontended => "uncontended",
            Scenario::Handoff => "handoff",
            Scenario::Many => "many",
            Scenario::Semaphore => "semaphore",
            Scenario::Failover => "failover",
            Scenario::Scale => "scale",
        };
        ctx.progress(name);
        let result = match scenario {
            Scenario::Uncontended => uncontended::run(&ctx, &main, floors_ref).await,
            Scenario::Handoff => handoff::run(&ctx, floors_ref).await,
            Scenario::Many => many::run(&ctx).await,
            Scenario::Semaphore => semaphore::run(&ctx, mutex_figures(&table)).await,
            Scenario::Failover => failover::run(&ctx).await,
            Scenario::Scale => scale::run(&ctx, &main, floors_ref).await,
        };
        table.push((name, result.map_err(|e| format!("{e:#}"))));
    }
    if ctx.args.explain {
        ctx.progress("explain");
        let result = explain::run(&ctx, floors_ref).await;
        table.push(("explain", result.map_err(|e| format!("{e:#}"))));
    }

    let mut failed = false;
    let mut unsafe_ = false;
    for (name, section) in &table {
        let value = match section {
            Ok(s) => {
                unsafe_ |= s.unsafe_;
                Value::Object(s.json.clone())
            }
            Err(e) => {
                failed = true;
                json!({ "error": e })
            }
        };
        out.insert((*name).to_owned(), value);
    }
    // A reader that went away (`| head`) is no reason to fail the bench.
    if ctx.args.json {
        crate::show::emit(&Value::Object(out).to_string());
    } else {
        crate::show::emit(render(&shown, ctx.kind, &ctx.args, &table).trim_end_matches('\n'));
    }
    if unsafe_ {
        return Err(Failure::new(
            Status::Internal,
            "safety check failed: two contenders owned the mutex at once (see `overlaps`)",
        ));
    }
    if failed {
        return Err(Failure::new(
            Status::Unavailable,
            "a scenario failed (see its `error`)",
        ));
    }
    Ok(0)
}

/// The mutex's p50s measured so far in this run, for the semaphore's rows.
fn mutex_figures(table: &[(&'static str, Result<Section, String>)]) -> semaphore::MutexFigures {
    let p50 = |name: &str| {
        table
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, s)| s.as_ref().ok())
            .and_then(|s| s.json.get("p50_us"))
            .and_then(Value::as_f64)
    };
    semaphore::MutexFigures {
        uncontended_p50: p50("uncontended"),
        handoff_p50: p50("handoff"),
    }
}

async fn first_acquisition(ctx: &Ctx, main: &Backend) -> anyhow::Result<Duration> {
    let locker = simba_core::Locker::new(main.factory(), &ctx.mutex("first"))?;
    let t0 = std::time::Instant::now();
    let guard = locker.acquire_timeout(Duration::from_secs(60)).await?;
    let took = t0.elapsed();
    guard.release().await?;
    Ok(took)
}

fn floor_section(f: &Floors) -> Section {
    let mut s = Section::default();
    s.json.insert("rtt_op".into(), json!(f.rtt_what));
    s.json.insert("rtt_p50_us".into(), num(f.rtt.p50()));
    s.json.insert("rtt_p99_us".into(), num(f.rtt.p99()));
    s.rows.push(Row::new(
        format!("round trip ({}) p50 / p99", f.rtt_what),
        format!("{} / {}", us(f.rtt.p50()), us(f.rtt.p99())),
        format!("{} samples", f.rtt.len()),
    ));
    let (value, json_value) = match &f.durability {
        Ok(settings) if settings.is_empty() => {
            ("not reported by this backend".to_owned(), Value::Null)
        }
        Ok(settings) => (
            settings
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(", "),
            Value::Object(
                settings
                    .iter()
                    .map(|(k, v)| (k.clone(), json!(v)))
                    .collect::<Map<String, Value>>(),
            ),
        ),
        Err(e) => (format!("not read: {e}"), Value::Null),
    };
    s.json.insert("durability".into(), json_value);
    s.rows.push(Row::new(
        "server durability",
        value,
        "what a write waits for (read from the server)",
    ));
    // etcd's probe (its round trip is a `put`) measures a watch delivery and a
    // transaction lock where Redis's measures pub/sub and `SET NX PX`.
    let etcd = f.rtt_what == "put";
    if let Some(p) = &f.pubsub {
        s.json.insert("pubsub_p50_us".into(), num(p.p50()));
        s.json.insert("pubsub_p99_us".into(), num(p.p99()));
        let (what, how) = if etcd {
            (
                "put → watch delivered p50 / p99",
                "a watch on another stream",
            )
        } else {
            (
                "PUBLISH → delivered p50 / p99",
                "command → subscriber connection",
            )
        };
        s.rows.push(Row::new(
            what,
            format!("{} / {}", us(p.p50()), us(p.p99())),
            how,
        ));
    }
    if let Some(h) = &f.handoff {
        s.json.insert("handoff_op".into(), json!(f.handoff_what));
        s.json.insert("handoff_p50_us".into(), num(h.p50()));
        s.json.insert("handoff_p99_us".into(), num(h.p99()));
        s.rows.push(Row::new(
            "native handoff p50 / p99",
            format!("{} / {}", us(h.p50()), us(h.p99())),
            format!(
                "{}: release answered → waiter's lock answered",
                f.handoff_what
            ),
        ));
    }
    if let Some(r) = &f.raw_lock {
        s.json.insert("raw_lock_p50_us".into(), num(r.p50()));
        s.json.insert("raw_lock_p99_us".into(), num(r.p99()));
        s.rows.push(Row::new(
            "raw lock p50 / p99",
            format!("{} / {}", us(r.p50()), us(r.p99())),
            if etcd {
                "put-if-absent transaction + DELETE"
            } else {
                "SET NX PX + DEL"
            },
        ));
    }
    s
}

fn render(
    shown: &str,
    kind: &str,
    args: &BenchArgs,
    table: &[(&'static str, Result<Section, String>)],
) -> String {
    let mut rows: Vec<[String; 4]> = vec![[
        "scenario".into(),
        "figure".into(),
        "value".into(),
        "compare with".into(),
    ]];
    for (name, section) in table {
        match section {
            Ok(s) => {
                for (i, r) in s.rows.iter().enumerate() {
                    let label = if i == 0 {
                        (*name).to_owned()
                    } else {
                        String::new()
                    };
                    rows.push([label, r.figure.clone(), r.value.clone(), r.beside.clone()]);
                }
            }
            Err(e) => rows.push([
                (*name).to_owned(),
                "FAILED".into(),
                e.clone(),
                String::new(),
            ]),
        }
    }
    let width = |i: usize| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0);
    let (w0, w1, w2) = (width(0), width(1), width(2));
    let mut out = format!(
        "simba bench: {shown} ({kind}), {} iterations\n\n",
        args.iterations
    );
    for (n, r) in rows.iter().enumerate() {
        let _ = writeln!(out, "{:<w0$}  {:<w1$}  {:<w2$}  {}", r[0], r[1], r[2], r[3]);
        if n == 0 {
            let _ = writeln!(out, "{}", "-".repeat(w0 + w1 + w2 + 6 + width(3)));
        }
    }
    out
}

/// Whether `kind` is one of simba-jdbc's backends.
fn is_sql(kind: &str) -> bool {
    matches!(kind, "postgres" | "mysql" | "sqlite")
}

/// The SQL backends' native handoff floor (see [`floor::sql_handoff`]).
#[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
async fn sql_handoff(ctx: &Ctx) -> anyhow::Result<Option<(&'static str, stats::Samples)>> {
    floor::sql_handoff(&ctx.url, ctx.iterations(), &ctx.run)
        .await
        .map(Some)
}

#[cfg(not(any(feature = "sqlite", feature = "mysql", feature = "postgres")))]
async fn sql_handoff(_ctx: &Ctx) -> anyhow::Result<Option<(&'static str, stats::Samples)>> {
    Ok(None)
}

/// The SQL backends' acquisition statement alone (see [`floor::sql_acquisition`]).
#[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
async fn sql_acquisition(ctx: &Ctx) -> anyhow::Result<Option<stats::Samples>> {
    floor::sql_acquisition(&ctx.url, ctx.iterations(), &ctx.mutex("acquisition-floor"))
        .await
        .map(Some)
}

#[cfg(not(any(feature = "sqlite", feature = "mysql", feature = "postgres")))]
async fn sql_acquisition(_ctx: &Ctx) -> anyhow::Result<Option<stats::Samples>> {
    Ok(None)
}
