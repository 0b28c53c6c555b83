//! [`EtcdConfig`]: endpoints, key prefix, credentials and timing, from code or a URL.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use simba_core::{Error, Result, is_secret_key, redact_url_with};

/// The port of an endpoint that names none (etcd's client port).
pub const DEFAULT_PORT: u16 = 2379;
/// The key prefix under which mutex keys live by default.
pub const DEFAULT_PREFIX: &str = "/simba";
/// The shortest lease: etcd grants no lease shorter than about 1.5 election timeouts
/// (2 s with its default 1 s election timeout) and rounds up what is asked below that.
pub const MIN_LEASE_TTL: Duration = Duration::from_secs(2);
/// The longest lease this crate accepts (a mistake beyond that).
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(3600);
/// The longest connect timeout this crate accepts.
pub const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(300);

/// The URL schemes of plain connections.
pub(crate) const PLAIN_SCHEMES: &[&str] = &["etcd"];
/// The URL schemes of TLS connections (refused without the feature `tls`).
pub(crate) const TLS_SCHEMES: &[&str] = &["etcds", "etcd+tls"];

/// The URL options of TLS (`etcds://…?tlsCaFile=…`).
pub(crate) const TLS_URL_OPTIONS: &[&str] =
    &["tlsCaFile", "tlsCertFile", "tlsKeyFile", "tlsServerName"];

/// TLS settings (feature `tls`): which CA to trust, a client certificate, and the name the
/// server's certificate must carry. The chain and the name are always checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdTlsOptions {
    /// The CA certificates (PEM) to trust instead of the system's (`tlsCaFile=`).
    pub ca_file: Option<PathBuf>,
    /// A client certificate chain (PEM), for etcd's `--client-cert-auth` (`tlsCertFile=`).
    pub cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM) (`tlsKeyFile=`).
    pub key_file: Option<PathBuf>,
    /// The name the server's certificate must carry, whatever host is dialled
    /// (`tlsServerName=`); by default the host of the endpoint.
    pub server_name: Option<String>,
}

impl EtcdTlsOptions {
    /// Trust the CA certificates of `path` (PEM) instead of the system's.
    #[must_use]
    pub fn with_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self
    }

    /// Present the client certificate `cert` with its key `key` (PEM files).
    #[must_use]
    pub fn with_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.cert_file = Some(cert.into());
        self.key_file = Some(key.into());
        self
    }

    /// Check the server's certificate against `name` instead of the dialled host.
    #[must_use]
    pub fn with_server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }

    fn is_empty(&self) -> bool {
        *self == EtcdTlsOptions::default()
    }
}

/// How to reach etcd and how long leases last.
///
/// ```
/// use std::time::Duration;
/// use simba_etcd::EtcdConfig;
///
/// let config = EtcdConfig::from_url("etcd://app:s3cret@etcd1:2379,etcd2:2379/apps/billing")?
///     .with_lease_ttl(Duration::from_secs(10));
/// assert_eq!(config.endpoints, ["http://etcd1:2379", "http://etcd2:2379"]);
/// assert_eq!(config.prefix, "/apps/billing");
/// assert!(!format!("{config:?}").contains("s3cret"));
/// # Ok::<(), simba_core::Error>(())
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct EtcdConfig {
    /// `http://host:port` (or `https://` with TLS) of each member to connect to.
    pub endpoints: Vec<String>,
    /// The key prefix below which every mutex's keys live (`/simba` by default).
    pub prefix: String,
    /// `(user, password)` for etcd's authentication. Redacted in `Debug`.
    pub user: Option<(String, String)>,
    /// Whether to speak TLS (`etcds://`); without the feature `tls` refused by
    /// [`validate`](Self::validate).
    pub tls: bool,
    /// The TLS settings (used when `tls` is on).
    pub tls_options: EtcdTlsOptions,
    /// The time to live of each contender's lease, whole seconds (default 10 s); a silent
    /// owner keeps the mutex that long.
    pub lease_ttl: Duration,
    /// Bound of [`EtcdFactory::connect`](crate::EtcdFactory::connect) (default 10 s).
    pub connect_timeout: Duration,
    /// Subtracted from the owner's local deadline (clock-rate drift; default 200 ms).
    pub drift_margin: Duration,
    /// Tag metrics with the mutex name (off by default: names can be many).
    pub metrics_mutex_label: bool,
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("user", &self.user.as_ref().map(|(u, _)| (u, "***")))
            .field("tls", &self.tls)
            .field("tls_options", &self.tls_options)
            .field("lease_ttl", &self.lease_ttl)
            .field("connect_timeout", &self.connect_timeout)
            .field("drift_margin", &self.drift_margin)
            .finish()
    }
}

