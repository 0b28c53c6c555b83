//! The guardian of `simba exec`'s command: `simba` itself, started again in a hidden mode,
//! that is the command's parent and ends the command's whole process group the moment
//! simba can no longer guard it.
//!
//! ```text
//! simba (contends, renews)            ── socket pair ──  guardian (own process group)
//!   │ sends each local lease deadline                       │ parent of the command,
//!   │ and signal / stop requests                            │ child subreaper (Linux)
//!   │                                                       └─ command (group = its pid)
//!   │                                                            └─ grandchildren …
//! ```
//!
//! The guardian kills the command's group with SIGKILL when
//! - simba is gone, however it died: the socket's other end, which only simba holds,
//!   reads end-of-file at once (the kernel closes a dead process's descriptors);
//! - the last local lease deadline simba handed over passes without a newer one (simba
//!   stopped, or paused past its lease): both processes read the same CLOCK_MONOTONIC, so
//!   the deadline travels as an absolute instant of it.
//!
//! It stops the group gently (SIGTERM, then SIGKILL after the grace period) when simba
//! asks (`--hold-at-most`, a lost ownership) and when the command ends and leaves members
//! of its group behind. It reports the command's exit status, and that the group is gone,
//! then exits: on SQLite it holds a duplicate of each mutex's lock file until then (received
//! with the set-up message), and the command inherits them too, so the kernel frees the
//! mutex only once no process of the job is left. On Linux the command also inherits, and
//! alone holds, each mutex's *job byte* ([`lock_job_bytes`]): while a process of the job
//! lives, no contender takes the mutex, not even after the lease has run out.
//!
//! On Linux, where a cgroup v2 can be made, the job runs in one of its own (see
//! [`crate::cgroup`]): kills and the "is anyone left" check cover it, so processes that
//! left the group (`setsid`, `su`) are covered too, and a watcher (this binary in the
//! [`WATCHER_ARG`] mode, outside the cgroup) kills the cgroup when the guardian dies or at
//! the last deadline the guardian passed on. The command is started through the
//! [`START_ARG`] mode, which asks for PDEATHSIG (SIGKILL when the guardian dies), joins the
//! cgroup, and execs the command (no `pre_exec`: the workspace has no unsafe code).
//!
//! When the command is stopped for the terminal (SIGTSTP, SIGTTIN, SIGTTOU) the guardian
//! says `stopped SIG`, and simba stops itself the same way (job control, see
//! `crate::child`).
//!
//! The guardian lives in a process group of its own, outside both simba's (a shell's
//! `kill -9 %1` of simba's job does not take it along) and the command's (what is sent to
//! the command's group does not reach it). It ignores SIGINT, SIGTERM, SIGHUP and SIGQUIT:
//! simba passes those on.
//!
//! The protocol is lines of text on the socket. simba → guardian: `deadline NS`,
//! `signal N`, `stop MS`; guardian → simba: `started PID`, `failed KIND MESSAGE`,
//! `stopped SIG`, `exited RAW` (the wait status), `gone WHY`. The first line from simba, `setup GRACE_MS
//! DEADLINE_NS|- JOB_BYTES|- FOREGROUND|-` (one job byte or `-` per lock file, comma
//! separated; simba's process group when it has the terminal's foreground),
//! carries the command's standard input and, on SQLite, the lock files (one per mutex) as
//! SCM_RIGHTS descriptors (the only ones the guardian inherits otherwise are standard
//! input — the socket — and standard output and error).

use std::ffi::OsString;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{ExitCode, Stdio};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, recvmsg, sendmsg,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::{Instant, sleep, sleep_until};

use crate::cgroup::JobCgroup;

/// `argv[1]` of the watcher mode (see [`start_watcher`]).
pub(crate) const WATCHER_ARG: &str = "__simba-watcher-1";
/// `argv[1]` of the start mode (see [`start_main`]).
pub(crate) const START_ARG: &str = "__simba-start-1";
/// `argv[1]` of the guardian mode: no clap subcommand, never shown in help. The version
/// suffix keeps a guardian from a different protocol from misreading the set-up.
pub(crate) const ARG: &str = "__simba-guardian-1";

