#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod common;
mod config;
mod connector;
mod contend;
mod factory;
#[cfg(feature = "bench")]
mod floor;
mod permits;
mod retrieve;
mod tls;

pub use config::{
    DEFAULT_PORT, DEFAULT_PREFIX, EtcdConfig, EtcdTlsOptions, MAX_CONNECT_TIMEOUT, MAX_LEASE_TTL,
    MIN_LEASE_TTL, redact_url,
};
pub use connector::{CONNECTOR, EtcdConnector};
pub use contend::EtcdContendService;
pub use etcd_client;
pub use factory::EtcdFactory;
pub use permits::EtcdPermitStore;
pub use retrieve::EtcdRetrievalService;
/// Why a TLS connection failed: the `source` of the error [`EtcdFactory::connect`] returns
/// then (feature `tls`).
pub use simba_core::tls::{TlsFailure, TlsProblem};

/// The backend name this crate reports ([`ContendServiceFactory::backend`] and
/// [`Error::Backend`]'s `backend`).
///
/// [`ContendServiceFactory::backend`]: simba_core::ContendServiceFactory::backend
/// [`Error::Backend`]: simba_core::Error::Backend
pub const BACKEND: &str = common::BACKEND;
