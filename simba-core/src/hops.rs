//! Hop timestamps of a handoff, for `simba bench --explain`.
//!
//! A handoff goes through the [`Hop`]s in their order: the owner's release is sent and
//! answered, the backend's push reaches the waiter's process, the waiter's engine wakes,
//! sends its acquisition and gets the answer, and the waiting `acquire()` returns its
//! guard. The engine and the backends call [`record`] at each of these points; it costs
//! one relaxed atomic load unless a bench has called [`watch`] for a mutex, and it records
//! only for that mutex.
//!
//! Only with the `bench` feature (the engine's calls), and a backend crate's own `bench`
//! feature (that backend's calls): without it, neither this module nor any call to it is
//! compiled. Not for production use: one process-wide recorder, meant for a bench that
//! hands one mutex over between its own contenders.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// A point on the path of a handoff, in path order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Hop {
    /// The owner's release call is sent to the backend.
    ReleaseSent,
    /// The backend answered the owner's release.
    ReleaseAnswered,
    /// The waiter's process received the backend's push (pub/sub message, watch event,
    /// in-memory notification).
    PushReceived,
    /// The task that contends for the waiter handled the push.
    WaiterWoken,
    /// The waiter's acquisition is sent to the backend.
    AcquireSent,
    /// The backend store sends the acquisition's statement (recorded by stores whose
    /// acquisition does work of its own around it: the SQL stores).
    StatementSent,
    /// The acquisition's statement is answered, before the store makes its reply.
    StatementAnswered,
    /// The backend answered the waiter's acquisition (whatever it said).
    AcquireAnswered,
    /// The waiter's `acquire()` returned its guard.
    GuardReturned,
}

impl Hop {
    /// Every hop, in path order.
    pub const ALL: [Hop; 9] = [
        Hop::ReleaseSent,
        Hop::ReleaseAnswered,
        Hop::PushReceived,
        Hop::WaiterWoken,
        Hop::AcquireSent,
        Hop::StatementSent,
        Hop::StatementAnswered,
        Hop::AcquireAnswered,
        Hop::GuardReturned,
    ];

    /// A short name (`release sent`, …).
    pub fn name(self) -> &'static str {
        match self {
            Hop::ReleaseSent => "release sent",
            Hop::ReleaseAnswered => "release answered",
            Hop::PushReceived => "push received",
            Hop::WaiterWoken => "waiter woken",
            Hop::AcquireSent => "acquire sent",
            Hop::StatementSent => "statement sent",
            Hop::StatementAnswered => "statement answered",
            Hop::AcquireAnswered => "acquire answered",
            Hop::GuardReturned => "guard returned",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);

#[derive(Default)]
struct Recorder {
    mutex: String,
    marks: Vec<(Hop, Instant)>,
}

fn recorder() -> &'static Mutex<Recorder> {
    static RECORDER: OnceLock<Mutex<Recorder>> = OnceLock::new();
    RECORDER.get_or_init(Mutex::default)
}

fn lock() -> std::sync::MutexGuard<'static, Recorder> {
    recorder().lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether a bench records hops now: the cheap check before anything is formatted.
#[inline]
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Records `hop` for `mutex` now, if a bench watches that mutex. `mutex` may also be a
/// key or channel name that contains the mutex name (a backend's push arrives on one).
#[inline]
pub fn record(hop: Hop, mutex: &str) {
    if enabled() {
        record_slow(hop, mutex, Instant::now());
    }
}

#[cold]
fn record_slow(hop: Hop, mutex: &str, at: Instant) {
    let mut r = lock();
    if !r.mutex.is_empty() && mutex.contains(r.mutex.as_str()) {
        r.marks.push((hop, at));
    }
}

/// Starts recording the hops of `mutex` (and of every name containing it: choose a name
/// no other mutex contains), dropping any recorded before.
pub fn watch(mutex: &str) {
    let mut r = lock();
    r.mutex = mutex.to_owned();
    r.marks.clear();
    ON.store(true, Ordering::Relaxed);
}

/// The hops recorded since [`watch`] or the last `take`, in the order recorded.
pub fn take() -> Vec<(Hop, Instant)> {
    std::mem::take(&mut lock().marks)
}

/// Stops recording.
pub fn stop() {
    ON.store(false, Ordering::Relaxed);
    let mut r = lock();
    r.mutex.clear();
    r.marks.clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_the_watched_mutex_and_only_while_on() {
        record(Hop::ReleaseSent, "a");
        watch("a");
        record(Hop::ReleaseSent, "a");
        record(Hop::ReleaseSent, "b");
        record(Hop::PushReceived, "prefix:a:channel");
        let marks = take();
        stop();
        record(Hop::AcquireSent, "a");
        assert_eq!(
            marks.iter().map(|m| m.0).collect::<Vec<_>>(),
            [Hop::ReleaseSent, Hop::PushReceived]
        );
        assert!(take().is_empty());
    }
}
