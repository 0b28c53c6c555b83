//! A private Redis Sentinel deployment on loopback: a primary, one or more replicas (each
//! with its `replica-priority`) and three sentinels, with the faults a failover test needs
//! (freeze the replication, hold one replica back, kill the primary and let the sentinels
//! promote a replica).

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

/// How long the sentinels wait before they call an unresponsive primary down (ms). At
/// 1 s a loaded test machine made the sentinels fail over a second time, from the newly
/// promoted primary to the old one restarted from its append-only file (keys the test
/// expected gone came back, or the other way round); 3 s keeps a test's failover to the
/// one it makes.
const DOWN_AFTER_MS: u64 = 3000;
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

/// The `replica-priority` of a node the kit starts without one given (Redis's default).
const DEFAULT_PRIORITY: u32 = 100;

/// The ACL user node `i` replicates as (with [`redis_sentinel_with_replicas`]): each node
/// has its own, so that the primary can refuse one replica's link and keep the others'.
fn replication_user(i: usize) -> String {
    format!("simba-repl-{i}")
}

const REPLICATION_PASSWORD: &str = "simba-repl-password";

/// A primary, one or more replicas and three sentinels (quorum 2) on loopback, all private
/// processes.
///
/// Which node is the primary changes with each failover: ask [`primary`](Self::primary).
/// Everything is killed when this is dropped.
pub struct RedisSentinel {
    nodes: Vec<TestServer>,
    /// The `replica-priority` of each node (applied whenever the node is a replica).
    priorities: Vec<u32>,
    /// Whether each node replicates as its own ACL user ([`replication_user`]), so that
    /// [`hold_back_replica`](Self::hold_back_replica) can refuse its link.
    replication_users: bool,
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
    start_deployment(None, &[DEFAULT_PRIORITY], false).await
}

/// As [`redis_sentinel`], with one replica per entry of `priorities`, each with that
/// `replica-priority` (lower is preferred by the sentinels, 0 is never promoted): node 0
/// starts as the primary (priority 100 once it is a replica), node `i + 1` has
/// `priorities[i]`. Each node replicates as an ACL user of its own, so that
/// [`hold_back_replica`](RedisSentinel::hold_back_replica) can keep one replica from the
/// replication while the sentinels still see it healthy.
pub async fn redis_sentinel_with_replicas(
    priorities: &[u32],
) -> Result<RedisSentinel, ServerError> {
    if priorities.is_empty() {
        return Err(start_error(
            "a Sentinel deployment needs at least one replica",
        ));
    }
    start_deployment(None, priorities, true).await
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
    start_deployment(Some(tls), &[DEFAULT_PRIORITY], false).await
}

async fn start_deployment(
    tls: Option<super::tls::RedisTls>,
    replica_priorities: &[u32],
    replication_users: bool,
) -> Result<RedisSentinel, ServerError> {
    let redis = super::redis::Redis::detect().map_err(|e| e.with_advice(true))?;
    let node = || -> Result<super::redis::Redis, ServerError> {
        let Some(tls) = &tls else {
            return Ok(redis.clone());
        };
        let admin =
            free_port().map_err(|e| ServerError::io(KIND, "finding a free admin port", e))?;
        Ok(redis.clone().with_tls(tls.clone()).with_admin_port(admin))
    };
    let count = 1 + replica_priorities.len();
    let configs = (0..count).map(|_| node()).collect::<Result<Vec<_>, _>>()?;
    let mut admin_ports: Vec<Option<u16>> = configs.iter().map(|r| r.admin_port()).collect();
    let flavor = super::process::Flavor::Redis;
    let locals = futures_util::future::try_join_all(
        configs.into_iter().map(|c| LocalServer::create(flavor(c))),
    )
    .await?;
    let nodes: Vec<TestServer> = locals.into_iter().map(TestServer::from_local).collect();
    let admin_ports: Vec<u16> = admin_ports
        .iter_mut()
        .zip(&nodes)
        .map(|(admin, n)| admin.unwrap_or_else(|| n.port()))
        .collect();
    let mut priorities = vec![DEFAULT_PRIORITY];
    priorities.extend_from_slice(replica_priorities);
    let primary_port = nodes[0].port().to_string();
    for i in 0..count {
        set_up_node(
            loopback(admin_ports[i]),
            i,
            count,
            priorities[i],
            replication_users,
        )
        .await?;
    }
    for admin in &admin_ports[1..] {
        command(loopback(*admin), &["REPLICAOF", "127.0.0.1", &primary_port]).await?;
    }
    let mut sentinels = Vec::new();
    for _ in 0..3 {
        sentinels.push(start_sentinel(&redis, nodes[0].port(), tls.as_ref())?);
    }
    let deployment = RedisSentinel {
        nodes,
        priorities,
        replication_users,
        admin_ports,
        sentinels,
        tls: tls.is_some(),
    };
    deployment.wait_healthy(Duration::from_secs(30)).await?;
    Ok(deployment)
}

