//! SQLite's native lock on Linux: open file description (OFD) byte-range locks in one
//! lock file per database, `{db}-simba.locks`, two bytes per mutex: the lock byte and,
//! before it, an "entry" byte that keeps the order (see the crate README), for the wait
//! queue (`crate::gate`).
//!
//! An OFD lock belongs to the open file description: every acquisition opens the file
//! anew, so the locks of two acquisitions conflict even within one process, a duplicated
//! descriptor (`simba exec`'s guardian) shares the lock, and the lock ends when the last
//! descriptor of its description is closed — by the holder, or by the kernel when the
//! process is gone.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, fcntl};
use nix::libc;
use tokio::task::JoinHandle;

use super::open_lock_file as open;

/// How many mutex slots the lock file has: slot `s` is the bytes `2s` (entry) and
/// `2s + 1` (lock), so the highest byte, `2 × (SLOTS − 1) + 1`, stays within `off_t`.
const SLOTS: u64 = (libc::off_t::MAX as u64).div_ceil(2);

/// The lock file of the database file `prefix`.
fn lock_path(prefix: &str) -> PathBuf {
    format!("{prefix}-simba.locks").into()
}

/// The byte at `offset`, to lock (`F_WRLCK`) or unlock (`F_UNLCK`).
fn byte(kind: libc::c_int, offset: libc::off_t) -> libc::flock {
    libc::flock {
        // F_WRLCK / F_UNLCK and SEEK_SET are small constants (1, 2, 0).
        l_type: kind as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: offset,
        l_len: 1,
        // Must be 0 for OFD locks.
        l_pid: 0,
    }
}

/// One place in the lock file: its path and the two bytes of one mutex.
#[derive(Debug, Clone)]
pub(crate) struct FileKey {
    path: PathBuf,
    entry: libc::off_t,
    lock: libc::off_t,
}

/// The lock file, open (a description of its own) and holding the lock byte of one
/// mutex; closing it (and every duplicate) unlocks.
pub(crate) type FileLock = File;

/// Error text of a lock call on `what` of `key`.
fn failed(key: &FileKey, what: &str, e: Errno) -> String {
    format!(
        "lock file {} ({what} byte {}): {e}",
        key.path.display(),
        if what == "entry" { key.entry } else { key.lock }
    )
}

/// One non-blocking attempt at a byte: `Ok(false)` if another description holds it.
fn try_byte(file: &File, key: &FileKey, what: &str, offset: libc::off_t) -> Result<bool, String> {
    let lock = byte(libc::F_WRLCK, offset);
    loop {
        match fcntl(file, FcntlArg::F_OFD_SETLK(&lock)) {
            Ok(_) => return Ok(true),
            Err(Errno::EAGAIN | Errno::EACCES) => return Ok(false),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(failed(key, what, e)),
        }
    }
}

/// A blocking wait for a byte (the kernel frees it when its holder closes its last
/// descriptor, or dies).
fn wait_byte(file: &File, key: &FileKey, what: &str, offset: libc::off_t) -> Result<(), String> {
    let lock = byte(libc::F_WRLCK, offset);
    loop {
        match fcntl(file, FcntlArg::F_OFD_SETLKW(&lock)) {
            Ok(_) => return Ok(()),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(failed(key, what, e)),
        }
    }
}

/// Lets the entry byte go, keeping the lock byte (the same description holds both).
fn leave_entry(file: &File, key: &FileKey) -> Result<(), String> {
    let unlock = byte(libc::F_UNLCK, key.entry);
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
    what: &str,
    offset: libc::off_t,
) -> Result<bool, String> {
    let mut probe = byte(libc::F_WRLCK, offset);
    loop {
        match fcntl(file, FcntlArg::F_OFD_GETLK(&mut probe)) {
            // The kernel writes F_UNLCK back when nothing conflicts.
            Ok(_) => return Ok(probe.l_type != libc::F_UNLCK as libc::c_short),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(failed(key, what, e)),
        }
    }
}

