//! Property tests of the [`LeaseStore`] contract: random sequences of `acquire`, `guard`,
//! `release`, `release_after` and clock advances by three contenders over two stores,
//! each call checked against a reference model of the lease rules (the trait's
//! `# Contract`), and the owner read back after every call.
//!
//! The model knows the backend's clock only through the times the store reports: each
//! call is evaluated at some instant between the previous read's `now` and its own reply's
//! (or the next read's) `now`. Where that window straddles the end of a lease, both
//! outcomes are allowed and the store's answer says which one happened; everything else —
//! who owns, fences, `acquired_at`, `ttl_at`, `transition_at`, the return values — is
//! exact. Sequences come from a small seeded generator (the seed is in every failure
//! message; `SIMBA_PROP_SEED` replays one) and a failing sequence is shrunk by dropping
//! calls while it still fails.
//!
//! What the model allows beyond the plainest reading of the contract: a store with a wait
//! queue ([`PropertyRun::wait_queue`]) may answer an acquisition of a free mutex with the
//! unnamed holder (empty id, fence 0) and take nothing; `guard` on a free mutex may
//! acquire it (the trait's default runs `acquire`); `release` of one's own ended lease may
//! answer either way; a read may show an ended lease or no owner.

use std::fmt;
use std::time::Duration;

use simba_core::MutexOwner;
use simba_core::backend::{BoxFuture, Lease, LeaseStore, held_owner_id};

use crate::store_cases::StoreSource;
use crate::suite::{CaseError, CaseResult};
use crate::support::unique_name;

/// How clock advances are made.
#[derive(Debug, Clone, Copy)]
pub enum Clock {
    /// By the function given: for the in-memory store under a paused tokio clock,
    /// `|d| Box::pin(tokio::time::advance(d))` (tokio's `test-util`, which this crate
    /// leaves to its users' dev-dependencies).
    Manual(fn(Duration) -> BoxFuture<'static, ()>),
    /// A real sleep: for a backend with its own clock.
    Wall,
}

/// The size and shape of a property run.
#[derive(Debug, Clone)]
pub struct PropertyRun {
    /// How many random sequences.
    pub cases: usize,
    /// Calls (and clock advances) per sequence.
    pub steps: usize,
    /// The generator's seed (`SIMBA_PROP_SEED` overrides it).
    pub seed: u64,
    /// The lease every acquisition asks for.
    pub lease: Lease,
    /// The clock advances to choose from, in milliseconds.
    pub advances: Vec<u64>,
    /// The holds `release_after` chooses from, in milliseconds (0 is a plain release).
    pub holds: Vec<u64>,
    /// How advances are made.
    pub clock: Clock,
    /// Whether the store keeps a wait queue (see the module docs).
    pub wait_queue: bool,
    /// At most this many re-runs to shrink a failing sequence.
    pub shrink_runs: usize,
}

impl PropertyRun {
    /// The in-memory store under a paused tokio clock that `advance` moves (see
    /// [`Clock::Manual`]): many cases, exact times.
    pub fn memory(advance: fn(Duration) -> BoxFuture<'static, ()>) -> Self {
        PropertyRun {
            cases: 500,
            steps: 40,
            seed: 0x51ba_0001,
            lease: Lease {
                ttl: Duration::from_millis(1000),
                transition: Duration::from_millis(500),
            },
            advances: vec![1, 200, 499, 500, 700, 1000, 1499, 1500, 2500],
            holds: vec![0, 1, 300, 2000],
            clock: Clock::Manual(advance),
            wait_queue: false,
            shrink_runs: 500,
        }
    }

    /// A server backend on the wall clock: a bounded number of short sequences (about
    /// 15 s in all, mostly the advances' sleeps), leases short enough that advances end
    /// them.
    pub fn backend(wait_queue: bool) -> Self {
        PropertyRun {
            cases: 10,
            steps: 20,
            seed: 0x51ba_0002,
            lease: Lease {
                ttl: Duration::from_millis(300),
                transition: Duration::from_millis(200),
            },
            // A quarter of the lease, most of it, and more than all of it.
            advances: vec![120, 400, 700],
            holds: vec![0, 250],
            clock: Clock::Wall,
            wait_queue,
            shrink_runs: 20,
        }
    }
}

/// One step of a sequence. Contenders are `c0`, `c1`, `c2`; `c1` calls through the
/// second store, the others through the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// `acquire` by a contender.
    Acquire(usize),
    /// `guard` by a contender.
    Guard(usize),
    /// `release` by a contender.
    Release(usize),
    /// `release_after` by a contender, with a hold in milliseconds.
    ReleaseAfter(usize, u64),
    /// The clock moves on, in milliseconds.
    Advance(u64),
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Acquire(c) => write!(f, "acquire(c{c})"),
            Step::Guard(c) => write!(f, "guard(c{c})"),
            Step::Release(c) => write!(f, "release(c{c})"),
            Step::ReleaseAfter(c, ms) => write!(f, "release_after(c{c}, {ms}ms)"),
            Step::Advance(ms) => write!(f, "advance({ms}ms)"),
        }
    }
}

