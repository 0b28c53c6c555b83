//! PostgreSQL connections: the TLS options of the URL (`sslmode`, `sslrootcert`, `sslcert`,
//! `sslkey`, with libpq's meanings), and the one connector a store builds from them and
//! uses for every connection it opens (pool, LISTEN, wait queue and its cancel request,
//! floor probe).

use std::fmt;
use std::path::PathBuf;
use std::sync::Mutex as StdMutex;

use simba_core::{Error, Result};
use tokio_postgres::{CancelToken, Client, Connection, Socket};

use crate::config::{redact_url, take_query_options};

/// The URL options this crate reads itself (tokio-postgres refuses all but `sslmode`,
/// and knows no `verify-*` modes): removed from what tokio-postgres sees.
const TLS_OPTIONS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

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

/// The TLS options of a PostgreSQL URL.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct TlsOptions {
    /// `sslmode`; `None`: not given (libpq's default, `prefer`).
    pub(crate) mode: Option<SslMode>,
    /// `sslrootcert`: a PEM file of CA certificates.
    pub(crate) root_cert: Option<PathBuf>,
    /// `sslcert`: the client certificate (PEM).
    pub(crate) cert: Option<PathBuf>,
    /// `sslkey`: the client certificate's key (PEM).
    pub(crate) key: Option<PathBuf>,
}

impl TlsOptions {
    /// The mode in effect: libpq's default is `prefer`.
    pub(crate) fn mode(&self) -> SslMode {
        self.mode.unwrap_or(SslMode::Prefer)
    }
}

/// Splits a `postgres://` URL into the URL tokio-postgres is given (without this crate's
/// TLS options) and those options, checked.
pub(crate) fn split_url(url: &str) -> Result<(String, TlsOptions)> {
    let mut options = TlsOptions::default();
    let stripped = take_query_options(url, &TLS_OPTIONS, |name, value| {
        match name {
            "sslmode" => options.mode = Some(SslMode::parse(&value)?),
            "sslrootcert" => options.root_cert = Some(PathBuf::from(value)),
            "sslcert" => options.cert = Some(PathBuf::from(value)),
            _ => options.key = Some(PathBuf::from(value)),
        }
        Ok(())
    })?;
    check(&options)?;
    Ok((stripped, options))
}

/// Checks the options against each other and against this build's features.
fn check(options: &TlsOptions) -> Result<()> {
    match (&options.cert, &options.key) {
        (Some(_), None) => {
            return Err(Error::config(
                "sslkey",
                "sslcert is given without sslkey: give the client certificate's private key \
                 with sslkey=/path/client-key.pem",
            ));
        }
        (None, Some(_)) => {
            return Err(Error::config(
                "sslcert",
                "sslkey is given without sslcert: give the client certificate with \
                 sslcert=/path/client.pem",
            ));
        }
        _ => {}
    }
    let mode = options.mode();
    if mode == SslMode::Disable && (options.root_cert.is_some() || options.cert.is_some()) {
        return Err(Error::config(
            "sslmode",
            "sslmode=disable turns TLS off, but sslrootcert or sslcert is given: remove them, \
             or use sslmode=verify-full",
        ));
    }
    if !cfg!(feature = "tls")
        && (mode.needs_tls() || options.root_cert.is_some() || options.cert.is_some())
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

/// Why a PostgreSQL connection failed over TLS, or for want of TLS (the `source` of the
/// [`Error::Backend`] a failed connection gives, when the store could tell). Every case is
/// permanent: fix the setting named in the message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PgTlsFailure {
    /// The server's certificate chain does not end at a trusted CA.
    UntrustedCertificate,
    /// The server's certificate has expired (or is not valid yet).
    CertificateExpired,
    /// The server's certificate does not name the host connected to (`sslmode=verify-full`).
    NameMismatch {
        /// The host name that was checked.
        name: String,
    },
    /// The URL asks for TLS (`sslmode=require` or stricter), but the server does not offer
    /// it.
    NotOffered,
    /// The server accepts only TLS connections from this client, and the URL asks for none
    /// (`sslmode=disable`).
    Required,
    /// The server asked for a client certificate and none was given, or it rejected the
    /// one given.
    ClientCertificateRejected,
    /// Another TLS failure; the text is rustls's.
    Other(String),
}

impl fmt::Display for PgTlsFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PgTlsFailure::UntrustedCertificate => f.write_str(
                "the server's TLS certificate is not signed by a trusted CA: give the CA that \
                 signed it with sslrootcert=/path/ca.pem",
            ),
            PgTlsFailure::CertificateExpired => f.write_str(
                "the server's TLS certificate has expired or is not valid yet: renew the \
                 server's certificate (ssl_cert_file), or check this machine's clock",
            ),
            PgTlsFailure::NameMismatch { name } => write!(
                f,
                "the server's TLS certificate is not valid for the host {name:?} \
                 (sslmode=verify-full): connect with a host name the certificate carries, or \
                 use sslmode=verify-ca to check the CA only"
            ),
            PgTlsFailure::NotOffered => f.write_str(
                "the URL asks for TLS (sslmode=require or stricter) but the server does not \
                 offer it: turn on ssl in the server's postgresql.conf, or use sslmode=prefer \
                 or disable",
            ),
            PgTlsFailure::Required => f.write_str(
                "the server accepts only TLS connections from this client (pg_hba.conf \
                 hostssl): use sslmode=verify-full with sslrootcert=/path/ca.pem (or \
                 sslmode=require)",
            ),
            PgTlsFailure::ClientCertificateRejected => f.write_str(
                "the server asks for a client certificate and did not accept what was given: \
                 give one signed by a CA in its ssl_ca_file with sslcert=/path/client.pem and \
                 sslkey=/path/client-key.pem",
            ),
            PgTlsFailure::Other(text) => write!(f, "TLS failed: {text}"),
        }
    }
}

