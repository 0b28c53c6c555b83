//! One way in per backend: from a URL to a connected backend, for programs that pick the
//! backend at run time (a command-line tool, a service configured by one URL).
//!
//! Each backend crate implements [`Connector`] for its own URL schemes: it knows which
//! schemes are its own, how to check and redact them, and how to connect one. A
//! [`Connectors`] list holds the connectors a program was built with and sends each URL to
//! the one that owns its scheme:
//!
//! ```
//! use simba_core::connect::{ConnectOptions, Connectors};
//! # async fn run(connectors: Connectors) -> simba_core::Result<()> {
//! // let connectors = Connectors::new(vec![&simba_redis::CONNECTOR, &simba_jdbc::CONNECTOR]);
//! let url = "postgres://app:secret@db/jobs";
//! println!("using {}", connectors.redact(url)); // postgres://app:***@db/jobs
//! let backend = connectors.connect(url, &ConnectOptions::default()).await?;
//! let locker = simba_core::Locker::new(backend.factory(), "nightly-report")?;
//! # let _ = locker; Ok(()) }
//! ```
//!
//! What a [`Connection`] offers beyond its [`ContendServiceFactory`] is what a generic
//! tool needs without knowing the backend: what it can do ([`Capabilities`]), one read of a
//! mutex's owner where the backend has leases, and a [`Semaphore`] on the same backend
//! ([`Connection::open_semaphore`]).
//!
//! With the `bench` feature (measurement for `simba bench`; not for applications), a
//! connection also opens a probe of the bare round trips that `simba bench` compares every
//! figure to (`Probe`, `Floor`, `Connection::probe`). Without it, none of that code is
//! compiled, here or in a backend crate (each has a `bench` feature of its own).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::{BoxFuture, LeaseReply};
use crate::error::{Error, Result};
use crate::lease::LeaseConfig;
use crate::semaphore::Semaphore;
use crate::service::ContendServiceFactory;

/// A backend crate's URL schemes and how to connect them. Dyn-compatible: a program keeps
/// `&'static dyn Connector`s in a [`Connectors`] list.
pub trait Connector: Send + Sync + 'static {
    /// The backend family, as people write it (`"Redis"`, `"SQL"`, `"ZooKeeper"`).
    fn name(&self) -> &'static str;

    /// The URL schemes this connector owns, lower case, without `://` (`"redis"`,
    /// `"rediss-sentinel"`, …). Also those that need a crate feature that is off, or that
    /// the backend cannot serve at all: [`validate`](Connector::validate) then says which
    /// feature to enable or what to do instead, which no other connector could.
    fn schemes(&self) -> Vec<&'static str>;

    /// The URL forms, for help texts and error messages (`"redis://HOST[:PORT][/DB]"`).
    fn forms(&self) -> Vec<&'static str>;

    /// `url` with every secret it carries replaced by `***`, by this backend's rules (which
    /// query options and userinfo parts hold passwords). Never fails: a URL that does not
    /// parse is redacted by the common rule.
    fn redact(&self, url: &str) -> String;

    /// Checks `url` without connecting: scheme, syntax and options (a CA or key file the
    /// URL names may be read).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] saying what is wrong and how to write it instead.
    fn validate(&self, url: &str) -> Result<()>;

    /// Connects to `url` (which must be one of [`schemes`](Connector::schemes)) with
    /// `options`, and checks that the backend answers. Checks `url` as
    /// [`validate`](Connector::validate) does first: callers need not.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a bad URL or options (before any I/O);
    /// [`Error::Backend`] if the backend cannot be reached or refuses the connection.
    ///
    /// # Cancel safety
    /// Dropping the future closes whatever it had opened.
    fn connect<'a>(
        &'a self,
        url: &'a str,
        options: &'a ConnectOptions,
    ) -> BoxFuture<'a, Result<Box<dyn Connection>>>;
}

/// How to connect, beyond the URL.
#[derive(Debug, Clone, Default)]
pub struct ConnectOptions {
    lease: LeaseConfig,
    session_timeout: Option<Duration>,
    connect_timeout: Option<Duration>,
}

