//! `simba exec`: run a command while holding a mutex, or several (a multi-lock: every part
//! is guarded as the one mutex is, the earliest deadline of them all is the guardian's), or
//! one permit of a semaphore (`--permits N`), or a read or the write of a read-write lock
//! (`--read`, `--write`): each guarded as a mutex is.

use std::time::Duration;

use std::ffi::OsString;

use simba_core::{
    ContenderStatus, LossReason, MAX_MULTI_LOCK_NAMES, MultiGuard, MultiLocker, PermitGuard,
    ReadGuard, RwLock, Semaphore, WriteGuard,
};
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
/// "a", "b"` and `fences 3, 9` for several (in acquisition order), `a permit of semaphore
/// "s"` and `fence 3` for a permit; `noun` is what the command may have run without.
struct Shown {
    what: String,
    fences: String,
    noun: &'static str,
}

impl Shown {
    fn of(held: &Held) -> Self {
        let guard = match held {
            Held::Mutexes(guard) => guard,
            Held::Permit { guard, .. } => {
                return Shown {
                    what: permit_of(guard.semaphore()),
                    fences: format!("fence {}", guard.fence()),
                    noun: "the permit",
                };
            }
            Held::Rw { guard, .. } => {
                return Shown {
                    what: guard.what(),
                    fences: format!("fence {}", guard.fence()),
                    noun: guard.noun(),
                };
            }
        };
        let fences = guard.fences();
        if let [(mutex, fence)] = fences[..] {
            return Shown {
                what: format!("mutex {mutex:?}"),
                fences: format!("fence {fence}"),
                noun: "the mutex",
            };
        }
        let list = |f: &dyn Fn(&(&str, u64)) -> String| {
            fences.iter().map(f).collect::<Vec<_>>().join(", ")
        };
        Shown {
            what: format!("mutexes {}", list(&|(m, _)| format!("{m:?}"))),
            fences: format!("fences {}", list(&|(_, f)| f.to_string())),
            noun: "the mutexes",
        }
    }
}

/// `a permit of semaphore "s"`.
fn permit_of(semaphore: &str) -> String {
    format!("a permit of semaphore {semaphore:?}")
}

/// A read or the write of a read-write lock.
enum RwHeld {
    Read(ReadGuard, String),
    Write(WriteGuard, String),
}

impl RwHeld {
    /// `a read of lock "l"` / `the write of lock "l"`.
    fn what(&self) -> String {
        match self {
            RwHeld::Read(_, name) => format!("a read of lock {name:?}"),
            RwHeld::Write(_, name) => format!("the write of lock {name:?}"),
        }
    }

    fn noun(&self) -> &'static str {
        match self {
            RwHeld::Read(..) => "the read",
            RwHeld::Write(..) => "the write",
        }
    }

    fn name(&self) -> &str {
        match self {
            RwHeld::Read(_, n) | RwHeld::Write(_, n) => n,
        }
    }

    fn mode(&self) -> &'static str {
        match self {
            RwHeld::Read(..) => "read",
            RwHeld::Write(..) => "write",
        }
    }

    fn fence(&self) -> u64 {
        match self {
            RwHeld::Read(g, _) => g.fence(),
            RwHeld::Write(g, _) => g.fence(),
        }
    }

    fn contender_id(&self) -> &str {
        match self {
            RwHeld::Read(g, _) => g.contender_id(),
            RwHeld::Write(g, _) => g.contender_id(),
        }
    }

    fn is_held(&self) -> bool {
        match self {
            RwHeld::Read(g, _) => g.is_held(),
            RwHeld::Write(g, _) => g.is_held(),
        }
    }

    fn is_suspect(&self) -> bool {
        match self {
            RwHeld::Read(g, _) => g.is_suspect(),
            RwHeld::Write(g, _) => g.is_suspect(),
        }
    }

    fn valid_for(&self) -> Option<Duration> {
        match self {
            RwHeld::Read(g, _) => g.valid_for(),
            RwHeld::Write(g, _) => g.valid_for(),
        }
    }

    fn status(&self) -> watch::Receiver<ContenderStatus> {
        match self {
            RwHeld::Read(g, _) => g.status(),
            RwHeld::Write(g, _) => g.status(),
        }
    }

    async fn lost(&self) -> LossReason {
        match self {
            RwHeld::Read(g, _) => g.lost().await,
            RwHeld::Write(g, _) => g.lost().await,
        }
    }

    async fn release(self) -> simba_core::Result<()> {
        match self {
            RwHeld::Read(g, _) => g.release().await,
            RwHeld::Write(g, _) => g.release().await,
        }
    }
}

