//! `simba-chaos contender`: one contender process of a chaos run.
//!
//! It loops: acquire, report the ownership to the fenced resource, write under its fence
//! for a few milliseconds (checking before every write that it still owns), then release
//! — or, now and then, exit without releasing, as a crashing process would (not with
//! `SIMBA_CHAOS_CRASH=0`). It tells the resource when it starts waiting (`WAIT`). Its orders
//! come from the `SIMBA_BACKEND` and `SIMBA_CHAOS_*` variables that the run sets (see
//! `simba_test_kit::chaos`). With `SIMBA_CHAOS_PERMITS` set it holds one permit of a
//! semaphore of that many permits instead, in the same loop. With `SIMBA_CHAOS_RWLOCK=1`
//! it takes the read-write lock of the mutex's name, three times in four to read (it then
//! reads the resource instead of writing to it) and otherwise to write; unsafe
//! (`SIMBA_CHAOS_UNSAFE=1`), its writers take the lock's gate only and do not wait for the
//! readers to leave.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use simba_core::connect::{ConnectOptions, Connection, Connectors};
use simba_core::{
    LeaseConfig, LockGuard, Locker, LossReason, PermitGuard, ReadGuard, RwLock, Semaphore,
    WriteGuard,
};
use simba_test_kit::chaos::ResourceClient;

fn var(name: &str) -> Result<String> {
    std::env::var(name)
        .with_context(|| format!("{name} is not set (the contender is started by simba-chaos)"))
}

fn ms_var(name: &str) -> Result<Duration> {
    var(name)?
        .parse::<u64>()
        .map(Duration::from_millis)
        .with_context(|| format!("{name} must be a number of milliseconds"))
}

/// The lease ordered by the run.
fn lease() -> Result<LeaseConfig> {
    Ok(LeaseConfig {
        // Waiters on backends without push look again every 50 ms, so that handoffs
        // happen often enough to test.
        waiter_poll: Some(Duration::from_millis(50)),
        ..LeaseConfig::with_lease(
            ms_var("SIMBA_CHAOS_TTL_MS")?,
            ms_var("SIMBA_CHAOS_TRANSITION_MS")?,
        )
    })
}

/// The backends a contender can run against: every URL form of the backend crates
/// (`redis`, `rediss`, Cluster and Sentinel; `postgres`, `mysql`, `mariadb`, `sqlite`;
/// `zk` with credentials and a chroot; `etcd`).
fn connectors() -> Connectors {
    Connectors::new(vec![
        &simba_redis::CONNECTOR,
        &simba_jdbc::CONNECTOR,
        &simba_zookeeper::CONNECTOR,
        &simba_etcd::CONNECTOR,
    ])
}

/// Connects to the backend of `url` with the run's lease (on ZooKeeper, whose ownership
/// lasts as long as a session, the session timeout is `ttl + transition`).
async fn connect(url: &str, lease: LeaseConfig) -> Result<Box<dyn Connection>> {
    let connectors = connectors();
    connectors
        .connect(url, &ConnectOptions::new().with_lease(lease))
        .await
        .with_context(|| format!("connecting to {}", connectors.redact(url)))
}

fn roll(n: u64) -> u64 {
    RandomState::new().hash_one(std::time::SystemTime::now()) % n.max(1)
}

/// A small generator of the read-or-write choices (xorshift64*), seeded per contender
/// process.
struct Choices(u64);

impl Choices {
    fn seeded(id: &str) -> Choices {
        let seed = RandomState::new().hash_one((id, std::process::id()));
        // Xorshift must not start at 0.
        Choices(seed | 1)
    }

    /// True `num` times in `den`, at random.
    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % den.max(1) < num
    }
}

/// A mutex ownership, a semaphore permit, or a read-write lock's read or write: the loop
/// does the same with each, but that a reader reads the resource instead of writing.
enum Guard {
    Lock(LockGuard),
    Permit(PermitGuard),
    Read(ReadGuard),
    Write(WriteGuard),
}

impl Guard {
    fn fence(&self) -> u64 {
        match self {
            Guard::Lock(g) => g.fence(),
            Guard::Permit(g) => g.fence(),
            Guard::Read(g) => g.fence(),
            Guard::Write(g) => g.fence(),
        }
    }

