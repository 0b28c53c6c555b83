//! One subscriber connection per store, routing pub/sub messages to contenders.
//!
//! Every contender that subscribes gets an event channel ([`simba_core::events`]) fed from three Redis channels: the
//! mutex channel `P:{M}` (`acquired@@<id>`, and `released@@<id>` when a release reached no
//! waiter or came from a JVM Simba that broadcasts it), its own channel `P:{M}:<id>`
//! (`released@@<id>`, the targeted handoff) and the handoff channel `P:{M}:@@handoff`
//! (`reserved@@<ms>:<waiter>`: a release reserved the mutex for `<waiter>` for `<ms>`). A
//! reservation that lapses without an `acquired@@` on the mutex channel (the waiter is
//! paused or died after its wake-up) becomes [`StoreEvent::Released`] for every contender
//! of the mutex here, so that a live waiter takes the turn the paused one missed instead of
//! waiting for the owner's lease to end. One loop reads fred's message broadcast and
//! routes; when that broadcast lagged or the connection was re-established, messages may
//! have been lost, so every contender gets [`StoreEvent::Resync`] (after the channels were
//! subscribed again). Channels whose contenders all went away are unsubscribed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex as StdMutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use fred::clients::SubscriberClient;
use fred::error::Error as FredError;
use fred::interfaces::{ClientLike, EventInterface, PubsubInterface};
use fred::types::config::{Options, Server};
use fred::types::{Message, Value};
use simba_core::Result;
use simba_core::backend::StoreEvent;
use simba_core::events::{self, EventReceiver, EventSender, TrySendError};
use tokio::sync::Notify;
use tokio::sync::broadcast::error::RecvError;
use tracing::{debug, trace, warn};

use crate::error::{BACKEND, backend};
use crate::keys::HANDOFF_CHANNEL_SUFFIX;
use crate::keys::SEMAPHORE_WAITER;
use crate::watchdog::Watchdog;

/// Capacity of each contender's event channel. Events are hints (the engine re-reads the
/// owner on each), so a full channel loses nothing that matters; see [`deliver`].
const EVENT_CAPACITY: usize = 16;

/// How often channels nobody listens to are unsubscribed, besides after release/leave.
const SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// How long after a reservation's announced length its lapse is acted on: the reservation
/// began on the server before the announcement arrived, so this only absorbs timer slack.
const LAPSE_MARGIN: Duration = Duration::from_millis(10);

/// How long a targeted release message entitles its contender to take a reserved mutex.
const HANDOFF_VALID: Duration = Duration::from_secs(1);

/// The longest reservation acted on (a bound on what a message can make us wait for).
const MAX_RESERVATION: Duration = Duration::from_secs(60);

/// A message of the JVM Simba format `event@@contenderId`, or simba's own handoff
/// reservation `reserved@@<ms>:<waiter>`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Notice<'a> {
    Acquired(&'a str),
    Released(&'a str),
    Reserved(Duration),
}

pub(crate) fn parse_notice(text: &str) -> Option<Notice<'_>> {
    let (event, id) = text.split_once(crate::keys::MESSAGE_SEPARATOR)?;
    match event {
        "acquired" => Some(Notice::Acquired(id)),
        "released" => Some(Notice::Released(id)),
        "reserved" => {
            let (ms, _waiter) = id.split_once(':')?;
            let ms = Duration::from_millis(ms.parse().ok()?);
            Some(Notice::Reserved(ms.min(MAX_RESERVATION)))
        }
        _ => None,
    }
}

struct Route {
    contender: String,
    tx: EventSender,
}

#[derive(Default)]
struct Routes {
    next: u64,
    routes: HashMap<u64, Route>,
    channels: HashMap<String, Vec<u64>>,
}

