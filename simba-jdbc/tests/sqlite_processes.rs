//! Two OS processes contending for one mutex in one SQLite file never both own it.
//!
//! The test re-runs its own binary twice (`std::env::current_exe()`) with [`CHILD_ENV`]
//! set; in those children, [`child_contender`] runs contenders that acquire, hold for a
//! random while (sometimes across several renewals) and release, recording every
//! ownership interval they believed in with this machine's wall clock. The parent then
//! checks that no two intervals of different ownerships overlap and that fences increase.
#![allow(missing_docs)]
#![cfg(feature = "sqlite")]

use std::io::Write;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use simba_core::{
    ContendService, Contender, LeaseConfig, LeaseServiceFactory, LossReason, MutexState,
};
use simba_jdbc::{SqlConfig, SqlStore};

/// Set in the children: `URL|TABLE|OUTPUT FILE|RUN MS|LABEL`.
const CHILD_ENV: &str = "SIMBA_JDBC_SQLITE_CHILD";
const MUTEX: &str = "two-processes";
/// Contenders (each with its own store and pool) per child process.
const PER_PROCESS: usize = 2;
const RUN: Duration = Duration::from_secs(6);

fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or(0)
}

/// A cheap pseudo-random number (xorshift), seeded per contender.
struct Rng(u64);

impl Rng {
    fn next(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % below.max(1)
    }
}

#[derive(Debug, Clone)]
struct Interval {
    who: String,
    fence: u64,
    start: u128,
    end: Option<u128>,
}

/// Records ownership intervals as the engine reports them.
struct Recorder {
    id: String,
    log: Arc<Mutex<Vec<Interval>>>,
}

impl Contender for Recorder {
    fn contender_id(&self) -> Option<String> {
        Some(self.id.clone())
    }

    fn on_acquired(&self, state: &MutexState) {
        let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        log.push(Interval {
            who: self.id.clone(),
            fence: state.after.fence,
            start: now_us(),
            end: None,
        });
    }

    fn on_released(&self, _state: &MutexState, _reason: LossReason) {
        let end = now_us();
        let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(iv) = log
            .iter_mut()
            .rev()
            .find(|iv| iv.who == self.id && iv.end.is_none())
        {
            iv.end = Some(end);
        }
    }
}

fn lease_config() -> LeaseConfig {
    LeaseConfig {
        request_timeout: Duration::from_secs(1),
        retry_interval: Duration::from_millis(50),
        drift_margin: Duration::from_millis(50),
        // Short polls so that handoffs (by poll: SQLite does not push) happen often.
        jitter: 0..100,
        jitter_no_transition: 0..100,
        ..LeaseConfig::with_lease(Duration::from_millis(300), Duration::from_millis(200))
    }
}

async fn run_contender(
    url: String,
    table: String,
    id: String,
    log: Arc<Mutex<Vec<Interval>>>,
    until: tokio::time::Instant,
) {
    let store = SqlStore::connect(SqlConfig::new(&url).with_table(&table))
        .await
        .expect("child connects");
    let factory = LeaseServiceFactory::new(store, lease_config()).expect("factory");
    let seed = id.bytes().fold(u64::from(std::process::id()), |h, b| {
        h.wrapping_mul(31).wrapping_add(u64::from(b))
    });
    let mut rng = Rng(seed | 1);
    let recorder = Arc::new(Recorder { id, log });
    while tokio::time::Instant::now() < until {
        let svc = factory
            .contend_service(MUTEX, recorder.clone())
            .expect("service");
        svc.start().expect("start");
        let mut status = svc.status();
        let held = tokio::time::timeout(
            Duration::from_secs(3),
            status.wait_for(|s| s.held.is_some()),
        )
        .await
        .is_ok();
        if held {
            // Up to 2 ttl: some holds span several renewals.
            tokio::time::sleep(Duration::from_millis(rng.next(600))).await;
        }
        svc.stop().await.expect("stop");
        // Waiters poll (SQLite does not push) at the released lease's end plus jitter,
        // at most ttl + transition + 100 ms after its last renewal: pausing longer than
        // that now and then lets the other process win too.
        tokio::time::sleep(Duration::from_millis(rng.next(700))).await;
    }
}

