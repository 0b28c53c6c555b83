//! Faults: ownership suspect or lost while `simba exec` runs its command.
//!
//! The binary is named `faults` so that the workspace's nextest configuration runs it in
//! the serial fault group (its timing must not be starved by other tests).

mod common;

use std::time::{Duration, Instant};

use common::*;
use simba_test_kit::proxy::FaultProxy;
use simba_test_kit::servers;

/// Runs blocking test code off the runtime's threads (the proxy runs on them).
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .expect("blocking test code panicked")
}

/// What happened after the network to Redis was cut under a running `simba exec`.
struct AfterCut {
    status: std::process::ExitStatus,
    stderr: String,
    took: Duration,
    group: Vec<i32>,
}

/// Runs `simba exec --ttl 2s --transition 1s --grace GRACE` through a fault proxy with a
/// command whose process group has a shell, a `sleep` child and, if `stubborn`, a `sleep`
/// that ignores SIGTERM; cuts the network (blackhole: connections stay open, nothing
/// answers) once the command runs, and waits for simba to end.
async fn cut_under_exec(grace: &str, stubborn: bool, test: &str) -> AfterCut {
    let server = servers::redis().await.expect("a Redis server");
    let proxy = FaultProxy::start(server.socket_addr().expect("Redis address"))
        .await
        .expect("start the proxy");
    let url = server.url_via(proxy.addr());
    let dir = tempdir();
    let pids = file(dir.path(), "pids");
    let p = pids.display();
    let extra = if stubborn {
        format!("(trap '' TERM; exec sleep 1000) & echo $! >> {p}; ")
    } else {
        String::new()
    };
    let script = format!("sleep 1000 & echo $! >> {p}; {extra}echo $$ >> {p}; wait");
    let expected = if stubborn { 3 } else { 2 };
    let mutex = mutex_name(test);
    let mut exec = simba(Some(&url))
        .args([
            "exec",
            &mutex,
            "--ttl",
            "2s",
            "--transition",
            "1s",
            "--grace",
            grace,
        ])
        .args(sh(&script))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start simba exec");
    let group: Vec<i32> = blocking(move || {
        eventually(
            Duration::from_secs(30),
            "the command's processes start",
            || lines(&pids).len() == expected,
        );
        lines(&pids)
            .iter()
            .map(|l| l.trim().parse().expect("a pid"))
            .collect()
    })
    .await;
    assert!(group.iter().all(|&pid| alive(pid)), "{group:?}");

    // Let it renew once or twice, then cut the network without closing connections.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        matches!(exec.try_wait(), Ok(None)),
        "simba exec ended early"
    );
    proxy.blackhole(true);
    let cut = Instant::now();
    let (status, stderr) = blocking(move || {
        // lease (3 s) + grace + the bounded release and shutdown (2 s) + slack.
        let status = wait_for(
            &mut exec,
            Duration::from_secs(40),
            "simba exec after the cut",
        );
        let mut err = String::new();
        if let Some(mut e) = exec.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        (status, err)
    })
    .await;
    let took = cut.elapsed();
    eprintln!("simba exec ended {took:?} after the cut; its stderr:\n{stderr}");
    proxy.heal();
    AfterCut {
        status,
        stderr,
        took,
        group,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_ownership_stops_the_whole_process_group() {
    let after = cut_under_exec("1s", true, "lost").await;
    assert_eq!(after.status.code(), Some(LOST), "stderr: {}", after.stderr);
    assert!(after.stderr.contains("lost"), "{}", after.stderr);
    // The TERM-ignoring grandchild made simba wait for the grace period, then SIGKILL it.
    assert!(after.took >= Duration::from_secs(1), "{:?}", after.took);
    assert!(after.took < Duration::from_secs(10), "{:?}", after.took);
    let survivors: Vec<i32> = after.group.iter().copied().filter(|&p| alive(p)).collect();
    assert!(
        survivors.is_empty(),
        "processes of the group survived: {survivors:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_that_obeys_sigterm_is_not_kept_for_the_grace_period() {
    let after = cut_under_exec("60s", false, "lost-quick").await;
    assert_eq!(after.status.code(), Some(LOST), "stderr: {}", after.stderr);
    // Lease (3 s) + release bound + shutdown, far below the 60 s grace.
    assert!(after.took < Duration::from_secs(10), "{:?}", after.took);
    let survivors: Vec<i32> = after.group.iter().copied().filter(|&p| alive(p)).collect();
    assert!(
        survivors.is_empty(),
        "processes of the group survived: {survivors:?}"
    );
}

/// How long any one step below may take (a narration line to come, simba to exit).
/// Generous on purpose: the steps are a few seconds apart (leases of 4 s to 10 s), and a
/// loaded 2-core machine may be slow to start simba or to schedule it. A step that never
/// comes fails the test after this; none of these tests measures time.
const STEP_LIMIT: Duration = Duration::from_secs(30);

/// A runtime of its own for the proxy and the server set-up, so that the test's thread
/// can block on simba's stderr without starving the proxy.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// A `simba -v exec` on Redis through a fault proxy, guarding a command (a shell and its
/// `sleep` child) that runs until the file `go` exists; simba's stderr is read line by
/// line as it comes.
struct Narrated {
    exec: std::process::Child,
    mutex: String,
    stderr: std::sync::mpsc::Receiver<String>,
    /// Every stderr line read so far, for failure messages.
    said: Vec<String>,
    /// The fence of the ownership, from the `acquired` line.
    fence: u64,
    /// The command's shell and its `sleep` child.
    group: Vec<i32>,
    go: std::path::PathBuf,
    proxy: FaultProxy,
    _server: servers::TestServer,
    _dir: tempfile::TempDir,
}

impl Narrated {
    /// Starts it with `lease` options and waits until it has acquired and the command runs.
    fn start(rt: &tokio::runtime::Runtime, lease: &[&str], test: &str) -> Narrated {
        let (server, proxy) = rt.block_on(async {
            let server = servers::redis().await.expect("a Redis server");
            let proxy = FaultProxy::start(server.socket_addr().expect("Redis address"))
                .await
                .expect("start the proxy");
            (server, proxy)
        });
        // On a fresh server the first acquisition waits one lease (simba-redis's restart
        // quarantine): within STEP_LIMIT.
        let url = server.url_via(proxy.addr());
        let dir = tempdir();
        let pids = file(dir.path(), "pids");
        let go = file(dir.path(), "go");
        let script = format!(
            "sleep 1000 & echo $! >> {p}; echo $$ >> {p}; \
             while [ ! -e {g} ]; do sleep 0.05; done; kill $!",
            p = pids.display(),
            g = go.display()
        );
        let mutex = mutex_name(test);
        let mut exec = simba(Some(&url))
            .args(["-v", "exec", &mutex, "--grace", "1s"])
            .args(lease)
            .args(sh(&script))
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start simba exec");
        let stderr = line_channel(exec.stderr.take().expect("piped stderr"));
        let mut n = Narrated {
            exec,
            mutex,
            stderr,
            said: Vec::new(),
            fence: 0,
            group: Vec::new(),
            go,
            proxy,
            _server: server,
            _dir: dir,
        };
        let (step, fence) = n.next_step();
        assert_eq!(step, "acquired", "{}", n.said.join("\n"));
        n.fence = fence;
        eventually(STEP_LIMIT, "the command's processes start", || {
            lines(&pids).len() == 2
        });
        n.group = lines(&pids)
            .iter()
            .map(|l| l.trim().parse().expect("a pid"))
            .collect();
        n
    }

    /// The next step `-v` narrates (`acquired`, `suspect`, `no longer suspect`, `lost`,
    /// `released`) and its fence; other stderr lines (logs) are only kept.
    fn next_step(&mut self) -> (String, u64) {
        let marker = format!("mutex {:?} ", self.mutex);
        let deadline = Instant::now() + STEP_LIMIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.stderr.recv_timeout(left).unwrap_or_else(|e| {
                panic!(
                    "no narration within {STEP_LIMIT:?} ({e}); stderr so far:\n{}",
                    self.said.join("\n")
                )
            });
            self.said.push(line.clone());
            // `simba: <time> mutex "m" <step> (fence N)…`
            let Some((_, rest)) = line
                .strip_prefix("simba: ")
                .and_then(|l| l.split_once(&marker))
            else {
                continue;
            };
            let Some((step, after)) = rest.split_once(" (fence ") else {
                continue;
            };
            let known = [
                "acquired",
                "suspect",
                "no longer suspect",
                "lost",
                "released",
            ];
            if !known.contains(&step) {
                continue;
            }
            let fence = after
                .split(')')
                .next()
                .and_then(|f| f.parse().ok())
                .unwrap_or_else(|| panic!("no fence in {line:?}"));
            return (step.to_owned(), fence);
        }
    }

    /// Reads the next narrated step and checks that it is `step`, with the fence.
    fn expect_step(&mut self, step: &str) {
        let (got, fence) = self.next_step();
        assert_eq!(
            (got.as_str(), fence),
            (step, self.fence),
            "stderr so far:\n{}",
            self.said.join("\n")
        );
    }

    fn group_alive(&self) -> bool {
        self.group.iter().all(|&pid| alive(pid))
    }

    fn group_gone(&self) -> bool {
        self.group.iter().all(|&pid| !alive(pid))
    }

    /// Waits for simba to exit (bounded) and returns its status.
    fn exit(&mut self) -> std::process::ExitStatus {
        let status = wait_for(&mut self.exec, STEP_LIMIT, "simba exec");
        // The rest of stderr, for the messages.
        while let Ok(line) = self.stderr.recv_timeout(Duration::from_secs(5)) {
            self.said.push(line);
        }
        eprintln!(
            "simba exec ended ({status}); its stderr:\n{}",
            self.said.join("\n")
        );
        status
    }
}

impl Drop for Narrated {
    fn drop(&mut self) {
        self.proxy.heal();
        if matches!(self.exec.try_wait(), Ok(None)) {
            let _ = self.exec.kill();
            let _ = self.exec.wait();
        }
        for &pid in &self.group {
            if alive(pid) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

/// The server goes away under `simba -v exec` (its connections closed, new ones refused):
/// the owner's renewals fail, and it narrates `suspect` with its fence while the lease
/// still protects it and the command runs on, then `lost` at its local deadline; the
/// command's process group is stopped and simba exits 79.
#[test]
fn exec_v_narrates_suspect_then_lost_when_the_server_is_gone() {
    let rt = runtime();
    // A renewal every 4 s; the one after the cut fails within the Redis client's command
    // timeout (2 s), ~2 s before the deadline (4 s of transition, less the drift margin).
    let mut n = Narrated::start(&rt, &["--ttl", "4s", "--transition", "4s"], "suspect-lost");
    n.proxy.refuse(true);
    n.proxy.cut();
    n.expect_step("suspect");
    assert!(n.group_alive(), "the command runs on while suspect");
    n.expect_step("lost");
    let status = n.exit();
    assert_eq!(status.code(), Some(LOST), "{}", n.said.join("\n"));
    assert!(n.group_gone(), "the command was stopped: {:?}", n.group);
}

/// The server comes back before the deadline: `no longer suspect`, the command runs on and
/// ends on its own, and the mutex is released as usual.
#[test]
fn exec_v_narrates_no_longer_suspect_when_the_server_comes_back() {
    let rt = runtime();
    // Renewals every 4 s, 10 s of lease: after a failed renewal at least 4 s are left for
    // the client to reconnect (backoff up to 1 s) and for a retry to succeed.
    let mut n = Narrated::start(&rt, &["--ttl", "4s", "--transition", "6s"], "suspect-back");
    n.proxy.refuse(true);
    n.proxy.cut();
    n.expect_step("suspect");
    n.proxy.heal();
    n.expect_step("no longer suspect");
    assert!(n.group_alive(), "the command runs on");
    std::fs::write(&n.go, b"").expect("write go");
    n.expect_step("released");
    let status = n.exit();
    assert_eq!(status.code(), Some(0), "{}", n.said.join("\n"));
}

/// A renewal that hangs (the network holds every byte and keeps connections open, like a
/// paused server) is a backend that does not answer: `suspect` before the deadline, then
/// `lost` at it. The Redis client's own command timeout (2 s) is longer than what is left
/// of the lease when the renewal goes out (1.9 s), so only the lease engine can make it
/// suspect in time; before it did, this went straight from `acquired` to `lost`.
#[test]
fn exec_v_narrates_suspect_when_renewals_hang() {
    let rt = runtime();
    let mut n = Narrated::start(&rt, &["--ttl", "2s", "--transition", "2s"], "suspect-hang");
    n.proxy.blackhole(true);
    n.expect_step("suspect");
    n.expect_step("lost");
    let status = n.exit();
    assert_eq!(status.code(), Some(LOST), "{}", n.said.join("\n"));
    assert!(n.group_gone(), "the command was stopped: {:?}", n.group);
}
