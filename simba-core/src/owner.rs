//! The owner model: [`MutexOwner`], [`MutexState`] and [`ContendPeriod`].

use std::ops::Range;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Who owns a mutex, and until when.
///
/// Times are milliseconds since the Unix epoch **on the backend's clock** where the backend
/// has one (Redis `TIME`, the database's `now`), so that no application clock enters the
/// decision of who may acquire.
///
/// - until `ttl_at` the owner is expected to renew;
/// - between `ttl_at` and `transition_at` only the owner may still renew;
/// - after `transition_at` anyone may acquire.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MutexOwner {
    /// The owning contender's id; empty for [`MutexOwner::NONE`].
    pub owner_id: String,
    /// When the current owner acquired the mutex (kept across renewals).
    pub acquired_at: i64,
    /// When the owner's time-to-live ends.
    pub ttl_at: i64,
    /// When the transition period ends and anyone may acquire.
    pub transition_at: i64,
    /// Fencing token: strictly greater for every new acquisition of this mutex, unchanged
    /// while the same owner renews. Zero for [`MutexOwner::NONE`].
    pub fence: u64,
}

impl MutexOwner {
    /// No owner.
    pub const NONE: MutexOwner = MutexOwner {
        owner_id: String::new(),
        acquired_at: 0,
        ttl_at: 0,
        transition_at: 0,
        fence: 0,
    };

    /// Whether this value names an owner at all (it may still be expired).
    pub fn has_owner(&self) -> bool {
        !self.owner_id.is_empty()
    }

    /// Whether `contender_id` is the owner named here.
    pub fn is_owner(&self, contender_id: &str) -> bool {
        self.has_owner() && self.owner_id == contender_id
    }

    /// Whether, at backend time `now`, the owner is within its time-to-live.
    pub fn is_in_ttl(&self, now: i64) -> bool {
        self.has_owner() && now < self.ttl_at
    }

    /// Whether, at backend time `now`, the lease still protects the owner (before
    /// `transition_at`).
    pub fn is_in_lease(&self, now: i64) -> bool {
        self.has_owner() && now < self.transition_at
    }

    /// Whether `contender_id` owns the mutex at backend time `now`.
    pub fn is_owned_by_at(&self, contender_id: &str, now: i64) -> bool {
        self.is_owner(contender_id) && self.is_in_lease(now)
    }
}

/// The prefix of the owner id a mutex carries while it is kept held after a release with a
/// hold ([`LeaseStore::release_after`](crate::backend::LeaseStore::release_after)):
/// `held@@<the releaser's id>`.
///
/// Contender ids cannot start with it ([`check_common_contender_id`](crate::check_common_contender_id)),
/// so no contender ever has this id: nobody can renew
/// or release the hold, and everyone (the releaser included) can take the mutex only once
/// the hold's `transition_at` has passed.
pub const HELD_PREFIX: &str = "held@@";

/// The owner id of a mutex that `contender_id` released with a hold: [`HELD_PREFIX`]
/// followed by the id, cut to [`MAX_CONTENDER_ID_LEN`](crate::MAX_CONTENDER_ID_LEN) bytes
/// so that it fits where contender ids fit (a SQL column, a Redis key).
pub fn held_owner_id(contender_id: &str) -> String {
    let mut id = format!("{HELD_PREFIX}{contender_id}");
    let mut end = id.len().min(crate::MAX_CONTENDER_ID_LEN);
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    id.truncate(end);
    id
}

impl MutexOwner {
    /// If this owner is a hold left by a release with a hold ([`HELD_PREFIX`]), the id of
    /// the contender that released it (cut short if it was very long).
    pub fn held_after_release_by(&self) -> Option<&str> {
        self.owner_id.strip_prefix(HELD_PREFIX)
    }
}

impl Default for MutexOwner {
    fn default() -> Self {
        MutexOwner::NONE
    }
}

/// An observed change of owner: what was known before, and what is known now.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MutexState {
    /// The owner before the change.
    pub before: MutexOwner,
    /// The owner after the change.
    pub after: MutexOwner,
}

impl MutexState {
    /// A state that changed from `before` to `after`.
    pub fn new(before: MutexOwner, after: MutexOwner) -> Self {
        MutexState { before, after }
    }

