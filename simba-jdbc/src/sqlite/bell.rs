//! SQLite on Linux: how a store hears that another process freed permits of a semaphore.
//!
//! A database has one bell file beside it, `{db}-simba-permits`, of [`SLOTS`] slots of 8
//! bytes. A store that frees permits a waiter of another store is owed writes a value
//! never written before (its process id and a counter) to the semaphore's slot, found
//! from the hash of the table's and the semaphore's names ([`Bells::ring`]). A store with
//! waiters watches the file with inotify on a thread of its own ([`Bells::watch`]); on each
//! change it reads the file, compares it with what it read before, and hands the changed
//! slots to its [`OnPermit`], which wakes its waiters of the semaphores in those slots
//! (two semaphores in one slot wake each other's waiters: a spurious look, no more). The
//! file is created by the first watch and left in place.
//!
//! A ring is a hint: a waiter that misses one (the watch was not yet in place) finds its
//! permit at its next look, [`PERMIT_POLL`](crate::PERMIT_POLL) at most.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use tracing::debug;

use crate::hash::stable_hash;
use crate::push::{Freed, OnPermit};

/// Slots of the bell file: 512 × 8 bytes, one page.
pub(crate) const SLOTS: u64 = 512;

/// The bells of one database.
pub(crate) struct Bells {
    path: PathBuf,
    /// The mutex table: its semaphores ring slots apart from another table's.
    table: String,
    shared: Arc<Shared>,
    /// The bell file, opened by the first ring and kept for the next ones.
    file: OnceLock<std::fs::File>,
}

#[derive(Default)]
struct Shared {
    /// Set by the first watch, with the thread that reads its events; `None` if inotify
    /// or the thread could not be had (the waiters look again on their own then).
    watch: OnceLock<Option<Watch>>,
    on_permit: OnceLock<OnPermit>,
}

struct Watch {
    inotify: Arc<Inotify>,
    wd: WatchDescriptor,
    /// The store is gone: the thread ends at its next event.
    closed: Arc<Mutex<bool>>,
}

/// Rings made by this process: with its id, each value written is new.
static RINGS: AtomicU32 = AtomicU32::new(1);

impl Bells {
    pub(crate) fn new(db: &str, table: &str) -> Bells {
        Bells {
            path: format!("{db}-simba-permits").into(),
            table: table.to_owned(),
            shared: Arc::default(),
            file: OnceLock::new(),
        }
    }

    /// Sets what the store does with every ring heard. Set once; later calls are ignored.
    pub(crate) fn on_permit(&self, f: OnPermit) {
        let _ = self.shared.on_permit.set(f);
    }

    /// Tells the stores that watch the bell, in every process, that permits of `semaphore`
    /// were freed. A failure is logged and otherwise ignored: the waiters find their
    /// permit at their next look.
    pub(crate) fn ring(&self, semaphore: &str) {
        let value = (u64::from(std::process::id()) << 32)
            | u64::from(RINGS.fetch_add(1, Ordering::Relaxed));
        let file = match self.file.get() {
            Some(f) => Ok(f),
            None => open(&self.path).map(|f| self.file.get_or_init(|| f)),
        };
        let rung =
            file.and_then(|f| f.write_at(&value.to_le_bytes(), slot(&self.table, semaphore) * 8));
        if let Err(e) = rung {
            debug!(path = %self.path.display(), "cannot ring the semaphores' bell: {e}");
        }
    }

    /// Makes sure this store hears the bell (a waiter is about to wait). A failure is
    /// logged once and otherwise ignored: the store's waiters then look again on their own.
    pub(crate) fn watch(&self) {
        self.shared.watch.get_or_init(|| match self.start() {
            Ok(w) => Some(w),
            Err(e) => {
                debug!(path = %self.path.display(), "cannot watch the semaphores' bell: {e}");
                None
            }
        });
    }

