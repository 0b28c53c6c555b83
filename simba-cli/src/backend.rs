//! From a backend URL to a contend-service factory (`Arc<dyn ContendServiceFactory>`).
//!
//! | URL | backend | cargo feature |
//! |---|---|---|
//! | `sqlite://PATH` | SQLite file (the default lives in the user's state directory) | `sqlite` |
//! | `redis://HOST[:PORT][/DB]` | Redis / Valkey | `redis` |
//! | `rediss://…` | Redis over TLS | `tls` |
//! | `mysql://USER:PASS@HOST[:PORT]/DB` | MySQL / MariaDB | `mysql` |
//! | `postgres://USER:PASS@HOST[:PORT]/DB` | PostgreSQL | `postgres` |
//! | `zk://[USER:PASS@]HOST:PORT[,HOST:PORT…][/CHROOT]` | ZooKeeper (a userinfo is digest auth) | `zookeeper` |

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use simba_core::backend::{BoxFuture, LeaseReply};
use simba_core::{ContendServiceFactory, LeaseConfig};

use crate::status::{Failure, Status};

/// How often a waiter (or an observer) looks again on SQLite and MySQL where nothing
/// pushes to it, unless the caller chose (`LeaseConfig::waiter_poll`; core jitters it in
/// its second half). Waiters are pushed by the database's lock queue and use it only while
/// a subscription fails; observers there read at this pace.
const WAITER_POLL: Duration = Duration::from_millis(200);

/// How long `simba` tries to reach ZooKeeper before it gives up (the library's default is
/// 10 s); the same as the Redis backend's connect timeout.
#[allow(dead_code)] // unused without the zookeeper feature
const ZK_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// `lease` with [`WAITER_POLL`] unless a poll was already chosen.
#[allow(dead_code)] // unused without the sqlite and mysql features
fn polling(lease: LeaseConfig) -> LeaseConfig {
    LeaseConfig {
        waiter_poll: lease.waiter_poll.or(Some(WAITER_POLL)),
        ..lease
    }
}

/// Every scheme `simba` knows, with the feature that compiles it in.
const SCHEMES: &[(&str, &str, bool)] = &[
    ("sqlite://PATH", "sqlite", cfg!(feature = "sqlite")),
    ("redis://", "redis", cfg!(feature = "redis")),
    ("rediss://", "tls", cfg!(feature = "tls")),
    ("mysql://", "mysql", cfg!(feature = "mysql")),
    ("postgres://", "postgres", cfg!(feature = "postgres")),
    (
        "zk://host:port[,host:port]/chroot",
        "zookeeper",
        cfg!(feature = "zookeeper"),
    ),
];

/// The schemes compiled into this binary, for messages.
pub(crate) fn supported() -> String {
    let on: Vec<&str> = SCHEMES
        .iter()
        .filter(|(_, _, on)| *on)
        .map(|(s, _, _)| *s)
        .collect();
    if on.is_empty() {
        "none (this simba was built without any backend feature)".to_owned()
    } else {
        on.join(", ")
    }
}

/// Where to connect, parsed from a URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// A SQLite file.
    Sqlite(PathBuf),
    /// A Redis URL (`redis://`, `rediss://`, `redis-cluster://`, `redis-sentinel://`, `valkey…`).
    Redis(String),
    /// A MySQL / MariaDB URL.
    Mysql(String),
    /// A PostgreSQL URL.
    Postgres(String),
    /// A ZooKeeper URL (`zk://[user:password@]hosts[/chroot]`).
    Zookeeper(String),
}

