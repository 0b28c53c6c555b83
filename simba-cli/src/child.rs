//! The command run by `exec`: its guardian, its own process group, signals, and the
//! terminal.
//!
//! The command is not simba's child but its guardian's (see [`crate::guardian`]): simba
//! talks to the guardian over a socket pair, hands it every new local lease deadline, and
//! asks it to pass signals on and to stop the group.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep, timeout};
use tracing::{debug, warn};

use crate::guardian::{self, Gone};
use crate::status::{Failure, Status};

/// How often the group is checked for remaining members when simba has to end it itself
/// (its guardian died).
const POLL: Duration = Duration::from_millis(25);
/// How long to wait for the group to disappear after SIGKILL.
const AFTER_KILL: Duration = Duration::from_secs(2);
/// How long the guardian may take to start the command and say so.
const START_LIMIT: Duration = Duration::from_secs(30);
/// How long the guardian may take to exit once it said the group is gone.
const GUARDIAN_EXIT: Duration = Duration::from_secs(2);

/// What `exec` hands the guardian besides the command.
#[derive(Debug)]
pub(crate) struct Guarding {
    /// SIGTERM to SIGKILL when the group is stopped.
    pub(crate) grace: Duration,
    /// The local lease deadline at the start.
    pub(crate) deadline: Option<Instant>,
    /// SQLite's native locks (a description per mutex), held by the guardian until the
    /// group is gone. Sent as borrowed descriptors: simba itself never closes them (see
    /// `Connection::owner_anchor`).
    pub(crate) anchors: Vec<simba_core::connect::Anchor>,
}

/// How the command's group ended.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ended {
    /// The command's exit status.
    pub(crate) status: ExitStatus,
    /// How its group ended.
    pub(crate) gone: Gone,
}

/// A running command, leader of its own process group, and its guardian.
#[derive(Debug)]
pub(crate) struct Group {
    guardian: Child,
    lines: Lines<BufReader<OwnedReadHalf>>,
    link: OwnedWriteHalf,
    pgid: Pid,
    status: Option<ExitStatus>,
    gone: Option<Gone>,
    /// The guardian's link ended without `gone`.
    lost_guardian: bool,
    terminal: bool,
    /// The last deadline handed to the guardian.
    deadline: Option<Instant>,
    /// SIGCONT to simba (its shell's `fg` or `bg`), when it could be listened to.
    cont: Option<tokio::signal::unix::Signal>,
}

/// The program to start as the guardian: this very binary.
pub(crate) fn this_binary() -> std::io::Result<std::path::PathBuf> {
    if cfg!(target_os = "linux") {
        // The running file, even if it was replaced or removed on disk since.
        Ok("/proc/self/exe".into())
    } else {
        std::env::current_exe()
    }
}

fn internal(e: std::io::Error, what: &str) -> Failure {
    Failure::with(Status::Internal, e, what)
}

