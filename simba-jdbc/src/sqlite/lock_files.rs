//! SQLite's native lock outside Linux: `flock` on a lock file per mutex next to the
//! database file, behind a second "entry" lock file that keeps the order (see the crate
//! README), for the wait queue (`crate::gate`). These files are left in place: deleting
//! one races with a process about to lock it.

use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};

use tokio::task::JoinHandle;

use super::open_lock_file as open;

fn try_one(file: &File, path: &Path) -> Result<bool, String> {
    match file.try_lock() {
        Ok(()) => Ok(true),
        Err(TryLockError::WouldBlock) => Ok(false),
        Err(TryLockError::Error(e)) => Err(format!("lock file {}: {e}", path.display())),
    }
}

/// The lock without waiting, unless someone waits for it (holds the entry file).
pub(crate) fn try_lock(main: &Path, entry: &Path) -> Result<Option<File>, String> {
    let gate = open(entry)?;
    if !try_one(&gate, entry)? {
        return Ok(None);
    }
    let file = open(main)?;
    Ok(try_one(&file, main)?.then_some(file))
}

/// Waits for the lock: first for the entry file (the kernel queues its waiters behind
/// one another), then, holding it, for the lock file itself; the entry is let go once
/// the lock is held. So at most one process waits on the lock file at a time, and one
/// that just unlocked it cannot take it back before that waiter.
pub(crate) fn lock(main: &Path, entry: &Path) -> Result<File, String> {
    let gate = open(entry)?;
    gate.lock()
        .map_err(|e| format!("lock file {}: {e}", entry.display()))?;
    let file = open(main)?;
    file.lock()
        .map_err(|e| format!("lock file {}: {e}", main.display()))?;
    drop(gate);
    Ok(file)
}

/// The lock files of one mutex: `{prefix}-simba-{hash}.lock` and its `.entry`.
#[derive(Debug, Clone)]
pub(crate) struct FileKey {
    main: PathBuf,
    entry: PathBuf,
}

/// A lock file this process holds: open and locked; closing it unlocks.
pub(crate) type FileLock = File;

impl FileKey {
    /// The lock files of the mutex whose key hashes to `hash`, beside the database file
    /// `prefix`.
    pub(crate) fn new(prefix: &str, hash: u64) -> FileKey {
        FileKey {
            main: format!("{prefix}-simba-{hash:016x}.lock").into(),
            entry: format!("{prefix}-simba-{hash:016x}.entry").into(),
        }
    }

    /// One non-blocking attempt at the lock ([`try_lock`]), on a blocking thread.
    pub(crate) async fn try_lock(&self) -> Result<Option<File>, String> {
        let (main, entry) = (self.main.clone(), self.entry.clone());
        tokio::task::spawn_blocking(move || try_lock(&main, &entry))
            .await
            .map_err(|e| format!("lock file task: {e}"))?
    }

    /// A blocking wait for the lock ([`lock`]) on a thread of its own: it cannot be
    /// interrupted, so the caller follows its task.
    pub(crate) fn wait(&self) -> JoinHandle<Result<File, String>> {
        let (main, entry) = (self.main.clone(), self.entry.clone());
        tokio::task::spawn_blocking(move || lock(&main, &entry))
    }
}

/// Nothing to sweep: the per-name files are this build's own lock files here.
pub(crate) fn sweep_earlier(_prefix: &str) -> usize {
    0
}