/// What `simba exec` holds while the command runs: one mutex or several, one permit of a
/// semaphore, or a read or the write of a read-write lock. Each part is an ownership with
/// its own lease, fence and local deadline.
enum Held {
    Mutexes(MultiGuard),
    Permit {
        guard: PermitGuard,
        /// The semaphore's permit count, for the command's environment.
        permits: u32,
        /// When the acquisition returned: a permit guard does not say when its winning
        /// request was sent (a mutex's `acquired_at`), so this is later by that request's
        /// round trip, and `--hold-at-most` may run longer by as much.
        acquired_at: tokio::time::Instant,
    },
    /// A read or the write of a read-write lock; `acquired_at` as for a permit.
    Rw {
        guard: RwHeld,
        acquired_at: tokio::time::Instant,
    },
}

/// An ownership that ended while the command ran.
struct Loss {
    /// Which part (`mutex "m" (fence 3)`, `a permit of semaphore "s" (fence 3)`).
    part: String,
    reason: LossReason,
}

impl Held {
    fn is_held(&self) -> bool {
        match self {
            Held::Mutexes(g) => g.is_held(),
            Held::Permit { guard, .. } => guard.is_held(),
            Held::Rw { guard, .. } => guard.is_held(),
        }
    }

    fn is_suspect(&self) -> bool {
        match self {
            Held::Mutexes(g) => g.is_suspect(),
            Held::Permit { guard, .. } => guard.is_suspect(),
            Held::Rw { guard, .. } => guard.is_suspect(),
        }
    }

    fn acquired_at(&self) -> tokio::time::Instant {
        match self {
            Held::Mutexes(g) => g.acquired_at(),
            Held::Permit { acquired_at, .. } | Held::Rw { acquired_at, .. } => *acquired_at,
        }
    }

    /// `, valid for 1.2s more` when the guard has a local deadline.
    fn valid_for(&self) -> String {
        let left = match self {
            Held::Mutexes(g) => g.valid_for(),
            Held::Permit { guard, .. } => guard.valid_for(),
            Held::Rw { guard, .. } => guard.valid_for(),
        };
        left.map(|d| format!(", valid for {} more without a renewal", show(d)))
            .unwrap_or_default()
    }

    /// Whether there is more than one part (the loss then names its part).
    fn several(&self) -> bool {
        matches!(self, Held::Mutexes(g) if g.parts().len() > 1)
    }

    /// Resolves when a part is no longer held.
    async fn lost(&self) -> Loss {
        match self {
            Held::Mutexes(g) => {
                let lost = g.lost().await;
                let fence = g.fence(&lost.mutex).unwrap_or_default();
                Loss {
                    part: format!("mutex {:?} (fence {fence})", lost.mutex),
                    reason: lost.reason,
                }
            }
            Held::Permit { guard, .. } => {
                let reason = guard.lost().await;
                Loss {
                    part: format!("{} (fence {})", permit_of(guard.semaphore()), guard.fence()),
                    reason,
                }
            }
            Held::Rw { guard, .. } => {
                let reason = guard.lost().await;
                Loss {
                    part: format!("{} (fence {})", guard.what(), guard.fence()),
                    reason,
                }
            }
        }
    }

    fn statuses(&self) -> Statuses {
        match self {
            Held::Mutexes(g) => Statuses::of(g),
            Held::Permit { guard, .. } => Statuses(vec![(guard.status(), guard.fence())]),
            Held::Rw { guard, .. } => Statuses(vec![(guard.status(), guard.fence())]),
        }
    }

