//! Real servers for tests: Redis, MySQL/MariaDB, PostgreSQL, ZooKeeper and etcd.
//!
//! A test asks for a server with [`redis`], [`mysql`], [`postgres`], [`zookeeper`] or
//! [`etcd`]. Each
//! one resolves in this order:
//!
//! 1. the environment variable [`REDIS_URL_ENV`] / [`MYSQL_URL_ENV`] /
//!    [`POSTGRES_URL_ENV`] / [`ZOOKEEPER_ENV`] / [`ETCD_URL_ENV`], if set and not empty;
//! 2. what [`SERVERS_ENV`] (`SIMBA_TEST_SERVERS`) selects:
//!    - `containers`: a container of the kit's images (`simba/redis:bookworm`, ...; needs
//!      the cargo feature `containers`, a Docker daemon and the images, which
//!      `scripts/containers.sh build` makes). Nothing else is tried: if Docker or an image
//!      is missing the error says so and how to fix it;
//!    - `local`: a private instance of the locally installed server binary, on a free
//!      loopback port, in a temporary directory; nothing else is tried;
//!    - unset or empty: the local binary; if it is not installed and the kit has the
//!      feature `containers`, a container;
//! 3. otherwise [`ServerError::Unavailable`], whose message says how to get a server.
//!
//! Tests never skip silently: a missing server is an error.
//!
//! PostgreSQL behind PgBouncer comes as a [`Pooler`] (both servers) from [`pgbouncer`] /
//! [`pgbouncer_private`], resolved the same way from [`PGBOUNCER_URL_ENV`] /
//! [`PGBOUNCER_SESSION_URL_ENV`] with [`PGBOUNCER_DIRECT_URL_ENV`], local `pgbouncer` and
//! PostgreSQL binaries, or the image `simba/pgbouncer`.
//!
//! Fault tests need to stop, restart, kill or pause the server. They use
//! [`redis_private`], [`mysql_private`], [`postgres_private`], [`zookeeper_private`] or
//! [`etcd_private`],
//! which always start a private local instance and ignore the environment variables
//! (including [`SERVERS_ENV`]).
//! Only private instances support the control methods of [`TestServer`]; on other
//! servers they return [`ServerError::NotPrivate`].
//!
//! Private instances bind `127.0.0.1` only, keep their data in a temporary directory and
//! are killed (by process id) and waited for when the [`TestServer`] is dropped.
//! The process control uses `/proc` and the `kill` command, so it works on Linux.
//! Containers publish their port on `127.0.0.1` only, carry the label `simba.test=1` and
//! are removed when the [`TestServer`] is dropped.

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

mod cluster;
#[cfg(feature = "containers")]
mod container;
mod etcd;
#[cfg(feature = "containers")]
pub use container::LABEL;
#[cfg(feature = "containers")]
mod docker;
#[cfg(feature = "containers")]
mod ensemble;
#[cfg(feature = "containers")]
pub use ensemble::{ENSEMBLE_SIZE, NodeMode, ZkEnsemble};
#[cfg(feature = "containers")]
pub use pgbouncer::pgbouncer_container;
#[cfg(feature = "containers")]
mod etcd_cluster;
#[cfg(feature = "containers")]
pub use etcd_cluster::{CLUSTER_SIZE, EtcdCluster, MemberState};

/// The tag of the kit's images (`docker/*/Dockerfile`), the same as in `docker-compose.yml`
/// (a test reads that file to keep the two in step).
pub const IMAGE_TAG: &str = "bookworm";

/// The kit's image for `kind`, e.g. `simba/redis`, as `docker-compose.yml` names it.
pub fn image_name(kind: ServerKind) -> &'static str {
    match kind {
        ServerKind::Redis => "simba/redis",
        ServerKind::Mysql => "simba/mariadb",
        ServerKind::Postgres => "simba/postgres",
        ServerKind::Zookeeper => "simba/zookeeper",
        ServerKind::Etcd => "simba/etcd",
        ServerKind::Pgbouncer => "simba/pgbouncer",
    }
}
mod mysql;
mod pgbouncer;
mod postgres;
mod probe;
mod process;
mod redis;
mod sentinel;
mod tls;
mod zookeeper;

