//! PgBouncer in front of a PostgreSQL of the kit: [`pgbouncer`], [`pgbouncer_private`],
//! [`pgbouncer_in_front_of`] and the [`Pooler`] they give.
//!
//! Every PgBouncer of the kit (private instance or container) serves two databases, both
//! the PostgreSQL database `simba` behind it: `simba` in `pool_mode = transaction` and
//! [`SESSION_DATABASE`] in `pool_mode = session`; [`Pooler::url`] names the one of its
//! [`PoolMode`]. The transaction pool is small ([`TRANSACTION_POOL_SIZE`] server
//! connections), so that clients really do share server connections; the session pool is
//! larger ([`SESSION_POOL_SIZE`]), since there every client connection holds a server
//! connection for as long as it is open (a few contenders with a pool each would starve a
//! pool of 4). Authentication is `trust` (like the kit's
//! PostgreSQL), for the user `postgres` only, which is also the admin console's user
//! (`SHOW POOLS` on the database `pgbouncer`).
//!
//! **Cancel requests crash Debian bookworm's PgBouncer 1.18**: it exits with
//! `FATAL … disconnect_client(): bad client state: 0` when the client of a cancel request
//! closes that connection before PgBouncer has finished forwarding it (pgbouncer#801, fixed
//! in later releases) — and tokio-postgres's `CancelToken::cancel_query` does just that: about
//! one cancel in two killed it here, in either mode. A test that cancels through the pooler
//! sees PgBouncer gone ([`TestServer::is_running`] says so, [`TestServer::log_tail`] shows
//! the line); the chaos run starts it again and reports it.

use std::fmt::Write as _;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use super::process::{self, LocalServer, chown_tree, run_as_postgres, which};
use super::{DATABASE, Selection, ServerError, ServerKind, TestServer};

const KIND: ServerKind = ServerKind::Pgbouncer;

/// Environment variable with the URL of an existing PgBouncer in transaction mode, e.g.
/// `postgres://postgres@127.0.0.1:6432/simba`; needs [`PGBOUNCER_DIRECT_URL_ENV`].
pub const PGBOUNCER_URL_ENV: &str = "SIMBA_TEST_PGBOUNCER_URL";
/// Environment variable with the URL of an existing PgBouncer in session mode, e.g.
/// `postgres://postgres@127.0.0.1:6432/simba_session`; needs [`PGBOUNCER_DIRECT_URL_ENV`].
pub const PGBOUNCER_SESSION_URL_ENV: &str = "SIMBA_TEST_PGBOUNCER_SESSION_URL";
/// Environment variable with the URL of the PostgreSQL behind [`PGBOUNCER_URL_ENV`] /
/// [`PGBOUNCER_SESSION_URL_ENV`], reached directly.
pub const PGBOUNCER_DIRECT_URL_ENV: &str = "SIMBA_TEST_PGBOUNCER_DIRECT_URL";

/// The database of the kit's PgBouncers that pools in session mode (the PostgreSQL
/// database [`DATABASE`] behind it); `DATABASE` itself pools in transaction mode.
pub const SESSION_DATABASE: &str = "simba_session";

/// Server connections of the transaction-mode pool (database [`DATABASE`]) of the kit's
/// PgBouncers.
pub const TRANSACTION_POOL_SIZE: u32 = 4;
/// Server connections of the session-mode pool (database [`SESSION_DATABASE`]) of the kit's
/// PgBouncers: the most client connections that can be open at once in session mode. A
/// store holds up to 4 pooled, 4 fast-path, 1 LISTEN and 17 lock-session connections, and
/// a conformance case runs several stores: 40 left the session suite's stores waiting for
/// a server connection past their statement timeout when cases ran side by side.
pub const SESSION_POOL_SIZE: u32 = 150;

/// How PgBouncer hands server connections to clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// `pool_mode = transaction`: a server connection per transaction; no session state
    /// (session advisory locks, `LISTEN`, named prepared statements) survives between
    /// transactions.
    Transaction,
    /// `pool_mode = session`: a server connection per client connection, reset with
    /// `DISCARD ALL` when the client leaves.
    Session,
}

impl PoolMode {
    /// The database of the kit's PgBouncers that pools in this mode.
    pub fn database(self) -> &'static str {
        match self {
            Self::Transaction => DATABASE,
            Self::Session => SESSION_DATABASE,
        }
    }

    /// The environment variable that names an existing PgBouncer in this mode.
    pub fn env_var(self) -> &'static str {
        match self {
            Self::Transaction => PGBOUNCER_URL_ENV,
            Self::Session => PGBOUNCER_SESSION_URL_ENV,
        }
    }

    /// PgBouncer's name of the mode (`transaction`, `session`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Transaction => "transaction",
            Self::Session => "session",
        }
    }
}

