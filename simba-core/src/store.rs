//! The small contract a lease backend implements: [`LeaseStore`].
//!
//! Redis and SQL backends implement only this; the [`LeaseContendService`](crate::LeaseContendService)
//! engine owns scheduling, state, callbacks, the local lease deadline and reconnects.

use std::future::Future;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::events::EventReceiver;
use crate::owner::MutexOwner;

/// The lease asked for by an acquisition or renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Time to live: the owner renews from here on.
    pub ttl: Duration,
    /// Transition period after `ttl` in which only the owner may renew.
    pub transition: Duration,
}

impl Lease {
    /// The whole lease, `ttl + transition`: how long the backend keeps the ownership.
    pub fn total(&self) -> Duration {
        self.ttl + self.transition
    }

    /// `ttl` in whole milliseconds.
    pub fn ttl_ms(&self) -> i64 {
        i64::try_from(self.ttl.as_millis()).unwrap_or(i64::MAX)
    }

    /// `transition` in whole milliseconds.
    pub fn transition_ms(&self) -> i64 {
        i64::try_from(self.transition.as_millis()).unwrap_or(i64::MAX)
    }
}

/// A store's answer: the owner after the operation, and the backend's clock when it was
/// evaluated (milliseconds since the Unix epoch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseReply {
    /// The owner after the operation ([`MutexOwner::NONE`] when there is none).
    pub owner: MutexOwner,
    /// The backend's time at which the operation was evaluated.
    pub now: i64,
}

impl LeaseReply {
    /// The reply a store gives a permit contender that may not take a permit yet (see
    /// *Permits* in [`LeaseStore`]): an unnamed holder whose lease ends at `at`, when the
    /// contender should look again unless a push wakes it first; `now` is the store's
    /// clock.
    pub fn look_again_at(at: i64, now: i64) -> LeaseReply {
        LeaseReply {
            owner: MutexOwner {
                owner_id: String::new(),
                acquired_at: 0,
                ttl_at: at,
                transition_at: at,
                fence: 0,
            },
            now,
        }
    }
}

/// The whole milliseconds a store keeps a mutex held for [`LeaseStore::release_after`]:
/// `hold` rounded **up** (a hold never ends early), `0` for a zero hold (a plain release).
///
/// # Errors
/// [`Error::InvalidConfig`] for a hold longer than [`MAX_DURATION`](crate::MAX_DURATION)
/// (one year): longer values are mistakes.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(simba_core::backend::hold_millis(Duration::from_micros(1001)).unwrap(), 2);
/// assert_eq!(simba_core::backend::hold_millis(Duration::ZERO).unwrap(), 0);
/// assert!(simba_core::backend::hold_millis(Duration::from_secs(400 * 24 * 3600)).is_err());
/// ```
pub fn hold_millis(hold: Duration) -> Result<i64> {
    if hold > crate::MAX_DURATION {
        return Err(Error::config(
            "hold",
            format!("{hold:?} is longer than one year"),
        ));
    }
    let ms = hold.as_nanos().div_ceil(1_000_000);
    Ok(i64::try_from(ms).unwrap_or(i64::MAX))
}

/// A push notification from a store that can push (Redis pub/sub, PostgreSQL NOTIFY).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreEvent {
    /// The owner released the mutex; a waiter should try to acquire now.
    Released,
    /// A contender acquired the mutex.
    Acquired {
        /// The new owner's id.
        owner_id: String,
    },
    /// Messages may have been lost (reconnect, lagging receiver): re-read the owner now.
    Resync,
}

/// The holders of a semaphore, from [`LeaseStore::permit_owners`].
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

/// The error of a permit operation on a backend that has no semaphores.
fn no_permits(backend: &'static str) -> Error {
    Error::unsupported(
        backend,
        "semaphores",
        "this backend does not implement the permit operations of the store contract",
    )
}

