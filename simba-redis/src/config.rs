//! [`RedisConfig`]: where the server is and how to talk to it.

use std::fmt;
use std::time::Duration;

use fred::types::config::{Config as FredConfig, ServerConfig};
use simba_core::{Error, Result, validate_duration};

/// The default key prefix, as in the JVM Simba: keys are `simba:{mutex}`, ….
pub const DEFAULT_KEY_PREFIX: &str = "simba";

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
    /// Refuse to take a free mutex for one lease after the server's data was found new
    /// (a missing boot marker: first use, or data lost in a restart), because a lost owner
    /// key may belong to an owner that still believes it owns (default true). Costs one
    /// lease once per fresh server; a Redis that kept its data does not pay it. Not
    /// applied on Redis Cluster.
    pub restart_quarantine: bool,
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &redact_url(&self.url))
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
            .finish()
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
        }
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
    /// unparsable URL or unknown scheme, `rediss://` without the `tls` feature, a bad key
    /// prefix, a duration under 1 ms, over a year or not whole milliseconds, `hash_tag = false`
    /// with Cluster.
    pub fn validate(&self) -> Result<()> {
        self.fred_config().map(|_| ())
    }

    /// The fred client configuration (server, credentials, TLS) for this config.
    pub(crate) fn fred_config(&self) -> Result<FredConfig> {
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
        let mut config = parse_url(&self.url)?;
        if let Some(user) = &self.username {
            config.username = Some(user.clone());
        }
        if let Some(password) = &self.password {
            config.password = Some(password.clone());
        }
        if !self.hash_tag && config.server.is_clustered() {
            return Err(Error::config(
                "hash_tag",
                "Redis Cluster needs the hash tag: every key of a mutex must be in one slot; \
                 set hash_tag = true",
            ));
        }
        Ok(config)
    }
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

const SCHEMES: &[&str] = &[
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

fn parse_url(url: &str) -> Result<FredConfig> {
    let fail = |reason: String| Err(Error::config("url", reason));
    let shown = redact_url(url);
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
    let config = FredConfig::from_url(url).map_err(|e| {
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
    fn url_errors_do_not_leak_passwords() {
        let e = RedisConfig::new("redis://u:hunter2@localhost:bad")
            .validate()
            .unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }
}