impl Target {
    /// Parses `url`; a bad or unsupported URL is a usage error that lists what works.
    pub(crate) fn parse(url: &str) -> Result<Target, Failure> {
        let url = url.trim();
        let shown = redact(url);
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(Failure::usage(format!(
                "backend `{shown}` is not a URL; use one of: {}",
                supported()
            )));
        };
        let scheme = scheme.to_ascii_lowercase();
        let (target, feature) = match scheme.as_str() {
            "sqlite" => {
                if rest.is_empty() || rest == ":memory:" {
                    return Err(Failure::usage(format!(
                        "backend `{shown}` names no file: write sqlite://PATH, e.g. \
                         sqlite:///var/lib/app/simba.db (an in-memory database cannot be \
                         shared by processes)"
                    )));
                }
                (Target::Sqlite(PathBuf::from(rest)), "sqlite")
            }
            "redis" | "valkey" | "redis-cluster" | "valkey-cluster" | "redis-sentinel"
            | "valkey-sentinel" => (Target::Redis(url.to_owned()), "redis"),
            "rediss" | "valkeys" | "rediss-cluster" | "valkeys-cluster" | "rediss-sentinel"
            | "valkeys-sentinel" => (Target::Redis(url.to_owned()), "tls"),
            "mysql" | "mariadb" => (Target::Mysql(url.to_owned()), "mysql"),
            "postgres" | "postgresql" => (Target::Postgres(url.to_owned()), "postgres"),
            // TLS schemes too, so that simba-zookeeper says why they cannot work.
            "zk" | "zookeeper" | "zks" | "zookeeper+tls" | "zookeeper+ssl" | "zookeepers" => {
                if rest.is_empty() || rest.starts_with('/') {
                    return Err(Failure::usage(format!(
                        "backend `{shown}` names no server: write zk://HOST:PORT[,HOST:PORT]/CHROOT"
                    )));
                }
                (Target::Zookeeper(url.to_owned()), "zookeeper")
            }
            other => {
                return Err(Failure::usage(format!(
                    "backend `{shown}`: unknown scheme `{other}://`; use one of: {}",
                    supported()
                )));
            }
        };
        let compiled = SCHEMES.iter().any(|(_, f, on)| *f == feature && *on);
        if !compiled {
            return Err(Failure::usage(format!(
                "backend `{shown}` needs the cargo feature `{feature}`, which this simba was \
                 built without; rebuild with `cargo install simba-cli --features {feature}` \
                 (compiled in: {})",
                supported()
            )));
        }
        Ok(target)
    }
}

/// Reads a mutex's owner with one backend call (lease backends).
pub(crate) trait OwnerReader: Send + Sync {
    /// The owner of `mutex` and the backend's clock.
    fn read<'a>(&'a self, mutex: &'a str) -> BoxFuture<'a, simba_core::Result<LeaseReply>>;
}

#[allow(dead_code)] // unused when no lease backend is compiled in
struct StoreReader<S>(Arc<S>);

impl<S: simba_core::backend::LeaseStore> OwnerReader for StoreReader<S> {
    fn read<'a>(&'a self, mutex: &'a str) -> BoxFuture<'a, simba_core::Result<LeaseReply>> {
        Box::pin(self.0.owner(mutex))
    }
}

/// The concrete store (or session) under a backend, for what the contend-service traits
/// do not offer (`simba bench`'s floor probes).
#[derive(Clone)]
#[allow(dead_code)] // some variants are unused, depending on the features
pub(crate) enum Native {
    /// A Redis store.
    #[cfg(feature = "redis")]
    Redis(simba_redis::RedisStore),
    /// A SQL store (SQLite, MySQL, PostgreSQL).
    #[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
    Sql(simba_jdbc::SqlStore),
    /// A ZooKeeper session.
    #[cfg(feature = "zookeeper")]
    Zookeeper(simba_zookeeper::ZkFactory),
}

/// A connected backend.
pub(crate) struct Backend {
    /// The URL, password redacted.
    pub(crate) shown: String,
    /// The factory of contend and retrieval services.
    pub(crate) factory: Arc<dyn ContendServiceFactory>,
    /// A one-call owner read, where the backend has one (lease backends); ZooKeeper is
    /// observed through a retrieval service instead.
    pub(crate) reader: Option<Arc<dyn OwnerReader>>,
    /// Whether the backend cannot push a release to waiters, so that they poll (see
    /// [`WAITER_POLL`]); no backend today.
    pub(crate) polls: bool,
    /// The concrete store or session.
    #[allow(dead_code)] // read by `bench` only
    pub(crate) native: Native,
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend")
            .field("url", &self.shown)
            .field("factory", &self.factory)
            .finish_non_exhaustive()
    }
}

/// Lease timing asked for on the command line.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Timing {
    /// `--ttl`.
    pub(crate) ttl: Option<Duration>,
    /// `--transition`.
    pub(crate) transition: Option<Duration>,
    /// How often a waiter looks again on backends that cannot push a release.
    pub(crate) waiter_poll: Option<Duration>,
    /// The jitter range (ms, `start..end`) of non-owners' wake-ups, with and without a
    /// transition period; `None` keeps the library's.
    pub(crate) jitter: Option<(i64, i64)>,
}

