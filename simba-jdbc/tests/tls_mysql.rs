//! MySQL / MariaDB over TLS against a real private MariaDB (`--require-secure-transport=ON`)
//! with certificates the test generates: the conformance suite and the store-level cases
//! over mutual TLS with `ssl-mode=VERIFY_IDENTITY`, and a bounded error (never a hang, never
//! a connection) for each way TLS can fail. Needs the `tls` feature.
#![cfg(feature = "tls")]
#![allow(missing_docs)]
// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::SqlHarness;
use simba_core::Error;
use simba_jdbc::{MysqlTlsFailure, SqlConfig, SqlStore};
use simba_test_kit::servers::{
    CertPair, MysqlTls, TestCerts, TestServer, mysql_private, mysql_tls,
};
use tokio::time::Instant;

async fn tls_server(certs: &TestCerts, server: CertPair, mutual: bool) -> TestServer {
    mysql_tls(MysqlTls {
        server,
        ca: certs.ca(),
        require_client_cert: mutual,
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

fn p(path: &Path) -> String {
    path.display().to_string()
}

/// `?ssl-mode=MODE&ssl-ca=CA&ssl-cert=…&ssl-key=…` with the kit's client certificate.
fn query(mode: &str, ca: &Path, certs: &TestCerts) -> String {
    let client = certs.client();
    format!(
        "?ssl-mode={mode}&ssl-ca={}&ssl-cert={}&ssl-key={}",
        p(ca),
        p(&client.cert),
        p(&client.key)
    )
}

/// A harness on a TLS-only server, every URL with `ssl-mode=VERIFY_IDENTITY`. Without a
/// client certificate: mysql_async reads only PKCS#1 RSA keys, and the kit's are ECDSA.
async fn tls_harness() -> SqlHarness {
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), false).await;
    let q = format!("?ssl-mode=VERIFY_IDENTITY&ssl-ca={}", p(&certs.ca()));
    SqlHarness::on_server("mysql-tls", server, false)
        .with_query(&q)
        .keeping(certs)
}

mod suite {
    simba_test_kit::conformance_tests!(crate::tls_harness().await);
}

mod store {
    simba_test_kit::store_conformance_tests!(crate::tls_harness().await);
}

/// Connects (one `SELECT 1`); on failure returns the error and how long it took.
async fn connect(url: &str) -> Result<SqlStore, (Error, Duration)> {
    let t0 = Instant::now();
    let config = SqlConfig::new(url).with_statement_timeout(Duration::from_secs(5));
    SqlStore::connect(config)
        .await
        .map_err(|e| (e, t0.elapsed()))
}

/// The error of a connection that must fail: a backend error, without a hang.
fn failure(result: Result<SqlStore, (Error, Duration)>) -> String {
    let (e, took) = match result {
        Ok(_) => panic!("connected, but a TLS failure was expected"),
        Err(e) => e,
    };
    assert!(took < Duration::from_secs(10), "took {took:?}: {e}");
    assert!(matches!(&e, Error::Backend { .. }), "{e:?}");
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        text.push_str(&format!(" / {s}"));
        source = s.source();
    }
    text
}

/// The [`MysqlTlsFailure`] behind a connect error, which must be permanent, bounded, and
/// say what to do (`fix`).
fn typed(result: Result<SqlStore, (Error, Duration)>, fix: &str) -> MysqlTlsFailure {
    let (e, took) = match result {
        Ok(_) => panic!("connected, but a TLS failure was expected"),
        Err(e) => e,
    };
    assert!(took < Duration::from_secs(10), "took {took:?}: {e}");
    let text = e.to_string();
    assert!(text.contains(fix), "the message should say {fix:?}: {text}");
    match &e {
        Error::Backend { retryable, .. } => assert!(!retryable, "permanent: {e:?}"),
        other => panic!("expected a backend error, got {other:?}"),
    }
    std::error::Error::source(&e)
        .and_then(|s| s.downcast_ref::<MysqlTlsFailure>())
        .cloned()
        .unwrap_or_else(|| panic!("no MysqlTlsFailure behind {e:?}"))
}

async fn select_one(url: &str) {
    let store = connect(url)
        .await
        .unwrap_or_else(|(e, _)| panic!("{url}: {e}"));
    // The floor probe opens its own connection, with the same options.
    let mut probe = store.probe().await.unwrap();
    probe.select_one().await.unwrap();
}