impl EtcdConfig {
    /// A configuration for `endpoints` (`host:port`, comma-separated; port 2379 if
    /// missing), with the defaults.
    pub fn new(endpoints: &str) -> Self {
        let endpoints = endpoints
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| endpoint_url(e, false))
            .collect();
        EtcdConfig {
            endpoints,
            prefix: DEFAULT_PREFIX.to_owned(),
            user: None,
            tls: false,
            tls_options: EtcdTlsOptions::default(),
            lease_ttl: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            drift_margin: Duration::from_millis(200),
            metrics_mutex_label: false,
        }
    }

    /// Parses `etcd://[USER:PASSWORD@]HOST[:PORT][,HOST[:PORT]…][/PREFIX]` (or `etcds://`
    /// for TLS, feature `tls`). Options after `?`: `lease_ttl=SECONDS`; with `etcds://`
    /// also `tlsCaFile=PATH`, `tlsCertFile=PATH`, `tlsKeyFile=PATH`, `tlsServerName=NAME`
    /// ([`EtcdTlsOptions`]).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] saying what is wrong.
    pub fn from_url(url: &str) -> Result<Self> {
        let url = url.trim();
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(Error::config(
                "url",
                "expected etcd://HOST:PORT[,HOST:PORT…][/PREFIX]",
            ));
        };
        let scheme = scheme.to_ascii_lowercase();
        let tls = if PLAIN_SCHEMES.contains(&scheme.as_str()) {
            false
        } else if TLS_SCHEMES.contains(&scheme.as_str()) {
            true
        } else {
            return Err(Error::config(
                "url",
                format!("`{scheme}://` is not an etcd scheme: use etcd:// or etcds://"),
            ));
        };
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let (user, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => {
                let (u, p) = userinfo.split_once(':').unwrap_or((userinfo, ""));
                if u.is_empty() {
                    return Err(Error::config("url", "the user name before `@` is empty"));
                }
                (Some((percent_decode(u)?, percent_decode(p)?)), hosts)
            }
            None => (None, authority),
        };
        let mut hosts_out = Vec::new();
        for h in hosts.split(',').map(str::trim) {
            if h.is_empty() {
                return Err(Error::config(
                    "url",
                    format!(
                        "`{}`: no host (write etcd://HOST:PORT/PREFIX)",
                        redact_url(url)
                    ),
                ));
            }
            check_host(h)?;
            hosts_out.push(endpoint_url(h, tls));
        }
        let mut config = EtcdConfig::new("");
        config.endpoints = hosts_out;
        config.tls = tls;
        config.user = user;
        let path = path.trim_end_matches('/');
        if !path.is_empty() {
            config.prefix = percent_decode(path)?;
        }
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "lease_ttl" => {
                    let secs: u64 = v.parse().map_err(|_| {
                        Error::config(
                            "lease_ttl",
                            format!("`{v}` is not a whole number of seconds"),
                        )
                    })?;
                    config.lease_ttl = Duration::from_secs(secs);
                }
                "tlsCaFile" | "tlsCertFile" | "tlsKeyFile" | "tlsServerName" => {
                    let value = percent_decode(v)?;
                    if value.is_empty() {
                        return Err(Error::config("url", format!("`{k}=` needs a value")));
                    }
                    let o = &mut config.tls_options;
                    match k {
                        "tlsCaFile" => o.ca_file = Some(value.into()),
                        "tlsCertFile" => o.cert_file = Some(value.into()),
                        "tlsKeyFile" => o.key_file = Some(value.into()),
                        _ => o.server_name = Some(value),
                    }
                }
                other => {
                    return Err(Error::config(
                        "url",
                        format!(
                            "unknown option `{other}` (known: lease_ttl, {})",
                            TLS_URL_OPTIONS.join(", ")
                        ),
                    ));
                }
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Sets the key prefix.
    #[must_use]
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets the user and password of etcd's authentication.
    #[must_use]
    pub fn with_user(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((user.into(), password.into()));
        self
    }

    /// Speaks TLS with `options` (feature `tls`): every endpoint becomes `https://`.
    #[must_use]
    pub fn with_tls(mut self, options: EtcdTlsOptions) -> Self {
        self.tls = true;
        self.tls_options = options;
        for e in &mut self.endpoints {
            if let Some(rest) = e.strip_prefix("http://") {
                *e = format!("https://{rest}");
            }
        }
        self
    }

    /// Sets the lease time to live (rounded up to whole seconds by [`lease_secs`](Self::lease_secs)).
    #[must_use]
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// Sets the connect timeout.
    #[must_use]
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets the drift margin.
    #[must_use]
    pub fn with_drift_margin(mut self, margin: Duration) -> Self {
        self.drift_margin = margin;
        self
    }

    /// The lease TTL in whole seconds, rounded up.
    pub fn lease_secs(&self) -> i64 {
        let secs = self.lease_ttl.as_secs() + u64::from(self.lease_ttl.subsec_nanos() > 0);
        i64::try_from(secs).unwrap_or(i64::MAX)
    }

    /// Checks every setting.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.endpoints.is_empty() {
            return Err(Error::config("endpoints", "no etcd endpoint given"));
        }
        if !self.prefix.starts_with('/') || self.prefix.contains('\0') {
            return Err(Error::config(
                "prefix",
                format!("{:?} must start with `/` and hold no NUL", self.prefix),
            ));
        }
        if self.lease_ttl < MIN_LEASE_TTL || self.lease_ttl > MAX_LEASE_TTL {
            return Err(Error::config(
                "lease_ttl",
                format!(
                    "{:?} is outside {MIN_LEASE_TTL:?}..={MAX_LEASE_TTL:?} (etcd grants no \
                     shorter lease)",
                    self.lease_ttl
                ),
            ));
        }
        if self.connect_timeout.is_zero() || self.connect_timeout > MAX_CONNECT_TIMEOUT {
            return Err(Error::config(
                "connect_timeout",
                format!(
                    "{:?} is outside (0, {MAX_CONNECT_TIMEOUT:?}]",
                    self.connect_timeout
                ),
            ));
        }
        if self.drift_margin * 4 > self.lease_ttl {
            return Err(Error::config(
                "drift_margin",
                format!(
                    "{:?} is more than a quarter of the lease ({:?})",
                    self.drift_margin, self.lease_ttl
                ),
            ));
        }
        if self.tls && !cfg!(feature = "tls") {
            return Err(Error::config(
                "tls",
                "this simba-etcd was built without its feature `tls` (etcds:// URLs are \
                 refused rather than sent in plain text): build it with `features = [\"tls\"]`, \
                 or reach a TLS-only cluster through a local TLS tunnel and give \
                 etcd://127.0.0.1:TUNNEL_PORT",
            ));
        }
        if !self.tls && !self.tls_options.is_empty() {
            return Err(Error::config(
                "tls",
                format!(
                    "TLS options ({}) on a plain connection: use etcds:// (EtcdConfig::with_tls)",
                    TLS_URL_OPTIONS.join(", ")
                ),
            ));
        }
        let o = &self.tls_options;
        if o.cert_file.is_some() != o.key_file.is_some() {
            return Err(Error::config(
                "tls.cert_file",
                "a client certificate needs both tlsCertFile and tlsKeyFile",
            ));
        }
        Ok(())
    }

    /// The key prefix of `mutex`'s waiter keys: `{prefix}/{encoded mutex}/`.
    pub(crate) fn mutex_prefix(&self, mutex: &str) -> String {
        format!(
            "{}/{}/",
            self.prefix.trim_end_matches('/'),
            encode_name(mutex)
        )
    }
}