/// How often the guardian looks whether the group is empty while it is ending it (a member
/// reaped by another member of the group tells the guardian nothing).
const POLL_KILLING: Duration = Duration::from_millis(2);
/// The same while the group is being asked to stop, or after the command ended.
const POLL_STOPPING: Duration = Duration::from_millis(10);
/// Longest set-up line accepted.
const MAX_SETUP: usize = 4096;
/// The most lock files the set-up carries: one per mutex of a multi-lock (SQLite).
pub(crate) const MAX_ANCHORS: usize = simba_core::MAX_MULTI_LOCK_NAMES;
/// The command's environment variable listing the descriptors (comma separated) of the
/// SQLite lock files it inherits; while any process of the job has them open, the mutex
/// stays locked.
pub(crate) const LOCK_FDS_ENV: &str = "SIMBA_LOCK_FDS";

/// Why the group is gone, as the guardian reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gone {
    /// The command ended and no process of its group was left.
    Ended,
    /// The command ended, members of its group were left, and were stopped.
    Leftovers,
    /// simba asked for it to be stopped.
    Stopped,
    /// The local lease deadline passed without news from simba: SIGKILL at the deadline.
    Deadline,
    /// simba was gone: SIGKILL at once (simba never reads this one).
    Orphaned,
}

impl Gone {
    fn word(self) -> &'static str {
        match self {
            Gone::Ended => "ended",
            Gone::Leftovers => "leftovers",
            Gone::Stopped => "stopped",
            Gone::Deadline => "deadline",
            Gone::Orphaned => "orphaned",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<Gone> {
        [
            Gone::Ended,
            Gone::Leftovers,
            Gone::Stopped,
            Gone::Deadline,
            Gone::Orphaned,
        ]
        .into_iter()
        .find(|g| g.word() == s)
    }
}

/// Now on CLOCK_MONOTONIC, in nanoseconds: the clock simba and its guardian share.
pub(crate) fn monotonic_ns() -> u128 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let secs = u128::try_from(t.tv_sec).unwrap_or(0);
    let nanos = u128::try_from(t.tv_nsec).unwrap_or(0);
    secs * 1_000_000_000 + nanos
}

/// `at` (this process's monotonic clock) as an absolute CLOCK_MONOTONIC instant. Rounded
/// down: read the distance first, the clock after.
pub(crate) fn to_monotonic_ns(at: Instant) -> u128 {
    let left = at.saturating_duration_since(Instant::now());
    monotonic_ns() + left.as_nanos()
}

/// The local instant of an absolute CLOCK_MONOTONIC instant.
fn from_monotonic_ns(ns: u128) -> Instant {
    let left = ns.saturating_sub(monotonic_ns());
    Instant::now() + Duration::from_nanos(u64::try_from(left).unwrap_or(u64::MAX / 2))
}

