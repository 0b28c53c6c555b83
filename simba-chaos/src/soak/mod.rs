//! `simba-chaos soak`: many mutexes churned by several worker processes for a long time,
//! with the resources of each process sampled every minute.
//!
//! ```text
//! simba-chaos soak --backend sqlite|redis|mysql|postgres|zookeeper|etcd [--url URL]
//!     [--processes 8] [--mutexes 1000] [--shared 8] [--duration 60m] [--sample-every 60s]
//!     [--warmup 10] [--max-growth 5] [--count-slack 0] [--max-lost 0] [--report FILE]
//!     [--ttl 30s] [--transition 10s] [--request-timeout 5s] [--acquire-timeout 3s]
//!     [--hold 10s..110s] [--idle 0s..10s] [--shared-hold 100ms..2s] [--shared-idle 0s..1s]
//!     [--write-every 10s] [--observe-every 10] [--ramp 60s]
//! ```
//!
//! The parent starts the server (a private one unless `--url`), a [`ledger`] (a fenced
//! resource for every mutex) and `--processes` copies of itself as `simba-chaos
//! soak-worker` (see [`worker`]). Every 5 s it reads, per worker process, its RSS
//! (`VmRSS`), open descriptors (`/proc/<pid>/fd`), threads, TCP connections to the
//! server's port (`/proc/<pid>/net/tcp*`: each is one connection on the server) and the
//! tokio alive task count the worker reported; and, where the server can say, the
//! server's own count of client connections (Redis `CLIENT LIST`, ZooKeeper `cons`).
//! Every `--sample-every` it prints and records (`--report`, JSON lines) the **peak** of
//! each reading over that period, and runs the history checker of the ledger.
//!
//! The verdict compares the peaks of sample `--warmup` with those of the last sample, in
//! sum over the processes: each may grow by at most `--max-growth` percent (and the counts
//! by `--count-slack` more). It also needs no overlap, no fence regression, no accepted
//! stale write, no worker death, no error (acquire, release, observer, ledger, an
//! uncontended acquisition that timed out), at most `--max-lost` ownerships lost while
//! held (no fault is injected, so any is a failure by default), and hand-overs between
//! processes on the shared mutexes. The exit status is 0 when it passes, 1 when not.

mod ledger;
pub(crate) mod worker;

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use simba_core::connect::{ConnectOptions, Connection, Connectors};
use simba_test_kit::servers::{self, ServerKind, TestServer};
use tokio::process::{Child, Command};

use ledger::{Ledger, Totals};

/// A random duration in `[lo, hi]`.
pub(crate) fn between((lo, hi): (Duration, Duration)) -> Duration {
    use std::hash::BuildHasher;
    let span = hi.saturating_sub(lo).as_millis() as u64;
    let roll = std::collections::hash_map::RandomState::new()
        .hash_one((std::time::SystemTime::now(), std::thread::current().id()))
        % (span + 1);
    lo + Duration::from_millis(roll)
}

fn parse_duration(s: &str) -> Option<Duration> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = num.parse().ok()?;
    match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" => Some(Duration::from_secs(n)),
        "m" => Some(Duration::from_secs(n.checked_mul(60)?)),
        "h" => Some(Duration::from_secs(n.checked_mul(3600)?)),
        _ => None,
    }
}

fn parse_range(s: &str) -> Option<(Duration, Duration)> {
    let (a, b) = s.split_once("..")?;
    let (a, b) = (parse_duration(a)?, parse_duration(b)?);
    (a <= b).then_some((a, b))
}

fn show(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}

fn show_range((a, b): (Duration, Duration)) -> String {
    format!("{}..{}", show(a), show(b))
}

/// What the workers do: the flags the parent passes on to each of them.
#[derive(Debug, Clone)]
pub(crate) struct Params {
    mutexes: usize,
    shared: usize,
    ttl: Duration,
    transition: Duration,
    request_timeout: Duration,
    acquire_timeout: Duration,
    hold: (Duration, Duration),
    idle: (Duration, Duration),
    shared_hold: (Duration, Duration),
    shared_idle: (Duration, Duration),
    write_every: Duration,
    observe_every: usize,
    ramp: Duration,
    prefix: String,
}

