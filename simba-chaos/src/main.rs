//! `simba-chaos`: contender processes, a fenced resource, and faults; prints a summary
//! whose last line is `handoffs=N overlaps=X stale_writes_accepted=Y faults=Z` and exits
//! non-zero when X or Y is not 0 or N is too small.
//!
//! With `--semaphore N` the contenders (6 unless `--contenders` says otherwise) hold the
//! permits of a semaphore of N permits instead, and the last line is
//! `permits=N acquisitions=A handoffs=H over_capacity=X fence_violations=F
//! stale_writes_accepted=Y faults=Z`: never more than N holders believing at once (see
//! `simba_test_kit::history::check_permits` and the resource's rules in
//! `simba_test_kit::chaos`). Semaphores run on Redis (single, Sentinel), ZooKeeper, etcd and
//! the SQL backends; Redis Cluster is refused (its failover fault targets the mutex's
//! shard).
//!
//! With `--rwlock` the contenders (6 unless `--contenders` says otherwise) take a
//! read-write lock (`simba_core::RwLock`) instead, three times in four to read (a reader
//! reads the fenced resource, a writer writes to it), and the last line is
//! `rw reads=R writes=W acquisitions=A handoffs=H stale_reads=S rw_violations=X
//! fence_violations=F stale_writes_accepted=Y faults=Z`: never a writer beside another
//! holder (see `simba_test_kit::history::check_rw`); the run fails unless X, F and Y are
//! 0. `--unsafe` with `--rwlock` also makes the writers take the lock's gate only, without
//! waiting for the readers to leave. The backends are those of `--semaphore`.
//!
//! ```text
//! simba-chaos --backend redis|redis-sentinel|redis-cluster|mysql|postgres|postgres-pgbouncer|postgres-pgbouncer-session|sqlite|zookeeper|zookeeper-ensemble|etcd|etcd-cluster
//!             [--url URL] [--duration 60s] [--faults kill,pause,restart,cut,delay,partition|none]
//!             [--contenders 3] [--semaphore N | --rwlock] [--hold 20ms] [--waiter-pause 500ms]
//!             [--min-handoffs N] [--unsafe]
//! ```
//!
//! Before the last line, a `load:` line gives the run's acquisitions per second, the share
//! of the time with 0, 1, … N holders while at least one contender waited, and the
//! median and longest wait (`simba_test_kit::history::load`). `--faults none` makes a
//! load measurement: no faults and no contender crashes; `--hold` fixes how long each
//! ownership is held (5–40 ms at random otherwise). The fault `pause-waiter` (not among
//! the defaults) stops a waiting contender for `--waiter-pause` (500 ms) every 2 s, and
//! a `waiter_pauses=` line gives the share of the paused time during which the others
//! held every permit, and none; the `while_paused_others_queued_s=` line the same shares
//! counted only while another contender waited (the paused one is always queued, so the
//! first line also counts moments when nobody else wanted a permit: the others' pauses
//! between ownerships). Runs whose faults are all `pause-waiter` have no crashes either.
//!
//! `zookeeper-ensemble` (feature `containers`) starts a three-node ensemble in containers
//! and has its own faults: `leader-kill,follower-partition,contender-partition,kill,pause`;
//! `etcd-cluster` (feature `containers`) starts a three-member etcd cluster in containers
//! (contender `i` talks to member `i mod 3`), with the faults
//! `leader-kill,member-partition,member-restart,kill,pause`;
//! `redis-sentinel` starts a primary, two replicas of different `replica-priority` and three
//! sentinels, with the faults
//! `failover,kill,pause`; `redis-cluster` starts three primaries with a replica each
//! (contenders use `replicaAcks=1`), with the faults `failover,kill,pause,cut`.
//! `postgres-pgbouncer` starts a private PostgreSQL with PgBouncer in transaction mode in
//! front of it; contenders connect through PgBouncer with `simba_pooler=transaction` in
//! their URL. Besides the faults of `postgres` (`restart` restarts PostgreSQL), it has
//! `server-kill,server-pause` (PostgreSQL) and `pooler-kill,pooler-pause,pooler-restart`
//! (PgBouncer). `postgres-pgbouncer-session`: the same with PgBouncer in session mode and
//! `simba_pooler=session`.
//!
//! ```text
//! simba-chaos contender      # one contender process; the run starts these itself
//! ```
//!
//! ```text
//! simba-chaos soak --backend sqlite|redis|mysql|postgres|zookeeper [--processes 8]
//!                  [--mutexes 1000] [--duration 60m] [--report FILE] …
//! simba-chaos soak-worker    # one worker process of a soak; `soak` starts these itself
//! ```
//!
//! `soak` churns many mutexes in several processes and records their resources every
//! minute (see the `soak` module).
//!
//! Contenders are `simba-chaos contender` processes: this same binary, which links the
//! backend crates directly (the `simba` command links no test tooling).

