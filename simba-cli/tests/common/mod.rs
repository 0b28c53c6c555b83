//! Helpers shared by the tests of the `simba` binary: run it, bound every wait.

#![allow(dead_code, unreachable_pub)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use simba_test_kit::history::{Interval, check};
use simba_test_kit::support::unique_name;

/// The `simba` binary under test.
pub const SIMBA: &str = env!("CARGO_BIN_EXE_simba");

/// Statuses of `simba` (see the crate README).
pub const USAGE: i32 = 64;
pub const UNAVAILABLE: i32 = 69;
pub const CANT_CREATE: i32 = 73;
pub const NOT_ACQUIRED: i32 = 75;
pub const LOST: i32 = 79;

/// A `simba` command with a clean environment for simba's variables and `backend`.
pub fn simba(backend: Option<&str>) -> Command {
    let mut c = Command::new(SIMBA);
    c.env_remove("SIMBA_BACKEND")
        .env_remove("SIMBA_LOG")
        .stdin(Stdio::null());
    if let Some(b) = backend {
        c.arg("--backend").arg(b);
    }
    c
}

/// A fresh temporary directory.
pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("temporary directory")
}

/// `sqlite://DIR/name` for a temporary directory.
pub fn sqlite_url(dir: &Path, name: &str) -> String {
    format!("sqlite://{}", dir.join(name).display())
}

/// A unique mutex name for one test: `cli-{test}_` and a random suffix.
pub fn mutex_name(test: &str) -> String {
    unique_name(&format!("cli-{test}"))
}

/// Waits for `child` at most `limit`; kills it and panics when the limit passes.
pub fn wait_for(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{what}: still running after {limit:?}");
            }
            Err(e) => panic!("{what}: waiting failed: {e}"),
        }
    }
}

/// Runs `cmd` to completion within `limit`, capturing its output.
pub fn run(cmd: &mut Command, limit: Duration, what: &str) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: cannot start simba: {e}"));
    // Pipes are small: read them on threads so that the child never blocks on a full pipe.
    let out = child.stdout.take().map(reader);
    let err = child.stderr.take().map(reader);
    let status = wait_for(&mut child, limit, what);
    Output {
        status,
        stdout: out.map(join_reader).unwrap_or_default(),
        stderr: err.map(join_reader).unwrap_or_default(),
    }
}

fn reader<R: std::io::Read + Send + 'static>(mut r: R) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        buf
    })
}

fn join_reader(h: std::thread::JoinHandle<Vec<u8>>) -> Vec<u8> {
    h.join().unwrap_or_default()
}

/// The lines of `r` (a child's stderr, say), read on a thread and handed over as they come.
pub fn line_channel<R: std::io::Read + Send + 'static>(r: R) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The text of a captured stream.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Polls `cond` every 20 ms for at most `limit`; panics with `what` if it never holds.
pub fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The lines of a file, or none if it does not exist yet.
pub fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .map(|s| s.lines().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// Whether `pid` is a live process (a zombie counts as gone).
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // The state follows the command name in parentheses.
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .unwrap_or("X");
            !matches!(state, "Z" | "X")
        }
        Err(_) => false,
    }
}

/// Sends `sig` to `pid`.
pub fn send(pid: u32, sig: nix::sys::signal::Signal) {
    let pid = i32::try_from(pid).expect("pid fits i32");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig).expect("signal sent");
}

/// The command `sh -c SCRIPT` as arguments after `--`.
pub fn sh(script: &str) -> [&OsStr; 4] {
    [
        OsStr::new("--"),
        OsStr::new("sh"),
        OsStr::new("-c"),
        OsStr::new(script),
    ]
}

/// A script that appends `start TAG FENCE NANOS` and `end TAG FENCE NANOS` lines to `log`
/// around `sleep`: FENCE is the `$SIMBA_FENCE` simba gave the command, NANOS the wall clock
/// (`date +%s%N`).
pub fn interval_script(log: &Path, tag: &str, sleep: &str) -> String {
    let log = log.display();
    format!(
        "echo \"start {tag} $SIMBA_FENCE $(date +%s%N)\" >> {log}; sleep {sleep}; \
         echo \"end {tag} $SIMBA_FENCE $(date +%s%N)\" >> {log}"
    )
}

