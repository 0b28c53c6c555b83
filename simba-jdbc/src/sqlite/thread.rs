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
//! A statement's answer dropped before it came (a timeout cut the call off, its caller gave
//! up) waits, on the thread that drops it, for the job to end. What the dropping call holds
//! is let go only then: the pooled connection (diesel-async's wrapper needs it to itself
//! there, and its pool's check panics otherwise) and, above all, the native lock of an
//! acquisition, whose release lets another process's waiter take a gated owner's row at
//! once (the `locked_take` rule of `crate::sql`): if the lock were let go while the
//! statement still ran, the late statement could take a row the next holder of the lock
//! had just taken, and give two owners. The wait blocks the dropping thread itself, on a
//! multi-thread runtime too, and not with tokio's `block_in_place`: that hands the worker's
//! share of the runtime to another thread each time, each thread allocates in a glibc
//! malloc arena of its own, and every arena the runtime passes through keeps its size, so a
//! SQLite process's resident memory would keep growing (docs/testing.md, *Soak*). The wait
//! is as long as the rest of the statement: sub-millisecond to tens of milliseconds in the
//! soaks, at most the busy timeout (the statement timeout) when another process holds the
//! database's write lock.

use std::error::Error;
use std::future::Future;
use std::pin::Pin;
use std::sync::mpsc;

use diesel_async::sync_connection_wrapper::SpawnBlocking;

type Job = Box<dyn FnOnce() + Send>;

/// A connection's own thread, for diesel-async's `SyncConnectionWrapper` (its
/// [`SpawnBlocking`] runtime: the wrapper makes one per connection, when it connects).
pub(crate) struct ConnThread {
    /// `None` when the thread could not be started: every statement then fails.
    jobs: Option<mpsc::Sender<Job>>,
}

/// The answer of a job not yet received. Dropped before it came, it waits for the job to
/// end (see the module's doc).
struct Pending<R> {
    answer: Option<tokio::sync::oneshot::Receiver<R>>,
    /// Disconnected when the job has ended (or was dropped without running).
    ended: mpsc::Receiver<()>,
}

impl<R> Drop for Pending<R> {
    fn drop(&mut self) {
        let Some(mut answer) = self.answer.take() else {
            return;
        };
        if matches!(
            answer.try_recv(),
            Err(tokio::sync::oneshot::error::TryRecvError::Empty)
        ) {
            // Blocks this thread (not tokio's `block_in_place`: see the module's doc).
            let _ = self.ended.recv();
        }
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
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (end, ended) = mpsc::channel::<()>();
        let job: Job = Box::new(move || {
            // `task` holds the connection until it returns; `end` goes after the answer,
            // so that a drop that found no answer waits for both.
            let _ = tx.send(task());
            drop(end);
        });
        let sent = match &self.jobs {
            Some(jobs) => jobs
                .send(job)
                .map_err(|_| "the SQLite connection's thread has ended"),
            None => Err("the SQLite connection's thread could not be started"),
        };
        // Made before the future is first polled: dropped unpolled, it waits too.
        let mut pending = Pending {
            answer: Some(rx),
            ended,
        };
        Box::pin(async move {
            sent?;
            let answer = match pending.answer.as_mut() {
                Some(rx) => rx.await,
                None => return Err("no answer channel".into()),
            };
            // Answered: nothing left to wait for when `pending` drops.
            drop(pending.answer.take());
            answer.map_err(|_| "the SQLite statement panicked on the connection's thread".into())
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
        match started {
            Ok(_) => ConnThread { jobs: Some(jobs) },
            Err(e) => {
                tracing::warn!("cannot start a SQLite connection's thread: {e}");
                ConnThread { jobs: None }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
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

    /// A statement's answer dropped before it came returns only once the job has ended,
    /// on a multi-thread runtime as on a current-thread one.
    async fn a_dropped_answer_waits_for_its_job() {
        let mut t = ConnThread::get_runtime();
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        let ended = Arc::new(AtomicBool::new(false));
        let job_ended = ended.clone();
        let job = t.spawn_blocking(move || {
            let _ = blocked.recv();
            job_ended.store(true, Ordering::SeqCst);
        });
        // The pause only makes it likely that the drop below starts waiting before the job
        // is released; on a slow machine the job may end first and the test checks less,
        // but it cannot fail wrongly. Nothing tells when a drop has begun to wait.
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            let _ = release.send(());
        });
        // Not polled: the job is queued, its answer not come.
        drop(job);
        assert!(
            ended.load(Ordering::SeqCst),
            "the drop returned before the job ended"
        );
        releaser.join().expect("the releasing thread");
    }

    #[tokio::test]
    async fn a_dropped_answer_waits_on_a_current_thread_runtime() {
        a_dropped_answer_waits_for_its_job().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_answer_waits_on_a_multi_thread_runtime() {
        a_dropped_answer_waits_for_its_job().await;
    }
}
