//! PostgreSQL push: one LISTEN connection per store fans NOTIFY messages out to the
//! contenders that subscribed.
//!
//! Releases, new acquisitions and holds are notified once their UPDATE has committed
//! (`super::Notifier`: not in the same transaction, which would serialize commits). Payloads are
//! `R\n{mutex}\n{releaser}` and `A\n{mutex}\n{new owner}`; mutex names and contender ids
//! cannot contain a newline (they are validated).
//!
//! Notifications are lost while the LISTEN connection is down, so after every successful
//! (re)connect every subscriber gets [`StoreEvent::Resync`] and re-reads the owner.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use simba_core::backend::StoreEvent;
use simba_core::events::EventSender;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{MissedTickBehavior, interval_at, sleep, timeout};
use tokio_postgres::AsyncMessage;

use super::{ConnectError, Connector};
use tracing::{debug, info, warn};

/// How often the LISTEN connection is checked when no notification arrives.
const HEARTBEAT: Duration = Duration::from_secs(2);
/// First and longest pause between reconnect attempts.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

struct Sub {
    contender: String,
    tx: EventSender,
    /// Set once the subscriber contends: its gate wakes it then (one waiter per release),
    /// so it hears nothing more from here.
    contending: Arc<AtomicBool>,
}

impl Sub {
    fn listens(&self) -> bool {
        !self.tx.is_closed() && !self.contending.load(Ordering::Relaxed)
    }
}

/// What the store does when it hears a release (pokes the mutex's gate).
pub(crate) type OnRelease = Box<dyn Fn(&str) + Send + Sync>;

/// Subscribers by mutex name.
#[derive(Default)]
struct Hub {
    subs: StdMutex<HashMap<String, Vec<Sub>>>,
    /// Told of every release heard (see [`Listener::on_release`]).
    on_release: std::sync::OnceLock<OnRelease>,
}

impl Hub {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<Sub>>> {
        self.subs.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, mutex: &str, contender: &str, tx: EventSender, contending: Arc<AtomicBool>) {
        let mut subs = self.lock();
        let list = subs.entry(mutex.to_owned()).or_default();
        list.retain(Sub::listens);
        list.push(Sub {
            contender: contender.to_owned(),
            tx,
            contending,
        });
    }

    /// Sends `event` to the subscribers of `mutex` other than `actor`.
    fn dispatch(&self, mutex: &str, actor: &str, event: &StoreEvent) {
        let mut subs = self.lock();
        let Some(list) = subs.get_mut(mutex) else {
            return;
        };
        list.retain(Sub::listens);
        for s in list.iter().filter(|s| s.contender != actor) {
            let _ = s.tx.try_send(event.clone());
        }
        if list.is_empty() {
            subs.remove(mutex);
        }
    }

    /// Tells every subscriber that messages may have been lost.
    fn resync_all(&self) {
        let mut subs = self.lock();
        subs.retain(|_, list| {
            list.retain(Sub::listens);
            for s in list.iter() {
                let _ = s.tx.try_send(StoreEvent::Resync);
            }
            !list.is_empty()
        });
    }

    fn handle(&self, payload: &str) {
        let mut parts = payload.splitn(3, '\n');
        let (Some(kind), Some(mutex), Some(actor)) = (parts.next(), parts.next(), parts.next())
        else {
            debug!(payload, "ignoring a malformed notification");
            return;
        };
        match kind {
            "R" => {
                self.dispatch(mutex, actor, &StoreEvent::Released);
                if let Some(f) = self.on_release.get() {
                    f(mutex);
                }
            }
            "A" => self.dispatch(
                mutex,
                actor,
                &StoreEvent::Acquired {
                    owner_id: actor.to_owned(),
                },
            ),
            _ => debug!(payload, "ignoring an unknown notification"),
        }
    }
}

/// Formats the payload of a release notification.
pub(crate) fn released_payload(mutex: &str, contender: &str) -> String {
    format!("R\n{mutex}\n{contender}")
}

/// Formats the payload of an acquisition notification.
pub(crate) fn acquired_payload(mutex: &str, contender: &str) -> String {
    format!("A\n{mutex}\n{contender}")
}

/// Aborts a task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The LISTEN side of a PostgreSQL store; started by the first subscription.
pub(crate) struct Listener {
    hub: Arc<Hub>,
    pg: Arc<Connector>,
    channel: String,
    timeout: Duration,
    task: StdMutex<Option<JoinHandle<()>>>,
}

impl Listener {
    pub(crate) fn new(pg: Arc<Connector>, channel: String, timeout: Duration) -> Self {
        Listener {
            hub: Arc::default(),
            pg,
            channel,
            timeout,
            task: StdMutex::new(None),
        }
    }

