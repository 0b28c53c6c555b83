//! `simba exec`: run a command while holding a mutex.

use std::time::Duration;

use simba_core::{ContenderStatus, LockGuard, Locker, LossReason};
use tracing::{debug, info, warn};

use crate::backend::Backend;
use crate::child;
use crate::cli::ExecArgs;
use crate::duration::show;
use crate::guardian::Gone;
use crate::signals::{self, Signals};
use crate::status::{Failure, Outcome, Status};

/// Upper bound for the release after ownership was lost (there is nothing left to free;
/// it only tidies up, and the backend may be the thing that is down).
const RELEASE_AFTER_LOSS: Duration = Duration::from_millis(500);

/// Upper bound for stopping an acquisition given up on a signal (the engine bounds it by
/// the backend's request timeout, twice at most: the call in flight, then the release).
const SETTLE_LIMIT: Duration = Duration::from_secs(15);

/// With `-v`: one line on stderr per step of the ownership (acquired, suspect, no longer
/// suspect, lost, released), each with the fence and the local wall-clock time.
struct Narrator {
    on: bool,
    mutex: String,
}

impl Narrator {
    fn say(&self, what: std::fmt::Arguments<'_>) {
        if self.on {
            say!(
                "simba: {} mutex {:?} {what}",
                crate::show::iso(crate::show::now_ms()),
                self.mutex
            );
        }
    }
}

/// `, valid for 1.2s more` when the guard has a local deadline.
fn valid_for(guard: &LockGuard) -> String {
    guard
        .valid_for()
        .map(|d| format!(", valid for {} more without a renewal", show(d)))
        .unwrap_or_default()
}

