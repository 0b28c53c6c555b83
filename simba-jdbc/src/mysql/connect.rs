//! MySQL / MariaDB connections: the TLS options of the URL (`ssl-mode`, `ssl-ca`,
//! `ssl-cert`, `ssl-key`, with the MySQL client's names and meanings), and the
//! `mysql_async` options every connection of a store is opened with (pool, `GET_LOCK`
//! session and its `KILL QUERY` connection, floor probe).

use simba_core::tls::{TlsFailure, TlsProblem};
use simba_core::{Error, Result};

use crate::url_query::redact_url;
use crate::url_tls::{TlsOptionNames, UrlTls, split_tls_options};

/// The URL options this crate reads itself (mysql_async refuses them): removed from what
/// mysql_async sees.
const TLS_OPTIONS: TlsOptionNames = TlsOptionNames {
    mode: "ssl-mode",
    ca: "ssl-ca",
    cert: "ssl-cert",
    key: "ssl-key",
};

/// `ssl-mode`, as the MySQL client reads it (upper or lower case).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SslMode {
    /// No TLS (also when `ssl-mode` is not given).
    Disabled,
    /// TLS; the certificate is not checked, unless `ssl-ca` is given (then as `VerifyCa`).
    Required,
    /// TLS; the certificate chain must end at a trusted CA; the host name is not checked
    /// (asked of mysql_async, which with rustls 0.23 checks it anyway: see the README).
    VerifyCa,
    /// TLS; as `VerifyCa`, and the certificate must name the host connected to.
    VerifyIdentity,
}

impl SslMode {
    fn parse(value: &str) -> Result<SslMode> {
        Ok(match value.to_ascii_uppercase().as_str() {
            "DISABLED" => SslMode::Disabled,
            "REQUIRED" => SslMode::Required,
            "VERIFY_CA" => SslMode::VerifyCa,
            "VERIFY_IDENTITY" => SslMode::VerifyIdentity,
            // mysql_async cannot fall back to a plain connection when the server has no
            // TLS: refused rather than silently turned into REQUIRED.
            "PREFERRED" => {
                return Err(Error::config(
                    "ssl-mode",
                    "ssl-mode=PREFERRED is not supported (the driver cannot fall back to a \
                     plain connection): use REQUIRED, VERIFY_CA or VERIFY_IDENTITY for TLS, \
                     or DISABLED",
                ));
            }
            _ => {
                return Err(Error::config(
                    "ssl-mode",
                    format!(
                        "`{value}` is not a TLS mode: use DISABLED, REQUIRED, VERIFY_CA or \
                         VERIFY_IDENTITY (e.g. ?ssl-mode=VERIFY_IDENTITY&ssl-ca=/path/ca.pem)"
                    ),
                ));
            }
        })
    }
}

/// The TLS options of a MySQL URL.
pub(crate) type TlsOptions = UrlTls<SslMode>;

impl TlsOptions {
    /// The mode in effect: no TLS unless asked for.
    pub(crate) fn mode(&self) -> SslMode {
        self.mode.unwrap_or(SslMode::Disabled)
    }
}

/// Splits a `mysql://` URL into the URL mysql_async is given (without this crate's TLS
/// options) and those options, checked.
pub(crate) fn split_url(url: &str) -> Result<(String, TlsOptions)> {
    let (stripped, options) = split_tls_options(url, TLS_OPTIONS, SslMode::parse)?;
    check(&options)?;
    Ok((stripped, options))
}

