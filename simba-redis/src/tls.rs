//! TLS: the rustls client configuration (feature `tls`), and telling *why* a connection
//! failed — a certificate problem, or one side speaking TLS and the other not — so that the
//! error says what to fix.

use std::time::Duration;

use simba_core::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::BACKEND;

pub use simba_core::tls::{TlsFailure, TlsProblem};

/// What to change, in this crate's terms (URL options and [`TlsOptions`] fields).
///
/// [`TlsOptions`]: crate::TlsOptions
fn advice(problem: &TlsProblem) -> &'static str {
    match problem {
        TlsProblem::UntrustedCertificate => {
            "give the CA that signed it with tlsCaFile=/path/ca.pem (TlsOptions::ca_file)"
        }
        TlsProblem::CertificateExpired => {
            "renew the server's certificate (or check this machine's clock)"
        }
        TlsProblem::NameMismatch { .. } => {
            "connect with a name the certificate carries, or give that name with \
             tlsServerName=NAME (TlsOptions::server_name)"
        }
        TlsProblem::NotOffered => {
            "use redis:// for this port, or the port the server gives to `tls-port`"
        }
        TlsProblem::Required => {
            "use rediss:// (with tlsCaFile=… if its certificate is not signed by a system CA)"
        }
        TlsProblem::ClientCertificateRejected => {
            "give one it trusts with tlsCertFile=… and tlsKeyFile=…"
        }
        _ => "",
    }
}

/// The failure of `problem`, with this crate's advice.
pub(crate) fn failure(problem: TlsProblem) -> TlsFailure {
    TlsFailure::new(problem, advice)
}

/// The error a connection that failed for `failure` returns: permanent.
pub(crate) fn into_error(failure: TlsFailure, what: &str) -> Error {
    Error::backend_source(BACKEND, format!("{what}: {failure}"), false, failure)
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
                Some(failure(TlsProblem::Required))
            }
            // Closed without a RESP answer.
            Ok(0) => Some(failure(TlsProblem::Required)),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                Some(failure(TlsProblem::Required))
            }
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
    use std::sync::Arc;

    use simba_core::Result;
    use simba_core::tls::rustls_client::rustls::ClientConfig;
    use simba_core::tls::rustls_client::rustls::pki_types::ServerName;
    use simba_core::tls::rustls_client::{self, ClientTls, Settings, Verify, classify};
    use tokio::net::TcpStream;

    use super::{PROBE_TIMEOUT, TlsFailure, TlsProblem, failure};
    use crate::config::TlsOptions;

    /// This crate's names for the TLS settings.
    const SETTINGS: Settings = Settings {
        ca_file: "tls.ca_file",
        cert_file: "tls.cert_file",
        key_file: "tls.key_file",
        server_name: "tls.server_name",
        mode: "tls",
        ca_example: "tlsCaFile=/path/ca.pem",
    };

    /// The rustls configuration for `tls`: its CA file or the system's roots, its client
    /// certificate, its server name; the chain and the name are always checked.
    pub(crate) fn client_config(tls: &TlsOptions) -> Result<ClientConfig> {
        rustls_client::client_config(&ClientTls {
            verify: Verify::ChainAndName,
            ca_file: tls.ca_file.as_deref(),
            client: tls.cert_file.as_deref().zip(tls.key_file.as_deref()),
            server_name: tls.server_name.as_deref(),
            settings: SETTINGS,
        })
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
                    return Some(match rustls_client::rustls_error(&e) {
                        Some(e) => failure(classify(e, &name)),
                        // Closed during the handshake: a plain server drops a connection
                        // that starts with garbage.
                        None if matches!(
                            e.kind(),
                            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                        ) =>
                        {
                            failure(TlsProblem::NotOffered)
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
                Err(e) => Some(failure(match rustls_client::rustls_error(&e) {
                    Some(e) => classify(e, &name),
                    None => TlsProblem::ClientCertificateRejected,
                })),
                Ok(_) => Some(failure(TlsProblem::ClientCertificateRejected)),
            }
        };
        tokio::time::timeout(PROBE_TIMEOUT, probe)
            .await
            .ok()
            .flatten()
    }
}
