//! TLS: the rustls client configuration (feature `tls`), and telling *why* a connection
//! failed — a certificate problem, or one side speaking TLS and the other not — so that the
//! error says what to fix.

use std::fmt;
use std::time::Duration;

use simba_core::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::BACKEND;

/// Why a TLS connection failed (the `source` of the [`Error::Backend`] a failed connect
/// returns, when the store could tell). Every case is permanent: fix the setting named
/// in the message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TlsFailure {
    /// The server's certificate chain does not end at a trusted CA.
    UntrustedCertificate,
    /// The server's certificate has expired (or is not valid yet).
    CertificateExpired,
    /// The server's certificate does not name the host connected to.
    NameMismatch {
        /// The name that was checked.
        name: String,
    },
    /// The URL asks for TLS (`rediss://`), but the server did not answer TLS on that port.
    NotOffered,
    /// The URL asks for no TLS (`redis://`), but the server only speaks TLS on that port.
    Required,
    /// The server asked for a client certificate and none was given, or it rejected the
    /// one given.
    ClientCertificateRejected,
    /// Another TLS failure; the text is rustls's.
    Other(String),
}

impl fmt::Display for TlsFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TlsFailure::UntrustedCertificate => f.write_str(
                "the server's TLS certificate is not signed by a trusted CA: give the CA that \
                 signed it with tlsCaFile=/path/ca.pem (TlsOptions::ca_file)",
            ),
            TlsFailure::CertificateExpired => f.write_str(
                "the server's TLS certificate has expired or is not valid yet: renew the \
                 server's certificate (or check this machine's clock)",
            ),
            TlsFailure::NameMismatch { name } => write!(
                f,
                "the server's TLS certificate is not valid for {name:?}: connect with a name \
                 the certificate carries, or give that name with tlsServerName=NAME \
                 (TlsOptions::server_name)"
            ),
            TlsFailure::NotOffered => f.write_str(
                "the URL asks for TLS but the server does not speak TLS on this port: use \
                 redis:// for this port, or the port the server gives to `tls-port`",
            ),
            TlsFailure::Required => f.write_str(
                "the server speaks only TLS on this port: use rediss:// (with tlsCaFile=… if \
                 its certificate is not signed by a system CA)",
            ),
            TlsFailure::ClientCertificateRejected => f.write_str(
                "the server asks for a client certificate and did not accept what was given: \
                 give one it trusts with tlsCertFile=… and tlsKeyFile=…",
            ),
            TlsFailure::Other(text) => write!(f, "TLS failed: {text}"),
        }
    }
}

impl std::error::Error for TlsFailure {}

impl TlsFailure {
    pub(crate) fn into_error(self, what: &str) -> Error {
        Error::backend_source(BACKEND, format!("{what}: {self}"), false, self)
    }
}

