//! The lease contention engine shared by every lease backend (Redis, SQL, in-memory).
//!
//! - `config`: [`LeaseConfig`], the timing of a contender;
//! - `factory`: [`LeaseServiceFactory`], which makes services over one [`LeaseStore`](crate::backend::LeaseStore);
//! - `service`: [`LeaseContendService`] and [`LeaseRetrievalService`];
//! - `driver`: the task behind a service — when to call the store, what an answer means,
//!   the local lease deadline. It reports through the
//!   [`OwnershipTracker`](crate::backend::OwnershipTracker) and runs in a
//!   [`ServiceHandle`](crate::backend::ServiceHandle), as session backends do.

mod config;
mod driver;
mod factory;
mod service;

pub use config::{LeaseConfig, MAX_DURATION, validate_duration};
pub use factory::LeaseServiceFactory;
pub use service::{LeaseContendService, LeaseRetrievalService};