/// PgBouncer in front of a PostgreSQL.
///
/// From [`pgbouncer`] it may be external (environment variables), a container or private
/// local instances; from [`pgbouncer_private`] both servers are private local instances
/// whose [`TestServer`] control methods (kill, pause, resume, restart, stop, start) work.
/// A restarted PgBouncer comes back on the same port. Dropping the `Pooler` stops what the
/// kit started (PgBouncer first, then the PostgreSQL unless it is shared, see
/// [`pgbouncer_in_front_of`]).
#[derive(Debug)]
pub struct Pooler {
    mode: PoolMode,
    url: String,
    // Declared before `postgres`: PgBouncer is stopped before the server behind it.
    pooler: TestServer,
    postgres: Arc<TestServer>,
}

impl Pooler {
    /// `postgres://…` through PgBouncer, to the database of [`mode`](Self::mode) (no
    /// `simba_*` options in it).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// `postgres://…` of the PostgreSQL behind PgBouncer, directly.
    pub fn direct_url(&self) -> &str {
        self.postgres.url()
    }

    /// [`url`](Self::url) with the host and port replaced by `addr`: to connect through a
    /// [`FaultProxy`](crate::proxy::FaultProxy) in front of [`pooler`](Self::pooler).
    pub fn url_via(&self, addr: std::net::SocketAddr) -> String {
        super::replace_authority(KIND, &self.url, addr)
    }

    /// The pool mode of [`url`](Self::url).
    pub fn mode(&self) -> PoolMode {
        self.mode
    }

    /// The PgBouncer process (kind [`ServerKind::Pgbouncer`]); its
    /// [`url`](TestServer::url) is the transaction-mode one.
    pub fn pooler(&self) -> &TestServer {
        &self.pooler
    }

    /// The PostgreSQL behind PgBouncer.
    pub fn postgres(&self) -> &TestServer {
        &self.postgres
    }
}

/// PgBouncer in `mode` in front of PostgreSQL, resolved like the other servers:
///
/// 1. [`PGBOUNCER_URL_ENV`] (transaction) / [`PGBOUNCER_SESSION_URL_ENV`] (session), if set
///    and not empty, with [`PGBOUNCER_DIRECT_URL_ENV`] (the PostgreSQL behind it), which
///    must then be set too;
/// 2. as [`SERVERS_ENV`](super::SERVERS_ENV) selects: private local instances of
///    PostgreSQL and `pgbouncer`, else (feature `containers`) a container of the image
///    `simba/pgbouncer` (PostgreSQL and PgBouncer in one container);
/// 3. otherwise [`ServerError::Unavailable`], saying how to get one.
///
/// # Errors
///
/// [`ServerError::InvalidUrl`] for an unusable or missing environment variable,
/// [`ServerError::Unavailable`] when no PgBouncer can be had, [`ServerError::Start`] when
/// a server does not start.
///
/// # Cancel safety
///
/// Cancel safe for local instances (a dropped future drops what it started); a container
/// being created when the future is dropped is left to `scripts/containers.sh clean`.
pub async fn pgbouncer(mode: PoolMode) -> Result<Pooler, ServerError> {
    if let Some(pooler) = from_env(mode)? {
        return Ok(pooler);
    }
    let selection = Selection::from_env()?;
    if selection == Selection::Containers {
        return from_container(mode).await;
    }
    let missing = match Pgbouncer::detect() {
        Ok(bouncer) => match super::process::Flavor::detect(ServerKind::Postgres) {
            Ok(postgres) => {
                let postgres = TestServer::from_local(LocalServer::create(postgres).await?);
                return start(bouncer, Arc::new(postgres), mode).await;
            }
            Err(e) => e.with_advice(false),
        },
        Err(e) => e.with_advice(false),
    };
    #[cfg(feature = "containers")]
    let missing = match selection {
        Selection::Local => missing,
        _ => match super::container::start_pooler(mode).await {
            Ok(pooler) => return Ok(pooler),
            Err(reason) => super::container_failed_too(missing, reason),
        },
    };
    Err(missing)
}