/// splitmix64: small, seeded, good enough to pick steps.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % u64::try_from(n.max(1)).unwrap_or(1)).unwrap_or(0)
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> Option<T> {
        from.get(self.below(from.len())).copied()
    }
}

fn generate(run: &PropertyRun, rng: &mut Rng) -> Vec<Step> {
    (0..run.steps)
        .map(|_| {
            let who = rng.below(3);
            match rng.below(10) {
                0..=2 => Step::Acquire(who),
                3..=4 => Step::Guard(who),
                5..=6 => Step::Release(who),
                7 => Step::ReleaseAfter(who, rng.pick(&run.holds).unwrap_or(0)),
                _ => Step::Advance(rng.pick(&run.advances).unwrap_or(1)),
            }
        })
        .collect()
}

/// Runs `run.cases` random sequences against `src`; the first disagreement with the
/// model is shrunk and returned with its seed, sequence and the store's answers.
pub async fn check_store_contract<S: StoreSource>(src: &S, run: &PropertyRun) -> CaseResult {
    let seed = std::env::var("SIMBA_PROP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(run.seed);
    let stores = [src.store().await?, src.store().await?];
    let mut rng = Rng(seed);
    for case in 0..run.cases {
        let steps = generate(run, &mut rng);
        let Err(first) = run_steps(&stores, run, &steps).await? else {
            continue;
        };
        let (steps, failure) = shrink(&stores, run, steps, first).await?;
        let listed: Vec<String> = steps.iter().map(ToString::to_string).collect();
        return Err(CaseError(format!(
            "{}: the store disagrees with the lease model (seed {seed}, case {case}; \
             shrunk to {} steps): {}\nsteps: [{}]\nanswers:\n{}",
            src.name(),
            steps.len(),
            failure.message,
            listed.join(", "),
            failure.trace.join("\n")
        )));
    }
    Ok(())
}

/// Drops steps one at a time while the sequence still fails (on a fresh mutex each run).
async fn shrink<S: LeaseStore>(
    stores: &[S; 2],
    run: &PropertyRun,
    mut steps: Vec<Step>,
    mut failure: Failure,
) -> Result<(Vec<Step>, Failure), CaseError> {
    // Everything after the failing step is not needed.
    steps.truncate(failure.step + 1);
    let mut budget = run.shrink_runs;
    let mut i = 0;
    while i < steps.len() && budget > 0 {
        let mut fewer = steps.clone();
        fewer.remove(i);
        budget -= 1;
        match run_steps(stores, run, &fewer).await? {
            Err(f) => {
                fewer.truncate(f.step + 1);
                steps = fewer;
                failure = f;
            }
            Ok(()) => i += 1,
        }
    }
    Ok((steps, failure))
}

/// Where a sequence disagreed with the model.
struct Failure {
    step: usize,
    message: String,
    trace: Vec<String>,
}

/// What the model knows of the mutex.
struct Model {
    /// The last ownership the store was seen to make (may have ended since).
    owner: MutexOwner,
    /// The largest fence seen.
    max_fence: u64,
}

impl Model {
    fn may_hold(&self, now: i64) -> bool {
        self.owner.is_in_lease(now)
    }

    /// A new ownership of `id` in the reply `r`, evaluated within `[lo, hi]`.
    fn check_new(&self, r: &MutexOwner, lease: Lease, lo: i64, hi: i64) -> Result<(), String> {
        if r.fence <= self.max_fence {
            return Err(format!(
                "a new ownership got fence {}, not above every earlier fence ({})",
                r.fence, self.max_fence
            ));
        }
        if !(lo..=hi).contains(&r.acquired_at) {
            return Err(format!(
                "acquired_at {} is outside the call's window [{lo}, {hi}] (backend clock)",
                r.acquired_at
            ));
        }
        check_times(r, r.acquired_at, lease)
    }

    /// A renewal in the reply `r` of the current ownership, evaluated within `[lo, hi]`.
    fn check_renewal(&self, r: &MutexOwner, lease: Lease, lo: i64, hi: i64) -> Result<(), String> {
        if r.acquired_at != self.owner.acquired_at {
            return Err(format!(
                "a renewal changed acquired_at from {} to {}",
                self.owner.acquired_at, r.acquired_at
            ));
        }
        let at = r.ttl_at - lease.ttl_ms();
        if !(lo..=hi).contains(&at) {
            return Err(format!(
                "a renewal's ttl_at {} is not the call's time + ttl (window [{lo}, {hi}])",
                r.ttl_at
            ));
        }
        check_times(r, at, lease)
    }
}

fn check_times(r: &MutexOwner, at: i64, lease: Lease) -> Result<(), String> {
    if r.ttl_at != at + lease.ttl_ms() || r.transition_at != r.ttl_at + lease.transition_ms() {
        return Err(format!(
            "times are not now + ttl ({} ms), + transition ({} ms) from {at}: {r:?}",
            lease.ttl_ms(),
            lease.transition_ms()
        ));
    }
    Ok(())
}

/// The unnamed holder a store with a wait queue may answer (no id, no fence, and a
/// `transition_at` to look again at; [`MutexOwner::NONE`] has none).
fn unnamed(o: &MutexOwner) -> bool {
    o.owner_id.is_empty() && o.fence == 0 && o.transition_at != 0
}

/// Runs one sequence on a fresh mutex: `Err` on a backend error, `Ok(Err(..))` when the
/// store disagreed with the model.
async fn run_steps<S: LeaseStore>(
    stores: &[S; 2],
    run: &PropertyRun,
    steps: &[Step],
) -> Result<Result<(), Failure>, CaseError> {
    let m = &unique_name("props");
    let ids = ["c0", "c1", "c2"];
    let lease = run.lease;
    let mut trace = Vec::new();
    let first = stores[0].owner(m).await?;
    if first.owner.has_owner() {
        return Ok(Err(Failure {
            step: 0,
            message: format!("a new mutex has an owner: {:?}", first.owner),
            trace,
        }));
    }
    let mut model = Model {
        owner: MutexOwner::NONE,
        max_fence: 0,
    };
    let mut lo = first.now;
    for (i, step) in steps.iter().enumerate() {
        let who = match *step {
            Step::Advance(ms) => {
                match run.clock {
                    Clock::Manual(advance) => advance(Duration::from_millis(ms)).await,
                    Clock::Wall => tokio::time::sleep(Duration::from_millis(ms)).await,
                }
                trace.push(format!("#{i} {step}"));
                continue;
            }
            Step::Acquire(c) | Step::Guard(c) | Step::Release(c) | Step::ReleaseAfter(c, _) => c,
        };
        let id = ids[who];
        let store = &stores[who % 2];
        let outcome = match *step {
            Step::Acquire(_) => Answer::Reply(store.acquire(m, id, lease).await?),
            Step::Guard(_) => Answer::Reply(store.guard(m, id, lease).await?),
            Step::Release(_) => Answer::Done(store.release(m, id).await?),
            Step::ReleaseAfter(_, ms) => Answer::Done(
                store
                    .release_after(m, id, Duration::from_millis(ms))
                    .await?,
            ),
            Step::Advance(_) => unreachable!("handled above"),
        };
        let read = stores[0].owner(m).await?;
        trace.push(format!(
            "#{i} {step} -> {outcome}; read {:?} at {}",
            read.owner, read.now
        ));
        let hi = match &outcome {
            Answer::Reply(r) => r.now.min(read.now),
            Answer::Done(_) => read.now,
        };
        if let Err(message) = apply(
            &mut model,
            *step,
            id,
            lease,
            &outcome,
            (&read.owner, read.now),
            lo,
            hi,
            run,
        )
        .and_then(|()| check_read(&model, &read.owner, read.now))
        {
            return Ok(Err(Failure {
                step: i,
                message: format!("step #{i} {step}: {message}"),
                trace,
            }));
        }
        lo = read.now;
    }
    // Leave nothing held for the next sequence's stores (each uses a new mutex anyway).
    for (who, id) in ids.iter().enumerate() {
        let _ = stores[who % 2].release(m, id).await;
    }
    Ok(Ok(()))
}

enum Answer {
    Reply(simba_core::backend::LeaseReply),
    Done(bool),
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Answer::Reply(r) => write!(f, "{:?} at {}", r.owner, r.now),
            Answer::Done(b) => write!(f, "{b}"),
        }
    }
}

