//! The one public error type of simba.

use std::fmt;
use std::time::Duration;

/// `Result` with simba's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a contender stopped owning a mutex.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum LossReason {
    /// The owner released it (`release`, `stop`, or a dropped guard).
    Released,
    /// No renewal succeeded before the local lease deadline: the backend may already have
    /// handed the mutex to someone else, so this process must stop acting as owner.
    LeaseExpired,
    /// The backend answered that another contender owns the mutex now — or, at a release,
    /// that this contender no longer owns it: its record was taken over, deleted or changed
    /// by hand (a row's `owner_id`, a key's value, a node gone or rewritten).
    TakenOver,
    /// The backend session that carried the ownership ended (ZooKeeper session expiry).
    SessionLost,
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LossReason::Released => "released",
            LossReason::LeaseExpired => "lease expired before a renewal succeeded",
            LossReason::TakenOver => "taken over by another contender",
            LossReason::SessionLost => "backend session lost",
        })
    }
}

/// Every error simba returns.
///
/// Backends keep their own error types private and map them into [`Error::Backend`],
/// keeping the source for `Error::source()`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A mutex name was rejected; `reason` says what is wrong with it.
    #[error("invalid mutex name {name:?}: {reason}")]
    InvalidName {
        /// The rejected name (possibly shortened).
        name: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// A contender id was rejected; `reason` says what is wrong with it.
    #[error("invalid contender id {id:?}: {reason}")]
    InvalidContenderId {
        /// The rejected id.
        id: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// A configuration value was rejected.
    #[error("invalid configuration `{field}`: {reason}")]
    InvalidConfig {
        /// The name of the setting.
        field: &'static str,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// The mutex could not be acquired within the given time.
    #[error("mutex {mutex:?} not acquired within {waited:?}")]
    Timeout {
        /// The mutex.
        mutex: String,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The mutex is held by someone else and the caller asked not to wait.
    #[error("mutex {mutex:?} is held by another contender")]
    WouldBlock {
        /// The mutex.
        mutex: String,
    },
    /// Ownership was lost while an operation needed it.
    #[error("ownership of mutex {mutex:?} lost: {reason}")]
    Lost {
        /// The mutex.
        mutex: String,
        /// Why it was lost.
        reason: LossReason,
    },
    /// The service was stopped or is shutting down.
    #[error("contend service for mutex {mutex:?} is stopped")]
    Shutdown {
        /// The mutex.
        mutex: String,
    },
    /// The service was started twice, or some other call came in the wrong state.
    #[error("invalid state: {0}")]
    InvalidState(String),
    /// The backend cannot do what was asked (e.g. keep a released mutex held on ZooKeeper,
    /// which has sessions, not leases). Fails the same way every time.
    #[error("{what} is not supported on {backend}: {reason}")]
    Unsupported {
        /// Which backend, as people write it (`"ZooKeeper"`).
        backend: &'static str,
        /// The feature asked for (`"hold-at-least"`).
        what: &'static str,
        /// Why not, and what to do instead.
        reason: String,
    },
    /// A semaphore was asked for with a permit count other than the one its holders agreed
    /// on: every contender of one semaphore name must ask for the same number of permits.
    #[error(
        "semaphore {semaphore:?} has {existing} permits (its holders asked for that), \
         not {asked}: every contender of one semaphore must ask for the same count"
    )]
    PermitsMismatch {
        /// The semaphore.
        semaphore: String,
        /// The permit count this contender asked for.
        asked: u32,
        /// The permit count of the semaphore's current holders.
        existing: u32,
    },
    /// The backend failed.
    #[error("{backend} backend: {message}")]
    Backend {
        /// Which backend (`"redis"`, `"mysql"`, `"postgres"`, `"sqlite"`, `"zookeeper"`, `"memory"`).
        backend: &'static str,
        /// What was being done and what went wrong.
        message: String,
        /// Whether retrying the same call later may succeed (connection trouble, timeouts).
        retryable: bool,
        /// The underlying error, if any.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    },
}

impl Error {
    /// A retryable backend error without a source.
    pub fn backend(backend: &'static str, message: impl Into<String>) -> Self {
        Error::Backend {
            backend,
            message: message.into(),
            retryable: true,
            source: None,
        }
    }

    /// A backend error wrapping `source`.
    pub fn backend_source(
        backend: &'static str,
        message: impl Into<String>,
        retryable: bool,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Backend {
            backend,
            message: message.into(),
            retryable,
            source: Some(Box::new(source)),
        }
    }

    /// An invalid configuration value.
    pub fn config(field: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidConfig {
            field,
            reason: reason.into(),
        }
    }

    /// An operation the backend cannot do.
    pub fn unsupported(
        backend: &'static str,
        what: &'static str,
        reason: impl Into<String>,
    ) -> Self {
        Error::Unsupported {
            backend,
            what,
            reason: reason.into(),
        }
    }

    /// Whether trying the same operation again later may succeed.
    ///
    /// True for backend trouble marked retryable and for timeouts / would-block; false for
    /// invalid input, unsupported operations, shutdown and state errors, which fail the same
    /// way every time.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Backend { retryable, .. } => *retryable,
            Error::Timeout { .. } | Error::WouldBlock { .. } | Error::Lost { .. } => true,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_classification() {
        assert!(Error::backend("memory", "down").is_retryable());
        assert!(!Error::config("ttl", "zero").is_retryable());
        assert!(!Error::Shutdown { mutex: "m".into() }.is_retryable());
        let e = Error::backend_source("redis", "eval", false, std::io::Error::other("x"));
        assert!(!e.is_retryable());
        assert!(std::error::Error::source(&e).is_some());
        assert_eq!(e.to_string(), "redis backend: eval");
    }
}