mod contender;
mod soak;

use std::process::ExitCode;
use std::time::Duration;

use simba_test_kit::chaos::{ChaosBackend, ChaosConfig, FaultKind, run};

fn parse_duration(s: &str) -> Option<Duration> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = num.parse().ok()?;
    match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" => Some(Duration::from_secs(n)),
        "m" => Some(Duration::from_secs(n * 60)),
        _ => None,
    }
}

fn usage(msg: &str) -> ExitCode {
    eprintln!("simba-chaos: {msg}");
    eprintln!(
        "usage: simba-chaos --backend \
         redis|redis-sentinel|redis-cluster|mysql|postgres|postgres-pgbouncer|postgres-pgbouncer-session|\
         sqlite|zookeeper|zookeeper-ensemble|etcd|etcd-cluster \
         [--url URL] [--duration 60s] [--faults kill,pause,restart,cut,delay,partition,\
         pause-waiter|none] [--contenders N] [--semaphore PERMITS | --rwlock] [--hold 20ms] \
         [--waiter-pause 500ms] [--min-handoffs N] [--unsafe]\n\
         redis-sentinel: --faults failover,kill,pause\n\
         redis-cluster: --faults failover,kill,pause,cut\n\
         postgres-pgbouncer, postgres-pgbouncer-session (no --url): --faults \
         kill,pause,restart,cut,delay,partition,server-kill,server-pause,pooler-kill,\
         pooler-pause,pooler-restart\n\
         zookeeper-ensemble (feature `containers`): --faults \
         leader-kill,follower-partition,contender-partition,kill,pause\n\
         etcd-cluster (feature `containers`): --faults \
         leader-kill,member-partition,member-restart,kill,pause"
    );
    ExitCode::from(64)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    if std::env::args().nth(1).as_deref() == Some("contender") {
        return contend().await;
    }
    match std::env::args().nth(1).as_deref() {
        Some("soak") => return soak_parent().await,
        Some("soak-worker") => return soak_worker().await,
        _ => {}
    }
    orchestrate().await
}

/// The contender mode: logs (warnings, or `SIMBA_LOG`) go to stderr, which the run
/// collects per contender.
async fn contend() -> ExitCode {
    let filter = std::env::var("SIMBA_LOG").unwrap_or_else(|_| "warn".to_owned());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    match contender::run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("simba-chaos contender: {e:#}");
            ExitCode::from(69)
        }
    }
}

/// The soak's parent: logs (warnings, or `SIMBA_LOG`) to stderr, the table to stdout.
async fn soak_parent() -> ExitCode {
    let filter = std::env::var("SIMBA_LOG").unwrap_or_else(|_| "warn".to_owned());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let args: Vec<String> = std::env::args().skip(2).collect();
    soak::soak(&args).await
}

/// Every allocation of the process goes through dhat's profiler (feature `heap-profile`).
#[cfg(feature = "heap-profile")]
#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// Every allocation of the process goes to mimalloc (feature `mimalloc`), not glibc's
/// malloc; SQLite's own (C) allocations still go to the system allocator.
#[cfg(all(feature = "mimalloc", not(feature = "heap-profile")))]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[cfg(all(feature = "mimalloc", feature = "heap-profile"))]
compile_error!(
    "the features `mimalloc` and `heap-profile` each set the global allocator: choose one"
);

/// A soak worker: logs to stderr, which the parent keeps per worker.
async fn soak_worker() -> ExitCode {
    let filter = std::env::var("SIMBA_LOG").unwrap_or_else(|_| "warn".to_owned());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    #[cfg(feature = "heap-profile")]
    heap_profile();
    let args: Vec<String> = std::env::args().skip(2).collect();
    match soak::worker::run(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("simba-chaos soak-worker: {e:#}");
            ExitCode::from(69)
        }
    }
}

