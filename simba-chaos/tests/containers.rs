//! The `zookeeper-ensemble` chaos target (feature `containers`): a short round against a
//! three-node ZooKeeper ensemble in containers, with all five of its faults — the leader
//! killed, a follower partitioned from the others, the owner partitioned from the ensemble
//! (Docker networks, not the proxy), and the owner killed and paused. No two ownerships may
//! overlap and no stale write may be accepted, whatever ZooKeeper decides about the owner's
//! session. Time is the subject (sessions of 2 s), so the round lasts 60 s; the long run is
//! in docs/safety.md. The ensemble's containers and networks must be gone afterwards. The
//! second test makes the follower partition deterministic: an owner on a cut-off follower
//! must not outlive its session (the case of the failed long run in docs/safety.md).
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
    let mut cfg = ChaosConfig::new(
        ChaosBackend::ZookeeperEnsemble,
        env!("CARGO_BIN_EXE_simba-chaos"),
        vec!["contender".into()],
    );
    cfg.duration = Duration::from_secs(60);
    cfg.fault_every = Duration::from_secs(1);
    cfg.min_handoffs = 5;
    cfg.faults = vec![
        FaultKind::LeaderKill,
        FaultKind::FollowerPartition,
        FaultKind::ContenderPartition,
        FaultKind::Kill,
        FaultKind::Pause,
    ];
    let result = run(&cfg).await;
    // Whatever the outcome, the ensemble is gone once the run returned.
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
    for kind in [
        FaultKind::LeaderKill,
        FaultKind::FollowerPartition,
        FaultKind::ContenderPartition,
        FaultKind::Kill,
        FaultKind::Pause,
    ] {
        assert!(
            summary
                .faults_by_kind
                .iter()
                .any(|(k, n)| *k == kind && *n > 0),
            "{kind:?} was never injected: {summary}"
        );
    }
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
    use tokio::time::{Instant, timeout};

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
    let a_guard = a.acquire().await.expect("a acquires");
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
    assert!(a_guard.is_held(), "a owns before the cut");
    let cut = Instant::now();
    ens.partition(follower).await.expect("partition");
    let (b_acquired, a_lost) = tokio::join!(
        timeout(Duration::from_secs(30), b_acquire),
        timeout(Duration::from_secs(30), a_loss)
    );
    let (b_guard, b_at, a_believes, a_valid_for) =
        b_acquired.expect("b did not acquire within 30 s of the cut");
    let (a_reason, a_lost_at) = a_lost.expect("a did not see its loss within 30 s of the cut");
    println!(
        "a lost ({a_reason:?}) {:?} after the cut; b acquired {:?} after the cut; a then \
         believed {a_believes} (valid for {a_valid_for:?})",
        a_lost_at - cut,
        b_at - cut
    );
    assert!(
        !a_believes && a_lost_at <= b_at,
        "a still believed it owned (for {a_valid_for:?} more) when b acquired, {:?} after \
         the follower was cut off",
        b_at - cut
    );
    assert!(b_guard.fence() > a_guard.fence());
    ens.heal(follower).await.expect("heal");
}
