//! [`LockError`]: why a native lock call failed (the wait queue's locks, `crate::native`,
//! and each dialect's `lock` module). The queue never hands one to a user: it logs it and
//! lets the contenders go by the row and the lease until the lock works again, so what
//! matters is that the log names the call, the lock and the cause, and that the kind of
//! failure stays a value, not a sentence. [`Refused`]: why SQLite's database file cannot be
//! locked (the store makes a configuration error of some).

use std::time::Duration;

/// A cause from a driver or the OS, kept as it came.
pub(crate) type Cause = Box<dyn std::error::Error + Send + Sync>;

/// Why a native lock call failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LockError {
    /// A lock session's connection or statement failed (PostgreSQL, MySQL).
    #[cfg(any(feature = "mysql", feature = "postgres"))]
    #[error("{backend} lock session: {source}")]
    Session {
        backend: &'static str,
        #[source]
        source: Cause,
    },
    /// The server answered a lock call with something that is no lock outcome.
    #[cfg(any(feature = "mysql", feature = "postgres"))]
    #[error("{call} answered {answer}: {meaning}")]
    Answer {
        call: &'static str,
        answer: String,
        meaning: &'static str,
    },
    /// No answer within the store's statement timeout.
    #[error("{what}: no answer within {bound:?}")]
    NoAnswer { what: &'static str, bound: Duration },
    /// The store's shared session holds as many locks as it may (the caller goes by the
    /// row alone).
    #[error("this store holds {0} native locks on its shared session already")]
    AtCap(usize),
    /// A byte-range lock call on the database file failed (SQLite on Linux).
    #[cfg(all(feature = "sqlite", any(target_os = "linux", target_os = "android")))]
    #[error("database file {path} ({what} byte {byte}): {source}")]
    Byte {
        path: std::path::PathBuf,
        what: &'static str,
        byte: i64,
        #[source]
        source: Cause,
    },
    /// A lock file beside the database could not be opened or locked (SQLite elsewhere).
    #[cfg(all(
        feature = "sqlite",
        not(any(target_os = "linux", target_os = "android"))
    ))]
    #[error("lock file {path}: {source}")]
    File {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The database file cannot be locked at all (missing, hard-linked, unreadable).
    #[cfg(feature = "sqlite")]
    #[error(transparent)]
    Database(#[from] Refused),
    /// A given-up wait ends with its session's connection, not with a cancel request
    /// (PostgreSQL behind a session-mode pooler: PgBouncer 1.18 can exit on one).
    #[cfg(feature = "postgres")]
    #[error("a wait given up behind a pooler: its session is closed instead of cancelled")]
    Closed,
    /// The task of a blocking lock call ended without an answer.
    #[error("lock task: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// A key of another backend than the session's, or a lock call on a store that has no
    /// lock sessions: a bug, reported rather than acted on.
    #[error("{0}")]
    Mismatch(&'static str),
}

#[cfg(any(feature = "mysql", feature = "postgres"))]
impl LockError {
    /// A lock session's failure on `backend`.
    pub(crate) fn session(
        backend: &'static str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> LockError {
        LockError::Session {
            backend,
            source: Box::new(source),
        }
    }
}

/// Why the database file cannot be locked.
#[cfg(feature = "sqlite")]
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refused {
    /// The file has more than one name: a configuration error.
    #[error(
        "the SQLite database file {} has {links} hard links: SQLite names its WAL and \
         journal after the path it was opened by, so processes that open the file by \
         different names write different WALs and can each believe they own a mutex \
         (SQLite's documentation warns against hard-linking a database). Give the file one \
         name (remove the other links) and use a symlink where a second path is needed",
        path.display()
    )]
    HardLinked {
        path: std::path::PathBuf,
        links: u64,
    },
    /// The file does not exist: a configuration error (or not migrated yet).
    #[error(
        "SQLite database file {}: {source}; simba locks in the database file, which must \
         exist (run `migrate` first, and check the path)",
        path.display()
    )]
    Missing {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Anything else (out of descriptors, permissions): reported as it is.
    #[error("{what} of the SQLite database file {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A description of a file that has no name any more (Linux).
    #[cfg_attr(not(any(target_os = "linux", target_os = "android")), allow(dead_code))]
    #[error("the database file was deleted")]
    Deleted,
}

#[cfg(feature = "sqlite")]
impl Refused {
    /// The refusal of opening `path`, by the kind of `source`.
    pub(crate) fn opening(path: &std::path::Path, source: std::io::Error) -> Refused {
        let path = path.to_owned();
        if source.kind() == std::io::ErrorKind::NotFound {
            Refused::Missing { path, source }
        } else {
            Refused::Io {
                what: "open",
                path,
                source,
            }
        }
    }
}