/// Sends the set-up line with `fds` attached (simba's side).
pub(crate) fn send_setup(
    link: &impl AsFd,
    grace: Duration,
    deadline: Option<Instant>,
    fds: &[BorrowedFd<'_>],
    job_bytes: &[Option<u64>],
    foreground: Option<i32>,
) -> std::io::Result<()> {
    let deadline = deadline.map_or_else(|| "-".to_owned(), |d| to_monotonic_ns(d).to_string());
    let jobs = if job_bytes.is_empty() {
        "-".to_owned()
    } else {
        let each: Vec<String> = job_bytes
            .iter()
            .map(|j| j.map_or_else(|| "-".to_owned(), |b| b.to_string()))
            .collect();
        each.join(",")
    };
    let foreground = foreground.map_or_else(|| "-".to_owned(), |g| g.to_string());
    let line = format!(
        "setup {} {deadline} {jobs} {foreground}\n",
        grace.as_millis()
    );
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1 + MAX_ANCHORS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(std::io::Error::other(
            "too many descriptors for the guardian",
        ));
    }
    let bytes = line.as_bytes();
    let sent = sendmsg(
        link,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    let mut rest = &bytes[sent..];
    while !rest.is_empty() {
        let n = rustix::net::send(link, rest, SendFlags::NOSIGNAL)?;
        rest = &rest[n..];
    }
    Ok(())
}

/// The set-up as the guardian reads it.
struct Setup {
    grace: Duration,
    deadline: Option<Instant>,
    stdin: OwnedFd,
    /// SQLite's lock files (one per mutex), held until the guardian exits.
    anchors: Vec<OwnedFd>,
    /// For each anchor, the byte of its file that the job's processes lock (see
    /// [`lock_job_bytes`]), if any.
    job_bytes: Vec<Option<u64>>,
    /// simba's process group, when it had the terminal's foreground: the command takes it
    /// over before it runs (see [`start_main`]).
    foreground: Option<i32>,
}

fn receive_setup(link: &OwnedFd) -> Result<Setup, String> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1 + MAX_ANCHORS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut buf = [0u8; 512];
    let mut line = Vec::new();
    let mut fds: Vec<OwnedFd> = Vec::new();
    loop {
        let got = recvmsg(
            link,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::empty(),
        )
        .map_err(|e| format!("reading the set-up from simba: {e}"))?;
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = msg {
                fds.extend(received);
            }
        }
        if got.bytes == 0 {
            return Err("simba closed the link before the set-up".to_owned());
        }
        line.extend_from_slice(&buf[..got.bytes.min(buf.len())]);
        if let Some(end) = line.iter().position(|&b| b == b'\n') {
            line.truncate(end);
            break;
        }
        if line.len() > MAX_SETUP {
            return Err("the set-up line is too long".to_owned());
        }
    }
    // The command must inherit none of them but the standard input it is given.
    for fd in &fds {
        rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::CLOEXEC)
            .map_err(|e| format!("close-on-exec on a received descriptor: {e}"))?;
    }
    let line = String::from_utf8_lossy(&line).into_owned();
    let bad = || format!("bad set-up line {line:?}");
    let parts: Vec<&str> = line.split(' ').collect();
    let [tag, grace, deadline, jobs, foreground] = parts[..] else {
        return Err(bad());
    };
    if tag != "setup" {
        return Err(bad());
    }
    let grace = Duration::from_millis(grace.parse().map_err(|_| bad())?);
    let deadline = match deadline {
        "-" => None,
        ns => Some(from_monotonic_ns(ns.parse().map_err(|_| bad())?)),
    };
    let mut fds = fds.into_iter();
    let stdin = fds
        .next()
        .ok_or_else(|| "no standard input came with the set-up".to_owned())?;
    let anchors: Vec<OwnedFd> = fds.collect();
    let job_bytes = match jobs {
        "-" => vec![None; anchors.len()],
        list => list
            .split(',')
            .map(|j| match j {
                "-" => Ok(None),
                b => b.parse().map(Some).map_err(|_| bad()),
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
    if job_bytes.len() != anchors.len() {
        return Err(bad());
    }
    let foreground = match foreground {
        "-" => None,
        g => Some(g.parse().map_err(|_| bad())?),
    };
    Ok(Setup {
        grace,
        deadline,
        stdin,
        anchors,
        job_bytes,
        foreground,
    })
}

/// The guardian mode's `main`: `argv` is what follows [`ARG`] (`--`, the command and its
/// arguments). Standard input is the link to simba.
pub(crate) fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().skip(2).collect();
    match run(argv) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say!("simba (guardian): {e}");
            ExitCode::from(crate::status::Status::Internal.code())
        }
    }
}

fn run(mut argv: Vec<OsString>) -> Result<(), String> {
    if argv.first().is_some_and(|a| a == "--") {
        argv.remove(0);
    }
    let link = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| format!("the link to simba: {e}"))?;
    let setup = receive_setup(&link)?;
    #[cfg(target_os = "linux")]
    {
        // `ps` shows the guardian as `simba-guardian`, not `exe` (/proc/self/exe).
        let _ = nix::sys::prctl::set_name(c"simba-guardian");
        // Orphans of the group become the guardian's children, so it reaps them itself and
        // knows at once when the last is gone (and no zombie waits on a busy init).
        if let Err(e) = rustix::process::set_child_subreaper(Some(rustix::process::getpid())) {
            tracing::debug!("cannot become a child subreaper: {e}");
        }
    }
    // The job's own cgroup, when one can be made; its watcher is forked now, while the
    // guardian has one thread.
    let cgroup = match JobCgroup::create() {
        Ok(cg) => Some(cg),
        Err(why) => {
            tracing::debug!("no cgroup for the job: {why}");
            None
        }
    };
    let watcher = cgroup.as_ref().and_then(|cg| start_watcher(cg.dir()));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let link = std::os::unix::net::UnixStream::from(link);
    let r = runtime.block_on(guard(link, argv, setup, cgroup, watcher.as_ref()));
    // The watcher reads end-of-file now and exits (the cgroup is gone already).
    drop(watcher);
    r
}

