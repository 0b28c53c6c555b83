//! [`LockError`]: why a native lock call failed (the wait queue's locks, `crate::native`,
//! and each dialect's `lock` module). The queue never hands one to a user: it logs it and
//! lets the contenders go by the row and the lease until the lock works again, so what
//! matters is that the log names the call, the lock and the cause, and that the kind of
//! failure stays a value, not a sentence.

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
    Database(#[from] crate::sqlite::Refused),
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