impl std::error::Error for PgTlsFailure {}

/// A failed connection: tokio-postgres's error, and what it means when the store could
/// tell.
#[derive(Debug)]
pub(crate) struct ConnectError {
    pub(crate) tls: Option<PgTlsFailure>,
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
fn classify(e: &tokio_postgres::Error) -> Option<PgTlsFailure> {
    if let Some(db) = e.as_db_error()
        && *db.code() == tokio_postgres::error::SqlState::INVALID_AUTHORIZATION_SPECIFICATION
    {
        let message = db.message();
        if message.contains("no encryption") {
            return Some(PgTlsFailure::Required);
        }
        if message.contains("certificate") {
            return Some(PgTlsFailure::ClientCertificateRejected);
        }
        return None;
    }
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.to_string().contains("server does not support TLS") {
            return Some(PgTlsFailure::NotOffered);
        }
        #[cfg(feature = "tls")]
        if let Some(found) = rustls_tls::classify(c) {
            return Some(found);
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
    last_failure: StdMutex<Option<PgTlsFailure>>,
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
        let (stripped, options) = split_url(url)?;
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
        })
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
    pub(crate) fn last_failure(&self) -> Option<PgTlsFailure> {
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
    use std::path::Path;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll};

    use rustls::client::WebPkiServerVerifier;
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::crypto::CryptoProvider;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
    use rustls::{
        AlertDescription, CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore,
        SignatureScheme,
    };
    use simba_core::{Error, Result};
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
    use tokio_postgres::Socket;
    use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

    use super::{PgTlsFailure, SslMode, TlsOptions};

    fn file_error(field: &'static str, path: &Path, what: impl std::fmt::Display) -> Error {
        Error::config(field, format!("{}: {what}", path.display()))
    }

    fn certificates(field: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>> {
        let certs = CertificateDer::pem_file_iter(path)
            .map_err(|e| file_error(field, path, format_args!("cannot be read: {e}")))?
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| file_error(field, path, format_args!("is not valid PEM: {e}")))?;
        if certs.is_empty() {
            return Err(file_error(
                field,
                path,
                "holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
            ));
        }
        Ok(certs)
    }

    fn roots(options: &TlsOptions) -> Result<RootCertStore> {
        let mut roots = RootCertStore::empty();
        match &options.root_cert {
            Some(path) => {
                for cert in certificates("sslrootcert", path)? {
                    roots.add(cert).map_err(|e| {
                        file_error(
                            "sslrootcert",
                            path,
                            format_args!("has a bad CA certificate: {e}"),
                        )
                    })?;
                }
            }
            None => {
                for cert in rustls_native_certs::load_native_certs().certs {
                    // A system store can hold certificates rustls cannot use; skip them.
                    let _ = roots.add(cert);
                }
                if roots.is_empty() {
                    return Err(Error::config(
                        "sslrootcert",
                        "no CA certificates were found on this system: give the server's CA \
                         with sslrootcert=/path/ca.pem",
                    ));
                }
            }
        }
        Ok(roots)
    }

    /// The connector of a store: one rustls configuration, built from the URL's options.
    #[derive(Clone)]
    pub(crate) struct MakeRustls {
        config: Arc<ClientConfig>,
    }

