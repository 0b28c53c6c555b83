//! The faults shared by the deployments in containers (feature `containers`): the
//! ZooKeeper ensemble and the etcd cluster kill their leader and partition a node the
//! same way, through [`Nodes`].

use std::future::Future;
use std::time::Duration;

use tokio::time::{Instant, sleep};
use tracing::info;

use crate::servers::{EtcdCluster, MemberState, ServerError, ZkEnsemble};

/// How long a deployment may take to have a quorum again, or a node to serve again.
pub(super) const RECOVERY: Duration = Duration::from_secs(60);

/// The operations of a three-node deployment in containers that the shared faults use.
pub(super) trait Nodes: Sync {
    /// The node that says it leads, if one does.
    fn leader(&self) -> impl Future<Output = Option<usize>> + Send;
    /// SIGKILL of node `i`'s container (its data stays).
    fn kill(&self, i: usize) -> impl Future<Output = Result<(), ServerError>> + Send;
    /// Starts node `i` again and waits until it serves.
    fn start_node(&self, i: usize) -> impl Future<Output = Result<(), ServerError>> + Send;
    /// Waits for a leader with a quorum; returns the leader.
    fn wait_for_quorum(
        &self,
        within: Duration,
    ) -> impl Future<Output = Result<usize, ServerError>> + Send;
    /// Waits until node `i` serves.
    fn wait_serving(
        &self,
        i: usize,
        within: Duration,
    ) -> impl Future<Output = Result<(), ServerError>> + Send;
    /// Disconnects node `i` from the other nodes.
    fn partition(&self, i: usize) -> impl Future<Output = Result<(), ServerError>> + Send;
    /// Connects node `i` to the other nodes again.
    fn heal(&self, i: usize) -> impl Future<Output = Result<(), ServerError>> + Send;
}

impl Nodes for ZkEnsemble {
    async fn leader(&self) -> Option<usize> {
        ZkEnsemble::leader(self).await
    }
    async fn kill(&self, i: usize) -> Result<(), ServerError> {
        ZkEnsemble::kill(self, i).await
    }
    async fn start_node(&self, i: usize) -> Result<(), ServerError> {
        ZkEnsemble::start_node(self, i).await
    }
    async fn wait_for_quorum(&self, within: Duration) -> Result<usize, ServerError> {
        ZkEnsemble::wait_for_quorum(self, within).await
    }
    async fn wait_serving(&self, i: usize, within: Duration) -> Result<(), ServerError> {
        ZkEnsemble::wait_serving(self, i, within).await
    }
    async fn partition(&self, i: usize) -> Result<(), ServerError> {
        ZkEnsemble::partition(self, i).await
    }
    async fn heal(&self, i: usize) -> Result<(), ServerError> {
        ZkEnsemble::heal(self, i).await
    }
}

impl Nodes for EtcdCluster {
    async fn leader(&self) -> Option<usize> {
        EtcdCluster::leader(self).await
    }
    async fn kill(&self, i: usize) -> Result<(), ServerError> {
        EtcdCluster::kill(self, i).await
    }
    async fn start_node(&self, i: usize) -> Result<(), ServerError> {
        EtcdCluster::start_member(self, i).await
    }
    async fn wait_for_quorum(&self, within: Duration) -> Result<usize, ServerError> {
        EtcdCluster::wait_for_quorum(self, within).await
    }
    async fn wait_serving(&self, i: usize, within: Duration) -> Result<(), ServerError> {
        EtcdCluster::wait_serving(self, i, within).await
    }
    async fn partition(&self, i: usize) -> Result<(), ServerError> {
        EtcdCluster::partition(self, i).await
    }
    async fn heal(&self, i: usize) -> Result<(), ServerError> {
        EtcdCluster::heal(self, i).await
    }
}

/// Kills the leader, waits for the others to elect a new one, keeps it down for `down`
/// (sessions or leases are kept or end meanwhile) and starts it again. Returns whether
/// there was a leader to kill. The node is started again also when no new leader came.
pub(super) async fn leader_kill(nodes: &impl Nodes, down: Duration) -> Result<bool, ServerError> {
    let Some(leader) = nodes.leader().await else {
        return Ok(false);
    };
    nodes.kill(leader).await?;
    let t = Instant::now();
    let elected = nodes.wait_for_quorum(RECOVERY).await;
    if let Ok(new) = &elected {
        info!(killed = leader + 1, leader = new + 1, after = ?t.elapsed(), "new leader");
    }
    sleep(down).await;
    nodes.start_node(leader).await?;
    elected?;
    Ok(true)
}

/// Partitions node `i` from the others for `cut`, heals it and waits until it serves
/// again.
pub(super) async fn partition_for(
    nodes: &impl Nodes,
    i: usize,
    cut: Duration,
) -> Result<(), ServerError> {
    nodes.partition(i).await?;
    sleep(cut).await;
    nodes.heal(i).await?;
    nodes.wait_serving(i, RECOVERY).await
}

/// The etcd cluster's own faults. `owners_member` is the member the owner talks to;
/// `turn` counts this kind's injections, to alternate the targets.
pub(super) async fn etcd_member_fault(
    cluster: &EtcdCluster,
    partition: bool,
    owners_member: usize,
    turn: usize,
    lease: Duration,
) -> Result<bool, ServerError> {
    let mut states = Vec::new();
    for i in 0..crate::servers::CLUSTER_SIZE {
        states.push(cluster.state(i).await);
    }
    let leader = cluster.leader().await;
    let owners_turn = turn.is_multiple_of(2);
    let node = if owners_turn {
        owners_member
    } else if partition {
        // A follower that is not the owner's member (the owner then keeps its member,
        // which keeps its quorum).
        match (0..states.len()).find(|&i| i != owners_member && states[i] == MemberState::Follower)
        {
            Some(i) => i,
            None => return Ok(false),
        }
    } else {
        match leader {
            Some(l) => l,
            None => return Ok(false),
        }
    };
    info!(
        member = node + 1,
        owners_member = owners_member + 1,
        leader = ?leader.map(|l| l + 1),
        partition,
        "member fault"
    );
    if partition {
        // Past the lease: the owner on a cut-off member must have let go, and the leader
        // ended its lease, by the time the member is back.
        partition_for(cluster, node, lease + Duration::from_secs(1)).await?;
    } else {
        cluster.restart(node).await?;
    }
    Ok(true)
}