    fn log_acquired(&self) {
        match self {
            Held::Mutexes(g) => {
                for p in g.parts() {
                    info!(
                        mutex = p.mutex(),
                        fence = p.fence(),
                        owner = p.contender_id(),
                        "acquired"
                    );
                }
            }
            Held::Permit { guard, .. } => info!(
                semaphore = guard.semaphore(),
                fence = guard.fence(),
                holder = guard.contender_id(),
                "permit acquired"
            ),
            Held::Rw { guard, .. } => info!(
                lock = guard.name(),
                mode = guard.mode(),
                fence = guard.fence(),
                holder = guard.contender_id(),
                "acquired"
            ),
        }
    }

    /// On SQLite, each mutex's lock file for the guardian (see `Connection::owner_anchor`).
    /// A permit, a read or a write has none: its lease deadline guards it. The error names
    /// the mutex.
    fn anchors(
        &self,
        backend: &Backend,
    ) -> Result<Vec<simba_core::connect::Anchor>, (String, std::io::Error)> {
        let mut anchors = Vec::new();
        if let Held::Mutexes(g) = self {
            for p in g.parts() {
                match backend.conn.owner_anchor(p.mutex(), p.contender_id()) {
                    Ok(a) => anchors.extend(a),
                    Err(e) => return Err((p.mutex().to_owned(), e)),
                }
            }
        }
        Ok(anchors)
    }
}

/// Checks the mutex names of `simba exec` before anything connects.
pub(crate) fn check_names(args: &ExecArgs) -> Result<(), Failure> {
    let n = args.names().len();
    if n > MAX_MULTI_LOCK_NAMES {
        return Err(Failure::usage(format!(
            "{n} mutexes given; `simba exec` holds at most {MAX_MULTI_LOCK_NAMES} at once"
        )));
    }
    if args.permits.is_some() && n != 1 {
        return Err(Failure::usage(format!(
            "--permits holds a permit of one semaphore; {n} names given"
        )));
    }
    if (args.read || args.write) && n != 1 {
        return Err(Failure::usage(format!(
            "--read and --write hold one read-write lock; {n} names given"
        )));
    }
    Ok(())
}

/// What `simba exec` waits for: mutexes, a permit of a semaphore, or a read or the write
/// of a read-write lock.
enum Asking {
    Mutexes(MultiLocker),
    Permit(Semaphore),
    Read(RwLock),
    Write(RwLock),
}

impl Asking {
    /// Waits until the acquisition given up on (its future dropped) has stopped, at most
    /// [`SETTLE_LIMIT`]. A semaphore's acquisition releases what it may have won in the
    /// background, with nothing to wait on: the runtime's shutdown gives it a moment.
    async fn settle(&self) {
        let Asking::Mutexes(locker) = self else {
            return;
        };
        if tokio::time::timeout(SETTLE_LIMIT, locker.settled())
            .await
            .is_err()
        {
            warn!(
                "the acquisition did not stop within {SETTLE_LIMIT:?}; the lease frees the mutex"
            );
        }
    }
}

