//! PostgreSQL connections: the TLS options of the URL (`sslmode`, `sslrootcert`, `sslcert`,
//! `sslkey`, with libpq's meanings), and the one connector a store builds from them and
//! uses for every connection it opens (pool, LISTEN, wait queue and its cancel request,
//! floor probe).

use std::fmt;
use std::sync::Mutex as StdMutex;

use simba_core::tls::{TlsFailure, TlsProblem};
use simba_core::{Error, Result};
use tokio_postgres::{CancelToken, Client, Connection, Socket};

use crate::url_query::redact_url;
use crate::url_tls::{TlsOptionNames, UrlTls, split_tls_options};

use super::pooler::Pooler;

/// The URL options this crate reads itself (tokio-postgres refuses all but `sslmode`,
/// and knows no `verify-*` modes): removed from what tokio-postgres sees.
const TLS_OPTIONS: TlsOptionNames = TlsOptionNames {
    mode: "sslmode",
    ca: "sslrootcert",
    cert: "sslcert",
    key: "sslkey",
};

/// `sslmode`, as libpq reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SslMode {
    /// No TLS.
    Disable,
    /// TLS if the server offers it, else plain; the certificate is not checked.
    Prefer,
    /// TLS; the certificate is not checked, unless `sslrootcert` is given (then as
    /// `VerifyCa`).
    Require,
    /// TLS; the certificate chain must end at a trusted CA.
    VerifyCa,
    /// TLS; as `VerifyCa`, and the certificate must name the host connected to.
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<SslMode> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(Error::config(
                    "sslmode",
                    format!(
                        "`{other}` is not a TLS mode: use disable, prefer, require, verify-ca \
                         or verify-full (e.g. ?sslmode=verify-full&sslrootcert=/path/ca.pem)"
                    ),
                ));
            }
        })
    }

    fn needs_tls(self) -> bool {
        matches!(
            self,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    }
}

/// The TLS options of a PostgreSQL URL (`ca`: `sslrootcert`).
pub(crate) type TlsOptions = UrlTls<SslMode>;

impl TlsOptions {
    /// The mode in effect: libpq's default is `prefer`.
    pub(crate) fn mode(&self) -> SslMode {
        self.mode.unwrap_or(SslMode::Prefer)
    }
}

/// Splits a `postgres://` URL into the URL tokio-postgres is given (without this crate's
/// TLS options) and those options, checked.
/// The pooler options (`super::pooler`) are taken out too.
pub(crate) fn split_url(url: &str) -> Result<(String, TlsOptions, Pooler)> {
    let (url, pooler) = Pooler::take(url)?;
    let (stripped, options) = split_tls_options(&url, TLS_OPTIONS, SslMode::parse)?;
    check(&options)?;
    Ok((stripped, options, pooler))
}

/// Checks the options against each other and against this build's features.
fn check(options: &TlsOptions) -> Result<()> {
    let mode = options.mode();
    if mode == SslMode::Disable && (options.ca.is_some() || options.cert.is_some()) {
        return Err(Error::config(
            "sslmode",
            "sslmode=disable turns TLS off, but sslrootcert or sslcert is given: remove them, \
             or use sslmode=verify-full",
        ));
    }
    if !cfg!(feature = "tls")
        && (mode.needs_tls() || options.ca.is_some() || options.cert.is_some())
    {
        return Err(Error::config(
            "sslmode",
            "TLS for PostgreSQL needs the cargo feature `tls` of simba-jdbc, which is not \
             enabled in this build: enable it (simba-jdbc = { features = [\"tls\"] }), or use \
             sslmode=disable",
        ));
    }
    Ok(())
}

/// What to change, in PostgreSQL's terms (libpq's URL options and the server's settings).
fn advice(problem: &TlsProblem) -> &'static str {
    match problem {
        TlsProblem::UntrustedCertificate => {
            "give the CA that signed it with sslrootcert=/path/ca.pem"
        }
        TlsProblem::CertificateExpired => {
            "renew the server's certificate (ssl_cert_file), or check this machine's clock"
        }
        TlsProblem::NameMismatch { .. } => {
            "sslmode=verify-full checks the host name: connect with a host name the \
             certificate carries, or use sslmode=verify-ca to check the CA only"
        }
        TlsProblem::NotOffered => {
            "sslmode=require or stricter asks for TLS: turn on ssl in the server's \
             postgresql.conf, or use sslmode=prefer or disable"
        }
        TlsProblem::Required => {
            "the server's pg_hba.conf allows this client only on hostssl: use \
             sslmode=verify-full with sslrootcert=/path/ca.pem (or sslmode=require)"
        }
        TlsProblem::ClientCertificateRejected => {
            "give one signed by a CA in its ssl_ca_file with sslcert=/path/client.pem and \
             sslkey=/path/client-key.pem"
        }
        _ => "",
    }
}