pub use cluster::{RedisCluster, redis_cluster, redis_cluster_tls, redis_cluster_with_replicas};
pub use pgbouncer::{
    PGBOUNCER_DIRECT_URL_ENV, PGBOUNCER_SESSION_URL_ENV, PGBOUNCER_URL_ENV, PoolMode, Pooler,
    SESSION_DATABASE, SESSION_POOL_SIZE, TRANSACTION_POOL_SIZE, pgbouncer, pgbouncer_in_front_of,
    pgbouncer_private,
};
pub use sentinel::{
    RedisSentinel, SENTINEL_SERVICE, redis_sentinel, redis_sentinel_tls,
    redis_sentinel_with_replicas,
};
pub use tls::{
    CertPair, EtcdTls, MysqlTls, PostgresTls, RedisTls, TestCerts, etcd_tls, mysql_tls,
    postgres_tls, redis_tls,
};

use process::LocalServer;

/// Environment variable with the URL of an existing Redis server, e.g. `redis://127.0.0.1:6379`.
pub const REDIS_URL_ENV: &str = "SIMBA_TEST_REDIS_URL";
/// Environment variable with the URL of an existing MySQL/MariaDB database,
/// e.g. `mysql://root@127.0.0.1:3306/simba`.
pub const MYSQL_URL_ENV: &str = "SIMBA_TEST_MYSQL_URL";
/// Environment variable with the URL of an existing PostgreSQL database,
/// e.g. `postgres://postgres@127.0.0.1:5432/simba`.
pub const POSTGRES_URL_ENV: &str = "SIMBA_TEST_POSTGRES_URL";
/// Environment variable with a ZooKeeper connect string, `host:port[,host:port][/chroot]`.
pub const ZOOKEEPER_ENV: &str = "SIMBA_TEST_ZOOKEEPER";
/// Environment variable with the URL of an existing etcd, e.g. `etcd://127.0.0.1:2379`.
pub const ETCD_URL_ENV: &str = "SIMBA_TEST_ETCD_URL";
/// Environment variable that selects where servers come from when no URL is set:
/// `containers`, `local`, or unset/empty for local binaries with the container fallback.
/// See the [module documentation](self).
pub const SERVERS_ENV: &str = "SIMBA_TEST_SERVERS";

/// Name of the database that private MySQL and PostgreSQL instances create.
pub const DATABASE: &str = "simba";

/// How long a private instance may take to answer its readiness probe.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// The kind of a test server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ServerKind {
    /// Redis (or a protocol-compatible server such as Valkey).
    Redis,
    /// MySQL or MariaDB.
    Mysql,
    /// PostgreSQL.
    Postgres,
    /// Apache ZooKeeper.
    Zookeeper,
    /// etcd (v3 API).
    Etcd,
    /// PgBouncer in front of PostgreSQL (see [`pgbouncer`]; its clients speak PostgreSQL's
    /// protocol).
    Pgbouncer,
}

impl ServerKind {
    /// The environment variable that points the kit at an existing server of this kind.
    pub fn env_var(self) -> &'static str {
        match self {
            Self::Redis => REDIS_URL_ENV,
            Self::Mysql => MYSQL_URL_ENV,
            Self::Postgres => POSTGRES_URL_ENV,
            Self::Zookeeper => ZOOKEEPER_ENV,
            Self::Etcd => ETCD_URL_ENV,
            Self::Pgbouncer => PGBOUNCER_URL_ENV,
        }
    }

    /// The server's usual TCP port, used when a URL gives none.
    pub fn default_port(self) -> u16 {
        match self {
            Self::Redis => 6379,
            Self::Mysql => 3306,
            Self::Postgres => 5432,
            Self::Zookeeper => 2181,
            Self::Etcd => 2379,
            Self::Pgbouncer => 6432,
        }
    }

    /// An example value for [`ServerKind::env_var`], used in error messages.
    fn env_example(self) -> &'static str {
        match self {
            Self::Redis => "redis://127.0.0.1:6379",
            Self::Mysql => "mysql://root@127.0.0.1:3306/simba",
            Self::Postgres => "postgres://postgres@127.0.0.1:5432/simba",
            Self::Zookeeper => "127.0.0.1:2181",
            Self::Etcd => "etcd://127.0.0.1:2379",
            Self::Pgbouncer => "postgres://postgres@127.0.0.1:6432/simba",
        }
    }

    /// The Debian/Ubuntu package that provides the server binary.
    fn apt_package(self) -> &'static str {
        match self {
            Self::Redis => "redis-server",
            Self::Mysql => "mariadb-server",
            Self::Postgres => "postgresql",
            Self::Zookeeper => "zookeeper",
            Self::Etcd => "etcd-server",
            Self::Pgbouncer => "pgbouncer",
        }
    }
}

