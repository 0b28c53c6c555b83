//! The command run by `exec`: its own process group, signals, and the terminal.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::os::fd::AsFd;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep, sleep_until};
use tracing::{debug, warn};

use crate::status::{Failure, Status};

/// How often the group is checked for remaining members while stopping it.
const POLL: Duration = Duration::from_millis(25);
/// How long to wait for the group to disappear after SIGKILL.
const AFTER_KILL: Duration = Duration::from_secs(2);

/// A running command, leader of its own process group.
#[derive(Debug)]
pub(crate) struct Group {
    child: Child,
    pgid: Pid,
    status: Option<ExitStatus>,
    terminal: bool,
}

/// Starts `argv` in a new process group with `env` added to its environment.
///
/// When simba runs in the terminal's foreground with stdin on the terminal (started from
/// an interactive shell), the terminal's foreground is handed to the command's group, so
/// that it can read the terminal (a process of a background group that reads it is
/// stopped) and gets Ctrl-C directly; simba takes it back when the command ends.
pub(crate) fn spawn(argv: &[OsString], env: &[(&str, String)]) -> Result<Group, Failure> {
    let Some((program, args)) = argv.split_first() else {
        return Err(Failure::usage("no command given after `--`"));
    };
    let mut cmd = Command::new(program);
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::inherit())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .process_group(0)
        .kill_on_drop(false);
    let shown = program.to_string_lossy();
    let child = cmd.spawn().map_err(|e| {
        let status = match e.kind() {
            std::io::ErrorKind::NotFound => Status::NotFound,
            _ => Status::CannotRun,
        };
        Failure::with(status, e, format!("cannot run `{shown}`"))
    })?;
    let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) else {
        return Err(Failure::new(
            Status::Internal,
            "the command's process id is unknown right after it started",
        ));
    };
    let pgid = Pid::from_raw(pid);
    let terminal = hand_terminal(pgid);
    debug!(pid, terminal, "command started in its own process group");
    Ok(Group {
        child,
        pgid,
        status: None,
        terminal,
    })
}

impl Group {
    /// The process group id (the command's pid).
    pub(crate) fn pgid(&self) -> i32 {
        self.pgid.as_raw()
    }

    /// Waits for the command to exit. Cancel safe.
    pub(crate) async fn wait(&mut self) -> std::io::Result<ExitStatus> {
        if let Some(s) = self.status {
            return Ok(s);
        }
        let s = self.child.wait().await?;
        self.status = Some(s);
        Ok(s)
    }

    /// Sends `signal` to every process of the group.
    pub(crate) fn signal(&self, signal: Signal) {
        match killpg(self.pgid, signal) {
            Ok(()) => debug!(%signal, pgid = self.pgid.as_raw(), "signal sent to the group"),
            Err(Errno::ESRCH) => debug!(%signal, "the group is gone"),
            Err(e) => warn!(%signal, "cannot signal the command's process group: {e}"),
        }
    }

    /// Whether any process of the group is left (zombies count until reaped).
    fn group_alive(&self) -> bool {
        !matches!(killpg(self.pgid, None), Err(Errno::ESRCH))
    }

    /// Stops the whole group: SIGTERM now, SIGKILL after `grace` to whatever is left, and
    /// waits (bounded) until no process of the group remains.
    ///
    /// Returns the command's exit status if it was seen.
    pub(crate) async fn stop(&mut self, grace: Duration) -> Option<ExitStatus> {
        self.signal(Signal::SIGTERM);
        // A stopped process (Ctrl-Z, SIGTTIN) acts on SIGTERM only once continued.
        self.signal(Signal::SIGCONT);
        let kill_at = Instant::now() + grace;
        if !self.wait_gone(kill_at).await {
            debug!("grace period over: SIGKILL to the group");
            self.signal(Signal::SIGKILL);
            if !self.wait_gone(Instant::now() + AFTER_KILL).await {
                warn!(
                    pgid = self.pgid.as_raw(),
                    "processes of the command's group are still there after SIGKILL"
                );
            }
        }
        self.status
    }

    /// Waits until the command is reaped and no process of its group is left, or until
    /// `until`; returns whether the group is gone.
    async fn wait_gone(&mut self, until: Instant) -> bool {
        if self.status.is_none() {
            tokio::select! {
                r = self.wait() => {
                    if let Err(e) = r {
                        warn!("waiting for the command failed: {e}");
                    }
                }
                () = sleep_until(until) => return false,
            }
        }
        // The command is reaped; its own children may still run in the group.
        loop {
            if !self.group_alive() {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            sleep(POLL).await;
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

/// Hands the terminal's foreground to `pgid` when simba is interactive; see [`spawn`].
fn hand_terminal(pgid: Pid) -> bool {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return false;
    }
    let fd = stdin.as_fd();
    match nix::unistd::tcgetpgrp(fd) {
        Ok(fg) if fg == nix::unistd::getpgrp() => {}
        _ => return false,
    }
    if let Err(e) = nix::unistd::tcsetpgrp(fd, pgid) {
        debug!("cannot give the terminal to the command: {e}");
        return false;
    }
    // The command may have touched the terminal before it was its own and been stopped
    // for it (SIGTTIN/SIGTTOU): let it go on.
    let _ = killpg(pgid, Signal::SIGCONT);
    true
}

/// Makes simba's process group the terminal's foreground again. simba is in the
/// background at this point, so the call is made from a thread that blocks SIGTTOU
/// (otherwise the kernel would stop simba for it).
fn take_terminal_back() {
    let restore = || {
        let mut block = nix::sys::signal::SigSet::empty();
        block.add(Signal::SIGTTOU);
        if let Err(e) = nix::sys::signal::pthread_sigmask(
            nix::sys::signal::SigmaskHow::SIG_BLOCK,
            Some(&block),
            None,
        ) {
            debug!("cannot block SIGTTOU: {e}");
            return;
        }
        let stdin = std::io::stdin();
        if let Err(e) = nix::unistd::tcsetpgrp(stdin.as_fd(), nix::unistd::getpgrp()) {
            debug!("cannot take the terminal back: {e}");
        }
    };
    if std::thread::spawn(restore).join().is_err() {
        debug!("taking the terminal back failed");
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
