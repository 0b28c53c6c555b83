#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod admission;
pub mod backend;
pub mod connect;
mod error;
pub mod events;
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod fault;
#[cfg(any(test, fuzzing, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "bench")]
#[cfg_attr(docsrs, doc(cfg(feature = "bench")))]
pub mod hops;
mod id;
mod lease;
mod locker;
mod memory;
pub mod metrics;
#[cfg(test)]
mod model;
mod multi;
mod owner;
mod permit_store;
mod redact;
mod rt;
mod rwlock;
mod scheduler;
mod semaphore;
mod service;
mod store;
pub mod tls;
#[cfg(test)]
mod wakeups;

pub use error::{Error, LossReason, Result};
pub use id::{
    GENERATED_ID_MAX_LEN, MAX_CONTENDER_ID_LEN, MAX_MUTEX_NAME_LEN, check_common_contender_id,
    check_common_mutex_name, generate_contender_id,
};
pub use lease::{
    LeaseConfig, LeaseContendService, LeaseRetrievalService, LeaseServiceFactory, MAX_DURATION,
    validate_duration,
};
pub use locker::{LockGuard, LockRegistry, Locker};
pub use memory::MemoryStore;
pub use multi::{MAX_MULTI_LOCK_NAMES, MultiGuard, MultiLocker, PartLost};
pub use owner::{
    ContendPeriod, DEFAULT_JITTER, DEFAULT_JITTER_NO_TRANSITION, HELD_PREFIX, MutexOwner,
    MutexState,
};
pub use redact::{is_secret_key, redact_url_with};
pub use rwlock::{DRAIN_POLL_MAX, MAX_READERS, ReadGuard, RwLock, WriteGuard};
pub use scheduler::{LeaderScheduler, Schedule, WorkContext};
pub use semaphore::{PermitGuard, Semaphore};
pub use service::{
    ContendService, ContendServiceFactory, Contender, ContenderStatus, Held, Loss, MutexRetriever,
    RetrievalService, SilentContender, SilentRetriever,
};