impl Default for Params {
    fn default() -> Self {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        Params {
            mutexes: 1000,
            shared: 8,
            ttl: s(30),
            transition: s(10),
            request_timeout: s(5),
            acquire_timeout: s(3),
            hold: (s(10), s(110)),
            idle: (s(0), s(10)),
            shared_hold: (ms(100), s(2)),
            shared_idle: (s(0), s(1)),
            write_every: s(10),
            observe_every: 10,
            ramp: s(60),
            prefix: "soak".into(),
        }
    }
}

/// The parent's own flags.
#[derive(Debug, Clone)]
struct Run {
    backend: String,
    url: Option<String>,
    processes: usize,
    duration: Duration,
    sample_every: Duration,
    warmup: usize,
    max_growth: f64,
    count_slack: u64,
    max_lost: u64,
    report: Option<PathBuf>,
}

impl Params {
    /// Applies one flag of the workers; `Ok(false)` when `flag` is not one of theirs.
    fn apply(&mut self, flag: &str, value: &str) -> Result<bool, String> {
        let dur = || parse_duration(value).ok_or(format!("{flag} takes e.g. 500ms, 20s, 60m"));
        let range = || parse_range(value).ok_or(format!("{flag} takes e.g. 2s..30s"));
        let count = || {
            value
                .parse::<usize>()
                .map_err(|_| format!("{flag} takes a number"))
        };
        match flag {
            "--mutexes" => self.mutexes = count()?,
            "--shared" => self.shared = count()?,
            "--ttl" => self.ttl = dur()?,
            "--transition" => self.transition = dur()?,
            "--request-timeout" => self.request_timeout = dur()?,
            "--acquire-timeout" => self.acquire_timeout = dur()?,
            "--hold" => self.hold = range()?,
            "--idle" => self.idle = range()?,
            "--shared-hold" => self.shared_hold = range()?,
            "--shared-idle" => self.shared_idle = range()?,
            "--write-every" => self.write_every = dur()?,
            "--observe-every" => self.observe_every = count()?,
            "--ramp" => self.ramp = dur()?,
            "--prefix" => self.prefix = value.to_owned(),
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn check(&self) -> Result<(), String> {
        if self.mutexes == 0 || self.shared > self.mutexes {
            return Err("--mutexes must be at least 1 and at least --shared".into());
        }
        if self.write_every.is_zero() {
            return Err("--write-every must be more than 0".into());
        }
        if !self
            .prefix
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err("--prefix takes ASCII letters, digits and _".into());
        }
        Ok(())
    }

    /// The worker's arguments (after `soak-worker`).
    fn to_args(&self) -> Vec<String> {
        [
            ("--mutexes", self.mutexes.to_string()),
            ("--shared", self.shared.to_string()),
            ("--ttl", show(self.ttl)),
            ("--transition", show(self.transition)),
            ("--request-timeout", show(self.request_timeout)),
            ("--acquire-timeout", show(self.acquire_timeout)),
            ("--hold", show_range(self.hold)),
            ("--idle", show_range(self.idle)),
            ("--shared-hold", show_range(self.shared_hold)),
            ("--shared-idle", show_range(self.shared_idle)),
            ("--write-every", show(self.write_every)),
            ("--observe-every", self.observe_every.to_string()),
            ("--ramp", show(self.ramp)),
            ("--prefix", self.prefix.clone()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_owned(), v])
        .collect()
    }

    /// Parses a worker's arguments.
    pub(crate) fn parse_worker(args: &[String]) -> Result<Params, String> {
        let mut p = Params::default();
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let value = it.next().ok_or(format!("{flag} needs a value"))?;
            if !p.apply(flag, value)? {
                return Err(format!("unknown worker argument {flag:?}"));
            }
        }
        p.check()?;
        Ok(p)
    }
}