/// The runs that [`interval_script`]s logged, as the test kit's ownership intervals (one
/// per tag, the tag as contender), to be judged by [`check`]: each wall-clock time becomes a
/// common base `Instant` plus its offset from the earliest line, so order and distances are
/// kept. Panics on a malformed log, or a tag without exactly one start and one end after it.
pub fn logged_runs(log: &Path) -> Vec<Interval> {
    let lines = lines(log);
    let parsed: Vec<(String, String, u64, u128)> = lines
        .iter()
        .map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            [kind, tag, fence, nanos] => match (fence.parse(), nanos.parse()) {
                (Ok(fence), Ok(nanos)) => (kind.to_owned(), tag.to_owned(), fence, nanos),
                _ => panic!("bad log line {l:?} in {lines:?}"),
            },
            _ => panic!("bad log line {l:?} in {lines:?}"),
        })
        .collect();
    let first = parsed.iter().map(|p| p.3).min().unwrap_or(0);
    let base = Instant::now();
    let at = |nanos: u128| {
        base + Duration::from_nanos(u64::try_from(nanos - first).expect("a run of centuries"))
    };
    let mut runs: Vec<Interval> = Vec::new();
    for (kind, tag, fence, nanos) in &parsed {
        let open = runs.iter_mut().find(|r| &r.contender == tag);
        match (kind.as_str(), open) {
            ("start", None) => runs.push(Interval {
                contender: tag.clone(),
                fence: *fence,
                start: at(*nanos),
                end: None,
                reason: None,
            }),
            ("end", Some(run)) if run.end.is_none() && run.fence == *fence => {
                run.end = Some(at(*nanos));
            }
            _ => panic!("{kind} {tag} out of place in {lines:?}"),
        }
    }
    assert!(
        runs.iter().all(|r| r.end.is_some()),
        "a run did not end: {lines:?}"
    );
    runs
}

