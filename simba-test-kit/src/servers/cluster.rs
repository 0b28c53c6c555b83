//! A private Redis Cluster of primaries on loopback.

use std::fmt;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures_util::future::try_join_all;

use super::probe::{Resp, redis_command};
use super::process::{Flavor, LocalServer, free_port};
use super::{ServerError, ServerKind, TestServer};

const KIND: ServerKind = ServerKind::Redis;
const SLOTS: usize = 16_384;
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(30);

/// A Redis Cluster of private `redis-server --cluster-enabled yes` nodes, all primaries
/// (no replicas), covering all 16384 slots. Every node is a private [`TestServer`] that
/// fault tests can stop, kill or pause. All nodes are killed when this is dropped.
pub struct RedisCluster {
    nodes: Vec<TestServer>,
    /// The port the kit sends its own commands to, per node: the node's port, or for a TLS
    /// cluster its plain admin port.
    admin_ports: Vec<u16>,
    /// Whether clients speak TLS (`rediss://`) to the nodes.
    tls: bool,
    /// One replica per primary, in the primaries' order (from
    /// [`redis_cluster_with_replicas`]); empty otherwise.
    replicas: Vec<TestServer>,
}

impl fmt::Debug for RedisCluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisCluster")
            .field("nodes", &self.urls())
            .finish()
    }
}

/// Starts `primaries` cluster nodes, assigns each an equal share of the slots, joins them
/// and waits until every node reports `cluster_state:ok`.
///
/// This always uses local `redis-server` binaries (version 7 or newer, for
/// `cluster-port`); the environment variable [`REDIS_URL_ENV`](super::REDIS_URL_ENV) is
/// ignored.
pub async fn redis_cluster(primaries: usize) -> Result<RedisCluster, ServerError> {
    start_cluster(primaries, None).await
}

/// As [`redis_cluster`], with every node speaking TLS on its port (`tls`'s certificates,
/// client certificates required if `tls.require_client_cert`) and the cluster bus on TLS
/// too (`tls-cluster yes`). [`cluster_url`](RedisCluster::cluster_url) is then a
/// `rediss-cluster://` URL.
///
/// Each node also listens for plain RESP on a second port bound to 127.0.0.1, which only
/// the kit uses (slot set-up, `CLUSTER MEET`, readiness and health probes: the kit has no
/// TLS client). Redis 7 announces to each client the port of its own kind — TLS clients
/// get the TLS ports in `CLUSTER SLOTS` and `MOVED`, plain ones the plain ports — so a
/// `rediss-cluster://` client never leaves TLS.
pub async fn redis_cluster_tls(
    primaries: usize,
    tls: super::tls::RedisTls,
) -> Result<RedisCluster, ServerError> {
    start_cluster(primaries, Some(tls)).await
}

async fn start_cluster(
    primaries: usize,
    tls: Option<super::tls::RedisTls>,
) -> Result<RedisCluster, ServerError> {
    // Many clusters start at once when tests run in parallel, and a port found free can
    // be taken by another test's node before ours binds it; a node can then be reached by
    // another cluster's `CLUSTER MEET` ("Node config epoch is already non-zero"). Such a
    // start is thrown away and made again on new ports.
    let mut attempt = 0;
    loop {
        attempt += 1;
        match try_redis_cluster(primaries, tls.clone()).await {
            Err(ServerError::Start { message, .. }) if attempt < 3 => {
                tracing::debug!(%message, "cluster start failed, starting a new one");
            }
            other => return other,
        }
    }
}