/// Starts `argv` under a guardian, in a new process group, with `env` added to its
/// environment, and returns once it runs.
///
/// When simba runs in the terminal's foreground with stdin on the terminal (started from
/// an interactive shell), the terminal's foreground is handed to the command's group, so
/// that it can read the terminal (a process of a background group that reads it is
/// stopped) and gets Ctrl-C directly; simba takes it back when the command ends.
pub(crate) async fn spawn(
    argv: &[OsString],
    env: &[(String, String)],
    unset: &[OsString],
    guarding: Guarding,
) -> Result<Group, Failure> {
    if argv.is_empty() {
        return Err(Failure::usage("no command given after `--`"));
    }
    // Listened to from before the command starts: a Ctrl-Z that stops simba itself while it
    // starts the command is followed by a SIGCONT that must not be missed.
    let cont = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::from_raw(
        Signal::SIGCONT as i32,
    ))
    .map_err(|e| debug!("cannot listen to SIGCONT: {e}"))
    .ok();
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| internal(e, "cannot make the link to the guardian"))?;
    let exe = this_binary().map_err(|e| internal(e, "cannot find simba's own binary"))?;
    let guardian = {
        let mut cmd = Command::new(exe);
        // `ps` shows `simba-guardian __simba-guardian-1 -- COMMAND…`, not `/proc/self/exe`.
        cmd.arg0("simba-guardian")
            .arg(guardian::ARG)
            .arg("--")
            .args(argv)
            .envs(env.iter().map(|(k, v)| (k, v)));
        for name in unset {
            cmd.env_remove(name);
        }
        cmd.stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            // A group of its own: neither simba's (a kill of simba's job leaves it) nor
            // the command's.
            .process_group(0)
            .kill_on_drop(false);
        cmd.spawn()
            .map_err(|e| internal(e, "cannot start the command's guardian"))?
        // `cmd` goes here, and with it simba's copy of the guardian's end of the link.
    };
    let stdin = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| internal(e, "cannot pass standard input on"))?;
    let mut fds = vec![stdin.as_fd()];
    fds.extend(guarding.anchors.iter().map(AsFd::as_fd));
    let job_bytes: Vec<Option<u64>> = guarding.anchors.iter().map(|a| a.job_byte()).collect();
    // simba in the terminal's foreground: the command gets it before it runs (its start
    // mode hands it over before the exec), so that it never runs in the background first.
    let foreground = own_foreground();
    guardian::send_setup(
        &ours,
        guarding.grace,
        guarding.deadline,
        &fds,
        &job_bytes,
        foreground,
    )
    .map_err(|e| internal(e, "cannot set up the command's guardian"))?;
    // The guardian has its own copies now.
    drop(fds);
    drop(stdin);
    drop(guarding.anchors);
    ours.set_nonblocking(true)
        .map_err(|e| internal(e, "the link to the guardian"))?;
    let link = tokio::net::UnixStream::from_std(ours)
        .map_err(|e| internal(e, "the link to the guardian"))?;
    let (read, write) = link.into_split();
    let mut lines = BufReader::new(read).lines();

    let first = timeout(START_LIMIT, lines.next_line()).await;
    let line = match first {
        Ok(Ok(Some(line))) => line,
        Ok(Ok(None)) | Ok(Err(_)) => {
            return Err(Failure::new(
                Status::Internal,
                "the command's guardian ended before starting the command",
            ));
        }
        Err(_) => {
            return Err(Failure::new(
                Status::Internal,
                format!("the command's guardian did not start it within {START_LIMIT:?}"),
            ));
        }
    };
    let shown = argv[0].to_string_lossy();
    let (word, rest) = line.split_once(' ').unwrap_or((&line, ""));
    let pid = match word {
        "started" => rest.parse::<i32>().ok(),
        "failed" => {
            let (kind, message) = rest.split_once(' ').unwrap_or((rest, ""));
            let status = match kind {
                "notfound" => Status::NotFound,
                _ => Status::CannotRun,
            };
            return Err(Failure::new(
                status,
                format!("cannot run `{shown}`: {message}"),
            ));
        }
        _ => None,
    };
    let Some(pid) = pid else {
        return Err(Failure::new(
            Status::Internal,
            format!("the command's guardian said {line:?} instead of the command's pid"),
        ));
    };
    let pgid = Pid::from_raw(pid);
    // Handed over by the start mode (or, should that have failed, here).
    let terminal = holds_terminal(pgid) || hand_terminal(pgid);
    debug!(
        pid,
        guardian = guardian.id(),
        terminal,
        "command started in its own process group, under its guardian"
    );
    Ok(Group {
        guardian,
        lines,
        link: write,
        pgid,
        status: None,
        gone: None,
        lost_guardian: false,
        terminal,
        deadline: guarding.deadline,
        cont,
    })
}

impl Group {
    /// The process group id (the command's pid).
    pub(crate) fn pgid(&self) -> i32 {
        self.pgid.as_raw()
    }

