//! [`RedisConfig`]: where the server is and how to talk to it.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use fred::types::config::{Config as FredConfig, ServerConfig};
use simba_core::{Error, Result, validate_duration};

/// The default key prefix, as in the JVM Simba: keys are `simba:{mutex}`, ….
pub const DEFAULT_KEY_PREFIX: &str = "simba";

/// How long an acquisition or renewal waits for its replicas unless told otherwise.
pub const DEFAULT_REPLICA_ACK_TIMEOUT: Duration = Duration::from_millis(500);

/// The longest key prefix accepted (bytes).
pub const MAX_KEY_PREFIX_LEN: usize = 64;

/// How a waiting contender learns that the mutex was released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WaitMode {
    /// Pub/sub: the releasing owner hands the mutex to the longest live waiter with a
    /// message on that waiter's channel, so it owns within about one round trip. One
    /// subscriber connection per [`RedisStore`](crate::RedisStore) serves all its mutexes.
    #[default]
    PubSub,
    /// Polling: no subscriber connection; waiters try again when the owner's lease ends
    /// (the contend period). Use it where pub/sub is unavailable or unwanted.
    Polling,
}

/// Configuration of a [`RedisStore`](crate::RedisStore).
///
/// Timing of the leases (ttl, transition) is not here: it belongs to
/// [`simba_core::LeaseConfig`]. Build one with [`RedisConfig::new`] and the `with_*`
/// methods, or set the public fields.
///
/// # URLs
/// - `redis://[[user]:password@]host[:port][/db]`, and `valkey://`;
/// - `rediss://…` — TLS, needs this crate's `tls` feature;
/// - `redis-cluster://[[user]:password@]host:port[?node=host:port&node=…]` — Redis Cluster;
/// - `redis-sentinel://[[user]:password@]host[:port][/db]?sentinelServiceName=NAME[&node=host:port…]`
///   — a primary found through Sentinel (the host is a sentinel, default port 26379).
///
/// User and password may also be given in [`username`](Self::username) /
/// [`password`](Self::password), which override the URL's. They are never printed by
/// `Debug`.
#[derive(Clone)]
#[non_exhaustive]
pub struct RedisConfig {
    /// The server URL (see above).
    pub url: String,
    /// ACL user name; overrides the URL's.
    pub username: Option<String>,
    /// Password; overrides the URL's.
    pub password: Option<String>,
    /// Prefix of every key and channel (default [`DEFAULT_KEY_PREFIX`]): the owner key of
    /// mutex `m` is `{prefix}:{m}` with the braces kept (a Cluster hash tag).
    pub key_prefix: String,
    /// Whether keys wrap the mutex name in braces (`simba:{m}`, the default), so that every
    /// key of a mutex lands in one Cluster slot. Without the tag the keys are `simba:m`,
    /// `simba:m:contender`, …, as some JVM Simba versions name them; this is rejected for
    /// Redis Cluster. Without the tag, names of different mutexes can collide (mutex
    /// `a:fence` would own the fence counter of mutex `a`): avoid `:` in mutex names then.
    pub hash_tag: bool,
    /// Pub/sub handoff (default) or polling.
    pub wait_mode: WaitMode,
    /// Bound for opening a connection, including TLS and authentication (default 5 s).
    pub connect_timeout: Duration,
    /// Bound for one command; a command that gets no answer in time fails, and calls left
    /// unanswered this long make the store replace the connection (default 2 s).
    pub command_timeout: Duration,
    /// A connection on which a command waited this long without an answer is considered
    /// dead, closed and reconnected (default 2 s).
    pub unresponsive_timeout: Duration,
    /// How often the subscriber connection is pinged, so that a dead one is noticed even
    /// when no messages flow (default 1 s).
    pub heartbeat_interval: Duration,
    /// Longest pause between reconnection attempts; attempts never stop (default 1 s).
    pub reconnect_max_delay: Duration,
    /// Refuse to take a free mutex for one lease after its data may have lost writes,
    /// because a lost owner key may belong to an owner that still believes it owns
    /// (default true): after the server's data was found new (a missing boot marker: first
    /// use, or data lost in a restart; not on Redis Cluster), and after the mutex's data
    /// came to another primary (a failover, or a restart: the primary's replication id
    /// changed). Costs one lease once per fresh server, and once per mutex after a
    /// failover; see the crate docs, *Failover*.
    pub restart_quarantine: bool,
    /// How many replicas must have every acquisition and renewal before it counts
    /// (`WAIT`): an acquisition or renewal that fewer replicas confirmed within
    /// [`replica_ack_timeout`](Self::replica_ack_timeout) fails (retryably) instead, so a
    /// failover to a replica cannot lose a live owner's key (see the crate docs,
    /// *Failover*). `None` (the default) means [`ReplicaAcks::AllOnline`] behind Sentinel
    /// and none otherwise; URL option `replicaAcks=N` or `replicaAcks=all`. On Redis
    /// Cluster the `WAIT` goes to the primary of the mutex's slot, and the default is none
    /// there (a cluster may have no replicas): set it when every primary has one.
    pub replica_acks: Option<ReplicaAcks>,
    /// How long an acquisition or renewal waits for [`replica_acks`](Self::replica_acks)
    /// replicas; `None` (the default) means the URL option `replicaAckTimeoutMs=N`, else
    /// 500 ms. Must be shorter than [`command_timeout`](Self::command_timeout) and
    /// [`unresponsive_timeout`](Self::unresponsive_timeout): the connection waits with it.
    pub replica_ack_timeout: Option<Duration>,
    /// TLS settings for `rediss://` URLs (feature `tls`); also from the URL options
    /// `tlsCaFile`, `tlsCertFile`, `tlsKeyFile`, `tlsServerName`. Fields set here override
    /// the URL's.
    pub tls: TlsOptions,
    /// A resolver for every address the store dials (feature `resolver`): the URL's
    /// hosts, sentinels, the primary they name and the nodes a Cluster announces, IP
    /// addresses included. `None` (the default): the system's resolver. For tests and
    /// unusual networks, e.g. to send each Cluster node's traffic through a proxy.
    #[cfg(feature = "resolver")]
    pub resolver: Option<std::sync::Arc<dyn fred::types::Resolve>>,
}

