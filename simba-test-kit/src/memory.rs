//! The conformance [`Harness`] over simba-core's in-memory store.

use std::sync::Arc;

use simba_core::backend::{BoxFuture, LeaseStore};
use simba_core::fault::{Behavior, FaultControl, FaultStore};
use simba_core::{ContendServiceFactory, LeaseConfig, LeaseServiceFactory, MemoryStore};

use crate::store_cases::StoreSource;
use crate::suite::{Fault, FaultyFactory, Harness, SetupError, SuiteCapabilities, SuiteTiming};

/// Runs the suite on any in-process [`LeaseStore`] that clones as a shared handle;
/// "separate processes" are separate factories over it. Faults hang every call of a
/// [`FaultStore`] wrapper.
#[derive(Debug, Clone)]
pub struct StoreHarness<S> {
    name: String,
    store: S,
    pushes_release: bool,
}

impl<S: LeaseStore + Clone> StoreHarness<S> {
    /// A harness over `store`; `pushes_release` says whether its waiters are pushed.
    pub fn new(name: impl Into<String>, store: S, pushes_release: bool) -> Self {
        StoreHarness {
            name: name.into(),
            store,
            pushes_release,
        }
    }
}

/// The harness over a fresh [`MemoryStore`].
pub type MemoryHarness = StoreHarness<MemoryStore>;

impl MemoryHarness {
    /// A harness over a fresh in-memory store.
    pub fn memory() -> Self {
        StoreHarness::new("memory", MemoryStore::new(), true)
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
}

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