impl ConnectOptions {
    /// The backend's defaults: [`LeaseConfig::default`] on lease backends, the backend's
    /// own session timeout on session backends.
    pub fn new() -> Self {
        Self::default()
    }

    /// Chooses the lease timing. It also sets the [session
    /// timeout](ConnectOptions::with_session_timeout) to `ttl + transition`, so that a
    /// silent owner keeps the mutex as long on a session backend (ZooKeeper) as on a lease
    /// backend.
    #[must_use]
    pub fn with_lease(mut self, lease: LeaseConfig) -> Self {
        self.session_timeout = Some(lease.ttl + lease.transition);
        self.lease = lease;
        self
    }

    /// Chooses how often a waiter or an observer looks again where the backend cannot
    /// push to it ([`LeaseConfig::waiter_poll`]), leaving the rest of the timing alone.
    #[must_use]
    pub fn with_waiter_poll(mut self, poll: Duration) -> Self {
        self.lease.waiter_poll = Some(poll);
        self
    }

    /// On session backends, how long a silent owner keeps the mutex (the session
    /// timeout); lease backends take [`with_lease`](ConnectOptions::with_lease) instead.
    #[must_use]
    pub fn with_session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = Some(timeout);
        self
    }

    /// Bounds the first connection (the backend's own default otherwise).
    #[must_use]
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = Some(timeout);
        self
    }

    /// The lease timing (lease backends).
    pub fn lease(&self) -> &LeaseConfig {
        &self.lease
    }

    /// The session timeout chosen, if any (session backends).
    pub fn session_timeout(&self) -> Option<Duration> {
        self.session_timeout
    }

    /// The bound of the first connection, if one was chosen.
    pub fn connect_timeout(&self) -> Option<Duration> {
        self.connect_timeout
    }
}

/// How a backend keeps an ownership.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ownership {
    /// A lease with an end time on the backend's clock, renewed by the owner (Redis, SQL).
    Lease,
    /// As long as the owner's session lives (ZooKeeper).
    Session,
}

/// What a connected backend can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Lease or session.
    pub ownership: Ownership,
    /// Whether waiters are woken by the backend when the mutex is freed (pub/sub, a lock
    /// queue, a watch); `false`: they look again at the lease's pace.
    pub pushes_to_waiters: bool,
    /// Whether observers are told of owner changes by the backend; `false`: they read at
    /// a bounded interval.
    pub pushes_to_observers: bool,
}

impl Capabilities {
    /// A capability set.
    pub fn new(ownership: Ownership, pushes_to_waiters: bool, pushes_to_observers: bool) -> Self {
        Capabilities {
            ownership,
            pushes_to_waiters,
            pushes_to_observers,
        }
    }

    /// Whether a released mutex can be kept held for a while (hold-at-least): only a
    /// lease can outlive its owner's release.
    pub fn holds(&self) -> bool {
        self.ownership == Ownership::Lease
    }
}

/// A connected backend: its service factory and what a generic tool asks of it.
pub trait Connection: Send + Sync + fmt::Debug {
    /// The factory of contend and retrieval services on this connection.
    fn factory(&self) -> Arc<dyn ContendServiceFactory>;

    /// What this backend can do.
    fn capabilities(&self) -> Capabilities;

    /// Reads `mutex`'s owner and the backend's clock with one call, on lease backends;
    /// `None` on session backends, whose owner is observed with a
    /// [`RetrievalService`](crate::RetrievalService) instead.
    fn read_owner<'a>(&'a self, mutex: &'a str) -> Option<BoxFuture<'a, Result<LeaseReply>>>;

