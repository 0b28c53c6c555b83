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

use std::path::Path;
use std::time::Duration;

use common::SqlHarness;
use simba_core::Error;
use simba_jdbc::{PgTlsFailure, SqlConfig, SqlStore};
use simba_test_kit::servers::{
    CertPair, PostgresTls, TestCerts, TestServer, postgres_private, postgres_tls,
};
use tokio::time::Instant;

async fn tls_server(certs: &TestCerts, server: CertPair, mutual: bool) -> TestServer {
    postgres_tls(PostgresTls {
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

/// `?sslmode=MODE&sslrootcert=CA&sslcert=…&sslkey=…` with the kit's client certificate.
fn query(mode: &str, ca: &Path, certs: &TestCerts) -> String {
    let client = certs.client();
    format!(
        "?sslmode={mode}&sslrootcert={}&sslcert={}&sslkey={}",
        p(ca),
        p(&client.cert),
        p(&client.key)
    )
}

/// A harness on a mutual-TLS server, every URL with `sslmode=verify-full`.
async fn tls_harness() -> SqlHarness {
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), true).await;
    let q = query("verify-full", &certs.ca(), &certs);
    SqlHarness::on_server("postgres-tls", server, true)
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

/// The [`PgTlsFailure`] behind a connect error; also checks that the error is permanent,
/// came without a hang, and that its message says what to do.
fn failure(result: Result<SqlStore, (Error, Duration)>, fix: &str) -> PgTlsFailure {
    let (e, took) = match result {
        Ok(_) => panic!("connected, but a TLS failure was expected"),
        Err(e) => e,
    };
    assert!(took < Duration::from_secs(5), "took {took:?}: {e}");
    let text = e.to_string();
    assert!(text.contains(fix), "the message should say {fix:?}: {text}");
    match &e {
        Error::Backend { retryable, .. } => assert!(!retryable, "permanent: {e:?}"),
        other => panic!("expected a backend error, got {other:?}"),
    }
    std::error::Error::source(&e)
        .and_then(|s| s.downcast_ref::<PgTlsFailure>())
        .cloned()
        .unwrap_or_else(|| panic!("no PgTlsFailure behind {e:?}"))
}

async fn select_one(url: &str) {
    let store = connect(url)
        .await
        .unwrap_or_else(|(e, _)| panic!("{url}: {e}"));
    // The floor probe opens its own connection, through the same connector.
    let mut probe = store.probe().await.unwrap();
    probe.select_one().await.unwrap();
}

#[tokio::test]
async fn every_mode_that_should_connect_does() {
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), false).await;
    let base = server.url();
    for q in [
        query("verify-full", &certs.ca(), &certs),
        query("verify-ca", &certs.ca(), &certs),
        format!("?sslmode=verify-full&sslrootcert={}", p(&certs.ca())),
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
    let server = tls_server(&certs, certs.server(), false).await;
    for mode in ["verify-full", "verify-ca", "require"] {
        // require with a root certificate checks the chain, as libpq does.
        let url = format!(
            "{}?sslmode={mode}&sslrootcert={}",
            server.url(),
            p(&certs.other_ca())
        );
        let f = failure(connect(&url).await, "sslrootcert=");
        assert_eq!(f, PgTlsFailure::UntrustedCertificate, "{mode}");
    }
}

#[tokio::test]
async fn an_expired_server_certificate_is_refused() {
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.expired(), false).await;
    let url = format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        server.url(),
        p(&certs.ca())
    );
    let f = failure(connect(&url).await, "renew");
    assert_eq!(f, PgTlsFailure::CertificateExpired);
}

#[tokio::test]
async fn a_wrong_name_fails_verify_full_and_passes_verify_ca() {
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.wrong_name(), false).await;
    let url = |mode: &str| {
        format!(
            "{}?sslmode={mode}&sslrootcert={}",
            server.url(),
            p(&certs.ca())
        )
    };
    let f = failure(connect(&url("verify-full")).await, "verify-ca");
    assert!(
        matches!(&f, PgTlsFailure::NameMismatch { name } if name == "127.0.0.1"),
        "{f:?}"
    );
    select_one(&url("verify-ca")).await;
}

#[tokio::test]
async fn a_host_name_the_certificate_lacks_fails_verify_full() {
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), false).await;
    // The certificate names localhost and 127.0.0.1; dial 127.0.0.1 by another name.
    let url = format!(
        "postgres://postgres@db.invalid:{}/simba?hostaddr=127.0.0.1&sslmode=verify-full&sslrootcert={}",
        server.port(),
        p(&certs.ca())
    );
    let f = failure(connect(&url).await, "verify-ca");
    assert!(
        matches!(&f, PgTlsFailure::NameMismatch { name } if name == "db.invalid"),
        "{f:?}"
    );
}

#[tokio::test]
async fn tls_required_but_not_offered() {
    let server = postgres_private().await.unwrap_or_else(|e| panic!("{e}"));
    let f = failure(
        connect(&format!("{}?sslmode=require", server.url())).await,
        "does not offer",
    );
    assert_eq!(f, PgTlsFailure::NotOffered);
    // prefer falls back to plain.
    select_one(&format!("{}?sslmode=prefer", server.url())).await;
}

#[tokio::test]
async fn a_plain_connection_to_a_tls_only_server_is_refused() {
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), false).await;
    let f = failure(
        connect(&format!("{}?sslmode=disable", server.url())).await,
        "sslmode=verify-full",
    );
    assert_eq!(f, PgTlsFailure::Required);
}

#[tokio::test]
async fn mutual_tls_without_a_client_certificate_is_refused() {
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), true).await;
    let url = format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        server.url(),
        p(&certs.ca())
    );
    let f = failure(connect(&url).await, "sslcert=");
    assert_eq!(f, PgTlsFailure::ClientCertificateRejected);
}

#[tokio::test]
async fn a_missing_ca_file_is_a_config_error() {
    let e = SqlStore::connect(SqlConfig::new(
        "postgres://postgres@127.0.0.1:1/simba?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
    ))
    .await
    .err()
    .unwrap();
    assert!(
        matches!(&e, Error::InvalidConfig { field, reason } if *field == "sslrootcert" && reason.contains("/nonexistent/ca.pem")),
        "{e:?}"
    );
}