/// Starts the cgroup's watcher: simba once more (`simba-watcher`), in a process group of
/// its own, outside the job's cgroup, that SIGKILLs the whole cgroup (`cgroup.kill`) when
/// the guardian is gone (the pipe returned here reads end-of-file, however the guardian
/// died) or when the last local lease deadline the guardian passed on is over (simba and
/// the guardian both stopped). Returns the pipe's writing end; `None` when it cannot start.
fn start_watcher(dir: &std::path::Path) -> Option<std::io::PipeWriter> {
    let (reader, writer) = std::io::pipe().ok()?;
    // A stopped watcher must never block the guardian.
    let _ = rustix::io::ioctl_fionbio(&writer, true);
    let spawned = std::process::Command::new(crate::child::this_binary().ok()?)
        .arg0("simba-watcher")
        .arg(WATCHER_ARG)
        .arg(dir)
        .stdin(Stdio::from(OwnedFd::from(reader)))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
    match spawned {
        // Not waited for: the guardian, a subreaper, reaps it with the rest.
        Ok(_) => Some(writer),
        Err(e) => {
            tracing::debug!("cannot start the cgroup watcher: {e}");
            None
        }
    }
}

/// The watcher mode's `main` (see [`start_watcher`]): `argv[2]` is the cgroup's directory,
/// standard input the pipe from the guardian.
pub(crate) fn watcher_main() -> ExitCode {
    let Some(dir) = std::env::args_os().nth(2).map(std::path::PathBuf::from) else {
        return ExitCode::FAILURE;
    };
    #[cfg(target_os = "linux")]
    let _ = nix::sys::prctl::set_name(c"simba-watcher");
    let (tx, rx) = std::sync::mpsc::channel::<std::time::Instant>();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if let Some(ns) = line
                .strip_prefix("deadline ")
                .and_then(|v| v.parse::<u128>().ok())
            {
                let left = ns.saturating_sub(monotonic_ns());
                let left = Duration::from_nanos(u64::try_from(left).unwrap_or(u64::MAX / 2));
                if tx.send(std::time::Instant::now() + left).is_err() {
                    break;
                }
            }
        }
        // Dropping `tx` tells the main thread that the guardian is gone.
    });
    let mut deadline: Option<std::time::Instant> = None;
    loop {
        let got = match deadline {
            Some(at) => rx.recv_timeout(at.saturating_duration_since(std::time::Instant::now())),
            None => rx
                .recv()
                .map_err(|_| std::sync::mpsc::RecvTimeoutError::Disconnected),
        };
        match got {
            Ok(at) => deadline = Some(at),
            Err(_) => break,
        }
    }
    // The guardian is gone, or the deadline passed without a newer one.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while crate::cgroup::populated(&dir) && std::time::Instant::now() < until {
        crate::cgroup::kill(&dir);
        std::thread::sleep(Duration::from_millis(5));
    }
    crate::cgroup::remove(&dir);
    ExitCode::SUCCESS
}

/// The start mode's `main`: the command's own process before it becomes the command
/// (`argv`: [`START_ARG`], the guardian's pid, the status pipe's descriptor, the cgroup
/// directory or `-`, `--`, the command). It asks for SIGKILL when the guardian dies (and
/// checks after asking that the guardian is still its parent), joins the job's cgroup, and
/// execs the command; an exec that fails is reported on the status pipe, which closes by
/// itself on success (close-on-exec).
pub(crate) fn start_main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().skip(2).collect();
    let [
        guardian,
        status,
        dir,
        foreground,
        _dashes,
        program,
        rest @ ..,
    ] = &args[..]
    else {
        say!("simba (start): bad arguments");
        return ExitCode::from(crate::status::Status::Internal.code());
    };
    let status_fd = status.to_str().and_then(|s| s.parse::<RawFd>().ok());
    // The status pipe, opened anew close-on-exec; the inherited descriptor is closed so
    // that the command does not keep the pipe open.
    let mut report = status_fd.and_then(|fd| {
        let file = std::fs::File::options()
            .write(true)
            .open(format!("/proc/self/fd/{fd}"))
            .ok();
        let _ = nix::unistd::close(fd);
        file
    });
    #[cfg(target_os = "linux")]
    {
        let parent = guardian
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
            .and_then(rustix::process::Pid::from_raw);
        let asked =
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
        if asked.is_err() || rustix::process::getppid() != parent {
            // The guardian died already (or cannot be tied to): the command must not run.
            if let Some(f) = report.as_mut() {
                use std::io::Write as _;
                let _ = writeln!(f, "cannotrun the guardian died before the command started");
            }
            return ExitCode::from(crate::status::Status::Internal.code());
        }
    }
    if dir != "-" {
        // A failure leaves the command in the guardian's cgroup: the process group still
        // covers it.
        let _ = std::fs::write(std::path::Path::new(dir).join("cgroup.procs"), "0");
    }
    if let Some(simba) = foreground.to_str().and_then(|s| s.parse::<i32>().ok()) {
        take_terminal_from(Pid::from_raw(simba));
    }
    let e = std::process::Command::new(program).args(rest).exec();
    let kind = match e.kind() {
        std::io::ErrorKind::NotFound => "notfound",
        _ => "cannotrun",
    };
    if let Some(f) = report.as_mut() {
        use std::io::Write as _;
        let _ = writeln!(f, "{kind} {}", e.to_string().replace('\n', " "));
    }
    ExitCode::from(crate::status::Status::CannotRun.code())
}

