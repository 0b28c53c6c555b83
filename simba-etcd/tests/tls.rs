//! TLS against a real local etcd serving its client port with certificates the test
//! generates (`simba_test_kit::servers::etcd_tls`): a lock works over `etcds://` with the
//! right CA (and with a client certificate where etcd asks for one), and a server whose
//! certificate no trusted CA signed is a typed, permanent error that says so — not a hang.
//! Needs the `tls` feature (the workspace test command has it: simba-chaos enables it).
#![cfg(feature = "tls")]
// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use simba_core::{ContendServiceFactory, Error, Locker};
use simba_etcd::{EtcdConfig, EtcdFactory, TlsFailure, TlsProblem};
use simba_test_kit::servers::{EtcdTls, TestCerts, TestServer, etcd_tls};
use simba_test_kit::support::{init_tracing, unique_name};
use tokio::time::Instant;

async fn tls_server(certs: &TestCerts, mutual: bool) -> TestServer {
    etcd_tls(EtcdTls {
        server: certs.server(),
        ca: certs.ca(),
        require_client_cert: mutual,
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

fn url(server: &TestServer, ca: &Path, extra: &str) -> String {
    format!(
        "{}/{}?tlsCaFile={}{extra}",
        server.url(),
        unique_name("tls"),
        ca.display()
    )
}

/// Connects with a 5 s connect timeout.
async fn connect(url: &str) -> simba_core::Result<EtcdFactory> {
    let config = EtcdConfig::from_url(url)?
        .with_lease_ttl(Duration::from_secs(2))
        .with_connect_timeout(Duration::from_secs(5));
    EtcdFactory::connect(config).await
}

/// Acquires and releases a mutex through `factory`; returns the fence.
async fn lock_once(factory: EtcdFactory) -> u64 {
    let factory: Arc<dyn ContendServiceFactory> = Arc::new(factory);
    let locker = Locker::new(factory, "tls-lock").unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(10), locker.acquire())
        .await
        .expect("no ownership within 10 s")
        .unwrap();
    assert!(guard.is_held());
    let fence = guard.fence();
    guard.release().await.unwrap();
    fence
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_the_right_ca_acquires_and_releases() {
    init_tracing();
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, false).await;
    assert!(server.url().starts_with("etcds://"), "{}", server.url());
    let factory = connect(&url(&server, &certs.ca(), ""))
        .await
        .unwrap_or_else(|e| panic!("{e:?}"));
    assert!(lock_once(factory).await > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_client_certificate_where_etcd_asks_for_one() {
    init_tracing();
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, true).await;
    let client = certs.client();
    let extra = format!(
        "&tlsCertFile={}&tlsKeyFile={}",
        client.cert.display(),
        client.key.display()
    );
    let factory = connect(&url(&server, &certs.ca(), &extra))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(lock_once(factory).await > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_certificate_of_another_ca_is_a_typed_tls_error() {
    init_tracing();
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, false).await;
    let t0 = Instant::now();
    let result = connect(&url(&server, &certs.other_ca(), "")).await;
    let took = t0.elapsed();
    let e = match result {
        Ok(_) => panic!("connected with a CA that signed nothing"),
        Err(e) => e,
    };
    // Bounded: the connect timeout (5 s) and one diagnosing handshake (at most 3 s).
    assert!(took < Duration::from_secs(9), "took {took:?}: {e}");
    assert!(matches!(e, Error::Backend { .. }), "{e:?}");
    assert!(!e.is_retryable(), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("TLS certificate") && text.contains("tlsCaFile"),
        "{text}"
    );
    let source = std::error::Error::source(&e).unwrap_or_else(|| panic!("no source: {e}"));
    let failure = source
        .downcast_ref::<TlsFailure>()
        .unwrap_or_else(|| panic!("source is not a TlsFailure: {source:?}"));
    assert_eq!(failure.problem(), &TlsProblem::UntrustedCertificate);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_client_certificate_where_etcd_asks_for_one_is_a_typed_tls_error() {
    init_tracing();
    let certs = TestCerts::generate().unwrap();
    let server = tls_server(&certs, true).await;
    let e = connect(&url(&server, &certs.ca(), ""))
        .await
        .expect_err("connected without the client certificate etcd asks for");
    assert!(!e.is_retryable(), "{e}");
    let source = std::error::Error::source(&e).unwrap_or_else(|| panic!("no source: {e}"));
    let failure = source
        .downcast_ref::<TlsFailure>()
        .unwrap_or_else(|| panic!("source is not a TlsFailure: {source:?}"));
    assert_eq!(
        failure.problem(),
        &TlsProblem::ClientCertificateRejected,
        "{e}"
    );
    assert!(e.to_string().contains("tlsCertFile"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_ca_file_is_a_config_error() {
    let e = connect("etcds://127.0.0.1:1/x?tlsCaFile=/nonexistent/ca.pem")
        .await
        .expect_err("a missing CA file must fail");
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                field: "tls.ca_file",
                ..
            }
        ),
        "{e:?}"
    );
}
