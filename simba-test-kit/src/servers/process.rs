//! Private server processes: detection, start, readiness, signals, cleanup.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::OpenOptions;
use std::future::Future;
use std::io::{Read, Seek, SeekFrom};
use std::net::SocketAddr;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tempfile::TempDir;
use tokio::sync::Mutex;

use super::{
    READY_TIMEOUT, ServerError, ServerKind, etcd, mysql, pgbouncer, postgres, probe, redis,
    zookeeper,
};

/// How to run one kind of server, with the binaries found on this machine.
#[derive(Debug, Clone)]
pub(crate) enum Flavor {
    Redis(redis::Redis),
    Mysql(mysql::Mysql),
    Postgres(postgres::Postgres),
    Zookeeper(zookeeper::Zookeeper),
    Etcd(etcd::Etcd),
    /// PgBouncer in front of a PostgreSQL (made by `servers::pgbouncer`, not detected).
    Pgbouncer(pgbouncer::Pgbouncer),
}

impl Flavor {
    /// Finds the local binaries for `kind`, or says how to install them.
    pub(crate) fn detect(kind: ServerKind) -> Result<Self, ServerError> {
        Ok(match kind {
            ServerKind::Redis => Self::Redis(redis::Redis::detect()?),
            ServerKind::Mysql => Self::Mysql(mysql::Mysql::detect()?),
            ServerKind::Postgres => Self::Postgres(postgres::Postgres::detect()?),
            ServerKind::Zookeeper => Self::Zookeeper(zookeeper::Zookeeper::detect()?),
            ServerKind::Etcd => Self::Etcd(etcd::Etcd::detect()?),
            ServerKind::Pgbouncer => return Err(pgbouncer::needs_postgres()),
        })
    }

    pub(crate) fn kind(&self) -> ServerKind {
        match self {
            Self::Redis(_) => ServerKind::Redis,
            Self::Mysql(_) => ServerKind::Mysql,
            Self::Postgres(_) => ServerKind::Postgres,
            Self::Zookeeper(_) => ServerKind::Zookeeper,
            Self::Etcd(_) => ServerKind::Etcd,
            Self::Pgbouncer(_) => ServerKind::Pgbouncer,
        }
    }

    /// Creates fresh data in `dir/data`.
    async fn prepare(&self, dir: &Path) -> Result<(), ServerError> {
        match self {
            Self::Redis(r) => r.prepare(dir).await,
            Self::Mysql(m) => m.prepare(dir).await,
            Self::Postgres(p) => p.prepare(dir).await,
            Self::Zookeeper(z) => z.prepare(dir).await,
            Self::Etcd(e) => e.prepare(dir).await,
            Self::Pgbouncer(b) => b.prepare(dir).await,
        }
    }

    /// The command that runs the server in the foreground (writing its configuration
    /// files into `dir` first).
    fn command(&self, dir: &Path, port: u16) -> Result<std::process::Command, ServerError> {
        match self {
            Self::Redis(r) => Ok(r.command(dir, port)),
            Self::Mysql(m) => m.command(dir, port),
            Self::Postgres(p) => Ok(p.command(dir, port)),
            Self::Zookeeper(z) => z.command(dir, port),
            Self::Etcd(e) => e.command(dir, port),
            Self::Pgbouncer(b) => b.command(dir, port),
        }
    }

    fn url(&self, port: u16) -> String {
        if let Self::Redis(r) = self
            && r.is_tls()
        {
            return format!("rediss://127.0.0.1:{port}");
        }
        if let Self::Etcd(e) = self
            && e.is_tls()
        {
            return format!("etcds://127.0.0.1:{port}");
        }
        match self.kind() {
            ServerKind::Redis => format!("redis://127.0.0.1:{port}"),
            ServerKind::Mysql => format!("mysql://root@127.0.0.1:{port}/{}", super::DATABASE),
            ServerKind::Postgres | ServerKind::Pgbouncer => {
                format!("postgres://postgres@127.0.0.1:{port}/{}", super::DATABASE)
            }
            ServerKind::Zookeeper => format!("127.0.0.1:{port}"),
            ServerKind::Etcd => format!("etcd://127.0.0.1:{port}"),
        }
    }