impl fmt::Display for ServerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Redis => "Redis",
            Self::Mysql => "MySQL/MariaDB",
            Self::Postgres => "PostgreSQL",
            Self::Zookeeper => "ZooKeeper",
            Self::Etcd => "etcd",
            Self::Pgbouncer => "PgBouncer",
        })
    }
}

/// Why a test server could not be provided or controlled.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// No server of this kind can be had here; `hint` says how to get one.
    #[error("no {kind} server for tests: {hint}")]
    Unavailable {
        /// The server kind.
        kind: ServerKind,
        /// What to install or set, and what was tried.
        hint: String,
    },
    /// A private instance did not start or did not become ready.
    #[error("{kind} test server failed to start: {message}\n--- server log (tail) ---\n{log_tail}")]
    Start {
        /// The server kind.
        kind: ServerKind,
        /// What went wrong.
        message: String,
        /// The last lines of the server's log.
        log_tail: String,
    },
    /// A control method was called on a server that the kit does not own.
    #[error(
        "{kind} test server: {operation} needs a private instance, this is not a private instance ({origin})"
    )]
    NotPrivate {
        /// The server kind.
        kind: ServerKind,
        /// The method that was called.
        operation: &'static str,
        /// Where the server came from.
        origin: &'static str,
    },
    /// The private instance is stopped, so the operation cannot be applied.
    #[error("{kind} test server: {operation} needs a running server, but it is stopped")]
    NotRunning {
        /// The server kind.
        kind: ServerKind,
        /// The method that was called.
        operation: &'static str,
    },
    /// A server address (from the environment variable or [`TestServer::external`])
    /// that the kit cannot use.
    #[error("invalid {kind} server address {url:?} (check {}): {message}", kind.env_var())]
    InvalidUrl {
        /// The server kind.
        kind: ServerKind,
        /// The address as given.
        url: String,
        /// What is wrong with it.
        message: String,
    },
    /// [`SERVERS_ENV`] has a value the kit does not know.
    #[error(
        "{SERVERS_ENV}={value:?} is not a server source: use `containers`, `local`, or leave it unset"
    )]
    InvalidSelection {
        /// The value as given.
        value: String,
    },
    /// A control operation on a deployment (a cluster in containers: a leader, a quorum,
    /// a member serving again) did not come about within its bound.
    #[error("{kind} test servers: {operation} not done within {within:?}: {state}")]
    Timeout {
        /// The server kind.
        kind: ServerKind,
        /// What was waited for.
        operation: String,
        /// The bound.
        within: Duration,
        /// What the deployment looked like at the end.
        state: String,
    },
    /// An I/O or helper-command failure while managing a server.
    #[error("{kind} test server: {context}: {source}")]
    Io {
        /// The server kind.
        kind: ServerKind,
        /// What the kit was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl ServerError {
    pub(crate) fn io(kind: ServerKind, context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            kind,
            context: context.into(),
            source,
        }
    }

    /// A missing local binary; `what` says what was looked for. [`with_advice`](Self::with_advice) adds how
    /// to get one.
    pub(crate) fn missing_binary(kind: ServerKind, what: &str) -> Self {
        Self::Unavailable {
            kind,
            hint: what.to_owned(),
        }
    }

    /// Appends to an [`Unavailable`](Self::Unavailable) error how to get a server: for a
    /// `private` instance only a local binary helps.
    pub(crate) fn with_advice(self, private: bool) -> Self {
        let Self::Unavailable { kind, hint } = self else {
            return self;
        };
        let install = format!(
            "install the server (Debian/Ubuntu: `apt-get install {}`)",
            kind.apt_package()
        );
        let hint = if private {
            format!(
                "{hint}. This test controls the server process (stop, kill, pause), so it needs \
                 a local server binary and does not use {}: {install}",
                kind.env_var()
            )
        } else {
            format!(
                "{hint}. Either {install}, or set {var} (e.g. {var}={example}), or build \
                 simba-test-kit with the feature `containers`, run a Docker daemon and set \
                 SIMBA_TEST_SERVERS=containers",
                var = kind.env_var(),
                example = kind.env_example(),
            )
        };
        Self::Unavailable { kind, hint }
    }
}

