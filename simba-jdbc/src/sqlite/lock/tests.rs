use super::*;

fn db(dir: &tempfile::TempDir) -> Arc<DbFile> {
    let path = dir.path().join("t.db");
    std::fs::write(&path, b"").unwrap_or_else(|e| panic!("{e}"));
    DbFile::new(path.to_str().unwrap_or_else(|| panic!("UTF-8")))
}

#[test]
fn the_bytes_stay_within_off_t_and_above_sqlites() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
    let d = db(&dir);
    for hash in [0, 1, u64::MAX, u64::MAX - 1, 1 << 63, (1 << 62) - 1] {
        let key = FileKey::new(&d, hash);
        assert!(key.entry >= BASE && (key.entry - BASE) % 2 == 0, "{key:?}");
        assert_eq!(key.lock, key.entry + 1, "{key:?}");
    }
    const { assert!(BASE > 0x4000_0000 + 512) };
    // The last slot ends at off_t's last byte (no wrap, no fallback to slot 0).
    assert_eq!(FileKey::new(&d, SLOTS - 1).lock, libc::off_t::MAX);
    assert_ne!(FileKey::new(&d, 7).entry, FileKey::new(&d, 8).entry);
}

#[test]
fn marks_are_at_least_two() {
    for (dev, ino) in [(0, 0), (1, 1), (u64::MAX, u64::MAX), (2049, 123_456)] {
        assert!(identity_mark(dev, ino) >= 2);
    }
    assert_ne!(identity_mark(2049, 1), identity_mark(2049, 2));
}

#[test]
fn two_descriptions_exclude_each_other_and_descriptions_are_reused_not_closed() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
    let d = db(&dir);
    let key = FileKey::new(&d, 42);
    let other = FileKey::new(&d, 43);
    let held = try_lock(&key)
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("free lock not taken"));
    assert!(try_lock(&key).unwrap_or_else(|e| panic!("{e}")).is_none());
    // Another mutex's bytes are independent.
    let o = try_lock(&other)
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("another mutex's lock was blocked"));
    drop(o);
    drop(held);
    let inode = d.inode.get().unwrap_or_else(|| panic!("no inode"));
    let free = inode.free.lock().unwrap_or_else(|p| p.into_inner()).len();
    assert!(free >= 2, "descriptions not given back: {free}");
    assert!(try_lock(&key).unwrap_or_else(|e| panic!("{e}")).is_some());
    // No file beside the database.
    let files: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap_or_else(|e| panic!("{e}"))
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(files, vec![std::ffi::OsString::from("t.db")]);
}

#[test]
fn an_anchored_lock_stays_held_and_its_description_is_not_reused() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
    let d = db(&dir);
    let key = FileKey::new(&d, 9);
    let mut held = try_lock(&key)
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("free lock not taken"));
    let anchor = held.anchor().unwrap_or_else(|| panic!("no description"));
    drop(held);
    drop(anchor);
    assert!(
        try_lock(&key).unwrap_or_else(|e| panic!("{e}")).is_none(),
        "an anchored lock was let go by this process"
    );
}

#[test]
fn job_bytes_lie_between_sqlites_and_the_mutex_slots() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
    let d = db(&dir);
    for hash in [0, 1, u64::MAX, 1 << 63, JOB_SLOTS - 1, JOB_SLOTS, SLOTS - 1] {
        let job = job_byte(FileKey::new(&d, hash).entry);
        assert!((JOB_BASE..BASE).contains(&job), "{hash}: {job}");
    }
    assert_ne!(
        job_byte(FileKey::new(&d, 7).entry),
        job_byte(FileKey::new(&d, 8).entry)
    );
}

#[test]
fn a_job_byte_held_by_another_description_is_seen_and_its_anchor_names_it() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
    let d = db(&dir);
    let key = FileKey::new(&d, 11);
    assert_eq!(d.check_job(&key).map_err(|e| e.to_string()), Ok(None));
    let mut held = try_lock(&key)
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("free lock not taken"));
    // The owner's own lock is not the job's.
    assert_eq!(d.check_job(&key).map_err(|e| e.to_string()), Ok(None));
    let anchor = held.anchor().unwrap_or_else(|| panic!("no description"));
    let offset = anchor.job_byte().unwrap_or_else(|| panic!("no job byte"));
    assert_eq!(offset, u64::try_from(job_byte(key.entry)).unwrap_or(0));
    // A job's description, as `simba exec`'s guardian makes it.
    let job = File::options()
        .read(true)
        .write(true)
        .open(&d.path)
        .unwrap_or_else(|e| panic!("{e}"));
    let byte = range(libc::F_WRLCK, libc::off_t::try_from(offset).unwrap_or(0), 1);
    fcntl(&job, FcntlArg::F_OFD_SETLK(&byte)).unwrap_or_else(|e| panic!("{e}"));
    let mark = d.check().unwrap_or_else(|e| panic!("{e:?}"));
    assert_eq!(d.check_job(&key).map_err(|e| e.to_string()), Ok(Some(mark)));
    // Another mutex's job byte is free.
    assert_eq!(
        d.check_job(&FileKey::new(&d, 12))
            .map_err(|e| e.to_string()),
        Ok(None)
    );
    let free = range(libc::F_UNLCK, libc::off_t::try_from(offset).unwrap_or(0), 1);
    fcntl(&job, FcntlArg::F_OFD_SETLK(&free)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(d.check_job(&key).map_err(|e| e.to_string()), Ok(None));
    drop(held);
}

#[test]
fn a_hard_linked_database_is_refused() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
    let d = db(&dir);
    std::fs::hard_link(&d.path, dir.path().join("h.db")).unwrap_or_else(|e| panic!("{e}"));
    match d.check() {
        Err(e @ Refused::HardLinked { links: 2, .. }) => {
            let t = e.to_string();
            assert!(t.contains("2 hard links"), "{t}");
        }
        other => panic!("{other:?}"),
    }
    assert!(try_lock(&FileKey::new(&d, 1)).is_err());
    let missing = DbFile::new(&dir.path().join("none.db").display().to_string());
    assert!(matches!(missing.check(), Err(Refused::Missing { .. })));
}

#[test]
fn a_waiter_holding_the_entry_keeps_a_try_out() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
    let d = db(&dir);
    let key = FileKey::new(&d, 5);
    let held = try_lock(&key)
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("free lock not taken"));
    let k = key.clone();
    let waiter = std::thread::spawn(move || lock(&k));
    // The waiter takes the entry byte, then blocks on the lock byte: seen from here
    // as a try failing while the holder still holds.
    let probe = start(&key).unwrap_or_else(|e| panic!("{e}"));
    let pf = probe.file().unwrap_or_else(|| panic!("no file"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while try_byte(pf, &key, "entry", key.entry).unwrap_or_else(|e| panic!("{e}")) {
        leave_entry(pf, &key).unwrap_or_else(|e| panic!("{e}"));
        assert!(std::time::Instant::now() < deadline, "waiter never queued");
        std::thread::yield_now();
    }
    drop(probe);
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
    assert_eq!(sweep_earlier(&db), 2);
    assert!(
        name("00000000000000bb", "lock").exists(),
        "a held file was removed"
    );
    assert!(!name("00000000000000aa", "lock").exists());
    assert!(other.exists(), "another database's file was removed");
}
