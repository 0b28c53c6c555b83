//! The runtime seam of the locker and the lease engine: spawning, and the timers that
//! bound a wait.
//!
//! In every build but this crate's own unit tests these are tokio's items, re-exported
//! unchanged. In the unit tests (`cfg(test)`), each one looks at where it runs: inside a
//! tokio runtime it is tokio's; inside a [shuttle](https://docs.rs/shuttle) execution (the
//! model-checked tests of `crate::model`) it spawns a shuttle task, and time stands still:
//! a sleep whose deadline has passed ends at once and any later one never does; a
//! `timeout` whose deadline is at most a minute away elapses at a moment the scheduler
//! chooses (a timer task), a later one never. So the model checker runs the
//! locker and engine code that ships, with tokio's runtime-agnostic `tokio::sync`
//! primitives, and only the runtime underneath is swapped.

#[cfg(not(test))]
pub(crate) use tokio::runtime::Handle;
#[cfg(not(test))]
pub(crate) use tokio::spawn;
#[cfg(not(test))]
pub(crate) use tokio::task::JoinHandle;
#[cfg(not(test))]
pub(crate) use tokio::time::error::Elapsed;
#[cfg(not(test))]
pub(crate) use tokio::time::{sleep_until, timeout, timeout_at};

#[cfg(test)]
pub(crate) use model::{
    Elapsed, Handle, JoinHandle, TASK_POLLS, sleep_until, spawn, timeout, timeout_at,
};

#[cfg(test)]
mod model {
    use std::fmt;
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll, Waker};
    use std::time::Duration;

    use tokio::time::Instant;

    /// Whether the caller runs under the model checker rather than in a tokio runtime.
    fn in_model() -> bool {
        tokio::runtime::Handle::try_current().is_err()
            && shuttle::current::try_get_current_task().is_some()
    }

    /// A bounded wait ran out (tokio's `Elapsed` cannot be made outside tokio).
    #[derive(Debug)]
    pub(crate) struct Elapsed;

    impl fmt::Display for Elapsed {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("deadline has elapsed")
        }
    }

    /// Where to spawn: tokio's runtime or the model checker's executor.
    pub(crate) enum Handle {
        Tokio(tokio::runtime::Handle),
        Model,
    }

    impl Handle {
        pub(crate) fn try_current() -> Result<Handle, &'static str> {
            match tokio::runtime::Handle::try_current() {
                Ok(h) => Ok(Handle::Tokio(h)),
                Err(_) if in_model() => Ok(Handle::Model),
                Err(_) => Err("no runtime"),
            }
        }

        pub(crate) fn spawn<F>(&self, fut: F) -> JoinHandle<F::Output>
        where
            F: Future + Send + 'static,
            F::Output: Send + 'static,
        {
            match self {
                Handle::Tokio(h) => JoinHandle::Tokio(h.spawn(Counted(Box::pin(fut)))),
                Handle::Model => JoinHandle::Model(shuttle::future::spawn(fut)),
            }
        }
    }

    thread_local! {
        /// Polls of the tasks spawned through this seam on this thread's tokio runtime:
        /// on a current-thread runtime, how many times the engine's tasks ran, i.e. the
        /// task hops of what the test did (see `crate::wakeups`).
        pub(crate) static TASK_POLLS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// A spawned future whose polls count in [`TASK_POLLS`].
    struct Counted<F>(Pin<Box<F>>);

    impl<F: Future> Future for Counted<F> {
        type Output = F::Output;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            TASK_POLLS.with(|n| n.set(n.get() + 1));
            self.0.as_mut().poll(cx)
        }
    }

    /// A spawned task of either runtime.
    pub(crate) enum JoinHandle<T> {
        Tokio(tokio::task::JoinHandle<T>),
        Model(shuttle::future::JoinHandle<T>),
    }

    impl<T> JoinHandle<T> {
        pub(crate) fn is_finished(&self) -> bool {
            match self {
                JoinHandle::Tokio(h) => h.is_finished(),
                JoinHandle::Model(h) => h.is_finished(),
            }
        }
    }

    impl<T> Future for JoinHandle<T> {
        type Output = Result<T, String>;
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
            match self.get_mut() {
                JoinHandle::Tokio(h) => Pin::new(h).poll(cx).map_err(|e| e.to_string()),
                JoinHandle::Model(h) => Pin::new(h).poll(cx).map_err(|e| e.to_string()),
            }
        }
    }

    pub(crate) fn spawn<F>(fut: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match Handle::try_current() {
            Ok(h) => h.spawn(fut),
            // As tokio::spawn: outside any runtime it is a bug of the caller.
            Err(_) => JoinHandle::Tokio(tokio::spawn(fut)),
        }
    }

    pub(crate) async fn sleep_until(deadline: Instant) {
        if !in_model() {
            return tokio::time::sleep_until(deadline).await;
        }
        if deadline <= Instant::now() {
            shuttle::future::yield_now().await;
        } else {
            std::future::pending::<()>().await;
        }
    }

    /// How far ahead a deadline may be for the model to fire it at a moment of the
    /// scheduler's choosing; later ones never fire within a schedule.
    const SHORT: Duration = Duration::from_secs(60);

    pub(crate) async fn timeout_at<F: Future>(
        deadline: Instant,
        fut: F,
    ) -> Result<F::Output, Elapsed> {
        if !in_model() {
            return tokio::time::timeout_at(deadline, fut)
                .await
                .map_err(|_| Elapsed);
        }
        let now = Instant::now();
        // A short deadline is a timer task that fires after one scheduling point of its
        // own, so the scheduler decides where, among the other tasks' steps, it falls.
        let timer = (deadline > now && deadline - now <= SHORT).then(|| {
            let timer = Arc::new(Timer::default());
            let t = timer.clone();
            drop(shuttle::future::spawn(async move {
                shuttle::future::yield_now().await;
                *t.fired.lock().unwrap_or_else(|p| p.into_inner()) = true;
                if let Some(w) = t.waker.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    w.wake();
                }
            }));
            timer
        });
        let mut fut = std::pin::pin!(fut);
        std::future::poll_fn(|cx| {
            if let Poll::Ready(v) = fut.as_mut().poll(cx) {
                return Poll::Ready(Ok(v));
            }
            let fired = match &timer {
                Some(t) => {
                    *t.waker.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
                    *t.fired.lock().unwrap_or_else(|p| p.into_inner())
                }
                None => deadline <= Instant::now(),
            };
            if fired {
                Poll::Ready(Err(Elapsed))
            } else {
                Poll::Pending
            }
        })
        .await
    }

    #[derive(Default)]
    struct Timer {
        fired: Mutex<bool>,
        waker: Mutex<Option<Waker>>,
    }

    pub(crate) async fn timeout<F: Future>(bound: Duration, fut: F) -> Result<F::Output, Elapsed> {
        match Instant::now().checked_add(bound) {
            Some(deadline) => timeout_at(deadline, fut).await,
            None => Ok(fut.await),
        }
    }
}
