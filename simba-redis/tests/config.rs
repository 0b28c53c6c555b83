//! Connecting: ACL users, bad URLs and settings, unreachable servers.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{cmd, raw, test_config};
use simba_core::backend::{Lease, LeaseStore};
use simba_core::{Error, LeaseConfig};
use simba_redis::{RedisConfig, RedisStore};
use simba_test_kit::servers::redis_private;
use simba_test_kit::support::{init_tracing, lease, unique_name};

const LEASE: Lease = Lease {
    ttl: Duration::from_secs(2),
    transition: Duration::from_secs(1),
};

fn url_with_auth(url: &str, userinfo: &str) -> String {
    url.replacen("redis://", &format!("redis://{userinfo}@"), 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acl_user_and_password() {
    init_tracing();
    let server = redis_private().await.unwrap_or_else(|e| panic!("{e}"));
    let admin = raw(server.url()).await;
    let prefix = unique_name("t");
    let keys = format!("~{prefix}:*");
    let channels = format!("&{prefix}:*");
    cmd(
        &admin,
        "ACL",
        &[
            "SETUSER", "simba", "on", ">s3cret", &keys, &channels, "+@all",
        ],
    )
    .await;
    cmd(
        &admin,
        "ACL",
        &[
            "SETUSER", "narrow", "on", ">pw", "~other:*", "&other:*", "+@all",
        ],
    )
    .await;

    // Credentials in the URL.
    let url = url_with_auth(server.url(), "simba:s3cret");
    let store = RedisStore::connect(test_config(&url, &prefix))
        .await
        .unwrap();
    let r = store.acquire("acl", "a", LEASE).await.unwrap();
    assert_eq!(r.owner.owner_id, "a");
    assert!(store.release("acl", "a").await.unwrap());
    assert!(!format!("{store:?}").contains("s3cret"), "{store:?}");

    // Credentials in the config.
    let store = RedisStore::connect(
        test_config(server.url(), &prefix).with_credentials(Some("simba"), "s3cret"),
    )
    .await
    .unwrap();
    assert_eq!(
        store
            .acquire("acl", "b", LEASE)
            .await
            .unwrap()
            .owner
            .owner_id,
        "b"
    );
    let factory = simba_redis::factory(
        &url,
        lease(Duration::from_secs(1), Duration::from_millis(500)),
    )
    .await
    .unwrap();
    assert_eq!(factory.store().owner_key("x"), "simba:{x}");

    // A wrong password is not retryable, says what to check, and does not print itself.
    let bad = url_with_auth(server.url(), "simba:wrong");
    let e = RedisStore::connect(test_config(&bad, &prefix))
        .await
        .expect_err("wrong password accepted");
    assert!(
        matches!(
            e,
            Error::Backend {
                retryable: false,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("password"), "{e}");
    assert!(!e.to_string().contains("wrong"), "{e}");

    // A user without access to the key prefix fails, not retryably.
    let narrow = url_with_auth(server.url(), "narrow:pw");
    let store = RedisStore::connect(test_config(&narrow, &prefix))
        .await
        .unwrap();
    let e = store
        .acquire("acl", "c", LEASE)
        .await
        .expect_err("acquire without key permission");
    assert!(
        matches!(
            e,
            Error::Backend {
                retryable: false,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string().contains("the ACL user lacks a permission"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_urls_and_settings_are_typed_errors() {
    init_tracing();
    for url in [
        "",
        "127.0.0.1:6379",
        "http://127.0.0.1:6379",
        "redis://",
        "redis://127.0.0.1:99999",
        "redis-sentinel://127.0.0.1:26379",
    ] {
        match RedisStore::connect(RedisConfig::new(url)).await {
            Err(Error::InvalidConfig {
                field: "url",
                reason,
            }) => {
                assert!(!reason.is_empty());
            }
            other => panic!("{url:?}: expected InvalidConfig(url), got {other:?}"),
        }
    }
    #[cfg(not(feature = "tls"))]
    match RedisStore::connect(RedisConfig::new("rediss://127.0.0.1:6379")).await {
        Err(Error::InvalidConfig {
            field: "url",
            reason,
        }) => {
            assert!(reason.contains("tls"), "{reason}");
        }
        other => panic!("rediss without tls: {other:?}"),
    }
    let e = RedisStore::connect(
        RedisConfig::new("redis://127.0.0.1:6379").with_command_timeout(Duration::from_micros(1)),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                field: "command_timeout",
                ..
            }
        ),
        "{e:?}"
    );
    let e = RedisStore::connect(RedisConfig::new("redis://127.0.0.1:6379").with_key_prefix("a{b}"))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                field: "key_prefix",
                ..
            }
        ),
        "{e:?}"
    );

    // The lease is checked before any connection is tried.
    let bad_lease = LeaseConfig::with_lease(Duration::ZERO, Duration::from_secs(1));
    let e = simba_redis::factory("redis://127.0.0.1:1", bad_lease)
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidConfig { field: "ttl", .. }),
        "{e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_is_a_retryable_error() {
    init_tracing();
    // A port nobody listens on: bind, note it, close.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap();
    let config = RedisConfig::new(format!("redis://127.0.0.1:{port}"))
        .with_connect_timeout(Duration::from_secs(2));
    let t0 = std::time::Instant::now();
    let e = RedisStore::connect(config).await.unwrap_err();
    assert!(e.is_retryable(), "{e:?}");
    assert!(
        matches!(
            e,
            Error::Backend {
                backend: "redis",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
}