    /// Whether the server at `addr` (its files in `dir`) is ready. A TLS-only Redis is
    /// ready when it accepts connections (the kit speaks no TLS itself).
    async fn ready(&self, dir: &Path, addr: SocketAddr) -> Result<(), String> {
        match self {
            // A TLS etcd answers `/health` in plain HTTP on its metrics port.
            Self::Etcd(e) if e.is_tls() => {
                let port = e
                    .metrics_port(dir)
                    .ok_or_else(|| "the metrics port is not written yet".to_owned())?;
                probe::ready(ServerKind::Etcd, SocketAddr::new(addr.ip(), port)).await
            }
            // A TLS Redis with a plain admin port: PING there once the TLS port accepts.
            Self::Redis(r) if r.admin_port().is_some() => {
                tokio::net::TcpStream::connect(addr)
                    .await
                    .map_err(|e| format!("connecting to {addr}: {e}"))?;
                let admin = SocketAddr::new(addr.ip(), r.admin_port().unwrap_or_default());
                probe::ready(ServerKind::Redis, admin).await
            }
            Self::Redis(r) if r.is_tls() => tokio::net::TcpStream::connect(addr)
                .await
                .map(drop)
                .map_err(|e| format!("connecting to {addr}: {e}")),
            // A TLS-only PostgreSQL refuses the kit's plain start-up with "no pg_hba.conf
            // entry … no encryption": it checks pg_hba.conf only once it accepts sessions.
            Self::Postgres(p) if p.is_tls() => {
                match probe::ready(ServerKind::Postgres, addr).await {
                    Err(e) if e.contains("no encryption") => Ok(()),
                    other => other,
                }
            }
            // A TLS-only MariaDB (require_secure_transport) refuses the kit's plain login
            // with "Access denied": it answers logins only once it accepts sessions.
            Self::Mysql(m) if m.is_tls() => match probe::ready(ServerKind::Mysql, addr).await {
                Err(e) if e.contains("Access denied") || e.contains("insecure transport") => Ok(()),
                other => other,
            },
            _ => probe::ready(self.kind(), addr).await,
        }
    }

    /// The signal for a graceful stop (PostgreSQL's "smart" SIGTERM would wait for clients).
    fn stop_signal(&self) -> &'static str {
        match self {
            Self::Postgres(_) => "INT",
            _ => "TERM",
        }
    }
}

/// Why one launch attempt failed.
enum LaunchError {
    /// The process exited before it became ready (e.g. its port was taken): worth a retry.
    Exited(ServerError),
    /// Anything else.
    Fatal(ServerError),
}