/// Runs `simba exec`; `verbose` narrates the ownership on stderr.
pub(crate) async fn run(backend: Backend, args: ExecArgs, verbose: bool) -> Outcome {
    let started = tokio::time::Instant::now();
    // Installed first: a signal while waiting for the mutex must not kill simba before it
    // has stopped contending.
    let mut signals = Signals::new()?;
    let mutex = args.mutex.as_str();
    let locker =
        Locker::new(backend.factory(), mutex).map_err(|e| Failure::simba(e, "bad mutex name"))?;
    if let Some(hold) = args.hold_at_least {
        // Refused before waiting: a hold the backend cannot keep would be silently lost.
        backend
            .factory()
            .check_hold()
            .and_then(|()| simba_core::validate_duration("hold-at-least", hold, Duration::ZERO))
            .map_err(|e| Failure::simba(e, "--hold-at-least"))?;
    }
    if let Some(most) = args.hold_at_most {
        simba_core::validate_duration("hold-at-most", most, Duration::from_millis(1))
            .map_err(|e| Failure::simba(e, "--hold-at-most"))?;
    }

    let acquire = acquire(&locker, &args);
    debug!(mutex, backend = %backend.shown, "waiting for the mutex");
    let waited = tokio::select! {
        r = acquire => Ok(r),
        sig = signals.recv() => Err(sig),
    };
    let guard = match waited {
        Ok(r) => r.map_err(|e| not_acquired(e, mutex, &backend))?,
        Err(sig) => {
            info!(%sig, "signal while waiting for the mutex: giving up");
            // The dropped acquisition stops in the background, releasing whatever it was
            // winning: wait for that before exiting, or the exit cuts it short and leaves
            // a dead owner for a whole lease.
            if tokio::time::timeout(SETTLE_LIMIT, locker.settled())
                .await
                .is_err()
            {
                warn!(
                    "the acquisition did not stop within {SETTLE_LIMIT:?}; the lease frees the mutex"
                );
            }
            return Ok(signals::status_for(sig));
        }
    };
    let fence = guard.fence();
    info!(mutex, fence, owner = guard.contender_id(), "acquired");
    let narrator = Narrator {
        on: verbose,
        mutex: mutex.to_owned(),
    };
    narrator.say(format_args!(
        "acquired (fence {fence}) after waiting {}{}",
        show(guard.acquired_at().saturating_duration_since(started)),
        valid_for(&guard)
    ));
    // --hold-at-most counts from the acquisition, like --hold-at-least.
    let at_most = args.hold_at_most.map(|d| guard.acquired_at() + d);

    if !guard.is_held() {
        return Err(Failure::new(
            Status::Lost,
            format!(
                "ownership of mutex {mutex:?} (fence {fence}) was lost before the command \
                 started; it was not run"
            ),
        ));
    }
    let env = [
        ("SIMBA_MUTEX", mutex.to_owned()),
        ("SIMBA_FENCE", fence.to_string()),
        ("SIMBA_OWNER_ID", guard.contender_id().to_owned()),
    ];
    // Watched from before the first deadline is read, so that no later one is missed.
    let mut status = guard.status();
    let deadline = held_deadline(&status.borrow_and_update(), fence);
    // On SQLite the guardian holds the mutex's lock file too, so that the kernel frees it
    // only once no process of the command is left.
    let anchor = match backend.conn.owner_anchor(mutex, guard.contender_id()) {
        Ok(a) => a,
        Err(e) => {
            let _ = release(guard, None, None).await;
            return Err(Failure::with(
                Status::Internal,
                e,
                format!(
                    "cannot hand the lock file of mutex {mutex:?} to the command's guardian; \
                     the command was not run"
                ),
            ));
        }
    };
    let guarding = child::Guarding {
        grace: args.grace,
        deadline,
        anchor,
    };
    let mut group = match child::spawn(&args.command, &env, guarding).await {
        Ok(g) => g,
        Err(f) => {
            // The command never ran: nothing to keep held.
            let _ = release(guard, None, None).await;
            return Err(f);
        }
    };

    // Always watched: each renewal's deadline goes to the guardian.
    let mut watching = true;
    let mut suspect = false;
    let lost = loop {
        tokio::select! {
            biased;
            r = group.wait() => match r {
                Ok(ended) => {
                    group.restore_terminal();
                    debug!(?ended, "command ended");
                    if ended.gone == Gone::Deadline {
                        // simba did not run (stopped, paused) until after its local deadline:
                        // the guardian killed the group at it. (`is_held` checks the
                        // deadline itself, before the engine's task has said so.)
                        if !guard.is_held() {
                            narrator.say(format_args!(
                                "lost (fence {fence}) after holding it {}: the local lease \
                                 deadline passed",
                                show(guard.acquired_at().elapsed())
                            ));
                        }
                        say!(
                            "simba: the local lease deadline of mutex {mutex:?} (fence {fence}) \
                             passed without a renewal (simba was stopped or paused); the \
                             command's process group was killed (SIGKILL) at the local lease \
                             deadline by its guardian"
                        );
                        let _ = release(guard, Some(RELEASE_AFTER_LOSS), None).await;
                        return Ok(Status::Lost.code());
                    }
                    if ended.gone == Gone::Leftovers {
                        warn!(
                            "the command ended and left processes in its process group; they \
                             were stopped (SIGTERM, SIGKILL after {}) before the release",
                            show(args.grace)
                        );
                    }
                    let code = child::exit_code(ended.status);
                    let held = guard.acquired_at().elapsed();
                    return match release(guard, None, args.hold_at_least).await {
                        None => {
                            narrator.say(format_args!(
                                "released (fence {fence}) after holding it {}",
                                show(held)
                            ));
                            Ok(code)
                        }
                        // The loss was not seen before the command ended (both were ready
                        // together, or simba was paused): the command may have run
                        // unprotected, which the exit status must say.
                        Some(lost) => Err(Failure::new(
                            Status::Lost,
                            format!(
                                "ownership of mutex {mutex:?} (fence {fence}) ended before the \
                                 command did: {lost}; the command exited with status {code} \
                                 and may have run without the mutex"
                            ),
                        )),
                    };
                }
                Err(e) => {
                    group.stop(args.grace).await;
                    group.restore_terminal();
                    let _ = release(guard, None, args.hold_at_least).await;
                    return Err(Failure::with(Status::Internal, e, "waiting for the command failed"));
                }
            },
            sig = signals.recv() => {
                debug!(%sig, "passing the signal on to the command");
                group.signal(sig).await;
            }
            reason = guard.lost() => break Some(reason),
            _ = sleep_until_opt(at_most) => break None,
            changed = status.changed(), if watching => {
                if changed.is_err() {
                    watching = false;
                    continue;
                }
                let deadline = held_deadline(&status.borrow_and_update(), fence);
                if let Some(d) = deadline {
                    group.set_deadline(d).await;
                }
                if !verbose {
                    continue;
                }
                let now = guard.is_suspect();
                // Not suspect any more because the ownership ended (published between the
                // polls of `lost()` and of this branch): the next turn reports the loss,
                // not a recovery.
                if !now && !guard.is_held() {
                    continue;
                }
                if now != suspect {
                    suspect = now;
                    if now {
                        narrator.say(format_args!(
                            "suspect (fence {fence}): the backend does not answer{}",
                            valid_for(&guard)
                        ));
                    } else {
                        narrator.say(format_args!(
                            "no longer suspect (fence {fence}): a renewal succeeded"
                        ));
                    }
                }
            }
        }
    };
    if let Some(reason) = lost {
        narrator.say(format_args!(
            "lost (fence {fence}) after holding it {}: {reason}",
            show(guard.acquired_at().elapsed())
        ));
    }

    // At the local deadline another contender may own the mutex from now on: no grace
    // (the guardian kills the group at that instant by itself, too).
    let grace = match lost {
        Some(LossReason::LeaseExpired) => Duration::ZERO,
        _ => args.grace,
    };
    match lost {
        Some(lost @ LossReason::LeaseExpired) => say!(
            "simba: ownership of mutex {mutex:?} (fence {fence}) lost: {lost}; the command's \
             process group {} is killed (SIGKILL) at the local lease deadline",
            group.pgid(),
        ),
        Some(lost) => say!(
            "simba: ownership of mutex {mutex:?} (fence {fence}) lost: {lost}; stopping the \
             command (SIGTERM to its process group {}, SIGKILL after {})",
            group.pgid(),
            show(args.grace)
        ),
        None => say!(
            "simba: the command held mutex {mutex:?} (fence {fence}) for --hold-at-most {}; \
             stopping it (SIGTERM to its process group {}, SIGKILL after {})",
            show(args.hold_at_most.unwrap_or_default()),
            group.pgid(),
            show(args.grace)
        ),
    }
    let ended = group.stop(grace).await;
    group.restore_terminal();
    if let Some(ended) = ended {
        info!(?ended, "command stopped");
    }
    // A release after a loss says so: that was reported above.
    let _ = match lost {
        Some(_) => release(guard, Some(RELEASE_AFTER_LOSS), None).await,
        None => release(guard, None, args.hold_at_least).await,
    };
    Ok(Status::Lost.code())
}

