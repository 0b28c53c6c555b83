//! What a backend implements and the engine parts it builds on: the lease store contract
//! ([`LeaseStore`], [`Lease`], [`LeaseReply`], [`StoreEvent`], [`hold_millis`],
//! [`held_owner_id`]), the permit store contract of semaphores ([`PermitStore`],
//! [`PermitHolders`]) with its admission rule written once ([`admit_permit`]), the
//! session-backend parts below, and the plumbing of the
//! object-safe service traits ([`BoxFuture`], [`ServiceFactory`]). Applications do not
//! need this module: they use [`Locker`](crate::Locker),
//! [`LeaderScheduler`](crate::LeaderScheduler), [`LeaseConfig`](crate::LeaseConfig) and a
//! backend's factory.
//!
//! # Where a backend plugs in
//!
//! There are two families of backends, and each has one contract:
//!
//! - **Lease backends** (Redis, SQL, the in-memory store) implement only
//!   [`LeaseStore`], the wire protocol: acquire, renew, release, read,
//!   and optionally push. The lease engine ([`LeaseServiceFactory`](crate::LeaseServiceFactory))
//!   owns scheduling, state, callbacks, the local lease deadline and reconnects. A backend
//!   with semaphores implements [`PermitStore`] as well (ZooKeeper's semaphores implement
//!   only that), and [`Semaphore`](crate::Semaphore) runs its permits on the same engine.
//! - **Session backends** (ZooKeeper: ownership is a node that lives as long as a session)
//!   implement [`ContendService`](crate::ContendService) and
//!   [`RetrievalService`](crate::RetrievalService) themselves, following the status
//!   protocol written in [`ContendService`'s contract](crate::ContendService#contract). They
//!   do it with the same parts the lease engine is built from, so no state machine is
//!   written twice:
//!   - [`ServiceHandle`]: the service itself — identity, status, start, stop, restart —
//!     around the backend's driver ([`DriverFn`]) and the state it shares with it; a
//!     service type made of one implements [`ContendHandle`] or [`RetrievalHandle`] and
//!     gets [`ContendService`](crate::ContendService) or
//!     [`RetrievalService`](crate::RetrievalService) from them;
//!   - [`ServiceRunner`]: the background task under it — start, stop, restart, stop on
//!     drop, with a [`CancellationToken`](tokio_util::sync::CancellationToken) as the stop
//!     signal;
//!   - [`ServiceStatus`] and [`OwnershipTracker`]: the ownership state machine and the
//!     only writer of the status — acquired, renewed, suspect, lost, attempts counted,
//!     callbacks before status;
//!   - [`contender_id_for`]: the id a contender contends with, validated or generated;
//!   - [`ServiceFactory`]: the typed factory; the object-safe
//!     [`ContendServiceFactory`](crate::ContendServiceFactory) comes with it.
//!
//! A session backend's driver then only decides, from its own protocol, *when* it owns,
//! when its answers stop, and when the ownership ended.

mod factory;
mod handle;
mod ownership;
mod runner;

pub use factory::ServiceFactory;
pub use handle::{ContendHandle, DriverFn, RetrievalHandle, ServiceHandle};
pub use ownership::{OwnershipTracker, Reporter, ServiceStatus};
pub use runner::ServiceRunner;

pub use crate::admission::{
    Admission, AdmissionHolder, AdmissionWaiter, PERMIT_CLAIM_MS, PermitDecision, PermitRequest,
    SemaphoreState, WAITER_GRACE_MS, admit_permit, permit_wakes,
};
pub use crate::owner::held_owner_id;
pub use crate::permit_store::{PermitHolders, PermitStore};
pub use crate::service::BoxFuture;
pub use crate::store::{Lease, LeaseReply, LeaseStore, StoreEvent, hold_millis};

use crate::error::Result;
use crate::id::{check_common_contender_id, generate_contender_id};
use crate::service::Contender;

/// The id `contender` contends with: its own ([`Contender::contender_id`]) after
/// [`check_common_contender_id`], or a new one from
/// [`generate_contender_id`].
///
/// # Errors
/// [`Error::InvalidContenderId`](crate::Error::InvalidContenderId) for a bad own id.
pub fn contender_id_for(contender: &dyn Contender) -> Result<String> {
    match contender.contender_id() {
        Some(id) => {
            check_common_contender_id(&id)?;
            Ok(id)
        }
        None => Ok(generate_contender_id()),
    }
}

/// 64 pseudo-random bits, different in every call and every process (seeded from the
/// standard library's per-process hasher keys, the clock and a counter). Not for
/// cryptography: for jitter, id suffixes and node-name tokens.
pub fn random_u64() -> u64 {
    crate::id::random_u64()
}