impl Timing {
    fn lease(self) -> LeaseConfig {
        let d = LeaseConfig::default();
        let mut lease = LeaseConfig {
            waiter_poll: self.waiter_poll,
            ..LeaseConfig::with_lease(
                self.ttl.unwrap_or(d.ttl),
                self.transition.unwrap_or(d.transition),
            )
        };
        if let Some((start, end)) = self.jitter {
            lease.jitter = start..end;
            lease.jitter_no_transition = start..end;
        }
        lease
    }
}

/// The URL to use: `--backend` / `SIMBA_BACKEND`, else the default SQLite file.
pub(crate) fn resolve_url(given: Option<&str>) -> Result<String, Failure> {
    match given.map(str::trim).filter(|s| !s.is_empty()) {
        Some(url) => Ok(url.to_owned()),
        None => default_url(),
    }
}

/// `sqlite://$XDG_STATE_HOME/simba/simba.db` (or `~/.local/state/simba/simba.db`), with the
/// directory created.
fn default_url() -> Result<String, Failure> {
    if !cfg!(feature = "sqlite") {
        return Err(Failure::usage(format!(
            "no backend given and this simba was built without the `sqlite` feature that \
             the default needs; pass --backend URL or set SIMBA_BACKEND (compiled in: {})",
            supported()
        )));
    }
    let dir = state_dir()?;
    create_private_dir(&dir)?;
    let file = dir.join("simba.db");
    let Some(path) = file.to_str() else {
        return Err(Failure::new(
            Status::CantCreate,
            format!(
                "the state directory {} is not valid UTF-8; pass --backend sqlite://PATH",
                dir.display()
            ),
        ));
    };
    Ok(format!("sqlite://{path}"))
}

fn state_dir() -> Result<PathBuf, Failure> {
    let absolute = |v: std::ffi::OsString| Some(PathBuf::from(v)).filter(|p| p.is_absolute());
    if let Some(base) = std::env::var_os("XDG_STATE_HOME").and_then(absolute) {
        return Ok(base.join("simba"));
    }
    if let Some(home) = std::env::var_os("HOME").and_then(absolute) {
        return Ok(home.join(".local").join("state").join("simba"));
    }
    Err(Failure::new(
        Status::CantCreate,
        "cannot find a state directory for the default SQLite backend: neither \
         XDG_STATE_HOME nor HOME is set to an absolute path; set one of them, or pass \
         --backend URL / set SIMBA_BACKEND",
    ))
}

fn create_private_dir(dir: &Path) -> Result<(), Failure> {
    use std::os::unix::fs::DirBuilderExt;
    let made = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir);
    match made {
        Ok(()) if dir.is_dir() => Ok(()),
        Ok(()) => Err(Failure::new(
            Status::CantCreate,
            format!("the state directory {} is not a directory", dir.display()),
        )),
        Err(e) => Err(Failure::with(
            Status::CantCreate,
            e,
            format!(
                "cannot create the state directory {} for the default SQLite backend; fix its \
                 permissions, set XDG_STATE_HOME to a writable directory, or pass \
                 --backend URL",
                dir.display()
            ),
        )),
    }
}

