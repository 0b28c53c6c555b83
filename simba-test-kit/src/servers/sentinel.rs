//! A private Redis Sentinel deployment on loopback: a primary, a replica and three
//! sentinels, with the faults a failover test needs (freeze the replication, kill the
//! primary and let the sentinels promote the replica).

use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::probe::{Resp, redis_command};
use super::process::{LocalServer, free_port};
use super::{ServerError, ServerKind, TestServer};

const KIND: ServerKind = ServerKind::Redis;

/// The service (master) name the sentinels monitor.
pub const SENTINEL_SERVICE: &str = "simba";

/// How long the sentinels wait before they call an unresponsive primary down (ms).
const DOWN_AFTER_MS: u64 = 1000;
/// Sentinel's `failover-timeout` (ms). Sentinels start no second failover of the same
/// primary within twice this after the last one.
const FAILOVER_TIMEOUT_MS: u64 = 2000;

/// One `redis-server --sentinel` process, killed (by process id) when dropped.
struct SentinelProcess {
    child: Child,
    /// The plain port, for the kit's own commands (for a TLS deployment, bound beside
    /// [`tls_port`](Self::tls_port) and used by nobody else).
    port: u16,
    /// The TLS port clients use, for a TLS deployment.
    tls_port: Option<u16>,
    dir: TempDir,
}

