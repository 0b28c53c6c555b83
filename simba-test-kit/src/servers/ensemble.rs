//! A three-node ZooKeeper ensemble in containers: see [`ZkEnsemble`].

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::container::preflight;
use super::docker::{self as dk, Deployment, Net};
use super::{IMAGE_TAG, ServerError, ServerKind, image_name, probe};

const KIND: ServerKind = ServerKind::Zookeeper;

/// The number of nodes.
pub const ENSEMBLE_SIZE: usize = 3;

/// How long the ensemble may take to elect its first leader, or a node to serve again.
const STARTUP: Duration = Duration::from_secs(120);

/// The client port inside the containers.
const CLIENT_PORT: u16 = 2181;

/// Distinguishes the ensembles of one process.
static SEQUENCE: AtomicU32 = AtomicU32::new(0);

/// What a node says it is (`srvr`'s `Mode:` line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeMode {
    /// The quorum's leader.
    Leader,
    /// A follower of the current leader.
    Follower,
    /// Running but not serving: looking for a leader (no quorum), or starting.
    NotServing,
    /// Not answering at all (stopped, killed, or not reachable).
    Down,
}

/// A three-node ZooKeeper ensemble in containers (feature `containers`), for faults that
/// need hosts: killing the leader, partitioning a follower from the others, and cutting a
/// client off from the servers — all with Docker networks, not the loopback proxy.
///
/// # Layout
///
/// Every node is a container of the kit's `simba/zookeeper` image with its own `myid` and
/// the ensemble's `server.N` lines. The containers sit on Docker networks with fixed
/// addresses (so that a node keeps them across a restart or a reconnect):
///
/// - `peers`: quorum and election traffic (ports 2888 and 3888), an internal network;
///   [`ZkEnsemble::partition`] disconnects a node from it;
/// - `control`: the kit's own `srvr` queries from the host ([`ZkEnsemble::mode`]); no
///   fault touches it;
/// - one `client` network per client (`clients` in [`ZkEnsemble::start`]): client `c`
///   reaches every node at its address on network `c` ([`ZkEnsemble::connect_string`]),
///   so [`ZkEnsemble::cut_client`] can part exactly that client from the servers while the
///   others and the quorum carry on.
///
/// The host reaches the containers at their addresses on these bridge networks directly
/// (no published ports), which needs a Docker engine on this Linux host (not a remote one,
/// not Docker Desktop's VM). The kit drives the engine with the `docker` command.
///
/// Containers and networks carry the label [`LABEL`](super::LABEL)` = 1` (and `simba.test.pid`), and are
/// removed when the [`ZkEnsemble`] is dropped, also when the test panics;
/// `scripts/containers.sh clean` removes what a killed test process left.
pub struct ZkEnsemble {
    d: Deployment,
}

impl fmt::Debug for ZkEnsemble {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkEnsemble")
            .field("containers", &self.d.containers)
            .field("peers", &self.d.peers.name)
            .field("clients", &self.d.clients.len())
            .finish()
    }
}

/// The `zoo.cfg` of every node: the kit's usual short ticks (sessions from 400 ms), the
/// four-letter words the kit uses, and the `server.N` lines on the peers network.
fn zoo_cfg(peers: &Net) -> String {
    let mut text = String::from(
        "tickTime=200\n\
         minSessionTimeout=400\n\
         maxSessionTimeout=60000\n\
         initLimit=25\n\
         syncLimit=10\n\
         dataDir=/var/lib/zookeeper/data\n\
         clientPort=2181\n\
         clientPortAddress=0.0.0.0\n\
         quorumListenOnAllIPs=true\n\
         maxClientCnxns=0\n\
         admin.enableServer=false\n\
         4lw.commands.whitelist=ruok,srvr,stat,mntr,cons,conf\n\
         forceSync=no\n",
    );
    for i in 0..ENSEMBLE_SIZE {
        text.push_str(&format!(
            "server.{}={}:2888:3888\n",
            i + 1,
            peers.node_ip(i)
        ));
    }
    text
}

