//! The loop both ZooKeeper services run: check, wait for a watch, the session or a
//! retry, check again.
//!
//! A [`Recipe`] says what one check does and what its outcome means; [`run`] decides when
//! to check: at once after a watch of the latest check fired or the connection was made
//! again, after a retry pause when a check failed, and never while the session is not
//! connected.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use simba_core::Result;
use tokio::sync::mpsc;
use tokio::time::{Instant, Interval, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use zookeeper_async::WatchedEvent;

use crate::common::sleep_until_opt;
use crate::session::{Core, View};

/// When the next check is due, and the watches of the latest one.
pub(crate) struct Schedule {
    /// Watch callbacks send the generation of their check here.
    tx: mpsc::UnboundedSender<u64>,
    /// The generation of the latest check; callbacks of older ones are ignored.
    generation: u64,
    /// The session link last seen (a new link loses every watch).
    link: u64,
    /// A check is needed.
    dirty: bool,
    /// Not before this instant (after a failure).
    retry_at: Option<Instant>,
    /// Failed checks in a row.
    failures: u32,
}

/// The receiving end of a [`Schedule`]'s watches.
pub(crate) struct Watches(mpsc::UnboundedReceiver<u64>);

impl Schedule {
    /// A schedule whose first check is due at once.
    pub(crate) fn new() -> (Schedule, Watches) {
        let (tx, rx) = mpsc::unbounded_channel();
        let schedule = Schedule {
            tx,
            generation: 0,
            link: 0,
            dirty: true,
            retry_at: None,
            failures: 0,
        };
        (schedule, Watches(rx))
    }

    /// Begins a check: watches set from now on belong to it, earlier ones are ignored.
    /// Returns the callback for its watches: a non-blocking send from the client's watch
    /// task, never a panic.
    pub(crate) fn begin_check(&mut self) -> impl Fn(WatchedEvent) + Clone + Send + 'static {
        self.generation += 1;
        let generation = self.generation;
        let tx = self.tx.clone();
        move |e: WatchedEvent| {
            #[cfg(feature = "bench")]
            if simba_core::hops::enabled() {
                let path = e.path.as_deref().unwrap_or_default();
                simba_core::hops::record(simba_core::hops::Hop::PushReceived, path);
            }
            #[cfg(not(feature = "bench"))]
            let _ = e;
            let _ = tx.send(generation);
        }
    }

    /// Check again now.
    pub(crate) fn wake(&mut self) {
        self.dirty = true;
        self.retry_at = None;
    }

    /// Check again after `pause`.
    pub(crate) fn retry_after(&mut self, pause: Duration) {
        self.dirty = true;
        self.retry_at = Some(Instant::now() + pause);
    }

    /// The check settled the state: nothing to do until a watch fires.
    pub(crate) fn settled(&mut self) {
        self.failures = 0;
        self.dirty = false;
        self.retry_at = None;
    }

    /// A check failed: check again after `pause`. Returns how many failed in a row.
    pub(crate) fn failed(&mut self, pause: Duration) -> u32 {
        self.failures = self.failures.saturating_add(1);
        self.retry_after(pause);
        self.failures
    }

    /// A check that neither settled nor failed: forget earlier failures.
    pub(crate) fn reset_failures(&mut self) {
        self.failures = 0;
    }

    fn relink(&mut self, link: u64) {
        if link != self.link {
            self.link = link;
            self.wake();
        }
    }

    fn due(&self) -> bool {
        self.dirty && self.retry_at.is_none_or(|t| t <= Instant::now())
    }

    fn retry_at(&self) -> Option<Instant> {
        self.retry_at.filter(|_| self.dirty)
    }
}

/// What one ZooKeeper service does in [`run`].
pub(crate) trait Recipe: Send {
    /// What a check that did not fail found.
    type Step: Send;

    fn core(&self) -> &Arc<Core>;

    fn schedule(&mut self) -> &mut Schedule;

    /// Applies what the session says before each turn (after a new link was noted in the
    /// schedule).
    fn sync(&mut self, view: View) {
        let _ = view;
    }

    /// The instant the loop must wake up at whatever else happens (an owner's deadline).
    fn deadline(&self) -> Option<Instant> {
        None
    }

    /// How often the loop wakes up by itself besides, if at all.
    fn republish_every(&self) -> Option<Duration> {
        None
    }

    /// A check is due but the session is not connected; the loop then waits.
    fn not_ready(&mut self, view: View) {
        let _ = view;
    }

    /// One check (begun with [`Schedule::begin_check`]).
    fn check(&mut self) -> impl Future<Output = Result<Self::Step>> + Send;

    /// Applies a check's outcome to the state and the schedule.
    fn after_check(&mut self, step: Result<Self::Step>);

    /// A watch of the latest check fired (the schedule wakes up besides).
    fn on_watch(&mut self) {}

    /// The service was told to stop; `ready`: the session is connected now.
    fn shutdown(self, ready: bool) -> impl Future<Output = ()> + Send
    where
        Self: Sized,
    {
        let _ = ready;
        async {}
    }
}

/// Runs `recipe` until `stop` is cancelled, then its shutdown.
pub(crate) async fn run<R: Recipe>(
    mut recipe: R,
    Watches(mut events): Watches,
    stop: CancellationToken,
) {
    let mut view = recipe.core().view();
    let mut republish = recipe.republish_every().map(|every| {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        tick
    });
    loop {
        if stop.is_cancelled() {
            break;
        }
        let now = *view.borrow_and_update();
        recipe.schedule().relink(now.link);
        recipe.sync(now);
        let deadline = recipe.deadline();
        let due = recipe.schedule().due();
        if due && now.ready {
            let step = tokio::select! {
                biased;
                () = stop.cancelled() => break,
                () = sleep_until_opt(deadline) => continue,
                step = recipe.check() => step,
            };
            recipe.after_check(step);
            continue;
        }
        if due {
            recipe.not_ready(now);
        }
        let retry_at = recipe.schedule().retry_at();
        tokio::select! {
            biased;
            () = stop.cancelled() => break,
            () = sleep_until_opt(deadline) => {}
            _ = view.changed() => {}
            Some(generation) = events.recv() => {
                if generation == recipe.schedule().generation {
                    recipe.on_watch();
                    recipe.schedule().wake();
                }
            }
            () = sleep_until_opt(retry_at) => {}
            () = tick(republish.as_mut()) => {}
        }
    }
    let ready = view.borrow().ready;
    recipe.shutdown(ready).await;
}

/// The next tick of `interval`, or never.
async fn tick(interval: Option<&mut Interval>) {
    match interval {
        Some(i) => {
            i.tick().await;
        }
        None => std::future::pending().await,
    }
}