/// Private local instances of PostgreSQL and PgBouncer in `mode`, ignoring the environment
/// variables (and [`SERVERS_ENV`](super::SERVERS_ENV)); fault tests control both with
/// [`Pooler::pooler`] and [`Pooler::postgres`].
///
/// # Errors
///
/// [`ServerError::Unavailable`] when `pgbouncer` or PostgreSQL is not installed,
/// [`ServerError::Start`] when one does not start.
///
/// # Cancel safety
///
/// Cancel safe: a dropped future drops (stops) what it started.
pub async fn pgbouncer_private(mode: PoolMode) -> Result<Pooler, ServerError> {
    let bouncer = Pgbouncer::detect().map_err(|e| e.with_advice(true))?;
    let postgres = super::private(ServerKind::Postgres).await?;
    start(bouncer, Arc::new(postgres), mode).await
}

/// A container of the kit's image `simba/pgbouncer` (PostgreSQL and PgBouncer in one
/// container, feature `containers`), whatever the environment says: the [`Pooler`] of
/// `mode`. The container publishes both ports on `127.0.0.1`, carries the label
/// [`LABEL`](super::LABEL)` = 1` and is removed when the `Pooler` is dropped; its servers
/// are not private (the control methods return [`ServerError::NotPrivate`]).
///
/// # Errors
///
/// [`ServerError::Unavailable`] when no Docker daemon answers or the image is missing,
/// [`ServerError::Start`] when the container does not start or does not answer.
///
/// # Cancel safety
///
/// Not cancel safe: a container being created when the future is dropped is not removed
/// (`scripts/containers.sh clean` removes it by its label).
#[cfg(feature = "containers")]
pub async fn pgbouncer_container(mode: PoolMode) -> Result<Pooler, ServerError> {
    super::container::start_pooler(mode).await
}

/// A private local PgBouncer in `mode` in front of `postgres`, which may be any PostgreSQL
/// the kit can reach (private, a container, external): PgBouncer logs in to its database
/// [`DATABASE`] as the user of its URL (`postgres` when the URL names none), with the
/// URL's password if it has one. Several poolers may share one PostgreSQL this way
/// (`simba-test-servers` starts one per mode).
///
/// # Errors
///
/// [`ServerError::InvalidUrl`] when `postgres` is not a PostgreSQL server or its user or
/// password cannot be written into PgBouncer's configuration, [`ServerError::Unavailable`]
/// when `pgbouncer` is not installed, [`ServerError::Start`] when it does not start.
///
/// # Cancel safety
///
/// Cancel safe: a dropped future stops the PgBouncer it was starting.
pub async fn pgbouncer_in_front_of(
    postgres: Arc<TestServer>,
    mode: PoolMode,
) -> Result<Pooler, ServerError> {
    let bouncer = Pgbouncer::detect().map_err(|e| e.with_advice(true))?;
    start(bouncer, postgres, mode).await
}

async fn start(
    bouncer: Pgbouncer,
    postgres: Arc<TestServer>,
    mode: PoolMode,
) -> Result<Pooler, ServerError> {
    let bouncer = bouncer.in_front_of(&postgres)?;
    let pooler =
        TestServer::from_local(LocalServer::create(process::Flavor::Pgbouncer(bouncer)).await?);
    let url = database_url(pooler.url(), mode);
    Ok(Pooler {
        mode,
        url,
        pooler,
        postgres,
    })
}

/// `url` (a kit PgBouncer's, whose path is `/simba`) with the database of `mode`.
pub(super) fn database_url(url: &str, mode: PoolMode) -> String {
    match url.rsplit_once('/') {
        Some((base, _)) => format!("{base}/{}", mode.database()),
        None => url.to_owned(),
    }
}

fn from_env(mode: PoolMode) -> Result<Option<Pooler>, ServerError> {
    let Some(url) = env_value(KIND, mode.env_var())? else {
        return Ok(None);
    };
    let Some(direct) = env_value(ServerKind::Postgres, PGBOUNCER_DIRECT_URL_ENV)? else {
        return Err(ServerError::InvalidUrl {
            kind: KIND,
            url,
            message: format!(
                "{} is set, {PGBOUNCER_DIRECT_URL_ENV} is not: set it to the URL of the \
                 PostgreSQL behind PgBouncer (e.g. postgres://postgres@127.0.0.1:5432/simba)",
                mode.env_var()
            ),
        });
    };
    let pooler = TestServer::external(KIND, &url)?;
    let postgres = TestServer::external(ServerKind::Postgres, &direct)?;
    Ok(Some(Pooler {
        mode,
        url,
        pooler,
        postgres: Arc::new(postgres),
    }))
}

/// The trimmed value of `var`, `None` when unset or empty.
fn env_value(kind: ServerKind, var: &str) -> Result<Option<String>, ServerError> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Ok(Some(v.trim().to_owned())),
        Ok(_) | Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(ServerError::InvalidUrl {
            kind,
            url: v.to_string_lossy().into_owned(),
            message: format!("{var} is not valid UTF-8"),
        }),
    }
}