/// The local lease deadline of the ownership with `fence`, while it is held.
fn held_deadline(status: &ContenderStatus, fence: u64) -> Option<tokio::time::Instant> {
    status
        .held
        .filter(|h| h.fence == fence)
        .and(status.deadline)
}

/// Acquires as the options say. Every backend wakes a waiting command when the owner is
/// done (SQL: the database's lock queue); on SQLite and MySQL the factory also has a
/// short `LeaseConfig::waiter_poll` (`simba_jdbc::OBSERVER_POLL`), used only while a
/// subscription cannot be made.
async fn acquire(locker: &Locker, args: &ExecArgs) -> simba_core::Result<LockGuard> {
    if args.no_wait {
        return locker.try_acquire().await;
    }
    match args.timeout {
        None => locker.acquire().await,
        Some(limit) => locker.acquire_timeout(limit).await,
    }
}

/// Why the mutex was not acquired, with the status that says so.
fn not_acquired(e: simba_core::Error, mutex: &str, backend: &Backend) -> Failure {
    match Status::of(&e) {
        // The library's message says it all: `mutex "m" is held by another contender`.
        Status::NotAcquired => Failure {
            status: Status::NotAcquired,
            error: anyhow::Error::new(e),
        },
        Status::Unavailable => Failure::simba(
            e,
            format!(
                "mutex {mutex:?} not acquired: backend {} unavailable",
                backend.shown
            ),
        ),
        _ => Failure::simba(e, format!("mutex {mutex:?} not acquired")),
    }
}

/// Sleeps until `at`, or forever when there is none.
async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Releases the mutex, waiting at most `bound` when given (the core bounds it otherwise);
/// with `hold`, keeps it held until `hold` after its acquisition. Returns why the
/// ownership had ended, when it had ended before the release.
async fn release(
    guard: LockGuard,
    bound: Option<Duration>,
    hold: Option<Duration>,
) -> Option<LossReason> {
    let call = async {
        match hold {
            Some(d) => {
                let r = guard.release_at_least(d).await;
                if r.is_ok() {
                    debug!(hold = %show(d), "released; held until the hold ends");
                }
                r
            }
            None => guard.release().await,
        }
    };
    let done = match bound {
        Some(b) => tokio::time::timeout(b, call).await.ok(),
        None => Some(call.await),
    };
    match done {
        Some(Ok(())) => debug!("released"),
        Some(Err(simba_core::Error::Lost { reason, .. })) => return Some(reason),
        Some(Err(e)) if hold.is_some() => {
            warn!("keeping the mutex held failed (its lease still ends it): {e}")
        }
        Some(Err(e)) => warn!("release failed (the lease frees the mutex): {e}"),
        None => debug!("release did not finish in time (the lease frees the mutex)"),
    }
    None
}