impl LaunchError {
    fn into_inner(self) -> ServerError {
        match self {
            Self::Exited(e) | Self::Fatal(e) => e,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    child: Option<Child>,
    paused: bool,
    /// Arguments added to the server's command line from the next start on.
    extra_args: Vec<String>,
}

/// A server process owned by this test process.
pub(crate) struct LocalServer {
    flavor: Flavor,
    port: u16,
    pid: AtomicU32,
    state: Mutex<State>,
    // Declared last: removed after `Drop` has killed the process.
    dir: TempDir,
}

const LOG_FILE: &str = "server.log";
const LAUNCH_ATTEMPTS: usize = 3;

impl LocalServer {
    /// Starts a new instance on a free port in a new temporary directory, retrying with
    /// another port if the process dies during start-up.
    pub(crate) async fn create(flavor: Flavor) -> Result<Self, ServerError> {
        let kind = flavor.kind();
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let dir = tempfile::Builder::new()
                .prefix(&format!("simba-{}-", short_name(kind)))
                .tempdir()
                .map_err(|e| ServerError::io(kind, "creating a temporary directory", e))?;
            let port = free_port().map_err(|e| ServerError::io(kind, "finding a free port", e))?;
            flavor.prepare(dir.path()).await?;
            let server = Self {
                flavor: flavor.clone(),
                port,
                pid: AtomicU32::new(0),
                state: Mutex::new(State::default()),
                dir,
            };
            let launched = {
                let mut state = server.state.lock().await;
                server.launch(&mut state).await
            };
            match launched {
                Ok(()) => {
                    tracing::debug!(
                        %kind, port, elapsed = ?started.elapsed(), dir = %server.dir().display(),
                        "private test server ready"
                    );
                    return Ok(server);
                }
                Err(LaunchError::Exited(e)) if attempt < LAUNCH_ATTEMPTS => {
                    tracing::debug!(%kind, port, error = %e, "test server died during start-up, retrying");
                }
                Err(e) => return Err(e.into_inner()),
            }
        }
    }

    pub(crate) fn kind(&self) -> ServerKind {
        self.flavor.kind()
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    pub(crate) fn url(&self) -> String {
        self.flavor.url(self.port)
    }

    pub(crate) fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        match self.pid.load(Ordering::SeqCst) {
            0 => None,
            pid => Some(pid),
        }
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join(LOG_FILE)
    }

    /// The last `lines` lines of the log written after byte `offset`.
    pub(crate) fn log_tail(&self, offset: u64, lines: usize) -> String {
        log_tail(&self.log_path(), offset, lines)
    }

    fn io(&self, context: impl Into<String>, e: std::io::Error) -> ServerError {
        ServerError::io(self.kind(), context, e)
    }

    /// Starts the process and waits until it answers; `state.child` must be empty.
    async fn launch(&self, state: &mut State) -> Result<(), LaunchError> {
        let kind = self.kind();
        let log_path = self.log_path();
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| LaunchError::Fatal(self.io("opening the server log", e)))?;
        let offset = log.metadata().map(|m| m.len()).unwrap_or(0);
        let stdout = log
            .try_clone()
            .map_err(|e| LaunchError::Fatal(self.io("opening the server log", e)))?;
        let mut command = self
            .flavor
            .command(self.dir.path(), self.port)
            .map_err(LaunchError::Fatal)?;
        command
            .args(&state.extra_args)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(log)
            .current_dir(self.dir.path());
        let program = command.get_program().to_string_lossy().into_owned();
        let mut child = command
            .spawn()
            .map_err(|e| LaunchError::Fatal(self.io(format!("starting {program}"), e)))?;
        self.pid.store(child.id(), Ordering::SeqCst);
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut last_error: String;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => {
                    self.pid.store(0, Ordering::SeqCst);
                    // Give the log a moment to be complete.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    return Err(LaunchError::Exited(ServerError::Start {
                        kind,
                        message: format!(
                            "{program} exited with {status} before it was ready (port {})",
                            self.port
                        ),
                        log_tail: self.log_tail(offset, 40),
                    }));
                }
                Ok(None) => {}
                Err(e) => {
                    self.pid.store(0, Ordering::SeqCst);
                    kill_tree(&mut child).await;
                    return Err(LaunchError::Fatal(self.io("waiting for the server", e)));
                }
            }
            match tokio::time::timeout(
                Duration::from_secs(2),
                self.flavor.ready(self.dir.path(), self.addr()),
            )
            .await
            {
                Ok(Ok(())) => {
                    state.child = Some(child);
                    state.paused = false;
                    return Ok(());
                }
                Ok(Err(e)) => last_error = e,
                Err(_) => last_error = "the readiness probe timed out after 2 s".to_owned(),
            }
            if Instant::now() >= deadline {
                self.pid.store(0, Ordering::SeqCst);
                kill_tree(&mut child).await;
                return Err(LaunchError::Fatal(ServerError::Start {
                    kind,
                    message: format!(
                        "not ready after {READY_TIMEOUT:?} on port {}; last probe error: {last_error}",
                        self.port
                    ),
                    log_tail: self.log_tail(offset, 40),
                }));
            }
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
    }

    /// Clears `state` if the process has exited on its own; returns whether it runs.
    fn refresh(&self, state: &mut State) -> Result<bool, ServerError> {
        let Some(child) = state.child.as_mut() else {
            return Ok(false);
        };
        match child.try_wait() {
            Ok(None) => Ok(true),
            Ok(Some(status)) => {
                tracing::debug!(kind = %self.kind(), %status, "test server exited on its own");
                state.child = None;
                state.paused = false;
                self.pid.store(0, Ordering::SeqCst);
                Ok(false)
            }
            Err(e) => Err(self.io("checking the server process", e)),
        }
    }

    pub(crate) async fn is_running(&self) -> Result<bool, ServerError> {
        let mut state = self.state.lock().await;
        self.refresh(&mut state)
    }

    pub(crate) async fn start(&self) -> Result<(), ServerError> {
        let mut state = self.state.lock().await;
        if self.refresh(&mut state)? {
            return Ok(());
        }
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.launch(&mut state).await {
                Ok(()) => return Ok(()),
                Err(LaunchError::Exited(e)) if attempt < LAUNCH_ATTEMPTS => {
                    tracing::debug!(kind = %self.kind(), error = %e, "restart failed, retrying");
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => return Err(e.into_inner()),
            }
        }
    }

    /// Adds `args` to the command line of every later start (e.g. a Redis node that must
    /// come back as a replica, never a primary with its old data).
    pub(crate) async fn set_extra_args(&self, args: Vec<String>) {
        self.state.lock().await.extra_args = args;
    }

    pub(crate) async fn stop(&self) -> Result<(), ServerError> {
        let mut state = self.state.lock().await;
        self.stop_locked(&mut state).await
    }

    async fn stop_locked(&self, state: &mut State) -> Result<(), ServerError> {
        if !self.refresh(state)? {
            return Ok(());
        }
        let Some(child) = state.child.as_mut() else {
            return Ok(());
        };
        let pid = child.id();
        let tree = process_tree(pid);
        signal(&[pid], self.flavor.stop_signal())
            .await
            .map_err(|e| self.io("sending the stop signal", e))?;
        if state.paused {
            signal(&tree, "CONT")
                .await
                .map_err(|e| self.io("sending SIGCONT", e))?;
        }
        let exited = wait_exit(child, Duration::from_secs(15))
            .await
            .map_err(|e| self.io("waiting for the server to stop", e))?;
        if exited.is_none() {
            tracing::warn!(kind = %self.kind(), pid, "test server ignored the stop signal, killing it");
            kill_tree(child).await;
        }
        self.forget(state);
        wait_gone(&tree, Duration::from_secs(10)).await;
        Ok(())
    }

    fn forget(&self, state: &mut State) {
        state.child = None;
        state.paused = false;
        self.pid.store(0, Ordering::SeqCst);
    }

    pub(crate) async fn kill(&self) -> Result<(), ServerError> {
        let mut state = self.state.lock().await;
        if !self.refresh(&mut state)? {
            return Err(ServerError::NotRunning {
                kind: self.kind(),
                operation: "kill",
            });
        }
        let Some(child) = state.child.as_mut() else {
            return Ok(());
        };
        let tree = process_tree(child.id());
        kill_tree(child).await;
        self.forget(&mut state);
        wait_gone(&tree, Duration::from_secs(10)).await;
        Ok(())
    }

    pub(crate) async fn pause(&self) -> Result<(), ServerError> {
        self.stop_or_continue("pause", "STOP", true).await
    }

    pub(crate) async fn resume(&self) -> Result<(), ServerError> {
        self.stop_or_continue("resume", "CONT", false).await
    }

    async fn stop_or_continue(
        &self,
        operation: &'static str,
        sig: &'static str,
        paused: bool,
    ) -> Result<(), ServerError> {
        let mut state = self.state.lock().await;
        if !self.refresh(&mut state)? {
            return Err(ServerError::NotRunning {
                kind: self.kind(),
                operation,
            });
        }
        let Some(child) = state.child.as_ref() else {
            return Ok(());
        };
        signal(&process_tree(child.id()), sig)
            .await
            .map_err(|e| self.io(format!("sending SIG{sig}"), e))?;
        state.paused = paused;
        Ok(())
    }

    pub(crate) async fn wipe_restart(&self) -> Result<(), ServerError> {
        let mut state = self.state.lock().await;
        self.stop_locked(&mut state).await?;
        let data = self.dir.path().join("data");
        if data.exists() {
            tokio::fs::remove_dir_all(&data)
                .await
                .map_err(|e| self.io(format!("removing {}", data.display()), e))?;
        }
        self.flavor.prepare(self.dir.path()).await?;
        drop(state);
        self.start().await
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.state.get_mut().child.take() {
            kill_tree_blocking(&mut child);
        }
    }
}