/// What a node needs whether it is the primary or a replica (again after a restart): its
/// `replica-priority` and, with `replication_users`, the ACL users of all `count` nodes'
/// replication links (all enabled) and its own replication credentials.
async fn set_up_node(
    admin: SocketAddr,
    i: usize,
    count: usize,
    priority: u32,
    replication_users: bool,
) -> Result<(), ServerError> {
    command(
        admin,
        &["CONFIG", "SET", "replica-priority", &priority.to_string()],
    )
    .await?;
    if replication_users {
        let password = format!(">{REPLICATION_PASSWORD}");
        for j in 0..count {
            let user = replication_user(j);
            command(
                admin,
                &[
                    "ACL", "SETUSER", &user, "reset", "on", &password, "+@all", "~*", "&*",
                ],
            )
            .await?;
        }
        let own = replication_user(i);
        command(admin, &["CONFIG", "SET", "masteruser", &own]).await?;
        command(
            admin,
            &["CONFIG", "SET", "masterauth", REPLICATION_PASSWORD],
        )
        .await?;
    }
    Ok(())
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
    /// The data nodes (index 0 started as the primary, the others as its replicas).
    pub fn nodes(&self) -> &[TestServer] {
        &self.nodes
    }

    /// The `replica-priority` of node `i`.
    pub fn priority(&self, i: usize) -> Option<u32> {
        self.priorities.get(i).copied()
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

    /// The highest `config-epoch` of the service among the sentinels that answer: it grows
    /// by one with every failover, so a test can tell one failover from two (a second one
    /// happens when a loaded machine keeps the new primary from answering the sentinels
    /// within `down-after-milliseconds`).
    pub async fn config_epoch(&self) -> Result<u64, ServerError> {
        let mut highest = None;
        for s in &self.sentinels {
            let Ok(Resp::Array(Some(items))) =
                command(loopback(s.port), &["SENTINEL", "MASTER", SENTINEL_SERVICE]).await
            else {
                continue;
            };
            let epoch = items
                .chunks(2)
                .find(|pair| pair[0].text().as_deref() == Some("config-epoch"))
                .and_then(|pair| pair.get(1))
                .and_then(Resp::text)
                .and_then(|v| v.parse::<u64>().ok());
            if let Some(e) = epoch {
                highest = Some(highest.map_or(e, |h: u64| h.max(e)));
            }
        }
        highest.ok_or_else(|| ServerError::Start {
            kind: KIND,
            message: "no sentinel reported the service's config-epoch".into(),
            log_tail: String::new(),
        })
    }

    /// The index of a replica (the first node that is not the primary).
    pub async fn replica(&self) -> Result<usize, ServerError> {
        Ok(self.replicas_of(self.primary().await?)[0])
    }

    /// Every node but `primary`.
    fn replicas_of(&self, primary: usize) -> Vec<usize> {
        (0..self.nodes.len()).filter(|&i| i != primary).collect()
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
            for r in self.replicas_of(i) {
                let replica_port = self.nodes[r].port().to_string();
                let ok = replicas.iter().any(|info| {
                    info.get("port") == Some(&replica_port)
                        && info.get("flags").is_some_and(|f| f == "slave")
                        && info.get("master-link-status").is_some_and(|l| l == "ok")
                });
                if !ok {
                    return Err(format!(
                        "sentinel {} does not see node {r} as a healthy replica: {replicas:?}",
                        s.port
                    ));
                }
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

    /// Stops the replication from reaching the replicas: every replica is frozen (SIGSTOP)
    /// and the primary drops its replication links. Writes the primary answers from now on
    /// exist only on the primary (the replicas cannot reconnect while frozen). Undo with
    /// [`thaw_replication`](Self::thaw_replication), or fail over with
    /// [`kill_primary_and_fail_over`](Self::kill_primary_and_fail_over).
    pub async fn freeze_replication(&self) -> Result<(), ServerError> {
        let primary = self.primary().await?;
        for r in self.replicas_of(primary) {
            self.nodes[r].pause().await?;
        }
        command(
            self.admin_addr(primary),
            &["CLIENT", "KILL", "TYPE", "replica"],
        )
        .await?;
        Ok(())
    }

    /// Resumes the replicas frozen by [`freeze_replication`](Self::freeze_replication);
    /// they reconnect and catch up.
    pub async fn thaw_replication(&self) -> Result<(), ServerError> {
        let primary = self.primary().await?;
        for r in self.replicas_of(primary) {
            self.nodes[r].resume().await?;
        }
        Ok(())
    }

    /// Keeps replica `i` from the replication while it stays up and healthy to the
    /// sentinels (so they may still promote it): the primary disables `i`'s replication
    /// user and drops its link, so `i` cannot reconnect; the other replicas stay online.
    /// Writes the primary answers from now on are missing on `i`. Needs a deployment from
    /// [`redis_sentinel_with_replicas`]; undone by
    /// [`release_replica`](Self::release_replica) or by a failover.
    pub async fn hold_back_replica(&self, i: usize) -> Result<(), ServerError> {
        if !self.replication_users {
            return Err(start_error(
                "hold_back_replica needs a deployment from redis_sentinel_with_replicas",
            ));
        }
        let primary = self.primary().await?;
        if i == primary || i >= self.nodes.len() {
            return Err(start_error(format!("node {i} is not a replica")));
        }
        let admin = self.admin_addr(primary);
        let user = replication_user(i);
        command(admin, &["ACL", "SETUSER", &user, "off"]).await?;
        command(admin, &["CLIENT", "KILL", "USER", &user]).await?;
        Ok(())
    }

    /// Lets replica `i` held back by [`hold_back_replica`](Self::hold_back_replica)
    /// replicate again; it reconnects and catches up.
    pub async fn release_replica(&self, i: usize) -> Result<(), ServerError> {
        let primary = self.primary().await?;
        let user = replication_user(i);
        command(self.admin_addr(primary), &["ACL", "SETUSER", &user, "on"]).await?;
        Ok(())
    }

    /// The replica the sentinels would promote first if all were healthy and equally up
    /// to date: the lowest non-zero `replica-priority` (the first such node on a tie).
    /// `None` if no replica can be promoted.
    pub async fn preferred_replica(&self) -> Result<Option<usize>, ServerError> {
        let primary = self.primary().await?;
        Ok(self
            .replicas_of(primary)
            .into_iter()
            .filter(|&i| self.priorities[i] != 0)
            .min_by_key(|&i| self.priorities[i]))
    }

    /// The number of replicas the primary reports online (`INFO replication`).
    pub async fn online_replicas(&self) -> Result<usize, ServerError> {
        let primary = self.primary().await?;
        let info = command(self.admin_addr(primary), &["INFO", "replication"]).await?;
        Ok(info
            .text()
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("slave") && l.contains("state=online"))
            .count())
    }

    /// Kills the primary (SIGKILL), resumes the replicas if they were frozen, waits until
    /// the sentinels have promoted one (the one they prefer: lowest non-zero
    /// `replica-priority`, then largest replication offset), then starts the old primary
    /// again as a replica of the new one (`--replicaof` on its command line, so it never
    /// serves its old data as a primary: what the sentinels' `+convert-to-slave` does, a
    /// few seconds later, to a node that restarts on its own) and waits until every node
    /// is a replica of the new one. Returns the new primary's index.
    ///
    /// Writes the old primary had not replicated are lost, as in a real failover.
    pub async fn kill_primary_and_fail_over(
        &self,
        timeout: Duration,
    ) -> Result<usize, ServerError> {
        let old = self.primary().await?;
        self.nodes[old].kill().await?;
        // A frozen replica must answer the sentinels to be promoted.
        for r in self.replicas_of(old) {
            let _ = self.nodes[r].resume().await;
        }
        let deadline = Instant::now() + timeout;
        let new = loop {
            let mut named = None;
            let mut agreed = true;
            for s in &self.sentinels {
                match self.named_primary(s.port).await.ok().flatten() {
                    Some(i) if i != old && named.is_none_or(|n| n == i) => named = Some(i),
                    _ => {
                        agreed = false;
                        break;
                    }
                }
            }
            if let (true, Some(new)) = (agreed, named) {
                let role = command(self.admin_addr(new), &["ROLE"]).await;
                let promoted = matches!(&role, Ok(Resp::Array(Some(items)))
                    if items.first().and_then(Resp::text).as_deref() == Some("master"));
                if promoted {
                    break new;
                }
            }
            if Instant::now() >= deadline {
                let logs: Vec<String> = self
                    .sentinels
                    .iter()
                    .map(|s| log_of(s.dir.path()))
                    .collect();
                return Err(ServerError::Start {
                    kind: KIND,
                    message: format!(
                        "the sentinels did not promote a replica of node {old} within {timeout:?}"
                    ),
                    log_tail: logs.join("\n---\n"),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        // Started as a replica from the start: had it come back as a primary with its
        // append-only file until the REPLICAOF below, a second failover (the sentinels
        // calling the new primary down on a loaded machine) could promote it, old keys
        // and all (seen: "a's key came back").
        let new_port = self.nodes[new].port().to_string();
        self.nodes[old]
            .start_with_args(&["--replicaof", "127.0.0.1", &new_port])
            .await?;
        set_up_node(
            self.admin_addr(old),
            old,
            self.nodes.len(),
            self.priorities[old],
            self.replication_users,
        )
        .await?;
        // Again after the set-up (the replication user's credentials are set now).
        command(self.admin_addr(old), &["REPLICAOF", "127.0.0.1", &new_port]).await?;
        let left = deadline.saturating_duration_since(Instant::now());
        self.wait_healthy(left.max(Duration::from_secs(30))).await?;
        Ok(new)
    }
}