/// TLS settings of a `rediss://` connection (feature `tls`): which certificate
/// authorities to trust, an optional client certificate (mutual TLS) and the name the
/// server's certificate must carry.
///
/// The server's certificate is always verified: its chain must end at a trusted CA, it
/// must be valid now, and it must name the host (or [`server_name`](Self::server_name)).
/// The same settings apply to every connection of the store: sentinels, the primary,
/// every Cluster node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TlsOptions {
    /// PEM file with the CA certificate(s) to trust instead of the system's roots
    /// (`tlsCaFile=`).
    pub ca_file: Option<PathBuf>,
    /// PEM file with the client certificate chain, for servers that ask for one
    /// (`tlsCertFile=`; needs [`key_file`](Self::key_file)).
    pub cert_file: Option<PathBuf>,
    /// PEM file with the client certificate's private key (PKCS#8, PKCS#1 or SEC1;
    /// `tlsKeyFile=`).
    pub key_file: Option<PathBuf>,
    /// The name sent as SNI and required in the server's certificate, instead of the
    /// host of each address (`tlsServerName=`). Useful when connecting by IP address to a
    /// server whose certificate names only its DNS name.
    pub server_name: Option<String>,
}

impl TlsOptions {
    fn is_empty(&self) -> bool {
        self == &TlsOptions::default()
    }

    /// `self` with every unset field taken from `url`.
    fn or(&self, url: &TlsOptions) -> TlsOptions {
        TlsOptions {
            ca_file: self.ca_file.clone().or_else(|| url.ca_file.clone()),
            cert_file: self.cert_file.clone().or_else(|| url.cert_file.clone()),
            key_file: self.key_file.clone().or_else(|| url.key_file.clone()),
            server_name: self.server_name.clone().or_else(|| url.server_name.clone()),
        }
    }
}

/// Which replicas must confirm an acquisition or renewal before it counts (see
/// [`RedisConfig::replica_acks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplicaAcks {
    /// Every replica that is online at the primary when the write is made, and at least
    /// one (`WAIT n`, n counted by the script that writes). `WAIT` does not say which
    /// replicas confirmed, so replicas with `replica-priority 0`, which are never promoted,
    /// count too: waiting for fewer could be answered by them instead of a promotable one.
    AllOnline,
    /// This many replicas, whichever they are (`WAIT n`); `Count(0)` turns the check off.
    Count(u32),
}