/// Where a [`TestServer`] comes from.
enum Origin {
    /// Given by an environment variable or URL; the kit does not control it.
    Env,
    /// A private instance started by the kit.
    Local(Box<LocalServer>),
    /// A testcontainers container, removed when dropped.
    #[cfg(feature = "containers")]
    Container(Box<testcontainers::ContainerAsync<testcontainers::GenericImage>>),
}

impl Origin {
    fn name(&self) -> &'static str {
        match self {
            Self::Env => "an external server given by URL",
            Self::Local(_) => "private local instance",
            #[cfg(feature = "containers")]
            Self::Container(_) => "container",
        }
    }
}

/// A server that a test can use, and for private instances control.
///
/// Dropping a private instance kills its process (by process id), waits for it and
/// removes its temporary directory. Dropping a container removes the container.
pub struct TestServer {
    kind: ServerKind,
    url: String,
    host: String,
    port: u16,
    origin: Origin,
}

impl fmt::Debug for TestServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("TestServer");
        d.field("kind", &self.kind)
            .field("url", &self.url)
            .field("origin", &self.origin.name());
        match &self.origin {
            Origin::Local(local) => {
                d.field("pid", &local.pid())
                    .field("dir", &local.dir().display());
            }
            #[cfg(feature = "containers")]
            Origin::Container(container) => {
                d.field("container", &container.id());
            }
            Origin::Env => {}
        }
        d.finish()
    }
}

impl TestServer {
    fn from_local(local: LocalServer) -> Self {
        let kind = local.kind();
        let port = local.port();
        Self {
            kind,
            url: local.url(),
            host: "127.0.0.1".to_owned(),
            port,
            origin: Origin::Local(Box::new(local)),
        }
    }

    /// An existing server that the kit does not control, given by its URL (for ZooKeeper:
    /// a connect string). The control methods return [`ServerError::NotPrivate`].
    pub fn external(kind: ServerKind, url: &str) -> Result<TestServer, ServerError> {
        let (host, port) = parse_address(kind, url).map_err(|message| ServerError::InvalidUrl {
            kind,
            url: url.to_owned(),
            message,
        })?;
        Ok(TestServer {
            kind,
            url: url.to_owned(),
            host,
            port,
            origin: Origin::Env,
        })
    }

    /// The server kind.
    pub fn kind(&self) -> ServerKind {
        self.kind
    }