fn check_host(h: &str) -> Result<()> {
    let (host, port) = split_host_port(h);
    if host.is_empty() || host.contains(['/', '@', ' ']) {
        return Err(Error::config("url", format!("`{h}` is not HOST[:PORT]")));
    }
    if let Some(p) = port
        && p.parse::<u16>().map_or(true, |p| p == 0)
    {
        return Err(Error::config(
            "url",
            format!("`{p}` in `{h}` is not a port"),
        ));
    }
    Ok(())
}

/// `(host, port)` of `host[:port]` or `[v6][:port]`.
fn split_host_port(h: &str) -> (&str, Option<&str>) {
    if let Some(rest) = h.strip_prefix('[') {
        return match rest.split_once(']') {
            Some((host, tail)) => (host, tail.strip_prefix(':')),
            None => (h, None),
        };
    }
    match h.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => (host, Some(port)),
        _ => (h, None),
    }
}

fn endpoint_url(h: &str, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    let (_, port) = split_host_port(h);
    if port.is_some() {
        format!("{scheme}://{h}")
    } else {
        format!("{scheme}://{h}:{DEFAULT_PORT}")
    }
}

fn percent_decode(s: &str) -> Result<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| Error::config("url", "a `%` not followed by two hex digits"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| Error::config("url", "percent-encoding is not UTF-8"))
}

