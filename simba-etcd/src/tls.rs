//! TLS (feature `tls`): the client configuration handed to etcd-client (rustls with the
//! ring provider, through tonic), and telling *why* a TLS connection failed.
//!
//! etcd-client's channel retries a failing endpoint in the background, so a certificate
//! problem shows only as "no answer": when the first read fails, one TLS handshake of our
//! own to the first endpoint, with the same files, says what is wrong
//! ([`TlsFailure`](simba_core::tls::TlsFailure) as the error's source).

#[cfg(feature = "tls")]
pub(crate) use with_rustls::{diagnose, options};

#[cfg(feature = "tls")]
mod with_rustls {
    use std::sync::Arc;
    use std::time::Duration;

    use etcd_client::{Certificate, Identity, TlsOptions};
    use simba_core::tls::rustls_client::rustls::ClientConfig;
    use simba_core::tls::rustls_client::rustls::pki_types::ServerName;
    use simba_core::tls::rustls_client::{self, ClientTls, Settings, Verify, classify};
    use simba_core::tls::{TlsFailure, TlsProblem};
    use simba_core::{Error, Result};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use crate::config::EtcdConfig;

    /// This crate's names for the TLS settings.
    const SETTINGS: Settings = Settings {
        ca_file: "tls.ca_file",
        cert_file: "tls.cert_file",
        key_file: "tls.key_file",
        server_name: "tls.server_name",
        mode: "tls",
        ca_example: "tlsCaFile=/path/ca.pem",
    };

    /// How long the diagnosing handshake may take.
    const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

    /// The client connection preface of HTTP/2 (RFC 9113, 3.4).
    const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    /// What to change, in this crate's terms.
    fn advice(problem: &TlsProblem) -> &'static str {
        match problem {
            TlsProblem::UntrustedCertificate => {
                "give the CA that signed it with tlsCaFile=/path/ca.pem (EtcdTlsOptions::ca_file)"
            }
            TlsProblem::CertificateExpired => {
                "renew the server's certificate (or check this machine's clock)"
            }
            TlsProblem::NameMismatch { .. } => {
                "connect with a name the certificate carries, or give that name with \
                 tlsServerName=NAME (EtcdTlsOptions::server_name)"
            }
            TlsProblem::NotOffered => "use etcd:// for this endpoint: it does not speak TLS",
            TlsProblem::ClientCertificateRejected => {
                "give one it trusts with tlsCertFile=… and tlsKeyFile=…"
            }
            _ => "",
        }
    }

    /// The TLS of a connection: the rustls configuration of the diagnosis (its files read
    /// and checked, so that a bad file is an `InvalidConfig` error before any connection).
    pub(crate) struct Tls {
        rustls: Arc<ClientConfig>,
    }

    /// etcd-client's TLS options for `config`, and the [`Tls`] of the diagnosis.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the setting when a file cannot be read or holds no
    /// usable certificate or key.
    pub(crate) fn options(config: &EtcdConfig) -> Result<(TlsOptions, Tls)> {
        let o = &config.tls_options;
        let rustls = rustls_client::client_config(&ClientTls {
            verify: Verify::ChainAndName,
            ca_file: o.ca_file.as_deref(),
            client: o.cert_file.as_deref().zip(o.key_file.as_deref()),
            server_name: o.server_name.as_deref(),
            settings: SETTINGS,
        })?;
        let read = |field: &'static str, path: &std::path::Path| {
            std::fs::read(path).map_err(|e| {
                Error::config(field, format!("{}: cannot be read: {e}", path.display()))
            })
        };
        let mut tls = TlsOptions::new();
        tls = match &o.ca_file {
            Some(path) => tls.ca_certificate(Certificate::from_pem(read(SETTINGS.ca_file, path)?)),
            None => tls.with_native_roots(),
        };
        if let (Some(cert), Some(key)) = (&o.cert_file, &o.key_file) {
            tls = tls.identity(Identity::from_pem(
                read(SETTINGS.cert_file, cert)?,
                read(SETTINGS.key_file, key)?,
            ));
        }
        if let Some(name) = &o.server_name {
            tls = tls.domain_name(name.clone());
        }
        Ok((
            tls,
            Tls {
                rustls: Arc::new(rustls),
            },
        ))
    }

    /// After a connection over TLS failed: one TLS handshake to `endpoint`
    /// (`https://host:port`) with the same settings, to tell what went wrong; `None` when
    /// the handshake succeeds or shows nothing.
    pub(crate) async fn diagnose(
        tls: &Tls,
        config: &EtcdConfig,
        endpoint: &str,
    ) -> Option<TlsFailure> {
        let authority = endpoint.strip_prefix("https://").unwrap_or(endpoint);
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (h, p.parse::<u16>().ok()?),
            None => return None,
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let name = config
            .tls_options
            .server_name
            .clone()
            .unwrap_or_else(|| host.to_owned());
        let server_name = ServerName::try_from(name.clone()).ok()?;
        let probe = async {
            let stream = TcpStream::connect((host, port)).await.ok()?;
            let connector = tokio_rustls::TlsConnector::from(tls.rustls.clone());
            let mut stream = match connector.connect(server_name, stream).await {
                Ok(s) => s,
                Err(e) => {
                    return Some(match rustls_client::rustls_error(&e) {
                        Some(e) => classify(e, &name),
                        // Closed during the handshake: a plain server drops a connection that
                        // starts with bytes that are no HTTP/2.
                        None if matches!(
                            e.kind(),
                            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                        ) =>
                        {
                            TlsProblem::NotOffered
                        }
                        None => return None,
                    });
                }
            };
            // A TLS 1.3 server checks the client's certificate after the handshake: the
            // HTTP/2 preface shows whether it kept the connection (etcd answers with its
            // SETTINGS frame) or rejected the certificate (an alert, or closed).
            stream.write_all(HTTP2_PREFACE).await.ok()?;
            let mut buf = [0u8; 16];
            match stream.read(&mut buf).await {
                Ok(n) if n > 0 => None,
                Err(e) => Some(match rustls_client::rustls_error(&e) {
                    Some(e) => classify(e, &name),
                    None => TlsProblem::ClientCertificateRejected,
                }),
                Ok(_) => Some(TlsProblem::ClientCertificateRejected),
            }
        };
        let problem = tokio::time::timeout(PROBE_TIMEOUT, probe)
            .await
            .ok()
            .flatten()?;
        Some(TlsFailure::new(problem, advice))
    }
}
