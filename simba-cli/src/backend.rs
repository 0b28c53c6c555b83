//! From a backend URL to a connected backend, through the connector of the backend crate
//! that owns the URL's scheme (`simba_core::connect`): `simba` itself knows only which
//! backends are compiled in, and which cargo feature brings which scheme.
//!
//! | URL | backend | cargo feature |
//! |---|---|---|
//! | `sqlite://PATH` | SQLite file (the default lives in the user's state directory) | `sqlite` |
//! | `redis://HOST[:PORT][/DB]` | Redis / Valkey | `redis` |
//! | `rediss://…` | Redis over TLS | `tls` |
//! | `mysql://USER:PASS@HOST[:PORT]/DB` | MySQL / MariaDB | `mysql` |
//! | `postgres://USER:PASS@HOST[:PORT]/DB` | PostgreSQL | `postgres` |
//! | `zk://[USER:PASS@]HOST:PORT[,HOST:PORT…][/CHROOT]` | ZooKeeper (a userinfo is digest auth) | `zookeeper` |
//! | `etcd://[USER:PASS@]HOST:PORT[,HOST:PORT…][/PREFIX]` | etcd v3 (a userinfo is etcd auth) | `etcd` |

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use simba_core::connect::{
    ConnectOptions, Connection, Connector, Connectors, Ownership, scheme_of,
};
use simba_core::{ContendServiceFactory, LeaseConfig};

use crate::status::{Failure, Status};

/// How long `simba` tries to reach a backend before it gives up (ZooKeeper's library
/// default is 10 s; Redis's is this).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The backends compiled into this binary: the only per-backend list in `simba`. Each
/// backend crate's connector owns its URL schemes, checks, redacts and connects them.
fn compiled_in() -> Vec<&'static dyn Connector> {
    vec![
        #[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
        &simba_jdbc::CONNECTOR,
        #[cfg(feature = "redis")]
        &simba_redis::CONNECTOR,
        #[cfg(feature = "zookeeper")]
        &simba_zookeeper::CONNECTOR,
        #[cfg(feature = "etcd")]
        &simba_etcd::CONNECTOR,
    ]
}

/// This binary's cargo features and the URL schemes each brings, to name the feature to
/// rebuild with when a URL needs one that is off.
const FEATURES: &[(&str, &[&str], bool)] = &[
    ("sqlite", &["sqlite"], cfg!(feature = "sqlite")),
    ("mysql", &["mysql", "mariadb"], cfg!(feature = "mysql")),
    (
        "postgres",
        &["postgres", "postgresql"],
        cfg!(feature = "postgres"),
    ),
    (
        "redis",
        &[
            "redis",
            "valkey",
            "redis-cluster",
            "valkey-cluster",
            "redis-sentinel",
            "valkey-sentinel",
        ],
        cfg!(feature = "redis"),
    ),
    (
        "tls",
        &[
            "rediss",
            "valkeys",
            "rediss-cluster",
            "valkeys-cluster",
            "rediss-sentinel",
            "valkeys-sentinel",
        ],
        cfg!(feature = "tls"),
    ),
    (
        "zookeeper",
        &[
            "zk",
            "zookeeper",
            "zks",
            "zookeeper+tls",
            "zookeeper+ssl",
            "zookeepers",
        ],
        cfg!(feature = "zookeeper"),
    ),
    (
        "etcd",
        &["etcd", "etcds", "etcd+tls"],
        cfg!(feature = "etcd"),
    ),
];

/// The connectors of this binary.
pub(crate) fn connectors() -> Connectors {
    Connectors::new(compiled_in())
}

/// The URL forms this binary understands, for messages.
pub(crate) fn supported() -> String {
    let forms = connectors().forms();
    if compiled_in().is_empty() {
        "none (this simba was built without any backend feature)".to_owned()
    } else {
        forms
    }
}