/// The lock without waiting, unless someone waits for it (holds the entry byte).
///
/// The entry byte is only looked at, never taken: a try that took it, even for a moment,
/// would make a waiter the kernel had just woken for it (and not yet run) find it held;
/// the kernel then queues that waiter again and wakes every request queued behind it,
/// which race for the byte, so a later waiter could go first (seen under load as the third
/// waiter served before the second).
pub(crate) fn try_lock(key: &FileKey) -> Result<Option<File>, String> {
    let file = open(&key.path)?;
    if held_elsewhere(&file, key, "entry", key.entry)? || !try_byte(&file, key, "lock", key.lock)? {
        return Ok(None);
    }
    Ok(Some(file))
}

/// Waits for the lock: first for the entry byte (blocked waiters wait behind one
/// another), then, holding it, for the lock byte; the entry is let go once the lock is
/// held. So at most one process waits on the lock byte at a time, and one that just
/// unlocked it cannot take it back before that waiter.
pub(crate) fn lock(key: &FileKey) -> Result<File, String> {
    let file = open(&key.path)?;
    wait_byte(&file, key, "entry", key.entry)?;
    wait_byte(&file, key, "lock", key.lock)?;
    leave_entry(&file, key)?;
    Ok(file)
}

impl FileKey {
    /// The two bytes of the mutex whose key hashes to `hash`, in the lock file of the
    /// database file `prefix`. Two hashes equal modulo [`SLOTS`] (2⁶² on 64-bit Linux)
    /// share the bytes: their mutexes then share one lock, which is safe (the row decides
    /// ownership), only less concurrent.
    pub(crate) fn new(prefix: &str, hash: u64) -> FileKey {
        let slot = hash % SLOTS;
        // slot < SLOTS, so 2 × slot + 1 <= off_t::MAX: the conversions cannot fail.
        let entry = libc::off_t::try_from(slot * 2).unwrap_or(0);
        FileKey {
            path: lock_path(prefix),
            entry,
            lock: entry + 1,
        }
    }

    /// One non-blocking attempt at the lock ([`try_lock`]), on the caller's thread: an
    /// `open` of a local file and two or three `fcntl(F_OFD_SETLK)` calls, which never
    /// wait (a few microseconds). A hop to a blocking thread cost more than the call, and
    /// 10,000 acquisitions at once grew the blocking pool by hundreds of threads (their
    /// stacks and malloc arenas: about 20 MB of the scale bench's resident memory).
    pub(crate) async fn try_lock(&self) -> Result<Option<File>, String> {
        try_lock(self)
    }

    /// A blocking wait for the lock ([`lock`]) on a thread of its own: it cannot be
    /// interrupted, so the caller follows its task.
    pub(crate) fn wait(&self) -> JoinHandle<Result<File, String>> {
        let key = self.clone();
        tokio::task::spawn_blocking(move || lock(&key))
    }
}