    fn is_held(&self) -> bool {
        match self {
            Guard::Lock(g) => g.is_held(),
            Guard::Permit(g) => g.is_held(),
            Guard::Read(g) => g.is_held(),
            Guard::Write(g) => g.is_held(),
        }
    }

    fn valid_for(&self) -> Option<Duration> {
        match self {
            Guard::Lock(g) => g.valid_for(),
            Guard::Permit(g) => g.valid_for(),
            Guard::Read(g) => g.valid_for(),
            Guard::Write(g) => g.valid_for(),
        }
    }

    async fn lost(&self) -> LossReason {
        match self {
            Guard::Lock(g) => g.lost().await,
            Guard::Permit(g) => g.lost().await,
            Guard::Read(g) => g.lost().await,
            Guard::Write(g) => g.lost().await,
        }
    }

    async fn release(self) -> simba_core::Result<()> {
        match self {
            Guard::Lock(g) => g.release().await,
            Guard::Permit(g) => g.release().await,
            Guard::Read(g) => g.release().await,
            Guard::Write(g) => g.release().await,
        }
    }

    fn is_reader(&self) -> bool {
        matches!(self, Guard::Read(_))
    }
}

/// What the holder may still count on; an unsafe contender claims an hour.
fn valid(guard: &Guard, lease: Duration, unsafe_mode: bool) -> Duration {
    if unsafe_mode {
        Duration::from_secs(3600)
    } else {
        guard.valid_for().unwrap_or(lease)
    }
}