const USAGE: &str = "usage: simba-chaos soak --backend sqlite|redis|mysql|postgres|zookeeper|etcd \
    [--url URL] [--processes 8] [--mutexes 1000] [--shared 8] [--duration 60m] \
    [--sample-every 60s] [--warmup 10] [--max-growth 5] [--count-slack 0] [--max-lost 0] \
    [--report FILE] [--ttl 30s] [--transition 10s] [--request-timeout 5s] \
    [--acquire-timeout 3s] [--hold 10s..110s] [--idle 0s..10s] [--shared-hold 100ms..2s] \
    [--shared-idle 0s..1s] [--write-every 10s] [--observe-every 10] [--ramp 60s]";

fn parse(args: &[String]) -> Result<(Params, Run), String> {
    let mut p = Params::default();
    let mut run = Run {
        backend: String::new(),
        url: None,
        processes: 8,
        duration: Duration::from_secs(3600),
        sample_every: Duration::from_secs(60),
        warmup: 10,
        max_growth: 5.0,
        count_slack: 0,
        max_lost: 0,
        report: None,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        if p.apply(flag, value)? {
            continue;
        }
        let number = |what: &str| format!("{flag} takes {what}");
        match flag.as_str() {
            "--backend" => run.backend = value.clone(),
            "--url" => run.url = Some(value.clone()),
            "--processes" => run.processes = value.parse().map_err(|_| number("a number"))?,
            "--duration" => {
                run.duration = parse_duration(value).ok_or(number("e.g. 3m, 60m"))?;
            }
            "--sample-every" => {
                run.sample_every = parse_duration(value).ok_or(number("e.g. 60s"))?;
            }
            "--warmup" => run.warmup = value.parse().map_err(|_| number("a sample number"))?,
            "--max-growth" => {
                run.max_growth = value.parse().map_err(|_| number("a percentage"))?;
            }
            "--count-slack" => run.count_slack = value.parse().map_err(|_| number("a number"))?,
            "--max-lost" => run.max_lost = value.parse().map_err(|_| number("a number"))?,
            "--report" => run.report = Some(PathBuf::from(value)),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    p.check()?;
    if run.backend.is_empty() {
        return Err("--backend is required".into());
    }
    if run.processes == 0 {
        return Err("--processes must be at least 1".into());
    }
    if run.sample_every < Duration::from_secs(5) {
        return Err("--sample-every must be at least 5s (resources are read every 5 s)".into());
    }
    if run.warmup == 0 {
        return Err("--warmup counts samples from 1".into());
    }
    Ok((p, run))
}

/// The server kind of `backend`, `None` for SQLite.
fn server_kind(backend: &str) -> Result<Option<ServerKind>, String> {
    Ok(match backend {
        "sqlite" => None,
        "redis" => Some(ServerKind::Redis),
        "mysql" | "mariadb" => Some(ServerKind::Mysql),
        "postgres" | "postgresql" => Some(ServerKind::Postgres),
        "zookeeper" | "zk" => Some(ServerKind::Zookeeper),
        "etcd" => Some(ServerKind::Etcd),
        other => {
            return Err(format!(
                "unknown soak backend {other:?}: use sqlite, redis, mysql, postgres, zookeeper \
                 or etcd"
            ));
        }
    })
}

/// The URL the workers connect to, for a server whose own URL (ZooKeeper: connect string)
/// is `server_url`.
fn backend_url(kind: ServerKind, server_url: &str) -> String {
    match kind {
        ServerKind::Zookeeper if !server_url.starts_with("zk://") => format!("zk://{server_url}"),
        // mysql_async would switch a local server to its Unix socket, which the connection
        // count (TCP to the server's port) does not see.
        ServerKind::Mysql if !server_url.contains('?') => {
            format!("{server_url}?prefer_socket=false")
        }
        _ => server_url.to_owned(),
    }
}

/// One reading of one process.
#[derive(Debug, Clone, Copy, Default)]
struct Reading {
    rss_kib: u64,
    fds: u64,
    conns: u64,
    threads: u64,
    tasks: u64,
}

impl Reading {
    fn peak(&mut self, o: &Reading) {
        self.rss_kib = self.rss_kib.max(o.rss_kib);
        self.fds = self.fds.max(o.fds);
        self.conns = self.conns.max(o.conns);
        self.threads = self.threads.max(o.threads);
        self.tasks = self.tasks.max(o.tasks);
    }

    fn add(&mut self, o: &Reading) {
        self.rss_kib += o.rss_kib;
        self.fds += o.fds;
        self.conns += o.conns;
        self.threads += o.threads;
        self.tasks += o.tasks;
    }
}

/// RSS, descriptors, threads and TCP connections to `port` of process `pid`, from `/proc`
/// (Linux). `None` when the process is gone.
fn read_proc(pid: u32, port: Option<u16>) -> Option<Reading> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let mut sockets = std::collections::HashSet::new();
    let mut fds = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.flatten() {
        fds += 1;
        if let Ok(target) = std::fs::read_link(entry.path()) {
            let target = target.to_string_lossy().into_owned();
            if let Some(inode) = target
                .strip_prefix("socket:[")
                .and_then(|t| t.strip_suffix(']'))
            {
                sockets.insert(inode.to_owned());
            }
        }
    }
    let mut conns = 0;
    if let Some(port) = port {
        for table in ["tcp", "tcp6"] {
            let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
                continue;
            };
            conns += text
                .lines()
                .skip(1)
                .filter(|line| {
                    let f: Vec<&str> = line.split_whitespace().collect();
                    // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
                    let remote_port = f
                        .get(2)
                        .and_then(|a| a.rsplit_once(':'))
                        .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
                    f.get(3) == Some(&"01")
                        && remote_port == Some(port)
                        && f.get(9).is_some_and(|i| sockets.contains(*i))
                })
                .count() as u64;
        }
    }
    Some(Reading {
        rss_kib: field("VmRSS:"),
        fds,
        conns,
        threads: field("Threads:"),
        tasks: 0,
    })
}