/// The start mode's hand-over of the terminal: when simba's group `simba` is still the
/// foreground of the terminal on standard input, this process's group (the command's)
/// becomes it, before the command runs. So the command never runs in the background
/// first (a read there would stop it, and the SIGCONT after a later hand-over would
/// cancel a Ctrl-Z typed meanwhile). SIGTTOU is blocked for the call (this process is
/// in a background group until it succeeds: `crate::child::set_foreground`), the mask
/// restored before the exec.
fn take_terminal_from(simba: Pid) {
    if crate::child::stdin_foreground() == Some(simba) {
        // Best effort: failing that, simba hands the terminal over once the command runs.
        let _ = crate::child::set_foreground(nix::unistd::getpgrp());
    }
}

/// Locks the job byte of each anchor that has one, each on a new open file description
/// of the anchor's file (reopened through `/proc/self/fd`), inheritable, for the command
/// alone. SQLite (simba-jdbc) then takes the owner's row from nobody while any process
/// of the job lives, not even after the lease (see simba-jdbc's `DbFile::check_job`).
///
/// Closing these descriptors in the guardian is safe: it holds no other lock of the
/// file's but the anchors' OFD locks, which a close of another description leaves alone.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn lock_job_bytes(anchors: &[OwnedFd], job_bytes: &[Option<u64>]) -> Result<Vec<OwnedFd>, String> {
    use nix::fcntl::{FcntlArg, fcntl};
    use nix::libc;
    let mut jobs = Vec::new();
    for (anchor, job) in anchors.iter().zip(job_bytes) {
        let Some(offset) = *job else {
            continue;
        };
        let offset = libc::off_t::try_from(offset)
            .map_err(|_| format!("a job byte out of range: {offset}"))?;
        let path = format!("/proc/self/fd/{}", anchor.as_raw_fd());
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("cannot open the database file again ({path}): {e}"))?;
        let byte = libc::flock {
            l_type: libc::F_WRLCK as libc::c_short,
            l_whence: libc::SEEK_SET as libc::c_short,
            l_start: offset,
            l_len: 1,
            l_pid: 0,
        };
        loop {
            match fcntl(&file, FcntlArg::F_OFD_SETLK(&byte)) {
                Ok(_) => break,
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN | Errno::EACCES) => {
                    return Err(format!(
                        "a process of an earlier job of this mutex still runs (it holds byte \
                         {offset} of the database file); the command is not started"
                    ));
                }
                Err(e) => return Err(format!("cannot lock byte {offset} of {path}: {e}")),
            }
        }
        let fd = OwnedFd::from(file);
        rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::empty())
            .map_err(|e| format!("cannot pass a job lock on to the command: {e}"))?;
        jobs.push(fd);
    }
    Ok(jobs)
}

/// No job bytes outside Linux (simba-jdbc's lock files there name none).
#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn lock_job_bytes(
    _anchors: &[OwnedFd],
    _job_bytes: &[Option<u64>],
) -> Result<Vec<OwnedFd>, String> {
    Ok(Vec::new())
}

