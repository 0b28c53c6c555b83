//! [`LeaseConfig`]: the timing of a lease contender, and duration checks.

use std::ops::Range;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::owner::{DEFAULT_JITTER, DEFAULT_JITTER_NO_TRANSITION};
use crate::store::Lease;

/// The longest duration any setting accepts (one year): longer values are mistakes.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// Checks a duration setting the way every simba config does: at least `min`, at most
/// [`MAX_DURATION`], and a whole number of milliseconds (backends count in ms).
///
/// # Errors
/// [`Error::InvalidConfig`] naming `field` and what is wrong with `d`.
///
/// ```
/// use std::time::Duration;
/// use simba_core::validate_duration;
///
/// let ms = Duration::from_millis(1);
/// assert!(validate_duration("ttl", Duration::from_secs(10), ms).is_ok());
/// assert!(validate_duration("ttl", Duration::ZERO, ms).is_err());
/// assert!(validate_duration("ttl", Duration::from_micros(1500), ms).is_err());
/// ```
pub fn validate_duration(field: &'static str, d: Duration, min: Duration) -> Result<()> {
    if d < min {
        return Err(Error::config(
            field,
            format!("{d:?} is shorter than {min:?}"),
        ));
    }
    if d > MAX_DURATION {
        return Err(Error::config(
            field,
            format!("{d:?} is longer than one year"),
        ));
    }
    if !d.subsec_nanos().is_multiple_of(1_000_000) {
        return Err(Error::config(
            field,
            format!("{d:?} is not a whole number of milliseconds (backends count in ms)"),
        ));
    }
    Ok(())
}

/// Timing of a lease contender. Defaults are Simba's (ttl 10 s, transition 6 s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Time to live of an ownership; the owner renews from here on.
    pub ttl: Duration,
    /// Transition period after the ttl in which only the owner may renew.
    pub transition: Duration,
    /// Safety margin subtracted from the local lease deadline for clock-rate drift between
    /// this process and the backend.
    pub drift_margin: Duration,
    /// Upper bound for one backend call made while not owning (an owner's calls are bounded
    /// by its lease deadline). An owner whose renewal is still unanswered after this long,
    /// or after two thirds of the time left to its deadline if that comes first, is
    /// *suspect* ([`Held::suspect`](crate::Held::suspect)) while it keeps waiting for the
    /// answer, as after a failed renewal.
    pub request_timeout: Duration,
    /// Pause before retrying after a failed call. A contender that does not own doubles
    /// it after each further failure in a row, up to the smaller of 8 × this and the ttl
    /// (never below this), at a random point of the pause's second half, so that the
    /// waiters of a backend that times out under load do not keep it overloaded; an owner
    /// retries at this pace, within its deadline.
    pub retry_interval: Duration,
    /// When the store cannot push releases (SQLite, MySQL, Redis in polling mode): the
    /// longest a non-owner sleeps between two looks (a random time in the second half of
    /// it, so that waiters do not poll in lockstep), so that a released mutex is taken
    /// within this time rather than at the end of the old lease. `None` keeps Simba's
    /// schedule (wake at the end of the owner's transition).
    ///
    /// Retrieval services (observers) on such stores read the owner every `waiter_poll`
    /// too; with `None` they read every `max(ttl / 2, 500 ms)` and at the end of each
    /// lease they saw (see [`LeaseRetrievalService`](crate::LeaseRetrievalService)).
    pub waiter_poll: Option<Duration>,
    /// Jitter (ms) for non-owners when the owner has a transition period.
    pub jitter: Range<i64>,
    /// Jitter (ms) for non-owners when it has none.
    pub jitter_no_transition: Range<i64>,
    /// Label the [metrics](crate::metrics) of this config's services with `mutex` (the
    /// mutex name) besides `backend`. Off by default: every mutex name then makes its own
    /// time series, and names are unbounded — turn it on only for a bounded set of names.
    pub metrics_mutex_label: bool,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            ttl: Duration::from_secs(10),
            transition: Duration::from_secs(6),
            drift_margin: Duration::from_millis(100),
            request_timeout: Duration::from_secs(5),
            retry_interval: Duration::from_secs(1),
            waiter_poll: None,
            jitter: DEFAULT_JITTER,
            jitter_no_transition: DEFAULT_JITTER_NO_TRANSITION,
            metrics_mutex_label: false,
        }
    }
}

impl LeaseConfig {
    /// Default timing with the given ttl and transition.
    pub fn with_lease(ttl: Duration, transition: Duration) -> Self {
        LeaseConfig {
            ttl,
            transition,
            ..LeaseConfig::default()
        }
    }

    /// The lease this config asks for.
    pub fn lease(&self) -> Lease {
        Lease {
            ttl: self.ttl,
            transition: self.transition,
        }
    }

    /// Checks every setting.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first bad setting: zero or sub-millisecond ttl,
    /// durations over a year, ttl + transition over a year, a drift margin that eats the whole lease, empty jitter ranges.
    pub fn validate(&self) -> Result<()> {
        let ms = Duration::from_millis(1);
        let checks: [(&'static str, Duration, Duration); 5] = [
            ("ttl", self.ttl, ms),
            ("transition", self.transition, Duration::ZERO),
            ("drift_margin", self.drift_margin, Duration::ZERO),
            ("request_timeout", self.request_timeout, ms),
            ("retry_interval", self.retry_interval, Duration::ZERO),
        ];
        for (field, d, min) in checks {
            validate_duration(field, d, min)?;
        }
        if let Some(p) = self.waiter_poll {
            validate_duration("waiter_poll", p, ms)?;
        }
        if self.ttl + self.transition > MAX_DURATION {
            return Err(Error::config(
                "transition",
                format!(
                    "ttl + transition = {:?} is longer than one year (a lease that long \
                     outlives any owner it protects)",
                    self.ttl + self.transition
                ),
            ));
        }
        if self.drift_margin * 2 >= self.ttl + self.transition {
            return Err(Error::config(
                "drift_margin",
                format!(
                    "{:?} must be less than half of ttl + transition ({:?})",
                    self.drift_margin,
                    self.ttl + self.transition
                ),
            ));
        }
        if self.jitter.is_empty() || self.jitter_no_transition.is_empty() {
            return Err(Error::config("jitter", "jitter ranges must not be empty"));
        }
        Ok(())
    }
}
