//! SQLite's native lock on Linux: open file description (OFD) byte-range locks on the
//! database file itself, two bytes per mutex far above SQLite's own lock bytes: the lock
//! byte and, before it, an "entry" byte that keeps the order (see the crate README), for
//! the store's wait queue. A third byte per mutex, in a region of its own, is
//! the *job* byte: held by the processes of a job that runs for the owner (`simba exec`'s
//! command, see [`DbFile::check_job`]), never by simba's own processes.
//!
//! The lock belongs to the file (its inode), not to a name: every path that opens the
//! database (a symlink, a bind mount, `a/../t.db`) reaches the same bytes, and there is no
//! file beside it that an operator could delete.
//!
//! An OFD lock belongs to the open file description: each held or waited lock uses a
//! description of its own, so the locks of two acquisitions conflict even within one
//! process, a duplicated descriptor (`simba exec`'s guardian) shares the lock, and the
//! kernel frees the lock when the process is gone.
//!
//! **No descriptor of the database file is ever closed here.** Closing any descriptor of a
//! file drops every POSIX (`fcntl`) lock the process holds on it, so SQLite's own locks
//! of this process's connections (SQLite's "How To Corrupt An SQLite Database File",
//! §2.2). A lock is let go with `F_UNLCK` and its description goes back to a free list of
//! its database file ([`Inode`]), process-wide, for the next lock; a description that was
//! shared with another process ([`FileLock::anchor`]) is retired: kept open, never used
//! again, its lock kept until the process ends.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex as StdMutex, OnceLock};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, fcntl};
use nix::libc;
use tokio::task::JoinHandle;

use super::Refused;
use crate::lock_error::LockError;

/// The first byte simba locks in the database file: 2⁴⁰, far above SQLite's lock bytes
/// (`0x40000000` to `0x400001ff`), which stay below every slot whatever SQLite's page
/// size.
const BASE: libc::off_t = 1 << 40;

/// How many mutex slots there are: slot `s` is the bytes `BASE + 2s` (entry) and
/// `BASE + 2s + 1` (lock); the last lock byte is `off_t::MAX`.
const SLOTS: u64 = ((libc::off_t::MAX - BASE) as u64).div_ceil(2);

/// The first job byte: 2³⁹, the region below [`BASE`].
const JOB_BASE: libc::off_t = 1 << 39;

/// How many job bytes there are: slot `s` has the job byte `JOB_BASE + s % JOB_SLOTS`.
/// Two mutexes whose slots are equal modulo 2³⁹ share it: a running job of one then keeps
/// a lease takeover of the other back too (liveness only, never safety).
const JOB_SLOTS: u64 = 1 << 39;

/// The job byte of the mutex whose entry byte is `entry`.
fn job_byte(entry: libc::off_t) -> libc::off_t {
    let slot = u64::try_from((entry - BASE) / 2).unwrap_or(0);
    // < 2³⁹: fits.
    JOB_BASE + libc::off_t::try_from(slot % JOB_SLOTS).unwrap_or(0)
}

/// The byte range `[offset, offset + len)`, to lock (`F_WRLCK`) or unlock (`F_UNLCK`).
fn range(kind: libc::c_int, offset: libc::off_t, len: libc::off_t) -> libc::flock {
    libc::flock {
        // F_WRLCK / F_UNLCK and SEEK_SET are small constants (1, 2, 0).
        l_type: kind as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: offset,
        l_len: len,
        // Must be 0 for OFD locks.
        l_pid: 0,
    }
}

/// An open file description of a database file. It is never closed (see the module
/// docs): dropping it leaves the descriptor open.
#[derive(Debug)]
pub(crate) struct Desc(ManuallyDrop<File>);