    /// The watch of the bell file and the thread that reads its events.
    fn start(&self) -> Result<Watch, String> {
        let first = read(&self.path).map_err(|e| e.to_string())?;
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC).map_err(|e| e.to_string())?;
        let wd = inotify
            .add_watch(&self.path, AddWatchFlags::IN_MODIFY)
            .map_err(|e| e.to_string())?;
        let inotify = Arc::new(inotify);
        let closed = Arc::new(Mutex::new(false));
        let reader = Reader {
            inotify: inotify.clone(),
            path: self.path.clone(),
            table: self.table.clone(),
            closed: closed.clone(),
            shared: Arc::downgrade(&self.shared),
            last: first,
        };
        std::thread::Builder::new()
            .name("simba-sqlite-bell".to_owned())
            .spawn(move || reader.run())
            .map_err(|e| e.to_string())?;
        Ok(Watch {
            inotify,
            wd,
            closed,
        })
    }
}

impl Drop for Bells {
    /// Ends the thread: removing the watch queues an event, which wakes it.
    fn drop(&mut self) {
        if let Some(Some(w)) = self.shared.watch.get() {
            *w.closed.lock().unwrap_or_else(|p| p.into_inner()) = true;
            let _ = w.inotify.rm_watch(w.wd);
        }
    }
}

/// The slot of `semaphore` of the mutex table `table`.
fn slot(table: &str, semaphore: &str) -> u64 {
    stable_hash(&[table, semaphore]) % SLOTS
}

/// Opens the bell file, creating it if needed.
fn open(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
}

/// The slots of the bell file (zero past its end).
fn read(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    let file = open(path)?;
    let mut page = vec![0u8; (SLOTS * 8) as usize];
    let mut at = 0;
    while at < page.len() {
        match file.read_at(&mut page[at..], at as u64)? {
            0 => break,
            n => at += n,
        }
    }
    Ok(page)
}

/// The thread of a store's bell.
struct Reader {
    inotify: Arc<Inotify>,
    path: PathBuf,
    table: String,
    closed: Arc<Mutex<bool>>,
    shared: Weak<Shared>,
    /// The file as last read.
    last: Vec<u8>,
}

impl Reader {
    /// Hands each change of the file to the store until the store is gone.
    fn run(mut self) {
        loop {
            match self.inotify.read_events() {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    debug!("the semaphores' bell stopped: {e}");
                    return;
                }
            }
            if *self.closed.lock().unwrap_or_else(|p| p.into_inner()) {
                return;
            }
            let Some(shared) = self.shared.upgrade() else {
                return;
            };
            let page = match read(&self.path) {
                Ok(page) => page,
                Err(e) => {
                    debug!("cannot read the semaphores' bell: {e}");
                    continue;
                }
            };
            let changed: Vec<u64> = page
                .chunks(8)
                .zip(self.last.chunks(8))
                .enumerate()
                .filter(|(_, (now, before))| now != before)
                .map(|(slot, _)| slot as u64)
                .collect();
            self.last = page;
            if !changed.is_empty()
                && let Some(f) = shared.on_permit.get()
            {
                f(Freed::Matching(&|semaphore: &str| {
                    changed.contains(&slot(&self.table, semaphore))
                }));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two stores' bells on one database, as in two processes: a ring of one reaches the
    /// watcher of the other, for the semaphore rung and not for one in another slot.
    #[test]
    fn a_ring_reaches_the_watcher_for_its_semaphore() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("t.db");
        let db = db.to_str().expect("utf-8 path");
        let (watcher, ringer) = (Bells::new(db, "simba"), Bells::new(db, "simba"));
        let other = (0..)
            .map(|i| format!("other-{i}"))
            .find(|o| slot("simba", o) != slot("simba", "s"))
            .expect("a name in another slot");
        let (tx, rx) = std::sync::mpsc::channel::<(bool, bool)>();
        let tx = Mutex::new(tx);
        watcher.on_permit(Box::new(move |news| {
            if let Freed::Matching(test) = news {
                let sent = tx
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .send((test("s"), test(&other)));
                let _ = sent;
            }
        }));
        watcher.watch();
        ringer.ring("s");
        // Bound: inotify delivers at once; 10 s is only a guard.
        let heard = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the ring was not heard");
        assert_eq!(heard, (true, false));
        // Dropping the watcher ends its thread (nothing to assert but that it returns).
        drop(watcher);
    }
}
