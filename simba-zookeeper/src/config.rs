//! [`ZkConfig`], [`DigestAuth`], and the parsing and validation of connect strings and
//! ZooKeeper paths.

use std::fmt;
use std::time::Duration;

use simba_core::backend::PERMIT_CLAIM_MS;
use simba_core::{Error, Result, validate_duration};

/// The shortest session timeout accepted.
///
/// zookeeper-async derives its read-idle timer from whole seconds of two thirds of the
/// session timeout; below about 1.5 s that timer becomes zero and the client reconnects in
/// a loop. Two seconds leaves a margin.
pub const MIN_SESSION_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest session timeout accepted (one hour; ZooKeeper servers cap it far lower by
/// default, at 20 × `tickTime`).
pub const MAX_SESSION_TIMEOUT: Duration = Duration::from_secs(3600);

/// The longest connect timeout accepted (one hour).
pub const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(3600);

/// The default root path under which every mutex gets its node.
pub const DEFAULT_ROOT: &str = "/simba";

/// The port used when a host in the connect string names none.
pub const DEFAULT_PORT: u16 = 2181;

/// The TLS spellings of a ZooKeeper URL, each refused with [`TLS_UNAVAILABLE`].
pub(crate) const TLS_SCHEMES: &[&str] = &["zks", "zookeeper+tls", "zookeeper+ssl", "zookeepers"];

/// Why a TLS URL (`zks://`, `?tls=…`) is refused.
const TLS_UNAVAILABLE: &str = "TLS to ZooKeeper is not available: zookeeper-async, the client \
     this crate uses, speaks plain TCP only. To reach a TLS-only ZooKeeper (secureClientPort), \
     run a local TLS tunnel to it (stunnel, ghostunnel or a sidecar) and give \
     zk://127.0.0.1:TUNNEL_PORT; or use a backend that speaks TLS (Redis: rediss://, \
     PostgreSQL: sslmode=verify-full)";

/// Digest credentials (`user:password`) for ZooKeeper's `digest` authentication scheme.
///
/// When configured, the session authenticates with them after every (re)connect, and every
/// node simba creates gets the ACL "all permissions for the creator's identity"
/// (`Acl::creator_all()`), so only sessions authenticated as the same user can read,
/// change or delete them.
///
/// `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct DigestAuth {
    user: String,
    password: String,
}

impl DigestAuth {
    /// Credentials for `user` with `password`. Checked by [`ZkConfig::validate`].
    pub fn new(user: impl Into<String>, password: impl Into<String>) -> Self {
        DigestAuth {
            user: user.into(),
            password: password.into(),
        }
    }

    /// The user name.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// The `user:password` bytes sent with `add_auth("digest", ..)`.
    pub(crate) fn auth_bytes(&self) -> Vec<u8> {
        format!("{}:{}", self.user, self.password).into_bytes()
    }