impl AsFd for Desc {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// One database file (an inode) in this process: the value that marks rows gated by its
/// locks, and its descriptions that hold nothing.
#[derive(Debug)]
struct Inode {
    mark: i64,
    free: StdMutex<Vec<Desc>>,
}

/// The database files of this process, by (device, inode).
type Inodes = StdMutex<HashMap<(u64, u64), Arc<Inode>>>;

/// Every database file this process has locked in. Never emptied: its descriptions may
/// not be closed.
static INODES: LazyLock<Inodes> = LazyLock::new(|| StdMutex::new(HashMap::new()));

/// The value a gated row of the database file (`dev`, `ino`) carries in `waiter_until`:
/// a hash of the file's identity in `2..=i64::MAX` (0 and 1 mean "not gated" and "gated
/// by an earlier build").
pub(crate) fn identity_mark(dev: u64, ino: u64) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in dev.to_le_bytes().into_iter().chain(ino.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let span = i64::MAX as u64 - 1;
    // h % span <= i64::MAX - 2: the sum fits.
    2 + i64::try_from(h % span).unwrap_or(0)
}

/// The database file of a store: its path as configured, and the file it named when the
/// store first locked.
#[derive(Debug)]
pub(crate) struct DbFile {
    path: PathBuf,
    inode: OnceLock<Arc<Inode>>,
}

impl DbFile {
    /// No I/O: the file is opened at the first lock.
    pub(crate) fn new(path: &str) -> Arc<DbFile> {
        Arc::new(DbFile {
            path: path.into(),
            inode: OnceLock::new(),
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// A description of the database file that holds no lock, with its file: one off the
    /// free list, or a new one. Refused when the file has more than one name (checked on
    /// the description itself, each time).
    fn take(&self) -> Result<(Arc<Inode>, Desc), Refused> {
        if let Some(inode) = self.inode.get() {
            loop {
                let reused = inode.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
                let Some(desc) = reused else {
                    break;
                };
                match self.check_links(&desc) {
                    Ok(_) => return Ok((inode.clone(), desc)),
                    // A description of a file deleted since (its inode number may come
                    // back with another file): dropped, not closed, not used again.
                    Err(Refused::Deleted) => continue,
                    Err(e) => {
                        give_back(inode, desc);
                        return Err(e);
                    }
                }
            }
        }
        self.open()
    }

    /// Opens the database file anew (read-write, close-on-exec, never created) and finds
    /// its inode's entry.
    fn open(&self) -> Result<(Arc<Inode>, Desc), Refused> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&self.path)
            .map_err(|e| Refused::opening(&self.path, e))?;
        // From here on the descriptor is never closed.
        let desc = Desc(ManuallyDrop::new(file));
        let meta = self.check_links(&desc)?;
        let inode = {
            let mut all = INODES.lock().unwrap_or_else(|p| p.into_inner());
            all.entry((meta.dev(), meta.ino()))
                .or_insert_with(|| {
                    Arc::new(Inode {
                        mark: identity_mark(meta.dev(), meta.ino()),
                        free: StdMutex::new(Vec::new()),
                    })
                })
                .clone()
        };
        let _ = self.inode.set(inode.clone());
        Ok((inode, desc))
    }

    /// `fstat` of the description: refused if the file has other names.
    fn check_links(&self, desc: &Desc) -> Result<std::fs::Metadata, Refused> {
        let meta = desc.0.metadata().map_err(|source| Refused::Io {
            what: "fstat",
            path: self.path.clone(),
            source,
        })?;
        if meta.nlink() == 0 {
            return Err(Refused::Deleted);
        }
        if meta.nlink() > 1 {
            return Err(Refused::HardLinked {
                path: self.path.clone(),
                links: meta.nlink(),
            });
        }
        Ok(meta)
    }

    /// Checks that the database file exists and has one name, and returns the mark of its
    /// gated rows (store start, migrate and every acquisition: an `fstat` of a free
    /// description).
    pub(crate) fn check(&self) -> Result<i64, Refused> {
        self.with_free(|inode, _| inode.mark)
    }

    /// [`DbFile::check`], and whether a job holds the job byte of `key`, a mutex of this
    /// file (one `F_OFD_GETLK` on the same description): `Some(mark)` when one does, the
    /// mark of the rows its owner gated. A probe failure counts as held (it only holds a
    /// takeover back).
    pub(crate) fn check_job(&self, key: &FileKey) -> Result<Option<i64>, Refused> {
        self.with_free(|inode, desc| {
            let held =
                held_elsewhere(&desc.0, key, "job", job_byte(key.entry)).unwrap_or_else(|e| {
                    tracing::debug!("{e}");
                    true
                });
            held.then_some(inode.mark)
        })
    }

    /// `f` of a free description of the file (checked by [`DbFile::take`]), given back
    /// after.
    fn with_free<T>(&self, f: impl FnOnce(&Inode, &Desc) -> T) -> Result<T, Refused> {
        let (inode, desc) = self.take()?;
        let out = f(&inode, &desc);
        give_back(&inode, desc);
        Ok(out)
    }
}

/// A description that holds nothing goes back to the free list of its file.
fn give_back(inode: &Inode, desc: Desc) {
    inode
        .free
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(desc);
}

/// The two bytes of one mutex in a database file.
#[derive(Debug, Clone)]
pub(crate) struct FileKey {
    db: Arc<DbFile>,
    entry: libc::off_t,
    lock: libc::off_t,
}

/// How a held lock holds its description.
#[derive(Debug)]
enum Slot {
    Own(Desc),
    /// Shared with another process ([`FileLock::anchor`]): retired.
    Anchored(Arc<Desc>),
    /// Moved out (during drop).
    Gone,
}

/// A description of the database file locked for one mutex (or, while a wait or try is
/// under way, about to be). Dropping it unlocks the mutex's bytes and gives the
/// description back; an anchored one keeps its lock, open, until the process ends.
#[derive(Debug)]
pub(crate) struct FileLock {
    inode: Arc<Inode>,
    desc: Slot,
    entry: libc::off_t,
    path: PathBuf,
}

impl FileLock {
    fn file(&self) -> Option<&File> {
        match &self.desc {
            Slot::Own(d) => Some(&d.0),
            Slot::Anchored(d) => Some(&d.0),
            Slot::Gone => None,
        }
    }