/// Runs `simba exec`; `verbose` narrates the ownership on stderr.
pub(crate) async fn run(backend: Backend, args: ExecArgs, verbose: bool) -> Outcome {
    let started = tokio::time::Instant::now();
    // Installed first: a signal while waiting for the mutex must not kill simba before it
    // has stopped contending.
    let mut signals = Signals::new()?;
    check_names(&args)?;
    let names = args.names();
    let (asking, asked) = match (args.permits, &names[..]) {
        (Some(permits), [name]) => (
            Asking::Permit(open_semaphore(&backend, name, permits).await?),
            format!("{} ({permits} permits)", permit_of(name)),
        ),
        (Some(_), _) => {
            return Err(Failure::usage(
                "--permits holds a permit of one semaphore; give one name",
            ));
        }
        (None, [name]) if args.read || args.write => {
            let lock = open_rwlock(&backend, name).await?;
            if args.read {
                (Asking::Read(lock), format!("a read of lock {name:?}"))
            } else {
                (Asking::Write(lock), format!("the write of lock {name:?}"))
            }
        }
        (None, _) if args.read || args.write => {
            return Err(Failure::usage(
                "--read and --write hold one read-write lock; give one name",
            ));
        }
        (None, _) => {
            let locker = MultiLocker::new(backend.factory(), &names)
                .map_err(|e| Failure::simba(e, "bad mutex name"))?;
            let asked = match &names[..] {
                [one] => format!("mutex {one:?}"),
                _ => format!("mutexes {names:?}"),
            };
            (Asking::Mutexes(locker), asked)
        }
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
    let acquire = acquire(&asking, &args);
    match &asking {
        Asking::Mutexes(_) => {
            debug!(mutexes = ?names, backend = %backend.shown, "waiting for the mutex")
        }
        Asking::Permit(s) => debug!(
            semaphore = s.name(),
            permits = s.permits(),
            backend = %backend.shown,
            "waiting for a permit"
        ),
        Asking::Read(l) | Asking::Write(l) => debug!(
            lock = l.name(),
            write = matches!(asking, Asking::Write(_)),
            backend = %backend.shown,
            "waiting for the read-write lock"
        ),
    }
    let waited = tokio::select! {
        r = acquire => Ok(r),
        sig = signals.recv() => Err(sig),
    };
    let guard = match waited {
        Ok(r) => r.map_err(|e| not_acquired(e, &asked, &args, &backend))?,
        Err(sig) => {
            info!(%sig, "signal while waiting: giving up");
            // The dropped acquisition stops in the background, releasing whatever it was
            // winning: wait for that before exiting, or the exit cuts it short and leaves
            // a dead owner for a whole lease.
            asking.settle().await;
            return Ok(signals::status_for(sig));
        }
    };
    guard.log_acquired();
    let Shown { what, fences, noun } = Shown::of(&guard);
    let narrator = Narrator {
        on: verbose,
        what: what.clone(),
    };
    narrator.say(format_args!(
        "acquired ({fences}) after waiting {}{}",
        show(guard.acquired_at().saturating_duration_since(started)),
        guard.valid_for()
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
    let mut statuses = guard.statuses();
    let deadline = statuses.earliest_deadline();
    // On SQLite the guardian holds each mutex's lock file too, so that the kernel frees
    // them only once no process of the command is left.
    let anchors = match guard.anchors(&backend) {
        Ok(anchors) => anchors,
        Err((mutex, e)) => {
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
    };
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
                                 {noun}",
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
                                 {noun}",
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
                            guard.valid_for()
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
        let which = if guard.several() {
            format!("{}, ", lost.part)
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
            lost.part,
            lost.reason,
            group.pgid(),
        ),
        Some(lost) => say!(
            "simba: ownership of {} lost: {}; stopping the command (SIGTERM to its process \
             group {}, SIGKILL after {})",
            lost.part,
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

/// The variable families `simba exec` sets; one inherited from an outer `simba exec` and
/// not set again here is removed from the command's environment.
const FAMILIES: [&str; 6] = [
    "SIMBA_MUTEX",
    "SIMBA_FENCE",
    "SIMBA_OWNER_ID",
    "SIMBA_SEMAPHORE",
    "SIMBA_PERMIT",
    "SIMBA_RW",
];

/// The command's environment. For mutexes: SIMBA_MUTEX_COUNT, SIMBA_MUTEX_i,
/// SIMBA_FENCE_i, SIMBA_OWNER_ID_i (i from 1, in the order given) and SIMBA_FENCES;
/// SIMBA_MUTEX, SIMBA_FENCE and SIMBA_OWNER_ID for one mutex. For a permit:
/// SIMBA_SEMAPHORE, SIMBA_PERMITS, SIMBA_PERMIT (the holder's id) and SIMBA_FENCE. For a
/// read or the write of a read-write lock: SIMBA_RWLOCK, SIMBA_RW_MODE (`read` or
/// `write`), SIMBA_OWNER_ID (the holder's id) and SIMBA_FENCE.
/// Second: the variables of these families inherited from simba's own environment (an
/// outer `simba exec`) that are not set here, to be removed, so that none describes an
/// ownership this command does not have.
fn command_env(held: &Held, names: &[String]) -> (Vec<(String, String)>, Vec<OsString>) {
    let env = match held {
        Held::Mutexes(guard) => mutex_env(guard, names),
        Held::Permit { guard, permits, .. } => vec![
            ("SIMBA_SEMAPHORE".to_owned(), guard.semaphore().to_owned()),
            ("SIMBA_PERMITS".to_owned(), permits.to_string()),
            ("SIMBA_PERMIT".to_owned(), guard.contender_id().to_owned()),
            ("SIMBA_FENCE".to_owned(), guard.fence().to_string()),
        ],
        Held::Rw { guard, .. } => vec![
            ("SIMBA_RWLOCK".to_owned(), guard.name().to_owned()),
            ("SIMBA_RW_MODE".to_owned(), guard.mode().to_owned()),
            ("SIMBA_OWNER_ID".to_owned(), guard.contender_id().to_owned()),
            ("SIMBA_FENCE".to_owned(), guard.fence().to_string()),
        ],
    };
    let unset = std::env::vars_os()
        .map(|(k, _)| k)
        .filter(|k| {
            let k = k.to_string_lossy();
            FAMILIES.iter().any(|family| k.starts_with(family))
                && !env.iter().any(|(set, _)| *set == k)
        })
        .collect();
    (env, unset)
}

fn mutex_env(guard: &MultiGuard, names: &[String]) -> Vec<(String, String)> {
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
    env
}

/// The semaphore `name` of `permits` permits on the backend's connection; a backend
/// without semaphores is a usage error that says so.
async fn open_semaphore(backend: &Backend, name: &str, permits: u32) -> Result<Semaphore, Failure> {
    backend
        .conn
        .open_semaphore(name, permits)
        .await
        .map_err(|e| backend.open_failed(e, "--permits", format!("semaphore {name:?}")))
}

/// The read-write lock `name` on the backend's connection; a backend without semaphores
/// (which its readers are) is a usage error that says so.
async fn open_rwlock(backend: &Backend, name: &str) -> Result<RwLock, Failure> {
    backend.conn.open_rwlock(name).await.map_err(|e| {
        backend.open_failed(e, "--read and --write", format!("read-write lock {name:?}"))
    })
}

/// Acquires as the options say. Every backend wakes a waiting command when the owner is
/// done (SQL: the database's lock queue); on SQLite and MySQL the factory also has a
/// short `LeaseConfig::waiter_poll` (`simba_jdbc::OBSERVER_POLL`), used only while a
/// subscription cannot be made.
async fn acquire(asking: &Asking, args: &ExecArgs) -> simba_core::Result<Held> {
    match asking {
        Asking::Mutexes(locker) => {
            let guard = if args.no_wait {
                locker.try_acquire().await
            } else {
                match args.timeout {
                    None => locker.acquire().await,
                    Some(limit) => locker.acquire_timeout(limit).await,
                }
            };
            guard.map(Held::Mutexes)
        }
        Asking::Permit(semaphore) => {
            let guard = if args.no_wait {
                semaphore.try_acquire().await
            } else {
                match args.timeout {
                    None => semaphore.acquire().await,
                    Some(limit) => semaphore.acquire_timeout(limit).await,
                }
            }?;
            Ok(Held::Permit {
                guard,
                permits: semaphore.permits(),
                acquired_at: tokio::time::Instant::now(),
            })
        }
        Asking::Read(lock) => {
            let guard = if args.no_wait {
                lock.try_read().await
            } else {
                match args.timeout {
                    None => lock.read().await,
                    Some(limit) => lock.read_timeout(limit).await,
                }
            }?;
            Ok(Held::Rw {
                guard: RwHeld::Read(guard, lock.name().to_owned()),
                acquired_at: tokio::time::Instant::now(),
            })
        }
        Asking::Write(lock) => {
            let guard = if args.no_wait {
                lock.try_write().await
            } else {
                match args.timeout {
                    None => lock.write().await,
                    Some(limit) => lock.write_timeout(limit).await,
                }
            }?;
            Ok(Held::Rw {
                guard: RwHeld::Write(guard, lock.name().to_owned()),
                acquired_at: tokio::time::Instant::now(),
            })
        }
    }
}

/// Why nothing was acquired, with the status that says so.
fn not_acquired(e: simba_core::Error, asked: &str, args: &ExecArgs, backend: &Backend) -> Failure {
    use simba_core::Error as E;
    // The library speaks of a mutex: say it of the permit, the read or the write.
    let busy = if args.permits.is_some() {
        Some("every permit is held")
    } else if args.read {
        Some("a writer holds or waits")
    } else if args.write {
        Some("a reader or a writer holds, or a writer waits")
    } else {
        None
    };
    match (Status::of(&e), &e, busy) {
        (Status::NotAcquired, E::WouldBlock { .. }, Some(busy)) => {
            Failure::new(Status::NotAcquired, format!("{asked}: {busy} (--no-wait)"))
        }
        (Status::NotAcquired, E::Timeout { waited, .. }, Some(_)) => Failure::new(
            Status::NotAcquired,
            format!("{asked} not acquired within {}", show(*waited)),
        ),
        // The library's message says it all: `mutex "m" is held by another contender`.
        (Status::NotAcquired, ..) => Failure {
            status: Status::NotAcquired,
            error: anyhow::Error::new(e),
        },
        (Status::Unavailable, ..) => Failure::simba(
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

/// Releases what is held, waiting at most `bound` when given (the core bounds it
/// otherwise); with `hold` (mutexes only), keeps them held until `hold` after the
/// acquisition. Returns which ownership had ended (`mutex "m" (fence 3)`) and why, when
/// one had ended before the release.
async fn release(
    held: Held,
    bound: Option<Duration>,
    hold: Option<Duration>,
) -> Option<(String, LossReason)> {
    // (name, how messages name it, fence) of each part.
    let parts: Vec<(String, String, u64)> = match &held {
        Held::Mutexes(guard) => guard
            .fences()
            .into_iter()
            .map(|(m, f)| (m.to_owned(), format!("mutex {m:?}"), f))
            .collect(),
        Held::Permit { guard, .. } => vec![(
            guard.semaphore().to_owned(),
            permit_of(guard.semaphore()),
            guard.fence(),
        )],
        Held::Rw { guard, .. } => vec![(guard.name().to_owned(), guard.what(), guard.fence())],
    };
    let call = async {
        match (held, hold) {
            (Held::Mutexes(guard), Some(d)) => {
                let r = guard.release_at_least(d).await;
                if r.is_ok() {
                    debug!(hold = %show(d), "released; held until the hold ends");
                }
                r
            }
            (Held::Mutexes(guard), None) => guard.release().await,
            (Held::Permit { guard, .. }, _) => guard.release().await,
            (Held::Rw { guard, .. }, _) => guard.release().await,
        }
    };
    let done = match bound {
        Some(b) => tokio::time::timeout(b, call).await.ok(),
        None => Some(call.await),
    };
    match done {
        Some(Ok(())) => debug!("released"),
        Some(Err(simba_core::Error::Lost { mutex, reason })) => {
            // The error names the mutex, or the semaphore of a permit.
            let (what, fence) = parts
                .iter()
                .find(|(name, ..)| *name == mutex)
                .map_or((format!("{mutex:?}"), 0), |(_, what, f)| (what.clone(), *f));
            return Some((format!("{what} (fence {fence})"), reason));
        }
        Some(Err(e)) if hold.is_some() => {
            warn!("keeping the mutex held failed (its lease still ends it): {e}")
        }
        Some(Err(e)) => warn!("release failed (the lease frees it): {e}"),
        None => debug!("release did not finish in time (the lease frees it)"),
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