    async fn tell(&mut self, line: String) {
        if let Err(e) = self.link.write_all(line.as_bytes()).await {
            debug!("cannot reach the guardian: {e}");
        }
    }

    /// Hands the guardian a new local lease deadline (nothing when it is not later than the
    /// last one handed over).
    pub(crate) async fn set_deadline(&mut self, at: Instant) {
        if self.deadline.is_some_and(|d| d >= at) {
            return;
        }
        self.deadline = Some(at);
        let ns = guardian::to_monotonic_ns(at);
        self.tell(format!("deadline {ns}\n")).await;
    }

    /// Reads the guardian's reports until the group is gone. Cancel safe.
    async fn follow(&mut self) -> std::io::Result<Ended> {
        loop {
            if let (Some(status), Some(gone)) = (self.status, self.gone) {
                // Its exit closes what it held (SQLite's lock file): wait for it, bounded.
                if timeout(GUARDIAN_EXIT, self.guardian.wait()).await.is_err() {
                    warn!("the command's guardian did not exit after its group was gone");
                }
                return Ok(Ended { status, gone });
            }
            if self.lost_guardian {
                return Err(std::io::Error::other(
                    "the command's guardian ended before the command's group",
                ));
            }
            let next = tokio::select! {
                line = self.lines.next_line() => line,
                // `fg` / `bg` of simba's job: the command follows (the terminal, SIGCONT).
                () = continued(&mut self.cont) => {
                    self.resume();
                    continue;
                }
            };
            match next {
                Ok(Some(line)) => {
                    let (word, rest) = line.split_once(' ').unwrap_or((&line, ""));
                    match (word, rest) {
                        ("exited", raw) => match raw.parse::<i32>() {
                            Ok(raw) => self.status = Some(ExitStatus::from_raw(raw)),
                            Err(_) => warn!("the guardian said {line:?}"),
                        },
                        ("stopped", sig) => match sig.parse::<i32>() {
                            Ok(sig) => self.suspend(sig),
                            Err(_) => warn!("the guardian said {line:?}"),
                        },
                        ("gone", why) => match Gone::parse(why) {
                            Some(g) => self.gone = Some(g),
                            None => warn!("the guardian said {line:?}"),
                        },
                        _ => warn!("the guardian said {line:?}"),
                    }
                }
                Ok(None) | Err(_) => self.lost_guardian = true,
            }
        }
    }

    /// Waits for the command to exit and its group to be gone (members it left behind are
    /// stopped by the guardian: SIGTERM, SIGKILL after the grace period). Cancel safe.
    pub(crate) async fn wait(&mut self) -> std::io::Result<Ended> {
        self.follow().await
    }

    /// Sends `signal` to every process of the group (through the guardian, which knows
    /// whether the group is still there).
    pub(crate) async fn signal(&mut self, signal: Signal) {
        debug!(%signal, pgid = self.pgid.as_raw(), "signal to the group");
        self.tell(format!("signal {}\n", signal as i32)).await;
    }

    /// Whether any process of the group is left (zombies count until reaped).
    fn group_alive(&self) -> bool {
        !matches!(killpg(self.pgid, None), Err(Errno::ESRCH))
    }

