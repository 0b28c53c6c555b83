#![doc = include_str!("../README.md")]

pub mod chaos;
pub mod connector;
pub mod history;
pub mod memory;
pub mod permit_model;
pub mod proxy;
pub mod rw_cases;
pub mod semaphore_cases;
pub mod servers;
pub mod store_cases;
pub mod store_props;
pub mod suite;
pub mod support;
