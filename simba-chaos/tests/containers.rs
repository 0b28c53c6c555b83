//! The chaos targets in containers (feature `containers`), ZooKeeper's and etcd's.
//!
//! The `zookeeper-ensemble` chaos target: a short round against a
//! three-node ZooKeeper ensemble in containers, with all five of its faults — the leader
//! killed, a follower partitioned from the others, the owner partitioned from the ensemble
//! (Docker networks, not the proxy), and the owner killed and paused. No two ownerships may
//! overlap and no stale write may be accepted, whatever ZooKeeper decides about the owner's
//! session. Time is the subject (sessions of 2 s), so the round lasts 60 s; the long run is
//! in docs/safety.md. The ensemble's containers and networks must be gone afterwards. The
//! second test makes the follower partition deterministic: an owner on a cut-off follower
//! must not outlive its session (the case of the failed long run in docs/safety.md).
//!
//! The `etcd-cluster` target the same way: a short round with its five faults (the leader
//! killed, a member partitioned, a member restarted, the owner killed and paused), then
//! two deterministic cases — the leader killed under its owner's feet, and the owner's
//! member partitioned from the others.
//!
//! Needs a Docker engine on this host and the kit's images (`scripts/containers.sh build`);
//! `scripts/containers.sh test` runs it.
#![cfg(feature = "containers")]

use std::time::Duration;

use simba_test_kit::chaos::{ChaosBackend, ChaosConfig, FaultKind, run};

/// What the engine holds with this test process's label (`ps -a` or `network ls`).
fn labelled(what: &[&str], format: &str) -> Vec<String> {
    let pid = format!("label=simba.test.pid={}", std::process::id());
    let output = std::process::Command::new("docker")
        .args(what)
        .args(["--filter", &pid, "--format", format])
        .output()
        .expect("the docker command runs");
    assert!(output.status.success(), "docker {what:?}: {output:?}");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_zookeeper_ensemble() {
    chaos_round(
        ChaosBackend::ZookeeperEnsemble,
        vec![
            FaultKind::LeaderKill,
            FaultKind::FollowerPartition,
            FaultKind::ContenderPartition,
            FaultKind::Kill,
            FaultKind::Pause,
        ],
    )
    .await;
}

/// The follower-partition case of the ensemble, made deterministic: owner `a` talks only
/// to a follower, contender `b` only to the leader. The follower is cut off from the other
/// nodes while `a` owns. The leader stops hearing of `a`'s session and expires it, and `b`
/// takes over; the cut-off follower may still answer `a`'s reads for a while (until it
/// notices it lost the leader, syncLimit × tickTime). `a` must have stopped believing it
/// owns by the time `b` acquired. Time is the subject: sessions of 4 s, and `b` is given
/// 30 s (several session timeouts plus an election's worth of slack on a loaded machine).
/// The name puts it in nextest's `serial-faults` group (one such test at a time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_owner_on_a_partitioned_follower_stops_before_the_next_owner() {
    use std::sync::Arc;

    use simba_core::{ContendServiceFactory, Locker};
    use simba_test_kit::servers::{ENSEMBLE_SIZE, ZkEnsemble};
    use simba_zookeeper::{ZkConfig, ZkFactory};
    use tokio::time::timeout;

    let ens = timeout(Duration::from_secs(180), ZkEnsemble::start(2))
        .await
        .expect("no ensemble within 180 s")
        .unwrap_or_else(|e| panic!("ensemble: {e}"));
    let leader = ens
        .wait_for_quorum(Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let follower = (0..ENSEMBLE_SIZE)
        .find(|&i| i != leader)
        .expect("a node that is not the leader");
    let node = |client: usize, i: usize| -> String {
        ens.connect_string(client)
            .split(',')
            .nth(i)
            .expect("a node address")
            .to_owned()
    };
    let session = Duration::from_secs(4);
    let factory = |connect: String| async move {
        let config = ZkConfig::new(connect).with_session_timeout(session);
        let f: Arc<dyn ContendServiceFactory> =
            Arc::new(ZkFactory::connect(config).await.expect("connect"));
        f
    };
    let a = Locker::new(factory(node(0, follower)).await, "cut").expect("locker a");
    let b = Locker::new(factory(node(1, leader)).await, "cut").expect("locker b");
    let _b_guard = handover_after(
        &a,
        &b,
        async { ens.partition(follower).await.expect("partition") },
        "the follower's partition",
    )
    .await;
    ens.heal(follower).await.expect("heal");
}

/// Runs a 60 s chaos round on `backend` with `faults` (one every second, at least 5
/// handoffs) and checks what every round must show: the deployment is gone afterwards, it
/// passed (no overlap, no accepted stale write, enough handoffs), and every fault kind was
/// injected at least once.
async fn chaos_round(backend: ChaosBackend, faults: Vec<FaultKind>) {
    let mut cfg = ChaosConfig::new(
        backend,
        env!("CARGO_BIN_EXE_simba-chaos"),
        vec!["contender".into()],
    );
    cfg.duration = Duration::from_secs(60);
    cfg.fault_every = Duration::from_secs(1);
    cfg.min_handoffs = 5;
    cfg.faults = faults;
    let result = run(&cfg).await;
    // Whatever the outcome, the deployment is gone once the run returned.
    assert_eq!(labelled(&["ps", "-a"], "{{.Names}}"), Vec::<String>::new());
    assert_eq!(
        labelled(&["network", "ls"], "{{.Name}}"),
        Vec::<String>::new()
    );
    let summary = result.expect("the chaos run could be made");
    println!("{summary}");
    for tail in &summary.log_tails {
        println!("{tail}");
    }
    assert!(summary.passed(), "{summary}");
    assert_eq!(summary.overlaps(), 0, "{summary}");
    assert_eq!(summary.report.stale_writes_accepted, 0, "{summary}");
    for kind in &cfg.faults {
        assert!(
            summary
                .faults_by_kind
                .iter()
                .any(|(k, n)| k == kind && *n > 0),
            "{kind:?} was never injected: {summary}"
        );
    }
}

/// The `etcd-cluster` round: 60 s with a fault every second. One turn of the five kinds
/// takes about 25 s on an idle machine (a leader kill is the longest: an election, the lease
/// of 2 s, a container start and a catch-up), and a kind that finds no owner comes back
/// after the next one (the run's fault queue), so each kind has two turns' room to come at
/// least once even when the machine is loaded. Kill and pause, the quick ones, come first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_etcd_cluster() {
    chaos_round(
        ChaosBackend::EtcdCluster,
        vec![
            FaultKind::Kill,
            FaultKind::Pause,
            FaultKind::LeaderKill,
            FaultKind::MemberPartition,
            FaultKind::MemberRestart,
        ],
    )
    .await;
}