    /// The semaphore `name` of `permits` permits on this backend, on this connection's
    /// store or session and with its timing: the lease of the [`ConnectOptions`] on lease
    /// backends; on session backends (ZooKeeper) the permits last as long as the session
    /// allows, whose timeout the options chose. The semaphore keeps what it needs of the
    /// connection: it works after the connection is dropped.
    ///
    /// The default, for backends without semaphores, is [`Error::Unsupported`].
    ///
    /// # Errors
    /// [`Error::Unsupported`] where the backend has no semaphores; as
    /// [`Semaphore::new`] for zero permits or a bad name.
    ///
    /// # Cancel safety
    /// Dropping the future leaves nothing behind: a semaphore takes no permit until asked.
    fn open_semaphore<'a>(
        &'a self,
        name: &'a str,
        permits: u32,
    ) -> BoxFuture<'a, Result<Semaphore>> {
        let _ = (name, permits);
        Box::pin(async {
            Err(Error::unsupported(
                "simba",
                "semaphores",
                "this backend has no semaphores",
            ))
        })
    }

    /// Opens the read-write lock `name` ([`RwLock`](crate::RwLock)): a mutex of
    /// [`Connection::factory`] as its gate and this connection's semaphore of the same
    /// name ([`Connection::open_semaphore`], [`MAX_READERS`](crate::MAX_READERS) permits)
    /// for its readers. Every backend with semaphores has read-write locks.
    ///
    /// # Errors
    /// As [`Connection::open_semaphore`] ([`Error::Unsupported`] where the backend has no
    /// semaphores) and [`Locker::new`](crate::Locker::new).
    ///
    /// # Cancel safety
    /// Dropping the future leaves nothing behind: the lock takes nothing until asked.
    fn open_rwlock<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<crate::RwLock>> {
        Box::pin(async move {
            let readers = self.open_semaphore(name, crate::MAX_READERS).await?;
            let gate = crate::Locker::new(self.factory(), name)?;
            crate::RwLock::new(gate, readers)
        })
    }

    /// Opens a probe of this backend's bare round trips, on connections of the kind the
    /// services use. `name` is a unique token for any key or channel the probe needs
    /// (under the store's own prefix).
    ///
    /// Only with the `bench` feature. The default ([`Error::Unsupported`]) is what a
    /// backend crate built without its own `bench` feature answers.
    ///
    /// # Errors
    /// [`Error::Backend`] if the probe's connection or subscription cannot be made;
    /// [`Error::Unsupported`] where the backend measures no floors.
    #[cfg(feature = "bench")]
    #[cfg_attr(docsrs, doc(cfg(feature = "bench")))]
    fn probe<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Box<dyn Probe>>> {
        let _ = name;
        Box::pin(async {
            Err(Error::unsupported(
                "simba",
                "probe",
                "no floors: the backend crate was built without its `bench` feature",
            ))
        })
    }

    /// The connections this factory opens, by its configuration
    /// (`"1 command + 1 subscriber connection"`, `"pool of at most 10 + 1 LISTEN"`).
    fn connections(&self) -> String;

    /// How many client connections the server has now, where it can say (Redis's `CLIENT
    /// LIST`); `None` elsewhere or when the read fails.
    fn server_connections(&self) -> BoxFuture<'_, Option<usize>> {
        Box::pin(async { None })
    }

    /// What proves to other processes that `contender_id` of this process still owns
    /// `mutex`, where the backend has such a proof on this machine: SQLite's native lock,
    /// which the kernel frees only when the last descriptor of its open file description
    /// is closed. A process given a copy (the `simba exec` guardian, by `SCM_RIGHTS` of
    /// [`Anchor::as_fd`](std::os::fd::AsFd::as_fd)) keeps the owner alive in other
    /// contenders' eyes for as long as it lives, so a takeover "at once, the owner is dead"
    /// waits for it too. The descriptor is close-on-exec. Dropping the [`Anchor`] closes
    /// nothing (on Linux it is a descriptor of the database file, whose close would drop
    /// this process's SQLite locks); the lock it anchors is kept until the process ends.
    ///
    /// `Ok(None)` when the backend proves liveness by a lease or a session instead (every
    /// backend but SQLite), or when this process does not hold that proof for the
    /// contender now.
    ///
    /// # Errors
    /// The descriptor could not be duplicated (the process is out of descriptors).
    #[cfg(unix)]
    fn owner_anchor(&self, mutex: &str, contender_id: &str) -> std::io::Result<Option<Anchor>> {
        let _ = (mutex, contender_id);
        Ok(None)
    }

    /// How long an acquisition of a free mutex made now, with this connection's lease,
    /// would be held back by the backend's restart quarantine (simba-redis: a server whose
    /// data is new — first use, a restart without persistence, a flush — keeps free
    /// mutexes from everyone for one lease, in case an owner from before still runs).
    /// `None` when there is none now, when the backend has no such thing (the default), or
    /// when it cannot be read.
    fn restart_quarantine(&self) -> BoxFuture<'_, Option<Duration>> {
        Box::pin(async { None })
    }
}

