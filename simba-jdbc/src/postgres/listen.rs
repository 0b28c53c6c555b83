//! PostgreSQL push: one LISTEN connection per store fans NOTIFY messages out to the
//! contenders that subscribed.
//!
//! Releases, new acquisitions and holds are notified once their UPDATE has committed
//! (`super::Notifier`: not in the same transaction, which would serialize commits). Payloads are
//! `R\n{mutex}\n{releaser}` and `A\n{mutex}\n{new owner}`, and for semaphores
//! `P\n{semaphore}\n{waiter}\n{waiter}…`: the waiters a freed permit is owed to (see
//! [`permit_payload`]). Names and contender ids cannot contain a newline (they are validated).
//!
//! Notifications are lost while the LISTEN connection is down, so after every successful
//! (re)connect every subscriber gets [`StoreEvent::Resync`] and re-reads the owner (a
//! permit waiter finds a permit it missed at its next look).

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
use crate::push::{Freed, OnPermit};
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
    /// Told of every freed permit heard (see [`Listener::on_permit`]).
    on_permit: std::sync::OnceLock<OnPermit>,
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
            "P" => {
                if let Some(f) = self.on_permit.get() {
                    let owed: Vec<&str> = actor.split('\n').collect();
                    f(Freed::Owed(mutex, &owed));
                }
            }
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

/// The longest payload sent: PostgreSQL refuses one of 8,000 bytes or more.
const PAYLOAD_MAX: usize = 7_900;

/// Formats the payload that tells the listeners of other stores which waiters of
/// `semaphore` a freed permit is owed to; `None` when it is owed to nobody. Waiters beyond
/// what fits in one payload are not named: they find their permit at their next look.
pub(crate) fn permit_payload<'a>(
    semaphore: &str,
    owed: impl IntoIterator<Item = &'a str>,
) -> Option<String> {
    let mut payload = format!("P\n{semaphore}");
    let mut any = false;
    for who in owed {
        if payload.len() + 1 + who.len() > PAYLOAD_MAX {
            break;
        }
        payload.push('\n');
        payload.push_str(who);
        any = true;
    }
    any.then_some(payload)
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

    /// Sets what the store does with every freed permit heard (wakes its waiters owed one).
    /// Set once; later calls are ignored.
    pub(crate) fn on_permit(&self, f: OnPermit) {
        let _ = self.hub.on_permit.set(f);
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
        self.start();
    }

    /// Makes sure the listener runs (a permit waiter needs it: see [`Listener::on_permit`]).
    pub(crate) fn start(&self) {
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

    #[test]
    fn a_permit_payload_names_the_waiters_owed_and_fits() {
        type Heard = Vec<(String, Vec<String>)>;
        let heard: Arc<StdMutex<Heard>> = Arc::default();
        let hub = Hub::default();
        let log = heard.clone();
        let _ = hub.on_permit.set(Box::new(move |news| {
            if let Freed::Owed(s, owed) = news {
                let owed = owed.iter().map(|w| (*w).to_owned()).collect();
                log.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((s.to_owned(), owed));
            }
        }));
        assert_eq!(
            permit_payload("s", []),
            None,
            "nobody owed: nothing to send"
        );
        let payload = permit_payload("s", ["w1", "w2"]).expect("two owed");
        hub.handle(&payload);
        // A mutex's release is not a permit's.
        hub.handle(&released_payload("s", "w1"));
        let heard = heard.lock().unwrap_or_else(|p| p.into_inner()).clone();
        assert_eq!(
            heard,
            vec![("s".to_owned(), vec!["w1".to_owned(), "w2".to_owned()])]
        );
        let many: Vec<String> = (0..2_000).map(|i| format!("waiter-{i}")).collect();
        let long = permit_payload("s", many.iter().map(String::as_str)).expect("some fit");
        assert!(long.len() <= PAYLOAD_MAX, "{} bytes", long.len());
        assert!(long.ends_with("\nwaiter-0") || long.contains("\nwaiter-0\n"));
    }
}