    /// The value this lock's owner writes to its row's gated flag (`waiter_until`), and
    /// that a holder takes a gated row over at once by: the identity of the database file.
    pub(crate) fn mark(&self) -> i64 {
        self.inode.mark
    }

    /// The description, to be shared with another process (`simba exec`'s guardian):
    /// from now on this lock is never unlocked by this process, nor its description used
    /// again (the other process's copy would hold the next lock too).
    pub(crate) fn anchor(&mut self) -> Option<simba_core::connect::Anchor> {
        let desc = match std::mem::replace(&mut self.desc, Slot::Gone) {
            Slot::Own(d) => Arc::new(d),
            Slot::Anchored(d) => d,
            // Only a drop moves it out.
            Slot::Gone => return None,
        };
        self.desc = Slot::Anchored(desc.clone());
        // job_byte < BASE: positive.
        Some(
            simba_core::connect::Anchor::new(desc)
                .with_job_byte(u64::try_from(job_byte(self.entry)).unwrap_or(0)),
        )
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        let Slot::Own(desc) = std::mem::replace(&mut self.desc, Slot::Gone) else {
            // Anchored: locked and open until the process ends.
            return;
        };
        let unlock = range(libc::F_UNLCK, self.entry, 2);
        loop {
            match fcntl(&*desc.0, FcntlArg::F_OFD_SETLK(&unlock)) {
                Ok(_) => return give_back(&self.inode, desc),
                Err(Errno::EINTR) => continue,
                Err(e) => {
                    // Not reused (it may still hold a byte), and not closed.
                    tracing::warn!(
                        "cannot unlock bytes {}..{} of {}: {e}; its description is retired",
                        self.entry,
                        self.entry + 1,
                        self.path.display()
                    );
                    return;
                }
            }
        }
    }
}

/// The error of a lock call on `what` of `key`.
fn failed(key: &FileKey, what: &'static str, e: Errno) -> LockError {
    let byte = match what {
        "entry" => key.entry,
        "job" => job_byte(key.entry),
        _ => key.lock,
    };
    LockError::Byte {
        path: key.db.path.clone(),
        what,
        byte,
        source: Box::new(e),
    }
}

/// One non-blocking attempt at a byte: `Ok(false)` if another description holds it.
fn try_byte(
    file: &File,
    key: &FileKey,
    what: &'static str,
    offset: libc::off_t,
) -> Result<bool, LockError> {
    let lock = range(libc::F_WRLCK, offset, 1);
    loop {
        match fcntl(file, FcntlArg::F_OFD_SETLK(&lock)) {
            Ok(_) => return Ok(true),
            Err(Errno::EAGAIN | Errno::EACCES) => return Ok(false),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(failed(key, what, e)),
        }
    }
}

/// A blocking wait for a byte (the kernel frees it when its holder unlocks it, or dies).
fn wait_byte(
    file: &File,
    key: &FileKey,
    what: &'static str,
    offset: libc::off_t,
) -> Result<(), LockError> {
    let lock = range(libc::F_WRLCK, offset, 1);
    loop {
        match fcntl(file, FcntlArg::F_OFD_SETLKW(&lock)) {
            Ok(_) => return Ok(()),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(failed(key, what, e)),
        }
    }
}

/// Lets the entry byte go, keeping the lock byte (the same description holds both).
fn leave_entry(file: &File, key: &FileKey) -> Result<(), LockError> {
    let unlock = range(libc::F_UNLCK, key.entry, 1);
    loop {
        match fcntl(file, FcntlArg::F_OFD_SETLK(&unlock)) {
            Ok(_) => return Ok(()),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(failed(key, "entry", e)),
        }
    }
}

/// Whether another description holds the byte at `offset`. A query (`F_OFD_GETLK`): it
/// takes nothing, so it leaves the kernel's queue of blocked requests as it is.
fn held_elsewhere(
    file: &File,
    key: &FileKey,
    what: &'static str,
    offset: libc::off_t,
) -> Result<bool, LockError> {
    let mut probe = range(libc::F_WRLCK, offset, 1);
    loop {
        match fcntl(file, FcntlArg::F_OFD_GETLK(&mut probe)) {
            // The kernel writes F_UNLCK back when nothing conflicts.
            Ok(_) => return Ok(probe.l_type != libc::F_UNLCK as libc::c_short),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(failed(key, what, e)),
        }
    }
}

/// A description for `key`, wrapped so that any way out unlocks and gives it back.
fn start(key: &FileKey) -> Result<FileLock, LockError> {
    let (inode, desc) = key.db.take()?;
    Ok(FileLock {
        inode,
        desc: Slot::Own(desc),
        entry: key.entry,
        path: key.db.path.clone(),
    })
}

/// The lock without waiting, unless someone waits for it (holds the entry byte).
///
/// The entry byte is only looked at, never taken: a try that took it, even for a moment,
/// would make a waiter the kernel had just woken for it (and not yet run) find it held;
/// the kernel then queues that waiter again and wakes every request queued behind it,
/// which race for the byte, so a later waiter could go first (seen under load as the third
/// waiter served before the second).
pub(crate) fn try_lock(key: &FileKey) -> Result<Option<FileLock>, LockError> {
    let held = start(key)?;
    let Some(file) = held.file() else {
        return Err(LockError::Mismatch("a lock without its description"));
    };
    if held_elsewhere(file, key, "entry", key.entry)? || !try_byte(file, key, "lock", key.lock)? {
        return Ok(None);
    }
    Ok(Some(held))
}

/// Waits for the lock: first for the entry byte (blocked waiters wait behind one
/// another), then, holding it, for the lock byte; the entry is let go once the lock is
/// held. So at most one process waits on the lock byte at a time, and one that just
/// unlocked it cannot take it back before that waiter.
pub(crate) fn lock(key: &FileKey) -> Result<FileLock, LockError> {
    let held = start(key)?;
    let Some(file) = held.file() else {
        return Err(LockError::Mismatch("a lock without its description"));
    };
    wait_byte(file, key, "entry", key.entry)?;
    wait_byte(file, key, "lock", key.lock)?;
    leave_entry(file, key)?;
    Ok(held)
}

impl FileKey {
    /// The two bytes of the mutex whose key hashes to `hash`, in the database file `db`.
    /// Two hashes equal modulo [`SLOTS`] (about 2⁶²) share the bytes: their mutexes then
    /// share one lock, which is safe (the row decides ownership), only less concurrent.
    pub(crate) fn new(db: &Arc<DbFile>, hash: u64) -> FileKey {
        let slot = hash % SLOTS;
        // slot < SLOTS, so BASE + 2 × slot + 1 <= off_t::MAX: the conversion cannot fail.
        let entry = BASE + libc::off_t::try_from(slot * 2).unwrap_or(0);
        FileKey {
            db: db.clone(),
            entry,
            lock: entry + 1,
        }
    }

