//! PostgreSQL over TLS against a real private server (`ssl=on`, pg_hba.conf `hostssl` only)
//! with certificates the test generates: the conformance suite and the store-level cases
//! over mutual TLS with `sslmode=verify-full`, and a typed, explained error for each way
//! TLS can fail — quickly, never a hang. Needs the `tls` feature (the workspace test
//! command has it: simba-chaos enables it).
#![cfg(feature = "tls")]
#![allow(missing_docs)]
// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use common::SqlHarness;
use common::tls::{TlsBackend, config_error, connect, p, select_one};
use simba_jdbc::{TlsFailure, TlsProblem};
use simba_test_kit::servers::{TestCerts, postgres_private};

const TLS: TlsBackend = TlsBackend::Postgres;

/// A harness on a mutual-TLS server, every URL with `sslmode=verify-full`.
async fn tls_harness() -> SqlHarness {
    TLS.harness("verify-full", true).await
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
        TLS.client_query("verify-full", &certs.ca(), &certs),
        TLS.client_query("verify-ca", &certs.ca(), &certs),
        TLS.query("verify-full", &certs.ca()),
        // libpq: require and prefer check nothing without a root certificate.
        "?sslmode=require".to_owned(),
        "?sslmode=prefer".to_owned(),
        // The default is prefer: TLS when offered.
        String::new(),
    ] {
        select_one(&format!("{base}{q}")).await;
    }
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_untrusted() {
    let certs = TestCerts::generate().unwrap();
    let server = TLS.server(&certs, certs.server(), false).await;
    for mode in ["verify-full", "verify-ca", "require"] {
        // require with a root certificate checks the chain, as libpq does.
        let url = TLS.url(&server, mode, &certs.other_ca());
        let f: TlsFailure = TLS.typed(connect(&url).await, "sslrootcert=");
        assert_eq!(f.problem(), &TlsProblem::UntrustedCertificate, "{mode}");
    }
}

#[tokio::test]
async fn an_expired_server_certificate_is_refused() {
    let certs = TestCerts::generate().unwrap();
    let server = TLS.server(&certs, certs.expired(), false).await;
    let url = TLS.url(&server, "verify-full", &certs.ca());
    let f: TlsFailure = TLS.typed(connect(&url).await, "renew");
    assert_eq!(f.problem(), &TlsProblem::CertificateExpired);
}

#[tokio::test]
async fn a_wrong_name_fails_verify_full_and_passes_verify_ca() {
    let certs = TestCerts::generate().unwrap();
    let server = TLS.server(&certs, certs.wrong_name(), false).await;
    let url = |mode: &str| TLS.url(&server, mode, &certs.ca());
    let f: TlsFailure = TLS.typed(connect(&url("verify-full")).await, "verify-ca");
    assert!(
        matches!(f.problem(), TlsProblem::NameMismatch { name } if name == "127.0.0.1"),
        "{f:?}"
    );
    select_one(&url("verify-ca")).await;
}

#[tokio::test]
async fn a_host_name_the_certificate_lacks_fails_verify_full() {
    let certs = TestCerts::generate().unwrap();
    let server = TLS.server(&certs, certs.server(), false).await;
    // The certificate names localhost and 127.0.0.1; dial 127.0.0.1 by another name.
    let url = format!(
        "postgres://postgres@db.invalid:{}/simba?hostaddr=127.0.0.1&sslmode=verify-full&sslrootcert={}",
        server.port(),
        p(&certs.ca())
    );
    let f: TlsFailure = TLS.typed(connect(&url).await, "verify-ca");
    assert!(
        matches!(f.problem(), TlsProblem::NameMismatch { name } if name == "db.invalid"),
        "{f:?}"
    );
}

#[tokio::test]
async fn tls_required_but_not_offered() {
    let server = postgres_private().await.unwrap_or_else(|e| panic!("{e}"));
    let f: TlsFailure = TLS.typed(
        connect(&format!("{}?sslmode=require", server.url())).await,
        "does not speak TLS",
    );
    assert_eq!(f.problem(), &TlsProblem::NotOffered);
    // prefer falls back to plain.
    select_one(&format!("{}?sslmode=prefer", server.url())).await;
}

#[tokio::test]
async fn a_plain_connection_to_a_tls_only_server_is_refused() {
    let certs = TestCerts::generate().unwrap();
    let server = TLS.server(&certs, certs.server(), false).await;
    let f: TlsFailure = TLS.typed(
        connect(&format!("{}?sslmode=disable", server.url())).await,
        "sslmode=verify-full",
    );
    assert_eq!(f.problem(), &TlsProblem::Required);
}

#[tokio::test]
async fn mutual_tls_without_a_client_certificate_is_refused() {
    let certs = TestCerts::generate().unwrap();
    let server = TLS.server(&certs, certs.server(), true).await;
    let url = TLS.url(&server, "verify-full", &certs.ca());
    let f: TlsFailure = TLS.typed(connect(&url).await, "sslcert=");
    assert_eq!(f.problem(), &TlsProblem::ClientCertificateRejected);
}

#[tokio::test]
async fn a_missing_ca_file_is_a_config_error() {
    config_error(
        "postgres://postgres@127.0.0.1:1/simba?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
        "sslrootcert",
        "/nonexistent/ca.pem",
    )
    .await;
}