/// Checks the options against each other, against this build's features and that the
/// files named can be read.
fn check(options: &TlsOptions) -> Result<()> {
    let mode = options.mode();
    if mode == SslMode::Disabled && (options.ca.is_some() || options.cert.is_some()) {
        return Err(Error::config(
            "ssl-mode",
            "TLS is off (ssl-mode=DISABLED or not given), but ssl-ca or ssl-cert is given: \
             remove them, or use ssl-mode=VERIFY_IDENTITY",
        ));
    }
    if !cfg!(feature = "tls") && mode != SslMode::Disabled {
        return Err(Error::config(
            "ssl-mode",
            "TLS for MySQL needs the cargo feature `tls` of simba-jdbc, which is not enabled \
             in this build: enable it (simba-jdbc = { features = [\"tls\"] }), or use \
             ssl-mode=DISABLED",
        ));
    }
    for (field, path) in [
        ("ssl-ca", &options.ca),
        ("ssl-cert", &options.cert),
        ("ssl-key", &options.key),
    ] {
        if let Some(path) = path
            && let Err(e) = std::fs::File::open(path)
        {
            return Err(Error::config(
                field,
                format!("{}: cannot be read: {e}", path.display()),
            ));
        }
    }
    if let Some(path) = &options.key {
        // mysql_async reads only PKCS#1 RSA keys (PEM, or DER); anything else would fail
        // every connection with "no private key found".
        let bytes = std::fs::read(path).map_err(|e| {
            Error::config(
                "ssl-key",
                format!("{}: cannot be read: {e}", path.display()),
            )
        })?;
        if let Ok(text) = std::str::from_utf8(&bytes)
            && !text.contains("-----BEGIN RSA PRIVATE KEY-----")
        {
            return Err(Error::config(
                "ssl-key",
                format!(
                    "{}: the MySQL driver reads only RSA keys in PKCS#1 PEM form \
                     (-----BEGIN RSA PRIVATE KEY-----); convert an RSA key with \
                     `openssl pkey -in KEY -traditional`, other key types are not supported",
                    path.display()
                ),
            ));
        }
    }
    Ok(())
}

/// The mysql_async options for a (checked) `mysql://` URL: its own options, this crate's
/// TLS options, and matched-row counts (`client_found_rows`, as diesel-async sets them).
pub(crate) fn opts(url: &str) -> Result<mysql_async::Opts> {
    let (stripped, tls) = split_url(url)?;
    let opts = mysql_async::Opts::from_url(&stripped).map_err(|e| {
        Error::config(
            "url",
            format!("`{}` is not a valid MySQL URL: {e}", redact_url(url)),
        )
    })?;
    let builder = mysql_async::OptsBuilder::from_opts(opts).client_found_rows(true);
    Ok(with_tls(builder, &tls).into())
}

#[cfg(feature = "tls")]
fn with_tls(builder: mysql_async::OptsBuilder, tls: &TlsOptions) -> mysql_async::OptsBuilder {
    use mysql_async::{ClientIdentity, SslOpts};
    let mode = tls.mode();
    if mode == SslMode::Disabled {
        return builder.ssl_opts(None::<SslOpts>);
    }
    let mut ssl = SslOpts::default();
    if let Some(ca) = &tls.ca {
        ssl = ssl
            .with_root_certs(vec![ca.clone().into()])
            .with_disable_built_in_roots(true);
    }
    if let (Some(cert), Some(key)) = (&tls.cert, &tls.key) {
        ssl = ssl.with_client_identity(Some(ClientIdentity::new(
            cert.clone().into(),
            key.clone().into(),
        )));
    }
    // mysql_async would switch a local server to its Unix socket, where it does no TLS.
    let builder = builder.prefer_socket(false);
    ssl = match mode {
        // REQUIRED with ssl-ca checks the chain, as libpq's `require` does.
        SslMode::Required if tls.ca.is_none() => ssl.with_danger_accept_invalid_certs(true),
        SslMode::Required | SslMode::VerifyCa => ssl.with_danger_skip_domain_validation(true),
        SslMode::VerifyIdentity | SslMode::Disabled => ssl,
    };
    builder.ssl_opts(ssl)
}

#[cfg(not(feature = "tls"))]
fn with_tls(builder: mysql_async::OptsBuilder, _tls: &TlsOptions) -> mysql_async::OptsBuilder {
    // `check` refused any mode but DISABLED in this build.
    builder
}

/// What to change, in the MySQL client's terms (its URL options).
fn advice(problem: &TlsProblem) -> &'static str {
    match problem {
        TlsProblem::UntrustedCertificate => "give the CA that signed it with ssl-ca=/path/ca.pem",
        TlsProblem::CertificateExpired => {
            "renew the server's certificate (ssl-cert), or check this machine's clock"
        }
        TlsProblem::NameMismatch { .. } => "connect with a host name the certificate carries",
        TlsProblem::NotOffered => {
            "ssl-mode=REQUIRED or stricter asks for TLS: give the server ssl-cert and \
             ssl-key, or use ssl-mode=DISABLED"
        }
        // MySQL's `require_secure_transport` (error 3159). MariaDB answers "Access denied"
        // instead, which cannot be told from a wrong password: not classified.
        TlsProblem::Required => {
            "use ssl-mode=VERIFY_IDENTITY with ssl-ca=/path/ca.pem (or ssl-mode=REQUIRED)"
        }
        _ => "",
    }
}

