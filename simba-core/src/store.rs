//! The small contract a lease backend implements: [`LeaseStore`] (semaphores have their
//! own, [`PermitStore`](crate::backend::PermitStore)).
//!
//! Redis and SQL backends implement only this for their mutexes; the [`LeaseContendService`](crate::LeaseContendService)
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
    /// [`PermitStore`](crate::backend::PermitStore)): an unnamed holder whose lease ends at `at`, when the
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
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        (**self).check_contender_id(contender_id)
    }
}