/// Asserts that the kit's history checker finds nothing wrong with `runs`.
pub fn assert_safe(runs: &[Interval]) {
    let violations = check(runs);
    assert!(
        violations.is_empty(),
        "{}\nin {runs:#?}",
        violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// A path in `dir`.
pub fn file(dir: &Path, name: &str) -> PathBuf {
    dir.join(name)
}

/// A running `simba watch --json`, its lines read on a thread.
pub struct Watcher {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Watcher {
    /// Starts `simba watch MUTEX --json --interval 100ms` on `url`.
    pub fn start(url: &str, mutex: &str) -> Watcher {
        Self::start_with(url, mutex, "100ms")
    }

    /// Starts `simba watch MUTEX --json --interval INTERVAL` on `url`.
    pub fn start_with(url: &str, mutex: &str, interval: &str) -> Watcher {
        let mut child = simba(Some(url))
            .args(["watch", mutex, "--json", "--interval", interval])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start simba watch");
        let out = child.stdout.take().expect("piped stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Watcher { child, lines }
    }

    /// The next line as JSON, within `limit`.
    pub fn next(&self, limit: Duration) -> serde_json::Value {
        let line = self
            .lines
            .recv_timeout(limit)
            .unwrap_or_else(|e| panic!("no watch line within {limit:?}: {e}"));
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("watch line {line:?}: {e}"))
    }

    /// Sends SIGINT and returns the exit status (bounded).
    pub fn interrupt(mut self) -> ExitStatus {
        send(self.child.id(), nix::sys::signal::Signal::SIGINT);
        wait_for(
            &mut self.child,
            Duration::from_secs(10),
            "simba watch after SIGINT",
        )
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `simba owner MUTEX --json` on `url`, parsed.
pub fn owner_json(url: &str, mutex: &str) -> serde_json::Value {
    let out = run(
        simba(Some(url)).args(["owner", mutex, "--json"]),
        Duration::from_secs(30),
        "simba owner",
    );
    assert!(out.status.success(), "simba owner: {out:?}");
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("simba owner output {:?}: {e}", text(&out.stdout)))
}

/// `owner` and `watch` show what `exec` does: the watcher reports the acquisition (with
/// the owner id and fence the command saw in its environment) and the release; `owner`
/// shows the command's ownership while it runs and no owner afterwards.
pub fn owner_and_watch_follow_exec(url: &str, test: &str) {
    let dir = tempdir();
    let mutex = mutex_name(test);
    let seen = file(dir.path(), "seen");
    let go = file(dir.path(), "go");

    // Lease backends tell their clock with every read; ZooKeeper's watches do not.
    let leases = !url.starts_with("zk");
    let watcher = Watcher::start(url, &mutex);
    let first = watcher.next(Duration::from_secs(30));
    assert_eq!(first["event"], "current", "{first}");
    assert!(first["owner"].is_null(), "{first}");
    assert!(first["fence"].is_null(), "{first}");
    assert_eq!(first["backend_time"].is_i64(), leases, "{first}");
    assert_eq!(owner_json(url, &mutex)["owner"], serde_json::Value::Null);

    // The command records what it was given, then holds until the test says go.
    let script = format!(
        "echo \"$SIMBA_OWNER_ID $SIMBA_FENCE $SIMBA_MUTEX\" > {seen}; \
         while [ ! -e {go} ]; do sleep 0.05; done",
        seen = seen.display(),
        go = go.display()
    );
    let mut exec = simba(Some(url))
        .args(["-v", "exec", &mutex])
        .args(sh(&script))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start simba exec");
    let stderr = reader(exec.stderr.take().expect("stderr"));
    eventually(Duration::from_secs(30), "the command starts", || {
        lines(&seen).len() == 1
    });
    let got = lines(&seen).remove(0);
    let parts: Vec<&str> = got.split_whitespace().collect();
    assert_eq!(parts.len(), 3, "{got}");
    let (id, fence) = (
        parts[0],
        parts[1].parse::<u64>().expect("SIMBA_FENCE is a number"),
    );
    assert_eq!(parts[2], mutex);

    let acquired = watcher.next(Duration::from_secs(10));
    assert_eq!(acquired["event"], "acquired", "{acquired}");
    assert_eq!(acquired["owner"]["owner_id"], id, "{acquired}");
    assert_eq!(acquired["owner"]["fence"], fence, "{acquired}");
    assert_eq!(acquired["fence"], fence, "{acquired}");
    assert_eq!(acquired["backend_time"].is_i64(), leases, "{acquired}");

    let now = owner_json(url, &mutex);
    assert_eq!(now["owner"]["owner_id"], id, "{now}");
    assert_eq!(now["owner"]["fence"], fence, "{now}");

    std::fs::write(&go, b"").expect("write go");
    let status = wait_for(&mut exec, Duration::from_secs(30), "simba exec");
    assert_eq!(status.code(), Some(0));
    // `-v` narrates the ownership: acquired and released, with the fence.
    let said = text(&join_reader(stderr));
    let narrated = |what: &str| {
        said.lines().any(|l| {
            l.starts_with("simba: ")
                && l.contains(&format!("mutex {mutex:?} {what} (fence {fence})"))
        })
    };
    assert!(narrated("acquired"), "{said}");
    assert!(narrated("released"), "{said}");

    let released = watcher.next(Duration::from_secs(10));
    assert_eq!(released["event"], "released", "{released}");
    assert!(released["owner"].is_null(), "{released}");
    assert_eq!(released["previous"]["owner_id"], id, "{released}");
    assert!(released["fence"].is_null(), "{released}");
    assert_eq!(released["backend_time"].is_i64(), leases, "{released}");
    assert_eq!(owner_json(url, &mutex)["owner"], serde_json::Value::Null);

    let status = watcher.interrupt();
    assert_eq!(status.code(), Some(0), "watch ends with 0 on SIGINT");
}

/// Runs `n` concurrent `simba exec`s of `sleep` seconds on `url` (extra args before the
/// command) and checks with the test kit's history checker that their runs never overlap
/// and that their fences increase.
pub fn concurrent_execs_never_overlap(
    url: Option<&str>,
    env: &[(&str, &Path)],
    n: usize,
    sleep: &str,
    test: &str,
) {
    let dir = tempdir();
    let mutex = mutex_name(test);
    let log = file(dir.path(), "log");
    let mut children: Vec<Child> = (0..n)
        .map(|i| {
            let mut c = simba(url);
            for (k, v) in env {
                c.env(k, v);
            }
            c.args(["exec", &mutex])
                .args(sh(&interval_script(&log, &format!("c{i}"), sleep)))
                .spawn()
                .expect("start simba exec")
        })
        .collect();
    for (i, c) in children.iter_mut().enumerate() {
        let status = wait_for(c, Duration::from_secs(60), &format!("simba exec #{i}"));
        assert_eq!(status.code(), Some(0), "simba exec #{i}");
    }
    let runs = logged_runs(&log);
    assert_eq!(runs.len(), n, "every command ran once: {runs:?}");
    assert_safe(&runs);
}

/// While one `simba exec` holds the mutex, `--no-wait` exits with 75 promptly and
/// `--timeout 300ms` after about 300 ms, neither running its command; SIGTERM to the
/// holder ends it with 143.
pub fn not_acquired_while_held(url: &str, test: &str) {
    let dir = tempdir();
    let mutex = mutex_name(test);
    let ready = file(dir.path(), "ready");
    let ran = file(dir.path(), "ran");
    let mut holder = simba(Some(url))
        .args(["exec", &mutex])
        .args(sh(&format!("touch {}; sleep 30", ready.display())))
        .spawn()
        .expect("start the holder");
    eventually(Duration::from_secs(30), "the holder runs", || {
        ready.exists()
    });
    for (args, min) in [
        (&["--no-wait"][..], Duration::ZERO),
        (&["--timeout", "300ms"][..], Duration::from_millis(300)),
    ] {
        let started = Instant::now();
        let out = run(
            simba(Some(url))
                .args(["exec", &mutex])
                .args(args)
                .args(sh(&format!("touch {}", ran.display()))),
            Duration::from_secs(30),
            "simba exec on a held mutex",
        );
        let took = started.elapsed();
        assert_eq!(out.status.code(), Some(NOT_ACQUIRED), "{args:?}: {out:?}");
        assert!(
            took >= min && took < min + Duration::from_secs(5),
            "{args:?}: {took:?}"
        );
    }
    assert!(!ran.exists(), "a command ran without the mutex");
    send(holder.id(), nix::sys::signal::Signal::SIGTERM);
    let status = wait_for(&mut holder, Duration::from_secs(10), "holder after SIGTERM");
    assert_eq!(status.code(), Some(143));
}

/// `simba exec --no-wait --hold-at-least 3s`, run again and again: the command runs once
/// per 3 s — the later runs within the hold exit 75 without running it, though the first
/// command ended at once — and `simba owner` shows the hold meanwhile.
/// `lease`: extra lease options of every exec (e.g. `--ttl 1s --transition 1s`).
pub fn hold_at_least_runs_once_per_period(url: &str, test: &str, lease: &[&str]) {
    let dir = tempdir();
    let mutex = mutex_name(test);
    let log = file(dir.path(), "runs");
    let once = || {
        run(
            simba(Some(url))
                .args(["exec", &mutex, "--no-wait", "--hold-at-least", "3s"])
                .args(lease)
                .args(sh(&format!("echo ran >> {}", log.display()))),
            Duration::from_secs(30),
            "simba exec --no-wait --hold-at-least",
        )
    };
    let t0 = Instant::now();
    let first = once();
    assert_eq!(first.status.code(), Some(0), "{first:?}");
    let held = owner_json(url, &mutex);
    let holder = held["owner"]["owner_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(holder.starts_with("held@@"), "{held}");
    let mut skipped = 0;
    // Well inside the hold (the 3 s count from the first acquisition).
    while t0.elapsed() < Duration::from_millis(2000) {
        let out = once();
        assert_eq!(out.status.code(), Some(NOT_ACQUIRED), "{out:?}");
        skipped += 1;
    }
    assert!(skipped > 0);
    assert_eq!(lines(&log).len(), 1, "ran more than once within the hold");
    // After the hold: runs again (at once: --no-wait).
    std::thread::sleep(
        Duration::from_secs(3).saturating_sub(t0.elapsed()) + Duration::from_millis(300),
    );
    let again = once();
    assert_eq!(again.status.code(), Some(0), "{again:?}");
    assert_eq!(lines(&log).len(), 2);
}

/// `simba exec --hold-at-most 1s` stops a longer command as on a loss and exits 79.
pub fn hold_at_most_stops_the_command(url: &str, test: &str) {
    let mutex = mutex_name(test);
    let t0 = Instant::now();
    let out = run(
        simba(Some(url))
            .args([
                "exec",
                &mutex,
                "--hold-at-most",
                "1s",
                "--grace",
                "1s",
                "--",
            ])
            .args(["sleep", "30"]),
        Duration::from_secs(30),
        "simba exec --hold-at-most",
    );
    assert_eq!(out.status.code(), Some(LOST), "{out:?}");
    assert!(text(&out.stderr).contains("--hold-at-most"), "{out:?}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert_eq!(owner_json(url, &mutex)["owner"], serde_json::Value::Null);
}

/// How [`group_gone_before_next_owner`] takes `simba exec` away from its command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL to simba (as the OOM killer, a crash, `kill -9`).
    Kill,
    /// SIGSTOP to simba, past its lease (continued once the next owner is done).
    Stop,
    /// SIGKILL to simba and its guardian in one `kill` (`pkill -9 simba`, an OOM kill of
    /// both).
    KillBoth,
    /// SIGSTOP to simba and its guardian in one `kill`, past the lease.
    StopBoth,
}

impl Fault {
    pub fn signal(self) -> nix::sys::signal::Signal {
        use nix::sys::signal::Signal;
        match self {
            Fault::Kill | Fault::KillBoth => Signal::SIGKILL,
            Fault::Stop | Fault::StopBoth => Signal::SIGSTOP,
        }
    }

    fn both(self) -> bool {
        matches!(self, Fault::KillBoth | Fault::StopBoth)
    }
}

/// Whether this machine lets simba make a cgroup v2 for a job (as `simba exec` checks):
/// a child of this process's own cgroup can be made.
pub fn cgroup_available() -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let mount = info.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        (right.split(' ').next()? == "cgroup2")
            .then(|| left.split(' ').nth(4).map(PathBuf::from))?
    });
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("0::"))
                .map(str::to_owned)
        });
    let (Some(mount), Some(own)) = (mount, own) else {
        return false;
    };
    let probe = mount
        .join(own.trim_start_matches('/'))
        .join(format!("simba-test-probe-{}", std::process::id()));
    let made = std::fs::create_dir(&probe).is_ok();
    let _ = std::fs::remove_dir(&probe);
    made
}