/// Runs the contender loop until killed.
pub(crate) async fn run() -> Result<()> {
    let addr: SocketAddr = var("SIMBA_CHAOS_RESOURCE")?
        .parse()
        .context("SIMBA_CHAOS_RESOURCE must be host:port")?;
    let id = var("SIMBA_CHAOS_ID")?;
    let mutex = var("SIMBA_CHAOS_MUTEX")?;
    let unsafe_mode = var("SIMBA_CHAOS_UNSAFE").is_ok_and(|v| v == "1");
    // Crashes are on unless the run turned them off (a load measurement).
    let crashes = std::env::var("SIMBA_CHAOS_CRASH").map_or(true, |v| v != "0");
    let (hold_from, hold_span) = match std::env::var("SIMBA_CHAOS_HOLD_MS") {
        Ok(range) if !range.is_empty() => {
            let parsed = range.split_once("..").and_then(|(a, b)| {
                Some((a.trim().parse::<u64>().ok()?, b.trim().parse::<u64>().ok()?))
            });
            match parsed {
                Some((a, b)) if a < b => (a, b - a),
                _ => bail!(
                    "SIMBA_CHAOS_HOLD_MS must be FROM..TO in milliseconds, FROM < TO: {range:?}"
                ),
            }
        }
        _ => (5, 40),
    };
    let lease_config = lease()?;
    let lease = lease_config.ttl + lease_config.transition;
    let url = var("SIMBA_BACKEND")?;
    let permits = match std::env::var("SIMBA_CHAOS_PERMITS") {
        Ok(n) if !n.is_empty() => Some(
            n.parse::<u32>()
                .context("SIMBA_CHAOS_PERMITS must be a number")?,
        ),
        _ => None,
    };
    let rwlock = var("SIMBA_CHAOS_RWLOCK").is_ok_and(|v| v == "1");
    if rwlock && permits.is_some() {
        bail!("SIMBA_CHAOS_RWLOCK and SIMBA_CHAOS_PERMITS exclude each other");
    }
    let mut choices = Choices::seeded(&id);
    let mut resource = ResourceClient::connect(addr, &id)
        .await
        .context("the fenced resource")?;
    enum Source {
        Locker(Locker),
        Semaphore(Semaphore),
        /// The lock, and its gate alone for the unsafe writers.
        RwLock(RwLock, Option<Locker>),
    }
    // A semaphore on the connection's backend: Redis and the SQL backends time its
    // permits by the run's lease; ZooKeeper holds them on the connection's session
    // (timeout `ttl + transition`) with the longest lease it allows; etcd times them by
    // its lease TTL (`EtcdFactory::permit_lease`).
    let source = match permits {
        None if rwlock => {
            let conn = connect(&url, lease_config).await?;
            let lock = conn
                .open_rwlock(&mutex)
                .await
                .with_context(|| format!("the read-write lock on {}", connectors().redact(&url)))?;
            // The gate is the mutex of the lock's name on the same connection.
            let gate = if unsafe_mode {
                Some(Locker::new(conn.factory(), &mutex)?)
            } else {
                None
            };
            Source::RwLock(lock, gate)
        }
        Some(n) => Source::Semaphore(
            connect(&url, lease_config)
                .await?
                .open_semaphore(&mutex, n)
                .await
                .with_context(|| format!("the semaphore on {}", connectors().redact(&url)))?,
        ),
        None => Source::Locker(Locker::new(
            connect(&url, lease_config).await?.factory(),
            &mutex,
        )?),
    };
    loop {
        resource.wait().await.context("the fenced resource")?;
        let guard = match &source {
            Source::Locker(l) => Guard::Lock(l.acquire().await.context("acquire")?),
            Source::Semaphore(s) => Guard::Permit(s.acquire().await.context("acquire a permit")?),
            Source::RwLock(l, _) if choices.chance(3, 4) => {
                Guard::Read(l.read().await.context("acquire to read")?)
            }
            Source::RwLock(l, None) => Guard::Write(l.write().await.context("acquire to write")?),
            // Unsafe: a writer that holds the gate but never waited for the readers.
            Source::RwLock(_, Some(gate)) => {
                Guard::Lock(gate.acquire().await.context("acquire the gate")?)
            }
        };
        let fence = guard.fence();
        let reader = guard.is_reader();
        if reader {
            resource
                .begin_read(fence, valid(&guard, lease, unsafe_mode))
                .await
                .context("the fenced resource")?;
        } else {
            resource
                .begin(fence, valid(&guard, lease, unsafe_mode))
                .await
                .context("the fenced resource")?;
        }
        let until =
            tokio::time::Instant::now() + Duration::from_millis(hold_from + roll(hold_span));
        let mut lost: Option<LossReason> = None;
        while tokio::time::Instant::now() < until {
            // The check right before the write is what keeps a woken, paused process
            // from writing after its lease: `is_held` looks at the local deadline itself.
            if !unsafe_mode && !guard.is_held() {
                lost = Some(guard.lost().await);
                break;
            }
            let valid_for = valid(&guard, lease, unsafe_mode);
            if reader {
                let accepted = resource
                    .read(fence, valid_for)
                    .await
                    .context("the fenced resource")?;
                if !accepted {
                    tracing::warn!(
                        fence,
                        "read refused by the resource: a newer write is there"
                    );
                }
            } else {
                let accepted = resource
                    .write(fence, valid_for)
                    .await
                    .context("the fenced resource")?;
                if !accepted {
                    tracing::warn!(fence, "write fenced off by the resource");
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        match lost {
            Some(reason) => {
                resource
                    .end(fence, reason)
                    .await
                    .context("the fenced resource")?;
                drop(guard);
            }
            None if crashes && roll(100) < 3 => {
                // Crash while owning: no release, no END.
                std::process::exit(3);
            }
            None => {
                // Stop believing before the mutex is free for others.
                resource
                    .end(fence, LossReason::Released)
                    .await
                    .context("the fenced resource")?;
                let _ = guard.release().await;
            }
        }
        tokio::time::sleep(Duration::from_millis(roll(20))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::connectors;

    /// The TLS, Cluster, MariaDB and ZooKeeper-with-credentials forms are among them: a
    /// contender connects whatever URL the run was given.
    #[test]
    fn every_backend_url_form_reaches_its_connector() {
        let connectors = connectors();
        for url in [
            "redis://127.0.0.1:6379/0",
            "rediss://127.0.0.1:6380",
            "redis-cluster://127.0.0.1:7000?node=127.0.0.1:7001",
            "redis-sentinel://127.0.0.1:26379?sentinelServiceName=simba",
            "mariadb://app:secret@127.0.0.1:3306/simba",
            "mysql://app:secret@127.0.0.1:3306/simba",
            "postgres://app:secret@127.0.0.1:5432/simba",
            "sqlite:///tmp/simba-chaos.db",
            "zk://app:secret@127.0.0.1:2181/chaos",
        ] {
            if let Err(e) = connectors.validate(url) {
                panic!("{url}: {e}");
            }
        }
    }
}
