//! Small helpers that the backends' own tests share with the suite: unique names, the
//! lease config of the tests, waiting for a service's status with a bound, and logging.
//!
//! ```no_run
//! # async fn demo(svc: &dyn simba_core::ContendService) {
//! use std::time::Duration;
//! use simba_test_kit::support::{expect_status, init_tracing, lease, unique_name};
//!
//! init_tracing(); // logs to the test's output when RUST_LOG is set
//! let mutex = unique_name("failover"); // e.g. `failover_9f1c2a7be0d4c311`
//! let config = lease(Duration::from_secs(1), Duration::from_millis(500));
//! // … start `svc` on `mutex` with `config` …
//! let status = expect_status(svc, "the first owner", Duration::from_secs(5), |s| {
//!     s.held.is_some()
//! })
//! .await;
//! # let _ = (mutex, config, status);
//! # }
//! ```

use std::time::Duration;

use simba_core::{ContendService, ContenderStatus, LeaseConfig};

use crate::suite::CaseError;

/// A name no other test uses: `{prefix}_` followed by 16 random lowercase hex digits
/// (64 bits of [`random_u64`](simba_core::backend::random_u64), different in every call
/// and process). Lowercase, so that an unquoted name means the same table on PostgreSQL.
///
/// The result has no characters but the prefix's, `_` and `0-9a-f`: with a prefix of ASCII
/// letters, digits and `_` it is a plain SQL identifier (a table name), a Redis key prefix,
/// a ZooKeeper node name and a mutex name alike. It adds 17 bytes to the prefix.
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}_{:016x}", simba_core::backend::random_u64())
}

/// The lease config of the tests: `ttl` and `transition` as given, a 2 s request timeout
/// and a 100 ms retry interval, so that faults are noticed and retried quickly. Tests that
/// need other values change fields of it.
pub fn lease(ttl: Duration, transition: Duration) -> LeaseConfig {
    LeaseConfig {
        request_timeout: Duration::from_secs(2),
        retry_interval: Duration::from_millis(100),
        ..LeaseConfig::with_lease(ttl, transition)
    }
}

/// Waits until `svc`'s status satisfies `pred`, for at most `bound`, and returns that
/// status.
///
/// # Errors
///
/// A [`CaseError`] naming `what` when the status channel closes, or when `bound` passes
/// first (with the status at that moment).
///
/// # Cancel safety
///
/// Cancel safe: it only watches the status channel.
pub async fn wait_status(
    svc: &dyn ContendService,
    what: &str,
    bound: Duration,
    pred: impl FnMut(&ContenderStatus) -> bool,
) -> Result<ContenderStatus, CaseError> {
    let mut rx = svc.status();
    match tokio::time::timeout(bound, rx.wait_for(pred)).await {
        Ok(Ok(s)) => Ok(s.clone()),
        Ok(Err(_)) => Err(CaseError(format!(
            "{what}: the service's status channel closed"
        ))),
        Err(_) => Err(CaseError(format!(
            "{what}: not within {bound:?}; status is {:?}",
            *svc.status().borrow()
        ))),
    }
}