#[tokio::test]
async fn every_mode_that_should_connect_does() {
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), false).await;
    let base = server.url();
    for q in [
        format!("?ssl-mode=VERIFY_IDENTITY&ssl-ca={}", p(&certs.ca())),
        format!("?ssl-mode=verify_ca&ssl-ca={}", p(&certs.ca())),
        format!("?ssl-mode=REQUIRED&ssl-ca={}", p(&certs.ca())),
        // REQUIRED checks nothing without a CA.
        "?ssl-mode=REQUIRED".to_owned(),
    ] {
        select_one(&format!("{base}{q}")).await;
    }
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_untrusted() {
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), false).await;
    for mode in ["VERIFY_IDENTITY", "VERIFY_CA", "REQUIRED"] {
        let url = format!(
            "{}?ssl-mode={mode}&ssl-ca={}",
            server.url(),
            p(&certs.other_ca())
        );
        let f = typed(connect(&url).await, "ssl-ca=");
        assert_eq!(f, MysqlTlsFailure::UntrustedCertificate, "{mode}");
    }
}

#[tokio::test]
async fn an_expired_server_certificate_is_refused() {
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.expired(), false).await;
    let url = format!(
        "{}?ssl-mode=VERIFY_IDENTITY&ssl-ca={}",
        server.url(),
        p(&certs.ca())
    );
    let f = typed(connect(&url).await, "renew");
    assert_eq!(f, MysqlTlsFailure::CertificateExpired);
}

/// A wrong name fails VERIFY_IDENTITY. It fails VERIFY_CA too: mysql_async 0.36 skips the
/// host-name check only on an error text that rustls 0.23 no longer produces, so VERIFY_CA
/// is as strict as VERIFY_IDENTITY (stricter than asked, never weaker). This test pins that
/// down; when the driver is fixed, VERIFY_CA must connect here.
#[tokio::test]
async fn a_wrong_name_fails_verify_identity_and_verify_ca() {
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.wrong_name(), false).await;
    let url = |mode: &str| format!("{}?ssl-mode={mode}&ssl-ca={}", server.url(), p(&certs.ca()));
    for mode in ["VERIFY_IDENTITY", "VERIFY_CA"] {
        let f = typed(connect(&url(mode)).await, "host name");
        assert!(
            matches!(&f, MysqlTlsFailure::NameMismatch { name } if name == "127.0.0.1"),
            "{mode}: {f:?}"
        );
    }
    // REQUIRED without a CA checks nothing.
    select_one(&format!("{}?ssl-mode=REQUIRED", server.url())).await;
}

#[tokio::test]
async fn tls_required_but_not_offered() {
    let server = mysql_private().await.unwrap_or_else(|e| panic!("{e}"));
    let f = typed(
        connect(&format!("{}?ssl-mode=REQUIRED", server.url())).await,
        "does not offer",
    );
    assert_eq!(f, MysqlTlsFailure::NotOffered);
}

#[tokio::test]
async fn a_plain_connection_to_a_tls_only_server_is_refused() {
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), false).await;
    let text = failure(connect(&format!("{}?ssl-mode=DISABLED", server.url())).await);
    // MariaDB answers a plain login under require_secure_transport with "Access denied".
    assert!(
        text.contains("Access denied") || text.contains("insecure transport"),
        "{text}"
    );
}

#[tokio::test]
async fn mutual_tls_without_a_client_certificate_is_refused() {
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), true).await;
    let url = format!(
        "{}?ssl-mode=VERIFY_IDENTITY&ssl-ca={}",
        server.url(),
        p(&certs.ca())
    );
    let text = failure(connect(&url).await);
    assert!(text.contains("Access denied"), "{text}");
}

#[tokio::test]
async fn a_client_key_the_driver_cannot_read_is_a_config_error() {
    // The kit's keys are PKCS#8 ECDSA; mysql_async reads only PKCS#1 RSA keys.
    let certs = TestCerts::generate().unwrap();
    let e = SqlStore::connect(SqlConfig::new(format!(
        "mysql://root@127.0.0.1:1/simba{}",
        query("VERIFY_IDENTITY", &certs.ca(), &certs)
    )))
    .await
    .err()
    .unwrap();
    assert!(
        matches!(&e, Error::InvalidConfig { field, reason } if *field == "ssl-key" && reason.contains("PKCS#1")),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_missing_ca_file_is_a_config_error() {
    let e = SqlStore::connect(SqlConfig::new(
        "mysql://root@127.0.0.1:1/simba?ssl-mode=VERIFY_IDENTITY&ssl-ca=/nonexistent/ca.pem",
    ))
    .await
    .err()
    .unwrap();
    assert!(
        matches!(&e, Error::InvalidConfig { field, reason } if *field == "ssl-ca" && reason.contains("/nonexistent/ca.pem")),
        "{e:?}"
    );
}
