//! The channel a [`LeaseStore`](crate::backend::LeaseStore) pushes [`StoreEvent`]s on:
//! [`channel`], [`EventSender`], [`EventReceiver`].
//!
//! Every contender that subscribes keeps one for as long as it runs (owners too), so the
//! channel is small: one allocation of about 120 bytes while no event waits, the queue's
//! buffer allocated when an event is queued and freed when the receiver drained it. It
//! behaves like a bounded `tokio::sync::mpsc` channel of the same capacity: `try_send`
//! fails with [`TrySendError::Full`] or [`TrySendError::Closed`], `send` waits for room,
//! [`EventReceiver::recv`] returns `None` once every sender is gone and the queue is
//! empty, and a sender sees [`is_closed`](EventSender::is_closed) once the receiver is
//! dropped (a store drops such subscribers). Senders can be cloned.
//!
//! ```
//! use simba_core::backend::StoreEvent;
//! use simba_core::events::{TryRecvError, TrySendError, channel};
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let (tx, mut rx) = channel(1);
//! tx.try_send(StoreEvent::Released).unwrap();
//! assert!(matches!(tx.try_send(StoreEvent::Resync), Err(TrySendError::Full(_))));
//! assert_eq!(rx.recv().await, Some(StoreEvent::Released));
//! assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
//! drop(tx);
//! assert_eq!(rx.recv().await, None);
//! # });
//! ```

use std::collections::VecDeque;
use std::fmt;
use std::future::poll_fn;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use crate::store::StoreEvent;

/// A new channel that queues at most `capacity` events (at least one: a capacity of 0 is
/// taken as 1).
pub fn channel(capacity: usize) -> (EventSender, EventReceiver) {
    let shared = Arc::new(Shared {
        capacity: capacity.max(1),
        state: Mutex::new(State {
            queue: VecDeque::new(),
            senders: 1,
            receiver: true,
            receiver_waker: None,
            sender_wakers: Vec::new(),
        }),
    });
    (
        EventSender {
            shared: shared.clone(),
        },
        EventReceiver { shared },
    )
}

struct Shared {
    capacity: usize,
    state: Mutex<State>,
}

struct State {
    /// Empty and unallocated while no event waits.
    queue: VecDeque<StoreEvent>,
    /// Live [`EventSender`]s.
    senders: usize,
    /// Whether the [`EventReceiver`] is alive.
    receiver: bool,
    /// The task waiting in [`EventReceiver::recv`].
    receiver_waker: Option<Waker>,
    /// Tasks waiting in [`EventSender::send`] for room (rare: stores use `try_send`).
    sender_wakers: Vec<Waker>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while the lock is held but an allocation failure; the state is
        // consistent after every statement.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Why [`EventSender::try_send`] did not queue an event; it carries the event back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrySendError {
    /// The queue holds `capacity` events already.
    Full(StoreEvent),
    /// The receiver is gone.
    Closed(StoreEvent),
}

impl fmt::Display for TrySendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TrySendError::Full(_) => "the event channel is full",
            TrySendError::Closed(_) => "the event channel's receiver is gone",
        })
    }
}

impl std::error::Error for TrySendError {}

/// [`EventSender::send`] failed: the receiver is gone. It carries the event back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendError(pub StoreEvent);

impl fmt::Display for SendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the event channel's receiver is gone")
    }
}

impl std::error::Error for SendError {}

/// Why [`EventReceiver::try_recv`] returned no event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TryRecvError {
    /// No event queued; senders remain.
    Empty,
    /// No event queued and every sender is gone.
    Disconnected,
}

impl fmt::Display for TryRecvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TryRecvError::Empty => "no event queued",
            TryRecvError::Disconnected => "no event queued and every sender is gone",
        })
    }
}

impl std::error::Error for TryRecvError {}

/// The store's end of a [`channel`]. Cloning adds a sender; the receiver sees the channel
/// closed when the last one is dropped.
pub struct EventSender {
    shared: Arc<Shared>,
}