    /// The address to give a client.
    ///
    /// Private instances: `redis://127.0.0.1:PORT`, `mysql://root@127.0.0.1:PORT/simba`,
    /// `postgres://postgres@127.0.0.1:PORT/simba`, and for ZooKeeper the connect string
    /// `127.0.0.1:PORT`. Servers from an environment variable: its value.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The host of the (first) server address.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port of the (first) server address.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The (first) server address, resolved. Use it as the upstream of a
    /// [`FaultProxy`](crate::proxy::FaultProxy).
    pub fn socket_addr(&self) -> Result<SocketAddr, ServerError> {
        let resolved = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| ServerError::io(self.kind, format!("resolving {}", self.host), e))?
            .next();
        resolved.ok_or_else(|| {
            ServerError::io(
                self.kind,
                format!("resolving {}", self.host),
                std::io::Error::new(std::io::ErrorKind::NotFound, "no address"),
            )
        })
    }

    /// [`TestServer::url`] with the host and port replaced by `addr` (user, database and
    /// chroot are kept). Use it to connect through a [`FaultProxy`](crate::proxy::FaultProxy).
    pub fn url_via(&self, addr: SocketAddr) -> String {
        replace_authority(self.kind, &self.url, addr)
    }

    /// Whether this is a private instance that the control methods can act on.
    pub fn is_private(&self) -> bool {
        matches!(self.origin, Origin::Local(_))
    }

    /// The process id of a running private instance.
    pub fn pid(&self) -> Option<u32> {
        match &self.origin {
            Origin::Local(local) => local.pid(),
            _ => None,
        }
    }

    /// The id of the container this server runs in (feature `containers`).
    #[cfg(feature = "containers")]
    pub fn container_id(&self) -> Option<&str> {
        match &self.origin {
            Origin::Container(container) => Some(container.id()),
            _ => None,
        }
    }

    /// The temporary directory of a private instance (data, configuration, log).
    pub fn dir(&self) -> Option<&Path> {
        match &self.origin {
            Origin::Local(local) => Some(local.dir()),
            _ => None,
        }
    }

    /// The last `lines` lines of a private instance's log (empty for other servers).
    pub fn log_tail(&self, lines: usize) -> String {
        match &self.origin {
            Origin::Local(local) => local.log_tail(0, lines),
            _ => String::new(),
        }
    }

    fn local(&self, operation: &'static str) -> Result<&LocalServer, ServerError> {
        match &self.origin {
            Origin::Local(local) => Ok(local),
            other => Err(ServerError::NotPrivate {
                kind: self.kind,
                operation,
                origin: other.name(),
            }),
        }
    }

    /// Whether a private instance's process is running (paused counts as running).
    pub async fn is_running(&self) -> Result<bool, ServerError> {
        self.local("is_running")?.is_running().await
    }

    /// Stops a private instance gracefully (SIGTERM; SIGINT for PostgreSQL), waiting up
    /// to 15 s before it kills it. The data directory is kept. Stopping a stopped server
    /// does nothing.
    pub async fn stop(&self) -> Result<(), ServerError> {
        self.local("stop")?.stop().await
    }

    /// Starts a stopped private instance again on the same port with the same data
    /// directory, and waits until it answers. Data survives for every kind: Redis runs
    /// with an append-only file. Starting a running server does nothing.
    pub async fn start(&self) -> Result<(), ServerError> {
        self.local("start")?.start().await
    }

    /// Starts a private instance that was stopped or killed, with `args` added to its
    /// command line (for this and every later start).
    pub async fn start_with_args(&self, args: &[&str]) -> Result<(), ServerError> {
        let local = self.local("start_with_args")?;
        local
            .set_extra_args(args.iter().map(|a| (*a).to_owned()).collect())
            .await;
        local.start().await
    }

    /// [`stop`](Self::stop) followed by [`start`](Self::start).
    pub async fn restart(&self) -> Result<(), ServerError> {
        let local = self.local("restart")?;
        local.stop().await?;
        local.start().await
    }

    /// Kills a private instance with SIGKILL (a crash), together with its child
    /// processes, and waits until they are gone. The data directory is kept; call
    /// [`start`](Self::start) to bring it back.
    pub async fn kill(&self) -> Result<(), ServerError> {
        self.local("kill")?.kill().await
    }

    /// Freezes a private instance with SIGSTOP (and its child processes): connections
    /// stay open but nothing answers, like a hung server.
    pub async fn pause(&self) -> Result<(), ServerError> {
        self.local("pause")?.pause().await
    }

    /// Undoes [`pause`](Self::pause) with SIGCONT.
    pub async fn resume(&self) -> Result<(), ServerError> {
        self.local("resume")?.resume().await
    }

    /// Stops a private instance, throws all its data away and starts it again on the same
    /// port with fresh data (an empty Redis, a fresh database, an empty ZooKeeper tree).
    /// For a node of a [`RedisCluster`] this also loses the cluster configuration.
    pub async fn wipe_restart(&self) -> Result<(), ServerError> {
        self.local("wipe_restart")?.wipe_restart().await
    }
}

/// A Redis server: [`REDIS_URL_ENV`], else a private local `redis-server`, else a container
/// (feature `containers`), else [`ServerError::Unavailable`].
pub async fn redis() -> Result<TestServer, ServerError> {
    resolve(ServerKind::Redis).await
}

/// A MySQL/MariaDB database: [`MYSQL_URL_ENV`], else a private local `mariadbd`, else a
/// container (feature `containers`), else [`ServerError::Unavailable`].
pub async fn mysql() -> Result<TestServer, ServerError> {
    resolve(ServerKind::Mysql).await
}

/// A PostgreSQL database: [`POSTGRES_URL_ENV`], else a private local `postgres`, else a
/// container (feature `containers`), else [`ServerError::Unavailable`].
pub async fn postgres() -> Result<TestServer, ServerError> {
    resolve(ServerKind::Postgres).await
}

/// A ZooKeeper server: [`ZOOKEEPER_ENV`], else a private local ZooKeeper, else a container
/// (feature `containers`), else [`ServerError::Unavailable`].
pub async fn zookeeper() -> Result<TestServer, ServerError> {
    resolve(ServerKind::Zookeeper).await
}

/// A private local Redis instance, ignoring [`REDIS_URL_ENV`]; fault tests control it.
pub async fn redis_private() -> Result<TestServer, ServerError> {
    private(ServerKind::Redis).await
}

/// A private local MariaDB instance, ignoring [`MYSQL_URL_ENV`]; fault tests control it.
pub async fn mysql_private() -> Result<TestServer, ServerError> {
    private(ServerKind::Mysql).await
}

