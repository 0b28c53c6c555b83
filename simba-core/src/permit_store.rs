//! The small contract a semaphore backend implements: [`PermitStore`].
//!
//! [`Semaphore`](crate::Semaphore) runs every permit through the one lease engine; a store
//! only keeps the holders, the waiters and the fence of each semaphore, and decides an
//! acquisition by the rule [`admit_permit`](crate::backend::admit_permit) writes down.

use std::future::Future;

use crate::error::Result;
use crate::events::EventReceiver;
use crate::owner::MutexOwner;
use crate::store::{Lease, LeaseReply};

/// The holders of a semaphore, from [`PermitStore::permit_owners`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermitHolders {
    /// The permit count the holders agreed on; `None` when there is no holder.
    pub permits: Option<u32>,
    /// Each holder within its lease, as a mutex owner (its own fence and lease times),
    /// in the order they acquired.
    pub holders: Vec<MutexOwner>,
    /// The backend's time at which this was read (milliseconds since the Unix epoch).
    pub now: i64,
}

/// The wire protocol of a semaphore backend.
///
/// A semaphore is a name and a permit count N; its holders are contenders, each with a
/// lease and a fence of its own (a permit is an ownership like a mutex's, see
/// [`LeaseStore`](crate::backend::LeaseStore)). Semaphore names live apart from mutex names:
/// a semaphore and a mutex of one name are unrelated. A backend without semaphores does
/// not implement this trait.
///
/// # Contract
/// - `permit_acquire(s, c, n, lease)` decides by the rule of
///   [`admit_permit`](crate::backend::admit_permit), on the backend's clock `now`:
///   - holders past their lease (`transition_at <= now`) and waiters past the time their
///     place is kept are dropped first;
///   - if `c` holds a permit of `s` within its lease, it **renews** it: `ttl_at = now +
///     ttl`, `transition_at = now + ttl + transition`, the **same fence and the same
///     `acquired_at`**; the reply names `c`;
///   - otherwise, if `s` has holders that agreed on another count than `n`, it fails with
///     [`Error::PermitsMismatch`](crate::Error::PermitsMismatch) and changes nothing else
///     (with no holder, `n` becomes the count);
///   - a waiter owed a free permit gets a claim deadline the first time the store finds
///     it owed (`now + ` [`permit_claim`](PermitStore::permit_claim)); once that has come,
///     it is **passed over**: it keeps its place, but does not count against the waiters
///     behind it until it calls again (a stopped waiter does not hold a permit up). A
///     store without `permit_claim` never passes a waiter over;
///   - otherwise, if fewer than `n` hold and no earlier waiter (not passed over) is owed
///     the free permit (one free permit per waiter, first come first served), `c`
///     **takes** one: a fence
///     strictly greater than every fence `s` has had, **across all its permits**,
///     `acquired_at = now`; the reply names `c`;
///   - otherwise `c` **waits**: it keeps its place in the queue (or joins it at the end;
///     a later contender never gets ahead of it), and the reply is
///     [`LeaseReply::look_again_at`]: an unnamed holder (empty id, fence 0) whose
///     `transition_at` says when to look again unless a push wakes it first.
///
///   Never more than `n` holders within their lease. Atomic, and safe to run twice
///   (clients replay requests after a reconnect): run again by a holder it is a renewal,
///   by a waiter it keeps its place.
/// - `permit_guard(s, c, n, lease)` renews a permit `c` holds within its lease and never
///   takes one (a contender that holds none gets a `look_again_at` reply). The default runs
///   `permit_acquire`.
/// - `permit_release(s, c)` frees `c`'s permit only if `c` holds one within its lease
///   (owner-checked and atomic) and returns whether it did; it also takes `c` out of the
///   queue. It wakes one waiter per freed permit, the earliest first, and the waiter after
///   them (it looks again when their claims end): the waiters
///   [`permit_wakes`](crate::backend::permit_wakes) names (where the store can push; a
///   store that pushes may drop from the queue a waiter that no push reaches, as gone, and
///   wake the next). A release by a contender that holds no permit only takes
///   it out of the queue: it returns `false` and frees nothing — a stale release never
///   frees another holder's permit. Safe to run twice (the second run returns `false`).
/// - `permit_owners(s)` reads the holders within their lease and the count they agreed on
///   (`None` with no holder).
/// - `permit_subscribe(s, c)` may return a channel of
///   [`StoreEvent`](crate::backend::StoreEvent)s for `c` (a wake-up is
///   [`StoreEvent::Released`](crate::backend::StoreEvent::Released)); `None` (the default)
///   means the store cannot push and waiters poll. Dropping the receiver unsubscribes.
/// - `permit_leave(s, c)` tells the store that `c` no longer waits: it leaves the queue (a
///   free permit it was owed goes to the next waiter). A permit `c` holds stays held until
///   its lease ends (the engine leaves when it lost track of its permit). The default does
///   nothing.
/// - `check_semaphore_name(s)` / `check_contender_id(c)` refuse what only this backend
///   cannot accept, beyond the rules every backend shares (the engine applies those first).
///   The defaults accept everything.
///
/// Times are the backend's clock; the local lease deadline that makes a holder stop
/// believing before its permit returns is the engine's. Dropping a returned future halfway
/// may leave its effect applied or not; the engine tolerates either (it always re-reads,
/// and releases on stop).
pub trait PermitStore: Send + Sync + 'static {
    /// The backend's name, for errors and traces (`"redis"`, `"postgres"`, …).
    fn backend(&self) -> &'static str;

    /// How long a waiter owed a free permit has to take it before this store passes it over
    /// (the rule's [`PermitRequest::claim_ms`](crate::backend::PermitRequest::claim_ms));
    /// `None` (the default): the store never passes a waiter over, so a stopped waiter
    /// holds its permit up until its place ends.
    fn permit_claim(&self) -> Option<std::time::Duration> {
        None
    }

    /// Acquires or renews a permit of `semaphore`, or waits in its queue (see the trait's
    /// contract).
    ///
    /// # Errors
    /// [`Error::PermitsMismatch`](crate::Error::PermitsMismatch) when the holders agreed on
    /// another count; the backend's errors.
    fn permit_acquire(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> impl Future<Output = Result<LeaseReply>> + Send;

    /// Renews a permit the contender holds, never taking one (see the trait's contract).
    ///
    /// # Errors
    /// As [`PermitStore::permit_acquire`].
    fn permit_guard(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> impl Future<Output = Result<LeaseReply>> + Send {
        self.permit_acquire(semaphore, contender_id, permits, lease)
    }

    /// Releases the contender's permit and takes it out of the queue; returns whether it
    /// held a permit.
    ///
    /// # Errors
    /// The backend's errors.
    fn permit_release(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Reads the holders of `semaphore` within their lease, and the count they agreed on.
    ///
    /// # Errors
    /// The backend's errors.
    fn permit_owners(&self, semaphore: &str) -> impl Future<Output = Result<PermitHolders>> + Send;

    /// Subscribes `contender_id` to pushed events about `semaphore`, if the store can push
    /// (the default cannot: waiters poll).
    ///
    /// # Errors
    /// The backend's errors.
    fn permit_subscribe(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> impl Future<Output = Result<Option<EventReceiver>>> + Send {
        let _ = (semaphore, contender_id);
        async { Ok(None) }
    }

    /// Tells the store that `contender_id` stopped waiting for a permit of `semaphore`.
    ///
    /// # Errors
    /// The backend's errors.
    fn permit_leave(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> impl Future<Output = Result<()>> + Send {
        let _ = (semaphore, contender_id);
        async { Ok(()) }
    }

    /// Refuses a semaphore name this backend cannot accept (see the trait's contract).
    ///
    /// # Errors
    /// [`Error::InvalidName`](crate::Error::InvalidName) saying why.
    fn check_semaphore_name(&self, semaphore: &str) -> Result<()> {
        let _ = semaphore;
        Ok(())
    }

    /// Refuses a contender id this backend cannot accept (see the trait's contract).
    ///
    /// # Errors
    /// [`Error::InvalidContenderId`](crate::Error::InvalidContenderId) saying why.
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        let _ = contender_id;
        Ok(())
    }
}

impl<S: PermitStore> PermitStore for std::sync::Arc<S> {
    fn backend(&self) -> &'static str {
        (**self).backend()
    }
    fn permit_claim(&self) -> Option<std::time::Duration> {
        (**self).permit_claim()
    }
    fn permit_acquire(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> impl Future<Output = Result<LeaseReply>> + Send {
        (**self).permit_acquire(semaphore, contender_id, permits, lease)
    }
    fn permit_guard(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> impl Future<Output = Result<LeaseReply>> + Send {
        (**self).permit_guard(semaphore, contender_id, permits, lease)
    }
    fn permit_release(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> impl Future<Output = Result<bool>> + Send {
        (**self).permit_release(semaphore, contender_id)
    }
    fn permit_owners(&self, semaphore: &str) -> impl Future<Output = Result<PermitHolders>> + Send {
        (**self).permit_owners(semaphore)
    }
    fn permit_subscribe(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> impl Future<Output = Result<Option<EventReceiver>>> + Send {
        (**self).permit_subscribe(semaphore, contender_id)
    }
    fn permit_leave(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> impl Future<Output = Result<()>> + Send {
        (**self).permit_leave(semaphore, contender_id)
    }
    fn check_semaphore_name(&self, semaphore: &str) -> Result<()> {
        (**self).check_semaphore_name(semaphore)
    }
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        (**self).check_contender_id(contender_id)
    }
}
