//! TLS for backend crates: what a failed TLS connection means ([`TlsFailure`], always
//! available), and with the feature `tls` the rustls parts every backend needs (PEM files,
//! the client configuration and its certificate checks, the classification of rustls
//! errors) in `rustls_client`.
//!
//! Applications meet [`TlsFailure`] as the `source` of the [`Error::Backend`](crate::Error)
//! a failed connection returns; the rest is for backend crates.

use std::fmt;

/// What went wrong with TLS, whatever the backend.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TlsProblem {
    /// The server's certificate chain does not end at a trusted CA.
    UntrustedCertificate,
    /// The server's certificate has expired (or is not valid yet).
    CertificateExpired,
    /// The server's certificate does not name the host connected to.
    NameMismatch {
        /// The name that was checked.
        name: String,
    },
    /// The client asks for TLS, but the server does not speak TLS there.
    NotOffered,
    /// The server accepts only TLS there, and the client asks for none.
    Required,
    /// The server asked for a client certificate and none was given, or it rejected the
    /// one given.
    ClientCertificateRejected,
    /// Another TLS failure; the text is the TLS library's or the driver's.
    Other(String),
}

impl fmt::Display for TlsProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TlsProblem::UntrustedCertificate => {
                f.write_str("the server's TLS certificate is not signed by a trusted CA")
            }
            TlsProblem::CertificateExpired => {
                f.write_str("the server's TLS certificate has expired or is not valid yet")
            }
            TlsProblem::NameMismatch { name } => {
                write!(f, "the server's TLS certificate is not valid for {name:?}")
            }
            TlsProblem::NotOffered => {
                f.write_str("the client asks for TLS but the server does not speak TLS there")
            }
            TlsProblem::Required => {
                f.write_str("the server accepts only TLS connections there, and none was asked for")
            }
            TlsProblem::ClientCertificateRejected => f.write_str(
                "the server asks for a client certificate and did not accept what was given",
            ),
            TlsProblem::Other(text) => write!(f, "TLS failed: {text}"),
        }
    }
}

/// Why a TLS connection failed, with the backend's advice in its own terms (the URL
/// option or setting to change). Every case is permanent: retrying without changing a
/// setting fails the same way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFailure {
    problem: TlsProblem,
    advice: &'static str,
}

impl TlsFailure {
    /// A failure, with the advice `advise` gives for its problem (empty: none).
    pub fn new(problem: TlsProblem, advise: fn(&TlsProblem) -> &'static str) -> TlsFailure {
        let advice = advise(&problem);
        TlsFailure { problem, advice }
    }

    /// What went wrong.
    pub fn problem(&self) -> &TlsProblem {
        &self.problem
    }

    /// What to change, in the backend's terms.
    pub fn advice(&self) -> &str {
        self.advice
    }
}

impl fmt::Display for TlsFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.advice.is_empty() {
            fmt::Display::fmt(&self.problem, f)
        } else {
            write!(f, "{}: {}", self.problem, self.advice)
        }
    }
}

impl std::error::Error for TlsFailure {}

#[cfg(feature = "tls")]
pub mod rustls_client {
    //! The rustls side (feature `tls`): certificates and keys from PEM files, a client
    //! configuration that checks the server as asked, and what a rustls error means.
    //! The ring provider only, so no C toolchain is needed.

    use std::fmt;
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

    use super::TlsProblem;
    use crate::{Error, Result};

    pub use rustls;