#[cfg(feature = "containers")]
async fn from_container(mode: PoolMode) -> Result<Pooler, ServerError> {
    pgbouncer_container(mode).await
}

#[cfg(not(feature = "containers"))]
async fn from_container(_mode: PoolMode) -> Result<Pooler, ServerError> {
    Err(super::no_containers(KIND))
}

/// Assembles a [`Pooler`] (for the container path).
#[cfg(feature = "containers")]
pub(super) fn pooler(mode: PoolMode, pooler: TestServer, postgres: TestServer) -> Pooler {
    Pooler {
        mode,
        url: database_url(pooler.url(), mode),
        pooler,
        postgres: Arc::new(postgres),
    }
}

/// The error of asking for a PgBouncer without its PostgreSQL ([`super::private`]).
pub(super) fn needs_postgres() -> ServerError {
    ServerError::Unavailable {
        kind: KIND,
        hint: "a PgBouncer needs a PostgreSQL behind it and a pool mode: use \
               servers::pgbouncer(PoolMode) or servers::pgbouncer_private(PoolMode), which \
               start both"
            .to_owned(),
    }
}

/// Where PgBouncer's server connections go.
#[derive(Debug, Clone)]
struct Upstream {
    host: String,
    port: u16,
    user: String,
    password: Option<String>,
}

impl Upstream {
    /// Host, port, user and password of a PostgreSQL server's URL.
    fn of(server: &TestServer) -> Result<Self, ServerError> {
        let invalid = |message: String| ServerError::InvalidUrl {
            kind: ServerKind::Postgres,
            url: server.url().to_owned(),
            message,
        };
        if server.kind() != ServerKind::Postgres {
            return Err(invalid(format!(
                "PgBouncer goes in front of PostgreSQL, not {}",
                server.kind()
            )));
        }
        let (prefix, _, _) = super::split_url(ServerKind::Postgres, server.url());
        let userinfo = prefix
            .split_once("://")
            .map(|(_, u)| u.trim_end_matches('@'))
            .unwrap_or_default();
        let (user, password) = match userinfo.split_once(':') {
            Some((u, p)) => (u, Some(p)),
            None => (userinfo, None),
        };
        let user = if user.is_empty() { "postgres" } else { user };
        // Written into pgbouncer.ini and userlist.txt unquoted: keep to what needs no
        // quoting (the kit's users and passwords do).
        let plain = |s: &str| {
            s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        };
        if !plain(user) || !password.is_none_or(plain) {
            return Err(invalid(
                "PgBouncer's configuration takes users and passwords of letters, digits, \
                 `_`, `-` and `.` only here"
                    .to_owned(),
            ));
        }
        Ok(Self {
            host: server.host().to_owned(),
            port: server.port(),
            user: user.to_owned(),
            password: password.map(str::to_owned),
        })
    }
}

/// A local `pgbouncer` binary, with the PostgreSQL it pools once
/// [`in_front_of`](Self::in_front_of) set it.
#[derive(Debug, Clone)]
pub(crate) struct Pgbouncer {
    bin: PathBuf,
    /// `(uid, gid)` to run as when this process is root (PgBouncer refuses root).
    run_as: Option<(u32, u32)>,
    upstream: Option<Upstream>,
}

impl Pgbouncer {
    pub(crate) fn detect() -> Result<Self, ServerError> {
        let bin = which("pgbouncer").ok_or_else(|| {
            ServerError::missing_binary(KIND, "pgbouncer was not found on PATH or in /usr/sbin")
        })?;
        let run_as = run_as_postgres(KIND, "PgBouncer")?;
        Ok(Self {
            bin,
            run_as,
            upstream: None,
        })
    }

    fn in_front_of(mut self, postgres: &TestServer) -> Result<Self, ServerError> {
        self.upstream = Some(Upstream::of(postgres)?);
        Ok(self)
    }

    /// The instance directory belongs to the user PgBouncer runs as: its Unix socket goes
    /// there.
    pub(crate) async fn prepare(&self, dir: &Path) -> Result<(), ServerError> {
        match self.run_as {
            Some(owner) => chown_tree(KIND, dir, owner).await,
            None => Ok(()),
        }
    }

