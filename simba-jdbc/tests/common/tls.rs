//! The parts of the TLS test files (`tls_mysql.rs`, `tls_postgres.rs`) that differ only in
//! the backend: the TLS server with the test's certificates, the URL options (named
//! `ssl-mode`, `ssl-ca`, … for MySQL and `sslmode`, `sslrootcert`, … for PostgreSQL), the
//! harness over TLS, and the checks of a connection that must fail.

use std::path::Path;
use std::time::Duration;

use simba_core::Error;
use simba_jdbc::{SqlConfig, SqlStore};
use simba_test_kit::servers::{
    CertPair, MysqlTls, PostgresTls, TestCerts, TestServer, mysql_tls, postgres_tls,
};
use tokio::time::Instant;

use super::SqlHarness;

/// The backend of a TLS test file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsBackend {
    /// MariaDB, with the MySQL client's option names.
    Mysql,
    /// PostgreSQL, with libpq's option names.
    Postgres,
}

/// The outcome of [`connect`]: on failure, the error and how long it took.
pub type Connected = Result<SqlStore, (Error, Duration)>;

impl TlsBackend {
    /// The names of the URL options: TLS mode, CA file, client certificate, client key.
    fn options(self) -> [&'static str; 4] {
        match self {
            TlsBackend::Mysql => ["ssl-mode", "ssl-ca", "ssl-cert", "ssl-key"],
            TlsBackend::Postgres => ["sslmode", "sslrootcert", "sslcert", "sslkey"],
        }
    }

    /// How long a connection that must fail may take.
    fn failure_bound(self) -> Duration {
        match self {
            TlsBackend::Mysql => Duration::from_secs(10),
            TlsBackend::Postgres => Duration::from_secs(5),
        }
    }

    /// A private TLS-only server with `server`'s certificate; `mutual`: clients must
    /// present a certificate signed by the test's CA.
    pub async fn server(self, certs: &TestCerts, server: CertPair, mutual: bool) -> TestServer {
        let (ca, require_client_cert) = (certs.ca(), mutual);
        match self {
            TlsBackend::Mysql => {
                mysql_tls(MysqlTls {
                    server,
                    ca,
                    require_client_cert,
                })
                .await
            }
            TlsBackend::Postgres => {
                postgres_tls(PostgresTls {
                    server,
                    ca,
                    require_client_cert,
                })
                .await
            }
        }
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// `?MODE=mode&CA=ca`.
    pub fn query(self, mode: &str, ca: &Path) -> String {
        let [mode_option, ca_option, _, _] = self.options();
        format!("?{mode_option}={mode}&{ca_option}={}", p(ca))
    }

    /// [`query`](Self::query) and the kit's client certificate and key.
    pub fn client_query(self, mode: &str, ca: &Path, certs: &TestCerts) -> String {
        let [_, _, cert_option, key_option] = self.options();
        let client = certs.client();
        format!(
            "{}&{cert_option}={}&{key_option}={}",
            self.query(mode, ca),
            p(&client.cert),
            p(&client.key)
        )
    }

    /// `server`'s URL with [`query`](Self::query).
    pub fn url(self, server: &TestServer, mode: &str, ca: &Path) -> String {
        format!("{}{}", server.url(), self.query(mode, ca))
    }

    /// A harness on a new TLS-only server, every URL with `mode` and the test's CA; with
    /// `client_cert`, the server wants a client certificate and the URLs give the kit's.
    pub async fn harness(self, mode: &str, client_cert: bool) -> SqlHarness {
        let certs = TestCerts::generate().unwrap_or_else(|e| panic!("certificates: {e}"));
        let server = self.server(&certs, certs.server(), client_cert).await;
        let q = if client_cert {
            self.client_query(mode, &certs.ca(), &certs)
        } else {
            self.query(mode, &certs.ca())
        };
        let (name, pushes_release) = match self {
            TlsBackend::Mysql => ("mysql-tls", false),
            TlsBackend::Postgres => ("postgres-tls", true),
        };
        SqlHarness::on_server(name, server, pushes_release)
            .with_query(&q)
            .keeping(certs)
    }

    /// The error of a connection that must fail: within the backend's bound, never a hang.
    fn failed(self, result: Connected) -> Error {
        let (e, took) = match result {
            Ok(_) => panic!("connected, but a TLS failure was expected"),
            Err(e) => e,
        };
        assert!(took < self.failure_bound(), "took {took:?}: {e}");
        e
    }

    /// The message of a connection that must fail, with its sources: a backend error.
    pub fn failure_text(self, result: Connected) -> String {
        let e = self.failed(result);
        assert!(matches!(&e, Error::Backend { .. }), "{e:?}");
        let mut text = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            text.push_str(&format!(" / {s}"));
            source = s.source();
        }
        text
    }

    /// The typed failure `F` ([`simba_jdbc::TlsFailure`]) behind a connection that
    /// must fail, which must be permanent, bounded, and say what to do (`fix`).
    pub fn typed<F>(self, result: Connected, fix: &str) -> F
    where
        F: std::error::Error + Clone + 'static,
    {
        let e = self.failed(result);
        let text = e.to_string();
        assert!(text.contains(fix), "the message should say {fix:?}: {text}");
        match &e {
            Error::Backend { retryable, .. } => assert!(!retryable, "permanent: {e:?}"),
            other => panic!("expected a backend error, got {other:?}"),
        }
        std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<F>())
            .cloned()
            .unwrap_or_else(|| panic!("no {} behind {e:?}", std::any::type_name::<F>()))
    }
}

/// A path as a URL option's value.
pub fn p(path: &Path) -> String {
    path.display().to_string()
}

/// Connects (one `SELECT 1`); on failure returns the error and how long it took.
pub async fn connect(url: &str) -> Connected {
    let t0 = Instant::now();
    let config = SqlConfig::new(url).with_statement_timeout(Duration::from_secs(5));
    SqlStore::connect(config)
        .await
        .map_err(|e| (e, t0.elapsed()))
}

/// Connects to `url`, and so does the connector's floor probe (its own connection, with
/// the same options); both run `SELECT 1`.
pub async fn select_one(url: &str) {
    connect(url)
        .await
        .unwrap_or_else(|(e, _)| panic!("{url}: {e}"));
    let connection = simba_core::connect::Connector::connect(
        &simba_jdbc::CONNECTOR,
        url,
        &simba_core::connect::ConnectOptions::new(),
    )
    .await
    .unwrap_or_else(|e| panic!("{url}: connector: {e}"));
    let mut probe = connection
        .probe("tls")
        .await
        .unwrap_or_else(|e| panic!("{url}: probe: {e}"));
    probe
        .measure(
            simba_core::connect::Floor::RoundTrip,
            Duration::from_secs(5),
        )
        .await
        .unwrap_or_else(|e| panic!("{url}: probe: {e}"));
}

/// Connecting to `url` (no server needed) is refused with an [`Error::InvalidConfig`] that
/// names `field` and says `text`.
pub async fn config_error(url: &str, field: &str, text: &str) {
    let e = match SqlStore::connect(SqlConfig::new(url)).await {
        Ok(_) => panic!("{url}: connected, but a config error was expected"),
        Err(e) => e,
    };
    assert!(
        matches!(&e, Error::InvalidConfig { field: f, reason } if *f == field && reason.contains(text)),
        "{e:?}"
    );
}
