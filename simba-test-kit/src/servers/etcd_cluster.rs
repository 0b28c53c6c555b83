//! A three-member etcd cluster in containers: see [`EtcdCluster`].

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::time::{Instant, sleep, timeout};

use super::container::preflight;
use super::docker::{self as dk, Deployment, Net};
use super::probe::{self, EtcdStatus};
use super::process::free_port;
use super::{IMAGE_TAG, ServerError, ServerKind, image_name};

const KIND: ServerKind = ServerKind::Etcd;

/// The number of members.
pub const CLUSTER_SIZE: usize = 3;

/// How long the cluster may take to elect its first leader, or a member to serve again
/// (a container start on a loaded machine, then an election).
const STARTUP: Duration = Duration::from_secs(120);

/// How long one status or health question to a member may take.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// The client port inside the containers.
const CLIENT_PORT: u16 = 2379;

/// The peer port inside the containers.
const PEER_PORT: u16 = 2380;

/// Distinguishes the clusters of one process.
static SEQUENCE: AtomicU32 = AtomicU32::new(0);

/// What a member says it is (its own status, which needs no quorum).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberState {
    /// It is the leader (of its term; a partitioned leader says so until it steps down,
    /// one election timeout after it last heard from a quorum).
    Leader,
    /// It follows a leader.
    Follower,
    /// Running but without a leader (no quorum, an election going on, or starting).
    NoLeader,
    /// Not answering at all (stopped, killed, or not reachable).
    Down,
}

/// A three-member etcd cluster in containers (feature `containers`), for the faults that
/// need hosts: killing the leader, partitioning a member from the others, restarting a
/// member, and cutting a client off.
///
/// # Layout
///
/// Every member is a container of the kit's `simba/etcd` image (Debian's `etcd-server`)
/// named `m1` to `m3`, with etcd's default timing (heartbeat 100 ms, election timeout 1 s)
/// and pre-vote on. The containers sit on Docker networks with fixed addresses (kept
/// across a restart or a reconnect):
///
/// - `peers`: Raft traffic (port 2380), an internal network; [`EtcdCluster::partition`]
///   disconnects a member from it;
/// - `control`: each member's client port is published on the host's `127.0.0.1`
///   ([`EtcdCluster::endpoint`], [`EtcdCluster::url`]; the host port is chosen at creation
///   and kept across restarts) and the kit asks members for their status there; no
///   fault touches it;
/// - one `client` network per client (`clients` in [`EtcdCluster::start`]): client `c`
///   reaches member `i` at its address on network `c` ([`EtcdCluster::client_endpoint`]),
///   so [`EtcdCluster::cut_client`] can part exactly that client from the cluster while
///   the others and the quorum carry on.
///
/// The host reaches the client networks' addresses directly, which needs a Docker engine
/// on this Linux host (not a remote one, not Docker Desktop's VM), as for the
/// [`ZkEnsemble`](super::ZkEnsemble). The kit drives the engine with the `docker` command;
/// every operation is bounded (a `docker` command by a minute, a wait by its argument or
/// two minutes).
///
/// Containers and networks carry the label [`LABEL`](super::LABEL)` = 1` (and
/// `simba.test.pid`), and are removed when the [`EtcdCluster`] is dropped, also when the
/// test panics; `scripts/containers.sh clean` removes what a killed test process left.
pub struct EtcdCluster {
    d: Deployment,
    /// Each member's client port on the host's loopback.
    host_ports: Vec<u16>,
    /// Each member's etcd member id.
    member_ids: Vec<u64>,
}

impl fmt::Debug for EtcdCluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdCluster")
            .field("containers", &self.d.containers)
            .field("host_ports", &self.host_ports)
            .field("peers", &self.d.peers.name)
            .field("clients", &self.d.clients.len())
            .finish()
    }
}