    /// Whether the owner (or the acquisition) changed. Renewals by the same owner are not a
    /// change.
    pub fn is_changed(&self) -> bool {
        self.before.owner_id != self.after.owner_id || self.before.fence != self.after.fence
    }

    /// Whether `contender_id` became the owner in this change.
    pub fn is_acquired(&self, contender_id: &str) -> bool {
        self.is_changed() && self.after.is_owner(contender_id)
    }

    /// Whether `contender_id` stopped being the owner in this change.
    pub fn is_released(&self, contender_id: &str) -> bool {
        self.is_changed() && self.before.is_owner(contender_id)
    }
}

/// The default jitter added to a non-owner's wake-up when there is a transition period.
pub const DEFAULT_JITTER: Range<i64> = -200..1000;
/// The default jitter when there is no transition period.
pub const DEFAULT_JITTER_NO_TRANSITION: Range<i64> = 0..1000;

/// When a contender should next try to acquire or renew (Simba's contend period).
///
/// - the owner wakes at `ttl_at - now`, to renew;
/// - a non-owner wakes at `transition_at - now + jitter`, jitter drawn from
///   `[-200, 1000)` ms, or `[0, 1000)` when the owner has no transition period;
/// - negative delays become zero.
#[derive(Debug, Clone)]
pub struct ContendPeriod {
    contender_id: String,
    jitter: Range<i64>,
    jitter_no_transition: Range<i64>,
}

impl ContendPeriod {
    /// The period of `contender_id` with Simba's default jitter.
    pub fn new(contender_id: impl Into<String>) -> Self {
        ContendPeriod {
            contender_id: contender_id.into(),
            jitter: DEFAULT_JITTER,
            jitter_no_transition: DEFAULT_JITTER_NO_TRANSITION,
        }
    }

    /// Replaces both jitter ranges (milliseconds).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if a range is empty.
    pub fn with_jitter(mut self, jitter: Range<i64>, no_transition: Range<i64>) -> Result<Self> {
        if jitter.is_empty() || no_transition.is_empty() {
            return Err(Error::config(
                "jitter",
                format!("jitter ranges must not be empty, got {jitter:?} and {no_transition:?}"),
            ));
        }
        self.jitter = jitter;
        self.jitter_no_transition = no_transition;
        Ok(self)
    }

    /// The jitter range used when the owner has a transition period.
    pub fn jitter(&self) -> Range<i64> {
        self.jitter.clone()
    }

    /// Milliseconds until the next contention, given the owner and the backend time `now`,
    /// with `roll` choosing a jitter value in the range (see [`ContendPeriod::next_delay`]).
    pub fn next_delay_with(
        &self,
        owner: &MutexOwner,
        now: i64,
        roll: impl FnOnce(Range<i64>) -> i64,
    ) -> i64 {
        // Saturating: the times come from a server (a hostile or broken one may say
        // anything) and the jitter from the config.
        let delay = if owner.is_owner(&self.contender_id) {
            owner.ttl_at.saturating_sub(now)
        } else {
            let range = if owner.transition_at > owner.ttl_at {
                self.jitter.clone()
            } else {
                self.jitter_no_transition.clone()
            };
            owner
                .transition_at
                .saturating_sub(now)
                .saturating_add(roll(range))
        };
        delay.max(0)
    }

    /// The delay until the next contention, given the owner and backend time `now`.
    pub fn next_delay(&self, owner: &MutexOwner, now: i64) -> Duration {
        let ms = self.next_delay_with(owner, now, random_in);
        Duration::from_millis(u64::try_from(ms).unwrap_or(0))
    }
}

