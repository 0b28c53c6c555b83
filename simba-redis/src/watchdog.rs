//! Replaces connections on which calls stall.
//!
//! fred closes a connection as unresponsive only when its *latest* write is older than
//! the unresponsive timeout, so a connection that keeps getting new commands (retries,
//! renewals, heartbeats) is never replaced, however long its answers are overdue. A dead
//! TCP path (a lost NAT entry, a silently dropped host) would then hold every call until
//! the kernel gives up, which takes many minutes.
//!
//! The watchdog forces a reconnection when calls went unanswered for a whole command
//! timeout — measured from the oldest call since the last answer, so that callers that give
//! up early (and drop their calls) are counted too — or when fred reports a command
//! timeout; at most once per cool-down.

use std::sync::{Mutex as StdMutex, MutexGuard, PoisonError};
use std::time::Duration;

use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::ClientLike;
use tokio::time::Instant;
use tracing::debug;

#[derive(Debug, Default)]
struct State {
    /// Start of the oldest call since the last answer.
    unanswered_since: Option<Instant>,
    /// When a reconnection was last forced.
    forced_at: Option<Instant>,
}

#[derive(Debug)]
pub(crate) struct Watchdog {
    /// Calls unanswered this long mean a stalled connection.
    threshold: Duration,
    /// Least time between two forced reconnections.
    cooldown: Duration,
    state: StdMutex<State>,
}

impl Watchdog {
    pub(crate) fn new(threshold: Duration, cooldown: Duration) -> Self {
        Watchdog {
            threshold,
            cooldown,
            state: StdMutex::new(State::default()),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts watching one call on `client`.
    pub(crate) fn watch<'a, C: ClientLike + 'static>(&'a self, client: &'a C) -> Watch<'a, C> {
        self.check(client, false);
        self.state()
            .unanswered_since
            .get_or_insert_with(Instant::now);
        Watch {
            dog: self,
            client,
            done: false,
        }
    }

    /// Forces a reconnection if calls went unanswered for the threshold (or `timed_out`).
    fn check<C: ClientLike + 'static>(&self, client: &C, timed_out: bool) {
        let now = Instant::now();
        let waited = {
            let mut state = self.state();
            let waited = state
                .unanswered_since
                .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
            if !timed_out && waited < self.threshold {
                return;
            }
            state.unanswered_since = None;
            if state
                .forced_at
                .is_some_and(|t| now.saturating_duration_since(t) < self.cooldown)
            {
                return;
            }
            state.forced_at = Some(now);
            waited
        };
        debug!("calls got no answer for {waited:?}: forcing a reconnection");
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let client = client.clone();
            rt.spawn(async move {
                if let Err(e) = client.force_reconnection().await {
                    debug!("forced reconnection failed (reconnects continue): {e}");
                }
            });
        }
    }
}

/// One watched call.
pub(crate) struct Watch<'a, C: ClientLike + 'static> {
    dog: &'a Watchdog,
    client: &'a C,
    done: bool,
}

impl<C: ClientLike + 'static> Watch<'_, C> {
    /// The call ended with `result`.
    pub(crate) fn finish<T>(mut self, result: &Result<T, FredError>) {
        self.done = true;
        match result {
            Err(e) if *e.kind() == ErrorKind::Timeout => self.dog.check(self.client, true),
            // An answer, or an error of a connection fred already knows is broken.
            _ => self.dog.state().unanswered_since = None,
        }
    }
}

impl<C: ClientLike + 'static> Drop for Watch<'_, C> {
    fn drop(&mut self) {
        if !self.done {
            self.dog.check(self.client, false);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ago(secs: u64) -> Instant {
        Instant::now()
            .checked_sub(Duration::from_secs(secs))
            .unwrap()
    }

    #[tokio::test]
    async fn forces_a_reconnection_after_the_threshold_once_per_cooldown() {
        // Never connected: the forced reconnection just fails in the background.
        let client = fred::types::Builder::default_centralized().build().unwrap();
        let dog = Watchdog::new(Duration::from_secs(2), Duration::from_secs(5));

        // A quick answer: nothing happens, and nothing stays unanswered.
        let w = dog.watch(&client);
        w.finish(&Ok::<(), FredError>(()));
        assert!(dog.state().unanswered_since.is_none());
        assert!(dog.state().forced_at.is_none());

        // A call dropped early does not count as a stall by itself.
        drop(dog.watch(&client));
        assert!(dog.state().forced_at.is_none());

        // Calls unanswered for longer than the threshold (callers gave up and dropped
        // them): the next call notices.
        dog.state().unanswered_since = Some(ago(3));
        drop(dog.watch(&client));
        let forced = dog.state().forced_at;
        assert!(forced.is_some());

        // Within the cool-down nothing is forced again, even on a fred timeout.
        dog.state().unanswered_since = Some(ago(3));
        let w = dog.watch(&client);
        w.finish(&Err::<(), _>(FredError::new(ErrorKind::Timeout, "t")));
        assert_eq!(dog.state().forced_at, forced);
        assert!(dog.state().unanswered_since.is_none());

        // After the cool-down a fred timeout forces at once.
        dog.state().forced_at = Some(ago(6));
        let w = dog.watch(&client);
        w.finish(&Err::<(), _>(FredError::new(ErrorKind::Timeout, "t")));
        assert!(dog.state().forced_at.unwrap() > ago(1));
    }
}