/// The failure of `problem`, with PostgreSQL's advice.
fn failure(problem: TlsProblem) -> TlsFailure {
    TlsFailure::new(problem, advice)
}

/// A failed connection: tokio-postgres's error, and what it means when the store could
/// tell.
#[derive(Debug)]
pub(crate) struct ConnectError {
    pub(crate) tls: Option<TlsFailure>,
    pub(crate) source: tokio_postgres::Error,
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.tls {
            Some(tls) => write!(f, "{}; {tls}", self.source),
            None => fmt::Display::fmt(&self.source, f),
        }
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.tls {
            Some(tls) => Some(tls),
            None => Some(&self.source),
        }
    }
}

/// What a server's refusal or a failed handshake means, if it is about TLS.
fn classify(e: &tokio_postgres::Error) -> Option<TlsFailure> {
    if let Some(db) = e.as_db_error()
        && *db.code() == tokio_postgres::error::SqlState::INVALID_AUTHORIZATION_SPECIFICATION
    {
        let message = db.message();
        if message.contains("no encryption") {
            return Some(failure(TlsProblem::Required));
        }
        if message.contains("certificate") {
            return Some(failure(TlsProblem::ClientCertificateRejected));
        }
        return None;
    }
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.to_string().contains("server does not support TLS") {
            return Some(failure(TlsProblem::NotOffered));
        }
        #[cfg(feature = "tls")]
        if let Some(found) = simba_core::tls::rustls_client::rustls_error(c) {
            return Some(failure(simba_core::tls::rustls_client::classify(
                found,
                "the host in the URL",
            )));
        }
        cause = c.source();
    }
    None
}

#[cfg(feature = "tls")]
type Tls = rustls_tls::MakeRustls;
#[cfg(not(feature = "tls"))]
type Tls = tokio_postgres::NoTls;

/// The stream of a connection opened by [`Connector`].
pub(crate) type PgStream = <Tls as tokio_postgres::tls::MakeTlsConnect<Socket>>::Stream;

/// Opens the connections of one store: its URL parsed once, its TLS configuration built
/// once.
pub(crate) struct Connector {
    config: tokio_postgres::Config,
    tls: Tls,
    /// What the last failed connection meant, until one succeeds: the pool's errors lose
    /// their source on the way through diesel.
    last_failure: StdMutex<Option<TlsFailure>>,
    /// What the URL says of a pooler in front of the server.
    pooler: Pooler,
}

impl fmt::Debug for Connector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connector")
            .field("ssl_mode", &self.config.get_ssl_mode())
            .finish_non_exhaustive()
    }
}

impl Connector {
    /// Parses `url` (already checked by the URL parser) and builds its TLS configuration,
    /// reading the certificate files.
    pub(crate) fn new(url: &str) -> Result<Connector> {
        let (stripped, options, pooler) = split_url(url)?;
        let mut config = stripped.parse::<tokio_postgres::Config>().map_err(|e| {
            Error::config(
                "url",
                format!("`{}` is not a valid PostgreSQL URL: {e}", redact_url(url)),
            )
        })?;
        config.ssl_mode(match options.mode() {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        });
        #[cfg(feature = "tls")]
        let tls = rustls_tls::MakeRustls::new(&options)?;
        #[cfg(not(feature = "tls"))]
        let tls = tokio_postgres::NoTls;
        Ok(Connector {
            config,
            tls,
            last_failure: StdMutex::new(None),
            pooler,
        })
    }

    /// What the URL says of a pooler in front of the server.
    pub(crate) fn pooler(&self) -> &Pooler {
        &self.pooler
    }

    /// Opens a connection (its driver is the caller's to run).
    pub(crate) async fn connect(
        &self,
    ) -> std::result::Result<(Client, Connection<Socket, PgStream>), ConnectError> {
        let result = self.config.connect(self.tls()).await;
        let mut last = self.last_failure.lock().unwrap_or_else(|p| p.into_inner());
        match result {
            Ok(pair) => {
                *last = None;
                Ok(pair)
            }
            Err(source) => {
                let tls = classify(&source);
                last.clone_from(&tls);
                Err(ConnectError { tls, source })
            }
        }
    }

    /// Opens a diesel connection (for the pool and the floor probe).
    pub(crate) async fn diesel(&self) -> diesel::ConnectionResult<diesel_async::AsyncPgConnection> {
        let (client, connection) = self
            .connect()
            .await
            .map_err(|e| diesel::ConnectionError::BadConnection(e.to_string()))?;
        diesel_async::AsyncPgConnection::try_from_client_and_connection(client, connection).await
    }