/// What a failed connection's message means, if it is about TLS (mysql_async keeps no
/// typed cause through the pool: read from the driver's message).
pub(crate) fn classify(message: &str) -> Option<TlsFailure> {
    let problem = if message.contains("certificate expired")
        || message.contains("certificate not valid yet")
    {
        TlsProblem::CertificateExpired
    } else if let Some((_, rest)) = message.split_once("certificate not valid for name \"") {
        TlsProblem::NameMismatch {
            name: rest.split('"').next().unwrap_or_default().to_owned(),
        }
    } else if message.contains("UnknownIssuer") || message.contains("unknown issuer") {
        TlsProblem::UntrustedCertificate
    } else if message.contains("server does not have this capability") {
        TlsProblem::NotOffered
    } else if message.contains("insecure transport") {
        TlsProblem::Required
    } else {
        return None;
    };
    Some(TlsFailure::new(problem, advice))
}

/// A diesel connection opened with [`opts`] (the setup queries of diesel-async's
/// `establish` are run by `try_from`).
pub(crate) async fn diesel(
    url: &str,
) -> diesel::ConnectionResult<diesel_async::AsyncMysqlConnection> {
    let opts =
        opts(url).map_err(|e| diesel::ConnectionError::InvalidConnectionUrl(e.to_string()))?;
    let opts = mysql_async::OptsBuilder::from_opts(opts).stmt_cache_size(0);
    let conn = mysql_async::Conn::new(opts)
        .await
        .map_err(|e| diesel::ConnectionError::BadConnection(e.to_string()))?;
    diesel_async::AsyncMysqlConnection::try_from(conn).await
}

/// Checks a MySQL URL without connecting: the TLS options are this crate's (mysql_async
/// refuses them); [`opts`] checks both.
pub(crate) fn check_url(url: &str) -> Result<()> {
    opts(url).map(|_| ())
}