/// The pid of `simba`'s guardian (its child started with `__simba-guardian-…`).
pub fn guardian_of(simba: u32) -> Option<i32> {
    std::fs::read_dir("/proc").ok()?.find_map(|e| {
        let pid: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (_, rest) = stat.rsplit_once(") ")?;
        let ppid: u32 = rest.split_whitespace().nth(1)?.parse().ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let guardian = String::from_utf8_lossy(&cmdline).contains("__simba-guardian");
        (ppid == simba && guardian).then_some(pid)
    })
}

/// The stderr lines of a `simba -vv exec` up to and with its `waiting for the mutex` line
/// (bounded: 60 s).
pub fn until_waiting(stderr: &std::sync::mpsc::Receiver<String>) -> Vec<String> {
    let mut said = Vec::new();
    loop {
        let line = stderr
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("the second simba exec does not wait ({e}): {said:?}"));
        let waits = line.contains("waiting for the mutex");
        said.push(line);
        if waits {
            return said;
        }
    }
}

/// Sends `sig` to every pid in one `kill` call (as `kill -9 A B` or `pkill` would).
pub fn send_all(pids: &[i32], sig: nix::sys::signal::Signal) {
    let list: Vec<String> = pids.iter().map(ToString::to_string).collect();
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!("kill -{} {}", sig as i32, list.join(" ")))
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{sig} {list:?}");
}

