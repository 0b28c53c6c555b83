//! The fault-injection safety run: contender **processes** contend for one mutex and write
//! to a [`FencedResource`] while faults hit the owner and the server; the history of
//! ownerships is then checked.
//!
//! The engine does not link any backend: it runs a contender program (the `simba-chaos`
//! binary's `contender` mode) that reads its orders from the environment:
//!
//! | variable | meaning |
//! |---|---|
//! | `SIMBA_BACKEND` | backend URL (through this contender's own fault proxy) |
//! | `SIMBA_CHAOS_RESOURCE` | `host:port` of the fenced resource |
//! | `SIMBA_CHAOS_ID` | the contender's name at the resource |
//! | `SIMBA_CHAOS_MUTEX` | the mutex |
//! | `SIMBA_CHAOS_TTL_MS`, `SIMBA_CHAOS_TRANSITION_MS` | lease timing |
//! | `SIMBA_CHAOS_UNSAFE` | `1`: ignore the local deadline (to prove the checker catches it) |

mod resource;

#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub use resource::fuzz_lines;
pub use resource::{FencedResource, ResourceClient, ResourceReport};

use std::fmt;
use std::path::PathBuf;
use std::process::Stdio;
use std::str::FromStr;
use std::time::Duration;

use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep};
use tracing::{info, warn};

use crate::history::Violation;
use crate::proxy::FaultProxy;
use crate::servers::{self, ServerError, ServerKind, TestServer};

/// The backend under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChaosBackend {
    /// Redis.
    Redis,
    /// MySQL / MariaDB.
    Mysql,
    /// PostgreSQL.
    Postgres,
    /// SQLite (a file; no server).
    Sqlite,
    /// ZooKeeper.
    Zookeeper,
}

impl FromStr for ChaosBackend {
    type Err = ChaosError;
    fn from_str(s: &str) -> Result<Self, ChaosError> {
        Ok(match s {
            "redis" => ChaosBackend::Redis,
            "mysql" | "mariadb" => ChaosBackend::Mysql,
            "postgres" | "postgresql" => ChaosBackend::Postgres,
            "sqlite" => ChaosBackend::Sqlite,
            "zookeeper" | "zk" => ChaosBackend::Zookeeper,
            other => {
                return Err(ChaosError::Usage(format!(
                    "unknown backend {other:?}: use redis, mysql, postgres, sqlite or zookeeper"
                )));
            }
        })
    }
}

impl ChaosBackend {
    fn server_kind(self) -> Option<ServerKind> {
        match self {
            ChaosBackend::Redis => Some(ServerKind::Redis),
            ChaosBackend::Mysql => Some(ServerKind::Mysql),
            ChaosBackend::Postgres => Some(ServerKind::Postgres),
            ChaosBackend::Zookeeper => Some(ServerKind::Zookeeper),
            ChaosBackend::Sqlite => None,
        }
    }
}

/// A fault the run injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// SIGKILL the owner process (it is restarted).
    Kill,
    /// SIGSTOP the owner past its lease, then SIGCONT: the classic GC pause.
    Pause,
    /// Restart the server (Redis: losing all data). Needs a private server.
    Restart,
    /// Close the owner's connections to the server.
    Cut,
    /// Add latency to the owner's connections for a while.
    Delay,
    /// Hold the owner's traffic past its lease (ZooKeeper: session expiry).
    Partition,
}

impl FromStr for FaultKind {
    type Err = ChaosError;
    fn from_str(s: &str) -> Result<Self, ChaosError> {
        Ok(match s {
            "kill" => FaultKind::Kill,
            "pause" => FaultKind::Pause,
            "restart" => FaultKind::Restart,
            "cut" => FaultKind::Cut,
            "delay" => FaultKind::Delay,
            "partition" | "expire" => FaultKind::Partition,
            other => {
                return Err(ChaosError::Usage(format!(
                    "unknown fault {other:?}: use kill, pause, restart, cut, delay, partition"
                )));
            }
        })
    }
}

