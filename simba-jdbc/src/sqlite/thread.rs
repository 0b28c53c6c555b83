//! The thread of a SQLite connection: every statement of one connection runs on one thread
//! of its own, in the order the calls came, instead of a hop to any thread of tokio's
//! blocking pool per statement.
//!
//! Two reasons. The store's calls take turns on SQLite (one writer at a time), so a
//! handful of connections are ever busy, and a thread each is all they need; tokio's pool
//! instead ran each statement on whichever of its threads was idle, grew to a dozen
//! threads and more under 10,000 acquisitions, and each thread that allocated kept a
//! glibc malloc arena of about 2 MB (20–27 MB of the scale bench's resident memory, see
//! `docs/performance.md`). And a statement's thread is the one that ran the connection's
//! last statement: SQLite's page cache and prepared statements stay hot in its caches.
//!
//! The thread ends when the connection is dropped (its job channel closes), after the jobs
//! already queued. A job that panics ends only itself: its caller gets an error, the
//! thread takes the next job.
//!
//! A caller that gives up on a statement (a timeout cut it off) drops its future at once
//! and the job runs on to its end on the connection's thread. The connection may then be
//! back in its pool while the job still holds it, and diesel-async's wrapper needs it to
//! itself there: the pool's recycling check reads the transaction state, which panics
//! while a job holds the connection. So the pools check a connection out only once its
//! jobs have ended ([`settle_hook`]): at once when none is queued (the common case, no
//! hop to the thread), else after them, without blocking any thread. An earlier version
//! blocked the dropping task's worker instead (`block_in_place`), which moved that
//! worker's share of the runtime to another thread each time; each thread allocates in a
//! glibc malloc arena of its own, and the arenas so visited kept growing a SQLite
//! process's resident memory (docs/testing.md, *Soak*).

use std::any::TypeId;
use std::error::Error;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use diesel_async::pooled_connection::deadpool::{Hook, HookError};
use diesel_async::sync_connection_wrapper::SpawnBlocking;

use super::SqliteConn;

type Job = Box<dyn FnOnce() + Send>;

/// A connection's own thread, for diesel-async's `SyncConnectionWrapper` (its
/// [`SpawnBlocking`] runtime: the wrapper makes one per connection, when it connects).
pub(crate) struct ConnThread {
    /// `None` when the thread could not be started: every statement then fails.
    jobs: Option<mpsc::Sender<Job>>,
    /// Jobs sent and not yet run to their end (their hold on the connection released).
    queued: Arc<AtomicUsize>,
}

/// The answer of [`settle_hook`]'s job. A type of its own, so that [`ConnThread`] knows
/// that job and runs it at once, on the caller's thread, when no other job is queued:
/// then no job holds the connection, and the job (take the connection's lock, answer)
/// does nothing that could block.
struct Settled;

/// Counts a job out of [`ConnThread::queued`] when dropped: after the job ran, or when it
/// panicked.
struct Ran(Arc<AtomicUsize>);