    /// How much of the server's certificate is checked.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Verify {
        /// Nothing (handshake signatures only): encryption without authentication.
        Nothing,
        /// The chain must end at a trusted CA; the name is not checked.
        Chain,
        /// The chain, and the certificate must name the server.
        ChainAndName,
    }

    /// The names of a backend's settings, for its error messages.
    #[derive(Debug, Clone, Copy)]
    pub struct Settings {
        /// The CA file (`sslrootcert`, `tls.ca_file`).
        pub ca_file: &'static str,
        /// The client certificate file.
        pub cert_file: &'static str,
        /// The client key file.
        pub key_file: &'static str,
        /// The server-name override, where the backend has one.
        pub server_name: &'static str,
        /// The setting that chooses TLS (`sslmode`, `tls`): named when rustls itself fails.
        pub mode: &'static str,
        /// How a user gives a CA, e.g. `sslrootcert=/path/ca.pem`.
        pub ca_example: &'static str,
    }

    /// What a client configuration is built from.
    #[derive(Debug, Clone, Copy)]
    pub struct ClientTls<'a> {
        /// How much of the server's certificate is checked.
        pub verify: Verify,
        /// The CA certificates (PEM); `None`: the system's.
        pub ca_file: Option<&'a Path>,
        /// A client certificate chain and its key (PEM).
        pub client: Option<(&'a Path, &'a Path)>,
        /// The name the certificate must carry, whatever host was dialled; `None`: the host.
        pub server_name: Option<&'a str>,
        /// The backend's names for these settings.
        pub settings: Settings,
    }

    fn file_error(field: &'static str, path: &Path, what: impl fmt::Display) -> Error {
        Error::config(field, format!("{}: {what}", path.display()))
    }

    /// The certificates of a PEM file; an error names `field` and the file.
    pub fn certificates(field: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>> {
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

    /// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
    pub fn private_key(field: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>> {
        PrivateKeyDer::from_pem_file(path).map_err(|e| {
            file_error(
                field,
                path,
                format_args!("holds no usable PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"),
            )
        })
    }

    fn roots(tls: &ClientTls<'_>) -> Result<RootCertStore> {
        let field = tls.settings.ca_file;
        let mut roots = RootCertStore::empty();
        match tls.ca_file {
            Some(path) => {
                for cert in certificates(field, path)? {
                    roots.add(cert).map_err(|e| {
                        file_error(field, path, format_args!("has a bad CA certificate: {e}"))
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
                        field,
                        format!(
                            "no CA certificates were found on this system: give the server's \
                             CA with {}",
                            tls.settings.ca_example
                        ),
                    ));
                }
            }
        }
        Ok(roots)
    }

    /// The rustls client configuration for `tls`, its files read and checked.
    pub fn client_config(tls: &ClientTls<'_>) -> Result<ClientConfig> {
        let settings = tls.settings;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain = match tls.verify {
            Verify::Nothing => None,
            Verify::Chain | Verify::ChainAndName => Some(
                WebPkiServerVerifier::builder_with_provider(
                    Arc::new(roots(tls)?),
                    provider.clone(),
                )
                .build()
                .map_err(|e| {
                    Error::config(settings.ca_file, format!("unusable CA certificates: {e}"))
                })?,
            ),
        };
        let fixed_name = tls
            .server_name
            .map(|name| {
                ServerName::try_from(name.to_owned()).map_err(|_| {
                    Error::config(
                        settings.server_name,
                        format!("{name:?} is not a DNS name or IP address"),
                    )
                })
            })
            .transpose()?;
        let verifier = Arc::new(Verifier {
            chain,
            check_name: tls.verify == Verify::ChainAndName,
            fixed_name,
            provider: provider.clone(),
        });
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::config(settings.mode, format!("rustls: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        match tls.client {
            Some((cert, key)) => {
                let chain = certificates(settings.cert_file, cert)?;
                let key = private_key(settings.key_file, key)?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    Error::config(
                        settings.key_file,
                        format!("the client key does not fit the client certificate: {e}"),
                    )
                })
            }
            None => Ok(builder.with_no_client_auth()),
        }
    }

    /// Checks the server's certificate as [`Verify`] asks, against a fixed name when one is
    /// set. Handshake signatures are always checked.
    #[derive(Debug)]
    struct Verifier {
        chain: Option<Arc<WebPkiServerVerifier>>,
        check_name: bool,
        fixed_name: Option<ServerName<'static>>,
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
            let name = self.fixed_name.as_ref().unwrap_or(server_name);
            match chain.verify_server_cert(end_entity, intermediates, name, ocsp_response, now) {
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

    /// The rustls error in `e` or among its sources (tokio-rustls wraps it in an I/O
    /// error), if any.
    pub fn rustls_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
        let mut cause = Some(e);
        while let Some(c) = cause {
            if let Some(found) = c.downcast_ref::<rustls::Error>() {
                return Some(found);
            }
            if let Some(found) = c
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            {
                return Some(found);
            }
            cause = c.source();
        }
        None
    }

    /// What a rustls error means; `name` is the name that was checked, used when the error
    /// does not carry it.
    pub fn classify(e: &rustls::Error, name: &str) -> TlsProblem {
        use rustls::Error as E;
        match e {
            E::InvalidCertificate(c) => match c {
                CertificateError::Expired
                | CertificateError::ExpiredContext { .. }
                | CertificateError::NotValidYet
                | CertificateError::NotValidYetContext { .. } => TlsProblem::CertificateExpired,
                CertificateError::NotValidForNameContext { expected, .. } => {
                    TlsProblem::NameMismatch {
                        name: match expected {
                            ServerName::DnsName(d) => d.as_ref().to_owned(),
                            ServerName::IpAddress(ip) => std::net::IpAddr::from(*ip).to_string(),
                            _ => name.to_owned(),
                        },
                    }
                }
                CertificateError::NotValidForName => TlsProblem::NameMismatch {
                    name: name.to_owned(),
                },
                CertificateError::UnknownIssuer | CertificateError::BadSignature => {
                    TlsProblem::UntrustedCertificate
                }
                other => TlsProblem::Other(format!("{other:?}")),
            },
            // Bytes that are no TLS record: the server answered in its plain protocol.
            E::InvalidMessage(_) => TlsProblem::NotOffered,
            E::AlertReceived(
                AlertDescription::CertificateRequired
                | AlertDescription::BadCertificate
                | AlertDescription::UnknownCA
                | AlertDescription::CertificateUnknown
                | AlertDescription::HandshakeFailure,
            ) => TlsProblem::ClientCertificateRejected,
            other => TlsProblem::Other(other.to_string()),
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        const SETTINGS: Settings = Settings {
            ca_file: "ca",
            cert_file: "cert",
            key_file: "key",
            server_name: "name",
            mode: "mode",
            ca_example: "ca=/path/ca.pem",
        };

        fn field(e: Error) -> (&'static str, String) {
            match e {
                Error::InvalidConfig { field, reason } => (field, reason),
                other => panic!("expected InvalidConfig, got {other:?}"),
            }
        }

        #[test]
        fn files_are_named_in_errors() {
            let dir = std::env::temp_dir().join(format!("simba-tls-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("temp dir");
            let empty = dir.join("empty.pem");
            std::fs::write(&empty, "no pem here\n").expect("write");
            let missing = dir.join("missing.pem");
            fn tls(ca: &Path) -> ClientTls<'_> {
                ClientTls {
                    verify: Verify::ChainAndName,
                    ca_file: Some(ca),
                    client: None,
                    server_name: None,
                    settings: SETTINGS,
                }
            }
            let (f, msg) = field(client_config(&tls(&missing)).expect_err("missing"));
            assert_eq!(f, "ca");
            assert!(
                msg.contains("missing.pem") && msg.contains("cannot be read"),
                "{msg}"
            );
            let (f, msg) = field(client_config(&tls(&empty)).expect_err("empty"));
            assert_eq!(f, "ca");
            assert!(msg.contains("no PEM certificate"), "{msg}");
            let (f, msg) = field(private_key("key", &empty).expect_err("no key"));
            assert_eq!(f, "key");
            assert!(msg.contains("private key"), "{msg}");
            let bad_name = ClientTls {
                server_name: Some("not a name"),
                verify: Verify::Nothing,
                ..tls(&empty)
            };
            let (f, _) = field(client_config(&bad_name).expect_err("bad name"));
            assert_eq!(f, "name");
            let _ = std::fs::remove_dir_all(&dir);
        }

        #[test]
        fn rustls_errors_are_classified() {
            let e = rustls::Error::InvalidCertificate(CertificateError::Expired);
            assert_eq!(classify(&e, "h"), TlsProblem::CertificateExpired);
            let e = rustls::Error::InvalidCertificate(CertificateError::NotValidForName);
            assert_eq!(
                classify(&e, "db.example"),
                TlsProblem::NameMismatch {
                    name: "db.example".to_owned()
                }
            );
            let e = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
            assert_eq!(classify(&e, "h"), TlsProblem::UntrustedCertificate);
            let e = rustls::Error::AlertReceived(AlertDescription::CertificateRequired);
            assert_eq!(classify(&e, "h"), TlsProblem::ClientCertificateRejected);
            // Found inside the I/O error tokio-rustls returns.
            let io = std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer),
            );
            let found = rustls_error(&io).expect("inside the I/O error");
            assert_eq!(classify(found, "h"), TlsProblem::UntrustedCertificate);
            assert!(rustls_error(&std::io::Error::other("plain")).is_none());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_says_the_problem_then_the_backend_advice() {
        fn advise(p: &TlsProblem) -> &'static str {
            match p {
                TlsProblem::UntrustedCertificate => "give its CA with ca=/path/ca.pem",
                _ => "",
            }
        }
        let f = TlsFailure::new(TlsProblem::UntrustedCertificate, advise);
        assert_eq!(
            f.to_string(),
            "the server's TLS certificate is not signed by a trusted CA: give its CA with \
             ca=/path/ca.pem"
        );
        assert_eq!(f.problem(), &TlsProblem::UntrustedCertificate);
        let f = TlsFailure::new(TlsProblem::Other("alert".to_owned()), advise);
        assert_eq!(f.to_string(), "TLS failed: alert");
    }
}