/// What [`group_gone_before_next_owner`] measured, from the instant of the fault.
#[derive(Debug, Clone, Copy)]
pub struct Handover {
    /// Until the next owner's command started.
    pub next_started: Duration,
    /// Until the last record any process of the first command's group wrote (zero when
    /// that was before the fault).
    pub first_last_seen: Duration,
}

/// Nanoseconds of the wall clock, as the scripts below write them.
fn wall_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_nanos()
}

/// `simba exec` of a command with a grandchild, then `fault` to simba while a second
/// `simba exec` waits for the mutex: the second command must start only after every
/// process of the first group is gone.
///
/// The first command (bash) and its grandchild (a bash subshell) each write a `start`
/// record, then a `beat` record every 20 ms, until they die; a third process (`sleep 100`)
/// records only its pid. Their own records give the first job's interval (first start to
/// last record of any of them); the second command writes `start` and `end` records and,
/// in between, `alive PID` for each process of the first group it finds alive. The kit's
/// history checker judges the two intervals (no overlap, fences increase), and no `alive`
/// record may appear. Returns the times measured from the fault.
pub fn group_gone_before_next_owner(
    url: &str,
    lease: &[&str],
    fault: Fault,
    test: &str,
) -> Handover {
    let one = Holding {
        mutexes: vec![mutex_name(test)],
        fence_var: "SIMBA_FENCE",
    };
    group_gone_before_next_owner_of(url, lease, fault, &one, &one)
}