/// Connects to the backend of `url` with `timing`.
pub(crate) async fn connect(url: &str, timing: Timing) -> Result<Backend, Failure> {
    let target = Target::parse(url)?;
    let shown = redact(url);
    let lease = timing.lease();
    lease
        .validate()
        .map_err(|e| Failure::simba(e, "bad --ttl / --transition"))?;
    #[allow(unused_variables)] // unused when no backend is compiled in
    let connect_failed =
        |e: simba_core::Error| Failure::simba(e, format!("cannot use backend {shown}"));
    match target {
        #[cfg(feature = "sqlite")]
        Target::Sqlite(path) => {
            check_sqlite_dir(&path)?;
            let url = format!("sqlite://{}", path.display());
            // simba-jdbc retries the WAL switch that races when processes open a new file
            // together.
            let f = simba_jdbc::factory(&url, polling(lease))
                .await
                .map_err(|e| {
                    let hint = sqlite_hint(&e.to_string(), &path);
                    let failure = connect_failed(e);
                    match hint {
                        // After what SQLite said, so that the message reads in order.
                        Some(hint) => Failure::new(
                            failure.status,
                            format!("{}. {hint}", crate::status::describe(&failure.error)),
                        ),
                        None => failure,
                    }
                })?;
            // Waiters are woken by the database's native lock queue (no polling); the
            // poll period is only the fallback while a subscription cannot be made.
            let native = Native::Sql((**f.store()).clone());
            Ok(lease_backend(shown, f, false, native))
        }
        #[cfg(feature = "redis")]
        Target::Redis(url) => {
            let f = simba_redis::factory(&url, lease)
                .await
                .map_err(connect_failed)?;
            let native = Native::Redis((**f.store()).clone());
            Ok(lease_backend(shown, f, false, native))
        }
        #[cfg(feature = "mysql")]
        Target::Mysql(url) => {
            let f = simba_jdbc::factory(&url, polling(lease))
                .await
                .map_err(connect_failed)?;
            // Waiters are woken by the database's native lock queue (no polling); the
            // poll period is only the fallback while a subscription cannot be made.
            let native = Native::Sql((**f.store()).clone());
            Ok(lease_backend(shown, f, false, native))
        }
        #[cfg(feature = "postgres")]
        Target::Postgres(url) => {
            // Advisory locks wake waiters; LISTEN/NOTIFY tells observers of changes.
            let f = simba_jdbc::factory(&url, lease)
                .await
                .map_err(connect_failed)?;
            let native = Native::Sql((**f.store()).clone());
            Ok(lease_backend(shown, f, false, native))
        }
        #[cfg(feature = "zookeeper")]
        Target::Zookeeper(url) => {
            let mut config = simba_zookeeper::ZkConfig::from_url(&url)
                .map_err(connect_failed)?
                .with_connect_timeout(ZK_CONNECT_TIMEOUT);
            if timing.ttl.is_some() || timing.transition.is_some() {
                // ZooKeeper has sessions, not leases: the session timeout plays the part
                // of ttl + transition (how long a silent owner keeps the mutex).
                config = config.with_session_timeout(lease.ttl + lease.transition);
            }
            let f = simba_zookeeper::ZkFactory::connect(config)
                .await
                .map_err(connect_failed)?;
            Ok(Backend {
                shown,
                factory: Arc::new(f.clone()),
                reader: None,
                polls: false,
                native: Native::Zookeeper(f),
            })
        }
        #[allow(unreachable_patterns)]
        other => Err(Failure::new(
            Status::Internal,
            format!("backend {other:?} is not compiled in (parse should have said so)"),
        )),
    }
}

#[allow(dead_code)] // unused when no lease backend is compiled in
fn lease_backend<S: simba_core::backend::LeaseStore>(
    shown: String,
    f: simba_core::LeaseServiceFactory<S>,
    polls: bool,
    native: Native,
) -> Backend {
    let store = f.store().clone();
    Backend {
        shown,
        factory: Arc::new(f),
        reader: Some(Arc::new(StoreReader(store))),
        polls,
        native,
    }
}

/// A SQLite file's directory must exist, and the path, if it exists, must be a regular
/// file: SQLite's own errors ("unable to open database file", "disk I/O error", or a
/// "database is locked" that lasts until the timeout for `/dev/null`) do not say so.
#[allow(dead_code)] // unused without the sqlite feature
fn check_sqlite_dir(path: &Path) -> Result<(), Failure> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if let Ok(meta) = std::fs::metadata(path)
        && !meta.is_file()
    {
        let kind = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file (a device, socket or pipe)"
        };
        return Err(Failure::new(
            Status::CantCreate,
            format!(
                "the SQLite path {} is {kind}; SQLite needs a regular file, and writes \
                 `-wal` and `-shm` files beside it: choose a file in a writable directory, \
                 e.g. sqlite:///var/tmp/simba.db",
                path.display()
            ),
        ));
    }
    if dir.is_dir() {
        Ok(())
    } else {
        Err(Failure::new(
            Status::CantCreate,
            format!(
                "the directory {} of the SQLite file {} does not exist; create it or choose \
                 another path",
                dir.display(),
                path.display()
            ),
        ))
    }
}

/// What to check when SQLite gives one of its terse file errors ("disk I/O error", "unable
/// to open database file") for `path`, or `None` for other errors.
#[allow(dead_code)] // unused without the sqlite feature
fn sqlite_hint(error: &str, path: &Path) -> Option<String> {
    ["disk I/O error", "unable to open database file"]
        .iter()
        .any(|terse| error.contains(terse))
        .then(|| {
            format!(
                "SQLite cannot read or write {} or create its -wal / -shm files beside it: \
                 check that the file and its directory are writable and on a local file system",
                path.display()
            )
        })
}