    /// Stops the whole group: SIGTERM now, SIGKILL after `grace` to whatever is left (by
    /// the guardian, or by simba itself if the guardian is gone), and waits (bounded) until
    /// no process of the group remains.
    ///
    /// Returns how the group ended, if that was seen.
    pub(crate) async fn stop(&mut self, grace: Duration) -> Option<Ended> {
        if self.gone.is_none() && !self.lost_guardian {
            self.tell(format!("stop {}\n", grace.as_millis())).await;
            match timeout(grace + AFTER_KILL, self.follow()).await {
                Ok(Ok(ended)) => return Some(ended),
                Ok(Err(e)) => warn!("{e}; simba ends the group itself"),
                Err(_) => warn!(
                    pgid = self.pgid.as_raw(),
                    "the command's group was not gone {AFTER_KILL:?} after the grace period"
                ),
            }
        } else if let (Some(status), Some(gone)) = (self.status, self.gone) {
            return Some(Ended { status, gone });
        }
        // Without a guardian: SIGKILL from here, and wait for the group (reaped by init).
        match killpg(self.pgid, Signal::SIGKILL) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => warn!("cannot kill the command's process group: {e}"),
        }
        let until = Instant::now() + AFTER_KILL;
        while self.group_alive() && Instant::now() < until {
            sleep(POLL).await;
        }
        if self.group_alive() {
            warn!(
                pgid = self.pgid.as_raw(),
                "processes of the command's group are still there after SIGKILL"
            );
        }
        None
    }

    /// The command was stopped for the terminal (`sig`: SIGTSTP from Ctrl-Z, SIGTTIN or
    /// SIGTTOU from the background): simba takes the terminal back and stops itself the
    /// same way, so that its shell sees the job stopped and can continue it (`fg`, `bg`);
    /// then [`resume`](Self::resume). While simba is stopped nothing renews the lease: the
    /// guardian kills the group at the local lease deadline, as for any stop of simba.
    ///
    /// Synchronous on purpose: the calling thread is the one stopped, and nothing may cancel
    /// the step between the stop and the resume.
    fn suspend(&mut self, sig: i32) {
        let Ok(sig) = Signal::try_from(sig) else {
            return;
        };
        // A report from before simba's last continue (simba itself was stopped meanwhile
        // and has continued the group since): nothing to follow.
        if !process_stopped(self.pgid) {
            debug!(%sig, "a stop report of a command that runs again: nothing to follow");
            return;
        }
        // Stopped for the terminal while simba hands it the terminal: it touched the
        // terminal before the hand-over. It has it now: let it go on (no SIGCONT is sent
        // at the hand-over itself, which would undo a Ctrl-Z that came right after it).
        // Only while its group is still the foreground: otherwise it would stop again.
        if self.terminal
            && matches!(sig, Signal::SIGTTIN | Signal::SIGTTOU)
            && holds_terminal(self.pgid)
        {
            debug!(%sig, "stopped before it was handed the terminal: continued");
            match killpg(self.pgid, Signal::SIGCONT) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(e) => debug!("cannot continue the command's group: {e}"),
            }
            return;
        }
        self.restore_terminal();
        // The kernel drops a terminal stop signal sent to a process of an orphaned process
        // group (no parent in another group of its session: no shell to continue it), and
        // the command would be stopped again at once: SIGSTOP then, which always stops.
        let sig = if has_job_control_parent() {
            sig
        } else {
            Signal::SIGSTOP
        };
        debug!(%sig, "the command was stopped for the terminal: simba stops too");
        // Thread-directed: this thread is stopped before the call returns.
        if let Err(e) = nix::sys::signal::raise(sig) {
            warn!("cannot stop simba along with its command: {e}");
        }
        // The SIGCONT that continued simba also comes from its signal stream, and `follow`
        // resumes then: resuming here too would continue the command twice (a second,
        // stale stop report after `bg`). Without the stream, here.
        if self.cont.is_none() {
            self.resume();
        }
    }

    /// simba was continued (or put in the foreground by its shell): the terminal goes to
    /// the command's group when simba has it, and the group is continued.
    fn resume(&mut self) {
        if self.terminal {
            // It has the terminal and was not stopped by simba: nothing to continue.
            return;
        }
        self.terminal = hand_terminal(self.pgid);
        if self.gone.is_none() {
            match killpg(self.pgid, Signal::SIGCONT) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(e) => debug!("cannot continue the command's group: {e}"),
            }
        }
    }

    /// Gives the terminal back to simba's own process group, if it was handed over.
    pub(crate) fn restore_terminal(&mut self) {
        if std::mem::take(&mut self.terminal) {
            take_terminal_back();
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.restore_terminal();
    }
}