/// Everything a run needs.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    /// The backend.
    pub backend: ChaosBackend,
    /// A server to use instead of a private one (the restart fault is then skipped).
    pub url: Option<String>,
    /// How long to run.
    pub duration: Duration,
    /// Which faults to inject, in turn.
    pub faults: Vec<FaultKind>,
    /// How many contender processes.
    pub contenders: usize,
    /// The contender program and its leading arguments (e.g. `simba-chaos contender`).
    pub program: PathBuf,
    /// Arguments before the contender's own.
    pub args: Vec<String>,
    /// Lease ttl of the contenders.
    pub ttl: Duration,
    /// Lease transition of the contenders.
    pub transition: Duration,
    /// Time between two faults.
    pub fault_every: Duration,
    /// Fewer handoffs than this fails the run: it would not mean anything.
    pub min_handoffs: usize,
    /// Contenders ignore their local deadline (to show that the checker catches it).
    pub unsafe_contenders: bool,
}

impl ChaosConfig {
    /// A config with the usual settings: 3 contenders, ttl 1 s, transition 500 ms, a fault
    /// every 2 s, all faults.
    pub fn new(backend: ChaosBackend, program: impl Into<PathBuf>, args: Vec<String>) -> Self {
        ChaosConfig {
            backend,
            url: None,
            duration: Duration::from_secs(30),
            faults: vec![
                FaultKind::Kill,
                FaultKind::Pause,
                FaultKind::Restart,
                FaultKind::Cut,
                FaultKind::Delay,
                FaultKind::Partition,
            ],
            contenders: 3,
            program: program.into(),
            args,
            // ZooKeeper: ttl + transition is the session timeout, at least 2 s.
            ttl: Duration::from_millis(if backend == ChaosBackend::Zookeeper {
                1500
            } else {
                1000
            }),
            transition: Duration::from_millis(500),
            fault_every: Duration::from_secs(2),
            min_handoffs: 5,
            unsafe_contenders: false,
        }
    }
}

/// Why a run could not be made (not a safety verdict).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChaosError {
    /// Bad arguments.
    #[error("{0}")]
    Usage(String),
    /// The server could not be had.
    #[error(transparent)]
    Server(#[from] ServerError),
    /// Local I/O (the resource, a proxy, spawning a contender).
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ChaosError {
    let context = context.into();
    move |source| ChaosError::Io { context, source }
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct ChaosSummary {
    /// What the resource counted.
    pub report: ResourceReport,
    /// Overlapping ownerships and fence regressions found by the checker.
    pub violations: Vec<Violation>,
    /// Faults injected.
    pub faults: usize,
    /// Faults by kind, for the report.
    pub faults_by_kind: Vec<(FaultKind, usize)>,
    /// The minimum of handoffs asked for.
    pub min_handoffs: usize,
    /// The last lines of each contender's log, kept when the run found violations.
    pub log_tails: Vec<String>,
}

impl ChaosSummary {
    /// Overlapping ownerships.
    pub fn overlaps(&self) -> usize {
        self.violations
            .iter()
            .filter(|v| matches!(v, Violation::Overlap { .. }))
            .count()
    }

    /// Whether the run passed: no overlap, no accepted stale write, no fence regression,
    /// and enough handoffs to mean something.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
            && self.report.stale_writes_accepted == 0
            && self.report.handoffs >= self.min_handoffs
    }
}

impl fmt::Display for ChaosSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for v in self.violations.iter().take(10) {
            writeln!(f, "violation: {v}")?;
        }
        writeln!(
            f,
            "ownerships={} writes_accepted={} writes_fenced_off={} faults_by_kind={:?}",
            self.report.ownerships,
            self.report.writes_accepted,
            self.report.writes_rejected,
            self.faults_by_kind
        )?;
        write!(
            f,
            "handoffs={} overlaps={} stale_writes_accepted={} faults={}",
            self.report.handoffs,
            self.overlaps(),
            self.report.stale_writes_accepted,
            self.faults
        )
    }
}

struct Contender {
    name: String,
    url: String,
    proxy: Option<FaultProxy>,
    child: Option<Child>,
    log: PathBuf,
}