impl EventSender {
    /// Queues `event` if there is room, and wakes the receiver.
    ///
    /// # Errors
    /// [`TrySendError::Full`] when `capacity` events are queued, [`TrySendError::Closed`]
    /// when the receiver is gone; both give the event back.
    pub fn try_send(&self, event: StoreEvent) -> Result<(), TrySendError> {
        let waker = {
            let mut state = self.shared.lock();
            if !state.receiver {
                return Err(TrySendError::Closed(event));
            }
            if state.queue.len() >= self.shared.capacity {
                return Err(TrySendError::Full(event));
            }
            state.queue.push_back(event);
            state.receiver_waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        Ok(())
    }

    /// Queues `event`, waiting for room while the queue is full.
    ///
    /// Dropping the future before it completes leaves the event unsent.
    ///
    /// # Errors
    /// [`SendError`] (with the event) when the receiver is gone.
    pub async fn send(&self, mut event: StoreEvent) -> Result<(), SendError> {
        loop {
            match self.try_send(event) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Closed(e)) => return Err(SendError(e)),
                Err(TrySendError::Full(e)) => event = e,
            }
            poll_fn(|cx| self.poll_room(cx)).await;
        }
    }

    /// Ready when the queue has room or the receiver is gone; otherwise registers to be
    /// woken when the receiver takes an event or goes (under the lock that `try_send`
    /// checks under, so no wake-up falls between the two).
    fn poll_room(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut state = self.shared.lock();
        if !state.receiver || state.queue.len() < self.shared.capacity {
            return Poll::Ready(());
        }
        if !state.sender_wakers.iter().any(|w| w.will_wake(cx.waker())) {
            state.sender_wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Whether the receiver is gone (events sent from now on fail with `Closed`).
    pub fn is_closed(&self) -> bool {
        !self.shared.lock().receiver
    }
}

impl Clone for EventSender {
    fn clone(&self) -> Self {
        self.shared.lock().senders += 1;
        EventSender {
            shared: self.shared.clone(),
        }
    }
}

impl Drop for EventSender {
    fn drop(&mut self) {
        let waker = {
            let mut state = self.shared.lock();
            state.senders -= 1;
            if state.senders == 0 {
                state.receiver_waker.take()
            } else {
                None
            }
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl fmt::Debug for EventSender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventSender")
            .field("closed", &self.is_closed())
            .finish_non_exhaustive()
    }
}

/// The subscriber's end of a [`channel`]. Dropping it closes the channel for the senders
/// and drops the events still queued.
pub struct EventReceiver {
    shared: Arc<Shared>,
}

impl EventReceiver {
    /// The next event, waiting for one; `None` once every sender is gone and no event is
    /// left. Cancel-safe: dropping the future loses no event.
    pub async fn recv(&mut self) -> Option<StoreEvent> {
        poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// Polls for the next event (see [`recv`](Self::recv)).
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<StoreEvent>> {
        let (event, wakers) = {
            let mut state = self.shared.lock();
            match Self::take(&mut state) {
                Ok(taken) => taken,
                Err(TryRecvError::Disconnected) => return Poll::Ready(None),
                Err(TryRecvError::Empty) => {
                    // Registered under the lock every sender queues under: an event sent
                    // after the check above finds this waker.
                    if !state
                        .receiver_waker
                        .as_ref()
                        .is_some_and(|w| w.will_wake(cx.waker()))
                    {
                        state.receiver_waker = Some(cx.waker().clone());
                    }
                    return Poll::Pending;
                }
            }
        };
        wakers.into_iter().for_each(Waker::wake);
        Poll::Ready(Some(event))
    }

    /// The next event if one is queued.
    ///
    /// # Errors
    /// [`TryRecvError::Empty`] when none is queued, [`TryRecvError::Disconnected`] when
    /// none is queued and every sender is gone.
    pub fn try_recv(&mut self) -> Result<StoreEvent, TryRecvError> {
        let (event, wakers) = Self::take(&mut self.shared.lock())?;
        wakers.into_iter().for_each(Waker::wake);
        Ok(event)
    }

    /// Takes the first event, freeing the queue's buffer when it is left empty, and the
    /// senders waiting for room (to be woken after the lock is let go).
    fn take(state: &mut State) -> Result<(StoreEvent, Vec<Waker>), TryRecvError> {
        match state.queue.pop_front() {
            Some(event) => {
                if state.queue.is_empty() {
                    state.queue = VecDeque::new();
                }
                Ok((event, std::mem::take(&mut state.sender_wakers)))
            }
            None if state.senders == 0 => Err(TryRecvError::Disconnected),
            None => Err(TryRecvError::Empty),
        }
    }
}

impl Drop for EventReceiver {
    fn drop(&mut self) {
        let (queue, wakers) = {
            let mut state = self.shared.lock();
            state.receiver = false;
            state.receiver_waker = None;
            (
                std::mem::take(&mut state.queue),
                std::mem::take(&mut state.sender_wakers),
            )
        };
        drop(queue);
        wakers.into_iter().for_each(Waker::wake);
    }
}

impl fmt::Debug for EventReceiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.shared.lock();
        f.debug_struct("EventReceiver")
            .field("queued", &state.queue.len())
            .field("senders", &state.senders)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;
    use std::time::Duration;

    use super::*;

    /// A waker that counts its wake-ups.
    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counting() -> (Arc<Count>, Waker) {
        let count = Arc::new(Count::default());
        (count.clone(), Waker::from(count))
    }

    fn acquired(id: &str) -> StoreEvent {
        StoreEvent::Acquired {
            owner_id: id.to_owned(),
        }
    }

    #[test]
    fn keeps_order_and_capacity() {
        let (tx, mut rx) = channel(2);
        tx.try_send(acquired("a")).unwrap();
        tx.try_send(StoreEvent::Released).unwrap();
        assert_eq!(
            tx.try_send(StoreEvent::Resync),
            Err(TrySendError::Full(StoreEvent::Resync))
        );
        assert_eq!(rx.try_recv(), Ok(acquired("a")));
        tx.try_send(StoreEvent::Resync).unwrap();
        assert_eq!(rx.try_recv(), Ok(StoreEvent::Released));
        assert_eq!(rx.try_recv(), Ok(StoreEvent::Resync));
        assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
    }

    #[test]
    fn zero_capacity_holds_one() {
        let (tx, mut rx) = channel(0);
        tx.try_send(StoreEvent::Released).unwrap();
        assert!(matches!(
            tx.try_send(StoreEvent::Released),
            Err(TrySendError::Full(_))
        ));
        assert_eq!(rx.try_recv(), Ok(StoreEvent::Released));
    }

    #[test]
    fn frees_the_buffer_when_drained() {
        let (tx, mut rx) = channel(4);
        assert_eq!(rx.shared.lock().queue.capacity(), 0);
        tx.try_send(StoreEvent::Released).unwrap();
        tx.try_send(StoreEvent::Resync).unwrap();
        assert!(rx.shared.lock().queue.capacity() > 0);
        rx.try_recv().unwrap();
        assert!(
            rx.shared.lock().queue.capacity() > 0,
            "one event still queued"
        );
        rx.try_recv().unwrap();
        assert_eq!(rx.shared.lock().queue.capacity(), 0);
    }

    #[test]
    fn a_send_wakes_the_waiting_receiver_once() {
        let (tx, mut rx) = channel(4);
        let (count, waker) = counting();
        let mut cx = Context::from_waker(&waker);
        assert_eq!(rx.poll_recv(&mut cx), Poll::Pending);
        // Polled again by the same task: registered once.
        assert_eq!(rx.poll_recv(&mut cx), Poll::Pending);
        tx.try_send(StoreEvent::Released).unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        tx.try_send(StoreEvent::Resync).unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken already");
        assert_eq!(
            rx.poll_recv(&mut cx),
            Poll::Ready(Some(StoreEvent::Released))
        );
        assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(Some(StoreEvent::Resync)));
    }

    #[test]
    fn no_wake_up_lost_between_try_recv_and_recv() {
        // The driver's pattern: try_recv finds nothing, an event is sent, then recv is
        // polled: it finds the event without a wake-up.
        let (tx, mut rx) = channel(4);
        let (count, waker) = counting();
        let mut cx = Context::from_waker(&waker);
        assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
        tx.try_send(StoreEvent::Released).unwrap();
        assert_eq!(
            rx.poll_recv(&mut cx),
            Poll::Ready(Some(StoreEvent::Released))
        );
        // Registered, then sent: woken.
        assert_eq!(rx.poll_recv(&mut cx), Poll::Pending);
        tx.try_send(StoreEvent::Resync).unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn last_sender_gone_ends_the_receiver_after_the_queue() {
        let (tx, mut rx) = channel(4);
        let tx2 = tx.clone();
        let (count, waker) = counting();
        let mut cx = Context::from_waker(&waker);
        tx.try_send(StoreEvent::Released).unwrap();
        drop(tx);
        assert_eq!(
            rx.poll_recv(&mut cx),
            Poll::Ready(Some(StoreEvent::Released))
        );
        assert_eq!(rx.poll_recv(&mut cx), Poll::Pending, "a sender remains");
        drop(tx2);
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "the last drop wakes");
        assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(None));
        assert_eq!(rx.try_recv(), Err(TryRecvError::Disconnected));
    }

    #[test]
    fn receiver_gone_closes_the_senders() {
        let (tx, rx) = channel(4);
        let tx2 = tx.clone();
        tx.try_send(StoreEvent::Released).unwrap();
        assert!(!tx.is_closed());
        drop(rx);
        assert!(tx.is_closed() && tx2.is_closed());
        assert_eq!(
            tx2.try_send(StoreEvent::Resync),
            Err(TrySendError::Closed(StoreEvent::Resync))
        );
        assert_eq!(
            tx.shared.lock().queue.capacity(),
            0,
            "queued events dropped"
        );
    }

    #[test]
    fn receiver_drop_lets_go_of_its_waker() {
        let (tx, mut rx) = channel(4);
        let (count, waker) = counting();
        assert_eq!(
            rx.poll_recv(&mut Context::from_waker(&waker)),
            Poll::Pending
        );
        drop(waker);
        assert_eq!(Arc::strong_count(&count), 2);
        drop(rx);
        assert_eq!(Arc::strong_count(&count), 1);
        drop(tx);
    }

    #[tokio::test]
    async fn recv_wakes_on_send_from_another_task() {
        let (tx, mut rx) = channel(4);
        let task = tokio::spawn(async move { rx.recv().await });
        tokio::task::yield_now().await;
        tx.try_send(acquired("o")).unwrap();
        let got = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, Some(acquired("o")));
    }

    #[tokio::test]
    async fn send_waits_for_room() {
        let (tx, mut rx) = channel(1);
        tx.try_send(StoreEvent::Resync).unwrap();
        let sender = tx.clone();
        let task = tokio::spawn(async move { sender.send(StoreEvent::Released).await });
        tokio::task::yield_now().await;
        assert!(!task.is_finished(), "the queue is full");
        assert_eq!(rx.recv().await, Some(StoreEvent::Resync));
        let sent = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(sent, Ok(()));
        assert_eq!(rx.recv().await, Some(StoreEvent::Released));
    }

    #[tokio::test]
    async fn send_fails_when_the_receiver_goes_while_it_waits() {
        let (tx, rx) = channel(1);
        tx.try_send(StoreEvent::Resync).unwrap();
        let task = tokio::spawn(async move { tx.send(StoreEvent::Released).await });
        tokio::task::yield_now().await;
        assert!(!task.is_finished(), "the queue is full");
        drop(rx);
        let sent = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(sent, Err(SendError(StoreEvent::Released)));
    }

    #[test]
    fn is_small() {
        // What every subscribed contender keeps while no event waits: one allocation of
        // the shared state.
        assert!(
            std::mem::size_of::<Shared>() + 16 <= 128,
            "{}",
            std::mem::size_of::<Shared>()
        );
    }
}