/// Checks one call's answer against the model and moves the model on.
#[allow(clippy::too_many_arguments)]
fn apply(
    model: &mut Model,
    step: Step,
    id: &str,
    lease: Lease,
    outcome: &Answer,
    (read, read_now): (&MutexOwner, i64),
    lo: i64,
    hi: i64,
    run: &PropertyRun,
) -> Result<(), String> {
    let cur = model.owner.clone();
    let (may_be_in, surely_in) = (cur.is_in_lease(lo), cur.is_in_lease(hi));
    let mine = cur.is_owner(id);
    // Someone else's lease may still be in force: the caller may be refused.
    let others = cur.has_owner() && !mine && may_be_in;
    // The mutex may be free for the caller (no lease in force, or its own ended).
    let may_be_free = !surely_in;
    match (step, outcome) {
        (Step::Acquire(_) | Step::Guard(_), Answer::Reply(r)) => {
            let r = &r.owner;
            let is_guard = matches!(step, Step::Guard(_));
            if r.is_owner(id) {
                if mine && r.fence == cur.fence {
                    if !may_be_in {
                        return Err(format!(
                            "renewed an ended lease under its old fence {}: {cur:?} -> {r:?}",
                            cur.fence
                        ));
                    }
                    model.check_renewal(r, lease, lo, hi)?;
                } else {
                    if !may_be_free {
                        return Err(format!("took a mutex whose lease is in force: {cur:?}"));
                    }
                    model.check_new(r, lease, lo, hi)?;
                    model.max_fence = r.fence;
                }
                model.owner = r.clone();
            } else if mine && surely_in {
                return Err(format!(
                    "the owner's {} within its lease did not renew: {cur:?} -> {r:?}",
                    if is_guard { "guard" } else { "acquire" }
                ));
            } else if unnamed(r) {
                if !run.wait_queue {
                    return Err(format!(
                        "answered the unnamed holder, not the owner (model: {cur:?})"
                    ));
                }
            } else if !is_guard && !others {
                return Err(format!(
                    "did not acquire a mutex nobody else holds; answered {r:?} (model: {cur:?})"
                ));
            } else if r.has_owner() && *r != cur {
                return Err(format!("answered the owner {r:?}; the model has {cur:?}"));
            } else if !r.has_owner() && surely_in {
                return Err(format!("answered no owner while {cur:?} is in its lease"));
            }
        }
        (Step::Release(_) | Step::ReleaseAfter(_, 0), Answer::Done(done)) => {
            if *done {
                // Its own lease, ended and not taken since: harmless either way.
                if !mine {
                    return Err(format!("said it released a mutex it did not own: {cur:?}"));
                }
                model.owner = MutexOwner::NONE;
            } else if mine && surely_in {
                return Err(format!(
                    "the owner's release within its lease said false: {cur:?}"
                ));
            }
        }
        (Step::ReleaseAfter(_, hold), Answer::Done(done)) => {
            let hold = i64::try_from(hold).unwrap_or(i64::MAX);
            if !*done {
                if mine && surely_in {
                    return Err(format!(
                        "the owner's release_after within its lease said false: {cur:?}"
                    ));
                }
                return Ok(());
            }
            if !(mine && may_be_in) {
                return Err(format!("said it held a mutex it did not own: {cur:?}"));
            }
            let holder = held_owner_id(id);
            if read.owner_id == holder {
                let at = read.ttl_at - hold;
                if read.fence != cur.fence
                    || read.acquired_at != cur.acquired_at
                    || read.transition_at != read.ttl_at
                    || !(lo..=hi).contains(&at)
                {
                    return Err(format!(
                        "the hold is not ({holder}, fence {}, acquired_at {}, ttl_at = \
                         transition_at = now + {hold} ms within [{lo}, {hi}]): {read:?}",
                        cur.fence, cur.acquired_at
                    ));
                }
                model.owner = read.clone();
            } else {
                // The hold ended before the read: its end is at least `lo + hold`.
                if read_now < lo + hold {
                    return Err(format!(
                        "the hold of {hold} ms ended early: no longer held at {read_now}, \
                         the call was at {lo} or later; read {read:?}"
                    ));
                }
                model.owner = MutexOwner {
                    owner_id: holder,
                    ttl_at: lo + hold,
                    transition_at: lo + hold,
                    ..cur
                };
            }
        }
        (step, outcome) => return Err(format!("{step} answered {outcome}: not a valid answer")),
    }
    Ok(())
}

/// The owner read at backend time `now` agrees with the model.
fn check_read(model: &Model, read: &MutexOwner, now: i64) -> Result<(), String> {
    let o = &model.owner;
    if model.may_hold(now) {
        if read != o {
            return Err(format!(
                "read {read:?} at {now}; the model has {o:?} in its lease"
            ));
        }
    } else if read.has_owner() && (read != o || read.is_in_lease(now)) {
        return Err(format!(
            "read {read:?} at {now}; the model has no lease in force (last: {o:?})"
        ));
    }
    Ok(())
}