struct Run<'a> {
    cfg: &'a ChaosConfig,
    resource: FencedResource,
    mutex: String,
    contenders: Vec<Contender>,
}

impl Run<'_> {
    fn spawn(&mut self, i: usize) -> Result<(), ChaosError> {
        let cfg = self.cfg;
        let c = &mut self.contenders[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&c.log)
            .map_err(io(format!("open {}", c.log.display())))?;
        let log2 = log.try_clone().map_err(io("clone log"))?;
        let child = Command::new(&cfg.program)
            .args(&cfg.args)
            .env("SIMBA_BACKEND", &c.url)
            .env("SIMBA_CHAOS_RESOURCE", self.resource.addr().to_string())
            .env("SIMBA_CHAOS_ID", &c.name)
            .env("SIMBA_CHAOS_MUTEX", &self.mutex)
            .env("SIMBA_CHAOS_TTL_MS", cfg.ttl.as_millis().to_string())
            .env(
                "SIMBA_CHAOS_TRANSITION_MS",
                cfg.transition.as_millis().to_string(),
            )
            .env(
                "SIMBA_CHAOS_UNSAFE",
                if cfg.unsafe_contenders { "1" } else { "0" },
            )
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .kill_on_drop(true)
            .spawn()
            .map_err(io(format!("spawn {}", cfg.program.display())))?;
        c.child = Some(child);
        Ok(())
    }

    /// Restarts contenders that exited (killed, or died on purpose).
    fn respawn_dead(&mut self) -> Result<(), ChaosError> {
        for i in 0..self.contenders.len() {
            let dead = match self.contenders[i].child.as_mut() {
                Some(ch) => ch.try_wait().map_err(io("wait for a contender"))?.is_some(),
                None => true,
            };
            if dead {
                self.spawn(i)?;
            }
        }
        Ok(())
    }

    fn owner_index(&self) -> Option<usize> {
        let name = self.resource.current_owner()?;
        self.contenders.iter().position(|c| c.name == name)
    }

    async fn signal(&self, i: usize, sig: &str) -> Result<(), ChaosError> {
        let Some(pid) = self.contenders[i].child.as_ref().and_then(Child::id) else {
            return Ok(());
        };
        Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(pid.to_string())
            .status()
            .await
            .map_err(io("run kill"))?;
        Ok(())
    }

    fn lease(&self) -> Duration {
        self.cfg.ttl + self.cfg.transition
    }

    /// Injects one fault; returns whether it applied.
    async fn fault(
        &mut self,
        kind: FaultKind,
        server: Option<&TestServer>,
    ) -> Result<bool, ChaosError> {
        let Some(owner) = self.owner_index() else {
            return Ok(false);
        };
        info!(?kind, owner = %self.contenders[owner].name, "fault");
        match kind {
            FaultKind::Kill => {
                if let Some(ch) = self.contenders[owner].child.as_mut() {
                    let _ = ch.start_kill();
                    let _ = ch.wait().await;
                }
                self.spawn(owner)?;
            }
            FaultKind::Pause => {
                self.signal(owner, "STOP").await?;
                sleep(self.lease() + Duration::from_millis(500)).await;
                self.signal(owner, "CONT").await?;
            }
            FaultKind::Restart => {
                let Some(s) = server.filter(|s| s.is_private()) else {
                    return Ok(false);
                };
                if self.cfg.backend == ChaosBackend::Redis {
                    s.wipe_restart().await?;
                } else {
                    s.restart().await?;
                }
            }
            FaultKind::Cut => {
                let Some(p) = &self.contenders[owner].proxy else {
                    return Ok(false);
                };
                p.cut();
            }
            FaultKind::Delay => {
                let Some(p) = &self.contenders[owner].proxy else {
                    return Ok(false);
                };
                p.set_latency(Duration::from_millis(200));
                sleep(self.lease()).await;
                p.set_latency(Duration::ZERO);
            }
            FaultKind::Partition => {
                let Some(p) = &self.contenders[owner].proxy else {
                    return Ok(false);
                };
                p.blackhole(true);
                // ZooKeeper sessions here time out after 2 s; lease backends after the lease.
                sleep(self.lease().max(Duration::from_secs(2)) + Duration::from_secs(1)).await;
                p.blackhole(false);
                p.cut();
            }
        }
        Ok(true)
    }
}