/// How long [`kill_tree`] lets the server reap its killed children.
const REAP_TIMEOUT: Duration = Duration::from_secs(3);

/// Whether `pid` still exists (zombies included) as a child of `parent`.
fn is_child_of(pid: u32, parent: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| parse_stat(&stat))
        .is_some_and(|(_, ppid)| ppid == parent)
}

/// SIGKILLs a server like a crash and reaps it. Its child processes (PostgreSQL's
/// backends) are killed first and the server is given a moment to reap them, because
/// orphans are left to init, and some init processes (e.g. in micro-VMs) never reap.
async fn kill_tree(child: &mut Child) {
    let pid = child.id();
    let tree = process_tree(pid);
    if tree.len() > 1 {
        let _ = signal(&tree[1..], "KILL").await;
        let _ = signal(&[pid], "CONT").await;
        let deadline = Instant::now() + REAP_TIMEOUT;
        while tree[1..].iter().any(|&p| is_child_of(p, pid)) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let _ = child.kill();
    let _ = wait_exit(child, Duration::from_secs(10)).await;
}

/// Blocking [`kill_tree`], for `Drop`.
fn kill_tree_blocking(child: &mut Child) {
    let pid = child.id();
    let tree = process_tree(pid);
    if tree.len() > 1 {
        signal_blocking(&tree[1..], "KILL");
        signal_blocking(&[pid], "CONT");
        let deadline = Instant::now() + REAP_TIMEOUT;
        while tree[1..].iter().any(|&p| is_child_of(p, pid)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn short_name(kind: ServerKind) -> &'static str {
    match kind {
        ServerKind::Redis => "redis",
        ServerKind::Mysql => "mariadb",
        ServerKind::Postgres => "postgres",
        ServerKind::Zookeeper => "zookeeper",
        ServerKind::Etcd => "etcd",
        ServerKind::Pgbouncer => "pgbouncer",
    }
}

/// A loopback port that was free a moment ago, and that no other process of the kit will
/// be given while this one lives.
///
/// The kernel's port 0 only says that a port is free now: between this call and the
/// server's `bind`, another test process may be given the same port for its own server,
/// and a readiness probe of the slower one then answers from the other's server, which
/// goes away with the other test ("connection refused" in the middle of a test). Each
/// port handed out is therefore reserved by an exclusive lock on a file `ports/<port>`
/// beside the kit's data directory templates ([`port_reservations`]), held until the
/// process exits (a private server keeps its port across restarts). The files are empty
/// and stay; a lock never outlives its process.
pub(crate) fn free_port() -> std::io::Result<u16> {
    static HELD: std::sync::Mutex<Vec<std::fs::File>> = std::sync::Mutex::new(Vec::new());
    let dir = port_reservations();
    std::fs::create_dir_all(&dir)?;
    for _ in 0..100 {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
        let port = listener.local_addr()?.port();
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(port.to_string()))?;
        match file.try_lock() {
            Ok(()) => {
                HELD.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(file);
                return Ok(port);
            }
            // Another process of the kit has it: ask the kernel again.
            Err(std::fs::TryLockError::WouldBlock) => {}
            Err(std::fs::TryLockError::Error(e)) => return Err(e),
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        "100 free ports in a row were reserved by other test processes",
    ))
}

/// The directory of [`free_port`]'s reservations: the user's own, so that the processes
/// of one user see each other's and another user's files are never in the way.
fn port_reservations() -> PathBuf {
    template_root().join("ports")
}

/// Polls a child until it exits or `timeout` passes.
async fn wait_exit(child: &mut Child, timeout: Duration) -> std::io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until none of `pids` is alive any more (orphans are reaped by init).
async fn wait_gone(pids: &[u32], timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while pids.iter().any(|&pid| is_alive(pid)) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether `pid` exists and is not a zombie.
fn is_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => parse_stat(&stat).is_some_and(|(state, _)| state != 'Z' && state != 'X'),
        Err(_) => false,
    }
}

/// `(state, parent pid)` from the text of `/proc/PID/stat`.
fn parse_stat(stat: &str) -> Option<(char, u32)> {
    let after = &stat[stat.rfind(')')? + 1..];
    let mut fields = after.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

/// `root` followed by all its descendants (read from `/proc`; just `root` elsewhere).
pub(crate) fn process_tree(root: u32) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if let Ok(stat) = std::fs::read_to_string(entry.path().join("stat"))
                && let Some((_, ppid)) = parse_stat(&stat)
            {
                children.entry(ppid).or_default().push(pid);
            }
        }
    }
    let mut tree = vec![root];
    let mut seen = std::collections::HashSet::from([root]);
    let mut i = 0;
    while i < tree.len() {
        if let Some(kids) = children.get(&tree[i]) {
            for &kid in kids {
                if seen.insert(kid) {
                    tree.push(kid);
                }
            }
        }
        i += 1;
    }
    tree
}