/// Removes, best effort, the per-name lock files of earlier builds beside the database
/// file `prefix` (`{db}-simba-{16 hex digits}.lock` and `.entry`), each one only if its
/// `flock` can be had without waiting (nobody holds or waits on it at that moment).
/// Returns how many it removed. See the crate README on running an earlier build beside
/// this one.
pub(crate) fn sweep_earlier(prefix: &str) -> usize {
    let prefix = Path::new(prefix);
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
mod tests {
    use super::*;

    #[test]
    fn the_bytes_stay_within_off_t() {
        for hash in [0, 1, u64::MAX, u64::MAX - 1, 1 << 63, (1 << 62) - 1] {
            let key = FileKey::new("/tmp/x.db", hash);
            assert!(key.entry >= 0 && key.entry % 2 == 0, "{key:?}");
            assert_eq!(key.lock, key.entry + 1, "{key:?}");
        }
        // The last slot ends at off_t's last byte (no wrap, no fallback to slot 0).
        assert_eq!(FileKey::new("/tmp/x.db", SLOTS - 1).lock, libc::off_t::MAX);
        assert_eq!(FileKey::new("/tmp/x.db", u64::MAX).lock, libc::off_t::MAX);
        let a = FileKey::new("/tmp/x.db", 7);
        let b = FileKey::new("/tmp/x.db", 8);
        assert_ne!(a.entry, b.entry);
    }

    #[test]
    fn two_descriptions_exclude_each_other_and_a_duplicate_shares_the_lock() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
        let db = dir.path().join("t.db");
        let db = db
            .to_str()
            .unwrap_or_else(|| panic!("temp path is not UTF-8"));
        let key = FileKey::new(db, 42);
        let other = FileKey::new(db, 43);
        let held = try_lock(&key)
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("free lock not taken"));
        assert!(try_lock(&key).unwrap_or_else(|e| panic!("{e}")).is_none());
        // Another mutex's bytes are independent.
        let _o = try_lock(&other)
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("another mutex's lock was blocked"));
        // A duplicate descriptor keeps the lock after the original is closed.
        let dup = held.try_clone().unwrap_or_else(|e| panic!("dup: {e}"));
        drop(held);
        assert!(try_lock(&key).unwrap_or_else(|e| panic!("{e}")).is_none());
        drop(dup);
        assert!(try_lock(&key).unwrap_or_else(|e| panic!("{e}")).is_some());
        // One lock file for both mutexes.
        let files: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap_or_else(|e| panic!("{e}"))
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(files, vec![std::ffi::OsString::from("t.db-simba.locks")]);
    }

    #[test]
    fn a_waiter_holding_the_entry_keeps_a_try_out() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
        let db = dir.path().join("t.db");
        let db = db
            .to_str()
            .unwrap_or_else(|| panic!("temp path is not UTF-8"));
        let key = FileKey::new(db, 5);
        let held = try_lock(&key)
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("free lock not taken"));
        let k = key.clone();
        let waiter = std::thread::spawn(move || lock(&k));
        // The waiter takes the entry byte, then blocks on the lock byte: seen from here
        // as a try failing while the holder still holds.
        let probe = open(&key.path).unwrap_or_else(|e| panic!("{e}"));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while try_byte(&probe, &key, "entry", key.entry).unwrap_or_else(|e| panic!("{e}")) {
            leave_entry(&probe, &key).unwrap_or_else(|e| panic!("{e}"));
            assert!(std::time::Instant::now() < deadline, "waiter never queued");
            std::thread::yield_now();
        }
        drop(held);
        // The holder let go; a newcomer's try still fails until the waiter has the lock,
        // and then because the waiter holds it.
        assert!(try_lock(&key).unwrap_or_else(|e| panic!("{e}")).is_none());
        let got = waiter
            .join()
            .unwrap_or_else(|_| panic!("waiter panicked"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(try_lock(&key).unwrap_or_else(|e| panic!("{e}")).is_none());
        drop(got);
        assert!(try_lock(&key).unwrap_or_else(|e| panic!("{e}")).is_some());
    }

    #[test]
    fn earlier_files_are_swept_unless_held() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
        let db = dir.path().join("t.db");
        let db_s = db
            .to_str()
            .unwrap_or_else(|| panic!("temp path is not UTF-8"));
        let name = |h: &str, ext: &str| dir.path().join(format!("t.db-simba-{h}.{ext}"));
        for p in [
            name("00000000000000aa", "lock"),
            name("00000000000000aa", "entry"),
            name("00000000000000bb", "lock"),
        ] {
            std::fs::write(&p, b"").unwrap_or_else(|e| panic!("{e}"));
        }
        let other = dir.path().join("other.db-simba-00000000000000aa.lock");
        std::fs::write(&other, b"").unwrap_or_else(|e| panic!("{e}"));
        let held = File::open(name("00000000000000bb", "lock")).unwrap_or_else(|e| panic!("{e}"));
        held.lock().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(sweep_earlier(db_s), 2);
        assert!(
            name("00000000000000bb", "lock").exists(),
            "a held file was removed"
        );
        assert!(!name("00000000000000aa", "lock").exists());
        assert!(other.exists(), "another database's file was removed");
    }
}
