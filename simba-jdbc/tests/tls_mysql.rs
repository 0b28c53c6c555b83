//! MySQL / MariaDB over TLS against a real private MariaDB (`--require-secure-transport=ON`)
//! with certificates the test generates: the conformance suite and the store-level cases
//! over mutual TLS with `ssl-mode=VERIFY_IDENTITY`, and a bounded error (never a hang, never
//! a connection) for each way TLS can fail. Needs the `tls` feature.
#![cfg(feature = "tls")]
#![allow(missing_docs)]
// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use common::SqlHarness;
use common::tls::{TlsBackend, config_error, connect, select_one};
use simba_jdbc::{TlsFailure, TlsProblem};
use simba_test_kit::servers::{TestCerts, mysql_private};

const TLS: TlsBackend = TlsBackend::Mysql;

/// A harness on a TLS-only server, every URL with `ssl-mode=VERIFY_IDENTITY`. Without a
/// client certificate: mysql_async reads only PKCS#1 RSA keys, and the kit's are ECDSA.
async fn tls_harness() -> SqlHarness {
    TLS.harness("VERIFY_IDENTITY", false).await
}

mod suite {
    simba_test_kit::conformance_tests!(crate::tls_harness().await);
}

mod store {
    simba_test_kit::store_conformance_tests!(crate::tls_harness().await);
}

#[tokio::test]
async fn every_mode_that_should_connect_does() {
    let certs = TestCerts::generate().unwrap();
    let server = TLS.server(&certs, certs.server(), false).await;
    let base = server.url();
    for q in [
        TLS.query("VERIFY_IDENTITY", &certs.ca()),
        TLS.query("verify_ca", &certs.ca()),
        TLS.query("REQUIRED", &certs.ca()),
        // REQUIRED checks nothing without a CA.
        "?ssl-mode=REQUIRED".to_owned(),
    ] {
        select_one(&format!("{base}{q}")).await;
    }
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_untrusted() {
    let certs = TestCerts::generate().unwrap();
    let server = TLS.server(&certs, certs.server(), false).await;
    for mode in ["VERIFY_IDENTITY", "VERIFY_CA", "REQUIRED"] {
        let url = TLS.url(&server, mode, &certs.other_ca());
        let f: TlsFailure = TLS.typed(connect(&url).await, "ssl-ca=");
        assert_eq!(f.problem(), &TlsProblem::UntrustedCertificate, "{mode}");
    }
}

#[tokio::test]
async fn an_expired_server_certificate_is_refused() {
    let certs = TestCerts::generate().unwrap();
    let server = TLS.server(&certs, certs.expired(), false).await;
    let url = TLS.url(&server, "VERIFY_IDENTITY", &certs.ca());
    let f: TlsFailure = TLS.typed(connect(&url).await, "renew");
    assert_eq!(f.problem(), &TlsProblem::CertificateExpired);
}

/// A wrong name fails VERIFY_IDENTITY. It fails VERIFY_CA too: mysql_async 0.36 skips the
/// host-name check only on an error text that rustls 0.23 no longer produces, so VERIFY_CA
/// is as strict as VERIFY_IDENTITY (stricter than asked, never weaker). This test pins that
/// down; when the driver is fixed, VERIFY_CA must connect here.
#[tokio::test]
async fn a_wrong_name_fails_verify_identity_and_verify_ca() {
    let certs = TestCerts::generate().unwrap();
    let server = TLS.server(&certs, certs.wrong_name(), false).await;
    for mode in ["VERIFY_IDENTITY", "VERIFY_CA"] {
        let url = TLS.url(&server, mode, &certs.ca());
        let f: TlsFailure = TLS.typed(connect(&url).await, "host name");
        assert!(
            matches!(f.problem(), TlsProblem::NameMismatch { name } if name == "127.0.0.1"),
            "{mode}: {f:?}"
        );
    }
    // REQUIRED without a CA checks nothing.
    select_one(&format!("{}?ssl-mode=REQUIRED", server.url())).await;
}

#[tokio::test]
async fn tls_required_but_not_offered() {
    let server = mysql_private().await.unwrap_or_else(|e| panic!("{e}"));
    let f: TlsFailure = TLS.typed(
        connect(&format!("{}?ssl-mode=REQUIRED", server.url())).await,
        "does not speak TLS",
    );
    assert_eq!(f.problem(), &TlsProblem::NotOffered);
}

#[tokio::test]
async fn a_plain_connection_to_a_tls_only_server_is_refused() {
    let certs = TestCerts::generate().unwrap();
    let server = TLS.server(&certs, certs.server(), false).await;
    let text = TLS.failure_text(connect(&format!("{}?ssl-mode=DISABLED", server.url())).await);
    // MariaDB answers a plain login under require_secure_transport with "Access denied".
    assert!(
        text.contains("Access denied") || text.contains("insecure transport"),
        "{text}"
    );
}

#[tokio::test]
async fn mutual_tls_without_a_client_certificate_is_refused() {
    let certs = TestCerts::generate().unwrap();
    let server = TLS.server(&certs, certs.server(), true).await;
    let url = TLS.url(&server, "VERIFY_IDENTITY", &certs.ca());
    let text = TLS.failure_text(connect(&url).await);
    assert!(text.contains("Access denied"), "{text}");
}

#[tokio::test]
async fn a_client_key_the_driver_cannot_read_is_a_config_error() {
    // The kit's keys are PKCS#8 ECDSA; mysql_async reads only PKCS#1 RSA keys.
    let certs = TestCerts::generate().unwrap();
    let url = format!(
        "mysql://root@127.0.0.1:1/simba{}",
        TLS.client_query("VERIFY_IDENTITY", &certs.ca(), &certs)
    );
    config_error(&url, "ssl-key", "PKCS#1").await;
}

#[tokio::test]
async fn a_missing_ca_file_is_a_config_error() {
    config_error(
        "mysql://root@127.0.0.1:1/simba?ssl-mode=VERIFY_IDENTITY&ssl-ca=/nonexistent/ca.pem",
        "ssl-ca",
        "/nonexistent/ca.pem",
    )
    .await;
}