/// How the parent asks the server for its client connection count.
enum ServerCount {
    /// Redis's `CLIENT LIST`, through a connection of the parent (counted too).
    Redis(Box<dyn Connection>),
    /// ZooKeeper's `cons` four-letter word (one line per connection, the asking one too).
    Zookeeper(std::net::SocketAddr),
    /// PostgreSQL, MariaDB: the connections are counted per process from `/proc` only.
    /// SQLite: no server.
    None,
}

impl ServerCount {
    async fn read(&self) -> Option<u64> {
        match self {
            ServerCount::Redis(c) => c.server_connections().await.map(|n| n as u64),
            ServerCount::Zookeeper(addr) => {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
                s.write_all(b"cons").await.ok()?;
                let mut text = String::new();
                tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut text))
                    .await
                    .ok()?
                    .ok()?;
                let n = text.lines().filter(|l| l.contains("queued=")).count() as u64;
                // A server without `cons` in its whitelist answers a sentence instead.
                n.checked_sub(1)
            }
            ServerCount::None => None,
        }
    }
}

/// One sample: the peaks of every process over a period.
#[derive(Debug, Clone, Default)]
struct Sample {
    elapsed: Duration,
    per_process: Vec<Reading>,
    server: Option<u64>,
    totals: Totals,
    counters: Vec<(String, u64)>,
}

impl Sample {
    fn sum(&self) -> Reading {
        let mut t = Reading::default();
        for r in &self.per_process {
            t.add(r);
        }
        t
    }