/// The wire protocol of a lease backend.
///
/// # Contract
/// - `acquire(m, c, lease)` makes `c` the owner of `m` **if** `m` has no owner, its owner's
///   `transition_at` has passed, or `c` already owns it within its lease. A new owner gets a
///   fence strictly greater than every fence this mutex has had; an owner that renews keeps
///   its fence and its `acquired_at`. Times are evaluated on the backend's clock:
///   `ttl_at = now + ttl`, `transition_at = now + ttl + transition`, and the backend keeps the
///   ownership for at most `ttl + transition` after `now`. Whatever happened, the reply names
///   the owner after the call — or, from a store with a wait queue, to a contender that may
///   not take the mutex yet, an unnamed holder (empty id, fence 0) whose `transition_at`
///   says when to look again. The operation is atomic and safe to run twice (clients replay
///   requests after a reconnect).
/// - `guard` renews an ownership `c` holds; it must never take a mutex someone else holds
///   within its lease. The default runs `acquire`.
/// - `release(m, c)` frees `m` only if `c` owns it (owner-checked and atomic) and returns
///   whether it did; a stale release never frees another owner's mutex.
/// - `release_after(m, c, hold)` ends `c`'s ownership of `m` at `hold` after the backend's
///   `now`, and not before: only if `c` owns `m` within its lease (owner-checked and
///   atomic, like `release`), it sets `ttl_at = transition_at = now + hold` and hands the
///   ownership to the id [`held_owner_id(c)`](crate::backend::held_owner_id), which no contender
///   has, keeping the fence and `acquired_at`. From then on nobody — `c` included — can
///   renew, release or take `m` until `now + hold` has passed; the backend frees it then
///   by itself (no renewals, no release call, no push). Returns whether `c` owned it; when
///   it did not, nothing changes. `hold` is a remaining duration, not an instant, so no
///   application clock enters the backend: the caller computes it from its monotonic
///   clock, the backend adds it to its own `now`. A `hold` of zero is a plain `release`;
///   see [`hold_millis`] for the accepted range. Safe to run twice (the second run finds
///   `c` no longer owner and returns `false`).
/// - `subscribe(m, c)` may return a channel of [`StoreEvent`]s for `c`; `None` means the
///   store cannot push and the engine polls on the contend period. Dropping the receiver
///   unsubscribes. A store that may have lost messages sends [`StoreEvent::Resync`].
/// - `leave(m, c)` tells the store that `c` no longer waits for `m` (wait queues).
/// - `check_mutex_name(m)` / `check_contender_id(c)` refuse what only this backend cannot
///   accept, beyond the rules every backend shares ([`check_common_mutex_name`](crate::check_common_mutex_name),
///   [`check_common_contender_id`](crate::check_common_contender_id), which the engine applies
///   first). The engine calls them when it makes a service, so bad input is a typed error
///   before anything reaches the backend. The defaults accept everything.
///
/// # Permits (semaphores)
/// A semaphore is a name and a permit count N; its holders are contenders, each with a lease
/// and a fence of its own. Semaphore names live apart from mutex names (a semaphore and a
/// mutex of one name are unrelated). The permit operations default to
/// [`Error::Unsupported`], so a backend without semaphores refuses them clearly.
/// - `permit_acquire(s, c, n, lease)`: as `acquire`, per permit. If `c` holds a permit of
///   `s` within its lease, it renews it (same fence, same `acquired_at`). Otherwise, once
///   the holders past their lease are dropped: if `s` has holders that agreed on another
///   count than `n`, it fails with [`Error::PermitsMismatch`] (no holder: `n` becomes the
///   count); if fewer than `n` hold and no earlier waiter is owed the free permit, `c`
///   becomes a holder with a fence strictly greater than every fence of `s` (across all
///   its permits); else `c` joins the wait queue (first come, first served) and the reply
///   names an unnamed holder (empty id, fence 0) whose `transition_at` says when to look
///   again. Never more than `n` holders within their lease. Atomic, safe to run twice.
/// - `permit_guard` renews a permit `c` holds and never takes one; the default runs
///   `permit_acquire`.
/// - `permit_release(s, c)` frees `c`'s permit (owner-checked, atomic), returns whether it
///   did, and wakes one waiter per freed permit; a non-holder only leaves the queue.
/// - `permit_owners(s)` reads the holders within their lease and the agreed count.
/// - `permit_subscribe` / `permit_leave` as `subscribe` / `leave`, for a semaphore.
///
/// Dropping a returned future halfway may leave its effect applied or not; the engine
/// tolerates either (it always re-reads, and releases on stop).
pub trait LeaseStore: Send + Sync + 'static {
    /// The backend's name, for errors and traces (`"redis"`, `"postgres"`, …).
    fn backend(&self) -> &'static str;

    /// Acquires or renews (see the trait's contract).
    fn acquire(
        &self,
        mutex: &str,
        contender_id: &str,
        lease: Lease,
    ) -> impl Future<Output = Result<LeaseReply>> + Send;

    /// Renews an ownership the contender holds (see the trait's contract).
    fn guard(
        &self,
        mutex: &str,
        contender_id: &str,
        lease: Lease,
    ) -> impl Future<Output = Result<LeaseReply>> + Send {
        self.acquire(mutex, contender_id, lease)
    }

    /// Releases the mutex if `contender_id` owns it; returns whether it did.
    fn release(&self, mutex: &str, contender_id: &str)
    -> impl Future<Output = Result<bool>> + Send;

    /// Releases the mutex so that it stays held for `hold` more (backend clock), without
    /// renewals, if `contender_id` owns it; returns whether it did (see the trait's
    /// contract). ShedLock's `lockAtLeastFor`.
    fn release_after(
        &self,
        mutex: &str,
        contender_id: &str,
        hold: Duration,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Reads the current owner.
    fn owner(&self, mutex: &str) -> impl Future<Output = Result<LeaseReply>> + Send;

    /// Subscribes `contender_id` to pushed events about `mutex`, if the store can push.
    fn subscribe(
        &self,
        mutex: &str,
        contender_id: &str,
    ) -> impl Future<Output = Result<Option<EventReceiver>>> + Send {
        let _ = (mutex, contender_id);
        async { Ok(None) }
    }

    /// Tells the store that `contender_id` stopped waiting for `mutex`.
    fn leave(&self, mutex: &str, contender_id: &str) -> impl Future<Output = Result<()>> + Send {
        let _ = (mutex, contender_id);
        async { Ok(()) }
    }

    /// Refuses a mutex name this backend cannot accept (see the trait's contract).
    ///
    /// # Errors
    /// [`Error::InvalidName`] saying why.
    fn check_mutex_name(&self, mutex: &str) -> Result<()> {
        let _ = mutex;
        Ok(())
    }

    /// Acquires or renews a permit of `semaphore` (see *Permits* in the trait's docs).
    ///
    /// # Errors
    /// [`Error::PermitsMismatch`] when the holders agreed on another count;
    /// [`Error::Unsupported`] from a backend without semaphores (the default).
    fn permit_acquire(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> impl Future<Output = Result<LeaseReply>> + Send {
        let _ = (semaphore, contender_id, permits, lease);
        let backend = self.backend();
        async move { Err(no_permits(backend)) }
    }

    /// Renews a permit the contender holds (see *Permits* in the trait's docs).
    fn permit_guard(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> impl Future<Output = Result<LeaseReply>> + Send {
        self.permit_acquire(semaphore, contender_id, permits, lease)
    }

    /// Releases the contender's permit; returns whether it held one.
    ///
    /// # Errors
    /// [`Error::Unsupported`] from a backend without semaphores (the default).
    fn permit_release(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> impl Future<Output = Result<bool>> + Send {
        let _ = (semaphore, contender_id);
        let backend = self.backend();
        async move { Err(no_permits(backend)) }
    }

    /// Reads the holders of `semaphore`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] from a backend without semaphores (the default).
    fn permit_owners(&self, semaphore: &str) -> impl Future<Output = Result<PermitHolders>> + Send {
        let _ = semaphore;
        let backend = self.backend();
        async move { Err(no_permits(backend)) }
    }

    /// Subscribes `contender_id` to pushed events about `semaphore`, if the store can push
    /// (the default cannot: waiters poll).
    fn permit_subscribe(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> impl Future<Output = Result<Option<EventReceiver>>> + Send {
        let _ = (semaphore, contender_id);
        async { Ok(None) }
    }

    /// Tells the store that `contender_id` stopped waiting for a permit of `semaphore`.
    fn permit_leave(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> impl Future<Output = Result<()>> + Send {
        let _ = (semaphore, contender_id);
        async { Ok(()) }
    }

    /// Refuses a contender id this backend cannot accept (see the trait's contract).
    ///
    /// # Errors
    /// [`Error::InvalidContenderId`] saying why.
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        let _ = contender_id;
        Ok(())
    }
}

impl<S: LeaseStore> LeaseStore for std::sync::Arc<S> {
    fn backend(&self) -> &'static str {
        (**self).backend()
    }
    fn acquire(
        &self,
        mutex: &str,
        contender_id: &str,
        lease: Lease,
    ) -> impl Future<Output = Result<LeaseReply>> + Send {
        (**self).acquire(mutex, contender_id, lease)
    }
    fn guard(
        &self,
        mutex: &str,
        contender_id: &str,
        lease: Lease,
    ) -> impl Future<Output = Result<LeaseReply>> + Send {
        (**self).guard(mutex, contender_id, lease)
    }
    fn release(
        &self,
        mutex: &str,
        contender_id: &str,
    ) -> impl Future<Output = Result<bool>> + Send {
        (**self).release(mutex, contender_id)
    }
    fn release_after(
        &self,
        mutex: &str,
        contender_id: &str,
        hold: Duration,
    ) -> impl Future<Output = Result<bool>> + Send {
        (**self).release_after(mutex, contender_id, hold)
    }
    fn owner(&self, mutex: &str) -> impl Future<Output = Result<LeaseReply>> + Send {
        (**self).owner(mutex)
    }
    fn subscribe(
        &self,
        mutex: &str,
        contender_id: &str,
    ) -> impl Future<Output = Result<Option<EventReceiver>>> + Send {
        (**self).subscribe(mutex, contender_id)
    }
    fn leave(&self, mutex: &str, contender_id: &str) -> impl Future<Output = Result<()>> + Send {
        (**self).leave(mutex, contender_id)
    }
    fn check_mutex_name(&self, mutex: &str) -> Result<()> {
        (**self).check_mutex_name(mutex)
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
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        (**self).check_contender_id(contender_id)
    }
}