async fn try_redis_cluster(
    primaries: usize,
    tls: Option<super::tls::RedisTls>,
) -> Result<RedisCluster, ServerError> {
    if primaries == 0 || primaries > SLOTS {
        return Err(ServerError::Start {
            kind: KIND,
            message: format!("a cluster needs between 1 and {SLOTS} primaries, not {primaries}"),
            log_tail: String::new(),
        });
    }
    let is_tls = tls.is_some();
    let mut redis = super::redis::Redis::detect().map_err(|e| e.with_advice(true))?;
    if let Some(tls) = tls {
        redis = redis.with_tls(tls);
    }
    let starts = (0..primaries).map(|_| {
        let redis = redis.clone();
        async move {
            let bus = free_port()
                .map_err(|e| ServerError::io(KIND, "finding a free cluster bus port", e))?;
            let mut node = redis.cluster_node(bus);
            if is_tls {
                let admin = free_port()
                    .map_err(|e| ServerError::io(KIND, "finding a free admin port", e))?;
                node = node.with_admin_port(admin);
            }
            let admin = node.admin_port();
            let local = LocalServer::create(Flavor::Redis(node)).await?;
            let server = TestServer::from_local(local);
            let admin = admin.unwrap_or_else(|| server.port());
            Ok::<_, ServerError>((server, bus, admin))
        }
    });
    let started = try_join_all(starts).await?;
    let bus_ports: Vec<u16> = started.iter().map(|(_, bus, _)| *bus).collect();
    let admin_ports: Vec<u16> = started.iter().map(|(_, _, admin)| *admin).collect();
    let cluster = RedisCluster {
        nodes: started.into_iter().map(|(node, _, _)| node).collect(),
        admin_ports,
        tls: is_tls,
        replicas: Vec::new(),
    };
    for i in 0..cluster.nodes.len() {
        let addr = cluster.admin_addr(i);
        let epoch = (i + 1).to_string();
        command(addr, &["CLUSTER", "SET-CONFIG-EPOCH", &epoch]).await?;
        let slots: Vec<String> = (i * SLOTS / primaries..(i + 1) * SLOTS / primaries)
            .map(|s| s.to_string())
            .collect();
        let mut args = vec!["CLUSTER", "ADDSLOTS"];
        args.extend(slots.iter().map(String::as_str));
        command(addr, &args).await?;
    }
    let first = cluster.admin_addr(0);
    for (node, bus) in cluster.nodes.iter().zip(&bus_ports).skip(1) {
        let port = node.port().to_string();
        let bus = bus.to_string();
        command(first, &["CLUSTER", "MEET", "127.0.0.1", &port, &bus]).await?;
    }
    cluster.wait_ok(CLUSTER_TIMEOUT).await?;
    Ok(cluster)
}