impl Routes {
    fn add(&mut self, contender: &str, channels: &[String], tx: EventSender) -> u64 {
        self.next += 1;
        let id = self.next;
        self.routes.insert(
            id,
            Route {
                contender: contender.to_owned(),
                tx,
            },
        );
        for ch in channels {
            self.channels.entry(ch.clone()).or_default().push(id);
        }
        id
    }

    fn remove_where(&mut self, mut dead: impl FnMut(u64, &Route) -> bool) {
        self.routes.retain(|id, r| !dead(*id, r));
        let routes = &self.routes;
        self.channels.retain(|_, ids| {
            ids.retain(|id| routes.contains_key(id));
            !ids.is_empty()
        });
    }
}

/// The subscriber side of a store.
pub(crate) struct Subscriptions {
    client: SubscriberClient,
    /// Redis Cluster: sharded pub/sub (`SSUBSCRIBE`), so that a release script's `SPUBLISH`
    /// counts the receivers of the slot's node.
    sharded: bool,
    routes: StdMutex<Routes>,
    /// Channels subscribed at the server; the lock also serialises (un)subscribe commands.
    subscribed: tokio::sync::Mutex<HashSet<String>>,
    sweep: Notify,
    watchdog: Watchdog,
    /// Handoff channels with a reservation whose lapse is awaited, each with the number of
    /// the announcement (a newer one replaces the wait).
    reservations: StdMutex<(u64, HashMap<String, u64>)>,
    /// Contender channels on which a release handed the mutex over (`released@@` targeted
    /// at that contender), with when: see [`Subscriptions::take_handoff`].
    handed: StdMutex<HashMap<String, Instant>>,
}

impl fmt::Debug for Subscriptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let routes = self.routes();
        f.debug_struct("Subscriptions")
            .field("sharded", &self.sharded)
            .field("routes", &routes.routes.len())
            .field("channels", &routes.channels.len())
            .finish()
    }
}

impl Subscriptions {
    pub(crate) fn new(client: SubscriberClient, sharded: bool, watchdog: Watchdog) -> Arc<Self> {
        Arc::new(Subscriptions {
            client,
            sharded,
            routes: StdMutex::new(Routes::default()),
            subscribed: tokio::sync::Mutex::new(HashSet::new()),
            sweep: Notify::new(),
            watchdog,
            reservations: StdMutex::new((0, HashMap::new())),
            handed: StdMutex::new(HashMap::new()),
        })
    }

    pub(crate) fn client(&self) -> &SubscriberClient {
        &self.client
    }

    fn routes(&self) -> MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Subscribes a contender to the mutex channel, its own channel and the handoff
    /// channel.
    ///
    /// The work runs in its own task, so that a caller that gives up halfway leaves the
    /// bookkeeping consistent (its receiver is then dropped and the route swept later).
    pub(crate) async fn subscribe(
        self: &Arc<Self>,
        channels: Vec<String>,
        contender: &str,
    ) -> Result<EventReceiver> {
        let this = self.clone();
        let contender = contender.to_owned();
        let task = tokio::spawn(async move {
            let (tx, rx) = events::channel(EVENT_CAPACITY);
            let mut subscribed = this.subscribed.lock().await;
            let route = this.routes().add(&contender, &channels, tx);
            let missing: Vec<String> = channels
                .iter()
                .filter(|ch| !subscribed.contains(*ch))
                .cloned()
                .collect();
            if !missing.is_empty() {
                if let Err(e) = this.subscribe_cmd(&missing).await {
                    this.routes().remove_where(|id, _| id == route);
                    return Err(backend("subscribing to the release channels", e));
                }
                subscribed.extend(missing);
            }
            Ok(rx)
        });
        task.await.map_err(|e| {
            simba_core::Error::backend_source(BACKEND, "subscribe task failed", true, e)
        })?
    }

    /// Asks the router loop to unsubscribe channels nobody listens to anymore.
    pub(crate) fn request_sweep(&self) {
        self.sweep.notify_one();
    }

