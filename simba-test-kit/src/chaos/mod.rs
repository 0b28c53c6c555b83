//! The fault-injection safety run: contender **processes** contend for one mutex (or the
//! permits of one semaphore, [`ChaosConfig::permits`], or a read-write lock,
//! [`ChaosConfig::rwlock`]) and write to a [`FencedResource`]
//! while faults hit the owner and the server; the history of ownerships is then checked.
//!
//! The engine does not link any backend: it runs a contender program (the `simba-chaos`
//! binary's `contender` mode) that reads its orders from the environment:
//!
//! | variable | meaning |
//! |---|---|
//! | `SIMBA_BACKEND` | backend URL (through this contender's own fault proxy) |
//! | `SIMBA_CHAOS_RESOURCE` | `host:port` of the fenced resource |
//! | `SIMBA_CHAOS_ID` | the contender's name at the resource |
//! | `SIMBA_CHAOS_MUTEX` | the mutex (or semaphore) |
//! | `SIMBA_CHAOS_PERMITS` | a number: contend for one permit of a semaphore of this many permits (empty: the mutex) |
//! | `SIMBA_CHAOS_RWLOCK` | `1`: contend for a read-write lock of the mutex's name instead, reading or writing |
//! | `SIMBA_CHAOS_TTL_MS`, `SIMBA_CHAOS_TRANSITION_MS` | lease timing |
//! | `SIMBA_CHAOS_UNSAFE` | `1`: ignore the local deadline (to prove the checker catches it) |
//! | `SIMBA_CHAOS_HOLD_MS` | `FROM..TO`: how long to hold, in milliseconds |
//! | `SIMBA_CHAOS_CRASH` | `0`: never exit while holding (by default it does now and then) |
//!
//! A contender tells the resource when it starts waiting (`WAIT`), so that the run also
//! measures its load ([`ChaosSummary::load`]).

#[cfg(feature = "containers")]
mod nodes;
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