/// The child side; does nothing in a normal test run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_contender() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split('|').collect();
    let [url, table, out, run_ms, label] = parts[..] else {
        panic!("bad {CHILD_ENV}: {spec}");
    };
    let run_ms: u64 = run_ms.parse().expect("run ms");
    let until = tokio::time::Instant::now() + Duration::from_millis(run_ms);
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..PER_PROCESS {
        tasks.push(tokio::spawn(run_contender(
            url.to_owned(),
            table.to_owned(),
            format!("{label}-{i}-{}", std::process::id()),
            log.clone(),
            until,
        )));
    }
    for t in tasks {
        t.await.expect("contender task");
    }
    let log = log.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut f = std::fs::File::create(out).expect("output file");
    for iv in log {
        writeln!(
            f,
            "{} {} {} {}",
            iv.who,
            iv.fence,
            iv.start,
            iv.end.map_or("open".to_owned(), |e| e.to_string())
        )
        .expect("write");
    }
}

fn read_intervals(path: &std::path::Path) -> Vec<Interval> {
    let text = std::fs::read_to_string(path).expect("child output");
    text.lines()
        .map(|line| {
            let f: Vec<&str> = line.split(' ').collect();
            Interval {
                who: f[0].to_owned(),
                fence: f[1].parse().expect("fence"),
                start: f[2].parse().expect("start"),
                end: f[3].parse().ok(),
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_never_both_own() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("shared.db").display());
    let table = "simba_mutex";
    let store = SqlStore::connect(SqlConfig::new(&url))
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    drop(store);

    let exe = std::env::current_exe().expect("test binary");
    let mut children = Vec::new();
    let mut outputs = Vec::new();
    for label in ["p1", "p2"] {
        let out = dir.path().join(format!("{label}.txt"));
        let spec = format!(
            "{url}|{table}|{}|{}|{label}",
            out.display(),
            RUN.as_millis()
        );
        let child = tokio::process::Command::new(&exe)
            .args([
                "--exact",
                "child_contender",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, spec)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn child");
        children.push(child);
        outputs.push(out);
    }
    for child in children {
        // Bounded: a child that hangs fails the test instead of hanging it.
        let out = tokio::time::timeout(RUN + Duration::from_secs(60), child.wait_with_output())
            .await
            .expect("child finished in time")
            .expect("child ran");
        assert!(
            out.status.success(),
            "child failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    let mut all: Vec<Interval> = outputs.iter().flat_map(|p| read_intervals(p)).collect();
    for iv in &all {
        assert!(iv.end.is_some(), "an ownership never ended: {iv:?}");
    }
    all.sort_by_key(|iv| iv.start);
    let by_process = |p: &str| all.iter().filter(|iv| iv.who.starts_with(p)).count();
    assert!(
        by_process("p1") > 0 && by_process("p2") > 0,
        "both processes must have owned at least once: {all:?}"
    );
    assert!(
        all.len() >= 6,
        "too few handoffs to mean anything: {}",
        all.len()
    );
    for (i, a) in all.iter().enumerate() {
        for b in &all[i + 1..] {
            let a_end = a.end.unwrap_or(u128::MAX);
            assert!(
                a_end <= b.start,
                "overlapping ownerships:\n  {a:?}\n  {b:?}"
            );
        }
    }
    for w in all.windows(2) {
        // The same ownership may be reported twice (lost locally, then its renewal came
        // back); any other later ownership has a larger fence.
        let same = w[0].who == w[1].who && w[0].fence == w[1].fence;
        assert!(
            same || w[0].fence < w[1].fence,
            "fences must increase: {:?} then {:?}",
            w[0],
            w[1]
        );
    }
    eprintln!(
        "two processes: {} ownerships, {} by p1, {} by p2, no overlap",
        all.len(),
        by_process("p1"),
        by_process("p2")
    );
}

/// Many mutex names, each acquired by one store while another waits for it, leave one lock
/// file beside the database (Linux: byte-range locks in `{db}-simba.locks`), not a file
/// or two per name.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_mutex_names_leave_one_lock_file() {
    const NAMES: usize = 60;
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("names.db");
    let url = format!("sqlite://{}", db.display());
    let store = SqlStore::connect(SqlConfig::new(&url))
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    let first = LeaseServiceFactory::new(store, lease_config()).expect("factory");
    let second = LeaseServiceFactory::new(
        SqlStore::connect(SqlConfig::new(&url))
            .await
            .expect("connect"),
        lease_config(),
    )
    .expect("factory");
    let log = Arc::new(Mutex::new(Vec::new()));
    for i in 0..NAMES {
        let name = format!("name-{i}");
        let mut turns = Vec::new();
        for (factory, who) in [(&first, "a"), (&second, "b")] {
            let recorder = Arc::new(Recorder {
                id: format!("{who}-{i}"),
                log: log.clone(),
            });
            let svc = factory.contend_service(&name, recorder).expect("service");
            svc.start().expect("start");
            // Each contender gives the mutex up as soon as it holds it: one takes it at
            // once, the other waits (a blocking lock wait) and gets it after.
            turns.push(tokio::spawn(async move {
                let mut status = svc.status();
                let held = status.wait_for(|s| s.held.is_some()).await.is_ok();
                svc.stop().await.expect("stop");
                held
            }));
        }
        for turn in turns {
            // Generous: two acquisitions and releases on a loaded 2-core machine.
            let held = tokio::time::timeout(Duration::from_secs(20), turn)
                .await
                .unwrap_or_else(|_| panic!("a contender never held {name}"))
                .expect("turn task");
            assert!(held, "a contender's status ended before it held {name}");
        }
    }
    let files: Vec<String> = std::fs::read_dir(dir.path())
        .expect("read dir")
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    let extra: Vec<&String> = files
        .iter()
        .filter(|n| !matches!(n.as_str(), "names.db" | "names.db-wal" | "names.db-shm"))
        .collect();
    assert!(
        extra.is_empty(),
        "{NAMES} mutex names left files beside the database: {extra:?} (all: {} files)",
        files.len()
    );
}

/// The native lock is the database file's (its inode), not its path's: two stores that
/// name one database file differently, or a store whose neighbours' lock files an operator
/// deleted, still exclude each other. The first owns with a long lease; the second must
/// not own while it holds (earlier builds took the "gated" row over at once: their lock
/// file, named by the path, was free), and owns soon after the first releases.
mod one_file_by_other_names {
    use super::*;
    use simba_core::Error;
    use simba_core::backend::{Lease, LeaseStore};

    /// Outlasts the test on a loaded machine.
    const LONG: Lease = Lease {
        ttl: Duration::from_secs(60),
        transition: Duration::from_secs(30),
    };

    async fn store(url: &str) -> SqlStore {
        let store = SqlStore::connect(SqlConfig::new(url))
            .await
            .unwrap_or_else(|e| panic!("connect {url}: {e}"));
        store
            .migrate()
            .await
            .unwrap_or_else(|e| panic!("migrate {url}: {e}"));
        store
    }

    /// `first` owns; then `meanwhile` runs (an operator's deed); `second` never owns
    /// while `first` holds, and owns once `first` has released.
    async fn second_waits_for_first(
        label: &str,
        first: &str,
        second: &str,
        meanwhile: impl FnOnce(),
    ) {
        let m = "one-file";
        let a = store(first).await;
        let r = a.acquire(m, "a", LONG).await.expect("acquire a");
        assert!(r.owner.is_owned_by_at("a", r.now), "{label}: {r:?}");
        meanwhile();
        let b = store(second).await;
        // Several tries: each one with B's native lock tried or waited for.
        for _ in 0..3 {
            let r = b.acquire(m, "b", LONG).await.expect("acquire b");
            assert!(
                r.owner.is_owner("a") && !r.owner.is_owner("b"),
                "{label}: the second store took the mutex while the first held it: {r:?}"
            );
        }
        assert!(a.release(m, "a").await.expect("release a"), "{label}");
        // The release frees the native lock; B's wait gets it and B takes the free row.
        let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let r = b.acquire(m, "b", LONG).await.expect("acquire b");
            if r.owner.is_owned_by_at("b", r.now) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < give_up,
                "{label}: the second never owned after the release: {r:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(b.release(m, "b").await.expect("release b"), "{label}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_symlink_to_the_database_shares_its_lock() {
        if std::env::var_os(CHILD_ENV).is_some() {
            return;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("t.db");
        let link = dir.path().join("link.db");
        // The file exists before the link is made to it (the first store creates it).
        let first = format!("sqlite://{}", db.display());
        drop(store(&first).await);
        std::os::unix::fs::symlink(&db, &link).expect("symlink");
        let second = format!("sqlite://{}", link.display());
        second_waits_for_first("symlink", &first, &second, || {}).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_path_through_a_directory_symlink_and_dotdot_shares_the_lock() {
        if std::env::var_os(CHILD_ENV).is_some() {
            return;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let real = dir.path().join("real");
        std::fs::create_dir_all(real.join("sub")).expect("dirs");
        let alias = dir.path().join("alias");
        std::os::unix::fs::symlink(real.join("sub"), &alias).expect("symlink");
        let first = format!("sqlite://{}", real.join("t.db").display());
        // `alias/..` is `real` (the kernel follows the symlink first).
        let second = format!("sqlite://{}/../t.db", alias.display());
        second_waits_for_first("alias/../t.db", &first, &second, || {}).await;
    }

    /// A bind mount of the database's directory (we are root in CI; a machine where the
    /// mount is not permitted fails here, it does not skip).
    #[cfg(target_os = "linux")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bind_mount_of_the_directory_shares_the_lock() {
        if std::env::var_os(CHILD_ENV).is_some() {
            return;
        }
        struct Mounted(std::path::PathBuf);
        impl Drop for Mounted {
            fn drop(&mut self) {
                let _ = std::process::Command::new("umount").arg(&self.0).status();
            }
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let real = dir.path().join("real");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir_all(&real).expect("dir");
        std::fs::create_dir_all(&mnt).expect("dir");
        let out = std::process::Command::new("mount")
            .arg("--bind")
            .arg(&real)
            .arg(&mnt)
            .output()
            .expect("run mount(8)");
        assert!(
            out.status.success(),
            "`mount --bind` failed (this test needs root, or CAP_SYS_ADMIN): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let _mounted = Mounted(mnt.clone());
        let first = format!("sqlite://{}", real.join("t.db").display());
        let second = format!("sqlite://{}", mnt.join("t.db").display());
        second_waits_for_first("bind mount", &first, &second, || {}).await;
    }

    /// An operator deletes every lock file beside the database while the first holds.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deleting_lock_files_beside_the_database_splits_nothing() {
        if std::env::var_os(CHILD_ENV).is_some() {
            return;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let path = dir.path().to_owned();
        second_waits_for_first("deleted lock files", &url, &url, move || {
            for e in std::fs::read_dir(&path).expect("read dir").flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.contains("-simba")
                    && (name.ends_with(".locks")
                        || name.ends_with(".lock")
                        || name.ends_with(".entry"))
                {
                    std::fs::remove_file(e.path()).expect("remove a lock file");
                }
            }
        })
        .await;
    }

    /// A hard-linked database is refused, by every name, with a configuration error that
    /// says why: SQLite's WAL and journal are named by the path, so two names split them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hard_linked_database_is_refused() {
        if std::env::var_os(CHILD_ENV).is_some() {
            return;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("t.db");
        let url = format!("sqlite://{}", db.display());
        let a = store(&url).await;
        let r = a
            .acquire("m", "a", LONG)
            .await
            .expect("acquire before the link");
        assert!(r.owner.is_owned_by_at("a", r.now), "{r:?}");
        assert!(a.release("m", "a").await.expect("release"));
        let linked = dir.path().join("hard.db");
        std::fs::hard_link(&db, &linked).expect("hard link");
        let check = |e: Error, what: &str| match e {
            Error::InvalidConfig { field, reason } => {
                assert_eq!(field, "url", "{what}");
                assert!(
                    reason.contains("2 hard links")
                        && reason.contains("WAL")
                        && reason.contains("remove the other links"),
                    "{what}: {reason}"
                );
            }
            other => panic!("{what}: not a configuration error: {other:?}"),
        };
        let by_link = SqlConfig::new(format!("sqlite://{}", linked.display()));
        check(
            SqlStore::connect(by_link.clone())
                .await
                .expect_err("connect through a hard link"),
            "connect",
        );
        let other = SqlStore::connect_lazy(by_link).expect("a lazy store does no I/O");
        check(
            other
                .migrate()
                .await
                .expect_err("migrate through a hard link"),
            "migrate",
        );
        check(
            other
                .acquire("m", "b", LONG)
                .await
                .expect_err("acquire through a hard link"),
            "acquire by the link",
        );
        check(
            a.acquire("m", "a", LONG)
                .await
                .expect_err("acquire by the first name"),
            "acquire by the first name",
        );
        // One name again: usable again.
        std::fs::remove_file(&linked).expect("remove the link");
        let r = a
            .acquire("m", "a", LONG)
            .await
            .expect("acquire after the unlink");
        assert!(r.owner.is_owned_by_at("a", r.now), "{r:?}");
    }
}
