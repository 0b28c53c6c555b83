//! [`LeaderScheduler`]: run async work on a schedule only while this process owns a mutex.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
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
#[derive(Debug, Clone)]
pub struct WorkContext {
    /// The mutex.
    pub mutex: String,
    /// The fencing token of the current ownership.
    pub fence: u64,
    /// How many runs this ownership has started before this one.
    pub run: u64,
}

type Work = Arc<dyn Fn(WorkContext) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// Runs work on a [`Schedule`] only while this process owns the mutex.
///
/// When ownership is lost (or the scheduler stops), the running work is cancelled at its
/// next `.await` and no new run starts until ownership comes back.
pub struct LeaderScheduler {
    service: Arc<dyn ContendService>,
    schedule: Schedule,
    work: Work,
    supervisor: StdMutex<Option<(watch::Sender<bool>, JoinHandle<()>)>>,
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
        let (tx, rx) = watch::channel(false);
        let task = tokio::spawn(supervise(
            self.service.status(),
            rx,
            self.schedule,
            self.work.clone(),
            self.service.mutex().to_owned(),
        ));
        *sup = Some((tx, task));
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
        if let Some((tx, task)) = sup {
            let _ = tx.send(true);
            let _ = task.await;
        }
        self.service.stop().await
    }
}

impl Drop for LeaderScheduler {
    fn drop(&mut self) {
        if let Some((tx, _)) = self.supervisor.get_mut().ok().and_then(Option::take) {
            let _ = tx.send(true);
        }
    }
}

async fn supervise(
    mut status: watch::Receiver<ContenderStatus>,
    mut stop: watch::Receiver<bool>,
    schedule: Schedule,
    work: Work,
    mutex: String,
) {
    let mut running: Option<(u64, JoinHandle<()>)> = None;
    loop {
        let fence = status.borrow_and_update().held.map(|h| h.fence);
        match (fence, &running) {
            (Some(f), Some((rf, _))) if f == *rf => {}
            (Some(f), _) => {
                if let Some((_, task)) = running.take() {
                    task.abort();
                }
                info!(%mutex, fence = f, "leader: starting scheduled work");
                running = Some((
                    f,
                    tokio::spawn(run_schedule(schedule, work.clone(), mutex.clone(), f)),
                ));
            }
            (None, Some(_)) => {
                if let Some((_, task)) = running.take() {
                    info!(%mutex, "leadership ended: cancelling scheduled work");
                    task.abort();
                }
            }
            (None, None) => {}
        }
        tokio::select! {
            r = stop.changed() => { if r.is_err() || *stop.borrow() { break; } }
            r = status.changed() => { if r.is_err() { break; } }
        }
    }
    if let Some((_, task)) = running.take() {
        debug!(%mutex, "scheduler stopping: cancelling work");
        task.abort();
        let _ = task.await;
    }
}

async fn run_schedule(schedule: Schedule, work: Work, mutex: String, fence: u64) {
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
        })
        .await;
        run += 1;
        if !fixed_rate {
            tokio::time::sleep(every).await;
        }
    }
}