/// `url` with its secrets replaced by `***`, by the rules of the backend crate that parses
/// it (each knows where its URL forms carry passwords); a URL of no compiled-in backend gets
/// the common rule of `simba-core`.
pub(crate) fn redact(url: &str) -> String {
    let scheme = url
        .trim()
        .split_once("://")
        .map(|(s, _)| s.to_ascii_lowercase());
    match scheme.as_deref() {
        #[cfg(feature = "redis")]
        Some(
            "redis" | "valkey" | "redis-cluster" | "valkey-cluster" | "redis-sentinel"
            | "valkey-sentinel" | "rediss" | "valkeys" | "rediss-cluster" | "valkeys-cluster"
            | "rediss-sentinel" | "valkeys-sentinel",
        ) => simba_redis::redact_url(url),
        #[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
        Some("sqlite" | "mysql" | "mariadb" | "postgres" | "postgresql") => {
            simba_jdbc::redact_url(url)
        }
        #[cfg(feature = "zookeeper")]
        Some("zk" | "zookeeper" | "zks" | "zookeeper+tls" | "zookeeper+ssl" | "zookeepers") => {
            simba_zookeeper::redact_url(url)
        }
        _ => simba_core::redact_url_with(url, simba_core::is_secret_key),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage_message(url: &str) -> String {
        let e = Target::parse(url).expect_err(url);
        assert_eq!(e.status, Status::Usage, "{url}");
        format!("{:#}", e.error)
    }

    #[test]
    fn parses_each_scheme() {
        assert_eq!(
            Target::parse("sqlite:///tmp/x.db").ok(),
            Some(Target::Sqlite(PathBuf::from("/tmp/x.db")))
        );
        assert_eq!(
            Target::parse("sqlite://rel/x.db").ok(),
            Some(Target::Sqlite(PathBuf::from("rel/x.db")))
        );
        assert!(matches!(
            Target::parse("redis://127.0.0.1:6379"),
            Ok(Target::Redis(_))
        ));
        assert!(matches!(
            Target::parse("mysql://root@h/db"),
            Ok(Target::Mysql(_))
        ));
        assert!(matches!(
            Target::parse("postgres://u@h/db"),
            Ok(Target::Postgres(_))
        ));
        assert_eq!(
            Target::parse("zk://a:2181,b:2181/apps").ok(),
            Some(Target::Zookeeper("zk://a:2181,b:2181/apps".into()))
        );
        // TLS schemes go to simba-zookeeper, which says why they cannot work.
        assert_eq!(
            Target::parse("zks://a:2281").ok(),
            Some(Target::Zookeeper("zks://a:2281".into()))
        );
    }

    #[test]
    fn bad_urls_name_the_supported_schemes() {
        let m = usage_message("ftp://x");
        assert!(
            m.contains("unknown scheme `ftp://`") && m.contains("redis://"),
            "{m}"
        );
        let m = usage_message("just-a-name");
        assert!(
            m.contains("not a URL") && m.contains("sqlite://PATH"),
            "{m}"
        );
        assert!(usage_message("sqlite://").contains("names no file"));
        assert!(usage_message("zk:///chroot").contains("names no server"));
    }

    #[test]
    fn tls_needs_its_feature() {
        if !cfg!(feature = "tls") {
            let m = usage_message("rediss://h:6380");
            assert!(m.contains("feature `tls`"), "{m}");
        }
    }

    #[test]
    fn terse_sqlite_file_errors_get_a_hint() {
        let path = Path::new("/srv/x.db");
        let hint = sqlite_hint("connect: … disk I/O error", path).expect("a hint");
        assert!(
            hint.contains("/srv/x.db") && hint.contains("writable"),
            "{hint}"
        );
        assert!(sqlite_hint("x: unable to open database file", path).is_some());
        assert!(sqlite_hint("no answer within 5s", path).is_none());
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("postgres://app:secret@db:5432/x"),
            "postgres://app:***@db:5432/x"
        );
        assert_eq!(redact("redis://h:6379"), "redis://h:6379");
        let m = usage_message("bogus://u:secret@h?token=secret");
        assert!(!m.contains("secret"), "{m}");
        for url in [
            "mysql://u@h/db?password=secret",
            "redis-sentinel://h:1/0?sentinelServiceName=m&sentinelPassword=secret",
            "zk://u:secret@h:2181/c",
        ] {
            assert!(!redact(url).contains("secret"), "{url}");
        }
    }
}
