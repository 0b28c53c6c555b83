//! What a backend gives the conformance suite: [`Harness`].

use std::sync::Arc;
use std::time::Duration;

use simba_core::ContendServiceFactory;
use simba_core::backend::BoxFuture;

/// Errors of setting a backend up for a case (not case failures).
pub type SetupError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The lease timing a conformance case asks a [`Harness`] factory for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SuiteTiming {
    /// Lease backends: the ttl. Session backends: ignored.
    pub ttl: Duration,
    /// Lease backends: the transition. Session backends: ignored.
    pub transition: Duration,
}

impl SuiteTiming {
    /// The suite's usual short timing: ttl 1 s, transition 500 ms.
    pub const SHORT: SuiteTiming = SuiteTiming {
        ttl: Duration::from_millis(1000),
        transition: Duration::from_millis(500),
    };
}

/// What a backend can do, so cases can hold it to the right promise, with the bounds the
/// suite allows it (a connected backend describes itself with
/// [`simba_core::connect::Capabilities`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SuiteCapabilities {
    /// Waiters are told of a release by a push (pub/sub, NOTIFY, watches), so a handoff
    /// must not wait for a poll period.
    pub pushes_release: bool,
    /// The longest time after an owner goes silent (crash, partition) that another
    /// contender may need to take over, beyond which the failover case fails. Lease
    /// backends: `ttl + transition` plus jitter; ZooKeeper: the session timeout plus a tick.
    pub failover_bound: Duration,
    /// How long an owner whose backend stops answering may keep believing it owns.
    pub loss_bound: Duration,
}

/// Makes a backend's store hang, as a partition or a stopped server does.
pub trait Fault: Send + Sync + std::fmt::Debug {
    /// From now on, calls through this factory get no answer (connections stay open).
    fn partition(&self) -> BoxFuture<'_, Result<(), SetupError>>;
    /// Calls get answers again.
    fn heal(&self) -> BoxFuture<'_, Result<(), SetupError>>;
}

/// A factory whose traffic goes through a fault point, and that fault point.
pub type FaultyFactory = (Arc<dyn ContendServiceFactory>, Box<dyn Fault>);

/// One backend, as the conformance suite sees it.
///
/// Every `factory` call should return a factory with its **own connections**, as a separate
/// process would have; all factories of one harness share the same backend data.
pub trait Harness: Send + Sync {
    /// A short name for messages (`"redis"`, `"memory"`, …).
    fn name(&self) -> String;

    /// What the backend can do, for the given timing.
    fn capabilities(&self, timing: SuiteTiming) -> SuiteCapabilities;

    /// A new factory with the given timing.
    fn factory(
        &self,
        timing: SuiteTiming,
    ) -> BoxFuture<'_, Result<Arc<dyn ContendServiceFactory>, SetupError>>;

    /// A new factory whose traffic goes through a fault point.
    fn faulty_factory(
        &self,
        timing: SuiteTiming,
    ) -> BoxFuture<'_, Result<FaultyFactory, SetupError>>;

    /// Changes the owner of `mutex` by hand, behind the back of its owner `owner_id` (a
    /// contender of a factory of this harness that holds it now), as an operator or a
    /// program that does not speak simba's protocol would: afterwards the backend no
    /// longer has the mutex as `owner_id`'s, and nothing tells the owner before its next
    /// renewal or its release. What it does per backend: SQL `UPDATE <table> SET owner_id
    /// = 'intruder'`, Redis `SET <owner key> intruder PX …`, ZooKeeper the owner's latch
    /// node rewritten to name `intruder`, etcd the owner's key rewritten to `intruder`
    /// (keeping its lease), the memory store its record rewritten. Where a harness has no
    /// plain access to the data (a TLS server), the owner's release by another process
    /// ([`intrude_through_store`]) stands in for the hand. It says what it left:
    /// [`Intrusion`]. The case [`release_after_intrusion_is_lost`] needs it.
    ///
    /// The default refuses (the case then fails, never skips): a backend's harness says
    /// how its owner is changed by hand.
    ///
    /// [`release_after_intrusion_is_lost`]: crate::suite::release_after_intrusion_is_lost
    fn intrude(&self, mutex: &str, owner_id: &str) -> BoxFuture<'_, Result<Intrusion, SetupError>> {
        let (mutex, owner_id) = (mutex.to_owned(), owner_id.to_owned());
        let name = self.name();
        Box::pin(async move {
            Err(format!(
                "the {name} harness cannot change the owner of mutex {mutex:?} ({owner_id}) by \
                 hand: implement Harness::intrude"
            )
            .into())
        })
    }
}

/// The owner id that [`Harness::intrude`] writes.
pub const INTRUDER: &str = "intruder";

/// What [`Harness::intrude`] left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Intrusion {
    /// The backend names [`INTRUDER`] the owner, as a live owner within a lease longer
    /// than the case: nobody else may take the mutex meanwhile.
    TakenOver,
    /// The owner's ownership was ended (deleted, released under its id), or handed to an
    /// owner the backend may take the mutex from at once (SQLite, whose owners prove they
    /// live by a lock file the intruder does not hold).
    Freed,
}

/// [`Harness::intrude`] through a lease store's own calls: `owner_id`'s release from
/// another process, which must find it the owner; then, with `take`, [`INTRUDER`]'s
/// acquisition with `lease`, which must win.
///
/// # Errors
/// When the owner's release or the intruder's acquisition did not go as said, or the store
/// failed.
pub async fn intrude_through_store<S: simba_core::backend::LeaseStore>(
    store: &S,
    mutex: &str,
    owner_id: &str,
    take: Option<simba_core::backend::Lease>,
) -> Result<Intrusion, SetupError> {
    if !store.release(mutex, owner_id).await? {
        return Err(format!("intruding: {owner_id} does not own mutex {mutex:?}").into());
    }
    let Some(lease) = take else {
        return Ok(Intrusion::Freed);
    };
    let reply = store.acquire(mutex, INTRUDER, lease).await?;
    if !reply.owner.is_owner(INTRUDER) {
        return Err(format!(
            "intruding: {INTRUDER} did not get the released mutex {mutex:?}: {:?}",
            reply.owner
        )
        .into());
    }
    Ok(Intrusion::TakenOver)
}