/// Starts the command through the start mode (see [`start_main`]); its pid, or the
/// `failed …` line for simba.
fn start_command(
    argv: &[OsString],
    stdin: OwnedFd,
    cgroup: Option<&JobCgroup>,
    lock_fds: &str,
    foreground: Option<i32>,
) -> Result<u32, String> {
    let failed = |kind: &str, e: &dyn std::fmt::Display| {
        format!("failed {kind} {}\n", e.to_string().replace('\n', " "))
    };
    let exe = crate::child::this_binary().map_err(|e| failed("cannotrun", &e))?;
    let (mut reader, writer) = std::io::pipe().map_err(|e| failed("cannotrun", &e))?;
    // The one descriptor the start mode inherits besides the standard ones and SQLite's.
    rustix::io::fcntl_setfd(&writer, rustix::io::FdFlags::empty())
        .map_err(|e| failed("cannotrun", &e))?;
    let mut cmd = std::process::Command::new(exe);
    // `ps` shows the command's name during the moment before its exec.
    cmd.arg0(argv.first().cloned().unwrap_or_default())
        .arg(START_ARG)
        .arg(rustix::process::getpid().as_raw_nonzero().get().to_string())
        .arg(writer.as_raw_fd().to_string())
        .arg(cgroup.map_or_else(|| OsString::from("-"), |c| c.dir().as_os_str().to_owned()))
        .arg(foreground.map_or_else(|| "-".to_owned(), |g| g.to_string()))
        .arg("--")
        .args(argv)
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .process_group(0);
    if !lock_fds.is_empty() {
        cmd.env(LOCK_FDS_ENV, lock_fds);
    }
    let spawned = cmd.spawn();
    drop(cmd);
    drop(writer);
    let child = spawned.map_err(|e| failed("cannotrun", &e))?;
    // End-of-file: the exec succeeded (the pipe is close-on-exec in the start mode).
    let mut said = String::new();
    let _ = std::io::Read::read_to_string(&mut reader, &mut said);
    let said = said.trim();
    if said.is_empty() {
        // Dropping a std Child neither kills nor waits: the guardian reaps it.
        return Ok(child.id());
    }
    let (kind, message) = said.split_once(' ').unwrap_or((said, ""));
    Err(failed(kind, &message))
}

/// What the guardian is doing with the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The command runs.
    Running,
    /// SIGTERM sent; SIGKILL at the end of the grace period.
    Stopping,
    /// SIGKILL sent: waiting for the group to be empty.
    Killing,
}

struct Watch {
    /// The job's cgroup, when there is one: kills and the last-process check cover it too.
    cgroup: Option<JobCgroup>,
    pgid: Pid,
    pid: i32,
    status: Option<i32>,
    phase: Phase,
    why: Option<Gone>,
    kill_at: Option<Instant>,
}

impl Watch {
    fn alive(&self) -> bool {
        self.cgroup.as_ref().is_some_and(JobCgroup::populated)
            || !matches!(killpg(self.pgid, None), Err(Errno::ESRCH))
    }

    /// `sig` to the whole job: the cgroup's processes (those that left the group: `setsid`,
    /// `su`) and the group.
    fn send_all(&self, sig: Signal) {
        if let Some(cg) = &self.cgroup {
            if sig == Signal::SIGKILL {
                cg.kill();
            } else {
                cg.signal(sig);
            }
        }
        self.send(sig);
    }

    fn send(&self, sig: Signal) {
        match killpg(self.pgid, sig) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => say!("simba (guardian): cannot send {sig} to the command's group: {e}"),
        }
    }

    fn kill(&mut self, why: Gone) {
        if self.phase != Phase::Killing {
            self.send_all(Signal::SIGKILL);
            self.phase = Phase::Killing;
            self.why.get_or_insert(why);
        }
    }

    fn stop(&mut self, grace: Duration, why: Gone) {
        if self.phase != Phase::Running {
            return;
        }
        self.why = Some(why);
        if grace.is_zero() {
            self.kill(why);
            return;
        }
        self.send_all(Signal::SIGTERM);
        // A stopped process acts on SIGTERM only once continued.
        self.send_all(Signal::SIGCONT);
        self.phase = Phase::Stopping;
        self.kill_at = Some(Instant::now() + grace);
    }

    /// Reaps every child that has ended (orphans of the group included, as subreaper);
    /// returns the command's wait status when it was among them, and the signal that
    /// stopped the command for the terminal (SIGTSTP, SIGTTIN, SIGTTOU) when it did.
    fn reap(&mut self) -> (Option<i32>, Option<i32>) {
        use rustix::process::WaitOptions;
        let mut exited = None;
        let mut stopped = None;
        loop {
            match rustix::process::wait(WaitOptions::NOHANG | WaitOptions::UNTRACED) {
                Ok(Some((pid, status))) => {
                    if pid.as_raw_nonzero().get() != self.pid {
                        continue;
                    }
                    if let Some(sig) = status.stopping_signal() {
                        if [Signal::SIGTSTP, Signal::SIGTTIN, Signal::SIGTTOU]
                            .iter()
                            .any(|s| *s as i32 == sig)
                        {
                            stopped = Some(sig);
                        }
                        continue;
                    }
                    self.status = Some(status.as_raw());
                    exited = Some(status.as_raw());
                }
                Ok(None) | Err(_) => return (exited, stopped),
            }
        }
    }
}