    fn counter(&self, key: &str) -> u64 {
        self.counters
            .iter()
            .find(|(k, _)| k == key)
            .map_or(0, |(_, v)| *v)
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

const COUNTERS: [&str; 12] = [
    "held",
    "acquired",
    "timeouts",
    "private_timeouts",
    "lost",
    "release_errors",
    "acquire_errors",
    "ledger_errors",
    "writes_rejected",
    "observer_changes",
    "observer_errors",
    "observer_fence_backwards",
];

/// The errors of the verdict (besides timeouts, which the shared mutexes are made to have,
/// and losses, bounded by `--max-lost`).
const ERRORS: [&str; 5] = [
    "private_timeouts",
    "release_errors",
    "acquire_errors",
    "ledger_errors",
    "observer_errors",
];

struct Worker {
    name: String,
    child: Child,
    pid: u32,
    log: PathBuf,
}

fn log_tail(path: &std::path::Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

fn json_line(out: &mut String, minute: usize, s: &Sample, who: &str, r: &Reading) {
    let _ = writeln!(
        out,
        "{{\"sample\":{minute},\"elapsed_s\":{:.1},\"process\":\"{who}\",\"rss_kib\":{},\
         \"fds\":{},\"conns\":{},\"threads\":{},\"tasks\":{}}}",
        s.elapsed.as_secs_f64(),
        r.rss_kib,
        r.fds,
        r.conns,
        r.threads,
        r.tasks
    );
}

fn growth(base: u64, last: u64) -> f64 {
    if base == 0 {
        if last == 0 { 0.0 } else { f64::INFINITY }
    } else {
        (last as f64 - base as f64) * 100.0 / base as f64
    }
}

/// Runs `simba-chaos soak ARGS`.
pub(crate) async fn soak(args: &[String]) -> ExitCode {
    let (mut params, run) = match parse(args) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("simba-chaos soak: {e}\n{USAGE}");
            return ExitCode::from(64);
        }
    };
    match soak_run(&mut params, &run).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("simba-chaos soak: {e:#}");
            ExitCode::from(69)
        }
    }
}