    async fn subscribe_cmd(&self, channels: &[String]) -> Result<(), FredError> {
        if self.sharded {
            for group in by_slot(channels) {
                self.client.ssubscribe(group).await?;
            }
            Ok(())
        } else {
            self.client.subscribe(channels.to_vec()).await
        }
    }

    async fn unsubscribe_cmd(&self, channels: &[String]) -> Result<(), FredError> {
        if self.sharded {
            for group in by_slot(channels) {
                self.client.sunsubscribe(group).await?;
            }
            Ok(())
        } else {
            self.client.unsubscribe(channels.to_vec()).await
        }
    }

    /// Drops routes whose contender went away and unsubscribes channels left without one.
    async fn sweep(&self) {
        let mut subscribed = self.subscribed.lock().await;
        let idle: Vec<String> = {
            let mut routes = self.routes();
            routes.remove_where(|_, r| r.tx.is_closed());
            subscribed
                .iter()
                .filter(|ch| !routes.channels.contains_key(*ch))
                .cloned()
                .collect()
        };
        if idle.is_empty() {
            return;
        }
        match self.unsubscribe_cmd(&idle).await {
            Ok(()) => {
                trace!(channels = idle.len(), "unsubscribed idle channels");
                for ch in &idle {
                    subscribed.remove(ch);
                }
            }
            Err(e) => debug!("unsubscribing idle channels failed, retrying later: {e}"),
        }
    }

    /// Subscribes every channel again (after a reconnect), then tells every contender to
    /// re-read the owner.
    async fn resubscribe(&self) {
        {
            let subscribed = self.subscribed.lock().await;
            let channels: Vec<String> = subscribed.iter().cloned().collect();
            if !channels.is_empty() {
                match self.subscribe_cmd(&channels).await {
                    Ok(()) => debug!(channels = channels.len(), "resubscribed after reconnect"),
                    Err(e) => warn!("resubscribing after reconnect failed: {e}"),
                }
            }
        }
        self.resync_all();
    }

    fn resync_all(&self) {
        let routes = self.routes();
        for route in routes.routes.values() {
            deliver(route, StoreEvent::Resync);
        }
    }

    fn dispatch(self: &Arc<Self>, message: &Message) {
        let text = match &message.value {
            Value::String(s) => &**s,
            Value::Bytes(b) => match std::str::from_utf8(b) {
                Ok(s) => s,
                Err(_) => return,
            },
            _ => return,
        };
        #[cfg(feature = "bench")]
        simba_core::hops::record(simba_core::hops::Hop::PushReceived, &message.channel);
        let Some(notice) = parse_notice(text) else {
            trace!(channel = %message.channel, "ignoring message {text:?}");
            return;
        };
        match notice {
            Notice::Reserved(length) => {
                self.await_lapse(&message.channel, length);
                return;
            }
            Notice::Acquired(_) => {
                // The handoff was taken up (or the mutex taken otherwise): no lapse to act on.
                let handoff = format!("{}{HANDOFF_CHANNEL_SUFFIX}", message.channel);
                self.reservations().1.remove(&handoff);
            }
            Notice::Released(_) => {}
        }
        let routes = self.routes();
        let Some(ids) = routes.channels.get(&*message.channel) else {
            return;
        };
        // A semaphore waiter's wake-up (`P:{S}:@@sem:w:<id>`) is no mutex handoff: the
        // acquire script of a semaphore has no reservation to outrank.
        if matches!(notice, Notice::Released(_)) && !message.channel.contains(SEMAPHORE_WAITER) {
            let own = ids.iter().filter_map(|id| routes.routes.get(id)).any(|r| {
                message
                    .channel
                    .strip_suffix(&*r.contender)
                    .is_some_and(|rest| rest.ends_with(':'))
            });
            if own {
                self.handed_map()
                    .insert(message.channel.to_string(), Instant::now());
            }
        }
        for route in ids.iter().filter_map(|id| routes.routes.get(id)) {
            let event = match notice {
                // An owner needs no news of its own acquisition or release.
                Notice::Acquired(id) | Notice::Released(id) if id == route.contender => continue,
                Notice::Acquired(id) => StoreEvent::Acquired {
                    owner_id: id.to_owned(),
                },
                Notice::Released(_) | Notice::Reserved(_) => StoreEvent::Released,
            };
            deliver(route, event);
        }
    }