async fn guard(
    link: std::os::unix::net::UnixStream,
    argv: Vec<OsString>,
    setup: Setup,
    cgroup: Option<JobCgroup>,
    watcher: Option<&std::io::PipeWriter>,
) -> Result<(), String> {
    let Setup {
        grace,
        mut deadline,
        stdin,
        anchors,
        job_bytes,
        foreground,
    } = setup;
    let registered = |kind: SignalKind| {
        signal(kind).map_err(|e| format!("cannot install a signal handler: {e}"))
    };
    let mut child = registered(SignalKind::child())?;
    // Ignored: simba passes these on to the command; caught (not SIG_IGN) so the command
    // does not inherit them ignored.
    let mut int = registered(SignalKind::interrupt())?;
    let mut term = registered(SignalKind::terminate())?;
    let mut hup = registered(SignalKind::hangup())?;
    let mut quit = registered(SignalKind::quit())?;

    link.set_nonblocking(true)
        .map_err(|e| format!("the link to simba: {e}"))?;
    let link =
        tokio::net::UnixStream::from_std(link).map_err(|e| format!("the link to simba: {e}"))?;
    let (read, mut write) = link.into_split();
    let mut lines = BufReader::new(read).lines();

    if argv.is_empty() {
        let _ = write.write_all(b"failed cannotrun no command\n").await;
        return Ok(());
    };
    let tell_watcher = |deadline: Option<Instant>| {
        if let (Some(mut pipe), Some(at)) = (watcher, deadline) {
            use std::io::Write as _;
            let _ = writeln!(pipe, "deadline {}", to_monotonic_ns(at));
        }
    };
    tell_watcher(deadline);
    // SQLite's lock files go with the command: while any process of the job has one open,
    // the mutex stays locked, whatever happens to simba and the guardian.
    let mut inherited = Vec::new();
    for a in &anchors {
        rustix::io::fcntl_setfd(a, rustix::io::FdFlags::empty())
            .map_err(|e| format!("cannot pass a lock file on to the command: {e}"))?;
        inherited.push(a.as_raw_fd().to_string());
    }
    // The job bytes: on descriptions of the guardian's own, handed to the command only
    // (closed here once it runs), so that the job's processes, and nothing of simba's,
    // keep the mutex past the lease.
    let started = match lock_job_bytes(&anchors, &job_bytes) {
        Ok(jobs) => {
            inherited.extend(jobs.iter().map(|j| j.as_raw_fd().to_string()));
            start_command(
                &argv,
                stdin,
                cgroup.as_ref(),
                &inherited.join(","),
                foreground,
            )
            // `jobs` dropped here: the command has its copies (or failed to start), the
            // job bytes are its alone.
        }
        Err(e) => Err(format!("failed cannotrun {}\n", e.replace('\n', " "))),
    };
    let pid = match started {
        Ok(pid) => pid,
        Err(line) => {
            let _ = write.write_all(line.as_bytes()).await;
            if let Some(cg) = cgroup {
                cg.remove();
            }
            return Ok(());
        }
    };
    let pid = i32::try_from(pid).map_err(|_| format!("a process id out of range: {pid}"))?;
    let mut w = Watch {
        cgroup,
        pgid: Pid::from_raw(pid),
        pid,
        status: None,
        phase: Phase::Running,
        why: None,
        kill_at: None,
    };
    // simba may be gone by now: the first read below says so.
    let _ = write.write_all(format!("started {pid}\n").as_bytes()).await;
    let mut simba_gone = false;

    loop {
        let (exited, stopped) = w.reap();
        if let Some(sig) = stopped
            && w.status.is_none()
            && !simba_gone
        {
            // Stopped for the terminal (Ctrl-Z, a read from the background): simba stops
            // itself the same way, so that its shell sees the job stopped.
            let _ = write.write_all(format!("stopped {sig}\n").as_bytes()).await;
        }
        if let Some(raw) = exited {
            let _ = write.write_all(format!("exited {raw}\n").as_bytes()).await;
        }
        // The deadline passed (the watcher may have acted on it a moment before the
        // timer below): the deadline ends the job, not a leftover stop.
        if deadline.is_some_and(|d| Instant::now() >= d) && w.phase != Phase::Killing {
            w.kill(Gone::Deadline);
            w.why = Some(Gone::Deadline);
        }
        if w.status.is_some() {
            if !w.alive() {
                break;
            }
            // The command ended; members of its group still run.
            if w.phase == Phase::Running {
                w.stop(grace, Gone::Leftovers);
            }
        }
        let poll = match (w.phase, w.status) {
            (Phase::Killing, _) => Some(POLL_KILLING),
            (Phase::Running, None) => None,
            _ => Some(POLL_STOPPING),
        };
        tokio::select! {
            biased;
            line = lines.next_line(), if !simba_gone => match line {
                Ok(Some(line)) => {
                    handle(&line, &mut w, &mut deadline);
                    tell_watcher(deadline);
                }
                // simba is gone, however it died.
                Ok(None) | Err(_) => {
                    simba_gone = true;
                    w.kill(Gone::Orphaned);
                }
            },
            _ = child.recv() => {}
            () = sleep_until_opt(deadline), if w.phase != Phase::Killing => {
                w.kill(Gone::Deadline);
                w.why = Some(Gone::Deadline);
            }
            () = sleep_until_opt(w.kill_at), if w.phase == Phase::Stopping => {
                w.kill(w.why.unwrap_or(Gone::Stopped));
            }
            () = sleep(poll.unwrap_or(Duration::ZERO)), if poll.is_some() => {}
            _ = int.recv() => {}
            _ = term.recv() => {}
            _ = hup.recv() => {}
            _ = quit.recv() => {}
        }
    }
    // Killed at the deadline by the watcher, a moment before the guardian's own timer:
    // the deadline's doing all the same.
    let past_deadline = deadline.is_some_and(|d| Instant::now() >= d);
    let why = w.why.unwrap_or(if past_deadline {
        Gone::Deadline
    } else {
        Gone::Ended
    });
    let _ = write
        .write_all(format!("gone {}\n", why.word()).as_bytes())
        .await;
    // Only now may the lock files go (SQLite): no process of the job is left.
    drop(anchors);
    if let Some(cg) = w.cgroup.take() {
        cg.remove();
    }
    Ok(())
}