/// How long a diagnosis may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// After a `rediss://` connection failed: whether the server at `host:port` answers a
/// plain `PING` (with `+PONG` or an error such as `-NOAUTH`): then it does not speak TLS
/// there. (A plain server cannot reject a TLS handshake: it waits for the end of a line
/// that never comes, so the handshake only times out.)
#[cfg(feature = "tls")]
pub(crate) async fn speaks_plain(host: &str, port: u16) -> bool {
    let probe = async {
        let mut stream = TcpStream::connect((host, port)).await.ok()?;
        stream.write_all(b"*1\r\n$4\r\nPING\r\n").await.ok()?;
        let mut buf = [0u8; 1];
        match stream.read(&mut buf).await {
            Ok(1) => Some(matches!(buf[0], b'+' | b'-')),
            _ => Some(false),
        }
    };
    tokio::time::timeout(PROBE_TIMEOUT, probe)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// After a plain (`redis://`) connection failed: whether the server at `host:port` speaks
/// only TLS there. A TLS server answers a `PING` by closing the connection, with a TLS
/// alert or nothing at all, where a Redis server answers `+PONG` (or an error).
pub(crate) async fn plain_probe(host: &str, port: u16) -> Option<TlsFailure> {
    let probe = async {
        let mut stream = TcpStream::connect((host, port)).await.ok()?;
        stream.write_all(b"*1\r\n$4\r\nPING\r\n").await.ok()?;
        let mut buf = [0u8; 64];
        match stream.read(&mut buf).await {
            // A TLS record (alert 0x15 or handshake 0x16, version 3.x): a TLS server.
            Ok(n) if n >= 2 && matches!(buf[0], 0x15 | 0x16) && buf[1] == 3 => {
                Some(TlsFailure::Required)
            }
            // Closed without a RESP answer.
            Ok(0) => Some(TlsFailure::Required),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Some(TlsFailure::Required),
            _ => None,
        }
    };
    tokio::time::timeout(PROBE_TIMEOUT, probe)
        .await
        .ok()
        .flatten()
}

#[cfg(feature = "tls")]
pub(crate) use with_rustls::{client_config, tls_probe};

#[cfg(feature = "tls")]
mod with_rustls {
    use std::path::Path;
    use std::sync::Arc;

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
    use tokio::net::TcpStream;

    use super::{PROBE_TIMEOUT, TlsFailure};
    use crate::config::TlsOptions;

    fn provider() -> Arc<CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    fn file_error(field: &'static str, path: &Path, what: impl fmt::Display) -> Error {
        Error::config(field, format!("{}: {what}", path.display()))
    }

    use std::fmt;

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

    /// The rustls configuration for `tls`: its CA file or the system's roots, its client
    /// certificate, its server name.
    pub(crate) fn client_config(tls: &TlsOptions) -> Result<ClientConfig> {
        let provider = provider();
        let mut roots = RootCertStore::empty();
        match &tls.ca_file {
            Some(path) => {
                for cert in certificates("tls.ca_file", path)? {
                    roots.add(cert).map_err(|e| {
                        file_error(
                            "tls.ca_file",
                            path,
                            format_args!("has a bad CA certificate: {e}"),
                        )
                    })?;
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                for cert in found.certs {
                    // A system store can hold certificates rustls cannot use; skip them.
                    let _ = roots.add(cert);
                }
                if roots.is_empty() {
                    return Err(Error::config(
                        "tls.ca_file",
                        "no CA certificates were found on this system; give the server's CA \
                         with tlsCaFile=/path/ca.pem",
                    ));
                }
            }
        }
        let verifier =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| {
                    Error::config("tls.ca_file", format!("unusable CA certificates: {e}"))
                })?;
        let verifier: Arc<dyn ServerCertVerifier> = match &tls.server_name {
            Some(name) => {
                let name = ServerName::try_from(name.clone()).map_err(|_| {
                    Error::config(
                        "tls.server_name",
                        format!("{name:?} is not a DNS name or IP address"),
                    )
                })?;
                Arc::new(FixedName {
                    inner: verifier,
                    name,
                })
            }
            None => verifier,
        };
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::config("tls", format!("rustls: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        match (&tls.cert_file, &tls.key_file) {
            (Some(cert), Some(key)) => {
                let chain = certificates("tls.cert_file", cert)?;
                let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
                    file_error(
                        "tls.key_file",
                        key,
                        format_args!(
                            "holds no usable PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"
                        ),
                    )
                })?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    Error::config(
                        "tls.key_file",
                        format!("the client key does not fit the client certificate: {e}"),
                    )
                })
            }
            _ => Ok(builder.with_no_client_auth()),
        }
    }

    /// Verifies the server's certificate against one fixed name, whatever host was dialled
    /// (`tlsServerName`).
    #[derive(Debug)]
    struct FixedName {
        inner: Arc<WebPkiServerVerifier>,
        name: ServerName<'static>,
    }

    impl ServerCertVerifier for FixedName {
        fn verify_server_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            intermediates: &[CertificateDer<'_>],
            _server_name: &ServerName<'_>,
            ocsp_response: &[u8],
            now: UnixTime,
        ) -> std::result::Result<ServerCertVerified, rustls::Error> {
            self.inner
                .verify_server_cert(end_entity, intermediates, &self.name, ocsp_response, now)
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            self.inner.verify_tls12_signature(message, cert, dss)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            self.inner.verify_tls13_signature(message, cert, dss)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.inner.supported_verify_schemes()
        }
    }

    fn classify(e: &rustls::Error, name: &str) -> TlsFailure {
        use rustls::Error as E;
        match e {
            E::InvalidCertificate(c) => match c {
                CertificateError::Expired
                | CertificateError::ExpiredContext { .. }
                | CertificateError::NotValidYet
                | CertificateError::NotValidYetContext { .. } => TlsFailure::CertificateExpired,
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => TlsFailure::NameMismatch {
                    name: name.to_owned(),
                },
                CertificateError::UnknownIssuer | CertificateError::BadSignature => {
                    TlsFailure::UntrustedCertificate
                }
                other => TlsFailure::Other(format!("{other:?}")),
            },
            E::InvalidMessage(_) => TlsFailure::NotOffered,
            E::AlertReceived(
                AlertDescription::CertificateRequired
                | AlertDescription::BadCertificate
                | AlertDescription::UnknownCA
                | AlertDescription::CertificateUnknown
                | AlertDescription::HandshakeFailure,
            ) => TlsFailure::ClientCertificateRejected,
            other => TlsFailure::Other(other.to_string()),
        }
    }

    /// After a `rediss://` connection failed: one TLS handshake (and a `PING`) to
    /// `host:port` with `config`, to tell what went wrong.
    pub(crate) async fn tls_probe(
        config: Arc<ClientConfig>,
        host: &str,
        port: u16,
        tls: &TlsOptions,
    ) -> Option<TlsFailure> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let name = tls.server_name.clone().unwrap_or_else(|| host.to_owned());
        let server_name = ServerName::try_from(name.clone()).ok()?;
        let probe = async {
            let stream = TcpStream::connect((host, port)).await.ok()?;
            let connector = tokio_rustls::TlsConnector::from(config);
            let mut stream = match connector.connect(server_name, stream).await {
                Ok(s) => s,
                Err(e) => {
                    let inner = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>());
                    return Some(match inner {
                        Some(e) => classify(e, &name),
                        // Closed during the handshake: a plain server drops a connection
                        // that starts with garbage.
                        None if matches!(
                            e.kind(),
                            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                        ) =>
                        {
                            TlsFailure::NotOffered
                        }
                        None => return None,
                    });
                }
            };
            // TLS 1.3 servers check the client certificate after the handshake: a PING
            // shows whether the server kept the connection.
            stream.write_all(b"*1\r\n$4\r\nPING\r\n").await.ok()?;
            let mut buf = [0u8; 16];
            match stream.read(&mut buf).await {
                Ok(n) if n > 0 => None,
                Err(e) => match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
                    Some(e) => Some(classify(e, &name)),
                    None => Some(TlsFailure::ClientCertificateRejected),
                },
                Ok(_) => Some(TlsFailure::ClientCertificateRejected),
            }
        };
        tokio::time::timeout(PROBE_TIMEOUT, probe)
            .await
            .ok()
            .flatten()
    }
}