async fn soak_run(params: &mut Params, run: &Run) -> anyhow::Result<bool> {
    use anyhow::Context;
    let kind = server_kind(&run.backend).map_err(anyhow::Error::msg)?;
    let program = std::env::current_exe().context("finding its own binary")?;
    let dir = std::env::temp_dir().join(format!("simba-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let server: Option<TestServer> = match (kind, &run.url) {
        (None, _) => None,
        (Some(kind), Some(url)) => {
            let bare = url.strip_prefix("zk://").unwrap_or(url);
            Some(TestServer::external(kind, bare)?)
        }
        (Some(kind), None) => Some(servers::private(kind).await?),
    };
    let url = match (&server, kind) {
        (Some(s), Some(kind)) => backend_url(kind, s.url()),
        _ => match &run.url {
            Some(u) => u.clone(),
            None => format!("sqlite://{}", dir.join("soak.db").display()),
        },
    };
    let server_addr = match &server {
        Some(s) => Some(s.socket_addr()?),
        None => None,
    };
    let port = server_addr.map(|a| a.port());
    let connectors = Connectors::new(vec![
        &simba_redis::CONNECTOR,
        &simba_jdbc::CONNECTOR,
        &simba_zookeeper::CONNECTOR,
        &simba_etcd::CONNECTOR,
    ]);
    let counter = match (kind, server_addr) {
        (Some(ServerKind::Redis), _) => ServerCount::Redis(
            connectors
                .connect(&url, &ConnectOptions::new())
                .await
                .with_context(|| format!("connecting to {}", connectors.redact(&url)))?,
        ),
        (Some(ServerKind::Zookeeper), Some(addr)) => ServerCount::Zookeeper(addr),
        _ => ServerCount::None,
    };
    // A server of others (`--url`) counts their connections too: shown, not judged.
    let judge_server = server.as_ref().is_some_and(TestServer::is_private);
    params.prefix = format!("soak_{}", std::process::id());
    let ledger = Ledger::start().await.context("starting the ledger")?;

    println!(
        "soak: backend={} url={} processes={} mutexes={} shared={} duration={}s \
         sample_every={}s warmup={} ttl={} transition={} hold={} shared_hold={} \
         observe_every={}",
        run.backend,
        connectors.redact(&url),
        run.processes,
        params.mutexes,
        params.shared,
        run.duration.as_secs(),
        run.sample_every.as_secs(),
        run.warmup,
        show(params.ttl),
        show(params.transition),
        show_range(params.hold),
        show_range(params.shared_hold),
        params.observe_every,
    );
    let mut workers = Vec::new();
    for i in 0..run.processes {
        let name = format!("p{i}");
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).with_context(|| format!("{}", log.display()))?;
        let child = Command::new(&program)
            .arg("soak-worker")
            .args(params.to_args())
            .env("SIMBA_BACKEND", &url)
            .env("SIMBA_SOAK_LEDGER", ledger.addr().to_string())
            .env("SIMBA_SOAK_ID", &name)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting worker {name}"))?;
        let pid = child.id().context("a worker without a pid")?;
        workers.push(Worker {
            name,
            child,
            pid,
            log,
        });
    }
    let mut report = match &run.report {
        Some(p) => {
            Some(std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?)
        }
        None => None,
    };
    println!(
        "{:>6} {:>10} {:>9} {:>6} {:>6} {:>7} {:>8} {:>8} {:>11} {:>9} {:>9} {:>5} {:>6}",
        "sample",
        "minute",
        "RSS MiB",
        "FDs",
        "conns",
        "server",
        "tasks",
        "threads",
        "ownerships",
        "handoffs",
        "timeouts",
        "lost",
        "errors"
    );
    let t0 = Instant::now();
    let mut samples: Vec<Sample> = Vec::new();
    let mut period = vec![Reading::default(); workers.len()];
    let mut server_peak: Option<u64> = None;
    let mut next_sample = t0 + run.sample_every;
    let mut dead: Vec<String> = Vec::new();
    let end = t0 + run.duration;
    let mut interrupted = false;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("listening for SIGTERM")?;
    while Instant::now() < end && dead.is_empty() && !interrupted {
        // SIGINT or SIGTERM end the run early: the workers and the server are still
        // stopped, and the verdict covers what was sampled.
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(5)) => {}
            _ = tokio::signal::ctrl_c() => interrupted = true,
            _ = term.recv() => interrupted = true,
        }
        for (w, peak) in workers.iter_mut().zip(period.iter_mut()) {
            if matches!(w.child.try_wait(), Ok(Some(_))) {
                dead.push(format!("{} exited:\n{}", w.name, log_tail(&w.log)));
                continue;
            }
            if let Some(mut r) = read_proc(w.pid, port) {
                r.tasks = ledger
                    .stats(&w.name)
                    .iter()
                    .find(|(k, _)| k == "tasks")
                    .map_or(0, |(_, v)| *v);
                peak.peak(&r);
            }
        }
        if let Some(n) = counter.read().await {
            server_peak = Some(server_peak.map_or(n, |p| p.max(n)));
        }
        let now = Instant::now();
        if now + Duration::from_secs(1) >= next_sample {
            let mut counters: Vec<(String, u64)> =
                COUNTERS.iter().map(|k| ((*k).to_owned(), 0)).collect();
            for w in &workers {
                for (k, v) in ledger.stats(&w.name) {
                    if let Some(c) = counters.iter_mut().find(|(ck, _)| *ck == k) {
                        c.1 += v;
                    }
                }
            }
            let sample = Sample {
                elapsed: now - t0,
                per_process: std::mem::take(&mut period),
                server: server_peak.take(),
                totals: ledger.check(),
                counters,
            };
            period = vec![Reading::default(); workers.len()];
            let n = samples.len() + 1;
            let sum = sample.sum();
            let errors: u64 = ERRORS.iter().map(|k| sample.counter(k)).sum();
            println!(
                "{n:>6} {:>10.1} {:>9.1} {:>6} {:>6} {:>7} {:>8} {:>8} {:>11} {:>9} {:>9} {:>5} \
                 {:>6}",
                sample.elapsed.as_secs_f64() / 60.0,
                mib(sum.rss_kib),
                sum.fds,
                sum.conns,
                sample.server.map_or("n/a".to_owned(), |s| s.to_string()),
                sum.tasks,
                sum.threads,
                sample.totals.ownerships,
                sample.totals.handoffs,
                sample.counter("timeouts"),
                sample.counter("lost"),
                errors
            );
            if let Some(f) = report.as_mut() {
                let mut out = String::new();
                for (w, r) in workers.iter().zip(&sample.per_process) {
                    json_line(&mut out, n, &sample, &w.name, r);
                }
                json_line(&mut out, n, &sample, "all", &sum);
                let t = &sample.totals;
                let _ = write!(
                    out,
                    "{{\"sample\":{n},\"process\":\"ledger\",\"server_conns\":{},\
                     \"ownerships\":{},\"handoffs\":{},\"writes_accepted\":{},\
                     \"writes_rejected\":{},\"stale_writes_accepted\":{},\"overlaps\":{},\
                     \"fence_regressions\":{}",
                    sample.server.map_or("null".to_owned(), |s| s.to_string()),
                    t.ownerships,
                    t.handoffs,
                    t.writes_accepted,
                    t.writes_rejected,
                    t.stale_writes_accepted,
                    t.overlaps,
                    t.fence_regressions
                );
                for (k, v) in &sample.counters {
                    let _ = write!(out, ",\"{k}\":{v}");
                }
                out.push_str("}\n");
                if let Err(e) = f.write_all(out.as_bytes()) {
                    eprintln!("simba-chaos soak: writing the report: {e}");
                }
            }
            samples.push(sample);
            next_sample += run.sample_every;
        }
    }
    // Stop every worker, then close their open ownerships at the kill.
    let mut kills = Vec::new();
    for w in &mut workers {
        let _ = w.child.start_kill();
        kills.push(Instant::now());
    }
    for (w, killed) in workers.iter_mut().zip(kills) {
        let _ = w.child.wait().await;
        ledger.died(&w.name, killed);
    }
    let totals = ledger.check();
    drop(server);
    if interrupted {
        println!(
            "interrupted after {:.1} minutes",
            t0.elapsed().as_secs_f64() / 60.0
        );
    }
    let passed = verdict(run, params, &samples, &totals, &ledger, &dead, judge_server);
    if passed {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        println!("the workers' logs are kept in {}", dir.display());
    }
    Ok(passed)
}