/// A three-member etcd cluster with two client networks, its leader, and a member that is
/// not the leader.
async fn etcd_cluster_and_roles() -> (simba_test_kit::servers::EtcdCluster, usize, usize) {
    use simba_test_kit::servers::{CLUSTER_SIZE, EtcdCluster};
    use tokio::time::timeout;

    let cluster = timeout(Duration::from_secs(180), EtcdCluster::start(2))
        .await
        .expect("no cluster within 180 s")
        .unwrap_or_else(|e| panic!("cluster: {e}"));
    let leader = cluster
        .wait_for_quorum(Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let follower = (0..CLUSTER_SIZE)
        .find(|&i| i != leader)
        .expect("a member that is not the leader");
    (cluster, leader, follower)
}

/// An etcd locker on one member of `cluster`, reached on client network `client`, with a
/// lease of 4 s (a keep-alive answer may be late on a loaded machine without the owner
/// losing).
async fn etcd_locker(
    cluster: &simba_test_kit::servers::EtcdCluster,
    client: usize,
    member: usize,
    mutex: &str,
) -> simba_core::Locker {
    use std::sync::Arc;

    use simba_core::{ContendServiceFactory, Locker};
    use simba_etcd::{EtcdConfig, EtcdFactory};

    let endpoint = cluster.client_endpoint(client, member).to_string();
    let config = EtcdConfig::new(&endpoint).with_lease_ttl(Duration::from_secs(4));
    let factory: Arc<dyn ContendServiceFactory> = Arc::new(
        EtcdFactory::connect(config)
            .await
            .unwrap_or_else(|e| panic!("connect to {endpoint}: {e}")),
    );
    Locker::new(factory, mutex).expect("locker")
}

/// `a` owns; the fault is applied; `b` (waiting) must acquire, and at that instant `a` must
/// have stopped believing it owns (its loss seen no later than `b`'s acquisition), with a
/// greater fence. Returns `b`'s guard. `b` is given 30 s: several leases plus an election's
/// worth of slack on a loaded machine.
async fn handover_after<F: std::future::Future<Output = ()>>(
    a: &simba_core::Locker,
    b: &simba_core::Locker,
    fault: F,
    what: &str,
) -> simba_core::LockGuard {
    use tokio::time::{Instant, timeout};

    let a_guard = timeout(Duration::from_secs(30), a.acquire())
        .await
        .expect("a acquires within 30 s")
        .expect("a acquires");
    let b_acquire = async {
        let guard = b.acquire().await.expect("b acquires");
        // Read a's belief at the instant b owns, before anything else runs here.
        let a_believes = a_guard.is_held();
        (guard, Instant::now(), a_believes, a_guard.valid_for())
    };
    let a_loss = async {
        let reason = a_guard.lost().await;
        (reason, Instant::now())
    };
    assert!(a_guard.is_held(), "a owns before the fault");
    let at = Instant::now();
    fault.await;
    let (b_acquired, a_lost) = tokio::join!(
        timeout(Duration::from_secs(30), b_acquire),
        timeout(Duration::from_secs(30), a_loss)
    );
    let (b_guard, b_at, a_believes, a_valid_for) =
        b_acquired.unwrap_or_else(|_| panic!("b did not acquire within 30 s of {what}"));
    let (a_reason, a_lost_at) =
        a_lost.unwrap_or_else(|_| panic!("a did not see its loss within 30 s of {what}"));
    println!(
        "{what}: a lost ({a_reason:?}) {:?} after; b acquired {:?} after; a then believed \
         {a_believes} (valid for {a_valid_for:?}); fences {} then {}",
        a_lost_at - at,
        b_at - at,
        a_guard.fence(),
        b_guard.fence()
    );
    assert!(
        !a_believes && a_lost_at <= b_at,
        "a still believed it owned (for {a_valid_for:?} more) when b acquired, {:?} after {what}",
        b_at - at
    );
    assert!(b_guard.fence() > a_guard.fence(), "fences must increase");
    b_guard
}

/// The leader killed while the owner talks to it: `a` talks only to the leader, `b` only to
/// a follower. The leader's container is killed while `a` owns: `a` can renew nowhere, so
/// it must have let go by the time `b` owns (the new leader ends `a`'s lease no earlier than
/// a full TTL after its election). Then the killed member is started again (its data kept)
/// and `a` owns again after `b` releases, with a fence greater still: the fences increase
/// across the leader change and the restart. The name puts it in nextest's `serial-faults`
/// group (one such test at a time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_leader_kill_and_restart_hands_over_with_increasing_fences() {
    use tokio::time::timeout;

    let (cluster, leader, follower) = etcd_cluster_and_roles().await;
    let a = etcd_locker(&cluster, 0, leader, "leader-kill").await;
    let b = etcd_locker(&cluster, 1, follower, "leader-kill").await;
    let b_guard = handover_after(
        &a,
        &b,
        async { cluster.kill(leader).await.expect("kill the leader") },
        "the leader's kill",
    )
    .await;
    let new = cluster
        .wait_for_quorum(Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(new, leader);
    cluster.start_member(leader).await.expect("restart");
    let b_fence = b_guard.fence();
    b_guard.release().await.expect("b releases");
    let a_again = timeout(Duration::from_secs(30), a.acquire())
        .await
        .expect("a owns again within 30 s of b's release")
        .expect("a acquires");
    assert!(a_again.fence() > b_fence, "fences must increase");
    a_again.release().await.expect("a releases");
}

/// The owner's member partitioned from the others: `a` talks only to a follower, `b` only
/// to the leader. The follower is cut off from the other members while `a` owns: it can no
/// longer forward `a`'s keep-alives to the leader, the leader ends `a`'s lease a TTL after
/// its last renewal, and `b` takes over. `a` must have stopped believing it owns by then.
/// The name puts it in nextest's `serial-faults` group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_owner_on_a_partitioned_member_stops_before_the_next_owner() {
    let (cluster, leader, follower) = etcd_cluster_and_roles().await;
    let a = etcd_locker(&cluster, 0, follower, "member-partition").await;
    let b = etcd_locker(&cluster, 1, leader, "member-partition").await;
    let b_guard = handover_after(
        &a,
        &b,
        async { cluster.partition(follower).await.expect("partition") },
        "the owner's member's partition",
    )
    .await;
    cluster.heal(follower).await.expect("heal");
    b_guard.release().await.expect("b releases");
}