impl ZkEnsemble {
    /// Starts a three-node ensemble with `clients` client networks (at least one) and waits
    /// until it has a leader and every node serves.
    ///
    /// # Errors
    ///
    /// [`ServerError::Unavailable`] when no Docker daemon answers or the image
    /// `simba/zookeeper` is missing (the message says how to fix it);
    /// [`ServerError::Io`] when a `docker` command fails; [`ServerError::Start`] when the
    /// ensemble does not serve within two minutes. What was created is removed.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: what was created when the future is dropped is left (with its
    /// labels, for `scripts/containers.sh clean`).
    pub async fn start(clients: usize) -> Result<ZkEnsemble, ServerError> {
        preflight(KIND)
            .await
            .map_err(|hint| ServerError::Unavailable { kind: KIND, hint })?;
        let prefix = format!(
            "simba-zk-{}-{}",
            std::process::id(),
            SEQUENCE.fetch_add(1, Ordering::Relaxed)
        );
        // Made step by step into `ensemble`, whose drop removes what exists so far.
        let mut ensemble = ZkEnsemble {
            d: Deployment::create(KIND, prefix.clone(), clients).await?,
        };
        let dir = tempfile::tempdir().map_err(|e| ServerError::io(KIND, "temp dir", e))?;
        let cfg = dir.path().join("zoo.cfg");
        std::fs::write(&cfg, zoo_cfg(&ensemble.d.peers))
            .map_err(|e| ServerError::io(KIND, "writing zoo.cfg", e))?;
        let cfg = cfg.display().to_string();
        let image = format!("{}:{IMAGE_TAG}", image_name(KIND));
        let [l1, label, l2, pid] = dk::label_args();
        for i in 0..ENSEMBLE_SIZE {
            let name = format!("{prefix}-n{}", i + 1);
            let ip = ensemble.d.peers.node_ip(i).to_string();
            ensemble
                .d
                .docker(&[
                    "create",
                    "--name",
                    &name,
                    "--hostname",
                    &format!("zk{}", i + 1),
                    &l1,
                    &label,
                    &l2,
                    &pid,
                    "--network",
                    &ensemble.d.peers.name,
                    "--ip",
                    &ip,
                    &image,
                    // Java options for the image's entrypoint: a dead peer is given up on
                    // after 1 s instead of 5 s, so that elections stay short.
                    "-Dzookeeper.cnxTimeout=1000",
                ])
                .await?;
            ensemble.d.containers.push(name.clone());
            let myid = dir.path().join(format!("myid{}", i + 1));
            std::fs::write(&myid, format!("{}\n", i + 1))
                .map_err(|e| ServerError::io(KIND, "writing myid", e))?;
            ensemble
                .d
                .docker(&["cp", &cfg, &format!("{name}:/etc/simba/zoo.cfg")])
                .await?;
            ensemble
                .d
                .docker(&[
                    "cp",
                    &myid.display().to_string(),
                    &format!("{name}:/var/lib/zookeeper/data/myid"),
                ])
                .await?;
            let mut nets = vec![ensemble.d.control.clone()];
            nets.extend(ensemble.d.clients.iter().cloned());
            for net in nets {
                ensemble.d.connect(&net, &name, i).await?;
            }
        }
        for name in &ensemble.d.containers {
            ensemble.d.docker(&["start", name]).await?;
        }
        let deadline = Instant::now() + STARTUP;
        loop {
            let mut modes = Vec::new();
            for i in 0..ENSEMBLE_SIZE {
                modes.push(ensemble.mode(i).await);
            }
            let leaders = modes.iter().filter(|m| **m == NodeMode::Leader).count();
            let followers = modes.iter().filter(|m| **m == NodeMode::Follower).count();
            if leaders == 1 && followers == ENSEMBLE_SIZE - 1 {
                break;
            }
            if Instant::now() >= deadline {
                return Err(ServerError::Start {
                    kind: KIND,
                    message: format!(
                        "the ensemble {prefix} does not serve after {STARTUP:?}: modes {modes:?}. \
                         The host must reach the containers' addresses on the Docker bridge \
                         networks (a local Linux engine)"
                    ),
                    log_tail: ensemble.logs(0, 30).await,
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(ensemble)
    }

    /// The number of client networks.
    pub fn clients(&self) -> usize {
        self.d.clients.len()
    }

    /// The container name of node `i` (0, 1 or 2; its `myid` is `i + 1`).
    pub fn container(&self, i: usize) -> &str {
        &self.d.containers[i]
    }

    /// The connect string for client `client`: every node's address on that client's
    /// network, e.g. `10.1.0.11:2181,10.1.0.12:2181,10.1.0.13:2181`.
    ///
    /// # Panics
    ///
    /// When `client` is not below [`clients`](Self::clients).
    pub fn connect_string(&self, client: usize) -> String {
        let net = &self.d.clients[client];
        (0..ENSEMBLE_SIZE)
            .map(|i| format!("{}:{CLIENT_PORT}", net.node_ip(i)))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The node that `addr` (a server address a client of the ensemble is connected to)
    /// belongs to, whichever client network it is on.
    pub fn node_of(&self, addr: SocketAddr) -> Option<usize> {
        let SocketAddr::V4(v4) = addr else {
            return None;
        };
        (0..ENSEMBLE_SIZE).find(|&i| {
            v4.port() == CLIENT_PORT && self.d.clients.iter().any(|n| n.node_ip(i) == *v4.ip())
        })
    }

    /// What node `i` says it is, asked with `srvr` on the control network.
    pub async fn mode(&self, i: usize) -> NodeMode {
        let addr = SocketAddr::from((self.d.control.node_ip(i), CLIENT_PORT));
        match tokio::time::timeout(
            Duration::from_secs(2),
            probe::zookeeper_four_letter(addr, "srvr"),
        )
        .await
        {
            Ok(Ok(text)) => {
                if text.contains("Mode: leader") {
                    NodeMode::Leader
                } else if text.contains("Mode: follower") {
                    NodeMode::Follower
                } else {
                    NodeMode::NotServing
                }
            }
            _ => NodeMode::Down,
        }
    }

    /// The node that says it is the leader, if one does.
    pub async fn leader(&self) -> Option<usize> {
        for i in 0..ENSEMBLE_SIZE {
            if self.mode(i).await == NodeMode::Leader {
                return Some(i);
            }
        }
        None
    }

    /// Waits until some node is the leader and at least a quorum (two nodes) serves;
    /// returns the leader.
    ///
    /// # Errors
    ///
    /// [`ServerError::Start`] when that does not happen `within`.
    pub async fn wait_for_quorum(&self, within: Duration) -> Result<usize, ServerError> {
        let deadline = Instant::now() + within;
        loop {
            let mut modes = Vec::new();
            for i in 0..ENSEMBLE_SIZE {
                modes.push(self.mode(i).await);
            }
            let leader = modes.iter().position(|m| *m == NodeMode::Leader);
            let serving = modes
                .iter()
                .filter(|m| matches!(m, NodeMode::Leader | NodeMode::Follower))
                .count();
            if let Some(leader) = leader.filter(|_| serving > ENSEMBLE_SIZE / 2) {
                return Ok(leader);
            }
            if Instant::now() >= deadline {
                return Err(ServerError::Start {
                    kind: KIND,
                    message: format!("no quorum with a leader within {within:?}: modes {modes:?}"),
                    log_tail: self.logs(0, 20).await,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until node `i` serves (as leader or follower).
    ///
    /// # Errors
    ///
    /// [`ServerError::Start`] when it does not `within`.
    pub async fn wait_serving(&self, i: usize, within: Duration) -> Result<(), ServerError> {
        let deadline = Instant::now() + within;
        loop {
            let mode = self.mode(i).await;
            if matches!(mode, NodeMode::Leader | NodeMode::Follower) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(ServerError::Start {
                    kind: KIND,
                    message: format!(
                        "node {} ({}) does not serve within {within:?}: {mode:?}",
                        i + 1,
                        self.d.containers[i]
                    ),
                    log_tail: self.logs(i, 20).await,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills node `i` with SIGKILL (a crash). Its data stays; [`start`](Self::start_node)
    /// brings it back.
    ///
    /// # Errors
    ///
    /// [`ServerError::Io`] when `docker kill` fails.
    pub async fn kill(&self, i: usize) -> Result<(), ServerError> {
        self.d.kill(i).await
    }

    /// Stops node `i` gracefully (SIGTERM, then SIGKILL after 10 s).
    ///
    /// # Errors
    ///
    /// [`ServerError::Io`] when `docker stop` fails.
    pub async fn stop(&self, i: usize) -> Result<(), ServerError> {
        self.d.stop(i).await
    }

    /// Starts a stopped or killed node `i` again (same data, same addresses) and waits
    /// until it serves.
    ///
    /// # Errors
    ///
    /// [`ServerError::Io`] when `docker start` fails, [`ServerError::Start`] when the
    /// node does not serve within two minutes.
    pub async fn start_node(&self, i: usize) -> Result<(), ServerError> {
        self.d.start(i).await?;
        self.wait_serving(i, STARTUP).await
    }

    /// Partitions node `i` from the other nodes: disconnects it from the peers network.
    /// Its clients can still reach it; a node without a quorum stops serving them.
    ///
    /// # Errors
    ///
    /// [`ServerError::Io`] when `docker network disconnect` fails.
    pub async fn partition(&self, i: usize) -> Result<(), ServerError> {
        self.d.partition(i).await
    }

    /// Undoes [`partition`](Self::partition): connects node `i` to the peers network
    /// again, at its address.
    ///
    /// # Errors
    ///
    /// [`ServerError::Io`] when `docker network connect` fails.
    pub async fn heal(&self, i: usize) -> Result<(), ServerError> {
        self.d.heal(i).await
    }

    /// Cuts client `client` off from every node: disconnects the nodes from that client's
    /// network. The other clients and the quorum are not touched.
    ///
    /// # Errors
    ///
    /// [`ServerError::Io`] when `docker network disconnect` fails.
    pub async fn cut_client(&self, client: usize) -> Result<(), ServerError> {
        self.d.cut_client(client).await
    }

    /// Undoes [`cut_client`](Self::cut_client).
    ///
    /// # Errors
    ///
    /// [`ServerError::Io`] when `docker network connect` fails.
    pub async fn restore_client(&self, client: usize) -> Result<(), ServerError> {
        self.d.restore_client(client).await
    }

    /// The last `lines` lines of node `i`'s log.
    pub async fn logs(&self, i: usize, lines: usize) -> String {
        self.d.logs(i, lines).await
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn config_names_every_node_on_the_peers_network() {
        let peers = Net {
            name: "p".into(),
            base: Ipv4Addr::new(172, 20, 0, 0),
        };
        let cfg = zoo_cfg(&peers);
        assert!(cfg.contains("server.1=172.20.0.11:2888:3888\n"), "{cfg}");
        assert!(cfg.contains("server.3=172.20.0.13:2888:3888\n"), "{cfg}");
        assert!(cfg.contains("4lw.commands.whitelist=ruok,srvr,"), "{cfg}");
    }
}
