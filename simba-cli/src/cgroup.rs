//! The job's own cgroup v2 (Linux), made by the guardian when the kernel lets it: a child of
//! the guardian's own cgroup (writable as root, or in a delegated subtree such as a systemd
//! user scope). Every process of the job is in it whatever it does (`setsid`, `su`, double
//! forks), so `cgroup.kill` ends all of them and `cgroup.events` says when the last is gone.
//! When no cgroup can be made (no cgroup v2, no write access), the guardian works with the
//! command's process group alone.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// `SIMBA_EXEC_CGROUP=off` in simba's environment: no cgroup, the process group only (to
/// compare, or where a cgroup is not wanted).
const OFF_ENV: &str = "SIMBA_EXEC_CGROUP";

/// A cgroup made for one job; removed by [`JobCgroup::remove`] once empty.
#[derive(Debug)]
pub(crate) struct JobCgroup {
    dir: PathBuf,
}

/// Where cgroup v2 is mounted, from `/proc/self/mountinfo`.
fn mount_point() -> Option<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        if right.split(' ').next()? != "cgroup2" {
            return None;
        }
        left.split(' ').nth(4).map(PathBuf::from)
    })
}

/// This process's cgroup v2 path (the `0::` line of `/proc/self/cgroup`).
fn own_path() -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_owned)
}

impl JobCgroup {
    /// Makes a cgroup for a job under this process's own, or says why not (the caller goes
    /// on without one).
    pub(crate) fn create() -> Result<JobCgroup, String> {
        if !cfg!(target_os = "linux") {
            return Err("cgroups are Linux only".to_owned());
        }
        if std::env::var_os(OFF_ENV).is_some_and(|v| v == "off") {
            return Err(format!("{OFF_ENV}=off"));
        }
        let mount = mount_point().ok_or("no cgroup v2 mounted")?;
        let own = own_path().ok_or("this process is in no cgroup v2")?;
        // `/` is the root; a path that was removed reads `/x (deleted)`.
        if own.contains(" (deleted)") {
            return Err("this process's cgroup was removed".to_owned());
        }
        let parent = mount.join(own.trim_start_matches('/'));
        let dir = parent.join(format!("simba-exec-{}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
        // Whether a process may be moved in (the command moves itself before its exec).
        if let Err(e) = OpenOptions::new()
            .write(true)
            .open(dir.join("cgroup.procs"))
        {
            let _ = std::fs::remove_dir(&dir);
            return Err(format!("cannot open {}/cgroup.procs: {e}", dir.display()));
        }
        Ok(JobCgroup { dir })
    }

    /// The directory (for the watcher).
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether any process is left in it (`cgroup.events`: `populated 1`). An unreadable
    /// file counts as populated: the caller's other checks decide.
    pub(crate) fn populated(&self) -> bool {
        populated(&self.dir)
    }

    /// SIGKILLs every process in it.
    pub(crate) fn kill(&self) {
        kill(&self.dir);
    }

    /// Sends `sig` to every process in it.
    pub(crate) fn signal(&self, sig: nix::sys::signal::Signal) {
        for pid in pids(&self.dir) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
        }
    }

    /// Removes it (only an empty cgroup can be removed).
    pub(crate) fn remove(self) {
        remove(&self.dir);
    }
}

fn pids(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

pub(crate) fn populated(dir: &Path) -> bool {
    match std::fs::read_to_string(dir.join("cgroup.events")) {
        Ok(s) => s.lines().any(|l| l == "populated 1"),
        Err(e) => e.kind() != std::io::ErrorKind::NotFound,
    }
}

/// `cgroup.kill` (Linux 5.14+), else a SIGKILL to every listed process.
pub(crate) fn kill(dir: &Path) {
    let done = OpenOptions::new()
        .write(true)
        .open(dir.join("cgroup.kill"))
        .and_then(|mut f| f.write_all(b"1"));
    if done.is_err() {
        for pid in pids(dir) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

pub(crate) fn remove(dir: &Path) {
    // Emptied just now: the kernel may take a moment to let it go.
    for _ in 0..100 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
        }
    }
}