fn verdict(
    run: &Run,
    params: &Params,
    samples: &[Sample],
    totals: &Totals,
    ledger: &Ledger,
    dead: &[String],
    judge_server: bool,
) -> bool {
    let mut failures: Vec<String> = Vec::new();
    for d in dead {
        failures.push(format!("a worker died: {d}"));
    }
    for v in ledger.first_violations() {
        println!("violation: {v}");
    }
    let mut line = format!("soak backend={}", run.backend);
    match (samples.get(run.warmup - 1), samples.last()) {
        (Some(base), Some(last)) if samples.len() > run.warmup => {
            let (b, l) = (base.sum(), last.sum());
            let mut judge = |line: &mut String, what: &str, base: u64, last: u64, slack: u64| {
                let g = growth(base, last);
                let limit = base as f64 * (1.0 + run.max_growth / 100.0) + slack as f64;
                let _ = write!(line, " {what}={base}->{last}({g:+.1}%)");
                if last as f64 > limit {
                    failures.push(format!(
                        "{what} grew from {base} (sample {}) to {last} (sample {}): {g:+.1}%, \
                         more than {}% + {slack}",
                        run.warmup,
                        samples.len(),
                        run.max_growth
                    ));
                }
            };
            judge(&mut line, "rss_kib", b.rss_kib, l.rss_kib, 0);
            judge(&mut line, "fds", b.fds, l.fds, run.count_slack);
            judge(&mut line, "conns", b.conns, l.conns, run.count_slack);
            judge(&mut line, "tasks", b.tasks, l.tasks, run.count_slack);
            let _ = write!(line, " threads={}->{}", b.threads, l.threads);
            match (base.server, last.server) {
                (Some(sb), Some(sl)) if judge_server => {
                    judge(&mut line, "server_conns", sb, sl, run.count_slack)
                }
                (Some(sb), Some(sl)) => {
                    let _ = write!(
                        line,
                        " server_conns={sb}->{sl}(not judged: a shared server)"
                    );
                }
                _ => line.push_str(" server_conns=n/a"),
            }
        }
        _ => failures.push(format!(
            "{} samples: too few to compare sample {} (the warm-up) with a later one",
            samples.len(),
            run.warmup
        )),
    }
    let last = samples.last().cloned().unwrap_or_default();
    let errors: u64 = ERRORS.iter().map(|k| last.counter(k)).sum();
    let _ = write!(
        line,
        " ownerships={} handoffs={} timeouts={} lost={} errors={errors} overlaps={} \
         fence_regressions={} stale_writes_accepted={}",
        totals.ownerships,
        totals.handoffs,
        last.counter("timeouts"),
        last.counter("lost"),
        totals.overlaps,
        totals.fence_regressions,
        totals.stale_writes_accepted
    );
    if totals.overlaps > 0 || totals.fence_regressions > 0 || totals.stale_writes_accepted > 0 {
        failures.push("safety: overlaps, fence regressions or stale writes (above)".into());
    }
    if totals.protocol_errors > 0 {
        failures.push(format!(
            "{} malformed ledger requests",
            totals.protocol_errors
        ));
    }
    for k in ERRORS {
        if last.counter(k) > 0 {
            failures.push(format!("{k}={}", last.counter(k)));
        }
    }
    if last.counter("lost") > run.max_lost {
        failures.push(format!(
            "{} ownerships lost while held (no fault is injected; --max-lost {})",
            last.counter("lost"),
            run.max_lost
        ));
    }
    if params.shared > 0 && run.processes > 1 && totals.handoffs == 0 {
        failures
            .push("no hand-over between processes: the shared mutexes saw no contention".into());
    }
    let passed = failures.is_empty();
    for f in &failures {
        println!("failed: {f}");
    }
    println!("{line} verdict={}", if passed { "pass" } else { "fail" });
    passed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_arguments_round_trip() {
        let args: Vec<String> = [
            "--backend",
            "redis",
            "--mutexes",
            "50",
            "--hold",
            "1s..3s",
            "--duration",
            "3m",
            "--ttl",
            "7s",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let (p, run) = parse(&args).expect("parses");
        assert_eq!(
            (run.backend.as_str(), run.duration),
            ("redis", Duration::from_secs(180))
        );
        let back = Params::parse_worker(&p.to_args()).expect("the worker parses its flags");
        assert_eq!(back.mutexes, 50);
        assert_eq!(back.hold, (Duration::from_secs(1), Duration::from_secs(3)));
        assert_eq!(back.ttl, Duration::from_secs(7));
        assert!(
            parse(&[
                "--backend".into(),
                "redis".into(),
                "--hold".into(),
                "3s..1s".into()
            ])
            .is_err()
        );
        assert!(
            parse(&["--mutexes".into(), "5".into()]).is_err(),
            "no backend"
        );
    }

    #[test]
    fn durations_and_growth() {
        assert_eq!(parse_duration("60m"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("5"), None);
        assert_eq!(growth(100, 105), 5.0);
        assert_eq!(growth(0, 0), 0.0);
        assert!(growth(0, 1).is_infinite());
        let (lo, hi) = (Duration::from_millis(10), Duration::from_millis(20));
        for _ in 0..100 {
            let d = between((lo, hi));
            assert!(d >= lo && d <= hi, "{d:?}");
        }
    }

    #[test]
    fn own_process_is_read_from_proc() {
        let r = read_proc(std::process::id(), Some(1)).expect("this process");
        assert!(r.rss_kib > 0 && r.fds >= 3 && r.threads >= 1, "{r:?}");
        assert!(read_proc(u32::MAX, None).is_none());
    }
}