    fn validate(&self) -> Result<()> {
        if self.user.is_empty() {
            return Err(Error::config("digest", "the user name must not be empty"));
        }
        if self.user.contains(':') {
            return Err(Error::config(
                "digest",
                "the user name must not contain `:` (digest credentials are `user:password`)",
            ));
        }
        if self.password.is_empty() {
            return Err(Error::config("digest", "the password must not be empty"));
        }
        if self
            .user
            .chars()
            .chain(self.password.chars())
            .any(char::is_control)
        {
            return Err(Error::config(
                "digest",
                "user name and password must not contain control characters",
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for DigestAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DigestAuth")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// How to reach ZooKeeper and how to time the session.
///
/// Build it with [`ZkConfig::new`] and the `with_*` methods; [`ZkFactory::connect`]
/// validates it.
///
/// [`ZkFactory::connect`]: crate::ZkFactory::connect
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ZkConfig {
    /// The connect string: `host:port[,host:port…][/chroot]`, e.g.
    /// `zk1:2181,zk2:2181/apps/billing`. A missing port means 2181, IPv6 addresses go in
    /// brackets (`[::1]:2181`), and a leading `zk://` is accepted. With a chroot, every path
    /// simba uses lies below it; simba creates the chroot node if it is missing.
    pub connect: String,
    /// The session timeout asked of the server (default 10 s, at least
    /// [`MIN_SESSION_TIMEOUT`]).
    ///
    /// It is also the basis of the owner's local deadline, so it must lie within the
    /// server's `minSessionTimeout..=maxSessionTimeout` (by default 2 to 20 × `tickTime`):
    /// the client cannot see the timeout the server negotiates, and a server that
    /// negotiated it *down* could expire the session before the owner gives up.
    pub session_timeout: Duration,
    /// How long [`ZkFactory::connect`](crate::ZkFactory::connect) may take to resolve the
    /// hosts, connect, authenticate and see the session established (default 10 s).
    pub connect_timeout: Duration,
    /// The root path below which each mutex `m` gets the node `{root}/{m}` (default
    /// [`DEFAULT_ROOT`], `/simba`). Absolute, without a trailing `/`.
    pub root: String,
    /// Digest credentials; `None` (the default) creates nodes with an open ACL.
    pub digest: Option<DigestAuth>,
    /// Safety margin subtracted from the owner's local deadline (default 200 ms; less than
    /// half the session timeout): covers clock-rate drift between this process and the
    /// server.
    pub drift_margin: Duration,
    /// Label the [metrics](simba_core::metrics) of this factory's services with `mutex`
    /// (the mutex name) besides `backend` (default off: names are unbounded, every one
    /// makes its own time series). As [`LeaseConfig::metrics_mutex_label`](simba_core::LeaseConfig::metrics_mutex_label).
    pub metrics_mutex_label: bool,
    /// How long a semaphore waiter owed a free permit has to take it before a waiter behind
    /// it removes its node (default `Some(`[`PERMIT_CLAIM_MS`]` ms)`; `None`: never, a
    /// stopped waiter then holds its permit up until its place lapses at its lease end).
    /// The removal is version-checked: a waiter that took meanwhile keeps its permit, and
    /// one removed that calls again joins again at the back of the queue (see
    /// [`ZkPermitStore`](crate::ZkPermitStore), *Claim window*). At least 1 ms, whole
    /// milliseconds.
    pub permit_claim: Option<Duration>,
}

impl ZkConfig {
    /// Defaults for the servers in `connect` (see [`ZkConfig::connect`]).
    pub fn new(connect: impl Into<String>) -> Self {
        ZkConfig {
            connect: connect.into(),
            session_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            root: DEFAULT_ROOT.to_owned(),
            digest: None,
            drift_margin: Duration::from_millis(200),
            metrics_mutex_label: false,
            permit_claim: Some(Duration::from_millis(PERMIT_CLAIM_MS.unsigned_abs())),
        }
    }

    /// Defaults for a URL `zk://[user:password@]host:port[,host:port…][/chroot]` (also
    /// `zookeeper://`): the hosts and chroot become [`ZkConfig::connect`], and a userinfo
    /// becomes [`ZkConfig::digest`] credentials (taken as written, not percent-decoded; the
    /// password may hold `@` but not `/`).
    /// Use [`redact_url`] to show such a URL.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] (field `url`) when `url` has another scheme, or a userinfo
    /// without a `:` between user and password; the message never holds the password.
    /// The rest is checked by [`ZkConfig::validate`].
    ///
    /// ```
    /// let c = simba_zookeeper::ZkConfig::from_url("zk://app:s3cret@zk1:2181,zk2:2181/apps")?;
    /// assert_eq!(c.connect, "zk1:2181,zk2:2181/apps");
    /// assert_eq!(c.digest.as_ref().map(|d| d.user()), Some("app"));
    /// # Ok::<(), simba_core::Error>(())
    /// ```
    pub fn from_url(url: &str) -> Result<Self> {
        let url = url.trim();
        let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
        if scheme.as_deref().is_some_and(|s| TLS_SCHEMES.contains(&s)) {
            return Err(Error::config("url", TLS_UNAVAILABLE));
        }
        let rest = ["zk://", "zookeeper://"]
            .iter()
            .find_map(|scheme| {
                url.get(..scheme.len())
                    .filter(|s| s.eq_ignore_ascii_case(scheme))
                    .map(|_| &url[scheme.len()..])
            })
            .ok_or_else(|| {
                Error::config(
                    "url",
                    format!(
                        "`{}` is not a ZooKeeper URL: expected \
                         zk://[user:password@]host:port[,host:port…][/chroot]",
                        redact_url(url)
                    ),
                )
            })?;
        if let Some((_, query)) = rest.split_once('?') {
            let tls = ["tls", "ssl", "secure"]
                .iter()
                .any(|k| query.to_ascii_lowercase().contains(k));
            return Err(Error::config(
                "url",
                if tls {
                    TLS_UNAVAILABLE.to_owned()
                } else {
                    "a zk:// URL takes no query options; set timeouts and the rest on \
                     ZkConfig"
                        .to_owned()
                },
            ));
        }
        // The chroot starts at the first `/`: a password may hold `@` but not `/`.
        let hosts_end = rest.find('/').unwrap_or(rest.len());
        let Some(at) = rest[..hosts_end].rfind('@') else {
            return Ok(ZkConfig::new(rest));
        };
        let (userinfo, connect) = (&rest[..at], &rest[at + 1..]);
        let Some((user, password)) = userinfo.split_once(':') else {
            return Err(Error::config(
                "url",
                "the userinfo of a zk:// URL must be user:password (digest credentials)",
            ));
        };
        Ok(ZkConfig::new(connect).with_digest(user, password))
    }

    /// Sets [`ZkConfig::session_timeout`].
    pub fn with_session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// Sets [`ZkConfig::connect_timeout`].
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets [`ZkConfig::root`].
    pub fn with_root(mut self, root: impl Into<String>) -> Self {
        self.root = root.into();
        self
    }

    /// Sets [`ZkConfig::digest`] to `user` / `password`.
    pub fn with_digest(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.digest = Some(DigestAuth::new(user, password));
        self
    }

    /// Sets [`ZkConfig::drift_margin`].
    pub fn with_drift_margin(mut self, margin: Duration) -> Self {
        self.drift_margin = margin;
        self
    }

    /// Sets [`ZkConfig::metrics_mutex_label`].
    pub fn with_metrics_mutex_label(mut self, on: bool) -> Self {
        self.metrics_mutex_label = on;
        self
    }

    /// Sets [`ZkConfig::permit_claim`] (`None`: a stopped waiter's place lasts its lease).
    pub fn with_permit_claim(mut self, claim: Option<Duration>) -> Self {
        self.permit_claim = claim;
        self
    }

    /// Checks every setting.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first bad setting and saying how to fix it: an
    /// unparsable connect string, a session timeout outside
    /// [`MIN_SESSION_TIMEOUT`]`..=`[`MAX_SESSION_TIMEOUT`], a zero or huge connect timeout,
    /// a root that is not a valid absolute ZooKeeper path, bad credentials, a drift margin
    /// of half the session timeout or more, or a permit claim of zero; any duration that is
    /// not whole milliseconds.
    pub fn validate(&self) -> Result<()> {
        self.resolve().map(|_| ())
    }

    /// Validates and returns the parsed form.
    pub(crate) fn resolve(&self) -> Result<Resolved> {
        let spec = parse_connect(&self.connect)?;
        for (field, d) in [
            ("session_timeout", self.session_timeout),
            ("connect_timeout", self.connect_timeout),
            ("drift_margin", self.drift_margin),
        ] {
            validate_duration(field, d, Duration::ZERO)?;
        }
        if let Some(claim) = self.permit_claim {
            // Zero would remove a waiter owed a permit the moment anyone behind it looks.
            validate_duration("permit_claim", claim, Duration::from_millis(1))?;
        }
        if self.session_timeout < MIN_SESSION_TIMEOUT {
            return Err(Error::config(
                "session_timeout",
                format!(
                    "{:?} is below the minimum of {MIN_SESSION_TIMEOUT:?} \
                     (zookeeper-async's ping timer breaks below about 1.5 s)",
                    self.session_timeout
                ),
            ));
        }
        if self.session_timeout > MAX_SESSION_TIMEOUT {
            return Err(Error::config(
                "session_timeout",
                format!(
                    "{:?} is above the maximum of {MAX_SESSION_TIMEOUT:?}",
                    self.session_timeout
                ),
            ));
        }
        if self.connect_timeout.is_zero() || self.connect_timeout > MAX_CONNECT_TIMEOUT {
            return Err(Error::config(
                "connect_timeout",
                format!(
                    "{:?} must be between 1 ms and {MAX_CONNECT_TIMEOUT:?}",
                    self.connect_timeout
                ),
            ));
        }
        if self.drift_margin * 2 >= self.session_timeout {
            return Err(Error::config(
                "drift_margin",
                format!(
                    "{:?} must be less than half the session timeout ({:?})",
                    self.drift_margin, self.session_timeout
                ),
            ));
        }
        validate_path(&self.root).map_err(|reason| {
            Error::config(
                "root",
                format!("{:?} is not a valid ZooKeeper path: {reason}", self.root),
            )
        })?;
        let base = format!("{}{}", spec.chroot.as_deref().unwrap_or(""), self.root);
        if base == "/zookeeper" || base.starts_with("/zookeeper/") {
            return Err(Error::config(
                "root",
                format!("{base:?} lies in /zookeeper, which ZooKeeper reserves for itself"),
            ));
        }
        if let Some(d) = &self.digest {
            d.validate()?;
        }
        Ok(Resolved {
            hosts: spec.hosts,
            chroot: spec.chroot,
            base,
        })
    }
}

/// `url` with the password of a `zk://user:password@hosts/chroot` URL replaced by `***`,
/// for errors and logs.
///
/// ```
/// assert_eq!(simba_zookeeper::redact_url("zk://app:s3cret@zk1:2181/apps"), "zk://app:***@zk1:2181/apps");
/// ```
pub fn redact_url(url: &str) -> String {
    let shown = simba_core::redact_url_with(url, simba_core::is_secret_key);
    // A zk:// userinfo is `user:password`; one without `:` is malformed and may well be a
    // bare password, so it is hidden whole.
    if let Some((scheme, rest)) = shown.split_once("://") {
        let hosts_end = rest.find('/').unwrap_or(rest.len());
        if let Some(at) = rest[..hosts_end].rfind('@')
            && !rest[..at].contains(':')
        {
            return format!("{scheme}://***{}", &rest[at..]);
        }
    }
    shown
}

/// A validated configuration's parsed parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resolved {
    /// `(host, port)` pairs, hosts without brackets.
    pub(crate) hosts: Vec<(String, u16)>,
    /// The chroot, if any (absolute, validated).
    pub(crate) chroot: Option<String>,
    /// `chroot + root`: the server-side path below which mutex nodes live.
    pub(crate) base: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct ConnectSpec {
    hosts: Vec<(String, u16)>,
    chroot: Option<String>,
}

fn connect_error(reason: impl Into<String>) -> Error {
    Error::config("connect", reason)
}

/// Parses `host:port[,host:port…][/chroot]` (an optional `zk://` in front).
fn parse_connect(s: &str) -> Result<ConnectSpec> {
    let s = s.trim();
    let s = s.strip_prefix("zk://").unwrap_or(s);
    if s.split('/').next().is_some_and(|hosts| hosts.contains('@')) {
        // Never echo it: what stands before the `@` is likely a password.
        return Err(connect_error(
            "the connect string holds credentials (`…@host`): give them to \
             ZkConfig::with_digest, or use ZkConfig::from_url with a zk:// URL",
        ));
    }
    if s.is_empty() {
        return Err(connect_error(
            "the connect string is empty; expected host:port[,host:port…][/chroot]",
        ));
    }
    let (hosts_part, chroot) = match s.find('/') {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, ""),
    };
    let chroot = match chroot {
        "" | "/" => None,
        c => {
            validate_path(c).map_err(|reason| {
                connect_error(format!(
                    "the chroot {c:?} is not a valid ZooKeeper path: {reason}"
                ))
            })?;
            Some(c.to_owned())
        }
    };
    let mut hosts = Vec::new();
    for entry in hosts_part.split(',') {
        let entry = entry.trim();
        if entry.is_empty() {
            return Err(connect_error(format!(
                "{s:?} has an empty host entry; expected host:port[,host:port…][/chroot]"
            )));
        }
        hosts.push(parse_host(entry)?);
    }
    Ok(ConnectSpec { hosts, chroot })
}

fn parse_host(entry: &str) -> Result<(String, u16)> {
    let (host, port) = if let Some(rest) = entry.strip_prefix('[') {
        let close = rest.find(']').ok_or_else(|| {
            connect_error(format!(
                "{entry:?}: `[` without a closing `]` (IPv6 address)"
            ))
        })?;
        let host = &rest[..close];
        let after = &rest[close + 1..];
        let port =
            match after {
                "" => None,
                p => Some(p.strip_prefix(':').ok_or_else(|| {
                    connect_error(format!("{entry:?}: expected `:port` after `]`"))
                })?),
            };
        (host, port)
    } else {
        match entry.rsplit_once(':') {
            Some((h, _)) if h.contains(':') => {
                return Err(connect_error(format!(
                    "{entry:?}: write IPv6 addresses in brackets, e.g. [::1]:2181"
                )));
            }
            Some((h, p)) => (h, Some(p)),
            None => (entry, None),
        }
    };
    if host.is_empty() {
        return Err(connect_error(format!("{entry:?}: the host is empty")));
    }
    if host.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(connect_error(format!(
            "{entry:?}: the host contains whitespace or control characters"
        )));
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => match p.parse::<u16>() {
            Ok(0) | Err(_) => {
                return Err(connect_error(format!(
                    "{entry:?}: {p:?} is not a port number (1 to 65535)"
                )));
            }
            Ok(n) => n,
        },
    };
    Ok((host.to_owned(), port))
}

/// Characters ZooKeeper refuses in paths (besides `/` structure rules).
fn forbidden_in_path(c: char) -> bool {
    matches!(c,
        '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' | '\u{e000}'..='\u{f8ff}' | '\u{fff0}'..='\u{ffff}')
}

/// Checks an absolute ZooKeeper path other than `/`; the error says what is wrong.
pub(crate) fn validate_path(path: &str) -> std::result::Result<(), String> {
    let Some(rest) = path.strip_prefix('/') else {
        return Err("it must start with `/`".into());
    };
    if rest.is_empty() {
        return Err("`/` itself cannot be used; name a node below it, e.g. /simba".into());
    }
    if rest.ends_with('/') {
        return Err("it must not end with `/`".into());
    }
    for part in rest.split('/') {
        if part.is_empty() {
            return Err("it contains an empty segment (`//`)".into());
        }
        if part == "." || part == ".." {
            return Err("`.` and `..` segments are not allowed".into());
        }
        if let Some(c) = part.chars().find(|c| forbidden_in_path(*c)) {
            return Err(format!(
                "it contains the character {c:?}, which ZooKeeper does not allow"
            ));
        }
    }
    Ok(())
}

/// Encodes a (validated) mutex name as one ZooKeeper node name: `%`, `/` and characters
/// ZooKeeper refuses are percent-encoded (UTF-8 bytes), and the names `.` and `..` are
/// spelled `%2E` / `%2E%2E`. Names made of other characters are kept as they are, so
/// `orders` lives at `{root}/orders`.
pub(crate) fn encode_name(name: &str) -> String {
    if name == "." || name == ".." {
        return name.replace('.', "%2E");
    }
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if c == '%' || c == '/' || forbidden_in_path(c) {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(e: Error) -> &'static str {
        match e {
            Error::InvalidConfig { field, .. } => field,
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[test]
    fn defaults_validate() {
        let r = ZkConfig::new("127.0.0.1:2181")
            .resolve()
            .expect("defaults are valid");
        assert_eq!(r.hosts, vec![("127.0.0.1".to_owned(), 2181)]);
        assert_eq!(r.chroot, None);
        assert_eq!(r.base, "/simba");
    }

    #[test]
    fn permit_claim_defaults_to_the_core_claim_and_is_checked() {
        let c = ZkConfig::new("h:1");
        assert_eq!(c.permit_claim, Some(Duration::from_millis(25)));
        assert!(c.clone().with_permit_claim(None).validate().is_ok());
        for bad in [Duration::ZERO, Duration::from_micros(1500)] {
            let e = c.clone().with_permit_claim(Some(bad)).validate();
            assert_eq!(field(e.expect_err("refused")), "permit_claim");
        }
    }

    #[test]
    fn connect_strings() {
        let r = ZkConfig::new("zk://a:1, b ,[::1]:3/apps/x")
            .resolve()
            .expect("valid");
        assert_eq!(
            r.hosts,
            vec![
                ("a".to_owned(), 1),
                ("b".to_owned(), 2181),
                ("::1".to_owned(), 3)
            ]
        );
        assert_eq!(r.chroot.as_deref(), Some("/apps/x"));
        assert_eq!(r.base, "/apps/x/simba");
        assert_eq!(ZkConfig::new("h:1/").resolve().expect("valid").chroot, None);
        for bad in [
            "",
            "  ",
            "h:1,,h:2",
            "h:notaport",
            "h:0",
            "h:70000",
            "::1:2181",
            "[::1",
            "[::1]x",
            "h:1/chroot/",
            "h:1//x",
            ":2181",
            "h:1/a/../b",
        ] {
            let e = ZkConfig::new(bad).validate().expect_err(bad);
            assert_eq!(field(e), "connect", "{bad:?}");
        }
    }

    #[test]
    fn timeouts_are_checked() {
        let c = ZkConfig::new("h:1");
        let e = c
            .clone()
            .with_session_timeout(Duration::from_millis(1500))
            .validate()
            .expect_err("too short");
        assert!(e.to_string().contains("1.5 s"), "{e}");
        assert_eq!(field(e), "session_timeout");
        assert!(
            c.clone()
                .with_session_timeout(MIN_SESSION_TIMEOUT)
                .validate()
                .is_ok()
        );
        for bad in [
            c.clone()
                .with_session_timeout(MAX_SESSION_TIMEOUT + Duration::from_secs(1)),
            c.clone()
                .with_session_timeout(Duration::from_micros(2_000_500)),
        ] {
            assert_eq!(field(bad.validate().expect_err("bad")), "session_timeout");
        }
        assert_eq!(
            field(
                c.clone()
                    .with_connect_timeout(Duration::ZERO)
                    .validate()
                    .expect_err("zero")
            ),
            "connect_timeout"
        );
        assert_eq!(
            field(
                c.clone()
                    .with_session_timeout(Duration::from_secs(2))
                    .with_drift_margin(Duration::from_secs(1))
                    .validate()
                    .expect_err("margin")
            ),
            "drift_margin"
        );
    }

    #[test]
    fn roots_are_checked() {
        let c = ZkConfig::new("h:1");
        for bad in [
            "",
            "simba",
            "/",
            "/a/",
            "/a//b",
            "/a/./b",
            "/..",
            "/zookeeper",
            "/zookeeper/x",
            "/a\u{1}",
        ] {
            let e = c.clone().with_root(bad).validate().expect_err(bad);
            assert_eq!(field(e), "root", "{bad:?}");
        }
        let e = ZkConfig::new("h:1/zookeeper")
            .with_root("/x")
            .validate()
            .expect_err("chroot in /zookeeper");
        assert_eq!(field(e), "root");
        assert!(c.with_root("/a/b-c_d.e/ünï").validate().is_ok());
    }

    #[test]
    fn credentials_are_checked_and_redacted() {
        let c = ZkConfig::new("h:1").with_digest("user", "s3cret:pw");
        assert!(c.validate().is_ok());
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(
            shown.contains("user") && shown.contains("redacted"),
            "{shown}"
        );
        for (u, p) in [("", "pw"), ("a:b", "pw"), ("u", ""), ("u", "p\n")] {
            let e = ZkConfig::new("h:1")
                .with_digest(u, p)
                .validate()
                .expect_err(u);
            assert_eq!(field(e), "digest");
        }
        assert_eq!(DigestAuth::new("u", "p:q").auth_bytes(), b"u:p:q".to_vec());
    }

    #[test]
    fn names_are_encoded() {
        assert_eq!(encode_name("orders"), "orders");
        assert_eq!(encode_name("a/b"), "a%2Fb");
        assert_eq!(encode_name("100%"), "100%25");
        assert_eq!(encode_name("."), "%2E");
        assert_eq!(encode_name(".."), "%2E%2E");
        assert_eq!(encode_name("..."), "...");
        assert_eq!(encode_name("ünï:x"), "ünï:x");
        assert_eq!(encode_name("p\u{e000}"), "p%EE%80%80");
        for n in ["a/b", ".", "..", "x\u{fff0}", "ünïcode/ok:1"] {
            let path = format!("/simba/{}", encode_name(n));
            assert!(validate_path(&path).is_ok(), "{n:?} -> {path}");
        }
        assert_ne!(encode_name("a/b"), encode_name("a%2Fb"));
    }

    #[test]
    fn urls_carry_digest_credentials_and_never_show_them() {
        let c = ZkConfig::from_url("zk://app:p@ss@h1:2181,h2/apps").expect("a valid URL");
        assert_eq!(c.connect, "h1:2181,h2/apps");
        assert_eq!(c.digest, Some(DigestAuth::new("app", "p@ss")));
        assert!(c.validate().is_ok());
        let c = ZkConfig::from_url("ZooKeeper://h1").expect("a valid URL");
        assert_eq!((c.connect.as_str(), c.digest), ("h1", None));
        for bad in ["zk://justuser@h1", "redis://u:p@ss@h", "h1:2181"] {
            let e = ZkConfig::from_url(bad).expect_err(bad);
            assert!(!e.to_string().contains("p@ss"), "{e}");
            assert_eq!(field(e), "url", "{bad}");
        }
        // Credentials given as a bare connect string are refused without echoing them.
        let e = ZkConfig::new("app:s3cret@h1:2181")
            .validate()
            .expect_err("credentials in a connect string");
        assert!(!e.to_string().contains("s3cret"), "{e}");
        assert_eq!(field(e), "connect");
        assert_eq!(redact_url("zk://app:s3cret@h1/c"), "zk://app:***@h1/c");
        assert_eq!(redact_url("zk://s3cret@h1/c"), "zk://***@h1/c");
    }

    #[test]
    fn tls_urls_say_tls_is_unavailable_and_how_to_get_it() {
        for url in [
            "zks://h1:2281/apps",
            "ZooKeeper+TLS://app:s3cret@h1:2281",
            "zk://h1:2281?tls=true",
            "zk://app:s3cret@h1:2281/apps?secure=1",
        ] {
            let e = ZkConfig::from_url(url).expect_err(url);
            let m = e.to_string();
            assert!(
                m.contains("TLS to ZooKeeper is not available") && m.contains("tunnel"),
                "{url}: {m}"
            );
            assert!(!m.contains("s3cret"), "{m}");
            assert_eq!(field(e), "url", "{url}");
        }
        let e = ZkConfig::from_url("zk://h1:2181?timeout=5").expect_err("a query");
        assert!(e.to_string().contains("no query options"), "{e}");
    }
}
