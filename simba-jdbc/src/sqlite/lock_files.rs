//! SQLite's native lock outside Linux: `flock` on a lock file per mutex next to the
//! database file, behind a second "entry" lock file that keeps the order (see the crate
//! README), for the store's wait queue. These files are left in place: deleting
//! one races with a process about to lock it.

use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::task::JoinHandle;

use super::Refused;
use super::open_lock_file as open;
use crate::lock_error::LockError;

fn failed(path: &Path, source: std::io::Error) -> LockError {
    LockError::File {
        path: path.to_owned(),
        source,
    }
}

fn try_one(file: &File, path: &Path) -> Result<bool, LockError> {
    match file.try_lock() {
        Ok(()) => Ok(true),
        Err(TryLockError::WouldBlock) => Ok(false),
        Err(TryLockError::Error(e)) => Err(failed(path, e)),
    }
}

/// The lock without waiting, unless someone waits for it (holds the entry file).
pub(crate) fn try_lock(main: &Path, entry: &Path) -> Result<Option<FileLock>, LockError> {
    let gate = open(entry)?;
    if !try_one(&gate, entry)? {
        return Ok(None);
    }
    let file = open(main)?;
    Ok(try_one(&file, main)?.then_some(FileLock(file)))
}

/// Waits for the lock: first for the entry file (the kernel queues its waiters behind
/// one another), then, holding it, for the lock file itself; the entry is let go once
/// the lock is held. So at most one process waits on the lock file at a time, and one
/// that just unlocked it cannot take it back before that waiter.
pub(crate) fn lock(main: &Path, entry: &Path) -> Result<FileLock, LockError> {
    let gate = open(entry)?;
    gate.lock().map_err(|e| failed(entry, e))?;
    let file = open(main)?;
    file.lock().map_err(|e| failed(main, e))?;
    drop(gate);
    Ok(FileLock(file))
}

/// The lock files of one mutex: `{prefix}-simba-{hash}.lock` and its `.entry`.
#[derive(Debug, Clone)]
pub(crate) struct FileKey {
    main: PathBuf,
    entry: PathBuf,
}

/// A lock file this process holds: open and locked; closing it unlocks.
#[derive(Debug)]
pub(crate) struct FileLock(File);

impl FileLock {
    /// The gated flag its owner writes: 0, never taken over at once (see the module docs).
    pub(crate) fn mark(&self) -> i64 {
        0
    }

    /// A duplicate of the lock file, for another process to hold too.
    #[cfg(unix)]
    pub(crate) fn anchor(&mut self) -> Option<simba_core::connect::Anchor> {
        let dup = self.0.try_clone().ok()?;
        Some(simba_core::connect::Anchor::new(Arc::new(dup)))
    }
}

/// The database file of a store.
#[derive(Debug)]
pub(crate) struct DbFile {
    path: PathBuf,
}

impl DbFile {
    pub(crate) fn new(path: &str) -> Arc<DbFile> {
        Arc::new(DbFile { path: path.into() })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Checks that the database file exists and (on Unix) has one name; the mark is 0.
    pub(crate) fn check(&self) -> Result<i64, Refused> {
        let meta = std::fs::metadata(&self.path).map_err(|e| Refused::opening(&self.path, e))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            if meta.nlink() > 1 {
                return Err(Refused::HardLinked {
                    path: self.path.clone(),
                    links: meta.nlink(),
                });
            }
        }
        let _ = meta;
        Ok(0)
    }

    /// [`DbFile::check`]; no job byte here (`simba exec` passes the lock files on to its
    /// command instead): `None`.
    pub(crate) fn check_job(&self, _key: &FileKey) -> Result<Option<i64>, Refused> {
        self.check().map(|_| None)
    }
}

impl FileKey {
    /// The lock files of the mutex whose key hashes to `hash`, beside the database file
    /// `db`.
    pub(crate) fn new(db: &Arc<DbFile>, hash: u64) -> FileKey {
        let prefix = db.path.display();
        FileKey {
            main: format!("{prefix}-simba-{hash:016x}.lock").into(),
            entry: format!("{prefix}-simba-{hash:016x}.entry").into(),
        }
    }

    /// One non-blocking attempt at the lock ([`try_lock`]), on a blocking thread.
    pub(crate) async fn try_lock(&self) -> Result<Option<FileLock>, LockError> {
        let (main, entry) = (self.main.clone(), self.entry.clone());
        tokio::task::spawn_blocking(move || try_lock(&main, &entry)).await?
    }

    /// A blocking wait for the lock ([`lock`]) on a thread of its own: it cannot be
    /// interrupted, so the caller follows its task.
    pub(crate) fn wait(&self) -> JoinHandle<Result<FileLock, LockError>> {
        let (main, entry) = (self.main.clone(), self.entry.clone());
        tokio::task::spawn_blocking(move || lock(&main, &entry))
    }
}

/// Nothing to sweep: the per-name files are this build's own lock files here.
pub(crate) fn sweep_earlier(_prefix: &Path) -> usize {
    0
}