/// A private local PostgreSQL instance, ignoring [`POSTGRES_URL_ENV`]; fault tests control it.
pub async fn postgres_private() -> Result<TestServer, ServerError> {
    private(ServerKind::Postgres).await
}

/// An etcd server: [`ETCD_URL_ENV`], else a private local etcd, else a container (feature
/// `containers`).
pub async fn etcd() -> Result<TestServer, ServerError> {
    resolve(ServerKind::Etcd).await
}

/// A private local etcd instance, ignoring [`ETCD_URL_ENV`]; fault tests control it.
pub async fn etcd_private() -> Result<TestServer, ServerError> {
    private(ServerKind::Etcd).await
}

/// A private local ZooKeeper instance, ignoring [`ZOOKEEPER_ENV`]; fault tests control it.
pub async fn zookeeper_private() -> Result<TestServer, ServerError> {
    private(ServerKind::Zookeeper).await
}

/// A server of `kind`, resolved as described in the [module documentation](self).
///
/// For [`ServerKind::Pgbouncer`] only its environment variable or a container gives a
/// server this way (the container's PgBouncer, in transaction mode, owns the container);
/// use [`pgbouncer`] for one with its PostgreSQL.
pub async fn server(kind: ServerKind) -> Result<TestServer, ServerError> {
    resolve(kind).await
}

/// A container of the kit's image for `kind` (feature `containers`), whatever
/// [`SERVERS_ENV`] and the URL variables say. It publishes its port on `127.0.0.1`, carries
/// the label [`LABEL`]` = 1` and is removed when the [`TestServer`] is dropped.
///
/// # Errors
///
/// [`ServerError::Unavailable`] when no Docker daemon answers or the image is missing
/// (the message says how to fix it), [`ServerError::Start`] when the container does not
/// start or its server does not answer within two minutes.
///
/// # Cancel safety
///
/// Not cancel safe: a container being created when the future is dropped is not removed
/// (`scripts/containers.sh clean` removes it by its label).
#[cfg(feature = "containers")]
pub async fn container(kind: ServerKind) -> Result<TestServer, ServerError> {
    container::start(kind).await
}

/// A private local instance of `kind`; see [`redis_private`].
///
/// PgBouncer needs a PostgreSQL and a pool mode: for [`ServerKind::Pgbouncer`] use
/// [`pgbouncer_private`] (this returns [`ServerError::Unavailable`] saying so).
pub async fn private(kind: ServerKind) -> Result<TestServer, ServerError> {
    if kind == ServerKind::Pgbouncer {
        return Err(pgbouncer::needs_postgres());
    }
    let flavor = process::Flavor::detect(kind).map_err(|e| e.with_advice(true))?;
    Ok(TestServer::from_local(LocalServer::create(flavor).await?))
}

/// Where [`resolve`] takes a server from when no URL is set, chosen by [`SERVERS_ENV`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Selection {
    /// The local binary, else (feature `containers`) a container.
    Auto,
    /// The local binary only.
    Local,
    /// A container only.
    Containers,
}

impl Selection {
    fn parse(value: &str) -> Result<Self, ServerError> {
        match value.trim() {
            "" => Ok(Self::Auto),
            v if v.eq_ignore_ascii_case("local") => Ok(Self::Local),
            v if v.eq_ignore_ascii_case("containers") => Ok(Self::Containers),
            _ => Err(ServerError::InvalidSelection {
                value: value.to_owned(),
            }),
        }
    }

    fn from_env() -> Result<Self, ServerError> {
        match std::env::var(SERVERS_ENV) {
            Ok(value) => Self::parse(&value),
            Err(std::env::VarError::NotPresent) => Ok(Self::Auto),
            Err(std::env::VarError::NotUnicode(value)) => Err(ServerError::InvalidSelection {
                value: value.to_string_lossy().into_owned(),
            }),
        }
    }
}

async fn resolve(kind: ServerKind) -> Result<TestServer, ServerError> {
    if let Some(server) = from_env(kind)? {
        return Ok(server);
    }
    let selection = Selection::from_env()?;
    if selection == Selection::Containers {
        return from_container(kind).await;
    }
    if kind == ServerKind::Pgbouncer {
        return Err(pgbouncer::needs_postgres());
    }
    let missing = match process::Flavor::detect(kind) {
        Ok(flavor) => return Ok(TestServer::from_local(LocalServer::create(flavor).await?)),
        Err(missing) => missing.with_advice(false),
    };
    #[cfg(feature = "containers")]
    let missing = match selection {
        Selection::Local => missing,
        _ => match container::start(kind).await {
            Ok(server) => return Ok(server),
            Err(reason) => container_failed_too(missing, reason),
        },
    };
    Err(missing)
}