    /// Sets what the store does with every release heard: its gates poke a wait beyond the
    /// cap on native waits (`crate::native::MAX_NATIVE_WAITS`), which has no session on the
    /// server's queue to be woken by. Set once; later calls are ignored.
    pub(crate) fn on_release(&self, f: OnRelease) {
        let _ = self.hub.on_release.set(f);
    }

    /// Registers `contender` for events about `mutex` (on `tx`, until `contending` is set)
    /// and makes sure the listener runs (it also pokes the gates of waits beyond the cap).
    /// A subscriber that contends already would never hear from here: it is not kept (a
    /// process holding 10,000 mutexes kept an entry for each, about 3 MiB).
    pub(crate) fn subscribe(
        &self,
        mutex: &str,
        contender: &str,
        tx: EventSender,
        contending: Arc<AtomicBool>,
    ) {
        if !contending.load(Ordering::Relaxed) {
            self.hub.add(mutex, contender, tx, contending);
        }
        let mut task = self.task.lock().unwrap_or_else(|p| p.into_inner());
        if task.as_ref().is_none_or(JoinHandle::is_finished) {
            *task = Some(tokio::spawn(run(
                self.pg.clone(),
                self.channel.clone(),
                self.timeout,
                self.hub.clone(),
            )));
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(task) = self.task.get_mut().ok().and_then(Option::take) {
            task.abort();
        }
    }
}

type Notifications = mpsc::UnboundedReceiver<tokio_postgres::Notification>;

async fn connect(
    pg: &Connector,
    listen_sql: &str,
) -> Result<(tokio_postgres::Client, Notifications, AbortOnDrop), ConnectError> {
    let (client, mut connection) = pg.connect().await?;
    let (tx, rx) = mpsc::unbounded_channel();
    let driver = AbortOnDrop(tokio::spawn(async move {
        loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(n))) => {
                    if tx.send(n).is_err() {
                        break;
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    debug!("postgres LISTEN connection failed: {e}");
                    break;
                }
                None => break,
            }
        }
    }));
    client
        .batch_execute(listen_sql)
        .await
        .map_err(|source| ConnectError { tls: None, source })?;
    Ok((client, rx, driver))
}

async fn run(pg: Arc<Connector>, channel: String, bound: Duration, hub: Arc<Hub>) {
    let listen_sql = format!("LISTEN \"{channel}\"");
    let mut backoff = BACKOFF_MIN;
    let mut failures = 0u32;
    loop {
        match timeout(bound, connect(&pg, &listen_sql)).await {
            Ok(Ok((client, mut notifications, _driver))) => {
                if failures > 0 {
                    info!(%channel, "postgres LISTEN connection restored");
                }
                failures = 0;
                backoff = BACKOFF_MIN;
                // Anything sent while we were not listening is lost: everyone looks again.
                hub.resync_all();
                let mut beat = interval_at(tokio::time::Instant::now() + HEARTBEAT, HEARTBEAT);
                beat.set_missed_tick_behavior(MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        n = notifications.recv() => match n {
                            Some(n) => hub.handle(n.payload()),
                            None => break,
                        },
                        _ = beat.tick() => {
                            if !matches!(timeout(bound, client.simple_query("")).await, Ok(Ok(_))) {
                                break;
                            }
                        }
                    }
                }
                warn!(%channel, "postgres LISTEN connection lost; reconnecting (waiters poll meanwhile)");
            }
            Ok(Err(e)) => {
                failures += 1;
                if failures == 1 {
                    warn!(%channel, "postgres LISTEN connection failed, retrying: {e}");
                }
            }
            Err(_) => {
                failures += 1;
                if failures == 1 {
                    warn!(%channel, "postgres LISTEN connection timed out after {bound:?}, retrying");
                }
            }
        }
        sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispatch_skips_the_actor_and_other_mutexes() {
        let hub = Hub::default();
        let add = |m: &str, c: &str| {
            let (tx, rx) = simba_core::events::channel(16);
            hub.add(m, c, tx, Arc::default());
            rx
        };
        let mut a = add("m", "a");
        let mut b = add("m", "b");
        let mut other = add("n", "c");
        hub.handle(&released_payload("m", "a"));
        assert!(a.try_recv().is_err());
        assert_eq!(b.try_recv().ok(), Some(StoreEvent::Released));
        assert!(other.try_recv().is_err());
        hub.handle(&acquired_payload("m", "b"));
        assert_eq!(
            a.try_recv().ok(),
            Some(StoreEvent::Acquired {
                owner_id: "b".into()
            })
        );
        hub.handle("garbage");
        drop(b);
        hub.resync_all();
        assert_eq!(a.try_recv().ok(), Some(StoreEvent::Resync));
        assert_eq!(other.try_recv().ok(), Some(StoreEvent::Resync));
        assert_eq!(hub.lock().get("m").map(Vec::len), Some(1));
    }
}