fn backend_url(backend: ChaosBackend, server_url: &str) -> String {
    match backend {
        ChaosBackend::Zookeeper => format!("zk://{server_url}"),
        // mysql_async switches a local server to its Unix socket, past the proxy.
        ChaosBackend::Mysql if !server_url.contains('?') => {
            format!("{server_url}?prefer_socket=false")
        }
        _ => server_url.to_owned(),
    }
}

/// Runs the chaos test.
///
/// # Errors
/// [`ChaosError`] when the run could not be made (server, spawning); a safety failure is
/// not an error but a [`ChaosSummary`] that did not pass.
pub async fn run(cfg: &ChaosConfig) -> Result<ChaosSummary, ChaosError> {
    if cfg.contenders < 2 {
        return Err(ChaosError::Usage("at least 2 contenders".into()));
    }
    let dir = tempfile::tempdir().map_err(io("temp dir"))?;
    let server = match (cfg.backend.server_kind(), &cfg.url) {
        (None, _) => None,
        (Some(kind), Some(url)) => Some(TestServer::external(kind, url)?),
        (Some(kind), None) => Some(servers::private(kind).await?),
    };
    let resource = FencedResource::start()
        .await
        .map_err(io("start the fenced resource"))?;
    let mutex = format!("chaos-{}", std::process::id());
    let mut contenders = Vec::new();
    for i in 0..cfg.contenders {
        let (url, proxy) = match &server {
            Some(s) => {
                let upstream = s.socket_addr()?;
                let proxy = FaultProxy::start(upstream)
                    .await
                    .map_err(io("start a proxy"))?;
                (
                    backend_url(cfg.backend, &s.url_via(proxy.addr())),
                    Some(proxy),
                )
            }
            None => (
                format!("sqlite://{}", dir.path().join("chaos.db").display()),
                None,
            ),
        };
        contenders.push(Contender {
            name: format!("c{i}"),
            url,
            proxy,
            child: None,
            log: dir.path().join(format!("c{i}.log")),
        });
    }
    let mut run = Run {
        cfg,
        resource,
        mutex,
        contenders,
    };
    for i in 0..cfg.contenders {
        run.spawn(i)?;
    }
    let t0 = Instant::now();
    let mut injected: Vec<(FaultKind, usize)> = Vec::new();
    let mut next_fault = t0 + cfg.fault_every;
    let mut turn = 0usize;
    while t0.elapsed() < cfg.duration {
        sleep(Duration::from_millis(50)).await;
        run.respawn_dead()?;
        if Instant::now() >= next_fault && !cfg.faults.is_empty() {
            let kind = cfg.faults[turn % cfg.faults.len()];
            turn += 1;
            match run.fault(kind, server.as_ref()).await {
                Ok(true) => match injected.iter_mut().find(|(k, _)| *k == kind) {
                    Some((_, n)) => *n += 1,
                    None => injected.push((kind, 1)),
                },
                Ok(false) => {}
                Err(e) => warn!(?kind, "fault failed: {e}"),
            }
            next_fault = Instant::now() + cfg.fault_every;
        }
    }
    for c in &mut run.contenders {
        if let Some(ch) = c.child.as_mut() {
            let _ = ch.start_kill();
            let _ = ch.wait().await;
        }
    }
    let violations = run.resource.violations();
    let report = run.resource.report();
    let mut log_tails = Vec::new();
    if !violations.is_empty()
        || report.handoffs < cfg.min_handoffs
        || report.stale_writes_accepted > 0
    {
        for c in &run.contenders {
            if let Ok(text) = std::fs::read_to_string(&c.log) {
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(20)..].join("\n");
                log_tails.push(format!("--- {} ---\n{tail}", c.name));
            }
        }
    }
    Ok(ChaosSummary {
        report,
        violations,
        faults: injected.iter().map(|(_, n)| n).sum(),
        faults_by_kind: injected,
        min_handoffs: cfg.min_handoffs,
        log_tails,
    })
}