/// The arguments of member `i`'s `etcd`: clients on every interface, peers on every
/// interface but advertised at the `peers` network's address (so Raft traffic only goes
/// there), the cluster's three members, and a token unique to this cluster.
fn member_args(prefix: &str, peers: &Net, control: &Net, i: usize) -> Vec<String> {
    let cluster = (0..CLUSTER_SIZE)
        .map(|j| format!("m{}=http://{}:{PEER_PORT}", j + 1, peers.node_ip(j)))
        .collect::<Vec<_>>()
        .join(",");
    [
        "--name".to_owned(),
        format!("m{}", i + 1),
        "--data-dir".to_owned(),
        "/var/lib/etcd/data".to_owned(),
        "--listen-client-urls".to_owned(),
        format!("http://0.0.0.0:{CLIENT_PORT}"),
        "--advertise-client-urls".to_owned(),
        format!("http://{}:{CLIENT_PORT}", control.node_ip(i)),
        "--listen-peer-urls".to_owned(),
        format!("http://0.0.0.0:{PEER_PORT}"),
        "--initial-advertise-peer-urls".to_owned(),
        format!("http://{}:{PEER_PORT}", peers.node_ip(i)),
        "--initial-cluster".to_owned(),
        cluster,
        "--initial-cluster-state".to_owned(),
        "new".to_owned(),
        "--initial-cluster-token".to_owned(),
        prefix.to_owned(),
        "--heartbeat-interval".to_owned(),
        "100".to_owned(),
        "--election-timeout".to_owned(),
        "1000".to_owned(),
        "--pre-vote".to_owned(),
        "--logger".to_owned(),
        "zap".to_owned(),
        "--log-outputs".to_owned(),
        "stderr".to_owned(),
    ]
    .into()
}

impl EtcdCluster {
    /// Starts a three-member cluster with `clients` client networks (at least one) and
    /// waits until it has a leader that every member follows.
    ///
    /// # Errors
    ///
    /// [`ServerError::Unavailable`] when no Docker daemon answers or the image `simba/etcd`
    /// is missing (the message says how to fix it); [`ServerError::Io`] when a `docker`
    /// command fails; [`ServerError::Start`] when the cluster does not serve within two
    /// minutes. What was created is removed.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: what was created when the future is dropped is left (with its
    /// labels, for `scripts/containers.sh clean`).
    pub async fn start(clients: usize) -> Result<EtcdCluster, ServerError> {
        preflight(KIND)
            .await
            .map_err(|hint| ServerError::Unavailable { kind: KIND, hint })?;
        let prefix = format!(
            "simba-etcd-{}-{}",
            std::process::id(),
            SEQUENCE.fetch_add(1, Ordering::Relaxed)
        );
        // Made step by step into `cluster`, whose drop removes what exists so far.
        let mut cluster = EtcdCluster {
            d: Deployment::create(KIND, prefix.clone(), clients).await?,
            host_ports: Vec::new(),
            member_ids: Vec::new(),
        };
        let image = format!("{}:{IMAGE_TAG}", image_name(KIND));
        let labels = dk::label_args();
        for i in 0..CLUSTER_SIZE {
            let name = format!("{prefix}-m{}", i + 1);
            // Chosen here and given to the engine, so that a restarted member keeps it.
            let port = free_port().map_err(|e| ServerError::io(KIND, "finding a free port", e))?;
            let publish = format!("{}:{port}:{CLIENT_PORT}", Ipv4Addr::LOCALHOST);
            let hostname = format!("etcd{}", i + 1);
            let ip = cluster.d.control.node_ip(i).to_string();
            let mut args: Vec<&str> = vec!["create", "--name", &name, "--hostname", &hostname];
            args.extend(labels.iter().map(String::as_str));
            args.extend([
                "--network",
                &cluster.d.control.name,
                "--ip",
                &ip,
                "--publish",
                &publish,
                "--entrypoint",
                "etcd",
                &image,
            ]);
            let member = member_args(&prefix, &cluster.d.peers, &cluster.d.control, i);
            args.extend(member.iter().map(String::as_str));
            cluster.d.docker(&args).await?;
            cluster.d.containers.push(name.clone());
            cluster.host_ports.push(port);
            let mut nets = vec![cluster.d.peers.clone()];
            nets.extend(cluster.d.clients.iter().cloned());
            for net in nets {
                cluster.d.connect(&net, &name, i).await?;
            }
        }
        for name in &cluster.d.containers {
            cluster.d.docker(&["start", name]).await?;
        }
        let deadline = Instant::now() + STARTUP;
        loop {
            let statuses = cluster.statuses().await;
            let leaders: Vec<u64> = statuses.iter().flatten().map(|s| s.leader).collect();
            let agreed = leaders.len() == CLUSTER_SIZE
                && leaders[0] != 0
                && leaders.iter().all(|l| *l == leaders[0]);
            if agreed {
                cluster.member_ids = statuses.iter().flatten().map(|s| s.member).collect();
                break;
            }
            if Instant::now() >= deadline {
                return Err(ServerError::Start {
                    kind: KIND,
                    message: format!(
                        "the cluster {prefix} does not agree on a leader after {STARTUP:?}: \
                         statuses {statuses:?}"
                    ),
                    log_tail: cluster.logs(0, 30).await,
                });
            }
            sleep(Duration::from_millis(200)).await;
        }
        Ok(cluster)
    }