/// The exit status simba reports for the command's `status`: its code, or 128+N when
/// signal N killed it.
pub(crate) fn exit_code(status: ExitStatus) -> u8 {
    if let Some(code) = status.code() {
        return u8::try_from(code & 0xff).unwrap_or(1);
    }
    match status.signal() {
        Some(sig) => u8::try_from(128 + (sig & 0x7f)).unwrap_or(255),
        None => 1,
    }
}

/// Whether `pid` is stopped now (state `T` in `/proc/PID/stat`; elsewhere: assumed).
fn process_stopped(pid: Pid) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('T')),
        Err(_) => !cfg!(target_os = "linux"),
    }
}

/// Waits for simba's next SIGCONT (never, when it cannot be listened to). Cancel safe.
async fn continued(cont: &mut Option<tokio::signal::unix::Signal>) {
    match cont {
        Some(s) => {
            if s.recv().await.is_none() {
                *cont = None;
            }
        }
        None => std::future::pending().await,
    }
}

/// Whether simba's parent is in another process group of simba's session (a shell with
/// job control): only then does a terminal stop signal stop simba.
fn has_job_control_parent() -> bool {
    let parent = nix::unistd::getppid();
    let theirs = nix::unistd::getpgid(Some(parent));
    let session = nix::unistd::getsid(Some(parent));
    matches!(
        (theirs, session, nix::unistd::getsid(None)),
        (Ok(g), Ok(s), Ok(own)) if g != nix::unistd::getpgrp() && s == own
    )
}

/// The foreground process group of the terminal on standard input, when it is one.
pub(crate) fn stdin_foreground() -> Option<Pid> {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return None;
    }
    nix::unistd::tcgetpgrp(stdin.as_fd()).ok()
}

/// Makes `pgid` the foreground of the terminal on standard input, also from a background
/// group of its session: SIGTTOU is blocked on the calling thread for the call (the
/// kernel would stop the caller otherwise), and the thread's mask restored after.
pub(crate) fn set_foreground(pgid: Pid) -> nix::Result<()> {
    use nix::sys::signal::{SigSet, SigmaskHow, pthread_sigmask};
    let mut ttou = SigSet::empty();
    ttou.add(Signal::SIGTTOU);
    let mut before = SigSet::empty();
    pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&ttou), Some(&mut before))?;
    let set = nix::unistd::tcsetpgrp(std::io::stdin().as_fd(), pgid);
    pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&before), None)?;
    set
}

/// simba's process group when it is the foreground of the terminal that is simba's
/// standard input (an interactive shell's foreground job), else `None`.
fn own_foreground() -> Option<i32> {
    let own = nix::unistd::getpgrp();
    (stdin_foreground() == Some(own)).then(|| own.as_raw())
}

/// Whether the terminal on simba's standard input has `pgid` in its foreground.
fn holds_terminal(pgid: Pid) -> bool {
    stdin_foreground() == Some(pgid)
}

/// Hands the terminal's foreground to `pgid` when simba is interactive; see [`spawn`].
fn hand_terminal(pgid: Pid) -> bool {
    if own_foreground().is_none() {
        return false;
    }
    if let Err(e) = nix::unistd::tcsetpgrp(std::io::stdin().as_fd(), pgid) {
        debug!("cannot give the terminal to the command: {e}");
        return false;
    }
    // A command stopped for touching the terminal before it was its own (SIGTTIN/SIGTTOU)
    // is continued when its stop report comes (`Group::suspend`), not here: a Ctrl-Z
    // right after the hand-over would be undone.
    true
}

/// Makes simba's process group the terminal's foreground again. simba is in the
/// background at this point, so the call is made from a thread that blocks SIGTTOU
/// (otherwise the kernel would stop simba for it).
fn take_terminal_back() {
    if let Err(e) = set_foreground(nix::unistd::getpgrp()) {
        debug!("cannot take the terminal back: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(exit_code(ExitStatus::from_raw(7 << 8)), 7);
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(ExitStatus::from_raw(9)), 137);
        assert_eq!(exit_code(ExitStatus::from_raw(15)), 143);
    }
}