impl ReplicaAcks {
    /// Whether any replica is waited for.
    pub fn is_on(self) -> bool {
        self != ReplicaAcks::Count(0)
    }
}

/// The settings a URL carries besides what fred parses.
#[derive(Debug, Default)]
struct UrlOptions {
    replica_acks: Option<ReplicaAcks>,
    replica_ack_timeout: Option<Duration>,
    tls: TlsOptions,
}

/// The resolved connection settings: fred's config, plus what this crate does itself.
#[derive(Debug)]
pub(crate) struct Resolved {
    pub(crate) fred: FredConfig,
    pub(crate) replica_acks: ReplicaAcks,
    pub(crate) replica_ack_timeout: Duration,
    pub(crate) tls: Option<TlsOptions>,
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("RedisConfig");
        d.field("url", &redact_url(&self.url))
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("key_prefix", &self.key_prefix)
            .field("hash_tag", &self.hash_tag)
            .field("wait_mode", &self.wait_mode)
            .field("connect_timeout", &self.connect_timeout)
            .field("command_timeout", &self.command_timeout)
            .field("unresponsive_timeout", &self.unresponsive_timeout)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("reconnect_max_delay", &self.reconnect_max_delay)
            .field("restart_quarantine", &self.restart_quarantine)
            .field("replica_acks", &self.replica_acks)
            .field("replica_ack_timeout", &self.replica_ack_timeout)
            .field("tls", &self.tls);
        #[cfg(feature = "resolver")]
        d.field(
            "resolver",
            &self.resolver.as_ref().map(|_| "<custom resolver>"),
        );
        d.finish()
    }
}

impl RedisConfig {
    /// A configuration for `url` with default settings.
    pub fn new(url: impl Into<String>) -> Self {
        RedisConfig {
            url: url.into(),
            username: None,
            password: None,
            key_prefix: DEFAULT_KEY_PREFIX.to_owned(),
            hash_tag: true,
            wait_mode: WaitMode::PubSub,
            connect_timeout: Duration::from_secs(5),
            command_timeout: Duration::from_secs(2),
            unresponsive_timeout: Duration::from_secs(2),
            heartbeat_interval: Duration::from_secs(1),
            reconnect_max_delay: Duration::from_secs(1),
            restart_quarantine: true,
            replica_acks: None,
            replica_ack_timeout: None,
            tls: TlsOptions::default(),
            #[cfg(feature = "resolver")]
            resolver: None,
        }
    }

    /// Sets [`resolver`](Self::resolver) (feature `resolver`): every address the store
    /// dials is resolved by `resolver` instead of the system's resolver.
    #[cfg(feature = "resolver")]
    pub fn with_resolver(mut self, resolver: std::sync::Arc<dyn fred::types::Resolve>) -> Self {
        self.resolver = Some(resolver);
        self
    }

    /// Sets [`replica_acks`](Self::replica_acks) to a number of replicas: `Some(0)` turns
    /// the replica check off, `None` leaves it to the URL or the default.
    pub fn with_replica_acks(mut self, acks: Option<u32>) -> Self {
        self.replica_acks = acks.map(ReplicaAcks::Count);
        self
    }

    /// Sets [`replica_acks`](Self::replica_acks) to [`ReplicaAcks::AllOnline`].
    pub fn with_all_replica_acks(mut self) -> Self {
        self.replica_acks = Some(ReplicaAcks::AllOnline);
        self
    }

    /// Sets [`replica_ack_timeout`](Self::replica_ack_timeout).
    pub fn with_replica_ack_timeout(mut self, d: Duration) -> Self {
        self.replica_ack_timeout = Some(d);
        self
    }

    /// Sets the TLS settings (see [`TlsOptions`]).
    pub fn with_tls(mut self, tls: TlsOptions) -> Self {
        self.tls = tls;
        self
    }

    /// Sets [`restart_quarantine`](Self::restart_quarantine).
    pub fn with_restart_quarantine(mut self, on: bool) -> Self {
        self.restart_quarantine = on;
        self
    }

    /// Sets the key prefix.
    pub fn with_key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// Sets the wait mode.
    pub fn with_wait_mode(mut self, mode: WaitMode) -> Self {
        self.wait_mode = mode;
        self
    }