/// `missing` (no local server), with why the container fallback failed too.
#[cfg(feature = "containers")]
fn container_failed_too(missing: ServerError, reason: impl fmt::Display) -> ServerError {
    match missing {
        ServerError::Unavailable { kind, hint } => ServerError::Unavailable {
            kind,
            hint: format!("{hint}. The container fallback failed too: {reason}"),
        },
        other => other,
    }
}

/// A container of the kit's image for `kind` ([`SERVERS_ENV`]`=containers`).
#[cfg(feature = "containers")]
async fn from_container(kind: ServerKind) -> Result<TestServer, ServerError> {
    container(kind).await
}

/// Without the feature `containers` there are no containers: an error that says so.
#[cfg(not(feature = "containers"))]
async fn from_container(kind: ServerKind) -> Result<TestServer, ServerError> {
    Err(no_containers(kind))
}

/// The error of [`SERVERS_ENV`]`=containers` without the feature `containers`.
#[cfg(not(feature = "containers"))]
fn no_containers(kind: ServerKind) -> ServerError {
    ServerError::Unavailable {
        kind,
        hint: format!(
            "{SERVERS_ENV}=containers, but simba-test-kit was built without its feature \
             `containers`: add `--features simba-test-kit/containers` to the cargo command"
        ),
    }
}

/// The server named by `kind`'s environment variable, if it is set and not empty.
fn from_env(kind: ServerKind) -> Result<Option<TestServer>, ServerError> {
    let var = kind.env_var();
    let value = match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => v.trim().to_owned(),
        Ok(_) | Err(std::env::VarError::NotPresent) => return Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => {
            return Err(ServerError::InvalidUrl {
                kind,
                url: v.to_string_lossy().into_owned(),
                message: format!("{var} is not valid UTF-8"),
            });
        }
    };
    TestServer::external(kind, &value).map(Some)
}

/// Splits a URL (or, for ZooKeeper, a connect string) into
/// `(prefix up to the authority, host:port list, rest)`.
fn split_url(kind: ServerKind, url: &str) -> (String, String, String) {
    let (prefix, after) = if kind == ServerKind::Zookeeper {
        (String::new(), url)
    } else {
        match url.find("://") {
            Some(i) => (url[..i + 3].to_owned(), &url[i + 3..]),
            None => (String::new(), url),
        }
    };
    let end = after.find(['/', '?']).unwrap_or(after.len());
    let (authority, rest) = after.split_at(end);
    let (userinfo, hosts) = match authority.rfind('@') {
        Some(i) => (&authority[..=i], &authority[i + 1..]),
        None => ("", authority),
    };
    (
        format!("{prefix}{userinfo}"),
        hosts.to_owned(),
        rest.to_owned(),
    )
}

/// The first host and port of a URL or connect string.
fn parse_address(kind: ServerKind, url: &str) -> Result<(String, u16), String> {
    if kind != ServerKind::Zookeeper && !url.contains("://") {
        return Err("expected a URL like scheme://host:port/...".to_owned());
    }
    let (_, hosts, _) = split_url(kind, url);
    let first = hosts.split(',').next().unwrap_or_default().trim();
    if first.is_empty() {
        return Err("no host".to_owned());
    }
    let (host, port) = if let Some(stripped) = first.strip_prefix('[') {
        // [v6]:port
        let Some(close) = stripped.find(']') else {
            return Err("unterminated [ in host".to_owned());
        };
        let host = &stripped[..close];
        let port = stripped[close + 1..].strip_prefix(':');
        (host.to_owned(), port)
    } else {
        match first.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), Some(p)),
            None => (first.to_owned(), None),
        }
    };
    let port = match port {
        Some(p) => p
            .parse::<u16>()
            .map_err(|e| format!("bad port {p:?}: {e}"))?,
        None => kind.default_port(),
    };
    if host.is_empty() {
        return Err("no host".to_owned());
    }
    Ok((host, port))
}