    /// Sends a cancel request for the statement running on `token`'s connection.
    pub(crate) async fn cancel(
        &self,
        token: &CancelToken,
    ) -> std::result::Result<(), tokio_postgres::Error> {
        token.cancel_query(self.tls()).await
    }

    /// The TLS connector (`NoTls`, which is `Copy`, without the `tls` feature).
    #[allow(clippy::clone_on_copy)]
    fn tls(&self) -> Tls {
        self.tls.clone()
    }

    /// What the last connection failure meant, if about TLS and none succeeded since.
    pub(crate) fn last_failure(&self) -> Option<TlsFailure> {
        self.last_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

#[cfg(feature = "tls")]
mod rustls_tls {
    use std::future::Future;
    use std::io;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll};

    use simba_core::Result;
    use simba_core::tls::rustls_client::rustls::ClientConfig;
    use simba_core::tls::rustls_client::rustls::pki_types::ServerName;
    use simba_core::tls::rustls_client::{self, ClientTls, Settings, Verify};
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
    use tokio_postgres::Socket;
    use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

    use super::{SslMode, TlsOptions};

    /// libpq's names for the TLS settings.
    const SETTINGS: Settings = Settings {
        ca_file: "sslrootcert",
        cert_file: "sslcert",
        key_file: "sslkey",
        server_name: "host",
        mode: "sslmode",
        ca_example: "sslrootcert=/path/ca.pem",
    };

    /// The connector of a store: one rustls configuration, built from the URL's options.
    #[derive(Clone)]
    pub(crate) struct MakeRustls {
        config: Arc<ClientConfig>,
    }

    impl MakeRustls {
        /// Checks the server's certificate as the mode asks: not at all (`prefer`,
        /// `require`), its chain (`verify-ca`, and `require` with `sslrootcert`, as libpq
        /// does), its chain and name (`verify-full`).
        pub(crate) fn new(options: &TlsOptions) -> Result<MakeRustls> {
            let verify = match options.mode() {
                SslMode::VerifyFull => Verify::ChainAndName,
                SslMode::VerifyCa => Verify::Chain,
                SslMode::Require if options.ca.is_some() => Verify::Chain,
                _ => Verify::Nothing,
            };
            let config = rustls_client::client_config(&ClientTls {
                verify,
                ca_file: options.ca.as_deref(),
                client: options.cert.as_deref().zip(options.key.as_deref()),
                server_name: None,
                settings: SETTINGS,
            })?;
            Ok(MakeRustls {
                config: Arc::new(config),
            })
        }
    }

    impl MakeTlsConnect<Socket> for MakeRustls {
        type Stream = RustlsStream;
        type TlsConnect = RustlsConnect;
        type Error = io::Error;

        fn make_tls_connect(&mut self, domain: &str) -> io::Result<RustlsConnect> {
            let name = ServerName::try_from(domain.to_owned()).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{domain:?} is not a DNS name or IP address"),
                )
            })?;
            Ok(RustlsConnect {
                config: self.config.clone(),
                name,
            })
        }
    }

    /// One TLS handshake, to the host named.
    pub(crate) struct RustlsConnect {
        config: Arc<ClientConfig>,
        name: ServerName<'static>,
    }

    impl TlsConnect<Socket> for RustlsConnect {
        type Stream = RustlsStream;
        type Error = io::Error;
        type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream>> + Send>>;

        fn connect(self, stream: Socket) -> Self::Future {
            Box::pin(async move {
                tokio_rustls::TlsConnector::from(self.config)
                    .connect(self.name, stream)
                    .await
                    .map(|s| RustlsStream(Box::new(s)))
            })
        }
    }

    /// A TLS connection to a PostgreSQL server.
    pub(crate) struct RustlsStream(Box<tokio_rustls::client::TlsStream<Socket>>);

    impl AsyncRead for RustlsStream {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut *self.0).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for RustlsStream {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut *self.0).poll_write(cx, buf)
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut *self.0).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut *self.0).poll_shutdown(cx)
        }
    }

    impl tokio_postgres::tls::TlsStream for RustlsStream {
        fn channel_binding(&self) -> ChannelBinding {
            // No tls-server-end-point binding: SCRAM runs without channel binding.
            ChannelBinding::none()
        }
    }
}