impl Drop for Ran {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

impl SpawnBlocking for ConnThread {
    fn spawn_blocking<'a, R>(
        &mut self,
        task: impl FnOnce() -> R + Send + 'static,
    ) -> Pin<Box<dyn Future<Output = Result<R, Box<dyn Error + Send + Sync + 'static>>> + Send + 'a>>
    where
        R: Send + 'static,
    {
        if TypeId::of::<R>() == TypeId::of::<diesel::QueryResult<Settled>>()
            && self.queued.load(Ordering::Acquire) == 0
        {
            return Box::pin(std::future::ready(Ok(task())));
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let ran = Ran(self.queued.clone());
        self.queued.fetch_add(1, Ordering::AcqRel);
        let job: Job = Box::new(move || {
            // `task` holds the connection until it returns; counted out before the
            // answer goes, so that a caller that checks the connection in again finds it
            // settled.
            let answer = task();
            drop(ran);
            let _ = tx.send(answer);
        });
        // A job that cannot be sent is dropped here, and `ran` with it.
        let sent = match &self.jobs {
            Some(jobs) => jobs
                .send(job)
                .map_err(|_| "the SQLite connection's thread has ended"),
            None => Err("the SQLite connection's thread could not be started"),
        };
        Box::pin(async move {
            sent?;
            rx.await
                .map_err(|_| "the SQLite statement panicked on the connection's thread".into())
        })
    }

    fn get_runtime() -> Self {
        let (jobs, rx) = mpsc::channel::<Job>();
        let started = std::thread::Builder::new()
            .name("simba-sqlite".to_owned())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    // A panic drops the job's answer channel: its caller gets an error.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            });
        let queued = Arc::new(AtomicUsize::new(0));
        match started {
            Ok(_) => ConnThread {
                jobs: Some(jobs),
                queued,
            },
            Err(e) => {
                tracing::warn!("cannot start a SQLite connection's thread: {e}");
                ConnThread { jobs: None, queued }
            }
        }
    }
}

/// The pools' `pre_recycle` hook: a connection is handed out only once the jobs of calls
/// that gave up on it have ended (see the module's doc). A connection whose thread has
/// ended fails the hook, and the pool replaces it.
pub(crate) fn settle_hook() -> Hook<SqliteConn> {
    Hook::async_fn(|conn: &mut SqliteConn, _| {
        Box::pin(async move {
            conn.spawn_blocking(|_| Ok(Settled))
                .await
                .map(|Settled| ())
                .map_err(|e| {
                    HookError::Backend(diesel_async::pooled_connection::PoolError::QueryError(e))
                })
        })
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn jobs_run_in_order_on_one_thread_and_a_panic_ends_only_its_job() {
        let mut t = ConnThread::get_runtime();
        let first = t.spawn_blocking(|| std::thread::current().id());
        let second = t.spawn_blocking(|| std::thread::current().id());
        let panicked = t.spawn_blocking(|| -> u8 { panic!("a statement panicked") });
        let after = t.spawn_blocking(|| std::thread::current().id());
        let (a, b) = (first.await.expect("first"), second.await.expect("second"));
        assert_eq!(a, b);
        assert_ne!(a, std::thread::current().id());
        assert!(panicked.await.is_err());
        assert_eq!(after.await.expect("after the panic"), a);
    }

    /// Where and after what the settle job ran.
    fn settle_job(
        log: &Arc<std::sync::Mutex<Vec<(&'static str, std::thread::ThreadId)>>>,
    ) -> impl FnOnce() -> diesel::QueryResult<Settled> + Send + 'static {
        let log = log.clone();
        move || {
            log.lock()
                .expect("the log")
                .push(("settle", std::thread::current().id()));
            Ok(Settled)
        }
    }

    #[tokio::test]
    async fn the_settle_job_runs_at_once_when_idle_and_after_the_queued_jobs_otherwise() {
        let mut t = ConnThread::get_runtime();
        let here = std::thread::current().id();
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));

        // Nothing queued: it runs here, at once.
        let idle = t.spawn_blocking(settle_job(&log));
        assert_eq!(*log.lock().expect("the log"), [("settle", here)]);
        assert!(idle.await.expect("the settle job").is_ok());
        log.lock().expect("the log").clear();

        // A job holds the connection's thread: the settle job waits behind it.
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        let job_log = log.clone();
        let job = t.spawn_blocking(move || {
            let _ = blocked.recv();
            job_log
                .lock()
                .expect("the log")
                .push(("job", std::thread::current().id()));
        });
        let mut settle = t.spawn_blocking(settle_job(&log));
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut settle)
                .await
                .is_err(),
            "the settle job answered while a job was queued"
        );
        assert!(log.lock().expect("the log").is_empty());
        release.send(()).expect("the job waits");
        assert!(settle.await.expect("the settle job").is_ok());
        job.await.expect("the job");
        let log_now = log.lock().expect("the log").clone();
        assert_eq!(log_now.len(), 2);
        assert_eq!((log_now[0].0, log_now[1].0), ("job", "settle"));
        assert_eq!(
            log_now[0].1, log_now[1].1,
            "both on the connection's thread"
        );
        assert_ne!(log_now[0].1, here);

        // A job that panicked is counted out: idle again.
        let panicked = t.spawn_blocking(|| -> u8 { panic!("a statement panicked") });
        assert!(panicked.await.is_err());
        log.lock().expect("the log").clear();
        let idle = t.spawn_blocking(settle_job(&log));
        assert_eq!(*log.lock().expect("the log"), [("settle", here)]);
        assert!(idle.await.expect("the settle job").is_ok());
    }
}