fn replace_authority(kind: ServerKind, url: &str, addr: SocketAddr) -> String {
    let (prefix, _, rest) = split_url(kind, url);
    format!("{prefix}{addr}{rest}")
}

#[cfg(test)]
mod compose_tests {
    use super::*;

    /// `docker-compose.yml` names exactly the images (and tag) the container path starts,
    /// built from the same `docker/<name>` directories.
    #[test]
    fn compose_names_the_kits_images() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docker-compose.yml");
        let compose = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let images: Vec<&str> = compose
            .lines()
            .filter_map(|l| l.trim().strip_prefix("image:"))
            .map(str::trim)
            .collect();
        let kinds = [
            ServerKind::Redis,
            ServerKind::Mysql,
            ServerKind::Postgres,
            ServerKind::Zookeeper,
            ServerKind::Etcd,
            ServerKind::Pgbouncer,
        ];
        let expected: Vec<String> = kinds
            .iter()
            .map(|k| format!("{}:{IMAGE_TAG}", image_name(*k)))
            .collect();
        assert_eq!(images, expected, "docker-compose.yml images");
        for k in kinds {
            let dir = image_name(k).trim_start_matches("simba/");
            assert!(compose.contains(&format!("context: docker/{dir}")), "{dir}");
            let dockerfile =
                concat!(env!("CARGO_MANIFEST_DIR"), "/../docker/").to_owned() + dir + "/Dockerfile";
            assert!(std::path::Path::new(&dockerfile).is_file(), "{dockerfile}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_addresses() {
        assert_eq!(
            parse_address(ServerKind::Redis, "redis://127.0.0.1:7000"),
            Ok(("127.0.0.1".to_owned(), 7000))
        );
        assert_eq!(
            parse_address(
                ServerKind::Mysql,
                "mysql://root:pw@db.example:3307/simba?x=1"
            ),
            Ok(("db.example".to_owned(), 3307))
        );
        assert_eq!(
            parse_address(ServerKind::Postgres, "postgres://u@[::1]/simba"),
            Ok(("::1".to_owned(), 5432))
        );
        assert_eq!(
            parse_address(ServerKind::Zookeeper, "zk1:2182,zk2:2183/chroot"),
            Ok(("zk1".to_owned(), 2182))
        );
        assert!(parse_address(ServerKind::Redis, "localhost:6379").is_err());
        assert!(parse_address(ServerKind::Redis, "redis://h:notaport").is_err());
    }

    #[test]
    fn unavailable_says_how_to_get_a_server() {
        let shared = ServerError::missing_binary(ServerKind::Redis, "redis-server was not found")
            .with_advice(false)
            .to_string();
        assert!(shared.contains("redis-server was not found"), "{shared}");
        assert!(shared.contains("apt-get install redis-server"), "{shared}");
        assert!(shared.contains("SIMBA_TEST_REDIS_URL=redis://"), "{shared}");
        let private = ServerError::missing_binary(ServerKind::Postgres, "no postgres")
            .with_advice(true)
            .to_string();
        assert!(private.contains("apt-get install postgresql"), "{private}");
        assert!(
            private.contains("does not use SIMBA_TEST_POSTGRES_URL"),
            "{private}"
        );
    }

    #[test]
    fn selection_values() {
        assert_eq!(Selection::parse("").ok(), Some(Selection::Auto));
        assert_eq!(Selection::parse(" local ").ok(), Some(Selection::Local));
        assert_eq!(
            Selection::parse("Containers").ok(),
            Some(Selection::Containers)
        );
        let error = Selection::parse("docker")
            .map(|_| ())
            .err()
            .map(|e| e.to_string());
        let error = error.unwrap_or_default();
        assert!(error.contains("SIMBA_TEST_SERVERS=\"docker\""), "{error}");
        assert!(error.contains("`containers`, `local`"), "{error}");
    }

    #[test]
    fn replaces_authority() {
        let addr: SocketAddr = ([127, 0, 0, 1], 9).into();
        assert_eq!(
            replace_authority(ServerKind::Mysql, "mysql://root:pw@db:3306/simba?a=b", addr),
            "mysql://root:pw@127.0.0.1:9/simba?a=b"
        );
        assert_eq!(
            replace_authority(ServerKind::Zookeeper, "a:1,b:2/chroot", addr),
            "127.0.0.1:9/chroot"
        );
        assert_eq!(
            replace_authority(ServerKind::Redis, "redis://127.0.0.1:6379", addr),
            "redis://127.0.0.1:9"
        );
    }
}
