//! `simba exec`: run a command while holding a mutex, or several (a multi-lock: every part
//! is guarded as the one mutex is, the earliest deadline of them all is the guardian's).

use std::time::Duration;

use std::ffi::OsString;

use simba_core::{ContenderStatus, LossReason, MAX_MULTI_LOCK_NAMES, MultiGuard, MultiLocker};
use tokio::sync::watch;
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
    /// `mutex "m"`, or `mutexes "a", "b"`.
    what: String,
}

impl Narrator {
    fn say(&self, what: std::fmt::Arguments<'_>) {
        if self.on {
            say!(
                "simba: {} {} {what}",
                crate::show::iso(crate::show::now_ms()),
                self.what
            );
        }
    }
}

/// How messages name what is held: `mutex "m"` and `fence 3` for one mutex, `mutexes
/// "a", "b"` and `fences 3, 9` for several (in acquisition order).
struct Shown {
    what: String,
    fences: String,
}

impl Shown {
    fn of(guard: &MultiGuard) -> Self {
        let fences = guard.fences();
        if let [(mutex, fence)] = fences[..] {
            return Shown {
                what: format!("mutex {mutex:?}"),
                fences: format!("fence {fence}"),
            };
        }
        let list = |f: &dyn Fn(&(&str, u64)) -> String| {
            fences.iter().map(f).collect::<Vec<_>>().join(", ")
        };
        Shown {
            what: format!("mutexes {}", list(&|(m, _)| format!("{m:?}"))),
            fences: format!("fences {}", list(&|(_, f)| f.to_string())),
        }
    }
}

/// `mutex "m" (fence 3)`: one part of what is held, for a loss.
fn part(guard: &MultiGuard, mutex: &str) -> String {
    let fence = guard.fence(mutex).unwrap_or_default();
    format!("mutex {mutex:?} (fence {fence})")
}

/// Checks the mutex names of `simba exec` before anything connects.
pub(crate) fn check_names(args: &ExecArgs) -> Result<(), Failure> {
    let n = args.names().len();
    if n > MAX_MULTI_LOCK_NAMES {
        return Err(Failure::usage(format!(
            "{n} mutexes given; `simba exec` holds at most {MAX_MULTI_LOCK_NAMES} at once"
        )));
    }
    Ok(())
}