    fn handed_map(&self) -> MutexGuard<'_, HashMap<String, Instant>> {
        self.handed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a release handed the mutex to the contender of `channel` (its own channel)
    /// within [`HANDOFF_VALID`]; forgets it either way. Such a contender may take the free
    /// mutex over a handoff reservation for another waiter: its release came later than the
    /// reservation's (a JVM Simba takes and releases without clearing reservations, and
    /// hands over without making one).
    pub(crate) fn take_handoff(&self, channel: &str) -> bool {
        let mut handed = self.handed_map();
        let now = Instant::now();
        handed.retain(|_, at| now.duration_since(*at) < HANDOFF_VALID);
        handed.remove(channel).is_some()
    }

    fn reservations(&self) -> MutexGuard<'_, (u64, HashMap<String, u64>)> {
        self.reservations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A release reserved the mutex of `handoff` (its handoff channel) for one waiter for
    /// `length`: unless the mutex channel says `acquired@@` first, every contender of the
    /// mutex here is woken when the reservation has lapsed. The reservation itself is never
    /// extended: a waiter that does not take its turn in time loses it to whoever calls next.
    fn await_lapse(self: &Arc<Self>, handoff: &str, length: Duration) {
        let number = {
            let mut r = self.reservations();
            r.0 += 1;
            let number = r.0;
            r.1.insert(handoff.to_owned(), number);
            number
        };
        let this = Arc::downgrade(self);
        let handoff = handoff.to_owned();
        tokio::spawn(async move {
            tokio::time::sleep(length + LAPSE_MARGIN).await;
            let Some(this) = this.upgrade() else { return };
            {
                let mut r = this.reservations();
                if r.1.get(&handoff) != Some(&number) {
                    return;
                }
                r.1.remove(&handoff);
            }
            debug!(channel = %handoff, "handoff reservation lapsed untaken: waking the waiters");
            let routes = this.routes();
            if let Some(ids) = routes.channels.get(&handoff) {
                for route in ids.iter().filter_map(|id| routes.routes.get(id)) {
                    deliver(route, StoreEvent::Released);
                }
            }
        });
    }

    /// The router loop: messages, reconnects, sweeps. Ends when the client closes.
    pub(crate) async fn run(self: Arc<Self>) {
        let mut messages = self.client.message_rx();
        let mut reconnects = self.client.reconnect_rx();
        let mut sweep_timer = tokio::time::interval(SWEEP_INTERVAL);
        sweep_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                m = messages.recv() => match m {
                    Ok(m) => self.dispatch(&m),
                    Err(RecvError::Lagged(n)) => {
                        warn!("pub/sub receiver lagged, {n} messages lost: every contender re-reads");
                        self.resync_all();
                    }
                    Err(RecvError::Closed) => break,
                },
                r = reconnects.recv() => match r {
                    Ok(_) | Err(RecvError::Lagged(_)) => {
                        let this = self.clone();
                        tokio::spawn(async move { this.resubscribe().await });
                    }
                    Err(RecvError::Closed) => break,
                },
                _ = self.sweep.notified() => {
                    let this = self.clone();
                    tokio::spawn(async move { this.sweep().await });
                }
                _ = sweep_timer.tick() => {
                    let this = self.clone();
                    tokio::spawn(async move { this.sweep().await });
                }
            }
        }
        debug!("subscriber closed, router loop ends");
    }

    /// Pings the subscriber connection(s) — every node's on Cluster — one round at a time,
    /// so that a connection whose pings go unanswered is noticed (and replaced) even when
    /// no messages flow.
    pub(crate) async fn heartbeat(self: Arc<Self>, every: Duration) {
        loop {
            tokio::time::sleep(every).await;
            let targets: Vec<Option<Server>> = if self.sharded {
                self.client
                    .active_connections()
                    .into_iter()
                    .map(Some)
                    .collect()
            } else {
                vec![None]
            };
            let mut pings = tokio::task::JoinSet::new();
            for node in targets {
                let this = self.clone();
                pings.spawn(async move {
                    let client = this.client.with_options(&Options {
                        cluster_node: node,
                        ..Options::default()
                    });
                    let watch = this.watchdog.watch(&this.client);
                    let result = client.ping::<Value>(None).await;
                    watch.finish(&result);
                    if let Err(e) = result {
                        trace!("subscriber heartbeat failed: {e}");
                    }
                });
            }
            // The next round starts when this one has ended: overlapping pings would keep
            // the connection looking busy to fred's unresponsive check.
            while pings.join_next().await.is_some() {}
        }
    }
}

