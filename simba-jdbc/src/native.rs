//! The native locks of the wait queue (`crate::gate`), by dialect: where a store's locks
//! live ([`Kind`]), the lock of one mutex ([`Key`]), the sessions that hold locks on a
//! server ([`Session`], PostgreSQL and MySQL) with what ends their blocking waits
//! ([`Canceller`]), and the three lock operations the queue uses ([`Locks`]: one try, one
//! blocking wait, one unlock). Each dialect's own lock code is in its module's `lock`
//! (`crate::postgres::lock`, `crate::mysql::lock`, `crate::sqlite::lock`).
//!
//! An enum per role, as for the store (`crate::dialect`): a store keeps sessions of its
//! dialect in a spare list and a holder slot, and their methods are `async` (no `dyn`).

use std::fmt;
use std::sync::Mutex as StdMutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tracing::debug;

use crate::gate::stable_hash;

#[cfg(feature = "sqlite")]
pub(crate) use crate::sqlite::{FileKey, FileLock};
#[cfg(not(feature = "sqlite"))]
pub(crate) use no_files::{FileKey, FileLock};

/// The most native locks one store holds on its shared session (PostgreSQL's advisory
/// locks live in the server's shared lock table, about 64 × max_connections entries for
/// every session together). A contender that finds the store at the bound acquires by the
/// row alone (see [`Pass::Unlocked`](crate::gate::Pass::Unlocked)): correct, only without
/// the queue's order and push.
const MAX_SHARED_LOCKS: usize = 1000;

/// How a blocking wait for the native lock ended.
pub(crate) enum Waited {
    Got(Held),
    /// Given up (cancelled); nothing of it is left.
    GaveUp,
    /// Given up, but a blocking lock-file call of it cannot be interrupted: it still waits,
    /// holding the entry, and returns the lock when the lock is free.
    Lingering(JoinHandle<Result<FileLock, String>>),
}

/// A native lock this process holds, and what holds it.
pub(crate) enum Held {
    /// On the store's shared holder session (taken by a non-blocking try).
    Shared,
    /// On a session of its own (taken by a blocking wait); back to the spares on unlock.
    Own(Session),
    /// The lock file, open and locked; closing it unlocks.
    File(FileLock),
    /// Nothing to hold (`sqlite::memory:`).
    Local,
}

/// The native locks of one store: where they live, and the sessions that hold them
/// (PostgreSQL, MySQL).
pub(crate) struct Locks {
    kind: Kind,
    /// Bound of a non-blocking lock call (the store's statement timeout).
    bound: Duration,
    /// The session that holds locks taken by a try (PostgreSQL, MySQL).
    holder: tokio::sync::Mutex<Option<Session>>,
    /// How many locks the holder session holds.
    shared: AtomicUsize,
    /// Idle sessions for blocking waits.
    spare: StdMutex<Vec<Session>>,
    /// Whether the lock files of earlier builds were swept (SQLite, first lock call).
    #[cfg(feature = "sqlite")]
    swept: std::sync::Once,
}

impl Locks {
    pub(crate) fn new(kind: Kind, bound: Duration) -> Self {
        Locks {
            kind,
            bound,
            holder: tokio::sync::Mutex::new(None),
            shared: AtomicUsize::new(0),
            spare: StdMutex::new(Vec::new()),
            #[cfg(feature = "sqlite")]
            swept: std::sync::Once::new(),
        }
    }

    /// On this store's first lock-file call, removes the per-name lock files that earlier
    /// builds left beside the database (`crate::sqlite::sweep_earlier`), best effort, on
    /// a blocking thread that nobody waits for.
    fn sweep_once(&self) {
        #[cfg(feature = "sqlite")]
        if let Kind::Files { prefix } = &self.kind {
            self.swept.call_once(|| {
                let prefix = prefix.clone();
                drop(tokio::task::spawn_blocking(move || {
                    let removed = crate::sqlite::sweep_earlier(&prefix);
                    if removed > 0 {
                        debug!(removed, database = %prefix, "removed lock files of earlier builds");
                    }
                }));
            });
        }
    }

    /// Where the locks live.
    pub(crate) fn kind(&self) -> &Kind {
        &self.kind
    }

