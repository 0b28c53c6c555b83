//! The conformance [`Harness`] over simba-core's in-memory store.

use std::sync::Arc;

use simba_core::backend::{BoxFuture, LeaseStore};
use simba_core::fault::{Behavior, FaultControl, FaultStore};
use simba_core::{ContendServiceFactory, LeaseConfig, LeaseServiceFactory, MemoryStore};

use crate::store_cases::StoreSource;
use crate::suite::{
    Fault, FaultyFactory, Harness, Intrusion, SetupError, SuiteCapabilities, SuiteTiming,
    intrude_through_store,
};

/// Runs the suite on any in-process [`LeaseStore`] that clones as a shared handle;
/// "separate processes" are separate factories over it. Faults hang every call of a
/// [`FaultStore`] wrapper.
#[derive(Debug, Clone)]
pub struct StoreHarness<S> {
    name: String,
    store: S,
    pushes_release: bool,
    /// How [`Harness::intrude`] changes an owner by hand, when the store offers a way
    /// that tells nobody (else the owner's release and the intruder's acquisition).
    intruder: Option<Intruder<S>>,
}

/// Rewrites the owner of a mutex (`store`, `mutex`, `owner_id`) to
/// [`INTRUDER`](crate::suite::INTRUDER) without telling anyone; whether `owner_id` owned it.
pub type Intruder<S> = fn(&S, &str, &str) -> bool;

impl<S: LeaseStore + Clone> StoreHarness<S> {
    /// A harness over `store`; `pushes_release` says whether its waiters are pushed.
    pub fn new(name: impl Into<String>, store: S, pushes_release: bool) -> Self {
        StoreHarness {
            name: name.into(),
            store,
            pushes_release,
            intruder: None,
        }
    }

    /// The same harness, whose [`Harness::intrude`] is `intruder`.
    pub fn with_intruder(mut self, intruder: Intruder<S>) -> Self {
        self.intruder = Some(intruder);
        self
    }
}

/// The harness over a fresh [`MemoryStore`].
pub type MemoryHarness = StoreHarness<MemoryStore>;

impl MemoryHarness {
    /// A harness over a fresh in-memory store.
    pub fn memory() -> Self {
        StoreHarness::new("memory", MemoryStore::new(), true).with_intruder(|store, m, owner| {
            store.overwrite_owner(m, owner, crate::suite::INTRUDER)
        })
    }
}

/// The lease config the lease harnesses use for a timing.
pub fn lease_config(timing: SuiteTiming) -> LeaseConfig {
    crate::support::lease(timing.ttl, timing.transition)
}

/// The capabilities of a lease backend with the given timing.
pub fn lease_capabilities(timing: SuiteTiming, pushes_release: bool) -> SuiteCapabilities {
    let lease = timing.ttl + timing.transition;
    SuiteCapabilities {
        pushes_release,
        // A waiter's poll comes at most a jitter period (1 s) after the lease ends.
        failover_bound: lease + std::time::Duration::from_millis(1500),
        loss_bound: lease + std::time::Duration::from_millis(500),
    }
}

/// A [`Fault`] that hangs every call of a [`FaultStore`].
#[derive(Debug, Clone)]
pub struct HangFault(pub FaultControl);

impl Fault for HangFault {
    fn partition(&self) -> BoxFuture<'_, Result<(), SetupError>> {
        self.0.set_all(Behavior::Hang);
        Box::pin(async { Ok(()) })
    }
    fn heal(&self) -> BoxFuture<'_, Result<(), SetupError>> {
        self.0.set_all(Behavior::Pass);
        Box::pin(async { Ok(()) })
    }
}

impl<S: LeaseStore + Clone> Harness for StoreHarness<S> {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn capabilities(&self, timing: SuiteTiming) -> SuiteCapabilities {
        lease_capabilities(timing, self.pushes_release)
    }

    fn factory(
        &self,
        timing: SuiteTiming,
    ) -> BoxFuture<'_, Result<Arc<dyn ContendServiceFactory>, SetupError>> {
        Box::pin(async move {
            let f = LeaseServiceFactory::new(self.store.clone(), lease_config(timing))?;
            Ok(Arc::new(f) as Arc<dyn ContendServiceFactory>)
        })
    }

    fn faulty_factory(
        &self,
        timing: SuiteTiming,
    ) -> BoxFuture<'_, Result<FaultyFactory, SetupError>> {
        Box::pin(async move {
            let store = FaultStore::new(self.store.clone());
            let fault = HangFault(store.control());
            let f = LeaseServiceFactory::new(store, lease_config(timing))?;
            Ok((
                Arc::new(f) as Arc<dyn ContendServiceFactory>,
                Box::new(fault) as Box<dyn Fault>,
            ))
        })
    }

    /// The harness's intruder ([`StoreHarness::with_intruder`]); without one, the owner's
    /// release, then [`INTRUDER`](crate::suite::INTRUDER)'s acquisition for a minute
    /// ([`intrude_through_store`]).
    fn intrude(&self, mutex: &str, owner_id: &str) -> BoxFuture<'_, Result<Intrusion, SetupError>> {
        let (mutex, owner_id) = (mutex.to_owned(), owner_id.to_owned());
        Box::pin(async move {
            match self.intruder {
                Some(intrude) if intrude(&self.store, &mutex, &owner_id) => {
                    Ok(Intrusion::TakenOver)
                }
                Some(_) => Err(format!("intruding: {owner_id} does not own {mutex:?}").into()),
                None => {
                    let take = Some(INTRUDER_LEASE);
                    intrude_through_store(&self.store, &mutex, &owner_id, take).await
                }
            }
        })
    }
}

/// The lease an intruder takes a mutex for: longer than any case that intrudes.
pub const INTRUDER_LEASE: simba_core::backend::Lease = simba_core::backend::Lease {
    ttl: std::time::Duration::from_secs(60),
    transition: std::time::Duration::from_secs(1),
};

impl<S: LeaseStore + Clone + 'static> StoreSource for StoreHarness<S> {
    type Store = S;

    fn name(&self) -> String {
        self.name.clone()
    }

    /// The same shared store each time: an in-process store has no connections of its own.
    fn store(&self) -> BoxFuture<'_, Result<S, SetupError>> {
        let store = self.store.clone();
        Box::pin(async move { Ok(store) })
    }

    fn pushes_release(&self) -> bool {
        self.pushes_release
    }
}