/// A descriptor shared with the backend that gave it ([`Connection::owner_anchor`]):
/// dropping an anchor never closes the descriptor while the backend uses it.
#[cfg(unix)]
#[derive(Clone)]
pub struct Anchor {
    fd: std::sync::Arc<dyn std::os::fd::AsFd + Send + Sync>,
    job_byte: Option<u64>,
}

#[cfg(unix)]
impl Anchor {
    /// An anchor of the descriptor `fd` holds.
    pub fn new(fd: std::sync::Arc<dyn std::os::fd::AsFd + Send + Sync>) -> Self {
        Anchor { fd, job_byte: None }
    }

    /// The same anchor, with the byte of its file that the owner's *job* locks.
    ///
    /// A process that runs a job for the owner (`simba exec`'s command) opens the file
    /// anew (its own open file description), write-locks this byte with an OFD lock
    /// (`F_OFD_SETLK`), and hands that description only to the job's processes. While
    /// any of them lives, the backend lets nobody take the owner's place, not even after
    /// its lease has run out (simba-jdbc's SQLite: the byte is probed before such a
    /// takeover). The owner's own process never holds it: a stopped owner alone does not
    /// keep the mutex past its lease, a running job does.
    #[must_use]
    pub fn with_job_byte(mut self, offset: u64) -> Self {
        self.job_byte = Some(offset);
        self
    }

    /// The byte a job of the owner locks (see [`Anchor::with_job_byte`]); `None` when the
    /// backend has none.
    pub fn job_byte(&self) -> Option<u64> {
        self.job_byte
    }
}

#[cfg(unix)]
impl std::os::fd::AsFd for Anchor {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(unix)]
impl std::fmt::Debug for Anchor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use std::os::fd::AsRawFd;
        f.debug_struct("Anchor")
            .field("fd", &self.fd.as_fd().as_raw_fd())
            .field("job_byte", &self.job_byte)
            .finish()
    }
}

/// A bare backend operation that a mutex operation is compared to.
///
/// Only with the `bench` feature: measurement for `simba bench`, not for applications.
#[cfg(feature = "bench")]
#[cfg_attr(docsrs, doc(cfg(feature = "bench")))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Floor {
    /// One round trip (`PING`, `SELECT 1`, ZooKeeper `exists`).
    RoundTrip,
    /// A message published on one connection until delivered on the subscriber one.
    PubSub,
    /// The lock a script-less client would take: set-if-absent with an expiry, then delete.
    RawLock,
    /// The backend's own wait queue handing a lock over between two sessions: from the
    /// holder's release being answered until the waiter's lock call is answered
    /// ([`Probe::handoff`]).
    Handoff,
}

/// Measures a backend's floors (see [`Connection::probe`]).
///
/// Only with the `bench` feature: measurement for `simba bench`, not for applications.
#[cfg(feature = "bench")]
#[cfg_attr(docsrs, doc(cfg(feature = "bench")))]
pub trait Probe: Send {
    /// What one [`Floor::RoundTrip`] is on this backend (`"PING"`, `"SELECT 1"`, `"exists"`).
    fn round_trip_name(&self) -> &'static str;

    /// The floors this probe measures; [`Floor::RoundTrip`] always.
    fn floors(&self) -> Vec<Floor>;

    /// Performs `floor` once, giving up after `limit` ([`Floor::Handoff`]: one handoff,
    /// which [`handoff`](Probe::handoff) times without its setup).
    ///
    /// # Errors
    /// [`Error::Backend`] if the operation fails or takes longer than `limit`;
    /// [`Error::Unsupported`] for a floor not in [`floors`](Probe::floors).
    fn measure(&mut self, floor: Floor, limit: Duration) -> BoxFuture<'_, Result<()>>;