#[cfg(test)]
// Tests fail by panicking; unwrap on a setup step is the clearest report.
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn field(e: Error) -> (String, String) {
        match e {
            Error::InvalidConfig { field, reason } => (field.to_owned(), reason),
            other => panic!("not a config error: {other:?}"),
        }
    }

    #[test]
    fn driver_messages_are_classified() {
        let c = |m: &str| classify(m).map(|f| f.problem().clone());
        assert_eq!(
            c(
                "Input/output error: invalid peer certificate: certificate expired: verification time 1"
            ),
            Some(TlsProblem::CertificateExpired)
        );
        assert_eq!(
            c(
                "invalid peer certificate: certificate not valid for name \"127.0.0.1\"; certificate is only valid for DnsName(\"x\")"
            ),
            Some(TlsProblem::NameMismatch {
                name: "127.0.0.1".to_owned()
            })
        );
        assert_eq!(
            c("invalid peer certificate: UnknownIssuer"),
            Some(TlsProblem::UntrustedCertificate)
        );
        assert_eq!(
            c("Client asked for SSL but server does not have this capability"),
            Some(TlsProblem::NotOffered)
        );
        assert_eq!(c("Access denied for user 'root'@'127.0.0.1'"), None);
    }

    #[test]
    fn tls_options_are_taken_out_of_the_url() {
        // Without the `tls` feature, a TLS mode is refused (see the test below).
        #[cfg(feature = "tls")]
        {
            let (url, o) =
                split_url("mysql://u:p@h/db?ssl-mode=verify_identity&pool_min=1&ssl-ca=/dev/null")
                    .unwrap();
            assert_eq!(url, "mysql://u:p@h/db?pool_min=1");
            assert_eq!(o.mode, Some(SslMode::VerifyIdentity));
            assert_eq!(o.ca, Some(std::path::PathBuf::from("/dev/null")));
        }
        let (url, o) = split_url("mysql://u@h/db").unwrap();
        assert_eq!(url, "mysql://u@h/db");
        assert_eq!(o.mode(), SslMode::Disabled);
        let (url, _) = split_url("mysql://u@h/db?ssl-mode=DISABLED").unwrap();
        assert_eq!(url, "mysql://u@h/db");
    }

    #[test]
    fn bad_tls_options_name_the_option() {
        let (f, r) = field(split_url("mysql://u:hunter2@h/db?ssl-mode=sometimes").unwrap_err());
        assert_eq!(f, "ssl-mode");
        assert!(r.contains("VERIFY_IDENTITY"), "{r}");
        let (f, r) = field(split_url("mysql://u:hunter2@h/db?ssl-mode=PREFERRED").unwrap_err());
        assert_eq!(f, "ssl-mode");
        assert!(r.contains("not supported"), "{r}");
        let (f, r) = field(split_url("mysql://u:hunter2@h/db?ssl-mode=&x=1").unwrap_err());
        assert_eq!(f, "ssl-mode");
        assert!(!r.contains("hunter2"), "{r}");
        let (f, _) =
            field(split_url("mysql://u@h/db?ssl-mode=REQUIRED&ssl-cert=/dev/null").unwrap_err());
        assert_eq!(f, "ssl-key");
        let (f, _) =
            field(split_url("mysql://u@h/db?ssl-mode=REQUIRED&ssl-key=/dev/null").unwrap_err());
        assert_eq!(f, "ssl-cert");
        let (f, _) = field(split_url("mysql://u@h/db?ssl-ca=/dev/null").unwrap_err());
        assert_eq!(f, "ssl-mode");
        // With the `tls` feature only: without it, the mode is refused first.
        #[cfg(feature = "tls")]
        {
            let (f, r) = field(
                split_url("mysql://u@h/db?ssl-mode=VERIFY_CA&ssl-ca=/nonexistent/ca.pem")
                    .unwrap_err(),
            );
            assert_eq!(f, "ssl-ca");
            assert!(r.contains("/nonexistent/ca.pem"), "{r}");
            let dir = tempfile::tempdir().unwrap();
            let key = dir.path().join("key.pem");
            std::fs::write(&key, "-----BEGIN PRIVATE KEY-----\n").unwrap();
            let (f, r) = field(
                split_url(&format!(
                    "mysql://u@h/db?ssl-mode=REQUIRED&ssl-cert=/dev/null&ssl-key={}",
                    key.display()
                ))
                .unwrap_err(),
            );
            assert_eq!(f, "ssl-key");
            assert!(r.contains("PKCS#1"), "{r}");
        }
    }

    #[test]
    fn tls_without_the_feature_says_to_enable_it() {
        let got = split_url("mysql://u@h/db?ssl-mode=REQUIRED");
        if cfg!(feature = "tls") {
            assert!(got.is_ok());
        } else {
            let (f, r) = field(got.unwrap_err());
            assert_eq!(f, "ssl-mode");
            assert!(r.contains("`tls`"), "{r}");
        }
    }

    #[cfg(feature = "tls")]
    #[test]
    fn modes_map_to_driver_options() {
        let ssl = |url: &str| opts(url).unwrap().ssl_opts().cloned();
        assert!(ssl("mysql://u@h/db").is_none());
        let s = ssl("mysql://u@h/db?ssl-mode=required").unwrap();
        assert!(s.accept_invalid_certs());
        let s = ssl("mysql://u@h/db?ssl-mode=required&ssl-ca=/dev/null").unwrap();
        assert!(!s.accept_invalid_certs() && s.skip_domain_validation());
        assert!(s.disable_built_in_roots());
        let s = ssl("mysql://u@h/db?ssl-mode=VERIFY_CA").unwrap();
        assert!(!s.accept_invalid_certs() && s.skip_domain_validation());
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key.pem");
        std::fs::write(&key, "-----BEGIN RSA PRIVATE KEY-----\n").unwrap();
        let s = ssl(&format!(
            "mysql://u@h/db?ssl-mode=VERIFY_IDENTITY&ssl-cert=/dev/null&ssl-key={}",
            key.display()
        ))
        .unwrap();
        assert!(!s.accept_invalid_certs() && !s.skip_domain_validation());
        assert!(s.client_identity().is_some());
        assert!(opts("mysql://u@h/db").unwrap().client_found_rows());
        assert!(
            !opts("mysql://u@h/db?ssl-mode=REQUIRED")
                .unwrap()
                .prefer_socket()
        );
    }
}