/// Checks what tokio-postgres would refuse only when connecting (no host, more ports than
/// hosts), so that a bad URL is an [`Error::InvalidConfig`] naming the problem rather than
/// a connection failure that says "invalid configuration".
pub(crate) fn check_url(url: &str) -> Result<()> {
    let bad = |what: String| {
        Err(Error::config(
            "url",
            format!(
                "`{}` is not a valid PostgreSQL URL: {what}; write \
                 postgres://USER:PASSWORD@HOST:PORT/DATABASE",
                redact_url(url)
            ),
        ))
    };
    // The TLS options are this crate's (tokio-postgres knows only some of them).
    let (stripped, _, pooler) = split_url(url)?;
    if let Some(direct) = &pooler.direct_url {
        check_url(direct)?;
    }
    let config = match stripped.parse::<tokio_postgres::Config>() {
        Ok(c) => c,
        Err(e) => {
            // tokio-postgres keeps the detail ("invalid value for option `port`") in the
            // source, not in its message.
            return match std::error::Error::source(&e) {
                Some(cause) => bad(format!("{e} ({cause})")),
                None => bad(e.to_string()),
            };
        }
    };
    if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
        return bad("it names no host".to_owned());
    }
    let (hosts, ports) = (config.get_hosts().len(), config.get_ports().len());
    if ports > 1 && ports != hosts {
        return bad(format!("{hosts} hosts but {ports} ports"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::url_query::invalid_config as field;

    #[test]
    fn tls_options_are_taken_out_of_the_url() {
        // Without the `tls` feature, verify-full is refused (see the test below).
        #[cfg(feature = "tls")]
        {
            let (url, o, _) = split_url(
            "postgres://u:pw@h/db?application_name=x&sslmode=verify-full&sslrootcert=/a%20b/ca.pem&connect_timeout=3",
        )
        .map_err(field)
        .expect("valid");
            assert_eq!(
                url,
                "postgres://u:pw@h/db?application_name=x&connect_timeout=3"
            );
            assert_eq!(o.mode, Some(SslMode::VerifyFull));
            assert_eq!(o.ca, Some(std::path::PathBuf::from("/a b/ca.pem")));
        }
        let (url, o, _) = split_url("postgres://h/db?sslmode=disable").expect("valid");
        assert_eq!(url, "postgres://h/db");
        assert_eq!(o.mode(), SslMode::Disable);
        let (url, o, _) = split_url("postgres://h/db").expect("valid");
        assert_eq!(url, "postgres://h/db");
        assert_eq!(o.mode(), SslMode::Prefer);
        let (url, o, p) =
            split_url("postgres://h:6432/db?simba_pooler=transaction&sslmode=disable")
                .expect("valid");
        assert_eq!(url, "postgres://h:6432/db");
        assert_eq!(o.mode(), SslMode::Disable);
        assert!(p.transaction);
    }

    #[test]
    fn bad_tls_options_name_the_option_and_the_fix() {
        let (f, msg) =
            field(split_url("postgres://u:hunter2@h/db?sslmode=verify").expect_err("mode"));
        assert_eq!(f, "sslmode");
        assert!(
            msg.contains("verify-full") && !msg.contains("hunter2"),
            "{msg}"
        );
        let (f, msg) =
            field(split_url("postgres://u:hunter2@h/db?sslcert=/c.pem").expect_err("no key"));
        assert_eq!(f, "sslkey");
        assert!(msg.contains("sslkey=") && !msg.contains("hunter2"), "{msg}");
        let (f, _) = field(split_url("postgres://h/db?sslkey=/k.pem").expect_err("no cert"));
        assert_eq!(f, "sslcert");
        let (f, _) = field(
            split_url("postgres://h/db?sslmode=disable&sslrootcert=/ca.pem").expect_err("off"),
        );
        assert_eq!(f, "sslmode");
        let (f, msg) =
            field(split_url("postgres://u:hunter2@h/db?sslrootcert=").expect_err("empty"));
        assert_eq!(f, "sslrootcert");
        assert!(!msg.contains("hunter2"), "{msg}");
        let (f, _) = field(split_url("postgres://h/db?sslrootcert=%zz").expect_err("escape"));
        assert_eq!(f, "sslrootcert");
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn tls_without_the_feature_says_to_enable_it() {
        for url in [
            "postgres://h/db?sslmode=require",
            "postgres://h/db?sslmode=verify-full",
            "postgres://h/db?sslrootcert=/ca.pem",
        ] {
            let (f, msg) = field(split_url(url).expect_err(url));
            assert_eq!(f, "sslmode");
            assert!(msg.contains("feature `tls`"), "{msg}");
        }
        split_url("postgres://h/db?sslmode=prefer").expect("prefer is plain without TLS");
    }

    #[cfg(feature = "tls")]
    #[test]
    fn missing_certificate_files_are_config_errors() {
        let (f, msg) = field(
            Connector::new("postgres://h/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem")
                .expect_err("missing file"),
        );
        assert_eq!(f, "sslrootcert");
        assert!(msg.contains("/nonexistent/ca.pem"), "{msg}");
    }
}
