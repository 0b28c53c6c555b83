//! [`LeaderScheduler`]: run async work on a schedule only while this process owns a mutex.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use tracing::{debug, info};

use crate::error::{Error, Result};
use crate::service::{ContendService, ContendServiceFactory, ContenderStatus, SilentContender};

/// When the work runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Starts a run every `period` (a run that overruns delays the next; missed runs are
    /// skipped, not bunched).
    FixedRate {
        /// Delay before the first run after becoming owner.
        initial_delay: Duration,
        /// Time between run starts.
        period: Duration,
    },
    /// Waits `delay` between the end of one run and the start of the next.
    FixedDelay {
        /// Delay before the first run after becoming owner.
        initial_delay: Duration,
        /// Time between a run's end and the next start.
        delay: Duration,
    },
}

/// What a run of the work is told.
///
/// # Stopping cooperatively
/// When the ownership ends (or the scheduler stops), the scheduler first cancels the
/// context's token ([`cancelled`](WorkContext::cancelled), [`is_cancelled`](WorkContext::is_cancelled),
/// [`token`](WorkContext::token)) and then aborts the run's task, which ends the run at its
/// next `.await`. The abort reaches neither what the work runs *between* two `.await`s nor
/// what it hands to other tasks or threads (`tokio::spawn`, `spawn_blocking`, a thread):
/// those should check [`is_cancelled`](WorkContext::is_cancelled) (or hold a clone of
/// [`token`](WorkContext::token)) and stop as soon as it says so, because the mutex no
/// longer protects them. Every run of one ownership shares one token.
#[derive(Debug, Clone)]
pub struct WorkContext {
    /// The mutex.
    pub mutex: String,
    /// The fencing token of the current ownership.
    pub fence: u64,
    /// How many runs this ownership has started before this one.
    pub run: u64,
    cancel: CancellationToken,
}

impl WorkContext {
    /// Completes once this ownership ended or the scheduler stopped (at once if it has).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping it only stops waiting.
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.cancel.cancelled()
    }

    /// Whether this ownership ended or the scheduler stopped: the work must stop.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// The token that is cancelled when this ownership ends or the scheduler stops; clone
    /// it into tasks and threads the work starts.
    pub fn token(&self) -> &CancellationToken {
        &self.cancel
    }
}

type Work = Arc<dyn Fn(WorkContext) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// Runs work on a [`Schedule`] only while this process owns the mutex.
///
/// When ownership is lost (or the scheduler stops), the run's [`WorkContext`] token is
/// cancelled, then the running work is aborted at its next `.await`, and no new run starts
/// until ownership comes back (see [`WorkContext`] for work that must stop between two
/// `.await`s or in tasks of its own).
pub struct LeaderScheduler {
    service: Arc<dyn ContendService>,
    schedule: Schedule,
    work: Work,
    supervisor: StdMutex<Option<(CancellationToken, JoinHandle<()>)>>,
}

impl fmt::Debug for LeaderScheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderScheduler")
            .field("service", &self.service)
            .field("schedule", &self.schedule)
            .finish()
    }
}

impl LeaderScheduler {
    /// A scheduler for `mutex` (not started).
    ///
    /// # Errors
    /// [`Error::InvalidName`] for a bad name; [`Error::InvalidConfig`] for a zero period.
    pub fn new<F, Fut>(
        factory: &dyn ContendServiceFactory,
        mutex: &str,
        schedule: Schedule,
        work: F,
    ) -> Result<Self>
    where
        F: Fn(WorkContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let period = match schedule {
            Schedule::FixedRate { period, .. } => period,
            Schedule::FixedDelay { delay, .. } => delay,
        };
        if period.is_zero() {
            return Err(Error::config(
                "schedule",
                "the period / delay must be greater than zero",
            ));
        }
        let service = factory.create_contend_service(mutex, Arc::new(SilentContender))?;
        Ok(LeaderScheduler {
            service,
            schedule,
            work: Arc::new(move |ctx| Box::pin(work(ctx))),
            supervisor: StdMutex::new(None),
        })
    }