/// [`group_gone_before_next_owner`] with one more process in the first job that leaves
/// its process group and session (`setsid`, as `su` or a daemon does) and writes records
/// too. Only the job's cgroup catches such a process: callers check
/// [`cgroup_available`].
pub fn group_gone_before_next_owner_escaping(
    url: &str,
    lease: &[&str],
    fault: Fault,
    test: &str,
) -> Handover {
    let one = Holding {
        mutexes: vec![mutex_name(test)],
        fence_var: "SIMBA_FENCE",
    };
    handover(url, lease, fault, &one, &one, true)
}

/// The mutexes one `simba exec` of [`group_gone_before_next_owner_of`] holds (each given
/// with `--mutex`), and the variable its script logs as the fence.
pub struct Holding {
    pub mutexes: Vec<String>,
    pub fence_var: &'static str,
}

impl Holding {
    fn args(&self) -> Vec<String> {
        let mut args = vec!["exec".to_owned()];
        for m in &self.mutexes {
            args.extend(["--mutex".to_owned(), m.clone()]);
        }
        args
    }
}

/// [`group_gone_before_next_owner`] with the mutexes of each `simba exec` given: the
/// first holds `first`, the next waits for `next`, which must share a mutex with it.
pub fn group_gone_before_next_owner_of(
    url: &str,
    lease: &[&str],
    fault: Fault,
    first_holds: &Holding,
    next_holds: &Holding,
) -> Handover {
    handover(url, lease, fault, first_holds, next_holds, false)
}