    /// One non-blocking attempt at the native lock.
    pub(crate) async fn try_lock(&self, key: &Key) -> Result<Option<Held>, String> {
        match key {
            Key::Local => Ok(Some(Held::Local)),
            Key::File(files) => {
                self.sweep_once();
                files.try_lock().await.map(|f| f.map(Held::File))
            }
            Key::Session(_) => {
                if self.shared.load(Ordering::Relaxed) >= MAX_SHARED_LOCKS {
                    return Err(format!(
                        "this store holds {MAX_SHARED_LOCKS} native locks already"
                    ));
                }
                let mut holder = self.holder.lock().await;
                if holder.is_none() {
                    let s = timeout(self.bound, Session::connect(&self.kind))
                        .await
                        .map_err(|_| format!("no lock session within {:?}", self.bound))??;
                    *holder = Some(s);
                }
                let Some(session) = holder.as_mut() else {
                    return Err("no lock session".to_owned());
                };
                match timeout(self.bound, session.try_lock(key)).await {
                    Ok(Ok(true)) => {
                        self.shared.fetch_add(1, Ordering::Relaxed);
                        Ok(Some(Held::Shared))
                    }
                    Ok(Ok(false)) => Ok(None),
                    Ok(Err(e)) => {
                        *holder = None;
                        Err(e)
                    }
                    Err(_) => {
                        *holder = None;
                        Err(format!("lock session: no answer within {:?}", self.bound))
                    }
                }
            }
        }
    }

    /// Waits (without bound) until the native lock is this process's, or until `cancel`
    /// fires (or its sender is dropped): then `None`, and no lock is left granted to a
    /// session of this process that nobody waits on.
    pub(crate) async fn wait(
        &self,
        key: &Key,
        mut cancel: oneshot::Receiver<()>,
    ) -> Result<Waited, String> {
        // Fired, or its sender dropped: given up. A receiver that `try_recv` found closed
        // is finished and must not be polled again (tokio panics "called after complete").
        if !matches!(cancel.try_recv(), Err(oneshot::error::TryRecvError::Empty)) {
            return Ok(Waited::GaveUp);
        }
        match key {
            Key::Local => Ok(Waited::Got(Held::Local)),
            Key::File(files) => {
                self.sweep_once();
                let mut blocking = files.wait();
                tokio::select! {
                    r = &mut blocking => r
                        .map_err(|e| format!("lock file task: {e}"))?
                        .map(|f| Waited::Got(Held::File(f))),
                    // A blocking lock call cannot be interrupted: its thread goes on
                    // waiting, and the gate follows it (`Gates::linger`).
                    _ = cancel => Ok(Waited::Lingering(blocking)),
                }
            }
            Key::Session(_) => {
                let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
                let mut session = match spare {
                    Some(s) => s,
                    None => timeout(self.bound, Session::connect(&self.kind))
                        .await
                        .map_err(|_| format!("no lock session within {:?}", self.bound))??,
                };
                let canceller = session.canceller(&self.kind);
                let mut given_up = false;
                let got = {
                    let lock = session.lock(key);
                    tokio::pin!(lock);
                    tokio::select! {
                        r = &mut lock => r,
                        _ = cancel => {
                            given_up = true;
                            if let Err(e) = timeout(self.bound, canceller.cancel()).await
                                .unwrap_or_else(|_| Err(format!("no answer within {:?}", self.bound)))
                            {
                                debug!("cancelling a native lock wait: {e}");
                            }
                            // The wait ends with an error (cancelled), or with the lock if it
                            // was granted first.
                            timeout(self.bound, &mut lock).await.unwrap_or_else(|_| {
                                Err(format!("a cancelled wait did not end within {:?}", self.bound))
                            })
                        }
                    }
                };
                match (got, given_up) {
                    (Ok(()), false) => Ok(Waited::Got(Held::Own(session))),
                    (Ok(()), true) => {
                        self.unlock(key, Held::Own(session)).await?;
                        Ok(Waited::GaveUp)
                    }
                    // The session is dropped: its connection closes, and whatever the server
                    // still had it wait for or hold goes with it.
                    (Err(_), true) => Ok(Waited::GaveUp),
                    (Err(e), false) => Err(e),
                }
            }
        }
    }