/// As [`redis_cluster`], with one replica per primary (`CLUSTER REPLICATE`), each
/// replicating before this returns: a cluster whose failover can lose writes that the
/// replica did not have, and whose replica check (`WAIT`) has a replica to count.
/// [`replicas`](RedisCluster::replicas) are private servers that tests can pause or kill.
pub async fn redis_cluster_with_replicas(primaries: usize) -> Result<RedisCluster, ServerError> {
    let mut cluster = redis_cluster(primaries).await?;
    let redis = super::redis::Redis::detect().map_err(|e| e.with_advice(true))?;
    let starts = (0..primaries).map(|_| {
        let redis = redis.clone();
        async move {
            let bus = free_port()
                .map_err(|e| ServerError::io(KIND, "finding a free cluster bus port", e))?;
            let local = LocalServer::create(Flavor::Redis(redis.cluster_node(bus))).await?;
            Ok::<_, ServerError>((TestServer::from_local(local), bus))
        }
    });
    let started = try_join_all(starts).await?;
    let first = cluster.admin_addr(0);
    for (replica, bus) in &started {
        let port = replica.port().to_string();
        let bus = bus.to_string();
        command(first, &["CLUSTER", "MEET", "127.0.0.1", &port, &bus]).await?;
    }
    cluster.replicas = started.into_iter().map(|(node, _)| node).collect();
    cluster.wait_ok(CLUSTER_TIMEOUT).await?;
    let deadline = Instant::now() + CLUSTER_TIMEOUT;
    for i in 0..primaries {
        let id = command(cluster.admin_addr(i), &["CLUSTER", "MYID"])
            .await?
            .text()
            .unwrap_or_default();
        let replica = cluster.replicas[i].socket_addr()?;
        // The replica learns of its primary by gossip after the MEET: until then it
        // answers "Unknown node".
        loop {
            match command(replica, &["CLUSTER", "REPLICATE", &id]).await {
                Ok(_) => break,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(%e, "replica not ready to replicate yet");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
    for replica in &cluster.replicas {
        wait_replicating(replica, replica.socket_addr()?, deadline, "the replica").await?;
    }
    Ok(cluster)
}

/// Waits until `node` (reached at `addr`) is a replica whose link to its primary is up.
async fn wait_replicating(
    node: &TestServer,
    addr: SocketAddr,
    deadline: Instant,
    what: &str,
) -> Result<(), ServerError> {
    loop {
        let info = redis_command(addr, &[b"INFO", b"replication"])
            .await
            .map(|r| r.text().unwrap_or_default())
            .unwrap_or_default();
        if info.contains("role:slave") && info.contains("master_link_status:up") {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(ServerError::Start {
                kind: KIND,
                message: format!(
                    "{what} at {addr} does not replicate in time: {}",
                    info.replace("\r\n", " ")
                ),
                log_tail: node.log_tail(20),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn no_replica(i: usize) -> ServerError {
    ServerError::Start {
        kind: KIND,
        message: format!(
            "primary {i} has no replica: start the cluster with redis_cluster_with_replicas"
        ),
        log_tail: String::new(),
    }
}

async fn command(addr: SocketAddr, args: &[&str]) -> Result<Resp, ServerError> {
    let raw: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    let shown = args.iter().take(3).copied().collect::<Vec<_>>().join(" ");
    match redis_command(addr, &raw).await {
        Ok(Resp::Error(e)) => Err(ServerError::Start {
            kind: KIND,
            message: format!("{shown} on {addr} failed: {e}"),
            log_tail: String::new(),
        }),
        Ok(reply) => Ok(reply),
        Err(e) => Err(ServerError::Start {
            kind: KIND,
            message: format!("{shown} on {addr} failed: {e}"),
            log_tail: String::new(),
        }),
    }
}

impl RedisCluster {
    /// The nodes, in slot order (node 0 serves the lowest slots).
    pub fn nodes(&self) -> &[TestServer] {
        &self.nodes
    }

    /// The replica of each primary, in the primaries' order (empty unless started by
    /// [`redis_cluster_with_replicas`]).
    pub fn replicas(&self) -> &[TestServer] {
        &self.replicas
    }

    /// The current roles of shard `i` (started as `nodes[i]` primary and `replicas[i]` its
    /// replica; each failover swaps them): `(primary, its address, replica, its address)`,
    /// read from the servers' `ROLE`. The primary is asked first through whichever of the
    /// two answers: a frozen replica answers nothing.
    async fn shard_roles(
        &self,
        i: usize,
    ) -> Result<(&TestServer, SocketAddr, &TestServer, SocketAddr), ServerError> {
        let replica = self.replicas.get(i).ok_or_else(|| no_replica(i))?;
        let pair = [
            (&self.nodes[i], self.admin_addr(i)),
            (replica, replica.socket_addr()?),
        ];
        let mut seen = Vec::new();
        for (k, (server, addr)) in pair.iter().enumerate() {
            let role = tokio::time::timeout(Duration::from_secs(2), command(*addr, &["ROLE"]))
                .await
                .map_err(|_| format!("{addr}: no answer to ROLE within 2 s"))
                .and_then(|r| r.map_err(|e| e.to_string()));
            let first = match &role {
                Ok(Resp::Array(Some(items))) => items.first().and_then(Resp::text),
                _ => None,
            };
            let (other, other_addr) = pair[1 - k];
            match first.as_deref() {
                Some("master") => return Ok((server, *addr, other, other_addr)),
                Some("slave") => return Ok((other, other_addr, server, *addr)),
                _ => seen.push(format!("{addr}: {role:?}")),
            }
        }
        Err(ServerError::Start {
            kind: KIND,
            message: format!(
                "shard {i}: neither node says whether it is primary or replica ({})",
                seen.join("; ")
            ),
            log_tail: String::new(),
        })
    }

    /// Which shard (index into [`nodes`](Self::nodes) and [`replicas`](Self::replicas))
    /// serves `key`'s slot: the slot from `CLUSTER KEYSLOT`, asked of the first node that
    /// answers; each shard keeps the slot range it was started with.
    pub async fn shard_of_key(&self, key: &str) -> Result<usize, ServerError> {
        let mut last = None;
        let addrs = (0..self.nodes.len()).map(|i| self.admin_addr(i));
        for addr in addrs {
            let reply = tokio::time::timeout(
                Duration::from_secs(2),
                command(addr, &["CLUSTER", "KEYSLOT", key]),
            )
            .await;
            match reply {
                Ok(Ok(Resp::Integer(slot))) if (0..SLOTS as i64).contains(&slot) => {
                    let n = self.nodes.len();
                    return Ok((0..n)
                        .find(|&i| (slot as usize) < (i + 1) * SLOTS / n)
                        .unwrap_or(n - 1));
                }
                Ok(Ok(other)) => last = Some(format!("{addr}: {other:?}")),
                Ok(Err(e)) => last = Some(e.to_string()),
                Err(_) => last = Some(format!("{addr}: no answer within 2 s")),
            }
        }
        Err(ServerError::Start {
            kind: KIND,
            message: format!(
                "no node told the slot of {key:?}: {}",
                last.unwrap_or_default()
            ),
            log_tail: String::new(),
        })
    }

    /// The port of the node that is now the primary of shard `i` (see
    /// [`shard_of_key`](Self::shard_of_key)).
    pub async fn primary_port(&self, i: usize) -> Result<u16, ServerError> {
        let (primary, ..) = self.shard_roles(i).await?;
        Ok(primary.port())
    }

    /// Has the node listening on `port` (a primary or a replica) close its connection from
    /// the client at `client` (`CLIENT KILL ADDR`); `Ok(false)` when `port` is not a node
    /// of this cluster or the node has no such client.
    pub async fn kill_client(&self, port: u16, client: SocketAddr) -> Result<bool, ServerError> {
        let addr = if let Some(i) = self.nodes.iter().position(|n| n.port() == port) {
            self.admin_addr(i)
        } else if let Some(r) = self.replicas.iter().find(|r| r.port() == port) {
            r.socket_addr()?
        } else {
            return Ok(false);
        };
        let client = client.to_string();
        let raw: [&[u8]; 4] = [b"CLIENT", b"KILL", b"ADDR", client.as_bytes()];
        match redis_command(addr, &raw).await {
            Ok(Resp::Error(e)) if e.contains("No such client") => Ok(false),
            Ok(Resp::Error(e)) => Err(ServerError::Start {
                kind: KIND,
                message: format!("CLIENT KILL ADDR {client} on {addr} failed: {e}"),
                log_tail: String::new(),
            }),
            Ok(_) => Ok(true),
            Err(e) => Err(ServerError::Start {
                kind: KIND,
                message: format!("CLIENT KILL ADDR {client} on {addr} failed: {e}"),
                log_tail: String::new(),
            }),
        }
    }

    /// Cuts the primary of shard `i` off from its replica: the replica is frozen (SIGSTOP)
    /// and the primary drops its replication link, so writes from now on reach no replica.
    /// The roles are read from the servers, so this follows earlier failovers.
    pub async fn freeze_replication(&self, i: usize) -> Result<(), ServerError> {
        let (_, primary, replica, _) = self.shard_roles(i).await?;
        replica.pause().await?;
        command(primary, &["CLIENT", "KILL", "TYPE", "replica"]).await?;
        Ok(())
    }

    /// Kills the primary of shard `i` (SIGKILL), resumes its replica if frozen, makes the
    /// replica take over the shard's slots (`CLUSTER FAILOVER TAKEOVER`) and waits, within
    /// `timeout`, until it is a primary that every other node knows as one; then starts
    /// the old primary again (with its data) and waits until it replicates the new one.
    /// Writes the old primary had not replicated are lost, as in a real failover.
    ///
    /// The roles are read from the servers (`ROLE`), not from the order the cluster was
    /// started in: the first failover of shard `i` promotes
    /// [`replicas`](Self::replicas)`[i]`, the next one [`nodes`](Self::nodes)`[i]` again.
    pub async fn kill_primary_and_fail_over(
        &self,
        i: usize,
        timeout: Duration,
    ) -> Result<(), ServerError> {
        // A frozen replica does not answer ROLE, but the primary does.
        let (old, old_addr, replica, addr) = self.shard_roles(i).await?;
        old.kill().await?;
        let _ = replica.resume().await;
        command(addr, &["CLUSTER", "FAILOVER", "TAKEOVER"]).await?;
        let port = replica.port();
        let deadline = Instant::now() + timeout;
        let others: Vec<SocketAddr> = (0..self.nodes.len())
            .filter(|&j| j != i)
            .flat_map(|j| {
                let mut v = vec![self.admin_addr(j)];
                v.extend(self.replicas.get(j).and_then(|r| r.socket_addr().ok()));
                v
            })
            .collect();
        loop {
            let role = command(addr, &["ROLE"]).await;
            let promoted = matches!(&role, Ok(Resp::Array(Some(items)))
                if items.first().and_then(Resp::text).as_deref() == Some("master"));
            // The others must know: their CLUSTER NODES names the replica's port as a master.
            let mut known = promoted;
            for other in &others {
                let nodes = command(*other, &["CLUSTER", "NODES"])
                    .await
                    .ok()
                    .and_then(|r| r.text())
                    .unwrap_or_default();
                known &= nodes
                    .lines()
                    .any(|l| l.contains(&format!(":{port}@")) && l.contains("master"));
            }
            if known {
                break;
            }
            if Instant::now() >= deadline {
                return Err(ServerError::Start {
                    kind: KIND,
                    message: format!(
                        "the replica on port {port} did not take over shard {i} \
                         within {timeout:?} (ROLE: {role:?})"
                    ),
                    log_tail: replica.log_tail(20),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // The old primary comes back with its data and learns that it was failed over:
        // it becomes the new primary's replica, so that the new primary has one.
        old.start().await?;
        wait_replicating(old, old_addr, deadline, "the old primary").await
    }

    /// Whether clients speak TLS to the nodes (started by [`redis_cluster_tls`]).
    pub fn is_tls(&self) -> bool {
        self.tls
    }

    /// Where the kit sends its own (plain RESP) commands to node `i`: its port, or for a
    /// TLS cluster its plain admin port on 127.0.0.1.
    pub fn admin_addr(&self, i: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.admin_ports[i]))
    }

    /// `redis://127.0.0.1:PORT` (`rediss://` for TLS) of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url().to_owned()).collect()
    }

    /// The URL of the first node, a seed for cluster clients.
    pub fn seed_url(&self) -> &str {
        self.nodes[0].url()
    }

    /// `(host, port)` of every node.
    pub fn hosts(&self) -> Vec<(String, u16)> {
        self.nodes
            .iter()
            .map(|n| (n.host().to_owned(), n.port()))
            .collect()
    }

    /// All nodes in the `redis-cluster://h:p?node=h:p&node=h:p` URL form that fred parses
    /// (`rediss-cluster://` for a TLS cluster; add TLS options with `&`).
    pub fn cluster_url(&self) -> String {
        let scheme = if self.tls {
            "rediss-cluster"
        } else {
            "redis-cluster"
        };
        let mut url = format!("{scheme}://127.0.0.1:{}", self.nodes[0].port());
        for (i, node) in self.nodes.iter().enumerate().skip(1) {
            url.push(if i == 1 { '?' } else { '&' });
            url.push_str(&format!("node=127.0.0.1:{}", node.port()));
        }
        url
    }

    /// Waits until every node reports `cluster_state:ok` and knows all nodes.
    pub async fn wait_ok(&self, timeout: Duration) -> Result<(), ServerError> {
        let deadline = Instant::now() + timeout;
        let expected = format!(
            "cluster_known_nodes:{}",
            self.nodes.len() + self.replicas.len()
        );
        loop {
            let mut last = None;
            for i in 0..self.nodes.len() {
                let addr = self.admin_addr(i);
                let info = redis_command(addr, &[b"CLUSTER", b"INFO"])
                    .await
                    .map(|r| r.text().unwrap_or_else(|| format!("{r:?}")));
                match info {
                    Ok(text) if text.contains("cluster_state:ok") && text.contains(&expected) => {}
                    Ok(text) => {
                        last = Some(format!("{addr}: {}", text.replace("\r\n", " ")));
                        break;
                    }
                    Err(e) => {
                        last = Some(e);
                        break;
                    }
                }
            }
            let Some(last) = last else {
                return Ok(());
            };
            if Instant::now() >= deadline {
                return Err(ServerError::Start {
                    kind: KIND,
                    message: format!("the cluster is not ok after {timeout:?}: {last}"),
                    log_tail: self.nodes[0].log_tail(20),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