/// `, valid for 1.2s more` when the guard has a local deadline.
fn valid_for(guard: &MultiGuard) -> String {
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
    check_names(&args)?;
    let names = args.names();
    let locker = MultiLocker::new(backend.factory(), &names)
        .map_err(|e| Failure::simba(e, "bad mutex name"))?;
    let asked = match &names[..] {
        [one] => format!("mutex {one:?}"),
        _ => format!("mutexes {names:?}"),
    };
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

    backend.announce_quarantine("waiting").await;
    let acquire = acquire(&locker, &args);
    debug!(mutexes = ?names, backend = %backend.shown, "waiting for the mutex");
    let waited = tokio::select! {
        r = acquire => Ok(r),
        sig = signals.recv() => Err(sig),
    };
    let guard = match waited {
        Ok(r) => r.map_err(|e| not_acquired(e, &asked, &backend))?,
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
    for p in guard.parts() {
        info!(
            mutex = p.mutex(),
            fence = p.fence(),
            owner = p.contender_id(),
            "acquired"
        );
    }
    let Shown { what, fences } = Shown::of(&guard);
    let narrator = Narrator {
        on: verbose,
        what: what.clone(),
    };
    narrator.say(format_args!(
        "acquired ({fences}) after waiting {}{}",
        show(guard.acquired_at().saturating_duration_since(started)),
        valid_for(&guard)
    ));
    // --hold-at-most counts from the acquisition, like --hold-at-least.
    let at_most = args.hold_at_most.map(|d| guard.acquired_at() + d);

    if !guard.is_held() {
        return Err(Failure::new(
            Status::Lost,
            format!(
                "ownership of {what} ({fences}) was lost before the command started; it was \
                 not run"
            ),
        ));
    }
    let (env, unset) = command_env(&guard, &names);
    // Watched from before the first deadline is read, so that no later one is missed.
    let mut statuses = Statuses::of(&guard);
    let deadline = statuses.earliest_deadline();
    // On SQLite the guardian holds each mutex's lock file too, so that the kernel frees
    // them only once no process of the command is left.
    let mut anchors = Vec::new();
    for p in guard.parts() {
        match backend.conn.owner_anchor(p.mutex(), p.contender_id()) {
            Ok(a) => anchors.extend(a),
            Err(e) => {
                let mutex = p.mutex().to_owned();
                let _ = release(guard, None, None).await;
                return Err(Failure::with(
                    Status::Internal,
                    e,
                    format!(
                        "cannot hand the lock file of mutex {mutex:?} to the command's \
                         guardian; the command was not run"
                    ),
                ));
            }
        }
    }
    let guarding = child::Guarding {
        grace: args.grace,
        deadline,
        anchors,
    };
    let mut group = match child::spawn(&args.command, &env, &unset, guarding).await {
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
                                "lost ({fences}) after holding it {}: the local lease \
                                 deadline passed",
                                show(guard.acquired_at().elapsed())
                            ));
                        }
                        say!(
                            "simba: the local lease deadline of {what} ({fences}) passed \
                             without a renewal (simba was stopped or paused); the command's \
                             process group was killed (SIGKILL) at the local lease deadline by \
                             its guardian"
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
                    // Still ours as far as simba knew: a loss now is one the release found.
                    let held_until_release = guard.is_held();
                    return match release(guard, None, args.hold_at_least).await {
                        None => {
                            narrator.say(format_args!(
                                "released ({fences}) after holding it {}",
                                show(held)
                            ));
                            Ok(code)
                        }
                        // The release found the mutex no longer this contender's (taken
                        // over, deleted or changed by hand on the backend): the command may
                        // have run unprotected, which the exit status must say.
                        Some(lost) if held_until_release => Err(Failure::new(
                            Status::Lost,
                            format!(
                                "the release found {} no longer this contender's: {}; the \
                                 command exited with status {code} and may have run without \
                                 the mutex",
                                lost.0, lost.1
                            ),
                        )),
                        // The loss was not seen before the command ended (both were ready
                        // together, or simba was paused): the command may have run
                        // unprotected, which the exit status must say.
                        Some(lost) => Err(Failure::new(
                            Status::Lost,
                            format!(
                                "ownership of {} ended before the command did: {}; the \
                                 command exited with status {code} and may have run without \
                                 the mutex",
                                lost.0, lost.1
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
            lost = guard.lost() => break Some(lost),
            _ = sleep_until_opt(at_most) => break None,
            changed = statuses.changed(), if watching => {
                if !changed {
                    watching = false;
                    continue;
                }
                let deadline = statuses.earliest_deadline();
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
                            "suspect ({fences}): the backend does not answer{}",
                            valid_for(&guard)
                        ));
                    } else {
                        narrator.say(format_args!(
                            "no longer suspect ({fences}): a renewal succeeded"
                        ));
                    }
                }
            }
        }
    };
    if let Some(lost) = &lost {
        let which = if guard.parts().len() > 1 {
            format!("{}, ", part(&guard, &lost.mutex))
        } else {
            String::new()
        };
        narrator.say(format_args!(
            "lost ({which}{fences}) after holding it {}: {}",
            show(guard.acquired_at().elapsed()),
            lost.reason
        ));
    }

    // At the local deadline another contender may own the mutex from now on: no grace
    // (the guardian kills the group at that instant by itself, too).
    let grace = match lost.as_ref().map(|l| l.reason) {
        Some(LossReason::LeaseExpired) => Duration::ZERO,
        _ => args.grace,
    };
    match &lost {
        Some(lost) if lost.reason == LossReason::LeaseExpired => say!(
            "simba: ownership of {} lost: {}; the command's process group {} is killed \
             (SIGKILL) at the local lease deadline",
            part(&guard, &lost.mutex),
            lost.reason,
            group.pgid(),
        ),
        Some(lost) => say!(
            "simba: ownership of {} lost: {}; stopping the command (SIGTERM to its process \
             group {}, SIGKILL after {})",
            part(&guard, &lost.mutex),
            lost.reason,
            group.pgid(),
            show(args.grace)
        ),
        None => say!(
            "simba: the command held {what} ({fences}) for --hold-at-most {}; stopping it \
             (SIGTERM to its process group {}, SIGKILL after {})",
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

/// The status of every part of the guard, watched together: the guardian's deadline is
/// the earliest of the parts' local lease deadlines.
struct Statuses(Vec<(watch::Receiver<ContenderStatus>, u64)>);

impl Statuses {
    fn of(guard: &MultiGuard) -> Self {
        Statuses(
            guard
                .parts()
                .iter()
                .map(|p| (p.status(), p.fence()))
                .collect(),
        )
    }

    /// The earliest local lease deadline of the parts, marking every status seen. `None`
    /// (no news for the guardian, which keeps the deadline it has) when any part is not
    /// held or has no deadline: a later deadline of one part never stands in for a part
    /// that has none.
    fn earliest_deadline(&mut self) -> Option<tokio::time::Instant> {
        let mut earliest: Option<tokio::time::Instant> = None;
        let mut complete = true;
        for (status, fence) in &mut self.0 {
            match held_deadline(&status.borrow_and_update(), *fence) {
                Some(d) => earliest = Some(earliest.map_or(d, |e| e.min(d))),
                None => complete = false,
            }
        }
        earliest.filter(|_| complete)
    }

    /// Waits until any part's status changes: `false` once a part's status can change no
    /// more (its service is gone, and so is the ownership: `lost()` says so).
    async fn changed(&mut self) -> bool {
        let mut waits: Vec<_> = self
            .0
            .iter_mut()
            .map(|(status, _)| Box::pin(status.changed()))
            .collect();
        std::future::poll_fn(|cx| {
            for wait in &mut waits {
                if let std::task::Poll::Ready(r) = wait.as_mut().poll(cx) {
                    return std::task::Poll::Ready(r.is_ok());
                }
            }
            std::task::Poll::Pending
        })
        .await
    }
}

/// The command's environment: SIMBA_MUTEX_COUNT, SIMBA_MUTEX_i, SIMBA_FENCE_i,
/// SIMBA_OWNER_ID_i (i from 1, in the order given) and SIMBA_FENCES; SIMBA_MUTEX,
/// SIMBA_FENCE and SIMBA_OWNER_ID for one mutex. Second: the variables of these families
/// inherited from simba's own environment (an outer `simba exec`) that are not set
/// here, to be removed, so that none describes a mutex this command does not hold.
fn command_env(guard: &MultiGuard, names: &[String]) -> (Vec<(String, String)>, Vec<OsString>) {
    let mut env = vec![("SIMBA_MUTEX_COUNT".to_owned(), names.len().to_string())];
    let mut fences = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let Some(p) = guard.part(name) else { continue };
        let i = i + 1;
        env.push((format!("SIMBA_MUTEX_{i}"), name.clone()));
        env.push((format!("SIMBA_FENCE_{i}"), p.fence().to_string()));
        env.push((format!("SIMBA_OWNER_ID_{i}"), p.contender_id().to_owned()));
        fences.push(p.fence().to_string());
    }
    env.push(("SIMBA_FENCES".to_owned(), fences.join(",")));
    if let [p] = guard.parts() {
        env.push(("SIMBA_MUTEX".to_owned(), p.mutex().to_owned()));
        env.push(("SIMBA_FENCE".to_owned(), p.fence().to_string()));
        env.push(("SIMBA_OWNER_ID".to_owned(), p.contender_id().to_owned()));
    }
    let unset = std::env::vars_os()
        .map(|(k, _)| k)
        .filter(|k| {
            let k = k.to_string_lossy();
            ["SIMBA_MUTEX", "SIMBA_FENCE", "SIMBA_OWNER_ID"]
                .iter()
                .any(|family| k.starts_with(family))
                && !env.iter().any(|(set, _)| *set == k)
        })
        .collect();
    (env, unset)
}

/// Acquires as the options say. Every backend wakes a waiting command when the owner is
/// done (SQL: the database's lock queue); on SQLite and MySQL the factory also has a
/// short `LeaseConfig::waiter_poll` (`simba_jdbc::OBSERVER_POLL`), used only while a
/// subscription cannot be made.
async fn acquire(locker: &MultiLocker, args: &ExecArgs) -> simba_core::Result<MultiGuard> {
    if args.no_wait {
        return locker.try_acquire().await;
    }
    match args.timeout {
        None => locker.acquire().await,
        Some(limit) => locker.acquire_timeout(limit).await,
    }
}

/// Why the mutex was not acquired, with the status that says so.
fn not_acquired(e: simba_core::Error, asked: &str, backend: &Backend) -> Failure {
    match Status::of(&e) {
        // The library's message says it all: `mutex "m" is held by another contender`.
        Status::NotAcquired => Failure {
            status: Status::NotAcquired,
            error: anyhow::Error::new(e),
        },
        Status::Unavailable => Failure::simba(
            e,
            format!(
                "{asked} not acquired: backend {} unavailable",
                backend.shown
            ),
        ),
        _ => Failure::simba(e, format!("{asked} not acquired")),
    }
}

/// Sleeps until `at`, or forever when there is none.
async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Releases every mutex, waiting at most `bound` when given (the core bounds it
/// otherwise); with `hold`, keeps them held until `hold` after the acquisition. Returns
/// which ownership had ended (`mutex "m" (fence 3)`) and why, when one had ended before
/// the release.
async fn release(
    guard: MultiGuard,
    bound: Option<Duration>,
    hold: Option<Duration>,
) -> Option<(String, LossReason)> {
    let fences: Vec<(String, u64)> = guard
        .fences()
        .into_iter()
        .map(|(m, f)| (m.to_owned(), f))
        .collect();
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
        Some(Err(simba_core::Error::Lost { mutex, reason })) => {
            let fence = fences
                .iter()
                .find(|(m, _)| *m == mutex)
                .map_or(0, |(_, f)| *f);
            return Some((format!("mutex {mutex:?} (fence {fence})"), reason));
        }
        Some(Err(e)) if hold.is_some() => {
            warn!("keeping the mutex held failed (its lease still ends it): {e}")
        }
        Some(Err(e)) => warn!("release failed (the lease frees the mutex): {e}"),
        None => debug!("release did not finish in time (the lease frees the mutex)"),
    }
    None
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use simba_core::{ContenderStatus, Held};
    use tokio::sync::watch;
    use tokio::time::Instant;

    use super::Statuses;

    fn held(fence: u64, deadline: Option<Instant>) -> ContenderStatus {
        ContenderStatus {
            running: true,
            held: Some(Held {
                fence,
                suspect: false,
            }),
            deadline,
            ..ContenderStatus::default()
        }
    }

    #[tokio::test]
    async fn the_guardian_gets_the_earliest_deadline_of_all_parts_or_none() {
        let now = Instant::now();
        let (early, late) = (now + Duration::from_secs(1), now + Duration::from_secs(5));
        let (tx_a, rx_a) = watch::channel(held(3, Some(late)));
        let (tx_b, rx_b) = watch::channel(held(7, Some(early)));
        let mut statuses = Statuses(vec![(rx_a, 3), (rx_b, 7)]);
        assert_eq!(statuses.earliest_deadline(), Some(early));

        // A renewal of b moves the earliest deadline to a's.
        tx_b.send_replace(held(7, Some(now + Duration::from_secs(9))));
        assert!(statuses.changed().await);
        assert_eq!(statuses.earliest_deadline(), Some(late));

        // A part that is not held (or held under another fence) gives no deadline at all:
        // the other part's must not stand in for it.
        tx_a.send_replace(ContenderStatus::default());
        assert!(statuses.changed().await);
        assert_eq!(statuses.earliest_deadline(), None);
        tx_a.send_replace(held(4, Some(late)));
        assert_eq!(statuses.earliest_deadline(), None);

        // A part whose service is gone ends the watching.
        drop(tx_a);
        assert!(!statuses.changed().await);
        drop(tx_b);
    }
}