    /// Sets user name and password (ACL), overriding the URL's.
    pub fn with_credentials(
        mut self,
        username: Option<impl Into<String>>,
        password: impl Into<String>,
    ) -> Self {
        self.username = username.map(Into::into);
        self.password = Some(password.into());
        self
    }

    /// Sets the connect timeout.
    pub fn with_connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// Sets the command timeout.
    pub fn with_command_timeout(mut self, d: Duration) -> Self {
        self.command_timeout = d;
        self
    }

    /// Sets the unresponsive-connection timeout.
    pub fn with_unresponsive_timeout(mut self, d: Duration) -> Self {
        self.unresponsive_timeout = d;
        self
    }

    /// Sets the heartbeat interval of the subscriber connection.
    pub fn with_heartbeat_interval(mut self, d: Duration) -> Self {
        self.heartbeat_interval = d;
        self
    }

    /// Sets the longest pause between reconnection attempts.
    pub fn with_reconnect_max_delay(mut self, d: Duration) -> Self {
        self.reconnect_max_delay = d;
        self
    }

    /// Sets whether keys carry the Cluster hash tag (see [`hash_tag`](Self::hash_tag)).
    pub fn with_hash_tag(mut self, hash_tag: bool) -> Self {
        self.hash_tag = hash_tag;
        self
    }

    /// Checks every setting and parses the URL.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first bad setting and saying what is wrong: an
    /// unparsable URL or unknown scheme, an unknown or bad URL option, `rediss://` without
    /// the `tls` feature, TLS options on a URL without TLS, a CA, certificate or key file
    /// that cannot be read or holds no usable PEM item, a bad key prefix, a duration under
    /// 1 ms, over a year or not whole milliseconds, a replica-ack timeout not shorter than
    /// the command timeout, `hash_tag = false` with Cluster.
    pub fn validate(&self) -> Result<()> {
        let resolved = self.resolve()?;
        #[cfg(feature = "tls")]
        if let Some(tls) = &resolved.tls {
            crate::tls::client_config(tls)?;
        }
        drop(resolved);
        Ok(())
    }