/// `mutex` with `/` and `%` percent-encoded, so that no mutex's key range holds another's.
pub(crate) fn encode_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        match c {
            '%' => out.push_str("%25"),
            '/' => out.push_str("%2F"),
            c => out.push(c),
        }
    }
    out
}

/// `url` with its password replaced by `***`.
pub fn redact_url(url: &str) -> String {
    redact_url_with(url, is_secret_key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let c = EtcdConfig::from_url("etcd://u:p%40ss@a:1,b/x/y/?lease_ttl=5").expect("url");
        assert_eq!(c.endpoints, ["http://a:1", "http://b:2379"]);
        assert_eq!(c.prefix, "/x/y");
        assert_eq!(c.user, Some(("u".to_owned(), "p@ss".to_owned())));
        assert_eq!(c.lease_ttl, Duration::from_secs(5));
        let c = EtcdConfig::from_url("etcd://[::1]:2379").expect("v6");
        assert_eq!(c.endpoints, ["http://[::1]:2379"]);
        assert_eq!(c.prefix, DEFAULT_PREFIX);
        for bad in [
            "etcd://",
            "etcd://a:0",
            "etcd://a:x",
            "redis://a",
            "etcd://a?lease_ttl=1",
            "etcd://a?what=1",
            "etcd://a,,b",
            "etcd://:p@a",
        ] {
            assert!(
                matches!(EtcdConfig::from_url(bad), Err(Error::InvalidConfig { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn names_do_not_nest() {
        let c = EtcdConfig::new("a");
        assert_eq!(c.mutex_prefix("a/b%"), "/simba/a%2Fb%25/");
        assert!(!c.mutex_prefix("a/b").starts_with(&c.mutex_prefix("a")));
    }

    #[test]
    fn redacts() {
        assert_eq!(
            redact_url("etcd://u:secret@h:2379/a"),
            "etcd://u:***@h:2379/a"
        );
        let c = EtcdConfig::new("h").with_user("u", "secret");
        assert!(!format!("{c:?}").contains("secret"));
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn tls_is_refused_not_sent_in_plain_text() {
        let r = EtcdConfig::from_url("etcds://h:2379");
        match r {
            Err(Error::InvalidConfig {
                field: "tls",
                reason,
            }) => {
                assert!(reason.contains("feature `tls`"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[cfg(feature = "tls")]
    #[test]
    fn tls_urls() {
        let c = EtcdConfig::from_url(
            "etcds://h:1,g/p?tlsCaFile=/c%20a.pem&tlsCertFile=/c.pem&tlsKeyFile=/k.pem&tlsServerName=n",
        )
        .expect("url");
        assert!(c.tls);
        assert_eq!(c.endpoints, ["https://h:1", "https://g:2379"]);
        assert_eq!(
            c.tls_options,
            EtcdTlsOptions::default()
                .with_ca_file("/c a.pem")
                .with_client_cert("/c.pem", "/k.pem")
                .with_server_name("n")
        );
        let c = EtcdConfig::new("h:1").with_tls(EtcdTlsOptions::default());
        assert_eq!(c.endpoints, ["https://h:1"]);
        for bad in [
            "etcd://h?tlsCaFile=/ca.pem",
            "etcds://h?tlsCertFile=/c.pem",
            "etcds://h?tlsCaFile=",
        ] {
            assert!(
                matches!(EtcdConfig::from_url(bad), Err(Error::InvalidConfig { .. })),
                "{bad}"
            );
        }
    }
}