    /// One non-blocking attempt at the lock ([`try_lock`]), on the caller's thread: a
    /// description off the free list (an `fstat`) and two or three `fcntl` calls, which
    /// never wait (a few microseconds). A hop to a blocking thread cost more than the call,
    /// and 10,000 acquisitions at once grew the blocking pool by hundreds of threads
    /// (their stacks and malloc arenas: about 20 MB of the scale bench's resident memory).
    pub(crate) async fn try_lock(&self) -> Result<Option<FileLock>, LockError> {
        try_lock(self)
    }

    /// A blocking wait for the lock ([`lock`]) on a thread of its own: it cannot be
    /// interrupted, so the caller follows its task.
    pub(crate) fn wait(&self) -> JoinHandle<Result<FileLock, LockError>> {
        let key = self.clone();
        tokio::task::spawn_blocking(move || lock(&key))
    }
}

/// Removes, best effort, the per-name lock files of earlier builds beside the database
/// file `prefix` (`{db}-simba-{16 hex digits}.lock` and `.entry`), each one only if its
/// `flock` can be had without waiting (nobody holds or waits on it at that moment).
/// Returns how many it removed. The `{db}-simba.locks` file of the build before this one
/// is left alone (see the crate README on running an earlier build beside this one).
pub(crate) fn sweep_earlier(prefix: &Path) -> usize {
    let (Some(dir), Some(name)) = (prefix.parent(), prefix.file_name()) else {
        return 0;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let Some(stem) = name.to_str().map(|n| format!("{n}-simba-")) else {
        return 0;
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(rest) = file_name.to_str().and_then(|n| n.strip_prefix(&stem)) else {
            continue;
        };
        let Some((hex, ext)) = rest.split_once('.') else {
            continue;
        };
        if hex.len() != 16
            || !hex.bytes().all(|b| b.is_ascii_hexdigit())
            || !matches!(ext, "lock" | "entry")
        {
            continue;
        }
        let path = entry.path();
        let Ok(file) = OpenOptions::new().read(true).write(true).open(&path) else {
            continue;
        };
        if file.try_lock().is_ok() && std::fs::remove_file(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests;
