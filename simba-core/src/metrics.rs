//! Metrics of the ownership engine, through the [metrics facade](https://docs.rs/metrics).
//!
//! simba records; it installs no recorder and no exporter. Without a recorder the calls
//! cost next to nothing. Install one (a Prometheus exporter, say) in the application and
//! call [`describe`] once to give the metrics their help texts and units. The names, labels
//! and meanings are listed in one table in the crate's README ("Metrics").
//!
//! Both families of backends report through the same code —
//! [`OwnershipTracker`](crate::backend::OwnershipTracker) and the lease engine — so a
//! metric means the same on Redis, SQL, the in-memory store and ZooKeeper. Every metric
//! carries the label `backend` (`"redis"`, `"sqlite"`, `"zookeeper"`, …); the label
//! `mutex` is added only when the service's config asks for it
//! ([`LeaseConfig::metrics_mutex_label`](crate::LeaseConfig::metrics_mutex_label), or the
//! ZooKeeper config's switch of the same name), because mutex names are unbounded.

use std::sync::Arc;
use std::time::Duration;

use ::metrics::{Label, Unit, counter, describe_counter, describe_gauge, describe_histogram};
use ::metrics::{gauge, histogram};

use crate::error::{Error, LossReason};

/// Counter: ownerships this process acquired.
pub const ACQUISITIONS: &str = "simba_acquisitions_total";
/// Counter: ownerships this process stopped holding, by `reason`. A release that finds the
/// ownership had already ended (taken over, deleted or changed by hand on the backend) is
/// counted once more, under the reason it found, beside its `released`.
pub const LOSSES: &str = "simba_losses_total";
/// Counter: suspect episodes (an owner whose backend stopped answering).
pub const SUSPECT: &str = "simba_suspect_total";
/// Gauge: ownerships this process holds now.
pub const HELD: &str = "simba_held";
/// Histogram (seconds): from the start of contending to the acquisition.
pub const ACQUIRE_WAIT: &str = "simba_acquire_wait_seconds";
/// Histogram (seconds): from the backend's word that the owner let go to the acquisition.
pub const HANDOFF_WAIT: &str = "simba_handoff_wait_seconds";
/// Histogram (seconds): duration of a renewal call that the backend answered (lease
/// backends only).
pub const RENEWAL: &str = "simba_renewal_seconds";
/// Counter: failed backend calls, by `kind` ([`FailureKind`]).
pub const BACKEND_ERRORS: &str = "simba_backend_errors_total";

/// Gives every simba metric its help text and unit in the installed recorder. Call it once
/// after installing the recorder (exporters show the help text); recording works without.
pub fn describe() {
    describe_counter!(ACQUISITIONS, Unit::Count, "ownerships acquired");
    describe_counter!(
        LOSSES,
        Unit::Count,
        "ownerships that ended, by reason (released, lease_expired, taken_over, session_lost)"
    );
    describe_counter!(
        SUSPECT,
        Unit::Count,
        "suspect episodes: the backend stopped answering an owner"
    );
    describe_gauge!(HELD, Unit::Count, "ownerships held now");
    describe_histogram!(
        ACQUIRE_WAIT,
        Unit::Seconds,
        "time from the start of contending to the acquisition"
    );
    describe_histogram!(
        HANDOFF_WAIT,
        Unit::Seconds,
        "time from the backend's word that the owner let go to the acquisition"
    );
    describe_histogram!(RENEWAL, Unit::Seconds, "duration of answered renewal calls");
    describe_counter!(
        BACKEND_ERRORS,
        Unit::Count,
        "failed backend calls, by kind (timeout, disconnected, retryable, fatal)"
    );
}

/// What kind of failure a backend call had: the `kind` label of [`BACKEND_ERRORS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureKind {
    /// The call got no answer within its bound.
    Timeout,
    /// No call could be made: the client is not connected (ZooKeeper between sessions or
    /// while reconnecting).
    Disconnected,
    /// The backend failed in a way that may pass ([`Error::is_retryable`]): connection
    /// trouble, a server that is loading or failing over.
    Retryable,
    /// Anything else: an answer the client cannot use, a refused command, a bad config.
    Fatal,
}