use crate::history::{self, Load, Violation};
use crate::proxy::FaultProxy;
use crate::servers::{self, PoolMode, Pooler, ServerError, ServerKind, TestServer};

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
    /// etcd (one member, a private local server).
    Etcd,
    /// Redis behind Sentinel: a primary, two replicas of different `replica-priority` and
    /// three sentinels ([`servers::redis_sentinel_with_replicas`]); a target of
    /// [`FaultKind::Failover`], with [`RedisCluster`](Self::RedisCluster).
    RedisSentinel,
    /// Redis Cluster: three primaries with one replica each
    /// ([`servers::redis_cluster_with_replicas`]), contenders connected with
    /// `replicaAcks=1`; the target of [`FaultKind::Failover`] on the primary of the
    /// mutex's slot, and of [`FaultKind::Cut`] (the owner's connections closed by the
    /// nodes, `CLIENT KILL`).
    RedisCluster,
    /// A three-node ZooKeeper ensemble in containers (`servers::ZkEnsemble`,
    /// feature `containers`): the target of the faults that need hosts.
    ZookeeperEnsemble,
    /// A three-member etcd cluster in containers (`servers::EtcdCluster`, feature
    /// `containers`); contender `i` talks to member `i mod 3` only (on its own client
    /// network), so that a member's fault is a fault of known contenders.
    EtcdCluster,
    /// PostgreSQL behind PgBouncer in transaction mode ([`servers::pgbouncer_private`]):
    /// contenders connect through PgBouncer (each through its own fault proxy) with the
    /// URL option `simba_pooler=transaction`; besides the PostgreSQL faults, PgBouncer is
    /// killed, paused and restarted ([`FaultKind::PoolerKill`] and its kin).
    PostgresPgbouncer,
    /// As [`PostgresPgbouncer`](Self::PostgresPgbouncer), with PgBouncer in session mode
    /// and the URL option `simba_pooler=session` (no cancel request through the pooler:
    /// PgBouncer 1.18 can exit on one).
    PostgresPgbouncerSession,
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
            "etcd" => ChaosBackend::Etcd,
            "redis-sentinel" => ChaosBackend::RedisSentinel,
            "redis-cluster" => ChaosBackend::RedisCluster,
            "zookeeper-ensemble" | "zk-ensemble" => ChaosBackend::ZookeeperEnsemble,
            "etcd-cluster" => ChaosBackend::EtcdCluster,
            "postgres-pgbouncer" => ChaosBackend::PostgresPgbouncer,
            "postgres-pgbouncer-session" => ChaosBackend::PostgresPgbouncerSession,
            other => {
                return Err(ChaosError::Usage(format!(
                    "unknown backend {other:?}: use redis, redis-sentinel, redis-cluster, mysql, \
                     postgres, postgres-pgbouncer, postgres-pgbouncer-session, sqlite, \
                     zookeeper, zookeeper-ensemble, etcd or etcd-cluster"
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
            ChaosBackend::Etcd => Some(ServerKind::Etcd),
            ChaosBackend::Sqlite
            | ChaosBackend::RedisSentinel
            | ChaosBackend::RedisCluster
            | ChaosBackend::ZookeeperEnsemble
            | ChaosBackend::EtcdCluster
            | ChaosBackend::PostgresPgbouncer
            | ChaosBackend::PostgresPgbouncerSession => None,
        }
    }

    /// The pool mode of a PostgreSQL-behind-PgBouncer target.
    fn pool_mode(self) -> Option<PoolMode> {
        match self {
            ChaosBackend::PostgresPgbouncer => Some(PoolMode::Transaction),
            ChaosBackend::PostgresPgbouncerSession => Some(PoolMode::Session),
            _ => None,
        }
    }

    /// Whether this target is a deployment in containers (its faults need hosts).
    fn in_containers(self) -> bool {
        matches!(
            self,
            ChaosBackend::ZookeeperEnsemble | ChaosBackend::EtcdCluster
        )
    }

    /// Whether this is an etcd target (leases of whole seconds, at least 2 s).
    fn is_etcd(self) -> bool {
        matches!(self, ChaosBackend::Etcd | ChaosBackend::EtcdCluster)
    }

    /// Whether this is a ZooKeeper target (sessions instead of leases).
    fn is_zookeeper(self) -> bool {
        matches!(
            self,
            ChaosBackend::Zookeeper | ChaosBackend::ZookeeperEnsemble
        )
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
    /// Fail over the primary. `redis-sentinel`: hold back the replica the
    /// sentinels prefer (lowest `replica-priority`) while the other one stays live — or,
    /// every other time, freeze both — wait for the next acquisition or renewal (which
    /// the held-back replica lacks), kill the primary and let the sentinels promote a
    /// replica (the held-back one, by its priority); the old primary comes back as a
    /// replica. `redis-cluster`: the primary of the mutex's slot, with its replica frozen
    /// every other time (live the other times), after the next acquisition or renewal (or
    /// a lease): SIGKILL, `CLUSTER FAILOVER TAKEOVER` on the replica, the old primary back
    /// as its replica.
    Failover,
    /// `zookeeper-ensemble`, `etcd-cluster`: kill the leader (SIGKILL of its container),
    /// let the other two elect a new one, start it again after a lease (its data kept).
    LeaderKill,
    /// `zookeeper-ensemble`: disconnect a follower from the other nodes' network (the one
    /// the owner is connected to, when it is a follower), reconnect it after the session
    /// timeout and a second.
    FollowerPartition,
    /// `zookeeper-ensemble`: disconnect the owner's client network from every node, for
    /// half to twice the session timeout, so that ZooKeeper keeps or expires the session.
    ContenderPartition,
    /// `etcd-cluster`: disconnect a member from the other members' network for the lease
    /// and a second, then reconnect it: every other time the owner's member (leader or
    /// follower), the other times a follower that is not the owner's.
    MemberPartition,
    /// `etcd-cluster`: restart a member (graceful stop, start on its data): every other
    /// time the owner's member, the other times the leader.
    MemberRestart,
    /// `postgres-pgbouncer*`: SIGKILL PostgreSQL (behind PgBouncer) and start it again at
    /// once (crash recovery). [`Restart`](Self::Restart) there restarts PostgreSQL too.
    ServerKill,
    /// `postgres-pgbouncer*`: SIGSTOP PostgreSQL for the lease and half a second, then
    /// SIGCONT.
    ServerPause,
    /// `postgres-pgbouncer*`: SIGKILL PgBouncer and start it again at once on its port:
    /// every client connection (and transaction) through it is gone.
    PoolerKill,
    /// `postgres-pgbouncer*`: SIGSTOP PgBouncer for the lease and half a second, then
    /// SIGCONT.
    PoolerPause,
    /// `postgres-pgbouncer*`: restart PgBouncer (graceful stop, start on its port).
    PoolerRestart,
    /// SIGSTOP a contender that waits (announced `WAIT`, holds nothing) for
    /// [`ChaosConfig::waiter_pause`], then SIGCONT; the summary says how many permits the
    /// others held meanwhile. Not among the default faults: it is a measurement (a waiter
    /// that the backend has just granted but that did not report its `BEGIN` yet is
    /// paused as a waiter, and holds its permit meanwhile).
    PauseWaiter,
}

impl FaultKind {
    /// Whether this fault can be injected on `backend`.
    fn applies_to(self, backend: ChaosBackend) -> bool {
        match self {
            FaultKind::Kill | FaultKind::Pause | FaultKind::PauseWaiter => true,
            FaultKind::Failover => matches!(
                backend,
                ChaosBackend::RedisSentinel | ChaosBackend::RedisCluster
            ),
            FaultKind::LeaderKill => backend.in_containers(),
            FaultKind::FollowerPartition | FaultKind::ContenderPartition => {
                backend == ChaosBackend::ZookeeperEnsemble
            }
            FaultKind::MemberPartition | FaultKind::MemberRestart => {
                backend == ChaosBackend::EtcdCluster
            }
            FaultKind::ServerKill
            | FaultKind::ServerPause
            | FaultKind::PoolerKill
            | FaultKind::PoolerPause
            | FaultKind::PoolerRestart => backend.pool_mode().is_some(),
            // The proxy and the private server's restart are not there on the deployments
            // in containers, whose connections go through Docker networks, nor behind
            // Sentinel, whose
            // contenders reach the deployment directly, nor on Cluster, whose clients follow
            // the nodes' own addresses past any proxy: there the nodes close the owner's
            // connections themselves (cut).
            FaultKind::Cut => !backend.in_containers() && backend != ChaosBackend::RedisSentinel,
            FaultKind::Restart | FaultKind::Delay | FaultKind::Partition => {
                !backend.in_containers()
                    && !matches!(
                        backend,
                        ChaosBackend::RedisSentinel | ChaosBackend::RedisCluster
                    )
            }
        }
    }
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
            "failover" => FaultKind::Failover,
            "leader-kill" => FaultKind::LeaderKill,
            "follower-partition" => FaultKind::FollowerPartition,
            "contender-partition" => FaultKind::ContenderPartition,
            "member-partition" => FaultKind::MemberPartition,
            "member-restart" => FaultKind::MemberRestart,
            "server-kill" => FaultKind::ServerKill,
            "server-pause" => FaultKind::ServerPause,
            "pooler-kill" => FaultKind::PoolerKill,
            "pooler-pause" => FaultKind::PoolerPause,
            "pooler-restart" => FaultKind::PoolerRestart,
            "pause-waiter" => FaultKind::PauseWaiter,
            other => {
                return Err(ChaosError::Usage(format!(
                    "unknown fault {other:?}: use kill, pause, pause-waiter, restart, cut, \
                     delay, partition, \
                     on redis-sentinel and redis-cluster failover, on zookeeper-ensemble \
                     leader-kill, follower-partition, contender-partition, on etcd-cluster \
                     leader-kill, member-partition, member-restart, or on postgres-pgbouncer \
                     server-kill, server-pause, pooler-kill, pooler-pause, pooler-restart"
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
    /// How long a contender holds, in milliseconds (a random time in this range; 5..45 by
    /// default). Longer holds keep a semaphore's permits busy, so that a paused holder
    /// that believes on is met by a full set of newer holders.
    pub hold_ms: std::ops::Range<u64>,
    /// `Some(n)`: contend for the permits of a semaphore of `n` permits instead of a mutex;
    /// the checker then allows `n` holders at once (see [`crate::history::check_permits`]).
    pub permits: Option<u32>,
    /// Whether a contender now and then exits while holding, as a crashing process would
    /// (3 % of its ownerships; on by default). Off for load measurements.
    pub crashes: bool,
    /// How long [`FaultKind::PauseWaiter`] keeps a waiter stopped (500 ms by default).
    pub waiter_pause: Duration,
    /// Contend for a read-write lock instead of a mutex: each acquisition a read or a
    /// write, and the checker is [`crate::history::check_rw`] (not with `permits`).
    pub rwlock: bool,
}

impl ChaosConfig {
    /// A config with the usual settings: 3 contenders, ttl 1 s (ZooKeeper: 1.5 s),
    /// transition 500 ms, a fault every 2 s, all the target's faults.
    pub fn new(backend: ChaosBackend, program: impl Into<PathBuf>, args: Vec<String>) -> Self {
        let faults = [
            FaultKind::Kill,
            FaultKind::Pause,
            FaultKind::Restart,
            FaultKind::Cut,
            FaultKind::Delay,
            FaultKind::Partition,
            FaultKind::Failover,
            FaultKind::LeaderKill,
            FaultKind::FollowerPartition,
            FaultKind::ContenderPartition,
            FaultKind::MemberPartition,
            FaultKind::MemberRestart,
            FaultKind::ServerKill,
            FaultKind::ServerPause,
            FaultKind::PoolerKill,
            FaultKind::PoolerPause,
            FaultKind::PoolerRestart,
        ]
        .into_iter()
        .filter(|f| f.applies_to(backend))
        .collect();
        ChaosConfig {
            backend,
            url: None,
            duration: Duration::from_secs(30),
            faults,
            contenders: 3,
            program: program.into(),
            args,
            // ZooKeeper: ttl + transition is the session timeout, at least 2 s; etcd: the
            // lease TTL, whole seconds, at least 2 s.
            ttl: Duration::from_millis(if backend.is_zookeeper() || backend.is_etcd() {
                1500
            } else {
                1000
            }),
            transition: Duration::from_millis(500),
            fault_every: Duration::from_secs(2),
            min_handoffs: 5,
            unsafe_contenders: false,
            hold_ms: 5..45,
            permits: None,
            crashes: true,
            waiter_pause: Duration::from_millis(500),
            rwlock: false,
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
    /// Faults that could not be injected (or not undone) and why, the first ten.
    pub fault_errors: Vec<String>,
    /// The semaphore's permits (`None`: a mutex run).
    pub permits: Option<u32>,
    /// The run's load, from the first ownership to the end (see [`history::load`]).
    pub load: Load,
    /// Waiter pauses ([`FaultKind::PauseWaiter`]) made, and the time during them with `k`
    /// holders, for `k` in `0..=permits` ([`history::holder_time`]).
    pub waiter_pauses: (usize, Vec<Duration>),
    /// The same, counted only while another contender than the paused one was waiting
    /// ([`history::others_queued`]): when nobody else waits, a permit left free keeps
    /// nobody from working.
    pub waiter_pauses_others_queued: Vec<Duration>,
    /// A read-write lock run.
    pub rwlock: bool,
}

impl ChaosSummary {
    /// Overlapping ownerships.
    pub fn overlaps(&self) -> usize {
        self.violations
            .iter()
            .filter(|v| matches!(v, Violation::Overlap { .. }))
            .count()
    }

    /// Instants at which more holders believed than the semaphore has permits (one per
    /// excess).
    pub fn over_capacity(&self) -> usize {
        self.violations
            .iter()
            .filter(|v| matches!(v, Violation::OverCapacity { .. }))
            .count()
    }

    /// Writers of a read-write lock that believed beside another holder (one per pair).
    pub fn rw_violations(&self) -> usize {
        self.violations
            .iter()
            .filter(|v| matches!(v, Violation::RwOverlap { .. }))
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
        for e in &self.fault_errors {
            writeln!(f, "fault error: {e}")?;
        }
        writeln!(
            f,
            "ownerships={} writes_accepted={} writes_fenced_off={} faults_by_kind={:?}",
            self.report.ownerships,
            self.report.writes_accepted,
            self.report.writes_rejected,
            self.faults_by_kind
        )?;
        writeln!(f, "{}", self.load)?;
        let (pauses, held) = &self.waiter_pauses;
        if *pauses > 0 {
            let total: Duration = held.iter().sum();
            let pct = |k: usize| {
                held.get(k).map_or(0.0, |d| {
                    100.0 * d.as_secs_f64() / total.as_secs_f64().max(f64::MIN_POSITIVE)
                })
            };
            writeln!(
                f,
                "waiter_pauses={pauses} paused_s={:.1} all_permits_held_while_paused={:.1}% \
                 none_held_while_paused={:.1}%",
                total.as_secs_f64(),
                pct(held.len().saturating_sub(1)),
                pct(0)
            )?;
            let others = &self.waiter_pauses_others_queued;
            let queued: Duration = others.iter().sum();
            let share = |d: Option<&Duration>| {
                d.map_or(0.0, |d| {
                    100.0 * d.as_secs_f64() / queued.as_secs_f64().max(f64::MIN_POSITIVE)
                })
            };
            writeln!(
                f,
                "while_paused_others_queued_s={:.1} all_permits_held={:.1}% none_held={:.1}%",
                queued.as_secs_f64(),
                share(others.last()),
                share(others.first())
            )?;
        }
        if self.rwlock {
            let reads = self.report.read_ownerships;
            return write!(
                f,
                "rw reads={reads} writes={} acquisitions={} handoffs={} stale_reads={} \
                 rw_violations={} fence_violations={} stale_writes_accepted={} faults={}",
                self.report.ownerships - reads,
                self.report.ownerships,
                self.report.handoffs,
                self.report.stale_reads,
                self.rw_violations(),
                self.violations.len() - self.rw_violations(),
                self.report.stale_writes_accepted,
                self.faults
            );
        }
        match self.permits {
            Some(permits) => write!(
                f,
                "permits={permits} acquisitions={} handoffs={} over_capacity={} \
                 fence_violations={} stale_writes_accepted={} faults={}",
                self.report.ownerships,
                self.report.handoffs,
                self.over_capacity(),
                self.violations.len() - self.over_capacity(),
                self.report.stale_writes_accepted,
                self.faults
            ),
            None => write!(
                f,
                "handoffs={} overlaps={} stale_writes_accepted={} faults={}",
                self.report.handoffs,
                self.overlaps(),
                self.report.stale_writes_accepted,
                self.faults
            ),
        }
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
    /// The Sentinel deployment of [`ChaosBackend::RedisSentinel`].
    sentinel: Option<servers::RedisSentinel>,
    /// The cluster of [`ChaosBackend::RedisCluster`] and the shard that serves the mutex.
    cluster: Option<(servers::RedisCluster, usize)>,
    /// Failovers begun, to alternate their kind.
    failovers: usize,
    resource: FencedResource,
    mutex: String,
    contenders: Vec<Contender>,
    /// The `zookeeper-ensemble` target's ensemble; contender `i` uses its client network `i`.
    #[cfg(feature = "containers")]
    ensemble: Option<crate::servers::ZkEnsemble>,
    /// The `etcd-cluster` target's cluster; contender `i` uses its client network `i` and
    /// member `i mod 3` on it.
    #[cfg(feature = "containers")]
    etcd_cluster: Option<crate::servers::EtcdCluster>,
    /// Member partitions and member restarts begun, to alternate their targets.
    #[cfg(feature = "containers")]
    member_faults: [usize; 2],
    /// The spans during which a waiter was stopped ([`FaultKind::PauseWaiter`]).
    /// (from, to, the contender paused).
    waiter_pauses: Vec<(Instant, Instant, String)>,
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
            .env(
                "SIMBA_CHAOS_PERMITS",
                cfg.permits.map(|n| n.to_string()).unwrap_or_default(),
            )
            .env("SIMBA_CHAOS_TTL_MS", cfg.ttl.as_millis().to_string())
            .env(
                "SIMBA_CHAOS_TRANSITION_MS",
                cfg.transition.as_millis().to_string(),
            )
            .env(
                "SIMBA_CHAOS_HOLD_MS",
                format!("{}..{}", cfg.hold_ms.start, cfg.hold_ms.end),
            )
            .env("SIMBA_CHAOS_CRASH", if cfg.crashes { "1" } else { "0" })
            .env("SIMBA_CHAOS_RWLOCK", if cfg.rwlock { "1" } else { "0" })
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
                // It exited by itself (a contender crashes on purpose now and then).
                self.resource.died(&self.contenders[i].name, None);
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

    /// Waits (up to 2 s: a stop is delivered in microseconds, the bound covers a loaded
    /// machine) until the kernel shows contender `i` stopped; false if it never does, or
    /// has no process.
    async fn stopped(&self, i: usize) -> bool {
        let Some(pid) = self.contenders[i].child.as_ref().and_then(Child::id) else {
            return false;
        };
        if !cfg!(target_os = "linux") {
            // No `/proc` to look at: the signal was sent, take it as delivered.
            return true;
        }
        let until = Instant::now() + Duration::from_secs(2);
        while Instant::now() < until {
            match all_threads_stopped(pid) {
                Some(true) => return true,
                Some(false) => sleep(Duration::from_millis(1)).await,
                None => return false,
            }
        }
        false
    }

    fn lease(&self) -> Duration {
        self.cfg.ttl + self.cfg.transition
    }

    /// [`FaultKind::PauseWaiter`]: stops a contender that waits for
    /// [`ChaosConfig::waiter_pause`] and records the span; false when none waits.
    async fn pause_waiter(&mut self) -> Result<bool, ChaosError> {
        let waiting: Vec<usize> = (0..self.contenders.len())
            .filter(|&i| {
                let name = &self.contenders[i].name;
                self.resource.is_waiting(name) && !self.resource.believes(name)
            })
            .collect();
        if waiting.is_empty() {
            return Ok(false);
        }
        let pick = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() as usize);
        let i = waiting[pick % waiting.len()];
        self.signal(i, "STOP").await?;
        // It may have got its ownership while the signal was on its way: a stopped holder
        // is not a stopped waiter (let go, try again at the next tick).
        if !self.stopped(i).await || !self.resource.is_waiting(&self.contenders[i].name) {
            self.signal(i, "CONT").await?;
            return Ok(false);
        }
        info!(waiter = %self.contenders[i].name, "pause a waiter");
        let from = Instant::now();
        sleep(self.cfg.waiter_pause).await;
        let name = self.contenders[i].name.clone();
        self.waiter_pauses.push((from, Instant::now(), name));
        self.signal(i, "CONT").await?;
        Ok(true)
    }

    /// Injects one fault; returns whether it applied.
    /// `server` is the backend's server (PostgreSQL behind PgBouncer), `pooler` PgBouncer.
    async fn fault(
        &mut self,
        kind: FaultKind,
        server: Option<&TestServer>,
        pooler: Option<&TestServer>,
    ) -> Result<bool, ChaosError> {
        if kind == FaultKind::PauseWaiter {
            return self.pause_waiter().await;
        }
        let Some(owner) = self.owner_index() else {
            return Ok(false);
        };
        info!(?kind, owner = %self.contenders[owner].name, "fault");
        match kind {
            FaultKind::Kill => {
                if let Some(ch) = self.contenders[owner].child.as_mut() {
                    let killed = std::time::Instant::now();
                    let _ = ch.start_kill();
                    if ch.wait().await.is_ok() {
                        // Reaped: it is dead, and believes nothing from its kill on.
                        self.resource
                            .died(&self.contenders[owner].name, Some(killed));
                    }
                }
                self.spawn(owner)?;
            }
            FaultKind::Pause => {
                self.signal(owner, "STOP").await?;
                // A holder holds for tens of milliseconds, about what spawning `kill` takes
                // on a loaded machine: the stop may land after its release. A pause of a
                // process that owns nothing tests nothing, so it is let go at once and the
                // pause comes again at the next tick.
                if !self.stopped(owner).await
                    || !self.resource.believes(&self.contenders[owner].name)
                {
                    self.signal(owner, "CONT").await?;
                    return Ok(false);
                }
                // Past the lease end and past the waiters' wake-up jitter after it (up to
                // 1 s by default): a waiter that is not pushed (its push would come from
                // the stopped owner) takes over while the owner is still stopped.
                sleep(self.lease() + Duration::from_millis(1500)).await;
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
                if let Some((cluster, _)) = &self.cluster {
                    let Some(pid) = self.contenders[owner].child.as_ref().and_then(Child::id)
                    else {
                        return Ok(false);
                    };
                    let mut closed = 0;
                    for (local, remote) in tcp_connections(pid) {
                        if cluster.kill_client(remote.port(), local).await? {
                            closed += 1;
                        }
                    }
                    info!(closed, "the nodes closed the owner's connections");
                    return Ok(closed > 0);
                }
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
            FaultKind::Failover if self.cluster.is_some() => {
                let Some((cluster, shard)) = &self.cluster else {
                    return Ok(false);
                };
                self.failovers += 1;
                let frozen = self.failovers % 2 == 1;
                if frozen {
                    cluster.freeze_replication(*shard).await?;
                }
                // Right after the next acquisition, or within a lease (with the replica
                // frozen no acquisition or renewal is confirmed meanwhile).
                let before = self.resource.report().ownerships;
                let until = Instant::now() + self.lease();
                while self.resource.report().ownerships == before && Instant::now() < until {
                    sleep(Duration::from_millis(2)).await;
                }
                let old = cluster.primary_port(*shard).await?;
                cluster
                    .kill_primary_and_fail_over(*shard, Duration::from_secs(60))
                    .await?;
                let new = cluster.primary_port(*shard).await?;
                info!(frozen, old, new, "failed over");
            }
            FaultKind::Failover => {
                let Some(d) = &self.sentinel else {
                    return Ok(false);
                };
                self.failovers += 1;
                let held = match d.preferred_replica().await? {
                    Some(r) if self.failovers % 2 == 1 => Some(r),
                    _ => None,
                };
                match held {
                    Some(r) => {
                        info!(replica = r, "hold back the preferred replica");
                        d.hold_back_replica(r).await?;
                    }
                    None => d.freeze_replication().await?,
                }
                // Right after the next acquisition (a handoff or crash takeover), or after
                // a renewal, which comes within a ttl.
                let before = self.resource.report().ownerships;
                let until = Instant::now() + self.lease();
                while self.resource.report().ownerships == before && Instant::now() < until {
                    sleep(Duration::from_millis(2)).await;
                }
                let promoted = d
                    .kill_primary_and_fail_over(Duration::from_secs(60))
                    .await?;
                info!(?held, promoted, "failed over");
            }
            FaultKind::LeaderKill
            | FaultKind::FollowerPartition
            | FaultKind::ContenderPartition
            | FaultKind::MemberPartition
            | FaultKind::MemberRestart => {
                return self.nodes_fault(kind, owner).await;
            }
            FaultKind::ServerKill
            | FaultKind::ServerPause
            | FaultKind::PoolerKill
            | FaultKind::PoolerPause
            | FaultKind::PoolerRestart => {
                let target = match kind {
                    FaultKind::ServerKill | FaultKind::ServerPause => server,
                    _ => pooler,
                };
                let Some(target) = target.filter(|s| s.is_private()) else {
                    return Ok(false);
                };
                match kind {
                    FaultKind::ServerKill | FaultKind::PoolerKill => {
                        target.kill().await?;
                        target.start().await?;
                    }
                    FaultKind::ServerPause | FaultKind::PoolerPause => {
                        target.pause().await?;
                        sleep(self.lease() + Duration::from_millis(500)).await;
                        target.resume().await?;
                    }
                    _ => target.restart().await?,
                }
            }
            // Made by `pause_waiter`, before the owner is looked for.
            FaultKind::PauseWaiter => return self.pause_waiter().await,
        }
        Ok(true)
    }

    /// The faults on the deployments in containers. Each one leaves the deployment whole
    /// again (every node serving, every network connected) before it returns.
    #[cfg(feature = "containers")]
    async fn nodes_fault(&mut self, kind: FaultKind, owner: usize) -> Result<bool, ChaosError> {
        if let Some(cluster) = &self.etcd_cluster {
            let applied = match kind {
                FaultKind::LeaderKill => nodes::leader_kill(cluster, self.lease()).await?,
                FaultKind::MemberPartition | FaultKind::MemberRestart => {
                    let partition = kind == FaultKind::MemberPartition;
                    let turn = &mut self.member_faults[usize::from(!partition)];
                    *turn += 1;
                    nodes::etcd_member_fault(
                        cluster,
                        partition,
                        owner % crate::servers::CLUSTER_SIZE,
                        *turn - 1,
                        self.lease(),
                    )
                    .await?
                }
                _ => false,
            };
            return Ok(applied);
        }
        self.ensemble_fault(kind, owner).await
    }

    #[cfg(not(feature = "containers"))]
    async fn nodes_fault(&mut self, _kind: FaultKind, _owner: usize) -> Result<bool, ChaosError> {
        Ok(false)
    }

    /// The faults on the ensemble. Each one leaves the ensemble whole again (every node
    /// serving, every network connected) before it returns, also when a step failed.
    #[cfg(feature = "containers")]
    async fn ensemble_fault(&self, kind: FaultKind, owner: usize) -> Result<bool, ChaosError> {
        let Some(ens) = &self.ensemble else {
            return Ok(false);
        };
        // The session timeout of the contenders (ttl + transition).
        let session = self.lease();
        match kind {
            FaultKind::LeaderKill => {
                // Down for a session timeout: sessions are kept or expire meanwhile.
                return Ok(nodes::leader_kill(ens, session).await?);
            }
            FaultKind::FollowerPartition => {
                let mut followers = Vec::new();
                for i in 0..crate::servers::ENSEMBLE_SIZE {
                    if ens.mode(i).await == crate::servers::NodeMode::Follower {
                        followers.push(i);
                    }
                }
                let owners_server = self.contenders[owner]
                    .child
                    .as_ref()
                    .and_then(Child::id)
                    .and_then(zookeeper_peer)
                    .and_then(|addr| ens.node_of(addr));
                let node = match owners_server {
                    Some(n) if followers.contains(&n) => n,
                    _ => match followers.first() {
                        Some(&n) => n,
                        None => return Ok(false),
                    },
                };
                info!(node = node + 1, owners_server = ?owners_server.map(|n| n + 1), "partition a follower");
                nodes::partition_for(ens, node, session + Duration::from_secs(1)).await?;
            }
            FaultKind::ContenderPartition => {
                if owner >= ens.clients() {
                    return Ok(false);
                }
                // Half to twice the session timeout: ZooKeeper keeps the session when the
                // client is back in time, and expires it otherwise.
                let ms = session.as_millis() as u64;
                let cut = Duration::from_millis(ms / 2 + roll(ms * 3 / 2));
                info!(?cut, "partition the owner from the ensemble");
                ens.cut_client(owner).await?;
                sleep(cut).await;
                ens.restore_client(owner).await?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// A number in `0..n`, different on every call.
#[cfg(feature = "containers")]
fn roll(n: u64) -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(std::time::SystemTime::now()) % n.max(1)
}

/// The ZooKeeper server (port 2181) process `pid` has an established TCP connection to.
#[cfg(feature = "containers")]
fn zookeeper_peer(pid: u32) -> Option<std::net::SocketAddr> {
    tcp_connections(pid)
        .into_iter()
        .map(|(_, remote)| remote)
        .find(|remote| remote.port() == 2181)
}

/// Whether every thread of process `pid` is stopped (state `T` or `t` in
/// `/proc/<pid>/task/*/stat`, Linux): a thread inside a system call stops only on its way
/// out of it, so a message it was sending has gone by then. `None`: no such process.
fn all_threads_stopped(pid: u32) -> Option<bool> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut any = false;
    for task in tasks.flatten() {
        // A thread that exited meanwhile has no stat any more: it runs nothing.
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        any = true;
        // "tid (comm) S ...": comm may hold spaces and parentheses, the state follows the
        // last ')'.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        if !matches!(state, Some("T" | "t")) {
            return Some(false);
        }
    }
    any.then_some(true)
}

/// The established TCP connections of process `pid`, `(local, remote)`, read from `/proc`
/// (Linux; none elsewhere): the socket inodes of its descriptors, looked up in its
/// network namespace's `net/tcp`.
fn tcp_connections(pid: u32) -> Vec<(std::net::SocketAddr, std::net::SocketAddr)> {
    let mut inodes = std::collections::HashSet::new();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    for entry in fds.flatten() {
        if let Ok(target) = std::fs::read_link(entry.path()) {
            let target = target.to_string_lossy().into_owned();
            if let Some(inode) = target
                .strip_prefix("socket:[")
                .and_then(|t| t.strip_suffix(']'))
            {
                inodes.insert(inode.to_owned());
            }
        }
    }
    let Ok(table) = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")) else {
        return Vec::new();
    };
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            let (local, remote) = (fields.get(1)?, fields.get(2)?);
            let (state, inode) = (fields.get(3)?, fields.get(9)?);
            if *state != "01" || !inodes.contains(*inode) {
                return None;
            }
            Some((parse_proc_addr(local)?, parse_proc_addr(remote)?))
        })
        .collect()
}

/// `0100007F:0885` (the address in host byte order, little-endian here) to `127.0.0.1:2181`.
fn parse_proc_addr(text: &str) -> Option<std::net::SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let ip = u32::from_str_radix(ip, 16).ok()?;
    let port = u16::from_str_radix(port, 16).ok()?;
    Some(std::net::SocketAddr::from((
        std::net::Ipv4Addr::from(ip.to_ne_bytes()),
        port,
    )))
}

fn backend_url(backend: ChaosBackend, server_url: &str) -> String {
    match backend {
        ChaosBackend::Zookeeper | ChaosBackend::ZookeeperEnsemble => format!("zk://{server_url}"),
        // mysql_async switches a local server to its Unix socket, past the proxy.
        ChaosBackend::Mysql if !server_url.contains('?') => {
            format!("{server_url}?prefer_socket=false")
        }
        _ => server_url.to_owned(),
    }
}

/// The contenders' URL of a PostgreSQL behind PgBouncer, through the proxy at `proxy`, with
/// `simba_pooler=` its mode (and no other option).
fn pooler_url(pooler: &Pooler, proxy: std::net::SocketAddr) -> String {
    let url = pooler.url_via(proxy);
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}simba_pooler={}", pooler.mode().as_str())
}

/// Starts PgBouncer again if it exited on its own, and says so in `errors` (the summary's
/// fault errors) with the end of its log. Debian bookworm's PgBouncer 1.18 does exit now and
/// then under these faults, with `FATAL … disconnect_client(): bad client state: 0` when a
/// client goes away while its cancel request is being forwarded (pgbouncer#801, fixed in
/// later releases): a crash of the pooler, not of the contenders, so the run goes on.
async fn revive_pooler(pooler: &TestServer, errors: &mut Vec<String>) {
    let problem = match pooler.is_running().await {
        Ok(true) => return,
        Ok(false) => {
            let tail = pooler.log_tail(3);
            warn!("PgBouncer exited on its own; starting it again. Its log ends:\n{tail}");
            match pooler.start().await {
                Ok(()) => {
                    format!("PgBouncer exited on its own (started again); its log ends: {tail}")
                }
                Err(e) => format!("PgBouncer exited on its own and did not start again: {e}"),
            }
        }
        Err(e) => format!("PgBouncer: {e}"),
    };
    if errors.len() < 10 {
        errors.push(problem);
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
    if let Some(f) = cfg.faults.iter().find(|f| !f.applies_to(cfg.backend)) {
        return Err(ChaosError::Usage(format!(
            "the fault {f:?} does not apply to {:?}",
            cfg.backend
        )));
    }
    if cfg.permits == Some(0) {
        return Err(ChaosError::Usage(
            "a semaphore needs at least 1 permit".into(),
        ));
    }
    if cfg.permits.is_some() && cfg.rwlock {
        return Err(ChaosError::Usage(
            "a run is of a semaphore or of a read-write lock, not both".into(),
        ));
    }
    if cfg.rwlock && cfg.backend == ChaosBackend::RedisCluster {
        // A read-write lock's readers are a semaphore's permits.
        return Err(ChaosError::Usage(
            "read-write lock runs are not made on redis-cluster yet: its failover targets \
             the mutex's shard"
                .into(),
        ));
    }
    if cfg.permits.is_some() && cfg.backend == ChaosBackend::RedisCluster {
        // Its failover targets the shard of the mutex's key, not of the semaphore's.
        return Err(ChaosError::Usage(
            "semaphore runs are not made on redis-cluster yet: its failover targets the \
             mutex's shard"
                .into(),
        ));
    }
    if cfg.backend.in_containers() && cfg.url.is_some() {
        return Err(ChaosError::Usage(format!(
            "{:?} starts its own servers in containers: leave out --url",
            cfg.backend
        )));
    }
    #[cfg(feature = "containers")]
    let ensemble = if cfg.backend == ChaosBackend::ZookeeperEnsemble {
        let t = Instant::now();
        let ensemble = crate::servers::ZkEnsemble::start(cfg.contenders).await?;
        info!(after = ?t.elapsed(), "ensemble serving");
        Some(ensemble)
    } else {
        None
    };
    #[cfg(feature = "containers")]
    let etcd_cluster = if cfg.backend == ChaosBackend::EtcdCluster {
        let t = Instant::now();
        let cluster = crate::servers::EtcdCluster::start(cfg.contenders).await?;
        info!(after = ?t.elapsed(), url = %cluster.url(), "etcd cluster serving");
        Some(cluster)
    } else {
        None
    };
    #[cfg(not(feature = "containers"))]
    if cfg.backend.in_containers() {
        return Err(ChaosError::Usage(format!(
            "{:?} needs simba-test-kit's feature `containers` (simba-chaos: \
             `--features containers`) and a Docker engine",
            cfg.backend
        )));
    }
    let dir = tempfile::tempdir().map_err(io("temp dir"))?;
    let mutex = format!("chaos-{}", std::process::id());
    let sentinel = match (cfg.backend, &cfg.url) {
        // Node 0 starts as the primary (priority 100); the replicas have 1 and 50, so
        // whichever node is the primary, its replicas differ in priority.
        (ChaosBackend::RedisSentinel, None) => {
            Some(servers::redis_sentinel_with_replicas(&[1, 50]).await?)
        }
        _ => None,
    };
    let cluster = match (cfg.backend, &cfg.url) {
        (ChaosBackend::RedisCluster, Some(_)) => {
            return Err(ChaosError::Usage(
                "redis-cluster starts its own cluster (its faults need it): leave out --url".into(),
            ));
        }
        (ChaosBackend::RedisCluster, None) => {
            let cluster = servers::redis_cluster_with_replicas(3).await?;
            let shard = cluster.shard_of_key(&mutex).await?;
            info!(shard, url = %cluster.cluster_url(), "cluster ok");
            Some((cluster, shard))
        }
        _ => None,
    };
    // One replica per primary: 1 is every replica.
    let cluster_url = cluster
        .as_ref()
        .map(|(c, _)| format!("{}&replicaAcks=1", c.cluster_url()));
    let pooler = match (cfg.backend.pool_mode(), &cfg.url) {
        (Some(_), Some(_)) => {
            return Err(ChaosError::Usage(format!(
                "{:?} starts its own PostgreSQL and PgBouncer (its faults need them): leave \
                 out --url",
                cfg.backend
            )));
        }
        (Some(mode), None) => {
            let pooler = servers::pgbouncer_private(mode).await?;
            info!(url = %pooler.url(), direct = %pooler.direct_url(), "PgBouncer serving");
            Some(pooler)
        }
        (None, _) => None,
    };
    let server = match (cfg.backend.server_kind(), &cfg.url) {
        (None, _) => None,
        (Some(kind), Some(url)) => Some(TestServer::external(kind, url)?),
        (Some(kind), None) => Some(servers::private(kind).await?),
    };
    let resource = if cfg.rwlock {
        FencedResource::start_rw().await
    } else {
        FencedResource::start_with_permits(cfg.permits.map_or(1, |n| n as usize)).await
    }
    .map_err(io("start the fenced resource"))?;
    let mut contenders = Vec::new();
    for i in 0..cfg.contenders {
        // In containers: client network `i` (etcd: member `i mod 3` on it).
        #[cfg(feature = "containers")]
        let in_containers = match (&ensemble, &etcd_cluster) {
            (Some(ens), _) => Some(backend_url(cfg.backend, &ens.connect_string(i))),
            (_, Some(cl)) => Some(format!(
                "etcd://{}",
                cl.client_endpoint(i, i % crate::servers::CLUSTER_SIZE)
            )),
            _ => None,
        };
        #[cfg(not(feature = "containers"))]
        let in_containers: Option<String> = None;
        if let Some(p) = &pooler {
            let proxy = FaultProxy::start(p.pooler().socket_addr()?)
                .await
                .map_err(io("start a proxy"))?;
            contenders.push(Contender {
                name: format!("c{i}"),
                url: pooler_url(p, proxy.addr()),
                proxy: Some(proxy),
                child: None,
                log: dir.path().join(format!("c{i}.log")),
            });
            continue;
        }
        if let Some(url) = in_containers {
            contenders.push(Contender {
                name: format!("c{i}"),
                url,
                proxy: None,
                child: None,
                log: dir.path().join(format!("c{i}.log")),
            });
            continue;
        }
        let (url, proxy) = match (&server, &sentinel, &cfg.url, &cluster_url) {
            (_, _, _, Some(url)) => (url.clone(), None),
            (_, Some(d), _, _) => (d.url(), None),
            (None, None, Some(url), _) => (url.clone(), None),
            (Some(s), _, _, _) => {
                let upstream = s.socket_addr()?;
                let proxy = FaultProxy::start(upstream)
                    .await
                    .map_err(io("start a proxy"))?;
                (
                    backend_url(cfg.backend, &s.url_via(proxy.addr())),
                    Some(proxy),
                )
            }
            (None, None, None, None) => (
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
        sentinel,
        cluster,
        failovers: 0,
        resource,
        mutex,
        contenders,
        #[cfg(feature = "containers")]
        ensemble,
        #[cfg(feature = "containers")]
        etcd_cluster,
        #[cfg(feature = "containers")]
        member_faults: [0; 2],
        waiter_pauses: Vec::new(),
    };
    for i in 0..cfg.contenders {
        run.spawn(i)?;
    }
    let t0 = Instant::now();
    let mut injected: Vec<(FaultKind, usize)> = Vec::new();
    let mut next_fault = t0 + cfg.fault_every;
    let mut fault_errors = Vec::new();
    let mut misses = 0u32;
    // The faults that can ever apply here: SQLite has no server and no connection, and a
    // server given by URL is not restarted.
    let faults: Vec<FaultKind> = cfg
        .faults
        .iter()
        .copied()
        .filter(|f| match f {
            FaultKind::Kill | FaultKind::Pause | FaultKind::PauseWaiter => true,
            FaultKind::Restart => cfg.url.is_none() && cfg.backend != ChaosBackend::Sqlite,
            _ => cfg.backend != ChaosBackend::Sqlite,
        })
        .collect();
    // The kinds in the order they come: one that applied goes to the back; one that could
    // not apply within the miss window (no owner for that long, say) comes back right
    // after the next kind, so a short run still gets every kind in.
    let mut queue: std::collections::VecDeque<FaultKind> = faults.iter().copied().collect();
    // How many 50 ms ticks a kind waits for a moment it applies to: two leases (an owner
    // is back within a lease after most faults) and at least 2 s.
    let miss_window = ((run.lease() * 2).as_millis() / 50).max(40) as u32;
    while t0.elapsed() < cfg.duration {
        sleep(Duration::from_millis(50)).await;
        run.respawn_dead()?;
        if let Some(p) = &pooler {
            revive_pooler(p.pooler(), &mut fault_errors).await;
        }
        if Instant::now() >= next_fault {
            let Some(kind) = queue.pop_front() else {
                continue;
            };
            let (fault_server, fault_pooler) = match &pooler {
                Some(p) => (Some(p.postgres()), Some(p.pooler())),
                None => (server.as_ref(), None),
            };
            match run.fault(kind, fault_server, fault_pooler).await {
                Ok(true) => {
                    match injected.iter_mut().find(|(k, _)| *k == kind) {
                        Some((_, n)) => *n += 1,
                        None => injected.push((kind, 1)),
                    }
                    queue.push_back(kind);
                }
                // Not now: the same kind at the next tick, within the miss window.
                Ok(false) if misses < miss_window => {
                    misses += 1;
                    queue.push_front(kind);
                    continue;
                }
                Ok(false) => {
                    let at = queue.len().min(1);
                    queue.insert(at, kind);
                }
                Err(e) => {
                    warn!(?kind, "fault failed: {e}");
                    if fault_errors.len() < 10 {
                        fault_errors.push(format!("{kind:?}: {e}"));
                    }
                    queue.push_back(kind);
                }
            }
            misses = 0;
            next_fault = Instant::now() + cfg.fault_every;
        }
    }
    let ended = Instant::now();
    for c in &mut run.contenders {
        if let Some(ch) = c.child.as_mut() {
            // One that exited by itself since the last look is dead since its last message.
            if matches!(ch.try_wait(), Ok(Some(_))) {
                run.resource.died(&c.name, None);
            }
            let killed = std::time::Instant::now();
            let _ = ch.start_kill();
            if ch.wait().await.is_ok() {
                run.resource.died(&c.name, Some(killed));
            }
        }
    }
    let violations = run.resource.violations();
    let report = run.resource.report();
    // A read-write lock: as many holders at once as there are contenders.
    let permits = if cfg.rwlock {
        cfg.contenders
    } else {
        cfg.permits.map_or(1, |n| n as usize)
    };
    let intervals = run.resource.intervals();
    // From the first ownership: the contenders' start (connecting) is not load.
    let load_from = intervals
        .iter()
        .map(|i| i.start)
        .min()
        .unwrap_or_else(|| ended.into_std());
    let waits = run.resource.waits();
    let load = history::load(&intervals, &waits, permits, load_from, ended.into_std());
    let spans: Vec<(std::time::Instant, std::time::Instant)> = run
        .waiter_pauses
        .iter()
        .map(|(a, b, _)| (a.into_std(), b.into_std()))
        .collect();
    let waiter_pauses = (
        spans.len(),
        history::holder_time(&intervals, permits, &spans, ended.into_std()),
    );
    let others_queued: Vec<(std::time::Instant, std::time::Instant)> = run
        .waiter_pauses
        .iter()
        .flat_map(|(a, b, who)| {
            let span = (a.into_std(), b.into_std());
            history::others_queued(&waits, who, span, ended.into_std())
        })
        .collect();
    let waiter_pauses_others_queued =
        history::holder_time(&intervals, permits, &others_queued, ended.into_std());
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
        fault_errors,
        permits: cfg.permits,
        load,
        waiter_pauses,
        waiter_pauses_others_queued,
        rwlock: cfg.rwlock,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_and_apply_to_their_targets() {
        assert_eq!(
            "leader-kill".parse::<FaultKind>().ok(),
            Some(FaultKind::LeaderKill)
        );
        assert_eq!(
            "contender-partition".parse::<FaultKind>().ok(),
            Some(FaultKind::ContenderPartition)
        );
        assert_eq!(
            "zookeeper-ensemble".parse::<ChaosBackend>().ok(),
            Some(ChaosBackend::ZookeeperEnsemble)
        );
        assert!(FaultKind::FollowerPartition.applies_to(ChaosBackend::ZookeeperEnsemble));
        assert!(!FaultKind::FollowerPartition.applies_to(ChaosBackend::Zookeeper));
        assert!(!FaultKind::Cut.applies_to(ChaosBackend::ZookeeperEnsemble));
        assert!(FaultKind::Pause.applies_to(ChaosBackend::ZookeeperEnsemble));
        assert_eq!(
            "redis-cluster".parse::<ChaosBackend>().ok(),
            Some(ChaosBackend::RedisCluster)
        );
        assert!(FaultKind::Failover.applies_to(ChaosBackend::RedisCluster));
        assert!(FaultKind::Cut.applies_to(ChaosBackend::RedisCluster));
        assert!(!FaultKind::Delay.applies_to(ChaosBackend::RedisCluster));
        assert!(!FaultKind::Failover.applies_to(ChaosBackend::Redis));
        let cfg = ChaosConfig::new(ChaosBackend::ZookeeperEnsemble, "x", Vec::new());
        assert!(cfg.faults.iter().all(|f| f.applies_to(cfg.backend)));
        assert_eq!(cfg.ttl + cfg.transition, Duration::from_secs(2));
        assert_eq!(
            "etcd-cluster".parse::<ChaosBackend>().ok(),
            Some(ChaosBackend::EtcdCluster)
        );
        let cfg = ChaosConfig::new(ChaosBackend::EtcdCluster, "x", Vec::new());
        assert_eq!(
            cfg.faults,
            [
                FaultKind::Kill,
                FaultKind::Pause,
                FaultKind::LeaderKill,
                FaultKind::MemberPartition,
                FaultKind::MemberRestart
            ]
        );
        assert_eq!(cfg.ttl + cfg.transition, Duration::from_secs(2));
        assert!(!FaultKind::MemberRestart.applies_to(ChaosBackend::ZookeeperEnsemble));
        assert!(!FaultKind::FollowerPartition.applies_to(ChaosBackend::EtcdCluster));
    }

    #[test]
    fn pgbouncer_targets_fault_postgres_and_the_pooler() {
        assert_eq!(
            "postgres-pgbouncer".parse::<ChaosBackend>().ok(),
            Some(ChaosBackend::PostgresPgbouncer)
        );
        assert_eq!(
            "pooler-restart".parse::<FaultKind>().ok(),
            Some(FaultKind::PoolerRestart)
        );
        let cfg = ChaosConfig::new(ChaosBackend::PostgresPgbouncer, "x", Vec::new());
        assert_eq!(
            cfg.faults,
            [
                FaultKind::Kill,
                FaultKind::Pause,
                FaultKind::Restart,
                FaultKind::Cut,
                FaultKind::Delay,
                FaultKind::Partition,
                FaultKind::ServerKill,
                FaultKind::ServerPause,
                FaultKind::PoolerKill,
                FaultKind::PoolerPause,
                FaultKind::PoolerRestart,
            ]
        );
        assert_eq!(
            ChaosBackend::PostgresPgbouncerSession.pool_mode(),
            Some(PoolMode::Session)
        );
        assert!(!FaultKind::PoolerKill.applies_to(ChaosBackend::Postgres));
        assert!(!FaultKind::ServerPause.applies_to(ChaosBackend::Redis));
    }

    /// `/proc/net/tcp` prints an address as the hex of its network-order bytes read as a
    /// native integer.
    #[cfg(target_endian = "little")]
    #[test]
    fn proc_addresses() {
        assert_eq!(
            parse_proc_addr("0100007F:0885"),
            Some(([127, 0, 0, 1], 2181).into())
        );
        assert_eq!(
            parse_proc_addr("0B0012AC:1F90"),
            Some(([172, 18, 0, 11], 8080).into())
        );
        assert_eq!(parse_proc_addr("zz:1"), None);
    }
}