fn kill_args(pids: &[u32], sig: &str) -> Vec<String> {
    let mut args = vec!["-s".to_owned(), sig.to_owned(), "--".to_owned()];
    args.extend(pids.iter().map(u32::to_string));
    args
}

/// Sends `SIG<sig>` to `pids` with the `kill` command (falling back to the shell's).
/// Processes that are already gone are ignored.
pub(crate) async fn signal(pids: &[u32], sig: &str) -> std::io::Result<()> {
    if pids.is_empty() {
        return Ok(());
    }
    let args = kill_args(pids, sig);
    let run = tokio::process::Command::new("kill")
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await;
    match run {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tokio::process::Command::new("sh")
                .arg("-c")
                .arg("kill \"$@\"")
                .arg("sh")
                .args(&args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .await?;
            Ok(())
        }
        Err(e) => Err(e),
        Ok(_) => Ok(()),
    }
}

/// Blocking [`signal`], for `Drop`.
pub(crate) fn signal_blocking(pids: &[u32], sig: &str) {
    let args = kill_args(pids, sig);
    let run = std::process::Command::new("kill")
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if matches!(&run, Err(e) if e.kind() == std::io::ErrorKind::NotFound) {
        let _ = std::process::Command::new("sh")
            .arg("-c")
            .arg("kill \"$@\"")
            .arg("sh")
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// The last `lines` lines of `path` after byte `offset` (at most the last 64 KiB).
pub(crate) fn log_tail(path: &Path, offset: u64, lines: usize) -> String {
    let Ok(mut file) = std::fs::File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let start = offset.max(len.saturating_sub(64 * 1024));
    if file.seek(SeekFrom::Start(start)).is_err() {
        return String::new();
    }
    let mut bytes = Vec::new();
    if file.read_to_end(&mut bytes).is_err() {
        return String::new();
    }
    let text = String::from_utf8_lossy(&bytes);
    let all: Vec<&str> = text.lines().collect();
    let from = all.len().saturating_sub(lines);
    let tail = all[from..].join("\n");
    if tail.is_empty() {
        format!("(nothing in {})", path.display())
    } else {
        tail
    }
}

/// The first executable called `name` on `PATH` or in the usual system directories.
pub(crate) fn which(name: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for extra in [
        "/usr/local/sbin",
        "/usr/local/bin",
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
    ] {
        dirs.push(PathBuf::from(extra));
    }
    dirs.into_iter()
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

pub(crate) fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Whether this process runs as root.
/// `(uid, gid)` of the `postgres` user when this process is root (PostgreSQL and PgBouncer
/// refuse to run as root), `None` otherwise; `server` names the refusing program.
pub(crate) fn run_as_postgres(
    kind: ServerKind,
    server: &str,
) -> Result<Option<(u32, u32)>, ServerError> {
    if !is_root() {
        return Ok(None);
    }
    lookup_user("postgres")
        .map(Some)
        .ok_or_else(|| ServerError::Unavailable {
            kind,
            hint: format!(
                "this process runs as root, which {server} refuses, and there is no `postgres` \
                 user to run it as (create one with `useradd -r postgres`, or run the tests as \
                 another user)"
            ),
        })
}

pub(crate) fn is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// `(uid, gid)` of a local user, from `/etc/passwd`.
pub(crate) fn lookup_user(name: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        if fields.next()? != name {
            return None;
        }
        let _password = fields.next()?;
        let uid = fields.next()?.parse().ok()?;
        let gid = fields.next()?.parse().ok()?;
        Some((uid, gid))
    })
}

/// Runs a helper command to completion; a failure carries its output.
pub(crate) async fn run(
    kind: ServerKind,
    what: &str,
    command: &mut tokio::process::Command,
) -> Result<(), ServerError> {
    let output = command
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| ServerError::io(kind, format!("running {what}"), e))?;
    if output.status.success() {
        return Ok(());
    }
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(40);
    Err(ServerError::Start {
        kind,
        message: format!("{what} failed with {}", output.status),
        log_tail: lines[from..].join("\n"),
    })
}