fn handover(
    url: &str,
    lease: &[&str],
    fault: Fault,
    first_holds: &Holding,
    next_holds: &Holding,
    escape: bool,
) -> Handover {
    use nix::sys::signal::Signal;
    let dir = tempdir();
    let log = file(dir.path(), "log");
    let pids = file(dir.path(), "pids");
    let (log_s, pids_s) = (log.display(), pids.display());
    let (first_fence, next_fence) = (first_holds.fence_var, next_holds.fence_var);
    // `${t/./}000`: EPOCHREALTIME (seconds.micros) in nanoseconds, without a fork.
    let first = format!(
        "rec() {{ t=$EPOCHREALTIME; echo \"$1 $2 ${first_fence} ${{t/./}}000\" >> {log_s}; }}; \
         beat() {{ while :; do rec beat $1; sleep 0.02; done; }}; \
         rec start cmd; \
         ( rec start gc; beat gc ) & echo $! >> {pids_s}; \
         sleep 100 & echo $! >> {pids_s}; \
         {escapee} \
         echo $$ >> {pids_s}; \
         beat cmd",
        escapee = if escape {
            format!(
                "setsid bash -c 'while :; do t=$EPOCHREALTIME; \
                 echo \"beat esc ${first_fence} ${{t/./}}000\" >> {log_s}; sleep 0.02; done' \
                 & echo $! >> {pids_s};"
            )
        } else {
            String::new()
        }
    );
    let processes = if escape { 4 } else { 3 };
    let second = format!(
        "rec() {{ t=$EPOCHREALTIME; echo \"$1 $2 ${next_fence} ${{t/./}}000\" >> {log_s}; }}; \
         rec start second; \
         while read -r p; do \
           if read -r stat < /proc/$p/stat 2>/dev/null; then \
             state=${{stat##*) }}; state=${{state%% *}}; \
             [ \"$state\" = Z ] || echo \"alive $p\" >> {log_s}; \
           fi; \
         done < {pids_s}; \
         rec end second"
    );
    let bash = |script: &str| -> Vec<std::ffi::OsString> {
        ["--", "bash", "-c", script]
            .iter()
            .map(std::ffi::OsString::from)
            .collect()
    };
    let mut holder = simba(Some(url))
        .env("LC_ALL", "C")
        .args(first_holds.args())
        .args(lease)
        .args(bash(&first))
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the first simba exec");
    // Read as lines: a command that outlived simba would hold the pipe open forever.
    let holder_err = line_channel(holder.stderr.take().expect("piped stderr"));
    eventually(
        Duration::from_secs(60),
        "the first command and its grandchildren run",
        || {
            let l = lines(&log);
            lines(&pids).len() == processes
                && l.iter().any(|l| l.starts_with("beat cmd "))
                && (!escape || l.iter().any(|l| l.starts_with("beat esc ")))
                && l.iter().any(|l| l.starts_with("beat gc "))
        },
    );
    let group: Vec<i32> = lines(&pids)
        .iter()
        .map(|l| l.trim().parse().expect("a pid"))
        .collect();
    assert!(group.iter().all(|&p| alive(p)), "{group:?}");

    // The next contender waits (its `waiting for the mutex` line comes right before).
    let mut next = simba(Some(url))
        .env("LC_ALL", "C")
        .arg("-vv")
        .args(next_holds.args())
        .args(lease)
        .args(bash(&second))
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the second simba exec");
    let next_err = line_channel(next.stderr.take().expect("piped stderr"));
    let mut said = until_waiting(&next_err);
    let guardian = guardian_of(holder.id()).expect("the first simba's guardian");
    let simba_pid = i32::try_from(holder.id()).expect("pid fits i32");
    let at_fault = wall_ns();
    if fault.both() {
        send_all(&[simba_pid, guardian], fault.signal());
    } else {
        send(holder.id(), fault.signal());
    }
    let until = Instant::now() + Duration::from_secs(60);
    let status = loop {
        match next.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => panic!("waiting for the second simba exec: {e}"),
        }
        if Instant::now() > until {
            let _ = next.kill();
            panic!("the second simba exec: still running after 60 s: {said:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let rest: Vec<String> = next_err.try_iter().collect();
    said.extend(rest);
    assert_eq!(status.code(), Some(0), "second simba exec: {said:#?}");
    match fault {
        Fault::Stop => send(holder.id(), Signal::SIGCONT),
        Fault::StopBoth => send_all(&[simba_pid, guardian], Signal::SIGCONT),
        Fault::Kill | Fault::KillBoth => {}
    }
    let first_status = wait_for(&mut holder, Duration::from_secs(60), "the first simba exec");
    let mut first_err = String::new();
    while let Ok(line) = holder_err.recv_timeout(Duration::from_secs(5)) {
        first_err.push_str(&line);
        first_err.push('\n');
    }
    match fault {
        Fault::Kill | Fault::KillBoth => assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&first_status),
            Some(9)
        ),
        // Continued with its guardian after the deadline: the group was killed meanwhile.
        Fault::StopBoth => assert_eq!(first_status.code(), Some(LOST), "{first_err}"),
        // Continued after its deadline: it finds the group killed by its guardian.
        Fault::Stop => {
            assert_eq!(first_status.code(), Some(LOST), "{first_err}");
            assert!(
                first_err.contains("killed (SIGKILL) at the local lease deadline"),
                "{first_err}"
            );
        }
    }

    let records = lines(&log);
    assert!(
        !records.iter().any(|l| l.starts_with("alive ")),
        "the second command saw processes of the first group alive: {records:#?}"
    );
    let survivors: Vec<i32> = group.iter().copied().filter(|&p| alive(p)).collect();
    assert!(
        survivors.is_empty(),
        "survivors of the first group: {survivors:?}"
    );
    // (kind, tag, fence, nanos)
    let parsed: Vec<(String, String, u64, u128)> = records
        .iter()
        .map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            [kind, tag, fence, nanos] => (
                kind.to_owned(),
                tag.to_owned(),
                fence.parse().unwrap_or_else(|_| panic!("bad line {l:?}")),
                nanos.parse().unwrap_or_else(|_| panic!("bad line {l:?}")),
            ),
            _ => panic!("bad line {l:?} in {records:#?}"),
        })
        .collect();
    let of = |second: bool| {
        parsed
            .iter()
            .filter(move |(_, tag, ..)| (tag == "second") == second)
    };
    let first_start = of(false).map(|p| p.3).min().expect("first job records");
    let first_end = of(false).map(|p| p.3).max().expect("first job records");
    let first_fence = of(false).map(|p| p.2).max().expect("first job records");
    let find = |kind: &str| {
        of(true)
            .find(|p| p.0 == kind)
            .unwrap_or_else(|| panic!("no {kind} of the second command in {records:#?}"))
    };
    let (second_start, second_end, second_fence) =
        (find("start").3, find("end").3, find("start").2);
    let base = Instant::now();
    let zero = first_start.min(at_fault);
    let at = |ns: u128| base + Duration::from_nanos(u64::try_from(ns - zero).expect("short"));
    let runs = [
        Interval {
            contender: "first job".to_owned(),
            fence: first_fence,
            start: at(first_start),
            end: Some(at(first_end)),
            reason: None,
        },
        Interval {
            contender: "second job".to_owned(),
            fence: second_fence,
            start: at(second_start),
            end: Some(at(second_end)),
            reason: None,
        },
    ];
    assert_safe(&runs);
    let since_fault =
        |ns: u128| Duration::from_nanos(u64::try_from(ns.saturating_sub(at_fault)).expect("short"));
    let handover = Handover {
        next_started: since_fault(second_start),
        first_last_seen: since_fault(first_end),
    };
    eprintln!(
        "{:?}: {fault:?} of simba exec on {url}: {handover:?}",
        first_holds.mutexes
    );
    handover
}