/// Acts on one line from simba.
fn handle(line: &str, w: &mut Watch, deadline: &mut Option<Instant>) {
    let (word, value) = line.split_once(' ').unwrap_or((line, ""));
    match word {
        "deadline" => {
            if let Ok(ns) = value.parse::<u128>() {
                *deadline = Some(from_monotonic_ns(ns));
            }
        }
        "signal" => {
            if w.phase == Phase::Running
                && let Some(sig) = value
                    .parse::<i32>()
                    .ok()
                    .and_then(|n| Signal::try_from(n).ok())
            {
                w.send(sig);
            }
        }
        "stop" => {
            if let Ok(ms) = value.parse::<u64>() {
                w.stop(Duration::from_millis(ms), Gone::Stopped);
            }
        }
        _ => say!("simba (guardian): unknown request {line:?}"),
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gone_words_read_back() {
        for g in [
            Gone::Ended,
            Gone::Leftovers,
            Gone::Stopped,
            Gone::Deadline,
            Gone::Orphaned,
        ] {
            assert_eq!(Gone::parse(g.word()), Some(g));
        }
        assert_eq!(Gone::parse("nope"), None);
    }

    /// A deadline survives the trip through CLOCK_MONOTONIC nanoseconds (to within the
    /// time the two clock reads take), and one in the past stays in the past.
    #[test]
    fn deadlines_travel_as_monotonic_instants() {
        let at = Instant::now() + Duration::from_secs(5);
        let back = from_monotonic_ns(to_monotonic_ns(at));
        let diff = if back > at { back - at } else { at - back };
        assert!(diff < Duration::from_millis(50), "{diff:?}");
        let past = Instant::now();
        assert!(from_monotonic_ns(to_monotonic_ns(past)) <= Instant::now());
    }
}