    pub(crate) async fn unlock(&self, key: &Key, held: Held) -> Result<(), String> {
        match held {
            Held::Local => Ok(()),
            Held::File(file) => {
                drop(file);
                Ok(())
            }
            Held::Shared => {
                let _ = self
                    .shared
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
                let mut holder = self.holder.lock().await;
                let Some(session) = holder.as_mut() else {
                    // The session is gone, and its locks with it.
                    return Ok(());
                };
                match timeout(self.bound, session.unlock(key)).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => {
                        *holder = None;
                        Err(e)
                    }
                    Err(_) => {
                        *holder = None;
                        Err(format!("lock session: no answer within {:?}", self.bound))
                    }
                }
            }
            Held::Own(mut session) => match timeout(self.bound, session.unlock(key)).await {
                Ok(Ok(())) => {
                    self.spare
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(session);
                    Ok(())
                }
                Ok(Err(e)) => Err(e),
                Err(_) => Err(format!("lock session: no answer within {:?}", self.bound)),
            },
        }
    }
}

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
    /// Lock files; `prefix` is the database file's path.
    #[cfg(feature = "sqlite")]
    Files {
        /// The database file: the lock file is `{prefix}-simba.locks` (on Linux; elsewhere
        /// `{prefix}-simba-{hash}.lock` / `.entry`).
        prefix: String,
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
            Kind::Files { prefix } => Key::File(FileKey::new(prefix, h)),
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
    pub(crate) async fn connect(kind: &Kind) -> Result<Session, String> {
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
            _ => Err("this backend has no lock sessions".to_owned()),
        }
    }

    pub(crate) async fn try_lock(&mut self, key: &Key) -> Result<bool, String> {
        match (self, key) {
            #[cfg(feature = "postgres")]
            (Session::Pg(s), Key::Session(SessionKey::Pg(k))) => s.try_lock(*k).await,
            #[cfg(feature = "mysql")]
            (Session::My(s), Key::Session(SessionKey::My(k))) => s.try_lock(k).await,
            #[allow(unreachable_patterns)]
            _ => Err("a lock key of another backend".to_owned()),
        }
    }

    pub(crate) async fn lock(&mut self, key: &Key) -> Result<(), String> {
        match (self, key) {
            #[cfg(feature = "postgres")]
            (Session::Pg(s), Key::Session(SessionKey::Pg(k))) => s.lock(*k).await,
            #[cfg(feature = "mysql")]
            (Session::My(s), Key::Session(SessionKey::My(k))) => s.lock(k).await,
            #[allow(unreachable_patterns)]
            _ => Err("a lock key of another backend".to_owned()),
        }
    }

    pub(crate) async fn unlock(&mut self, key: &Key) -> Result<(), String> {
        match (self, key) {
            #[cfg(feature = "postgres")]
            (Session::Pg(s), Key::Session(SessionKey::Pg(k))) => s.unlock(*k).await,
            #[cfg(feature = "mysql")]
            (Session::My(s), Key::Session(SessionKey::My(k))) => s.unlock(k).await,
            #[allow(unreachable_patterns)]
            _ => Err("a lock key of another backend".to_owned()),
        }
    }

    /// What ends this session's blocking wait from outside (another connection).
    pub(crate) fn canceller(&self, kind: &Kind) -> Canceller {
        match (self, kind) {
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
    /// Nothing to cancel with (a session and a kind of two different backends).
    None,
}

impl Canceller {
    pub(crate) async fn cancel(self) -> Result<(), String> {
        match self {
            #[cfg(feature = "postgres")]
            Canceller::Pg(token, pg) => pg
                .cancel(&token)
                .await
                .map_err(|e| format!("postgres cancel request: {e}")),
            #[cfg(feature = "mysql")]
            Canceller::My { url, id } => crate::mysql::lock::kill_query(&url, id).await,
            Canceller::None => Ok(()),
        }
    }
}

/// Without SQLite there are no lock files: their key and lock cannot be made.
#[cfg(not(feature = "sqlite"))]
mod no_files {
    use tokio::task::JoinHandle;

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

    impl FileKey {
        pub(crate) async fn try_lock(&self) -> Result<Option<FileLock>, String> {
            match *self {}
        }

        pub(crate) fn wait(&self) -> JoinHandle<Result<FileLock, String>> {
            match *self {}
        }
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;

    /// A wait whose cancel sender is gone has been given up: it returns at once without
    /// polling the finished receiver again (which panicked in a gate's wait task, and left
    /// that mutex's acquisitions waiting for good; found by `simba-chaos soak` on
    /// PostgreSQL).
    #[tokio::test]
    async fn a_wait_whose_canceller_is_gone_gives_up() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("t.db").display().to_string();
        for kind in [Kind::Files { prefix: db }, Kind::Local] {
            let locks = Locks::new(kind, Duration::from_secs(5));
            let key = locks.kind.key("simba_mutex", "m");
            let (tx, rx) = oneshot::channel::<()>();
            drop(tx);
            let waited = locks.wait(&key, rx).await;
            assert!(matches!(waited, Ok(Waited::GaveUp)), "{:?}", waited.is_ok());
        }
    }
}