/// The connector of `url`'s scheme: a scheme of a feature this binary lacks names the
/// feature, an unknown one lists what works (usage errors). The rest of the URL is the
/// connector's to judge when it connects.
pub(crate) fn check(url: &str) -> Result<&'static dyn Connector, Failure> {
    if let Some(scheme) = scheme_of(url)
        && let Some((feature, ..)) = FEATURES
            .iter()
            .find(|(_, schemes, on)| !on && schemes.contains(&scheme.as_str()))
    {
        return Err(Failure::usage(format!(
            "backend `{}` needs the cargo feature `{feature}`, which this simba was built \
             without; rebuild with `cargo install simba-cli --features {feature}` (compiled \
             in: {})",
            redact(url),
            supported()
        )));
    }
    connectors()
        .find(url)
        .map_err(|e| Failure::simba(e, "bad backend URL"))
}

/// A connected backend.
pub(crate) struct Backend {
    /// The URL, secrets redacted.
    pub(crate) shown: String,
    /// The connection its connector made.
    pub(crate) conn: Arc<dyn Connection>,
}

/// How long the restart-quarantine read may take before it is given up (it only informs).
const QUARANTINE_READ: Duration = Duration::from_secs(2);

impl Backend {
    /// Says on stderr (one line, at every verbosity) when the backend's restart quarantine
    /// holds free mutexes back now (simba-redis: a server whose data is new), for how long
    /// at most and why; `then` says what it means for the command run.
    pub(crate) async fn announce_quarantine(&self, then: &str) {
        let read = tokio::time::timeout(QUARANTINE_READ, self.conn.restart_quarantine()).await;
        if let Ok(Some(left)) = read {
            say!(
                "simba: the data of {} is new (first use, a restart without persistence, a \
                 flush): nobody takes a free mutex for up to {} more, in case an owner from \
                 before still runs (restart quarantine); {then}",
                self.shown,
                crate::duration::show(left)
            );
        }
    }

    /// The factory of contend and retrieval services.
    /// The failure of opening a semaphore or a read-write lock for `flag` (`--permits`,
    /// `--read`…): a usage error on a backend without semaphores, else `cannot open {what}`.
    pub(crate) fn open_failed(&self, e: simba_core::Error, flag: &str, what: String) -> Failure {
        match e {
            simba_core::Error::Unsupported { .. } => Failure::simba(
                e,
                format!(
                    "{flag} needs a backend with semaphores, and backend {} has none (use \
                     another backend, or drop {flag} for a plain mutex)",
                    self.shown
                ),
            ),
            _ => Failure::simba(e, format!("cannot open {what}")),
        }
    }

    pub(crate) fn factory(&self) -> Arc<dyn ContendServiceFactory> {
        self.conn.factory()
    }

    /// Whether waiters cannot be woken by the backend, so that they poll (no backend
    /// today).
    pub(crate) fn polls(&self) -> bool {
        !self.conn.capabilities().pushes_to_waiters
    }

    /// Whether the backend has leases (and so one-call owner reads).
    pub(crate) fn has_leases(&self) -> bool {
        self.conn.capabilities().ownership == Ownership::Lease
    }
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend")
            .field("url", &self.shown)
            .field("connection", &self.conn)
            .finish_non_exhaustive()
    }
}

/// The lease options given on the command line (`--ttl`, `--transition`, …).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LeaseArgs {
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