    /// What the [`Floor::Handoff`] of this backend is (`"watch on a deleted node + create"`).
    fn handoff_name(&self) -> &'static str {
        ""
    }

    /// One [`Floor::Handoff`]: one session holds the backend's native lock, a second one
    /// waits for it in the backend's own queue, the first releases. Returns the time from
    /// the release being answered until the waiter's lock call is answered (the setup is
    /// not timed).
    ///
    /// # Errors
    /// [`Error::Backend`] if a call fails or the handoff takes longer than `limit`;
    /// [`Error::Unsupported`] where [`floors`](Probe::floors) has no [`Floor::Handoff`].
    fn handoff(&mut self, limit: Duration) -> BoxFuture<'_, Result<Duration>> {
        let _ = limit;
        Box::pin(async { Err(unsupported_floor("this backend", Floor::Handoff)) })
    }

    /// Closes the probe's connections.
    ///
    /// # Errors
    /// [`Error::Backend`] if closing failed; nothing is left behind the probe's own key or
    /// channel.
    fn close(self: Box<Self>) -> BoxFuture<'static, Result<()>> {
        Box::pin(async { Ok(()) })
    }

    /// The settings that decide what a write waits for before the server answers (does a
    /// commit reach the disk?), as `(name, value)` pairs read from the server where it can
    /// say (`fsync`, `synchronous_commit`, `appendfsync`, …), so that a figure is read
    /// beside them. Empty (the default) where the backend does not report them.
    ///
    /// # Errors
    /// [`Error::Backend`] if the server refused or did not answer the read.
    fn durability(&mut self) -> BoxFuture<'_, Result<Vec<(String, String)>>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

/// The error for a floor a probe does not measure.
#[cfg(feature = "bench")]
#[cfg_attr(docsrs, doc(cfg(feature = "bench")))]
pub fn unsupported_floor(backend: &'static str, floor: Floor) -> Error {
    Error::unsupported(
        backend,
        "floor",
        format!("{floor:?} is not measured on this backend"),
    )
}

/// The connectors a program was built with; sends each URL to the one that owns its scheme.
#[derive(Clone)]
pub struct Connectors {
    list: Vec<&'static dyn Connector>,
}

impl fmt::Debug for Connectors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.list.iter().map(|c| c.name()))
            .finish()
    }
}

impl Connectors {
    /// A list of connectors. When two own the same scheme, the first wins.
    pub fn new(list: Vec<&'static dyn Connector>) -> Self {
        Connectors { list }
    }

    /// The connectors, in order.
    pub fn list(&self) -> &[&'static dyn Connector] {
        &self.list
    }

    /// Every URL form of every connector, for messages (`"none"` for an empty list).
    pub fn forms(&self) -> String {
        let forms: Vec<&str> = self.list.iter().flat_map(|c| c.forms()).collect();
        if forms.is_empty() {
            "none".to_owned()
        } else {
            forms.join(", ")
        }
    }

    /// The connector that owns `url`'s scheme.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] (field `backend URL`) when `url` has no scheme or no
    /// connector owns it; the message lists the URL forms that work.
    pub fn find(&self, url: &str) -> Result<&'static dyn Connector> {
        let Some(scheme) = scheme_of(url) else {
            return Err(Error::config(
                "backend URL",
                format!(
                    "`{}` is not a URL; use one of: {}",
                    self.redact(url),
                    self.forms()
                ),
            ));
        };
        self.owner_of(&scheme).ok_or_else(|| {
            Error::config(
                "backend URL",
                format!(
                    "`{}`: unknown scheme `{scheme}://`; use one of: {}",
                    self.redact(url),
                    self.forms()
                ),
            )
        })
    }

    fn owner_of(&self, scheme: &str) -> Option<&'static dyn Connector> {
        self.list
            .iter()
            .copied()
            .find(|c| c.schemes().contains(&scheme))
    }

    /// `url` redacted by its connector's rules, or by the common rule
    /// ([`redact_url_with`](crate::redact_url_with) with [`is_secret_key`](crate::is_secret_key))
    /// when no connector owns it.
    pub fn redact(&self, url: &str) -> String {
        match scheme_of(url).and_then(|s| self.owner_of(&s)) {
            Some(c) => c.redact(url),
            None => crate::redact_url_with(url, crate::is_secret_key),
        }
    }

    /// Checks `url` without connecting ([`Connector::validate`] of its connector).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] as [`find`](Connectors::find) and the connector say.
    pub fn validate(&self, url: &str) -> Result<()> {
        self.find(url)?.validate(url.trim())
    }

    /// Connects `url` through its connector (which checks it before any I/O).
    ///
    /// # Errors
    /// As [`find`](Connectors::find) and [`Connector::connect`].
    ///
    /// # Cancel safety
    /// As [`Connector::connect`].
    pub async fn connect(
        &self,
        url: &str,
        options: &ConnectOptions,
    ) -> Result<Box<dyn Connection>> {
        self.find(url)?.connect(url.trim(), options).await
    }
}