/// [`wait_status`] for tests that fail by panicking.
///
/// # Panics
///
/// With [`wait_status`]'s message when it fails.
///
/// # Cancel safety
///
/// Cancel safe, as [`wait_status`].
pub async fn expect_status(
    svc: &dyn ContendService,
    what: &str,
    bound: Duration,
    pred: impl FnMut(&ContenderStatus) -> bool,
) -> ContenderStatus {
    wait_status(svc, what, bound, pred)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Sends `tracing` events to the test's captured output, filtered by `RUST_LOG` (nothing
/// without it). Call it at the start of a test; later calls in the process do nothing.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// How many times [`give_ups_leave_nothing`] gives up per wait.
pub const GIVE_UP_TRIES: usize = 25;

/// Checks that a give-up leaves nothing owned: `a` tries `mutex`-like names with
/// `acquire_timeout` of 0, 5 and 50 ms ([`GIVE_UP_TRIES`] times each), and after every
/// `Timeout` `b` (another client of the same backend) must take the name at once with
/// `try_acquire`. The short waits put the deadline while the backend call that would make
/// `a` owner is in flight. One name per wait: what a first use creates (a parent node, a
/// row) exists after the first try, as in a long-running service.
///
/// Returns how many tries gave up (a caller asserts it is not 0: otherwise the check
/// checked nothing).
///
/// # Panics
/// When `b` cannot take the mutex after a give-up of `a`, or on any other error.
pub async fn give_ups_leave_nothing(
    a: &std::sync::Arc<dyn simba_core::ContendServiceFactory>,
    b: &std::sync::Arc<dyn simba_core::ContendServiceFactory>,
) -> usize {
    let mut timeouts = 0;
    for wait in [0, 5, 50].map(Duration::from_millis) {
        let name = unique_name("give-up");
        for i in 0..GIVE_UP_TRIES {
            let locker = simba_core::Locker::new(a.clone(), &name).expect("locker");
            match locker.acquire_timeout(wait).await {
                Ok(guard) => guard.release().await.expect("release"),
                Err(simba_core::Error::Timeout { .. }) => {
                    timeouts += 1;
                    taken_at_once(b, &name, &format!("wait {wait:?}, try {i}")).await;
                }
                Err(e) => panic!("wait {wait:?}, try {i}: {e}"),
            }
        }
    }
    timeouts
}

/// [`give_ups_leave_nothing`] for a multi-lock of two names: `a`'s
/// `MultiLocker::acquire_timeout(0)`, [`GIVE_UP_TRIES`] times; after every `Timeout`, `b`
/// takes each name at once. Returns how many tries gave up.
///
/// # Panics
/// As [`give_ups_leave_nothing`].
pub async fn multi_give_ups_leave_nothing(
    a: &std::sync::Arc<dyn simba_core::ContendServiceFactory>,
    b: &std::sync::Arc<dyn simba_core::ContendServiceFactory>,
) -> usize {
    let mut timeouts = 0;
    let names = [unique_name("multi-a"), unique_name("multi-b")];
    for i in 0..GIVE_UP_TRIES {
        let multi = simba_core::MultiLocker::new(a.clone(), names.iter().map(String::as_str))
            .expect("multi-locker");
        match multi.acquire_timeout(Duration::ZERO).await {
            Ok(guard) => guard.release().await.expect("release"),
            Err(simba_core::Error::Timeout { .. }) => {
                timeouts += 1;
                for name in &names {
                    taken_at_once(b, name, &format!("multi try {i}")).await;
                }
            }
            Err(e) => panic!("multi try {i}: {e}"),
        }
    }
    timeouts
}

/// `other` takes `name` in one attempt, then lets it go.
async fn taken_at_once(
    other: &std::sync::Arc<dyn simba_core::ContendServiceFactory>,
    name: &str,
    what: &str,
) {
    let locker = simba_core::Locker::new(other.clone(), name).expect("locker");
    match locker.try_acquire().await {
        Ok(guard) => guard.release().await.expect("release"),
        Err(e) => panic!("{what}: another client could not take the mutex at once: {e}"),
    }
}

/// `value` with every byte but the unreserved ones (`A-Z a-z 0-9 - . _ ~`) `%`-escaped: a
/// URL given as the value of another URL's query option (e.g. `simba_direct_url=`).
///
/// ```
/// assert_eq!(
///     simba_test_kit::support::percent_encode("postgres://u@h:5432/db"),
///     "postgres%3A%2F%2Fu%40h%3A5432%2Fdb"
/// );
/// ```
pub fn percent_encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_names_differ_and_are_identifiers() {
        let a = unique_name("simba_t");
        let b = unique_name("simba_t");
        assert_ne!(a, b);
        assert_eq!(a.len(), "simba_t".len() + 17, "{a}");
        let rest = a.strip_prefix("simba_t_").expect("prefix and separator");
        assert!(
            rest.chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)),
            "{a}"
        );
    }

    #[test]
    fn lease_keeps_the_durations() {
        let c = lease(Duration::from_millis(700), Duration::from_millis(300));
        assert_eq!(
            (c.ttl, c.transition, c.request_timeout, c.retry_interval),
            (
                Duration::from_millis(700),
                Duration::from_millis(300),
                Duration::from_secs(2),
                Duration::from_millis(100)
            )
        );
    }
}
