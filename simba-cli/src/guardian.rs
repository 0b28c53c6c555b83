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
//! with the set-up message), so the kernel frees the mutex only once no process of the job
//! is left.
//!
//! The guardian lives in a process group of its own, outside both simba's (a shell's
//! `kill -9 %1` of simba's job does not take it along) and the command's (what is sent to
//! the command's group does not reach it). It ignores SIGINT, SIGTERM, SIGHUP and SIGQUIT:
//! simba passes those on.
//!
//! The protocol is lines of text on the socket. simba → guardian: `deadline NS`,
//! `signal N`, `stop MS`; guardian → simba: `started PID`, `failed KIND MESSAGE`,
//! `exited RAW` (the wait status), `gone WHY`. The first line from simba, `setup GRACE_MS
//! DEADLINE_NS|-`, carries the command's standard input and, on SQLite, the lock files (one
//! per mutex) as SCM_RIGHTS descriptors (the only ones the guardian inherits otherwise are standard
//! input — the socket — and standard output and error).

use std::ffi::OsString;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
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
) -> std::io::Result<()> {
    let deadline = deadline.map_or_else(|| "-".to_owned(), |d| to_monotonic_ns(d).to_string());
    let line = format!("setup {} {deadline}\n", grace.as_millis());
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
    let [tag, grace, deadline] = parts[..] else {
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
    Ok(Setup {
        grace,
        deadline,
        stdin,
        anchors: fds.collect(),
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
        // Orphans of the group become the guardian's children, so it reaps them itself and
        // knows at once when the last is gone (and no zombie waits on a busy init).
        if let Err(e) = rustix::process::set_child_subreaper(Some(rustix::process::getpid())) {
            tracing::debug!("cannot become a child subreaper: {e}");
        }
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let link = std::os::unix::net::UnixStream::from(link);
    runtime.block_on(guard(link, argv, setup))
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
    pgid: Pid,
    pid: i32,
    status: Option<i32>,
    phase: Phase,
    why: Option<Gone>,
    kill_at: Option<Instant>,
}

impl Watch {
    fn alive(&self) -> bool {
        !matches!(killpg(self.pgid, None), Err(Errno::ESRCH))
    }

    fn send(&self, sig: Signal) {
        match killpg(self.pgid, sig) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => say!("simba (guardian): cannot send {sig} to the command's group: {e}"),
        }
    }

    fn kill(&mut self, why: Gone) {
        if self.phase != Phase::Killing {
            self.send(Signal::SIGKILL);
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
        self.send(Signal::SIGTERM);
        // A stopped process acts on SIGTERM only once continued.
        self.send(Signal::SIGCONT);
        self.phase = Phase::Stopping;
        self.kill_at = Some(Instant::now() + grace);
    }

    /// Reaps every child that has ended (orphans of the group included, as subreaper);
    /// returns the command's wait status when it was among them.
    fn reap(&mut self) -> Option<i32> {
        let mut exited = None;
        loop {
            match rustix::process::wait(rustix::process::WaitOptions::NOHANG) {
                Ok(Some((pid, status))) => {
                    if pid.as_raw_nonzero().get() == self.pid {
                        self.status = Some(status.as_raw());
                        exited = Some(status.as_raw());
                    }
                }
                Ok(None) | Err(_) => return exited,
            }
        }
    }
}

async fn guard(
    link: std::os::unix::net::UnixStream,
    argv: Vec<OsString>,
    setup: Setup,
) -> Result<(), String> {
    let Setup {
        grace,
        mut deadline,
        stdin,
        anchors,
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

    let Some((program, args)) = argv.split_first() else {
        let _ = write.write_all(b"failed cannotrun no command\n").await;
        return Ok(());
    };
    let spawned = std::process::Command::new(program)
        .args(args)
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .process_group(0)
        .spawn();
    let pid = match spawned {
        // Dropping a std Child neither kills nor waits: the guardian reaps it below.
        Ok(c) => c.id(),
        Err(e) => {
            let kind = match e.kind() {
                std::io::ErrorKind::NotFound => "notfound",
                _ => "cannotrun",
            };
            let line = format!("failed {kind} {}\n", e.to_string().replace('\n', " "));
            let _ = write.write_all(line.as_bytes()).await;
            return Ok(());
        }
    };
    let pid = i32::try_from(pid).map_err(|_| format!("a process id out of range: {pid}"))?;
    let mut w = Watch {
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
        if let Some(raw) = w.reap() {
            let _ = write.write_all(format!("exited {raw}\n").as_bytes()).await;
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
                Ok(Some(line)) => handle(&line, &mut w, &mut deadline),
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
    let why = w.why.unwrap_or(Gone::Ended);
    let _ = write
        .write_all(format!("gone {}\n", why.word()).as_bytes())
        .await;
    // Only now may the lock files go (SQLite): no process of the job is left.
    drop(anchors);
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