    /// The number of client networks.
    pub fn clients(&self) -> usize {
        self.d.clients.len()
    }

    /// The container name of member `i` (0, 1 or 2; etcd name `m{i + 1}`).
    pub fn container(&self, i: usize) -> &str {
        &self.d.containers[i]
    }

    /// Member `i`'s client port on the host's loopback, `127.0.0.1:PORT`.
    pub fn endpoint(&self, i: usize) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.host_ports[i]))
    }

    /// `etcd://` with every member's loopback endpoint, e.g.
    /// `etcd://127.0.0.1:40001,127.0.0.1:40002,127.0.0.1:40003`.
    pub fn url(&self) -> String {
        let endpoints: Vec<String> = (0..CLUSTER_SIZE)
            .map(|i| self.endpoint(i).to_string())
            .collect();
        format!("etcd://{}", endpoints.join(","))
    }

    /// Member `i`'s client address on client `client`'s network.
    ///
    /// # Panics
    ///
    /// When `client` is not below [`clients`](Self::clients).
    pub fn client_endpoint(&self, client: usize, i: usize) -> SocketAddr {
        SocketAddr::from((self.d.clients[client].node_ip(i), CLIENT_PORT))
    }

    /// Member `i`'s status, or `None` when it does not answer within two seconds.
    async fn status(&self, i: usize) -> Option<EtcdStatus> {
        match timeout(ASK_TIMEOUT, probe::etcd_status(self.endpoint(i))).await {
            Ok(Ok(s)) => Some(s),
            _ => None,
        }
    }

    async fn statuses(&self) -> Vec<Option<EtcdStatus>> {
        let mut all = Vec::with_capacity(CLUSTER_SIZE);
        for i in 0..CLUSTER_SIZE {
            all.push(self.status(i).await);
        }
        all
    }

    /// What member `i` says it is.
    pub async fn state(&self, i: usize) -> MemberState {
        match self.status(i).await {
            None => MemberState::Down,
            Some(s) if s.leader == 0 => MemberState::NoLeader,
            Some(s) if s.leader == s.member => MemberState::Leader,
            Some(_) => MemberState::Follower,
        }
    }

    /// The member that says it is the leader; of two (a partitioned leader that has not
    /// stepped down yet), the one of the later term.
    pub async fn leader(&self) -> Option<usize> {
        Self::leader_of(&self.statuses().await)
    }

    fn leader_of(statuses: &[Option<EtcdStatus>]) -> Option<usize> {
        statuses
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.filter(|s| s.leader != 0 && s.leader == s.member)
                    .map(|s| (i, s.term))
            })
            .max_by_key(|(_, term)| *term)
            .map(|(i, _)| i)
    }

    /// Waits until a leader is followed by a quorum (itself and at least one other member)
    /// and answers a quorum read (etcd's `/health`); returns the leader.
    ///
    /// # Errors
    ///
    /// [`ServerError::Timeout`] when that does not happen `within`.
    pub async fn wait_for_quorum(&self, within: Duration) -> Result<usize, ServerError> {
        let deadline = Instant::now() + within;
        loop {
            let statuses = self.statuses().await;
            if let Some(leader) = Self::leader_of(&statuses) {
                let id = self.member_ids[leader];
                let following = statuses.iter().flatten().filter(|s| s.leader == id).count();
                if following > CLUSTER_SIZE / 2 && self.healthy(leader).await {
                    return Ok(leader);
                }
            }
            if Instant::now() >= deadline {
                return Err(ServerError::Timeout {
                    kind: KIND,
                    operation: "a leader with a quorum".to_owned(),
                    within,
                    state: format!("statuses {statuses:?}"),
                });
            }
            sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether member `i` answers `/health` with `true` (it has a leader and a quorum read
    /// through it succeeds).
    async fn healthy(&self, i: usize) -> bool {
        matches!(
            timeout(ASK_TIMEOUT, probe::etcd_health(self.endpoint(i))).await,
            Ok(Ok(()))
        )
    }

    /// Waits until member `i` serves: it has a leader and a quorum read through it succeeds.
    ///
    /// # Errors
    ///
    /// [`ServerError::Timeout`] when it does not `within`.
    pub async fn wait_serving(&self, i: usize, within: Duration) -> Result<(), ServerError> {
        let deadline = Instant::now() + within;
        loop {
            if self.healthy(i).await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(ServerError::Timeout {
                    kind: KIND,
                    operation: format!("member m{} ({}) serving", i + 1, self.d.containers[i]),
                    within,
                    state: format!("{:?}", self.state(i).await),
                });
            }
            sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills member `i` with SIGKILL (a crash). Its data directory stays;
    /// [`start_member`](Self::start_member) brings it back.
    ///
    /// # Errors
    ///
    /// [`ServerError::Io`] when `docker kill` fails.
    pub async fn kill(&self, i: usize) -> Result<(), ServerError> {
        self.d.kill(i).await
    }

    /// Stops member `i` gracefully (SIGTERM, then SIGKILL after 10 s).
    ///
    /// # Errors
    ///
    /// [`ServerError::Io`] when `docker stop` fails.
    pub async fn stop(&self, i: usize) -> Result<(), ServerError> {
        self.d.stop(i).await
    }

    /// Starts a stopped or killed member `i` again (same data directory, same addresses,
    /// same host port) and waits until it serves.
    ///
    /// # Errors
    ///
    /// [`ServerError::Io`] when `docker start` fails, [`ServerError::Timeout`] when the
    /// member does not serve within two minutes.
    pub async fn start_member(&self, i: usize) -> Result<(), ServerError> {
        self.d.start(i).await?;
        self.wait_serving(i, STARTUP).await
    }

    /// Restarts member `i` (a graceful stop, then a start on its data directory) and waits
    /// until it serves.
    ///
    /// # Errors
    ///
    /// As [`stop`](Self::stop) and [`start_member`](Self::start_member).
    pub async fn restart(&self, i: usize) -> Result<(), ServerError> {
        self.stop(i).await?;
        self.start_member(i).await
    }

    /// Partitions member `i` from the other members: disconnects it from the peers network.
    /// Its clients still reach it (on the control and client networks); without a quorum
    /// it serves no quorum read and forwards no lease renewal.
    ///
    /// # Errors
    ///
    /// [`ServerError::Io`] when `docker network disconnect` fails.
    pub async fn partition(&self, i: usize) -> Result<(), ServerError> {
        self.d.partition(i).await
    }

    /// Undoes [`partition`](Self::partition): connects member `i` to the peers network
    /// again, at its address. [`wait_serving`](Self::wait_serving) waits for it to catch up.
    ///
    /// # Errors
    ///
    /// [`ServerError::Io`] when `docker network connect` fails.
    pub async fn heal(&self, i: usize) -> Result<(), ServerError> {
        self.d.heal(i).await
    }

    /// Cuts client `client` off from every member: disconnects the members from that
    /// client's network. The other clients and the quorum are not touched.
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

    /// The last `lines` lines of member `i`'s log.
    pub async fn logs(&self, i: usize, lines: usize) -> String {
        self.d.logs(i, lines).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_advertise_their_peers_address() {
        let peers = Net {
            name: "p".into(),
            base: Ipv4Addr::new(172, 20, 0, 0),
        };
        let control = Net {
            name: "c".into(),
            base: Ipv4Addr::new(172, 21, 0, 0),
        };
        let args = member_args("simba-etcd-1-0", &peers, &control, 1).join(" ");
        assert!(args.contains("--name m2 "), "{args}");
        assert!(
            args.contains("--initial-advertise-peer-urls http://172.20.0.12:2380 "),
            "{args}"
        );
        assert!(
            args.contains(
                "--initial-cluster m1=http://172.20.0.11:2380,m2=http://172.20.0.12:2380,\
                 m3=http://172.20.0.13:2380 "
            ),
            "{args}"
        );
        assert!(
            args.contains("--initial-cluster-token simba-etcd-1-0 "),
            "{args}"
        );
    }

    #[test]
    fn the_leader_of_the_later_term_wins() {
        let s = |member, leader, term| {
            Some(EtcdStatus {
                member,
                leader,
                term,
            })
        };
        // A partitioned old leader (term 2) and the new one (term 3).
        let statuses = [s(1, 1, 2), s(2, 3, 3), s(3, 3, 3)];
        assert_eq!(EtcdCluster::leader_of(&statuses), Some(2));
        assert_eq!(
            EtcdCluster::leader_of(&[None, s(2, 0, 4), s(3, 1, 4)]),
            None
        );
    }
}