impl SentinelProcess {
    /// The port clients use.
    fn client_port(&self) -> u16 {
        self.tls_port.unwrap_or(self.port)
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A primary, a replica and three sentinels (quorum 2) on loopback, all private processes.
///
/// Which node is the primary changes with each failover: ask [`primary`](Self::primary).
/// Everything is killed when this is dropped.
pub struct RedisSentinel {
    nodes: Vec<TestServer>,
    /// The port the kit sends its own commands to, per node: the node's port, or for a TLS
    /// deployment its plain admin port.
    admin_ports: Vec<u16>,
    sentinels: Vec<SentinelProcess>,
    tls: bool,
}

impl fmt::Debug for RedisSentinel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSentinel")
            .field(
                "nodes",
                &self.nodes.iter().map(TestServer::url).collect::<Vec<_>>(),
            )
            .field(
                "sentinels",
                &self
                    .sentinels
                    .iter()
                    .map(SentinelProcess::client_port)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

fn start_error(message: impl Into<String>) -> ServerError {
    ServerError::Start {
        kind: KIND,
        message: message.into(),
        log_tail: String::new(),
    }
}

async fn command(addr: SocketAddr, args: &[&str]) -> Result<Resp, ServerError> {
    let raw: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    let shown = args.iter().take(3).copied().collect::<Vec<_>>().join(" ");
    match redis_command(addr, &raw).await {
        Ok(Resp::Error(e)) => Err(start_error(format!("{shown} on {addr} failed: {e}"))),
        Ok(reply) => Ok(reply),
        Err(e) => Err(start_error(format!("{shown} on {addr} failed: {e}"))),
    }
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Starts a primary, a replica of it and three sentinels, and waits until every sentinel
/// knows the primary, the replica and the other sentinels.
///
/// This always uses local `redis-server` binaries; [`REDIS_URL_ENV`](super::REDIS_URL_ENV)
/// is ignored.
pub async fn redis_sentinel() -> Result<RedisSentinel, ServerError> {
    start_deployment(None).await
}

/// As [`redis_sentinel`], with TLS everywhere: the primary, the replica and the sentinels
/// speak TLS to clients on their ports (`tls`'s certificates; client certificates required
/// if `tls.require_client_cert`), the replica replicates over TLS and the sentinels talk to
/// the nodes and to each other over TLS (`tls-replication yes`, so they also announce
/// their TLS ports). [`url`](RedisSentinel::url) is then a `rediss-sentinel://` URL naming
/// the sentinels' TLS ports, and the sentinels name the nodes' TLS ports.
///
/// Each process also listens for plain RESP on a second port bound to 127.0.0.1, which
/// only the kit uses (set-up, health probes, fault injection: the kit has no TLS client).
pub async fn redis_sentinel_tls(tls: super::tls::RedisTls) -> Result<RedisSentinel, ServerError> {
    start_deployment(Some(tls)).await
}

async fn start_deployment(tls: Option<super::tls::RedisTls>) -> Result<RedisSentinel, ServerError> {
    let redis = super::redis::Redis::detect().map_err(|e| e.with_advice(true))?;
    let node = || -> Result<super::redis::Redis, ServerError> {
        let Some(tls) = &tls else {
            return Ok(redis.clone());
        };
        let admin =
            free_port().map_err(|e| ServerError::io(KIND, "finding a free admin port", e))?;
        Ok(redis.clone().with_tls(tls.clone()).with_admin_port(admin))
    };
    let (a, b) = (node()?, node()?);
    let admin_of = |r: &super::redis::Redis| r.admin_port();
    let (admin_a, admin_b) = (admin_of(&a), admin_of(&b));
    let flavor = super::process::Flavor::Redis;
    let (primary, replica) = tokio::try_join!(
        LocalServer::create(flavor(a)),
        LocalServer::create(flavor(b))
    )?;
    let nodes = vec![
        TestServer::from_local(primary),
        TestServer::from_local(replica),
    ];
    let admin_ports = vec![
        admin_a.unwrap_or_else(|| nodes[0].port()),
        admin_b.unwrap_or_else(|| nodes[1].port()),
    ];
    let primary_port = nodes[0].port().to_string();
    command(
        loopback(admin_ports[1]),
        &["REPLICAOF", "127.0.0.1", &primary_port],
    )
    .await?;
    let mut sentinels = Vec::new();
    for _ in 0..3 {
        sentinels.push(start_sentinel(&redis, nodes[0].port(), tls.as_ref())?);
    }
    let deployment = RedisSentinel {
        nodes,
        admin_ports,
        sentinels,
        tls: tls.is_some(),
    };
    deployment.wait_healthy(Duration::from_secs(30)).await?;
    Ok(deployment)
}

fn start_sentinel(
    redis: &super::redis::Redis,
    primary_port: u16,
    tls: Option<&super::tls::RedisTls>,
) -> Result<SentinelProcess, ServerError> {
    let dir = tempfile::Builder::new()
        .prefix("simba-sentinel-")
        .tempdir()
        .map_err(|e| ServerError::io(KIND, "creating a temporary directory", e))?;
    let port = free_port().map_err(|e| ServerError::io(KIND, "finding a free port", e))?;
    let conf = dir.path().join("sentinel.conf");
    let mut tls_port = None;
    let mut tls_text = String::new();
    if let Some(tls) = tls {
        let p = free_port().map_err(|e| ServerError::io(KIND, "finding a free TLS port", e))?;
        tls_port = Some(p);
        tls_text = format!(
            "tls-port {p}\ntls-cert-file {cert}\ntls-key-file {key}\ntls-ca-cert-file {ca}\n\
             tls-auth-clients {auth}\ntls-replication yes\n",
            cert = tls.server.cert.display(),
            key = tls.server.key.display(),
            ca = tls.ca.display(),
            auth = if tls.require_client_cert { "yes" } else { "no" },
        );
    }
    let text = format!(
        "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {log}\n\
         sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {primary_port} 2\n\
         sentinel down-after-milliseconds {SENTINEL_SERVICE} {DOWN_AFTER_MS}\n\
         sentinel failover-timeout {SENTINEL_SERVICE} {FAILOVER_TIMEOUT_MS}\n\
         sentinel parallel-syncs {SENTINEL_SERVICE} 1\n{tls_text}",
        dir = dir.path().display(),
        log = dir.path().join("sentinel.log").display(),
    );
    std::fs::write(&conf, text)
        .map_err(|e| ServerError::io(KIND, format!("writing {}", conf.display()), e))?;
    let child = Command::new(redis.binary())
        .arg(&conf)
        .arg("--sentinel")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .current_dir(dir.path())
        .spawn()
        .map_err(|e| ServerError::io(KIND, "starting redis-server --sentinel", e))?;
    Ok(SentinelProcess {
        child,
        port,
        tls_port,
        dir,
    })
}

fn log_of(dir: &Path) -> String {
    super::process::log_tail(&dir.join("sentinel.log"), 0, 30)
}

impl RedisSentinel {
    /// The data nodes (index 0 started as the primary, 1 as its replica).
    pub fn nodes(&self) -> &[TestServer] {
        &self.nodes
    }

    /// The sentinels' ports (the TLS ports for a TLS deployment).
    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels
            .iter()
            .map(SentinelProcess::client_port)
            .collect()
    }

    /// Whether clients speak TLS (started by [`redis_sentinel_tls`]).
    pub fn is_tls(&self) -> bool {
        self.tls
    }

    /// Where the kit sends its own (plain RESP) commands to node `i`: its port, or for a
    /// TLS deployment its plain admin port on 127.0.0.1.
    pub fn admin_addr(&self, i: usize) -> SocketAddr {
        loopback(self.admin_ports[i])
    }

    /// `redis-sentinel://127.0.0.1:S1?sentinelServiceName=simba&node=127.0.0.1:S2&node=…`,
    /// naming all three sentinels (`rediss-sentinel://` and their TLS ports for a TLS
    /// deployment; add TLS options with `&`).
    pub fn url(&self) -> String {
        let scheme = if self.tls {
            "rediss-sentinel"
        } else {
            "redis-sentinel"
        };
        let mut url = format!(
            "{scheme}://127.0.0.1:{}?sentinelServiceName={SENTINEL_SERVICE}",
            self.sentinels[0].client_port()
        );
        for s in &self.sentinels[1..] {
            url.push_str(&format!("&node=127.0.0.1:{}", s.client_port()));
        }
        url
    }

    /// The index in [`nodes`](Self::nodes) of the node that the first sentinel that
    /// answers names as the primary.
    pub async fn primary(&self) -> Result<usize, ServerError> {
        let mut last = String::new();
        for s in &self.sentinels {
            match self.named_primary(s.port).await {
                Ok(Some(i)) => return Ok(i),
                Ok(None) => last = format!("sentinel {} names no known node", s.port),
                Err(e) => last = e.to_string(),
            }
        }
        Err(start_error(format!("no sentinel names a primary: {last}")))
    }

    async fn named_primary(&self, sentinel: u16) -> Result<Option<usize>, ServerError> {
        let reply = command(
            loopback(sentinel),
            &["SENTINEL", "get-master-addr-by-name", SENTINEL_SERVICE],
        )
        .await?;
        let Resp::Array(Some(items)) = reply else {
            return Ok(None);
        };
        let port = items
            .get(1)
            .and_then(Resp::text)
            .and_then(|p| p.parse::<u16>().ok());
        Ok(port.and_then(|p| self.nodes.iter().position(|n| n.port() == p)))
    }

    /// The index of the replica (the node that is not the primary).
    pub async fn replica(&self) -> Result<usize, ServerError> {
        Ok(1 - self.primary().await?)
    }

    /// Waits until every sentinel names the same running primary, that primary has the
    /// other node as a replica whose link is up, and every sentinel knows the two other
    /// sentinels and the replica. Returns the primary's index.
    pub async fn wait_healthy(&self, timeout: Duration) -> Result<usize, ServerError> {
        let deadline = Instant::now() + timeout;
        loop {
            let problem = match self.health().await {
                Ok(primary) => return Ok(primary),
                Err(problem) => problem,
            };
            if Instant::now() >= deadline {
                let logs: Vec<String> = self
                    .sentinels
                    .iter()
                    .map(|s| log_of(s.dir.path()))
                    .collect();
                return Err(ServerError::Start {
                    kind: KIND,
                    message: format!(
                        "the sentinel deployment is not healthy after {timeout:?}: {problem}"
                    ),
                    log_tail: logs.join("\n---\n"),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn health(&self) -> Result<usize, String> {
        let mut named = None;
        for s in &self.sentinels {
            let i = self
                .named_primary(s.port)
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("sentinel {} names no known node", s.port))?;
            if named.is_some_and(|n| n != i) {
                return Err("the sentinels disagree on the primary".to_owned());
            }
            named = Some(i);
            let replicas = self.sentinel_info(s.port, "replicas").await?;
            let replica_port = self.nodes[1 - i].port().to_string();
            let ok = replicas.iter().any(|r| {
                r.get("port") == Some(&replica_port)
                    && r.get("flags").is_some_and(|f| f == "slave")
                    && r.get("master-link-status").is_some_and(|l| l == "ok")
            });
            if !ok {
                return Err(format!(
                    "sentinel {} does not see node {} as a healthy replica: {replicas:?}",
                    s.port,
                    1 - i
                ));
            }
            let others = self.sentinel_info(s.port, "sentinels").await?;
            if others.len() < self.sentinels.len() - 1 {
                return Err(format!(
                    "sentinel {} knows {} other sentinels",
                    s.port,
                    others.len()
                ));
            }
            // Over TLS, also check that the sentinels reach each other (on the TLS ports
            // they announce), not only that they heard of each other.
            if self.tls
                && let Some(bad) = others
                    .iter()
                    .find(|o| o.get("flags").is_none_or(|f| f != "sentinel"))
            {
                return Err(format!(
                    "sentinel {} does not reach another sentinel: {bad:?}",
                    s.port
                ));
            }
        }
        named.ok_or_else(|| "no sentinels".to_owned())
    }

    /// `SENTINEL replicas|sentinels <service>` as one map of fields per instance.
    async fn sentinel_info(
        &self,
        sentinel: u16,
        what: &str,
    ) -> Result<Vec<std::collections::HashMap<String, String>>, String> {
        let reply = command(loopback(sentinel), &["SENTINEL", what, SENTINEL_SERVICE])
            .await
            .map_err(|e| e.to_string())?;
        let Resp::Array(Some(items)) = reply else {
            return Ok(Vec::new());
        };
        Ok(items
            .iter()
            .filter_map(|item| match item {
                Resp::Array(Some(fields)) => Some(
                    fields
                        .chunks(2)
                        .filter_map(|kv| Some((kv.first()?.text()?, kv.get(1)?.text()?)))
                        .collect(),
                ),
                _ => None,
            })
            .collect())
    }

    /// Stops the replication from reaching the replica: the replica is frozen (SIGSTOP)
    /// and the primary drops its replication link. Writes the primary answers from now on
    /// exist only on the primary (the replica cannot reconnect while frozen). Undo with
    /// [`thaw_replication`](Self::thaw_replication), or fail over with
    /// [`kill_primary_and_fail_over`](Self::kill_primary_and_fail_over).
    pub async fn freeze_replication(&self) -> Result<(), ServerError> {
        let primary = self.primary().await?;
        self.nodes[1 - primary].pause().await?;
        command(
            self.admin_addr(primary),
            &["CLIENT", "KILL", "TYPE", "replica"],
        )
        .await?;
        Ok(())
    }

    /// Resumes a replica frozen by [`freeze_replication`](Self::freeze_replication); it
    /// reconnects and catches up.
    pub async fn thaw_replication(&self) -> Result<(), ServerError> {
        let replica = self.replica().await?;
        self.nodes[replica].resume().await
    }

    /// Kills the primary (SIGKILL), resumes the replica if it was frozen, waits until the
    /// sentinels have promoted it, then starts the old primary again (with its data) and
    /// waits until the sentinels have made it a replica of the new one. Returns the new
    /// primary's index.
    ///
    /// Writes the old primary had not replicated are lost, as in a real failover.
    pub async fn kill_primary_and_fail_over(
        &self,
        timeout: Duration,
    ) -> Result<usize, ServerError> {
        let old = self.primary().await?;
        let new = 1 - old;
        self.nodes[old].kill().await?;
        // A frozen replica must answer the sentinels to be promoted.
        let _ = self.nodes[new].resume().await;
        let deadline = Instant::now() + timeout;
        loop {
            let mut all = true;
            for s in &self.sentinels {
                if self.named_primary(s.port).await.ok().flatten() != Some(new) {
                    all = false;
                    break;
                }
            }
            let role = command(self.admin_addr(new), &["ROLE"]).await;
            let promoted = matches!(&role, Ok(Resp::Array(Some(items)))
                if items.first().and_then(Resp::text).as_deref() == Some("master"));
            if all && promoted {
                break;
            }
            if Instant::now() >= deadline {
                let logs: Vec<String> = self
                    .sentinels
                    .iter()
                    .map(|s| log_of(s.dir.path()))
                    .collect();
                return Err(ServerError::Start {
                    kind: KIND,
                    message: format!("the sentinels did not promote node {new} within {timeout:?}"),
                    log_tail: logs.join("\n---\n"),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.nodes[old].start().await?;
        // What the sentinels would do a few seconds later (`+convert-to-slave`).
        let new_port = self.nodes[new].port().to_string();
        command(self.admin_addr(old), &["REPLICAOF", "127.0.0.1", &new_port]).await?;
        let left = deadline.saturating_duration_since(Instant::now());
        self.wait_healthy(left.max(Duration::from_secs(30))).await?;
        Ok(new)
    }
}