/// Profiles the worker's heap for `SIMBA_SOAK_HEAP_PROFILE_SECS` seconds (default 600),
/// then writes `dhat-heap-<pid>.json`: per allocation site, the bytes allocated and the
/// bytes still held at that moment ("at t-end"), which is where a leak shows. The parent
/// kills its workers at the end of a run, so the profile ends on a timer, not at exit.
#[cfg(feature = "heap-profile")]
fn heap_profile() {
    let secs = std::env::var("SIMBA_SOAK_HEAP_PROFILE_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(600);
    let file = format!("dhat-heap-{}.json", std::process::id());
    let started = std::thread::Builder::new()
        .name("heap-profile".to_owned())
        .spawn(move || {
            let profiler = dhat::Profiler::builder().file_name(&file).build();
            std::thread::sleep(std::time::Duration::from_secs(secs));
            drop(profiler);
            tracing::warn!("heap profile written to {file}");
        });
    if let Err(e) = started {
        tracing::warn!("no heap profile: cannot start its thread: {e}");
    }
}

async fn orchestrate() -> ExitCode {
    let filter = std::env::var("SIMBA_LOG").unwrap_or_else(|_| "warn".to_owned());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let mut backend = None;
    let mut url = None;
    let mut duration = Duration::from_secs(60);
    let mut faults = None;
    let mut contenders = None;
    let mut permits = None;
    let mut min_handoffs = None;
    let mut unsafe_contenders = false;
    let mut rwlock = false;
    let mut hold = None;
    let mut waiter_pause = None;
    let program = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("simba-chaos: cannot find its own binary to run contenders: {e}");
            return ExitCode::from(70);
        }
    };
    let mut args = std::env::args().skip(1).collect::<Vec<_>>().into_iter();
    while let Some(a) = args.next() {
        let mut value = || args.next();
        match a.as_str() {
            "--backend" => match value().map(|v| v.parse::<ChaosBackend>()) {
                Some(Ok(b)) => backend = Some(b),
                Some(Err(e)) => return usage(&e.to_string()),
                None => return usage("--backend needs a value"),
            },
            "--url" => url = value(),
            "--duration" => match value().as_deref().and_then(parse_duration) {
                Some(d) => duration = d,
                None => return usage("--duration takes e.g. 30s, 500ms, 10m"),
            },
            "--faults" => {
                let Some(v) = value() else {
                    return usage("--faults needs a value");
                };
                if v == "none" {
                    faults = Some(Vec::new());
                    continue;
                }
                let parsed: Result<Vec<FaultKind>, _> = v.split(',').map(str::parse).collect();
                match parsed {
                    Ok(f) => faults = Some(f),
                    Err(e) => return usage(&e.to_string()),
                }
            }
            "--contenders" => match value().and_then(|v| v.parse().ok()) {
                Some(n) => contenders = Some(n),
                None => return usage("--contenders takes a number"),
            },
            "--semaphore" => match value().and_then(|v| v.parse::<u32>().ok()) {
                Some(n) if n > 0 => permits = Some(n),
                _ => return usage("--semaphore takes a number of permits, at least 1"),
            },
            "--min-handoffs" => match value().and_then(|v| v.parse().ok()) {
                Some(n) => min_handoffs = Some(n),
                None => return usage("--min-handoffs takes a number"),
            },
            "--hold" => match value().as_deref().and_then(parse_duration) {
                Some(d) if !d.is_zero() => hold = Some(d),
                _ => return usage("--hold takes a duration above 0, e.g. 20ms"),
            },
            "--waiter-pause" => match value().as_deref().and_then(parse_duration) {
                Some(d) if !d.is_zero() => waiter_pause = Some(d),
                _ => return usage("--waiter-pause takes a duration above 0, e.g. 500ms"),
            },
            "--rwlock" => rwlock = true,
            "--unsafe" => unsafe_contenders = true,
            other => return usage(&format!("unknown argument {other:?}")),
        }
    }
    let Some(backend) = backend else {
        return usage("--backend is required");
    };
    if rwlock && permits.is_some() {
        return usage("--semaphore and --rwlock exclude each other");
    }
    let mut cfg = ChaosConfig::new(backend, program, vec!["contender".into()]);
    cfg.url = url;
    cfg.duration = duration;
    if let Some(f) = faults {
        // A load measurement: no crashes either, when there is no fault but waiter pauses.
        cfg.crashes = f.iter().any(|k| *k != FaultKind::PauseWaiter);
        cfg.faults = f;
    }
    if let Some(h) = hold {
        let ms = u64::try_from(h.as_millis()).unwrap_or(u64::MAX - 1);
        cfg.hold_ms = ms..ms + 1;
    }
    if let Some(p) = waiter_pause {
        cfg.waiter_pause = p;
    }
    // A semaphore needs more contenders than permits to be contended; a read-write lock
    // needs readers side by side and writers among them.
    cfg.contenders = contenders.unwrap_or(if permits.is_some() || rwlock { 6 } else { 3 });
    cfg.permits = permits;
    cfg.rwlock = rwlock;
    cfg.unsafe_contenders = unsafe_contenders;
    // About one handoff every two seconds is the least that means anything.
    cfg.min_handoffs = min_handoffs.unwrap_or((duration.as_secs() / 2).max(3) as usize);
    match run(&cfg).await {
        Ok(summary) => {
            for tail in &summary.log_tails {
                eprintln!("{tail}");
            }
            println!("{summary}");
            if summary.passed() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("simba-chaos: {e}");
            ExitCode::from(69)
        }
    }
}
