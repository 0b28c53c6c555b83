//! TLS against real `redis-server --tls-port` instances with certificates the test
//! generates: what works, and a typed, explained error for each way it can fail — never a
//! hang. Needs the `tls` feature (the workspace test command has it: simba-chaos enables
//! it).
#![cfg(feature = "tls")]
// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::test_config;
use simba_core::Error;
use simba_core::backend::{Lease, LeaseStore};
use simba_redis::{RedisStore, TlsFailure, TlsOptions, TlsProblem};
use simba_test_kit::servers::{CertPair, RedisTls, TestCerts, redis_private, redis_tls};
use simba_test_kit::support::{init_tracing, unique_name};
use tokio::time::Instant;

async fn tls_server(
    certs: &TestCerts,
    server: CertPair,
    mutual: bool,
) -> simba_test_kit::servers::TestServer {
    redis_tls(RedisTls {
        server,
        ca: certs.ca(),
        require_client_cert: mutual,
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Connects; on failure returns the error and how long it took.
async fn connect(url: &str, tls: TlsOptions) -> Result<RedisStore, (Error, Duration)> {
    let t0 = Instant::now();
    let config = test_config(url, &unique_name("t"))
        .with_replica_acks(Some(0))
        .with_connect_timeout(Duration::from_secs(5))
        .with_tls(tls);
    RedisStore::connect(config)
        .await
        .map_err(|e| (e, t0.elapsed()))
}

fn ca(path: std::path::PathBuf) -> TlsOptions {
    let mut tls = TlsOptions::default();
    tls.ca_file = Some(path);
    tls
}

/// The [`TlsFailure`] behind a connect error; also checks that the error is permanent,
/// came without a hang, and that its message says what to do.
fn failure(result: Result<RedisStore, (Error, Duration)>, fix: &str) -> TlsFailure {
    let (e, took) = match result {
        Ok(_) => panic!("connected, but a TLS failure was expected"),
        Err(e) => e,
    };
    // Bounded: the connect timeout (5 s; a TLS handshake with a plain server gets no answer
    // before it) plus a diagnosis of a round trip or two, generously.
    assert!(took < Duration::from_secs(7), "took {took:?}: {e}");
    assert!(!e.is_retryable(), "{e}");
    assert!(e.to_string().contains(fix), "{e}");
    let source = std::error::Error::source(&e).unwrap_or_else(|| panic!("no source: {e}"));
    source
        .downcast_ref::<TlsFailure>()
        .unwrap_or_else(|| panic!("source is not a TlsFailure: {source:?}"))
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_the_right_ca_works_by_url_and_by_options() {
    init_tracing();
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), false).await;
    let lease = Lease {
        ttl: Duration::from_secs(2),
        transition: Duration::from_secs(1),
    };
    let by_url = format!("{}?tlsCaFile={}", server.url(), certs.ca().display());
    let store = connect(&by_url, TlsOptions::default())
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    assert_eq!(
        store.acquire("m", "a", lease).await.unwrap().owner.owner_id,
        "a"
    );
    let store = connect(server.url(), ca(certs.ca()))
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    assert_eq!(
        store.acquire("m", "b", lease).await.unwrap().owner.owner_id,
        "b"
    );
    // By the name "localhost" instead of the IP address: both are in the certificate.
    let by_name = server.url().replace("127.0.0.1", "localhost");
    connect(&by_name, ca(certs.ca()))
        .await
        .map_err(|(e, _)| e)
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_ca_is_an_untrusted_certificate() {
    init_tracing();
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), false).await;
    let f = failure(
        connect(server.url(), ca(certs.other_ca())).await,
        "tlsCaFile",
    );
    assert_eq!(f.problem(), &TlsProblem::UntrustedCertificate);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_server_certificate() {
    init_tracing();
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.expired(), false).await;
    let f = failure(connect(server.url(), ca(certs.ca())).await, "expired");
    assert_eq!(f.problem(), &TlsProblem::CertificateExpired);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_name_mismatch_and_the_server_name_option() {
    init_tracing();
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.wrong_name(), false).await;
    let f = failure(connect(server.url(), ca(certs.ca())).await, "tlsServerName");
    assert_eq!(
        f.problem(),
        &TlsProblem::NameMismatch {
            name: "127.0.0.1".to_owned()
        }
    );
    // The name the certificate carries, given explicitly, is accepted.
    let url = format!(
        "{}?tlsCaFile={}&tlsServerName=elsewhere.example",
        server.url(),
        certs.ca().display()
    );
    connect(&url, TlsOptions::default())
        .await
        .map_err(|(e, _)| e)
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_asked_for_but_the_server_speaks_plain() {
    init_tracing();
    let certs = TestCerts::generate().unwrap();
    let plain = redis_private().await.unwrap();
    let url = plain.url().replace("redis://", "rediss://");
    let f = failure(connect(&url, ca(certs.ca())).await, "redis://");
    assert_eq!(f.problem(), &TlsProblem::NotOffered);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_asked_for_but_the_server_speaks_only_tls() {
    init_tracing();
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), false).await;
    let url = server.url().replace("rediss://", "redis://");
    let f = failure(connect(&url, TlsOptions::default()).await, "rediss://");
    assert_eq!(f.problem(), &TlsProblem::Required);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_needs_a_client_certificate() {
    init_tracing();
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), true).await;
    let f = failure(connect(server.url(), ca(certs.ca())).await, "tlsCertFile");
    assert_eq!(f.problem(), &TlsProblem::ClientCertificateRejected);
    let client = certs.client();
    let mut tls = ca(certs.ca());
    tls.cert_file = Some(client.cert);
    tls.key_file = Some(client.key);
    connect(server.url(), tls)
        .await
        .map_err(|(e, _)| e)
        .unwrap();
}

#[test]
fn bad_tls_settings_are_config_errors() {
    let certs = TestCerts::generate().unwrap();
    let field = |url: &str| match simba_redis::RedisConfig::new(url).validate() {
        Err(Error::InvalidConfig { field, .. }) => field,
        other => panic!("{url}: expected InvalidConfig, got {other:?}"),
    };
    assert_eq!(
        field("rediss://h:1?tlsCaFile=/nonexistent/ca.pem"),
        "tls.ca_file"
    );
    // A key is no certificate.
    let key = certs.server().key.display().to_string();
    assert_eq!(
        field(&format!("rediss://h:1?tlsCaFile={key}")),
        "tls.ca_file"
    );
    let cert = certs.client().cert.display().to_string();
    assert_eq!(field(&format!("rediss://h:1?tlsCertFile={cert}")), "tls");
    assert_eq!(field(&format!("redis://h:1?tlsCaFile={cert}")), "tls");
    assert_eq!(field("rediss://h:1?tlsFoo=1"), "url");
}

/// The connector takes the whole TLS setup from the URL: mutual TLS, checked by the kit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connector_does_mutual_tls_from_the_url() {
    init_tracing();
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, certs.server(), true).await;
    let url = format!("{}?{}", server.url(), common::mutual_tls(&certs).1);
    simba_test_kit::connector::check(
        &simba_redis::CONNECTOR,
        &url,
        None,
        common::CONNECTOR_EXPECT,
    )
    .await;
}