    /// `pgbouncer.ini` and `userlist.txt` in `dir`.
    fn config(&self, dir: &Path, port: u16) -> Result<(String, String), ServerError> {
        let upstream = self.upstream.as_ref().ok_or_else(|| ServerError::Start {
            kind: KIND,
            message: "PgBouncer has no PostgreSQL to pool (an internal error of the kit)"
                .to_owned(),
            log_tail: String::new(),
        })?;
        let Upstream {
            host,
            port: upstream_port,
            user,
            password,
        } = upstream;
        let password = password
            .as_ref()
            .map(|p| format!(" password={p}"))
            .unwrap_or_default();
        let mut ini = String::from("[databases]\n");
        for (mode, size) in [
            (PoolMode::Transaction, TRANSACTION_POOL_SIZE),
            (PoolMode::Session, SESSION_POOL_SIZE),
        ] {
            let _ = writeln!(
                ini,
                "{} = host={host} port={upstream_port} dbname={DATABASE} user={user}{password} \
                 pool_mode={} pool_size={size}",
                mode.database(),
                mode.as_str()
            );
        }
        let dir = dir.display();
        let _ = write!(
            ini,
            "\n[pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir = {dir}\n\
             auth_type = trust\n\
             auth_file = {dir}/userlist.txt\n\
             admin_users = {user}\n\
             pool_mode = transaction\n\
             default_pool_size = {TRANSACTION_POOL_SIZE}\n\
             min_pool_size = 0\n\
             reserve_pool_size = 0\n\
             max_client_conn = 1000\n\
             ; After a failed login to PostgreSQL (restarting, killed), try again in 1 s,\n\
             ; not the default 15 s: the fault tests bring PostgreSQL back at once.\n\
             server_login_retry = 1\n\
             server_connect_timeout = 5\n\
             query_wait_timeout = 60\n\
             ; Logs go to stderr, which the kit keeps in server.log.\n\
             log_connections = 0\n\
             log_disconnections = 0\n"
        );
        // tokio-postgres sends only user, database, client_encoding and, if set,
        // application_name and options at start-up: PgBouncer knows all of them, so
        // `ignore_startup_parameters` is left empty (an ignored `options` would hide a
        // setting a test asked for).
        let userlist = format!("\"{user}\" \"\"\n");
        Ok((ini, userlist))
    }

    /// `pgbouncer pgbouncer.ini` in the foreground (writing the configuration first).
    pub(crate) fn command(&self, dir: &Path, port: u16) -> Result<Command, ServerError> {
        let (ini, userlist) = self.config(dir, port)?;
        let ini_path = dir.join("pgbouncer.ini");
        std::fs::write(&ini_path, ini)
            .and_then(|()| std::fs::write(dir.join("userlist.txt"), userlist))
            .map_err(|e| ServerError::io(KIND, "writing pgbouncer.ini", e))?;
        let mut cmd = Command::new(&self.bin);
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
        cmd.arg(ini_path);
        Ok(cmd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_urls_per_mode() {
        let url = "postgres://postgres@127.0.0.1:6432/simba";
        assert_eq!(database_url(url, PoolMode::Transaction), url);
        assert_eq!(
            database_url(url, PoolMode::Session),
            "postgres://postgres@127.0.0.1:6432/simba_session"
        );
    }

    #[test]
    fn config_pools_both_modes_in_front_of_the_upstream() {
        let postgres = TestServer::external(
            ServerKind::Postgres,
            "postgres://app:pw@10.0.0.7:5433/simba",
        )
        .expect("a URL");
        let bouncer = Pgbouncer {
            bin: PathBuf::from("/usr/sbin/pgbouncer"),
            run_as: None,
            upstream: None,
        }
        .in_front_of(&postgres)
        .expect("plain user and password");
        let (ini, userlist) = bouncer.config(Path::new("/tmp/x"), 7000).expect("a config");
        assert!(
            ini.contains(
                "simba = host=10.0.0.7 port=5433 dbname=simba user=app password=pw \
                 pool_mode=transaction pool_size=4"
            ),
            "{ini}"
        );
        assert!(
            ini.contains(&format!(
                "simba_session = host=10.0.0.7 port=5433 dbname=simba user=app password=pw \
                 pool_mode=session pool_size={SESSION_POOL_SIZE}"
            )),
            "{ini}"
        );
        assert!(ini.contains("listen_port = 7000\n"), "{ini}");
        assert!(ini.contains("listen_addr = 127.0.0.1\n"), "{ini}");
        assert!(ini.contains("default_pool_size = 4\n"), "{ini}");
        assert_eq!(userlist, "\"app\" \"\"\n");

        let odd = TestServer::external(ServerKind::Postgres, "postgres://u:p%20w@h/simba")
            .expect("a URL");
        assert!(
            Pgbouncer {
                bin: PathBuf::new(),
                run_as: None,
                upstream: None
            }
            .in_front_of(&odd)
            .is_err()
        );
    }
}
