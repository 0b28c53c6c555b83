//! `{`/`}` in mutex names (Cluster hash tags) are refused by the Redis factory with typed
//! errors before anything reaches the server, as by every backend (core's shared rule);
//! what only Redis refuses — `@@` in contender ids (its message separator) — is fine for
//! core.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::test_config;
use simba_core::{
    ContendServiceFactory, Error, LeaseConfig, LeaseServiceFactory, Locker, MemoryStore,
    SilentContender, SilentRetriever,
};
use simba_redis::{MESSAGE_SEPARATOR, RedisStore};
use simba_test_kit::servers::redis;
use simba_test_kit::support::{init_tracing, unique_name};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_refuses_braces_and_the_message_separator_up_front() {
    init_tracing();
    let server = redis().await.unwrap_or_else(|e| panic!("{e}"));
    let store = RedisStore::connect(test_config(server.url(), &unique_name("t")))
        .await
        .unwrap();
    let redis: Arc<dyn ContendServiceFactory> =
        Arc::new(LeaseServiceFactory::new(store, LeaseConfig::default()).unwrap());
    let memory: Arc<dyn ContendServiceFactory> =
        Arc::new(LeaseServiceFactory::new(MemoryStore::new(), LeaseConfig::default()).unwrap());
    let id = format!("owner{MESSAGE_SEPARATOR}x");

    for name in ["tag{x}", "open{", "close}"] {
        let r = redis.create_contend_service(name, Arc::new(SilentContender));
        assert!(matches!(r, Err(Error::InvalidName { .. })), "{name}: {r:?}");
        let r = redis.create_retrieval_service(name, Arc::new(SilentRetriever));
        assert!(matches!(r, Err(Error::InvalidName { .. })), "{name}");
        let r = Locker::new(redis.clone(), name);
        assert!(matches!(r, Err(Error::InvalidName { .. })), "{name}: {r:?}");
        let r = Locker::new(memory.clone(), name);
        assert!(
            matches!(r, Err(Error::InvalidName { .. })),
            "{name}: refused everywhere: {r:?}"
        );
    }
    let r = Locker::with_contender_id(redis.clone(), "fine", id.clone());
    assert!(matches!(r, Err(Error::InvalidContenderId { .. })), "{r:?}");
    assert!(Locker::with_contender_id(memory.clone(), "fine", id.clone()).is_ok());

    // A contender that brings its own id is checked when its service is made.
    struct Named(String);
    impl simba_core::Contender for Named {
        fn contender_id(&self) -> Option<String> {
            Some(self.0.clone())
        }
    }
    let r = redis.create_contend_service("fine", Arc::new(Named(id.clone())));
    assert!(matches!(r, Err(Error::InvalidContenderId { .. })), "{r:?}");
    assert!(
        memory
            .create_contend_service("fine", Arc::new(Named(id)))
            .is_ok()
    );
}