impl FailureKind {
    /// The kind of `error` as far as the error tells ([`Retryable`](Self::Retryable) or
    /// [`Fatal`](Self::Fatal)); a caller that timed the call out or could not send it says
    /// so itself.
    pub fn of(error: &Error) -> Self {
        if error.is_retryable() {
            FailureKind::Retryable
        } else {
            FailureKind::Fatal
        }
    }

    /// The label value: `timeout`, `disconnected`, `retryable` or `fatal`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Timeout => "timeout",
            FailureKind::Disconnected => "disconnected",
            FailureKind::Retryable => "retryable",
            FailureKind::Fatal => "fatal",
        }
    }
}

/// The label value of a loss reason (as [`LossReason`] serializes).
pub(crate) fn reason_label(reason: LossReason) -> &'static str {
    match reason {
        LossReason::Released => "released",
        LossReason::LeaseExpired => "lease_expired",
        LossReason::TakenOver => "taken_over",
        LossReason::SessionLost => "session_lost",
    }
}

/// The labels of one service's metrics, and the calls that record them.
#[derive(Debug, Clone)]
pub(crate) struct Labels {
    backend: &'static str,
    /// `Some` when the service's config asked for the mutex label.
    mutex: Option<Arc<str>>,
}

impl Default for Labels {
    fn default() -> Self {
        Labels {
            backend: "unknown",
            mutex: None,
        }
    }
}

impl Labels {
    pub(crate) fn new(backend: &'static str, mutex: Option<&str>) -> Self {
        Labels {
            backend,
            mutex: mutex.map(Arc::from),
        }
    }

    fn with(&self, extra: Option<(&'static str, &'static str)>) -> Vec<Label> {
        let mut labels = Vec::with_capacity(3);
        labels.push(Label::from_static_parts("backend", self.backend));
        if let Some(m) = &self.mutex {
            labels.push(Label::new("mutex", m.to_string()));
        }
        if let Some((k, v)) = extra {
            labels.push(Label::from_static_parts(k, v));
        }
        labels
    }

    pub(crate) fn acquired(&self, wait: Duration, handoff: Option<Duration>) {
        counter!(ACQUISITIONS, self.with(None)).increment(1);
        gauge!(HELD, self.with(None)).increment(1.0);
        histogram!(ACQUIRE_WAIT, self.with(None)).record(wait.as_secs_f64());
        if let Some(h) = handoff {
            histogram!(HANDOFF_WAIT, self.with(None)).record(h.as_secs_f64());
        }
    }

    pub(crate) fn lost(&self, reason: LossReason) {
        counter!(LOSSES, self.with(Some(("reason", reason_label(reason))))).increment(1);
        gauge!(HELD, self.with(None)).decrement(1.0);
    }

    /// A release found its ownership already ended (the ownership's end was counted as
    /// `released` when the release began; the held gauge was decremented then).
    pub(crate) fn lost_at_release(&self, reason: LossReason) {
        counter!(LOSSES, self.with(Some(("reason", reason_label(reason))))).increment(1);
    }

    /// An ownership ended without a report (a driver that panicked).
    pub(crate) fn dropped(&self) {
        gauge!(HELD, self.with(None)).decrement(1.0);
    }

    pub(crate) fn suspect(&self) {
        counter!(SUSPECT, self.with(None)).increment(1);
    }

    pub(crate) fn renewal(&self, took: Duration) {
        histogram!(RENEWAL, self.with(None)).record(took.as_secs_f64());
    }

    pub(crate) fn failure(&self, kind: FailureKind) {
        counter!(BACKEND_ERRORS, self.with(Some(("kind", kind.as_str())))).increment(1);
    }
}
