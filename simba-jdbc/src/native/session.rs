//! What a store's native locks are made of, by dialect: where they live ([`Kind`]), the
//! lock of one mutex ([`Key`]), the sessions that hold locks on a server ([`Session`],
//! PostgreSQL and MySQL) and what ends their blocking waits ([`Canceller`]).

use std::fmt;

use crate::hash::stable_hash;
use crate::lock_error::LockError;

#[cfg(feature = "sqlite")]
pub(crate) use crate::sqlite::{DbFile, FileKey, FileLock};
#[cfg(not(feature = "sqlite"))]
pub(crate) use no_files::{FileKey, FileLock};

/// Where the native locks of a store live.
#[derive(Clone)]
pub(crate) enum Kind {
    /// PostgreSQL advisory locks, on sessions the store's connector opens.
    #[cfg(feature = "postgres")]
    Postgres {
        /// Opens the sessions (and sends cancel requests), with the store's TLS.
        pg: std::sync::Arc<crate::postgres::Connector>,
    },
    /// MySQL / MariaDB user locks, on sessions to `url`.
    #[cfg(feature = "mysql")]
    Mysql {
        /// The connection URL.
        url: String,
    },
    /// SQLite: on Linux byte-range locks on the database file itself; elsewhere lock
    /// files beside it (`{db}-simba-{hash}.lock` / `.entry`).
    #[cfg(feature = "sqlite")]
    Files {
        /// The database file.
        db: std::sync::Arc<DbFile>,
    },
    /// No other process can reach the database (`sqlite::memory:`): the local queue is all.
    Local,
}

impl fmt::Debug for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            #[cfg(feature = "postgres")]
            Kind::Postgres { .. } => "postgres advisory locks",
            #[cfg(feature = "mysql")]
            Kind::Mysql { .. } => "mysql GET_LOCK",
            #[cfg(feature = "sqlite")]
            Kind::Files { .. } => "lock files",
            Kind::Local => "local",
        };
        f.write_str(name)
    }
}

impl Kind {
    /// The native lock of `mutex` in the namespace `scope` (the database and the table).
    pub(crate) fn key(&self, scope: &str, mutex: &str) -> Key {
        let h = stable_hash(&[scope, mutex]);
        match self {
            #[cfg(feature = "postgres")]
            Kind::Postgres { .. } => {
                Key::Session(SessionKey::Pg(i64::from_ne_bytes(h.to_ne_bytes())))
            }
            #[cfg(feature = "mysql")]
            Kind::Mysql { .. } => Key::Session(SessionKey::My(format!("simba:{h:016x}"))),
            #[cfg(feature = "sqlite")]
            Kind::Files { db } => Key::File(FileKey::new(db, h)),
            Kind::Local => {
                let _ = h;
                Key::Local
            }
        }
    }
}

/// The native lock of one mutex.
#[derive(Debug, Clone)]
pub(crate) enum Key {
    /// Held by a server session ([`Session`]).
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    Session(SessionKey),
    /// Lock files (SQLite).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    File(FileKey),
    /// Nothing to lock (`sqlite::memory:`).
    Local,
}

/// The lock of one mutex on a server.
#[derive(Debug, Clone)]
pub(crate) enum SessionKey {
    /// A PostgreSQL advisory lock's key.
    #[cfg(feature = "postgres")]
    Pg(i64),
    /// A MySQL user lock's name.
    #[cfg(feature = "mysql")]
    My(String),
}

/// A session that can hold native locks (PostgreSQL, MySQL).
pub(crate) enum Session {
    #[cfg(feature = "postgres")]
    Pg(crate::postgres::lock::Session),
    #[cfg(feature = "mysql")]
    My(crate::mysql::lock::Session),
}