    /// The fred client configuration (server, credentials) and this crate's own
    /// connection settings.
    pub(crate) fn resolve(&self) -> Result<Resolved> {
        let checks: [(&'static str, Duration); 5] = [
            ("connect_timeout", self.connect_timeout),
            ("command_timeout", self.command_timeout),
            ("unresponsive_timeout", self.unresponsive_timeout),
            ("heartbeat_interval", self.heartbeat_interval),
            ("reconnect_max_delay", self.reconnect_max_delay),
        ];
        for (field, d) in checks {
            validate_duration(field, d, Duration::from_millis(1))?;
        }
        validate_prefix(&self.key_prefix)?;
        let (fred_url, options) = split_options(&self.url)?;
        let mut config = parse_url(&fred_url, &self.url)?;
        if let Some(user) = &self.username {
            config.username = Some(user.clone());
        }
        if let Some(password) = &self.password {
            config.password = Some(password.clone());
        }
        let clustered = config.server.is_clustered();
        if !self.hash_tag && clustered {
            return Err(Error::config(
                "hash_tag",
                "Redis Cluster needs the hash tag: every key of a mutex must be in one slot; \
                 set hash_tag = true",
            ));
        }
        let sentinel = matches!(config.server, ServerConfig::Sentinel { .. });
        let replica_acks = self
            .replica_acks
            .or(options.replica_acks)
            .unwrap_or(if sentinel {
                ReplicaAcks::AllOnline
            } else {
                ReplicaAcks::Count(0)
            });
        let replica_ack_timeout = self
            .replica_ack_timeout
            .or(options.replica_ack_timeout)
            .unwrap_or(DEFAULT_REPLICA_ACK_TIMEOUT);
        validate_duration(
            "replica_ack_timeout",
            replica_ack_timeout,
            Duration::from_millis(1),
        )?;
        if replica_acks.is_on()
            && (replica_ack_timeout >= self.command_timeout
                || replica_ack_timeout >= self.unresponsive_timeout)
        {
            return Err(Error::config(
                "replica_ack_timeout",
                format!(
                    "{replica_ack_timeout:?} is not shorter than the command timeout \
                     ({:?}) and the unresponsive timeout ({:?}); the connection waits for the \
                     replicas, so make it shorter (e.g. 500 ms)",
                    self.command_timeout, self.unresponsive_timeout
                ),
            ));
        }
        let tls_url = is_tls_scheme(&self.url);
        let tls = self.tls.or(&options.tls);
        let tls = if tls_url {
            Some(tls)
        } else if tls.is_empty() {
            None
        } else {
            return Err(Error::config(
                "tls",
                format!(
                    "{:?} has TLS options (tlsCaFile, tlsCertFile, tlsKeyFile, tlsServerName) \
                     but no TLS scheme; use rediss:// (or rediss-cluster://, \
                     rediss-sentinel://)",
                    redact_url(&self.url)
                ),
            ));
        };
        if let Some(t) = &tls
            && t.cert_file.is_some() != t.key_file.is_some()
        {
            return Err(Error::config(
                "tls",
                "a client certificate needs both tlsCertFile and tlsKeyFile",
            ));
        }
        Ok(Resolved {
            fred: config,
            replica_acks,
            replica_ack_timeout,
            tls,
        })
    }
}

/// `%XX` escapes decoded (a bad escape is kept as it is).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        if bytes[i] == b'%'
            && let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            out.push(u8::try_from(hi * 16 + lo).unwrap_or(b'?'));
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn is_tls_scheme(url: &str) -> bool {
    let scheme = url
        .split_once("://")
        .map_or("", |(s, _)| s)
        .to_ascii_lowercase();
    scheme.starts_with("rediss") || scheme.starts_with("valkeys")
}

/// The URL options this crate reads itself (fred would ignore them).
const OWN_OPTIONS: &[&str] = &[
    "replicaAcks",
    "replicaAckTimeoutMs",
    "tlsCaFile",
    "tlsCertFile",
    "tlsKeyFile",
    "tlsServerName",
];

/// The query parameters fred reads.
const FRED_OPTIONS: &[&str] = &[
    "node",
    "sentinelServiceName",
    "sentinelUsername",
    "sentinelPassword",
];

/// Splits this crate's own options off `url`: the URL for fred, and the options.
fn split_options(url: &str) -> Result<(String, UrlOptions)> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), UrlOptions::default()));
    };
    let mut kept = Vec::new();
    let mut options = UrlOptions::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let bad = |what: &str| {
            Err(Error::config(
                "url",
                format!("URL option {key}={value:?} {what}"),
            ))
        };
        let path = || {
            let decoded = percent_decode(value);
            if decoded.is_empty() {
                None
            } else {
                Some(PathBuf::from(decoded))
            }
        };
        match key {
            "replicaAcks" => match value.parse::<u32>() {
                Ok(n) => options.replica_acks = Some(ReplicaAcks::Count(n)),
                Err(_) if value == "all" => options.replica_acks = Some(ReplicaAcks::AllOnline),
                Err(_) => {
                    return bad(
                        "is neither a number of replicas (0 turns the check off) nor `all` \
                         (every replica online)",
                    );
                }
            },
            "replicaAckTimeoutMs" => match value.parse::<u64>() {
                Ok(ms) if ms > 0 => options.replica_ack_timeout = Some(Duration::from_millis(ms)),
                _ => return bad("is not a positive number of milliseconds"),
            },
            "tlsCaFile" => match path() {
                Some(p) => options.tls.ca_file = Some(p),
                None => return bad("names no file"),
            },
            "tlsCertFile" => match path() {
                Some(p) => options.tls.cert_file = Some(p),
                None => return bad("names no file"),
            },
            "tlsKeyFile" => match path() {
                Some(p) => options.tls.key_file = Some(p),
                None => return bad("names no file"),
            },
            "tlsServerName" => {
                let name = percent_decode(value);
                if name.is_empty() {
                    return bad("names no server");
                }
                options.tls.server_name = Some(name);
            }
            k if FRED_OPTIONS.contains(&k) => kept.push(pair),
            _ => {
                return Err(Error::config(
                    "url",
                    format!(
                        "unknown URL option {key:?}; known: {}",
                        FRED_OPTIONS
                            .iter()
                            .chain(OWN_OPTIONS)
                            .copied()
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
        }
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((url, options))
}

fn validate_prefix(prefix: &str) -> Result<()> {
    let fail = |reason: &str| Err(Error::config("key_prefix", format!("{prefix:?} {reason}")));
    if prefix.is_empty() {
        return fail("is empty; use e.g. \"simba\"");
    }
    if prefix.len() > MAX_KEY_PREFIX_LEN {
        return fail(&format!(
            "is longer than {MAX_KEY_PREFIX_LEN} bytes; use a shorter prefix"
        ));
    }
    if prefix.contains(['{', '}']) {
        return fail("contains `{` or `}`, which would break the Cluster hash tag of the keys");
    }
    if prefix.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return fail("contains whitespace or control characters");
    }
    Ok(())
}

pub(crate) const SCHEMES: &[&str] = &[
    "redis",
    "rediss",
    "valkey",
    "valkeys",
    "redis-cluster",
    "rediss-cluster",
    "valkey-cluster",
    "valkeys-cluster",
    "redis-sentinel",
    "rediss-sentinel",
    "valkey-sentinel",
    "valkeys-sentinel",
];

/// Parses `url` (this crate's options removed) with fred; `original` is what the user gave,
/// for messages.
fn parse_url(url: &str, original: &str) -> Result<FredConfig> {
    let fail = |reason: String| Err(Error::config("url", reason));
    let shown = redact_url(original);
    let Some((scheme, rest)) = url.split_once("://") else {
        return fail(format!(
            "{shown:?} is not a URL; expected e.g. redis://127.0.0.1:6379"
        ));
    };
    let scheme = scheme.to_ascii_lowercase();
    if !SCHEMES.contains(&scheme.as_str()) {
        return fail(format!(
            "unsupported scheme {scheme:?} in {shown:?}; use redis://, rediss:// (TLS), \
             redis-cluster:// or redis-sentinel:// (valkey… also works)"
        ));
    }
    if rest.is_empty() || rest.starts_with(['/', '?']) {
        return fail(format!("{shown:?} names no host"));
    }
    let tls = scheme.starts_with("rediss") || scheme.starts_with("valkeys");
    if tls && !cfg!(feature = "tls") {
        return fail(format!(
            "{shown:?} asks for TLS, but simba-redis was built without its `tls` feature; \
             enable it (simba-redis = {{ features = [\"tls\"] }})"
        ));
    }
    let url = if tls {
        // fred parses these schemes; this crate sets up TLS itself (see `tls.rs`).
        url.replacen("rediss", "redis", 1)
            .replacen("valkeys", "valkey", 1)
    } else {
        url.to_owned()
    };
    check_database(rest, &shown)?;
    let config = FredConfig::from_url(&url).map_err(|e| {
        Error::config(
            "url",
            format!("{shown:?} is not a valid Redis URL: {}", e.details()),
        )
    })?;
    if let ServerConfig::Sentinel { service_name, .. } = &config.server
        && service_name.is_empty()
    {
        return fail(format!(
            "{shown:?}: a sentinel URL needs ?sentinelServiceName=NAME"
        ));
    }
    Ok(config)
}

/// The database of a URL's path (`rest` is what follows `scheme://`): none, or one number
/// from 0 to 255 (the client's range; the server's `databases` setting bounds it further,
/// to 0–15 by default). fred's own error for a bad one is "Invalid integer string".
fn check_database(rest: &str, shown: &str) -> Result<()> {
    let before_query = rest.split(['?', '#']).next().unwrap_or("");
    // After the userinfo, so that a password never shows in the message (even one with
    // an unescaped `/`).
    let host_and_path = before_query
        .rsplit_once('@')
        .map_or(before_query, |(_, after)| after);
    let Some((_, path)) = host_and_path.split_once('/') else {
        return Ok(());
    };
    let db = path.trim();
    if db.is_empty() {
        return Ok(());
    }
    if db.contains('/') {
        return Err(Error::config(
            "url",
            format!(
                "{shown:?}: the path `/{path}` is not a database number; the path holds at \
                 most one, from 0 to 255 (e.g. redis://HOST:PORT/2)"
            ),
        ));
    }
    match db.parse::<u8>() {
        Ok(_) => Ok(()),
        Err(_) => Err(Error::config(
            "url",
            format!(
                "{shown:?}: database `{db}` is not a database number from 0 to 255 (the \
                 server's `databases` setting may allow fewer: 16 by default, 0 to 15); \
                 write redis://HOST:PORT/DB, or leave the path out for database 0"
            ),
        )),
    }
}

/// `url` with every secret replaced by `***`, for errors and logs: the userinfo password
/// (`redis://user:password@…`, `redis://:password@…`) and every query parameter named like a
/// password (`sentinelPassword=`, `password=`, …), in every URL form this crate accepts
/// (`redis`, `rediss`, `valkey(s)`, `-cluster`, `-sentinel`).
///
/// ```
/// assert_eq!(
///     simba_redis::redact_url("redis-sentinel://:pw@h:26379/0?sentinelServiceName=m&sentinelPassword=x"),
///     "redis-sentinel://:***@h:26379/0?sentinelServiceName=m&sentinelPassword=***",
/// );
/// ```
pub fn redact_url(url: &str) -> String {
    simba_core::redact_url_with(url, simba_core::is_secret_key)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use simba_core::MAX_DURATION;

    fn field(e: Error) -> &'static str {
        match e {
            Error::InvalidConfig { field, .. } => field,
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[test]
    fn accepts_good_urls() {
        for url in [
            "redis://127.0.0.1:6379",
            "redis://localhost",
            "redis://:secret@localhost:6379/2",
            "redis://user:secret@localhost:6379",
            "valkey://127.0.0.1",
            "redis-cluster://127.0.0.1:7000?node=127.0.0.1:7001",
            "redis-sentinel://127.0.0.1:26379/0?sentinelServiceName=mymaster",
        ] {
            RedisConfig::new(url)
                .validate()
                .unwrap_or_else(|e| panic!("{url}: {e}"));
        }
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "",
            "localhost:6379",
            "http://localhost",
            "redis://",
            "redis:///0",
            "redis://localhost:notaport",
            "redis://localhost:6379/abc",
            "redis-sentinel://127.0.0.1:26379",
            "redis+unix:///tmp/redis.sock",
        ] {
            let e = RedisConfig::new(url).validate().expect_err(url);
            assert_eq!(field(e), "url", "{url}");
        }
    }

    #[test]
    fn a_bad_database_number_names_it_and_the_range() {
        for (url, db) in [
            ("redis://127.0.0.1:6379/99999", "`99999`"),
            ("redis://:secret@localhost/256", "`256`"),
            ("redis://localhost:6379/abc?replicaAcks=0", "`abc`"),
            ("redis://u:pa/ss@localhost:6379/x", "`x`"),
            ("redis://localhost:6379/-1", "`-1`"),
            ("redis://localhost:6379/1/2", "`/1/2`"),
        ] {
            let e = RedisConfig::new(url).validate().expect_err(url);
            let text = e.to_string();
            assert!(
                text.contains(db) && text.contains("0 to 255") && !text.contains("Invalid integer"),
                "{url}: {text}"
            );
            assert!(
                !text.contains("secret") && !text.contains("pa/ss"),
                "{text}"
            );
            assert_eq!(field(e), "url", "{url}");
        }
        for url in [
            "redis://localhost:6379/255",
            "redis://localhost:6379/0",
            "redis://localhost:6379/",
            "redis://[::1]:6379/3",
        ] {
            RedisConfig::new(url)
                .validate()
                .unwrap_or_else(|e| panic!("{url}: {e}"));
        }
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn rediss_needs_tls_feature() {
        let e = RedisConfig::new("rediss://localhost")
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("`tls` feature"), "{e}");
    }

    #[cfg(feature = "tls")]
    #[test]
    fn rediss_with_tls_feature() {
        RedisConfig::new("rediss://user:pw@localhost:6380")
            .validate()
            .unwrap();
        RedisConfig::new("rediss-cluster://localhost:7000")
            .validate()
            .unwrap();
    }

    #[test]
    fn rejects_bad_settings() {
        let base = RedisConfig::new("redis://localhost");
        let e = base
            .clone()
            .with_command_timeout(Duration::from_micros(10))
            .validate()
            .unwrap_err();
        assert_eq!(field(e), "command_timeout");
        let e = base
            .clone()
            .with_connect_timeout(Duration::ZERO)
            .validate()
            .unwrap_err();
        assert_eq!(field(e), "connect_timeout");
        let e = base
            .clone()
            .with_heartbeat_interval(MAX_DURATION * 2)
            .validate()
            .unwrap_err();
        assert_eq!(field(e), "heartbeat_interval");
        for prefix in ["", "a{b", "a b", "x\n"] {
            let e = base.clone().with_key_prefix(prefix).validate().unwrap_err();
            assert_eq!(field(e), "key_prefix", "{prefix:?}");
        }
        let e = RedisConfig::new("redis-cluster://127.0.0.1:7000")
            .with_hash_tag(false)
            .validate()
            .unwrap_err();
        assert_eq!(field(e), "hash_tag");
    }

    #[test]
    fn debug_redacts_passwords() {
        let c = RedisConfig::new("redis://user:hunter2@localhost:6379/0")
            .with_credentials(Some("u"), "swordfish");
        let s = format!("{c:?}");
        assert!(!s.contains("hunter2"), "{s}");
        assert!(!s.contains("swordfish"), "{s}");
        assert!(s.contains("user:***@localhost:6379/0"), "{s}");
        assert_eq!(
            redact_url("redis-sentinel://:pw@h:1?sentinelServiceName=m&sentinelPassword=x"),
            "redis-sentinel://:***@h:1?sentinelServiceName=m&sentinelPassword=***"
        );
        assert_eq!(redact_url("redis://h:1"), "redis://h:1");
    }

    #[test]
    fn replica_acks_defaults_and_options() {
        let acks = |url: &str| RedisConfig::new(url).resolve().unwrap().replica_acks;
        use ReplicaAcks::{AllOnline, Count};
        assert_eq!(acks("redis://h:1"), Count(0));
        assert_eq!(
            acks("redis-sentinel://h:1?sentinelServiceName=m"),
            AllOnline
        );
        assert_eq!(
            acks("redis-sentinel://h:1?sentinelServiceName=m&replicaAcks=0"),
            Count(0)
        );
        assert_eq!(acks("redis://h:1?replicaAcks=2"), Count(2));
        assert_eq!(acks("redis://h:1?replicaAcks=all"), AllOnline);
        // Cluster: off by default, allowed when asked for.
        assert_eq!(acks("redis-cluster://h:1"), Count(0));
        assert_eq!(acks("redis-cluster://h:1?replicaAcks=1"), Count(1));
        let r = RedisConfig::new("redis://h:1?replicaAcks=1&replicaAckTimeoutMs=250")
            .resolve()
            .unwrap();
        assert_eq!(r.replica_ack_timeout, Duration::from_millis(250));
        // The field overrides the URL.
        let r = RedisConfig::new("redis://h:1?replicaAcks=1")
            .with_replica_acks(Some(0))
            .resolve()
            .unwrap();
        assert_eq!(r.replica_acks, ReplicaAcks::Count(0));
        // fred's own options pass through.
        let r =
            RedisConfig::new("redis-sentinel://h:1?sentinelServiceName=m&node=h:2&replicaAcks=1")
                .resolve()
                .unwrap();
        assert!(
            matches!(r.fred.server, ServerConfig::Sentinel { ref hosts, .. } if hosts.len() == 2)
        );
    }

    #[test]
    fn rejects_bad_replica_settings() {
        let e = RedisConfig::new("redis://h:1?replicaAcks=1")
            .with_replica_ack_timeout(Duration::from_secs(2))
            .validate()
            .unwrap_err();
        assert_eq!(field(e), "replica_ack_timeout");
        for url in [
            "redis://h:1?replicaAcks=x",
            "redis://h:1?replicaAckTimeoutMs=0",
            "redis://h:1?nosuchoption=1",
            "redis://h:1?tlsCaFile=",
        ] {
            let e = RedisConfig::new(url).validate().expect_err(url);
            assert_eq!(field(e), "url", "{url}");
        }
        let e = RedisConfig::new("redis://h:1?tlsCaFile=/x.pem")
            .validate()
            .unwrap_err();
        assert_eq!(field(e), "tls");
    }

    #[test]
    fn url_errors_do_not_leak_passwords() {
        let e = RedisConfig::new("redis://u:hunter2@localhost:bad")
            .validate()
            .unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }
}
