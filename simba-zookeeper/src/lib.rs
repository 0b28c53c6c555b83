#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod common;
mod config;
mod connector;
mod contend;
mod factory;
#[cfg(feature = "bench")]
mod floor;
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzzing;
mod permits;
mod recipe;
mod retrieve;
mod session;

pub use config::{
    DEFAULT_PORT, DEFAULT_ROOT, DigestAuth, MAX_CONNECT_TIMEOUT, MAX_SESSION_TIMEOUT,
    MIN_SESSION_TIMEOUT, ZkConfig, redact_url,
};
pub use connector::{CONNECTOR, ZkConnector};
pub use contend::ZkContendService;
pub use factory::ZkFactory;
pub use permits::ZkPermitStore;
pub use retrieve::ZkRetrievalService;

/// The backend name this crate reports ([`ContendServiceFactory::backend`] and
/// [`Error::Backend`]'s `backend`).
///
/// [`ContendServiceFactory::backend`]: simba_core::ContendServiceFactory::backend
/// [`Error::Backend`]: simba_core::Error::Backend
pub const BACKEND: &str = session::BACKEND;