/// `cp -a from to`.
pub(crate) async fn copy_tree(kind: ServerKind, from: &Path, to: &Path) -> Result<(), ServerError> {
    run(
        kind,
        "cp -a",
        tokio::process::Command::new("cp")
            .arg("-a")
            .arg(from)
            .arg(to),
    )
    .await
}

/// `chown -R uid:gid path`.
pub(crate) async fn chown_tree(
    kind: ServerKind,
    path: &Path,
    (uid, gid): (u32, u32),
) -> Result<(), ServerError> {
    run(
        kind,
        "chown -R",
        tokio::process::Command::new("chown")
            .arg("-R")
            .arg(format!("{uid}:{gid}"))
            .arg(path),
    )
    .await
}

/// A directory that survives this process, shared by all test processes of this user,
/// holding initialised data directories that instances copy.
fn template_root() -> PathBuf {
    let uid = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(0);
    std::env::temp_dir().join(format!("simba-test-kit-{uid}"))
}

/// A cache key that changes when the binary at `path` changes.
pub(crate) fn binary_key(path: &Path) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    path.hash(&mut hasher);
    if let Ok(meta) = std::fs::metadata(path) {
        meta.len().hash(&mut hasher);
        meta.mtime().hash(&mut hasher);
        meta.ino().hash(&mut hasher);
    }
    format!("{:016x}", hasher.finish())
}