/// The lower-cased scheme of `url`, if it has one.
pub fn scheme_of(url: &str) -> Option<String> {
    let (scheme, _) = url.trim().split_once("://")?;
    let ok = !scheme.is_empty()
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    ok.then(|| scheme.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::LeaseStore;
    use crate::{LeaseServiceFactory, MemoryStore};

    /// A connector of `mem://NAME` URLs onto in-memory stores, with a secret option.
    struct Mem;

    #[derive(Debug)]
    struct MemConnection(Arc<LeaseServiceFactory<MemoryStore>>);

    impl Connector for Mem {
        fn name(&self) -> &'static str {
            "memory"
        }
        fn schemes(&self) -> Vec<&'static str> {
            vec!["mem", "memory"]
        }
        fn forms(&self) -> Vec<&'static str> {
            vec!["mem://NAME"]
        }
        fn redact(&self, url: &str) -> String {
            crate::redact_url_with(url, |k| k == "key")
        }
        fn validate(&self, url: &str) -> Result<()> {
            match url.split_once("://") {
                Some((_, rest)) if !rest.is_empty() => Ok(()),
                _ => Err(Error::config("backend URL", "mem:// needs a name")),
            }
        }
        fn connect<'a>(
            &'a self,
            url: &'a str,
            options: &'a ConnectOptions,
        ) -> BoxFuture<'a, Result<Box<dyn Connection>>> {
            Box::pin(async move {
                self.validate(url)?;
                let f = LeaseServiceFactory::new(MemoryStore::new(), options.lease().clone())?;
                Ok(Box::new(MemConnection(Arc::new(f))) as Box<dyn Connection>)
            })
        }
    }

    impl Connection for MemConnection {
        fn factory(&self) -> Arc<dyn ContendServiceFactory> {
            self.0.clone()
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::new(Ownership::Lease, true, true)
        }
        fn read_owner<'a>(&'a self, mutex: &'a str) -> Option<BoxFuture<'a, Result<LeaseReply>>> {
            Some(Box::pin(self.0.store().owner(mutex)))
        }
        fn open_semaphore<'a>(
            &'a self,
            name: &'a str,
            permits: u32,
        ) -> BoxFuture<'a, Result<crate::Semaphore>> {
            Box::pin(async move { crate::Semaphore::from_factory(&self.0, name, permits) })
        }
        fn connections(&self) -> String {
            "none".into()
        }
    }

    /// A connection that keeps every default of the trait.
    #[derive(Debug)]
    struct Defaults(MemConnection);

    impl Connection for Defaults {
        fn factory(&self) -> Arc<dyn ContendServiceFactory> {
            self.0.factory()
        }
        fn capabilities(&self) -> Capabilities {
            self.0.capabilities()
        }
        fn read_owner<'a>(&'a self, mutex: &'a str) -> Option<BoxFuture<'a, Result<LeaseReply>>> {
            self.0.read_owner(mutex)
        }
        fn connections(&self) -> String {
            self.0.connections()
        }
    }

    static MEM: Mem = Mem;

    fn connectors() -> Connectors {
        Connectors::new(vec![&MEM])
    }

    #[test]
    fn urls_go_to_the_connector_of_their_scheme() {
        let c = connectors();
        assert_eq!(c.find("MEM://x").map(|c| c.name()).ok(), Some("memory"));
        assert_eq!(
            c.find(" memory://x ").map(|c| c.name()).ok(),
            Some("memory")
        );
        let e = c.find("ftp://u:secret@h").err().map(|e| e.to_string());
        let e = e.unwrap_or_default();
        assert!(
            e.contains("unknown scheme `ftp://`") && e.contains("mem://NAME"),
            "{e}"
        );
        assert!(!e.contains("secret"), "{e}");
        let e = c.find("just-a-name").err().map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("not a URL")));
        assert!(c.validate("mem://").is_err());
        assert!(c.validate("mem://a").is_ok());
    }

    #[test]
    fn redaction_uses_the_owner_rules_or_the_common_one() {
        let c = connectors();
        assert_eq!(c.redact("mem://a?key=k&token=t"), "mem://a?key=***&token=t");
        assert_eq!(c.redact("ftp://h?token=t"), "ftp://h?token=***");
        assert_eq!(Connectors::new(vec![]).forms(), "none");
    }

    #[tokio::test]
    async fn connect_gives_a_working_factory_and_an_owner_read() {
        let c = connectors();
        let lease = LeaseConfig::with_lease(Duration::from_secs(5), Duration::from_secs(1));
        let conn = c
            .connect("mem://a", &ConnectOptions::new().with_lease(lease))
            .await
            .expect("connects");
        assert_eq!(conn.capabilities().ownership, Ownership::Lease);
        assert!(conn.capabilities().holds());
        let locker = crate::Locker::new(conn.factory(), "m").expect("locker");
        let _guard = locker
            .acquire_timeout(Duration::from_secs(5))
            .await
            .expect("acquired");
        let reply = conn.read_owner("m").expect("a lease backend reads").await;
        let reply = reply.expect("read");
        assert!(reply.owner.is_in_lease(reply.now), "{reply:?}");
        assert!(matches!(
            c.connect("nope://x", &ConnectOptions::new()).await,
            Err(Error::InvalidConfig { .. })
        ));
        // The connector checks the URL itself.
        assert!(matches!(
            c.connect("mem://", &ConnectOptions::new()).await,
            Err(Error::InvalidConfig { .. })
        ));
    }

    #[tokio::test]
    async fn a_semaphore_opens_where_the_backend_has_one_and_is_refused_elsewhere() {
        let factory =
            LeaseServiceFactory::new(MemoryStore::new(), LeaseConfig::default()).expect("factory");
        let conn = MemConnection(Arc::new(factory));
        let sem = conn.open_semaphore("s", 1).await.expect("a semaphore");
        assert_eq!((sem.name(), sem.permits()), ("s", 1));
        let permit = sem.try_acquire().await.expect("the one permit");
        let second = conn.open_semaphore("s", 1).await.expect("a semaphore");
        assert!(matches!(
            second.try_acquire().await,
            Err(Error::WouldBlock { .. })
        ));
        permit.release().await.expect("released");
        assert!(second.try_acquire().await.is_ok());
        assert!(matches!(
            conn.open_semaphore("s", 0).await,
            Err(Error::InvalidConfig { .. })
        ));

        let bare = Defaults(conn);
        match bare.open_semaphore("s", 1).await {
            Err(Error::Unsupported { what, .. }) => assert_eq!(what, "semaphores"),
            other => panic!("{:?}", other.map(|s| s.name().to_owned())),
        }
        #[cfg(feature = "bench")]
        assert!(matches!(
            bare.probe("p").await.map(|_| ()),
            Err(Error::Unsupported { what: "probe", .. })
        ));
    }

    #[test]
    fn schemes_are_read_only_from_urls() {
        assert_eq!(scheme_of("Zk+TLS://h"), Some("zk+tls".into()));
        assert_eq!(scheme_of("no scheme"), None);
        assert_eq!(scheme_of("://h"), None);
        assert_eq!(scheme_of("a b://h"), None);
    }
}
