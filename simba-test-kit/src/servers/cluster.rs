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
    // Many clusters start at once when tests run in parallel, and a port found free can
    // be taken by another test's node before ours binds it; a node can then be reached by
    // another cluster's `CLUSTER MEET` ("Node config epoch is already non-zero"). Such a
    // start is thrown away and made again on new ports.
    let mut attempt = 0;
    loop {
        attempt += 1;
        match try_redis_cluster(primaries).await {
            Err(ServerError::Start { message, .. }) if attempt < 3 => {
                tracing::debug!(%message, "cluster start failed, starting a new one");
            }
            other => return other,
        }
    }
}

async fn try_redis_cluster(primaries: usize) -> Result<RedisCluster, ServerError> {
    if primaries == 0 || primaries > SLOTS {
        return Err(ServerError::Start {
            kind: KIND,
            message: format!("a cluster needs between 1 and {SLOTS} primaries, not {primaries}"),
            log_tail: String::new(),
        });
    }
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
    let bus_ports: Vec<u16> = started.iter().map(|(_, bus)| *bus).collect();
    let cluster = RedisCluster {
        nodes: started.into_iter().map(|(node, _)| node).collect(),
    };
    for (i, node) in cluster.nodes.iter().enumerate() {
        let addr = node.socket_addr()?;
        let epoch = (i + 1).to_string();
        command(addr, &["CLUSTER", "SET-CONFIG-EPOCH", &epoch]).await?;
        let slots: Vec<String> = (i * SLOTS / primaries..(i + 1) * SLOTS / primaries)
            .map(|s| s.to_string())
            .collect();
        let mut args = vec!["CLUSTER", "ADDSLOTS"];
        args.extend(slots.iter().map(String::as_str));
        command(addr, &args).await?;
    }
    let first = cluster.nodes[0].socket_addr()?;
    for (node, bus) in cluster.nodes.iter().zip(&bus_ports).skip(1) {
        let port = node.port().to_string();
        let bus = bus.to_string();
        command(first, &["CLUSTER", "MEET", "127.0.0.1", &port, &bus]).await?;
    }
    cluster.wait_ok(CLUSTER_TIMEOUT).await?;
    Ok(cluster)
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

    /// `redis://127.0.0.1:PORT` of every node.
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

    /// All nodes in the `redis-cluster://h:p?node=h:p&node=h:p` URL form that fred parses.
    pub fn cluster_url(&self) -> String {
        let mut url = format!("redis-cluster://127.0.0.1:{}", self.nodes[0].port());
        for (i, node) in self.nodes.iter().enumerate().skip(1) {
            url.push(if i == 1 { '?' } else { '&' });
            url.push_str(&format!("node=127.0.0.1:{}", node.port()));
        }
        url
    }

    /// Waits until every node reports `cluster_state:ok` and knows all nodes.
    pub async fn wait_ok(&self, timeout: Duration) -> Result<(), ServerError> {
        let deadline = Instant::now() + timeout;
        let expected = format!("cluster_known_nodes:{}", self.nodes.len());
        loop {
            let mut last = None;
            for node in &self.nodes {
                let addr = node.socket_addr()?;
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
