//! Short fault-injection safety runs, one per backend: contender processes
//! (`simba-chaos contender`) write to a fenced resource while owners are killed and paused, the
//! server restarts and connections are cut, delayed and partitioned. No two ownerships may
//! overlap and no stale write may be accepted; the semaphore runs (3 permits, 6 contenders)
//! allow 3 holders at once and no more; the read-write lock runs allow readers side by side
//! and never a writer beside anyone. Time is the subject here (leases of 1.5 s),
//! so each run lasts 30 s; the long runs are in docs/safety.md.

use std::time::Duration;

use simba_test_kit::chaos::{ChaosBackend, ChaosConfig, FaultKind, run};

fn config(backend: ChaosBackend) -> ChaosConfig {
    let mut cfg = ChaosConfig::new(
        backend,
        env!("CARGO_BIN_EXE_simba-chaos"),
        vec!["contender".into()],
    );
    cfg.duration = Duration::from_secs(30);
    cfg.fault_every = Duration::from_secs(1);
    cfg.min_handoffs = 5;
    if backend == ChaosBackend::Sqlite {
        // No server and no connection to fault: only the processes can be.
        cfg.faults = vec![FaultKind::Kill, FaultKind::Pause];
    }
    cfg
}

async fn check(cfg: ChaosConfig) {
    let summary = run(&cfg).await.expect("the chaos run could be made");
    println!("{summary}");
    for tail in &summary.log_tails {
        println!("{tail}");
    }
    assert!(summary.passed(), "{:?}: {summary}", cfg.backend);
    assert!(summary.faults >= 5, "too few faults injected: {summary}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_redis() {
    check(config(ChaosBackend::Redis)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_mysql() {
    check(config(ChaosBackend::Mysql)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_postgres() {
    check(config(ChaosBackend::Postgres)).await;
}

/// PostgreSQL behind PgBouncer in transaction mode (`simba_pooler=transaction`): the
/// PostgreSQL faults, and PgBouncer killed, paused and restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_postgres_pgbouncer() {
    check(config(ChaosBackend::PostgresPgbouncer)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_sqlite() {
    check(config(ChaosBackend::Sqlite)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_zookeeper() {
    check(config(ChaosBackend::Zookeeper)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_etcd() {
    check(config(ChaosBackend::Etcd)).await;
}

/// Redis Cluster (three primaries with a replica each, `replicaAcks=1`): the primary of
/// the mutex's slot is failed over again and again (so the second failover promotes the
/// first primary back), between kills, pauses and cuts of the owner. 30 s of faults after
/// the cluster starts; the nextest filter `chaos` runs it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_redis_cluster_failover() {
    let mut cfg = config(ChaosBackend::RedisCluster);
    cfg.faults = vec![
        FaultKind::Failover,
        FaultKind::Kill,
        FaultKind::Pause,
        FaultKind::Cut,
    ];
    let summary = run(&cfg).await.expect("the chaos run could be made");
    println!("{summary}");
    for tail in &summary.log_tails {
        println!("{tail}");
    }
    assert!(summary.passed(), "{summary}");
    assert!(summary.fault_errors.is_empty(), "{summary}");
    let failovers = summary
        .faults_by_kind
        .iter()
        .find(|(k, _)| *k == FaultKind::Failover)
        .map_or(0, |(_, n)| *n);
    assert!(failovers >= 2, "fewer than two failovers: {summary}");
}

/// The checker and the fenced resource catch contenders that ignore their local deadline
/// (as a library without one would) when an owner is paused past its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_catches_contenders_without_a_local_deadline() {
    let mut cfg = config(ChaosBackend::Sqlite);
    cfg.faults = vec![FaultKind::Pause];
    cfg.duration = Duration::from_secs(10);
    cfg.unsafe_contenders = true;
    let summary = run(&cfg).await.expect("the chaos run could be made");
    println!("{summary}");
    assert!(
        summary.overlaps() > 0,
        "pauses of an unsafe owner went unnoticed: {summary}"
    );
    assert!(!summary.passed());
}

/// A semaphore of 3 permits, 6 contender processes: never more than 3 holders believing
/// at once, no stale write accepted, under the same faults as the mutex (kill, pause,
/// restart with Redis's data wiped, cut, delay, partition of one holder).
fn semaphore_config(backend: ChaosBackend) -> ChaosConfig {
    let mut cfg = config(backend);
    cfg.permits = Some(3);
    cfg.contenders = 6;
    cfg
}

/// The checks of a semaphore run: it passed (no excess, no fence violation, no stale
/// write accepted), at least 5 faults came, and at least 100 acquisitions.
async fn check_semaphore(cfg: ChaosConfig) {
    let summary = run(&cfg).await.expect("the chaos run could be made");
    println!("{summary}");
    for tail in &summary.log_tails {
        println!("{tail}");
    }
    assert!(summary.passed(), "{:?}: {summary}", cfg.backend);
    assert_eq!(summary.over_capacity(), 0, "{summary}");
    assert!(summary.faults >= 5, "too few faults injected: {summary}");
    assert!(
        summary.report.ownerships >= 100,
        "too few acquisitions to mean anything: {summary}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_semaphore_redis() {
    check_semaphore(semaphore_config(ChaosBackend::Redis)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_semaphore_zookeeper() {
    check_semaphore(semaphore_config(ChaosBackend::Zookeeper)).await;
}

/// The semaphore checker catches holders that ignore their local deadline: paused past
/// their lease, they write on beside the three that hold the permits since. Holds of
/// 150-300 ms keep the permits busy: with the usual 5-45 ms a slow run (340 acquisitions
/// in 15 s) had each permit idle most of the time, and three pauses met no moment with
/// all three permits held beside the paused one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_semaphore_catches_contenders_without_a_local_deadline() {
    let mut cfg = semaphore_config(ChaosBackend::Redis);
    cfg.faults = vec![FaultKind::Pause];
    cfg.duration = Duration::from_secs(15);
    cfg.unsafe_contenders = true;
    cfg.hold_ms = 150..300;
    let summary = run(&cfg).await.expect("the chaos run could be made");
    println!("{summary}");
    assert!(
        summary.over_capacity() > 0,
        "pauses of an unsafe holder went unnoticed: {summary}"
    );
    assert!(!summary.passed());
}

/// A read-write lock on SQLite, 6 contender processes reading three times in four, owners
/// killed and paused: never a writer beside another holder, writers' fences increasing,
/// no reader below a writer before it, no stale write accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_rwlock_sqlite() {
    let mut cfg = config(ChaosBackend::Sqlite);
    cfg.rwlock = true;
    cfg.contenders = 6;
    let summary = run(&cfg).await.expect("the chaos run could be made");
    println!("{summary}");
    for tail in &summary.log_tails {
        println!("{tail}");
    }
    assert!(summary.passed(), "{summary}");
    assert_eq!(summary.rw_violations(), 0, "{summary}");
    assert!(summary.faults >= 5, "too few faults injected: {summary}");
    let reads = summary.report.read_ownerships;
    let writes = summary.report.ownerships - reads;
    // Both kinds, enough of each to mean something (a slow run still makes hundreds).
    assert!(
        reads >= 50 && writes >= 10,
        "too few reads or writes: {summary}"
    );
    let last = summary.to_string();
    let last = last.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("rw reads=") && last.contains(" rw_violations=0 "),
        "{last}"
    );
}

/// The RW checker catches writers that do not wait for the readers (they take the lock's
/// gate only, as a read-write lock without its drain would), with no fault at all: a
/// reader lets the gate go as soon as it holds its permit, so the next writer comes in
/// beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_rwlock_catches_writers_that_do_not_wait_for_readers() {
    let mut cfg = config(ChaosBackend::Sqlite);
    cfg.rwlock = true;
    cfg.contenders = 6;
    cfg.faults = Vec::new();
    cfg.crashes = false;
    // Long enough holds that a reader is still reading when the next writer comes in.
    cfg.hold_ms = 100..200;
    cfg.duration = Duration::from_secs(10);
    cfg.unsafe_contenders = true;
    let summary = run(&cfg).await.expect("the chaos run could be made");
    println!("{summary}");
    assert!(
        summary.rw_violations() > 0,
        "writers beside readers went unnoticed: {summary}"
    );
    assert!(!summary.passed());
}
