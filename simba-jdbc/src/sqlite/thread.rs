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

/// The answer of a job not yet received. Dropped before it came (its caller gave up), it
/// waits for the job to end, as the wrapper's default runtime does: the job holds the
/// connection, and diesel-async's transactions need it to themselves (it panics
/// otherwise) once the connection is back in the pool. On a multi-thread runtime only
/// (elsewhere the job ends on its own, later).
struct Pending<R>(Option<tokio::sync::oneshot::Receiver<R>>);

impl<R> Drop for Pending<R> {
    fn drop(&mut self) {
        let Some(mut rx) = self.0.take() else {
            return;
        };
        if !matches!(
            rx.try_recv(),
            Err(tokio::sync::oneshot::error::TryRecvError::Empty)
        ) {
            return;
        }
        let multi = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if multi {
            tokio::task::block_in_place(move || {
                let _ = rx.blocking_recv();
            });
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
        let job: Job = Box::new(move || {
            let _ = tx.send(task());
        });
        let sent = match &self.jobs {
            Some(jobs) => jobs
                .send(job)
                .map_err(|_| "the SQLite connection's thread has ended"),
            None => Err("the SQLite connection's thread could not be started"),
        };
        Box::pin(async move {
            sent?;
            let mut pending = Pending(Some(rx));
            let answer = match pending.0.as_mut() {
                Some(rx) => rx.await,
                None => return Err("no answer channel".into()),
            };
            pending.0 = None;
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
}