impl LeaseArgs {
    /// The connect options of this timing: a chosen ttl or transition sets the lease (and
    /// a session backend's session timeout); a poll alone leaves the rest to the backend.
    pub(crate) fn options(self) -> ConnectOptions {
        let mut options = ConnectOptions::new().with_connect_timeout(CONNECT_TIMEOUT);
        if self.ttl.is_some() || self.transition.is_some() || self.jitter.is_some() {
            let d = LeaseConfig::default();
            let mut lease = LeaseConfig::with_lease(
                self.ttl.unwrap_or(d.ttl),
                self.transition.unwrap_or(d.transition),
            );
            if let Some((start, end)) = self.jitter {
                lease.jitter = start..end;
                lease.jitter_no_transition = start..end;
            }
            options = options.with_lease(lease);
        }
        if let Some(poll) = self.waiter_poll {
            options = options.with_waiter_poll(poll);
        }
        options
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
pub(crate) async fn connect(url: &str, timing: LeaseArgs) -> Result<Backend, Failure> {
    let connector = check(url)?;
    let shown = redact(url);
    let options = timing.options();
    options
        .lease()
        .validate()
        .map_err(|e| Failure::simba(e, "bad lease timing"))?;
    let conn: Arc<dyn Connection> = connector
        .connect(url.trim(), &options)
        .await
        .map_err(|e| Failure::simba(e, format!("cannot use backend {shown}")))?
        .into();
    Ok(Backend { shown, conn })
}

/// `url` with its secrets replaced by `***`, by the rules of the backend crate that parses
/// it (each knows where its URL forms carry passwords); a URL of no compiled-in backend gets
/// the common rule of `simba-core`.
pub(crate) fn redact(url: &str) -> String {
    connectors().redact(url.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `simba` says of `url` before connecting: its own routing, then the
    /// connector's check (which `connect` makes first).
    fn usage_message(url: &str) -> String {
        let e = check(url)
            .and_then(|c| {
                c.validate(url)
                    .map_err(|e| Failure::simba(e, "cannot use backend"))
            })
            .expect_err(url);
        assert_eq!(e.status, Status::Usage, "{url}");
        format!("{:#}", e.error)
    }

    #[test]
    fn each_scheme_goes_to_its_connector() {
        let name = |url: &str| check(url).map(|c| c.name()).ok();
        if cfg!(feature = "sqlite") {
            assert_eq!(name("sqlite:///tmp/x.db"), Some("SQL"));
        }
        if cfg!(feature = "mysql") {
            assert_eq!(name("mysql://root@h/db"), Some("SQL"));
        }
        if cfg!(feature = "postgres") {
            assert_eq!(name("postgres://u@h/db"), Some("SQL"));
        }
        if cfg!(feature = "redis") {
            assert_eq!(name("redis://127.0.0.1:6379"), Some("Redis"));
        }
        if cfg!(feature = "zookeeper") {
            assert_eq!(name("zk://a:2181,b:2181/apps"), Some("ZooKeeper"));
            // TLS spellings go to simba-zookeeper, which says why they cannot work.
            assert!(usage_message("zks://a:2281").contains("tunnel"));
        }
    }

    #[test]
    fn bad_urls_name_the_supported_schemes() {
        let m = usage_message("ftp://x");
        assert!(m.contains("unknown scheme `ftp://`"), "{m}");
        let m = usage_message("just-a-name");
        assert!(m.contains("not a URL"), "{m}");
        if cfg!(feature = "sqlite") {
            assert!(m.contains("sqlite://PATH"), "{m}");
            assert!(usage_message("sqlite://").contains("names no SQLite file"));
        }
        if cfg!(feature = "zookeeper") {
            let m = usage_message("zk:///chroot");
            assert!(m.contains("empty host") && m.contains("host:port"), "{m}");
        }
    }

    #[test]
    fn a_scheme_of_a_missing_feature_names_it() {
        for (feature, schemes, on) in FEATURES {
            if !on {
                let m = usage_message(&format!("{}://h:1", schemes[0]));
                assert!(m.contains(&format!("feature `{feature}`")), "{m}");
            }
        }
    }

    #[test]
    fn passwords_are_redacted() {
        if cfg!(feature = "postgres") {
            assert_eq!(
                redact("postgres://app:secret@db:5432/x"),
                "postgres://app:***@db:5432/x"
            );
        }
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

    #[test]
    fn timing_sets_the_lease_only_when_chosen() {
        let poll = LeaseArgs {
            waiter_poll: Some(Duration::from_millis(50)),
            ..LeaseArgs::default()
        }
        .options();
        assert_eq!(poll.session_timeout(), None);
        assert_eq!(poll.lease().waiter_poll, Some(Duration::from_millis(50)));
        let chosen = LeaseArgs {
            ttl: Some(Duration::from_secs(8)),
            transition: Some(Duration::from_secs(2)),
            ..LeaseArgs::default()
        }
        .options();
        assert_eq!(chosen.session_timeout(), Some(Duration::from_secs(10)));
        assert_eq!(chosen.lease().ttl, Duration::from_secs(8));
        assert_eq!(chosen.connect_timeout(), Some(CONNECT_TIMEOUT));
    }
}