    /// The contend service underneath.
    pub fn service(&self) -> &Arc<dyn ContendService> {
        &self.service
    }

    /// Whether this process owns the mutex now.
    pub fn is_leader(&self) -> bool {
        self.service.is_owner()
    }

    /// Starts contending and scheduling.
    ///
    /// # Errors
    /// [`Error::InvalidState`] if already started or outside a tokio runtime.
    pub fn start(&self) -> Result<()> {
        let mut sup = self.supervisor.lock().unwrap_or_else(|p| p.into_inner());
        if sup.is_some() {
            return Err(Error::InvalidState("scheduler already started".into()));
        }
        self.service.start()?;
        let stop = CancellationToken::new();
        let task = tokio::spawn(supervise(
            self.service.status(),
            stop.clone(),
            self.schedule,
            self.work.clone(),
            self.service.mutex().to_owned(),
        ));
        *sup = Some((stop, task));
        Ok(())
    }

    /// Stops: cancels running work, then stops contending (releasing the mutex).
    ///
    /// # Errors
    /// Never fails today.
    ///
    /// # Cancel safety
    /// Dropping the future after the first poll still stops, in the background.
    pub async fn stop(&self) -> Result<()> {
        let sup = self
            .supervisor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some((stop, task)) = sup {
            stop.cancel();
            let _ = task.await;
        }
        self.service.stop().await
    }
}

impl Drop for LeaderScheduler {
    fn drop(&mut self) {
        if let Some((stop, _)) = self.supervisor.get_mut().ok().and_then(Option::take) {
            stop.cancel();
        }
    }
}

/// One ownership's scheduled work: its fence, its token, its task.
struct Running {
    fence: u64,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

impl Running {
    /// Cancels the token first (work that checks it stops by itself), then aborts.
    fn end(self) -> JoinHandle<()> {
        self.cancel.cancel();
        self.task.abort();
        self.task
    }
}

async fn supervise(
    mut status: watch::Receiver<ContenderStatus>,
    stop: CancellationToken,
    schedule: Schedule,
    work: Work,
    mutex: String,
) {
    let mut running: Option<Running> = None;
    loop {
        let fence = status.borrow_and_update().held.map(|h| h.fence);
        match (fence, &running) {
            (Some(f), Some(r)) if f == r.fence => {}
            (Some(f), _) => {
                if let Some(r) = running.take() {
                    r.end();
                }
                info!(%mutex, fence = f, "leader: starting scheduled work");
                let cancel = stop.child_token();
                let task = tokio::spawn(run_schedule(
                    schedule,
                    work.clone(),
                    mutex.clone(),
                    f,
                    cancel.clone(),
                ));
                running = Some(Running {
                    fence: f,
                    cancel,
                    task,
                });
            }
            (None, Some(_)) => {
                if let Some(r) = running.take() {
                    info!(%mutex, "leadership ended: cancelling scheduled work");
                    r.end();
                }
            }
            (None, None) => {}
        }
        tokio::select! {
            () = stop.cancelled() => break,
            r = status.changed() => { if r.is_err() { break; } }
        }
    }
    if let Some(r) = running.take() {
        debug!(%mutex, "scheduler stopping: cancelling work");
        let _ = r.end().await;
    }
}

async fn run_schedule(
    schedule: Schedule,
    work: Work,
    mutex: String,
    fence: u64,
    cancel: CancellationToken,
) {
    let (initial, every, fixed_rate) = match schedule {
        Schedule::FixedRate {
            initial_delay,
            period,
        } => (initial_delay, period, true),
        Schedule::FixedDelay {
            initial_delay,
            delay,
        } => (initial_delay, delay, false),
    };
    let mut ticker = tokio::time::interval_at(Instant::now() + initial, every);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut run = 0;
    if !fixed_rate {
        tokio::time::sleep(initial).await;
    }
    loop {
        if fixed_rate {
            ticker.tick().await;
        }
        work(WorkContext {
            mutex: mutex.clone(),
            fence,
            run,
            cancel: cancel.clone(),
        })
        .await;
        run += 1;
        if !fixed_rate {
            tokio::time::sleep(every).await;
        }
    }
}
