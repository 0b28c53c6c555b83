//! A [`LeaseStore`] and [`PermitStore`] wrapper whose calls can be made to fail, stall or hang: for tests of the
//! engine and of code built on it. Test tooling, behind the `test-util` feature.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::events::EventReceiver;
use crate::permit_store::{PermitHolders, PermitStore};
use crate::store::{Lease, LeaseReply, LeaseStore};

/// A store operation, to aim a fault at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// [`LeaseStore::acquire`].
    Acquire,
    /// [`LeaseStore::guard`].
    Guard,
    /// [`LeaseStore::release`].
    Release,
    /// [`LeaseStore::owner`].
    Owner,
    /// [`LeaseStore::subscribe`].
    Subscribe,
    /// [`LeaseStore::release_after`].
    ReleaseAfter,
}

const OPS: [Op; 6] = [
    Op::Acquire,
    Op::Guard,
    Op::Release,
    Op::Owner,
    Op::Subscribe,
    Op::ReleaseAfter,
];

/// What a call does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Behavior {
    /// Passes through to the wrapped store.
    #[default]
    Pass,
    /// Fails at once with a retryable backend error; the wrapped store is not called.
    Fail,
    /// Waits this long, then passes through.
    Delay(Duration),
    /// Never answers.
    Hang,
    /// Passes through, then never answers (the effect happened; the caller never hears).
    ApplyThenHang,
}

#[derive(Debug, Default)]
struct State {
    behavior: [Behavior; OPS.len()],
    calls: [u64; OPS.len()],
}

/// Changes the behaviour of a [`FaultStore`] from the outside. Clones share the control.
#[derive(Debug, Clone, Default)]
pub struct FaultControl(Arc<Mutex<State>>);

impl FaultControl {
    fn idx(op: Op) -> usize {
        OPS.iter().position(|o| *o == op).unwrap_or(0)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets the behaviour of one operation.
    pub fn set(&self, op: Op, behavior: Behavior) {
        self.lock().behavior[Self::idx(op)] = behavior;
    }

    /// Sets the behaviour of every operation.
    pub fn set_all(&self, behavior: Behavior) {
        self.lock().behavior = [behavior; OPS.len()];
    }

    /// How many times `op` was called.
    pub fn calls(&self, op: Op) -> u64 {
        self.lock().calls[Self::idx(op)]
    }

    fn enter(&self, op: Op) -> Behavior {
        let mut s = self.lock();
        s.calls[Self::idx(op)] += 1;
        s.behavior[Self::idx(op)]
    }
}

/// Wraps a store; see [`FaultControl`].
#[derive(Debug, Clone)]
pub struct FaultStore<S> {
    inner: S,
    control: FaultControl,
}

impl<S> FaultStore<S> {
    /// Wraps `inner`; every call passes until told otherwise.
    pub fn new(inner: S) -> Self {
        FaultStore {
            inner,
            control: FaultControl::default(),
        }
    }

    /// The control of this store.
    pub fn control(&self) -> FaultControl {
        self.control.clone()
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S: Sync> FaultStore<S> {
    async fn run<T: Send>(
        &self,
        backend: &'static str,
        op: Op,
        call: impl Future<Output = Result<T>> + Send,
    ) -> Result<T> {
        match self.control.enter(op) {
            Behavior::Pass => call.await,
            Behavior::Fail => Err(Error::backend(
                backend,
                format!("injected failure of {op:?}"),
            )),
            Behavior::Delay(d) => {
                tokio::time::sleep(d).await;
                call.await
            }
            Behavior::Hang => std::future::pending().await,
            Behavior::ApplyThenHang => {
                let _ = call.await;
                std::future::pending().await
            }
        }
    }
}

impl<S: LeaseStore> LeaseStore for FaultStore<S> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn check_mutex_name(&self, mutex: &str) -> Result<()> {
        self.inner.check_mutex_name(mutex)
    }
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        self.inner.check_contender_id(contender_id)
    }

    async fn acquire(&self, mutex: &str, contender_id: &str, lease: Lease) -> Result<LeaseReply> {
        self.run(
            self.inner.backend(),
            Op::Acquire,
            self.inner.acquire(mutex, contender_id, lease),
        )
        .await
    }

    async fn guard(&self, mutex: &str, contender_id: &str, lease: Lease) -> Result<LeaseReply> {
        self.run(
            self.inner.backend(),
            Op::Guard,
            self.inner.guard(mutex, contender_id, lease),
        )
        .await
    }

    async fn release(&self, mutex: &str, contender_id: &str) -> Result<bool> {
        self.run(
            self.inner.backend(),
            Op::Release,
            self.inner.release(mutex, contender_id),
        )
        .await
    }

    async fn release_after(&self, mutex: &str, contender_id: &str, hold: Duration) -> Result<bool> {
        self.run(
            self.inner.backend(),
            Op::ReleaseAfter,
            self.inner.release_after(mutex, contender_id, hold),
        )
        .await
    }

    async fn owner(&self, mutex: &str) -> Result<LeaseReply> {
        self.run(self.inner.backend(), Op::Owner, self.inner.owner(mutex))
            .await
    }

    async fn subscribe(&self, mutex: &str, contender_id: &str) -> Result<Option<EventReceiver>> {
        self.run(
            self.inner.backend(),
            Op::Subscribe,
            self.inner.subscribe(mutex, contender_id),
        )
        .await
    }

    async fn leave(&self, mutex: &str, contender_id: &str) -> Result<()> {
        self.inner.leave(mutex, contender_id).await
    }
}

/// Permits fail as the mutex calls of the same kind do.
impl<S: PermitStore> PermitStore for FaultStore<S> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn permit_claim(&self) -> Option<std::time::Duration> {
        self.inner.permit_claim()
    }
    fn check_semaphore_name(&self, semaphore: &str) -> Result<()> {
        self.inner.check_semaphore_name(semaphore)
    }
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        self.inner.check_contender_id(contender_id)
    }

    async fn permit_acquire(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> Result<LeaseReply> {
        let call = self
            .inner
            .permit_acquire(semaphore, contender_id, permits, lease);
        self.run(self.inner.backend(), Op::Acquire, call).await
    }

    async fn permit_guard(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> Result<LeaseReply> {
        let call = self
            .inner
            .permit_guard(semaphore, contender_id, permits, lease);
        self.run(self.inner.backend(), Op::Guard, call).await
    }

    async fn permit_release(&self, semaphore: &str, contender_id: &str) -> Result<bool> {
        let call = self.inner.permit_release(semaphore, contender_id);
        self.run(self.inner.backend(), Op::Release, call).await
    }

    async fn permit_owners(&self, semaphore: &str) -> Result<PermitHolders> {
        self.run(
            self.inner.backend(),
            Op::Owner,
            self.inner.permit_owners(semaphore),
        )
        .await
    }

    async fn permit_subscribe(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> Result<Option<EventReceiver>> {
        let call = self.inner.permit_subscribe(semaphore, contender_id);
        self.run(self.inner.backend(), Op::Subscribe, call).await
    }

    async fn permit_leave(&self, semaphore: &str, contender_id: &str) -> Result<()> {
        self.inner.permit_leave(semaphore, contender_id).await
    }
}
