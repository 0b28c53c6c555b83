//! Exit statuses and the error type that carries one.

use std::fmt;

/// The exit statuses of `simba` itself (a command run by `exec` exits with its own).
///
/// sysexits(3) values where one fits, so that scripts can tell the cases apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// 64 (EX_USAGE): bad arguments, bad backend URL, bad duration, bad mutex name, a
    /// permit count other than the semaphore holders'.
    Usage,
    /// 69 (EX_UNAVAILABLE): the backend cannot be reached or failed.
    Unavailable,
    /// 70 (EX_SOFTWARE): an internal error (a bug in simba).
    Internal,
    /// 73 (EX_CANTCREAT): the state directory (or a SQLite file's directory) cannot be
    /// created or used, or the SQLite path is no regular file.
    CantCreate,
    /// 75 (EX_TEMPFAIL): the mutex was not acquired within `--timeout`, or it is held and
    /// `--no-wait` was given.
    NotAcquired,
    /// 79: ownership was lost while the command ran (or `--hold-at-most` passed); the
    /// command was stopped (or had ended, and the release found the ownership lost: ended
    /// before, or the mutex taken over, deleted or changed by hand on the backend).
    Lost,
    /// 126: the command was found but could not be started.
    CannotRun,
    /// 127: the command was not found.
    NotFound,
}

impl Status {
    /// The numeric exit status.
    pub(crate) fn code(self) -> u8 {
        match self {
            Status::Usage => 64,
            Status::Unavailable => 69,
            Status::Internal => 70,
            Status::CantCreate => 73,
            Status::NotAcquired => 75,
            Status::Lost => 79,
            Status::CannotRun => 126,
            Status::NotFound => 127,
        }
    }

    /// The status for an error of the simba library.
    pub(crate) fn of(e: &simba_core::Error) -> Status {
        use simba_core::Error as E;
        match e {
            // A local path the backend needs (the SQLite file) is unusable.
            E::InvalidConfig { field: "path", .. } => Status::CantCreate,
            E::InvalidName { .. }
            | E::InvalidContenderId { .. }
            | E::InvalidConfig { .. }
            | E::Unsupported { .. }
            | E::PermitsMismatch { .. } => Status::Usage,
            E::Timeout { .. } | E::WouldBlock { .. } => Status::NotAcquired,
            E::Lost { .. } => Status::Lost,
            E::Backend { .. } | E::Shutdown { .. } => Status::Unavailable,
            _ => Status::Internal,
        }
    }
}

/// The exit-status table printed by `--help` and kept in README.md.
pub(crate) const EXIT_STATUS_HELP: &str = "\
Exit status:
  exec exits with the command's own status, or 128+N when the command was killed
  by signal N. Otherwise:
    0    success (owner, watch ended by SIGINT/SIGTERM)
    64   usage error: bad option, backend URL, duration or mutex name, an option
         the backend cannot do (--hold-at-least on ZooKeeper, --permits on a
         backend without semaphores), or --permits N other than the count the
         semaphore's holders agreed on
    69   backend unavailable: cannot connect, or it failed
    70   internal error (a bug: please report it)
    73   cannot create the state directory or the SQLite file's directory, or
         the SQLite path is no regular file
    75   not acquired: --timeout passed, or --no-wait and the mutex (every
         permit) is held
    79   ownership lost while the command ran, or --hold-at-most passed; the
         command's process group was stopped: SIGKILL at the lease's local
         deadline, else SIGTERM, then SIGKILL after --grace (or the command had
         ended, and the release found the ownership lost, or the mutex taken
         over, deleted or changed by hand: it may have run unprotected)
    126  the command could not be started (e.g. not executable)
    127  the command was not found
    128+N  simba got signal N while waiting for the mutex";

/// An error that ends the program with a given status.
pub(crate) struct Failure {
    pub(crate) status: Status,
    pub(crate) error: anyhow::Error,
}

impl fmt::Debug for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} ({}): {}",
            self.status,
            self.status.code(),
            describe(&self.error)
        )
    }
}

impl Failure {
    /// A failure with `status` and a message.
    pub(crate) fn new(status: Status, message: impl fmt::Display) -> Self {
        Failure {
            status,
            error: anyhow::anyhow!("{message}"),
        }
    }

    /// A usage error.
    pub(crate) fn usage(message: impl fmt::Display) -> Self {
        Self::new(Status::Usage, message)
    }

    /// A failure from a library error, classified by [`Status::of`], with `context`.
    pub(crate) fn simba(e: simba_core::Error, context: impl fmt::Display) -> Self {
        let status = Status::of(&e);
        Failure {
            status,
            error: anyhow::Error::new(e).context(context.to_string()),
        }
    }

    /// A failure with `status` from any error, with `context`.
    pub(crate) fn with(
        status: Status,
        e: impl std::error::Error + Send + Sync + 'static,
        context: impl fmt::Display,
    ) -> Self {
        Failure {
            status,
            error: anyhow::Error::new(e).context(context.to_string()),
        }
    }
}

/// The error and its causes, joined with `: `; a cause whose text is already said (errors
/// that repeat their source in their own message) is left out, so each thing is said once.
pub(crate) fn describe(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if text.is_empty() || out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// What a subcommand ends with: the exit status to report.
pub(crate) type Outcome = Result<u8, Failure>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_already_said_is_not_repeated() {
        #[derive(Debug)]
        struct Inner;
        impl fmt::Display for Inner {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("disk I/O error")
            }
        }
        impl std::error::Error for Inner {}
        let e = simba_core::Error::backend_source(
            "sqlite",
            "connect: cannot open: disk I/O error",
            false,
            Inner,
        );
        let f = Failure::simba(e, "cannot use backend sqlite:///x");
        let said = describe(&f.error);
        assert_eq!(said.matches("disk I/O error").count(), 1, "{said}");
        assert!(
            said.starts_with("cannot use backend sqlite:///x: "),
            "{said}"
        );
    }

    #[test]
    fn statuses_are_distinct() {
        let all = [
            Status::Usage,
            Status::Unavailable,
            Status::Internal,
            Status::CantCreate,
            Status::NotAcquired,
            Status::Lost,
            Status::CannotRun,
            Status::NotFound,
        ];
        for (i, a) in all.iter().enumerate() {
            assert!(EXIT_STATUS_HELP.contains(&format!("  {}  ", a.code())));
            for b in &all[i + 1..] {
                assert_ne!(a.code(), b.code());
            }
        }
    }

    #[test]
    fn library_errors_map_to_statuses() {
        let e = simba_core::Error::WouldBlock { mutex: "m".into() };
        assert_eq!(Status::of(&e), Status::NotAcquired);
        assert_eq!(
            Status::of(&simba_core::Error::backend("redis", "down")),
            Status::Unavailable
        );
        assert_eq!(
            Status::of(&simba_core::Error::config("ttl", "zero")),
            Status::Usage
        );
        let e = simba_core::Error::PermitsMismatch {
            semaphore: "s".into(),
            asked: 3,
            existing: 2,
        };
        assert_eq!(Status::of(&e), Status::Usage);
    }
}