/// One run of a command, from the `start`/`end` lines of an [`interval_script`] log
/// (`start TAG FENCE NANOS`), or of a log whose lines also name a mode after the tag
/// (`start TAG MODE FENCE NANOS`; `mode` is empty otherwise).
#[derive(Debug)]
pub struct Run {
    pub tag: String,
    pub mode: String,
    pub fence: u64,
    pub start: u128,
    pub end: u128,
}

/// The runs of `log`; panics on a malformed log or a run without exactly one start and
/// one end after it.
pub fn runs(log: &Path) -> Vec<Run> {
    let lines = lines(log);
    let mut runs: Vec<Run> = Vec::new();
    for l in &lines {
        let (kind, tag, mode, fence, nanos) = match l.split_whitespace().collect::<Vec<_>>()[..] {
            [kind, tag, fence, nanos] => (kind, tag, "", fence, nanos),
            [kind, tag, mode, fence, nanos] => (kind, tag, mode, fence, nanos),
            _ => panic!("bad log line {l:?} in {lines:?}"),
        };
        let (Ok(fence), Ok(nanos)) = (fence.parse::<u64>(), nanos.parse::<u128>()) else {
            panic!("bad log line {l:?} in {lines:?}");
        };
        let open = runs.iter_mut().find(|r| r.tag == tag);
        match (kind, open) {
            ("start", None) => runs.push(Run {
                tag: tag.to_owned(),
                mode: mode.to_owned(),
                fence,
                start: nanos,
                end: 0,
            }),
            ("end", Some(r)) if r.end == 0 && r.fence == fence => r.end = nanos,
            _ => panic!("{kind} {tag} out of place in {lines:?}"),
        }
    }
    assert!(
        runs.iter().all(|r| r.end != 0),
        "a run did not end: {lines:?}"
    );
    runs
}

/// The most runs that overlapped at one instant (an end and a start at the same
/// nanosecond do not overlap: the end is counted first).
pub fn most_at_once(runs: &[Run]) -> usize {
    let mut events: Vec<(u128, i32)> = runs
        .iter()
        .flat_map(|r| [(r.start, 1), (r.end, -1)])
        .collect();
    events.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, step) in events {
        now += step;
        most = most.max(now);
    }
    usize::try_from(most).unwrap_or(0)
}

/// Six `simba exec --permits 2` started at once on `url`, each command logging its start
/// and end with its fence: all exit 0, every command ran once, never more than two at
/// once (and two did run together: the semaphore is no mutex), six distinct fences.
pub fn six_execs_two_at_a_time(url: &str, test: &str) {
    let dir = tempdir();
    let semaphore = mutex_name(test);
    let log = file(dir.path(), "log");
    let mut children: Vec<Child> = (0..6)
        .map(|i| {
            simba(Some(url))
                .args(["exec", "--permits", "2", &semaphore])
                .args(sh(&interval_script(&log, &format!("c{i}"), "0.5")))
                .spawn()
                .expect("start simba exec --permits")
        })
        .collect();
    // Three rounds of 0.5 s on a loaded machine, behind connecting and (Redis) a
    // restart quarantine of one default lease (16 s): a minute is ample.
    for (i, c) in children.iter_mut().enumerate() {
        let status = wait_for(c, Duration::from_secs(90), &format!("exec #{i}"));
        assert_eq!(status.code(), Some(0), "exec #{i}");
    }
    let runs = runs(&log);
    assert_eq!(runs.len(), 6, "every command ran once: {runs:?}");
    // Each of six waiters released while another still sleeps its 0.5 s: two overlap.
    assert_eq!(most_at_once(&runs), 2, "at most two at once: {runs:#?}");
    let mut fences: Vec<u64> = runs.iter().map(|r| r.fence).collect();
    fences.sort_unstable();
    fences.dedup();
    assert_eq!(fences.len(), 6, "six distinct fences: {runs:#?}");
}