    impl MakeRustls {
        pub(crate) fn new(options: &TlsOptions) -> Result<MakeRustls> {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let mode = match options.mode() {
                // libpq: with a root certificate file, require checks as verify-ca does.
                SslMode::Require if options.root_cert.is_some() => SslMode::VerifyCa,
                mode => mode,
            };
            let verifier: Arc<dyn ServerCertVerifier> = match mode {
                SslMode::VerifyCa | SslMode::VerifyFull => {
                    let webpki = WebPkiServerVerifier::builder_with_provider(
                        Arc::new(roots(options)?),
                        provider.clone(),
                    )
                    .build()
                    .map_err(|e| {
                        Error::config("sslrootcert", format!("unusable CA certificates: {e}"))
                    })?;
                    Arc::new(Verifier {
                        chain: Some(webpki),
                        check_name: mode == SslMode::VerifyFull,
                        provider: provider.clone(),
                    })
                }
                _ => Arc::new(Verifier {
                    chain: None,
                    check_name: false,
                    provider: provider.clone(),
                }),
            };
            let builder = ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| Error::config("sslmode", format!("rustls: {e}")))?
                .dangerous()
                .with_custom_certificate_verifier(verifier);
            let config = match (&options.cert, &options.key) {
                (Some(cert), Some(key)) => {
                    let chain = certificates("sslcert", cert)?;
                    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
                        file_error(
                            "sslkey",
                            key,
                            format_args!(
                                "holds no usable PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"
                            ),
                        )
                    })?;
                    builder.with_client_auth_cert(chain, key).map_err(|e| {
                        Error::config(
                            "sslkey",
                            format!("the client key does not fit the client certificate: {e}"),
                        )
                    })?
                }
                _ => builder.with_no_client_auth(),
            };
            Ok(MakeRustls {
                config: Arc::new(config),
            })
        }
    }

    /// Checks the server's certificate as the mode asks: not at all (`prefer`, `require`),
    /// its chain (`verify-ca`), its chain and name (`verify-full`). Handshake signatures
    /// are always checked.
    #[derive(Debug)]
    struct Verifier {
        chain: Option<Arc<WebPkiServerVerifier>>,
        check_name: bool,
        provider: Arc<CryptoProvider>,
    }

    impl ServerCertVerifier for Verifier {
        fn verify_server_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            intermediates: &[CertificateDer<'_>],
            server_name: &ServerName<'_>,
            ocsp_response: &[u8],
            now: UnixTime,
        ) -> std::result::Result<ServerCertVerified, rustls::Error> {
            let Some(chain) = &self.chain else {
                return Ok(ServerCertVerified::assertion());
            };
            match chain.verify_server_cert(
                end_entity,
                intermediates,
                server_name,
                ocsp_response,
                now,
            ) {
                // webpki checks the name last, after the chain and its validity: a name
                // error means everything else was fine.
                Err(rustls::Error::InvalidCertificate(
                    CertificateError::NotValidForName
                    | CertificateError::NotValidForNameContext { .. },
                )) if !self.check_name => Ok(ServerCertVerified::assertion()),
                other => other,
            }
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(
                message,
                cert,
                dss,
                &self.provider.signature_verification_algorithms,
            )
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(
                message,
                cert,
                dss,
                &self.provider.signature_verification_algorithms,
            )
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.provider
                .signature_verification_algorithms
                .supported_schemes()
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

    /// What a rustls error (inside an I/O error, as tokio-rustls gives it) means.
    pub(super) fn classify(e: &(dyn std::error::Error + 'static)) -> Option<PgTlsFailure> {
        let rustls_error = e.downcast_ref::<rustls::Error>().or_else(|| {
            e.downcast_ref::<io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        })?;
        use rustls::Error as E;
        Some(match rustls_error {
            E::InvalidCertificate(c) => match c {
                CertificateError::Expired
                | CertificateError::ExpiredContext { .. }
                | CertificateError::NotValidYet
                | CertificateError::NotValidYetContext { .. } => PgTlsFailure::CertificateExpired,
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => {
                    PgTlsFailure::NameMismatch { name: name_of(c) }
                }
                CertificateError::UnknownIssuer | CertificateError::BadSignature => {
                    PgTlsFailure::UntrustedCertificate
                }
                other => PgTlsFailure::Other(format!("{other:?}")),
            },
            E::AlertReceived(
                AlertDescription::CertificateRequired
                | AlertDescription::BadCertificate
                | AlertDescription::UnknownCA
                | AlertDescription::CertificateUnknown,
            ) => PgTlsFailure::ClientCertificateRejected,
            other => PgTlsFailure::Other(other.to_string()),
        })
    }

    fn name_of(c: &CertificateError) -> String {
        match c {
            CertificateError::NotValidForNameContext { expected, .. } => match expected {
                ServerName::DnsName(d) => d.as_ref().to_owned(),
                ServerName::IpAddress(ip) => std::net::IpAddr::from(*ip).to_string(),
                other => format!("{other:?}"),
            },
            _ => "the host in the URL".to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(e: Error) -> (String, String) {
        match e {
            Error::InvalidConfig { field, reason } => (field.to_owned(), reason),
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[test]
    fn tls_options_are_taken_out_of_the_url() {
        // Without the `tls` feature, verify-full is refused (see the test below).
        #[cfg(feature = "tls")]
        {
            let (url, o) = split_url(
            "postgres://u:pw@h/db?application_name=x&sslmode=verify-full&sslrootcert=/a%20b/ca.pem&connect_timeout=3",
        )
        .map_err(field)
        .expect("valid");
            assert_eq!(
                url,
                "postgres://u:pw@h/db?application_name=x&connect_timeout=3"
            );
            assert_eq!(o.mode, Some(SslMode::VerifyFull));
            assert_eq!(o.root_cert, Some(PathBuf::from("/a b/ca.pem")));
        }
        let (url, o) = split_url("postgres://h/db?sslmode=disable").expect("valid");
        assert_eq!(url, "postgres://h/db");
        assert_eq!(o.mode(), SslMode::Disable);
        let (url, o) = split_url("postgres://h/db").expect("valid");
        assert_eq!(url, "postgres://h/db");
        assert_eq!(o.mode(), SslMode::Prefer);
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