impl Session {
    pub(crate) async fn connect(kind: &Kind) -> Result<Session, LockError> {
        match kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres { pg } => crate::postgres::lock::Session::connect(pg)
                .await
                .map(Session::Pg),
            #[cfg(feature = "mysql")]
            Kind::Mysql { url } => crate::mysql::lock::Session::connect(url)
                .await
                .map(Session::My),
            #[allow(unreachable_patterns)]
            _ => Err(LockError::Mismatch("this backend has no lock sessions")),
        }
    }

    pub(crate) async fn try_lock(&mut self, key: &Key) -> Result<bool, LockError> {
        match (self, key) {
            #[cfg(feature = "postgres")]
            (Session::Pg(s), Key::Session(SessionKey::Pg(k))) => s.try_lock(*k).await,
            #[cfg(feature = "mysql")]
            (Session::My(s), Key::Session(SessionKey::My(k))) => s.try_lock(k).await,
            #[allow(unreachable_patterns)]
            _ => Err(LockError::Mismatch("a lock key of another backend")),
        }
    }

    pub(crate) async fn lock(&mut self, key: &Key) -> Result<(), LockError> {
        match (self, key) {
            #[cfg(feature = "postgres")]
            (Session::Pg(s), Key::Session(SessionKey::Pg(k))) => s.lock(*k).await,
            #[cfg(feature = "mysql")]
            (Session::My(s), Key::Session(SessionKey::My(k))) => s.lock(k).await,
            #[allow(unreachable_patterns)]
            _ => Err(LockError::Mismatch("a lock key of another backend")),
        }
    }

    pub(crate) async fn unlock(&mut self, key: &Key) -> Result<(), LockError> {
        match (self, key) {
            #[cfg(feature = "postgres")]
            (Session::Pg(s), Key::Session(SessionKey::Pg(k))) => s.unlock(*k).await,
            #[cfg(feature = "mysql")]
            (Session::My(s), Key::Session(SessionKey::My(k))) => s.unlock(k).await,
            #[allow(unreachable_patterns)]
            _ => Err(LockError::Mismatch("a lock key of another backend")),
        }
    }

    /// What ends this session's blocking wait from outside (another connection).
    pub(crate) fn canceller(&self, kind: &Kind) -> Canceller {
        match (self, kind) {
            // A cancel request through a session-mode pooler could end the pooler
            // (PgBouncer 1.18: pgbouncer#801): the wait ends with its connection instead.
            #[cfg(feature = "postgres")]
            (Session::Pg(_), Kind::Postgres { pg }) if pg.pooler().session => Canceller::Close,
            #[cfg(feature = "postgres")]
            (Session::Pg(s), Kind::Postgres { pg }) => Canceller::Pg(s.cancel_token(), pg.clone()),
            #[cfg(feature = "mysql")]
            (Session::My(s), Kind::Mysql { url }) => Canceller::My {
                url: url.clone(),
                id: s.id(),
            },
            #[allow(unreachable_patterns)]
            _ => Canceller::None,
        }
    }
}

/// Ends a session's blocking wait for a native lock on the server: PostgreSQL's cancel
/// request, MySQL's `KILL QUERY` of the session's connection.
pub(crate) enum Canceller {
    #[cfg(feature = "postgres")]
    Pg(
        tokio_postgres::CancelToken,
        std::sync::Arc<crate::postgres::Connector>,
    ),
    #[cfg(feature = "mysql")]
    My { url: String, id: u32 },
    /// No request: the session is closed (its connection dropped), which ends the wait
    /// on the server no later than when the lock would have been granted to it.
    #[cfg(feature = "postgres")]
    Close,
    /// Nothing to cancel with (a session and a kind of two different backends).
    None,
}

impl Canceller {
    pub(crate) async fn cancel(&self) -> Result<(), LockError> {
        match self {
            #[cfg(feature = "postgres")]
            Canceller::Pg(token, pg) => pg
                .cancel(token)
                .await
                .map_err(|e| LockError::session("postgres", e)),
            #[cfg(feature = "mysql")]
            Canceller::My { url, id } => crate::mysql::lock::kill_query(url, *id).await,
            #[cfg(feature = "postgres")]
            Canceller::Close => Err(LockError::Closed),
            Canceller::None => Ok(()),
        }
    }
}

/// Without SQLite there are no lock files: their key and lock cannot be made.
#[cfg(not(feature = "sqlite"))]
mod no_files {
    use tokio::task::JoinHandle;

    use crate::lock_error::LockError;

    /// The lock files of a mutex: none in this build.
    #[derive(Debug, Clone)]
    pub(crate) enum FileKey {}

    /// A held lock file: none in this build.
    pub(crate) enum FileLock {}

    /// Dropping a held lock file unlocks it (there is none to drop here).
    impl Drop for FileLock {
        fn drop(&mut self) {
            match *self {}
        }
    }

    impl FileLock {
        pub(crate) fn mark(&self) -> i64 {
            match *self {}
        }
    }

    impl FileKey {
        pub(crate) async fn try_lock(&self) -> Result<Option<FileLock>, LockError> {
            match *self {}
        }

        pub(crate) fn wait(&self) -> JoinHandle<Result<FileLock, LockError>> {
            match *self {}
        }
    }
}