const TEMPLATE_MARKER: &str = "simba-template-ready";

/// The template directory `name`, built by `build` (which fills the empty directory it
/// is given) unless another test process already did. Built under a temporary name and
/// renamed into place, so a template is either complete or absent.
pub(crate) async fn template<F, Fut>(
    kind: ServerKind,
    name: String,
    build: F,
) -> Result<PathBuf, ServerError>
where
    F: FnOnce(PathBuf) -> Fut,
    Fut: Future<Output = Result<(), ServerError>>,
{
    let root = template_root();
    let target = root.join(&name);
    if target.join(TEMPLATE_MARKER).exists() {
        return Ok(target);
    }
    std::fs::create_dir_all(&root)
        .and_then(|()| std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)))
        .map_err(|e| ServerError::io(kind, format!("creating {}", root.display()), e))?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let building = root.join(format!("{name}.tmp-{}-{nanos}", std::process::id()));
    std::fs::create_dir(&building)
        .map_err(|e| ServerError::io(kind, format!("creating {}", building.display()), e))?;
    let started = Instant::now();
    let built = build(building.clone()).await.and_then(|()| {
        std::fs::write(building.join(TEMPLATE_MARKER), b"")
            .map_err(|e| ServerError::io(kind, "writing the template marker", e))
    });
    if let Err(e) = built {
        let _ = std::fs::remove_dir_all(&building);
        return Err(e);
    }
    tracing::debug!(%kind, elapsed = ?started.elapsed(), "built a data directory template");
    match std::fs::rename(&building, &target) {
        Ok(()) => Ok(target),
        Err(_) if target.join(TEMPLATE_MARKER).exists() => {
            // Another process won the race.
            let _ = std::fs::remove_dir_all(&building);
            Ok(target)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&building);
            Err(ServerError::io(
                kind,
                format!("moving the template to {}", target.display()),
                e,
            ))
        }
    }
}

/// Joins `OsStr` pieces into one `--opt=value` argument.
pub(crate) fn opt(name: &str, value: impl AsRef<OsStr>) -> std::ffi::OsString {
    let mut s = std::ffi::OsString::from(name);
    s.push("=");
    s.push(value.as_ref());
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_handed_out_is_reserved_until_the_process_ends() {
        let a = free_port().expect("a port");
        let b = free_port().expect("another port");
        assert_ne!(a, b);
        // What another process sees: its own open file description of the port's file.
        let file = port_reservations().join(a.to_string());
        let other = OpenOptions::new()
            .write(true)
            .open(&file)
            .expect("the reservation file exists");
        assert!(
            matches!(other.try_lock(), Err(std::fs::TryLockError::WouldBlock)),
            "port {a} is not reserved"
        );
    }

    #[test]
    fn parses_proc_stat() {
        assert_eq!(
            parse_stat("123 (my (odd) name) S 45 123 123 0 -1"),
            Some(('S', 45))
        );
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn finds_own_process() {
        let me = std::process::id();
        assert!(is_alive(me));
        assert_eq!(process_tree(me).first(), Some(&me));
    }
}