/// Hands an event to a contender without blocking the router loop.
fn deliver(route: &Route, event: StoreEvent) {
    match route.tx.try_send(event) {
        Ok(()) | Err(TrySendError::Closed(_)) => {}
        // `Acquired` only matters to owners, who re-read on any event: dropping it is fine.
        Err(TrySendError::Full(StoreEvent::Acquired { .. })) => {}
        Err(TrySendError::Full(event)) => {
            let tx = route.tx.clone();
            tokio::spawn(async move {
                let _ = tx.send(event).await;
            });
        }
    }
}

/// Channels grouped by Cluster hash slot (sharded commands take one slot each).
fn by_slot(channels: &[String]) -> Vec<Vec<String>> {
    let mut groups: BTreeMap<u16, Vec<String>> = BTreeMap::new();
    for ch in channels {
        groups
            .entry(fred::util::redis_keyslot(ch.as_bytes()))
            .or_default()
            .push(ch.clone());
    }
    groups.into_values().collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parses_jvm_messages() {
        assert_eq!(
            parse_notice("acquired@@1:2@h:ab"),
            Some(Notice::Acquired("1:2@h:ab"))
        );
        assert_eq!(parse_notice("released@@x"), Some(Notice::Released("x")));
        assert_eq!(parse_notice("released"), None);
        assert_eq!(
            parse_notice("reserved@@250:1:2@h:ab"),
            Some(Notice::Reserved(Duration::from_millis(250)))
        );
        assert_eq!(
            parse_notice("reserved@@99999999:w"),
            Some(Notice::Reserved(MAX_RESERVATION))
        );
        assert_eq!(parse_notice("reserved@@soon:w"), None);
        assert_eq!(parse_notice("reserved@@250"), None);
        assert_eq!(parse_notice("other@@x"), None);
    }

    #[test]
    fn groups_by_slot() {
        let chans = vec![
            "simba:{a}".to_owned(),
            "simba:{b}".to_owned(),
            "simba:{a}:c1".to_owned(),
        ];
        let groups = by_slot(&chans);
        assert_eq!(groups.len(), 2);
        assert!(
            groups
                .iter()
                .any(|g| g.len() == 2 && g.iter().all(|c| c.starts_with("simba:{a}")))
        );
    }

    #[tokio::test]
    async fn full_channels_keep_releases() {
        let (tx, mut rx) = events::channel(1);
        let route = Route {
            contender: "c".into(),
            tx,
        };
        deliver(
            &route,
            StoreEvent::Acquired {
                owner_id: "o".into(),
            },
        );
        deliver(
            &route,
            StoreEvent::Acquired {
                owner_id: "o".into(),
            },
        );
        deliver(&route, StoreEvent::Released);
        assert!(matches!(rx.recv().await, Some(StoreEvent::Acquired { .. })));
        assert_eq!(rx.recv().await, Some(StoreEvent::Released));
    }
}