/// A pseudo-random value in `range` (not cryptographic; used for jitter).
pub(crate) fn random_in(range: Range<i64>) -> i64 {
    let span = range.end.saturating_sub(range.start).max(1) as u64;
    range.start + (crate::id::random_u64() % span) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(id: &str, ttl_at: i64, transition_at: i64) -> MutexOwner {
        MutexOwner {
            owner_id: id.into(),
            acquired_at: 0,
            ttl_at,
            transition_at,
            fence: 1,
        }
    }

    #[test]
    fn held_ids() {
        let id = held_owner_id("3:41@h:ab");
        assert_eq!(id, "held@@3:41@h:ab");
        let o = MutexOwner {
            owner_id: id,
            ..MutexOwner::NONE
        };
        assert_eq!(o.held_after_release_by(), Some("3:41@h:ab"));
        assert_eq!(owner("x", 0, 0).held_after_release_by(), None);
        let long = "é".repeat(150);
        let cut = held_owner_id(&long);
        assert!(cut.len() <= crate::MAX_CONTENDER_ID_LEN && cut.starts_with(HELD_PREFIX));
        assert!(
            crate::check_common_contender_id(&cut).is_err(),
            "never a contender's id"
        );
    }

    #[test]
    fn owner_wakes_at_ttl() {
        let p = ContendPeriod::new("me");
        assert_eq!(
            p.next_delay_with(&owner("me", 10_000, 16_000), 1_000, |_| 999),
            9_000
        );
    }

    #[test]
    fn non_owner_wakes_at_transition_plus_jitter() {
        let p = ContendPeriod::new("me");
        let o = owner("other", 10_000, 16_000);
        assert_eq!(p.next_delay_with(&o, 1_000, |r| r.start), 15_000 - 200);
        assert_eq!(p.next_delay_with(&o, 1_000, |r| r.end - 1), 15_000 + 999);
        let no_transition = owner("other", 10_000, 10_000);
        assert_eq!(p.next_delay_with(&no_transition, 1_000, |r| r.start), 9_000);
    }

    #[test]
    fn negative_delay_clamps_to_zero() {
        let p = ContendPeriod::new("me");
        assert_eq!(
            p.next_delay_with(&owner("other", 10, 20), 5_000, |r| r.start),
            0
        );
        assert!(p.next_delay(&MutexOwner::NONE, 5_000) < Duration::from_millis(1_000));
    }

    /// Times from a server that make no sense, and the widest jitter, saturate instead of
    /// overflowing (found by the fuzz target `sql_row`: a database clock near `i64::MIN`).
    #[test]
    fn extreme_times_saturate() {
        let p = ContendPeriod::new("me");
        assert_eq!(
            p.next_delay_with(&owner("me", 1_000, 2_000), i64::MIN + 5, |r| r.start),
            i64::MAX
        );
        assert_eq!(
            p.next_delay_with(&owner("me", i64::MIN, 0), i64::MAX, |r| r.start),
            0
        );
        assert_eq!(
            p.next_delay_with(&MutexOwner::NONE, i64::MIN, |r| r.end - 1),
            i64::MAX
        );
        let wide = p
            .with_jitter(i64::MIN..i64::MAX, i64::MIN..i64::MAX)
            .expect("non-empty ranges");
        let o = owner("other", 10_000, 16_000);
        assert_eq!(wide.next_delay_with(&o, 1_000, |r| r.end - 1), i64::MAX);
        assert_eq!(wide.next_delay_with(&o, 1_000, |r| r.start), 0);
        // The random roll, at the extremes: no panic either.
        let _ = wide.next_delay(&o, i64::MIN);
        let _ = wide.next_delay(&o, i64::MAX);
    }

    #[test]
    fn jitter_stays_in_range() {
        for _ in 0..1000 {
            let v = random_in(-200..1000);
            assert!((-200..1000).contains(&v), "{v}");
        }
        assert!(ContendPeriod::new("x").with_jitter(5..5, 0..1).is_err());
    }

    #[test]
    fn state_changes() {
        let a = owner("a", 1, 2);
        let b = owner("b", 1, 2);
        let s = MutexState::new(a.clone(), b.clone());
        assert!(s.is_changed() && s.is_released("a") && s.is_acquired("b") && !s.is_acquired("a"));
        let renewed = MutexState::new(a.clone(), owner("a", 5, 6));
        assert!(!renewed.is_changed());
        let mut reacquired = a.clone();
        reacquired.fence = 2;
        assert!(MutexState::new(a, reacquired).is_acquired("a"));
        assert!(!MutexOwner::NONE.has_owner());
        assert!(b.is_owned_by_at("b", 1) && !b.is_owned_by_at("b", 2));
    }
}
