//! [`EtcdContendService`]: a lease per contender, revision-ordered waiter keys,
//! predecessor watches.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, GetOptions, KvClient, LeaseClient, LeaseKeepAliveStream,
    LeaseKeeper, PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse, WatchClient,
    WatchOptions, WatchStream,
};
use simba_core::backend::{
    BoxFuture, ContendHandle, OwnershipTracker, Reporter, ServiceHandle, ServiceStatus,
    held_owner_id,
};
#[cfg(feature = "bench")]
use simba_core::hops::{self, Hop};
use simba_core::metrics::FailureKind;
use simba_core::{Contender, Error, LossReason, MutexOwner, Result};
use tokio::sync::oneshot;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::common::{
    BACKEND, bounded, call_limit, fence_key, first_key, now_micros, parse_waiter, waiter_value,
    watch_from_now,
};
use crate::config::EtcdConfig;
use crate::retrieve::{next_change, seen_owner};

/// After this many immediate re-checks in a row, wait a retry interval before the next.
const MAX_RECHECKS: u32 = 10;

/// Puts of the waiter key tried in one check while other contenders' puts move the fence
/// key under them.
const MAX_PUTS: u32 = 16;

/// A release with a hold, asked by [`ContendHandle::stop_holding_until`] and applied by the
/// driver's shutdown.
struct HoldRequest {
    until: Instant,
    reply: oneshot::Sender<Result<()>>,
}

struct Shared {
    client: Client,
    config: Arc<EtcdConfig>,
    mutex: String,
    contender_id: String,
    /// `{prefix}/{mutex}/`: the waiter keys live below it.
    prefix: String,
    /// `{prefix}/{mutex}`: the last fence given ([`fence_key`]).
    fence_key: Vec<u8>,
    /// The fence key's value and mod revision last seen (`(0, 0)`: absent), kept across
    /// runs so that a restarted service's put usually needs no second try.
    last_fence: StdMutex<(u64, i64)>,
    hold: StdMutex<Option<HoldRequest>>,
}

/// A contend service on etcd.
///
/// - While it runs, the contender has **one lease** of [`EtcdConfig::lease_ttl`], kept
///   alive every third of it, and **one waiter key** `{prefix}/{mutex}/{lease id}` put
///   with that lease, holding its fence and the contender id. The key with the **lowest
///   create revision** owns; each waiter watches only its predecessor's key (no herd).
/// - The **fence** is given when the waiter key is put, in the same transaction: the
///   greater of the mutex's last fence (kept in the key `{prefix}/{mutex}`, whose mod
///   revision the transaction compares) plus one and this machine's clock in
///   microseconds. Fences so follow the keys' create revisions (the queue order), and a
///   cluster rebuilt empty or restored from an older snapshot still gives greater ones
///   (the crate README states the clock assumption).
/// - Every renewal (each answered keep-alive) is followed by a transaction that compares
///   the key's create revision, so an owner whose key was deleted learns it within a third
///   of the lease.
/// - The **local deadline** is the send time of the last keep-alive answered with a
///   positive TTL, plus that TTL, minus the drift margin (the crate README says why that
///   is safe). When it passes without a newer answer, the owner reports
///   [`LossReason::LeaseExpired`] without waiting for the server, revokes the old lease
///   once it can, and contends again with a new lease and key (a new fence).
/// - `stop` revokes the lease, which deletes the key: the next waiter's watch fires.
/// - A release with a hold moves the key to a lease of its own whose TTL ends at the
///   instant asked for (rounded up to whole seconds, on the server's clock).
pub struct EtcdContendService {
    shared: Arc<Shared>,
    handle: ServiceHandle,
}

impl fmt::Debug for EtcdContendService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdContendService")
            .field("prefix", &self.shared.prefix)
            .field("service", &self.handle)
            .finish()
    }
}

impl EtcdContendService {
    pub(crate) fn new(
        client: Client,
        config: Arc<EtcdConfig>,
        mutex: String,
        contender_id: String,
        prefix: String,
        contender: Arc<dyn Contender>,
    ) -> Self {
        let out = ServiceStatus::new(Reporter::Contender(contender)).with_identity(
            BACKEND,
            &mutex,
            &contender_id,
            config.metrics_mutex_label,
        );
        let shared = Arc::new(Shared {
            client,
            config,
            mutex,
            contender_id,
            fence_key: fence_key(&prefix),
            last_fence: StdMutex::new((0, 0)),
            prefix,
            hold: StdMutex::new(None),
        });
        let driver = shared.clone();
        let handle = ServiceHandle::new(out, move |tracker, stop| {
            let run = Run::new(driver.clone(), tracker);
            Box::pin(run.run(stop))
        });
        EtcdContendService { shared, handle }
    }

    /// The key prefix of this mutex's waiter keys.
    pub fn prefix(&self) -> &str {
        &self.shared.prefix
    }
}

impl ContendHandle for EtcdContendService {
    fn handle(&self) -> &ServiceHandle {
        &self.handle
    }

    fn stop_holding_until(&self, until: Instant) -> BoxFuture<'_, Result<()>> {
        let (reply, answer) = oneshot::channel();
        *lock(&self.shared.hold) = Some(HoldRequest { until, reply });
        let stop = self.handle.stop();
        Box::pin(async move {
            stop.await?;
            // A driver that ran took the request; one left here found no run.
            if lock(&self.shared.hold).take().is_some() {
                return Err(Error::Shutdown {
                    mutex: self.shared.mutex.clone(),
                });
            }
            answer.await.unwrap_or_else(|_| {
                Err(Error::Shutdown {
                    mutex: self.shared.mutex.clone(),
                })
            })
        })
    }
}

fn lock<T>(m: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The contender's lease and its keep-alive stream.
struct Lease {
    id: i64,
    ttl: Duration,
    keeper: Option<LeaseKeeper>,
    stream: Option<LeaseKeepAliveStream>,
    /// Send times of the keep-alives not answered yet, oldest first (answers come in order
    /// on one stream).
    sent: VecDeque<Instant>,
    /// The send time of the last answered keep-alive (or grant) plus the TTL it answered:
    /// the lease cannot end before this.
    good_until: Instant,
}

/// This contender's waiter key.
#[derive(Clone)]
struct MyKey {
    key: Vec<u8>,
    revision: i64,
    /// The fence it holds.
    fence: u64,
}

/// The outcome of a check that did not fail.
enum Step {
    /// Decided: owner, or waiting on the predecessor's watch.
    Settled,
    /// Something changed under the check: check again now.
    Recheck,
}

struct Run {
    sh: Arc<Shared>,
    tracker: OwnershipTracker,
    kv: KvClient,
    leases: LeaseClient,
    watches: WatchClient,
    lease: Option<Lease>,
    key: Option<MyKey>,
    /// The watch on the predecessor's key (waiters only).
    watch: Option<WatchStream>,
    /// Leases of given-up ownerships, revoked (which deletes their keys) before anything else.
    stale: Vec<i64>,
    /// A check is due now.
    due: bool,
    retry_at: Option<Instant>,
    rechecks: u32,
    failures: u32,
    /// The watched key is the owner's: its deletion starts a handoff.
    predecessor_owns: bool,
    /// The key is the lowest but the lease's last answer is too old: own once a
    /// keep-alive is answered.
    confirm_before_owning: bool,
}

impl Run {
    fn new(sh: Arc<Shared>, tracker: OwnershipTracker) -> Self {
        let kv = sh.client.kv_client();
        let leases = sh.client.lease_client();
        let watches = sh.client.watch_client();
        Run {
            sh,
            tracker,
            kv,
            leases,
            watches,
            lease: None,
            key: None,
            watch: None,
            stale: Vec::new(),
            due: true,
            retry_at: None,
            rechecks: 0,
            failures: 0,
            predecessor_owns: false,
            confirm_before_owning: false,
        }
    }

    fn config(&self) -> &EtcdConfig {
        &self.sh.config
    }

    fn limit(&self) -> Duration {
        call_limit(self.config().lease_ttl)
    }

    fn retry(&self) -> Duration {
        (self.config().lease_ttl / 8).clamp(Duration::from_millis(100), Duration::from_secs(1))
    }

    /// The local deadline of the ownership: the lease's `good_until` minus the margin.
    fn deadline(&self) -> Option<Instant> {
        if !self.tracker.is_held() {
            return None;
        }
        self.lease.as_ref().map(|l| {
            l.good_until
                .checked_sub(self.config().drift_margin)
                .unwrap_or(l.good_until)
        })
    }

    async fn run(mut self, stop: CancellationToken) {
        let every = (self.config().lease_ttl / 3).max(Duration::from_millis(200));
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let deadline = self.deadline();
            if self.due {
                let step = tokio::select! {
                    biased;
                    () = stop.cancelled() => break,
                    () = sleep_opt(deadline) => { self.expire(); continue; }
                    r = self.check() => r,
                };
                self.after_check(step);
                continue;
            }
            let retry_at = self.retry_at;
            tokio::select! {
                biased;
                () = stop.cancelled() => break,
                () = sleep_opt(deadline) => self.expire(),
                r = next_keepalive(&mut self.lease) => self.on_keepalive(r),
                r = next_watch(&mut self.watch, &self.sh.prefix) => self.on_watch(r),
                _ = tick.tick() => self.send_keepalive().await,
                () = sleep_opt(retry_at) => {
                    self.retry_at = None;
                    self.due = true;
                }
            }
        }
        self.shutdown().await;
    }

    fn after_check(&mut self, step: Result<Step>) {
        match step {
            Ok(Step::Settled) => {
                self.due = false;
                self.rechecks = 0;
                self.failures = 0;
                self.tracker.count_attempt(None);
            }
            Ok(Step::Recheck) => {
                self.rechecks += 1;
                if self.rechecks > MAX_RECHECKS {
                    self.rechecks = 0;
                    self.due = false;
                    self.retry_at = Some(Instant::now() + self.retry());
                }
            }
            Err(e) => {
                self.rechecks = 0;
                self.failures += 1;
                self.due = false;
                self.retry_at = Some(Instant::now() + self.retry());
                if self.tracker.is_held() {
                    self.tracker.mark_suspect(&"an etcd call failed");
                }
                if self.failures == 1 {
                    let mut cause = String::new();
                    let mut next = std::error::Error::source(&e);
                    while let Some(c) = next {
                        cause.push_str(": ");
                        cause.push_str(&c.to_string());
                        next = c.source();
                    }
                    warn!("contending failed, retrying: {e}{cause}");
                } else {
                    debug!("contending failed again: {e}");
                }
                self.tracker
                    .count_failure(FailureKind::of(&e), e.to_string());
            }
        }
    }

    /// The deadline passed with no newer keep-alive answered: the lease may end any moment.
    fn expire(&mut self) {
        warn!("no keep-alive answered in time: giving up ownership before the etcd lease can end");
        self.tracker
            .lose(LossReason::LeaseExpired, MutexOwner::NONE);
        self.drop_lease();
        self.due = true;
    }

    /// Forgets the lease and key (the lease is revoked at the next check).
    fn drop_lease(&mut self) {
        if let Some(l) = self.lease.take() {
            self.stale.push(l.id);
        }
        self.key = None;
        self.watch = None;
        self.predecessor_owns = false;
        self.confirm_before_owning = false;
    }

    /// The lease is gone on the server (keep-alive answered TTL 0, or "lease not found").
    fn lease_gone(&mut self) {
        if self.tracker.is_held() {
            warn!("the etcd lease ended: ownership lost");
        }
        self.tracker
            .lose(LossReason::LeaseExpired, MutexOwner::NONE);
        self.lease = None;
        self.key = None;
        self.watch = None;
        self.predecessor_owns = false;
        self.confirm_before_owning = false;
        self.due = true;
    }

    async fn send_keepalive(&mut self) {
        let held = self.tracker.is_held();
        let Some(lease) = self.lease.as_mut() else {
            return;
        };
        let Some(keeper) = lease.keeper.as_mut() else {
            // The stream broke: the check opens a new one.
            self.due = true;
            return;
        };
        if !lease.sent.is_empty() && held {
            self.tracker
                .mark_suspect(&"a keep-alive of the etcd lease is not answered");
        }
        if lease.sent.len() >= 3 {
            // Three unanswered: the stream is stuck; open a new one.
            debug!("keep-alive stream stuck, reopening");
            lease.keeper = None;
            lease.stream = None;
            lease.sent.clear();
            self.due = true;
            return;
        }
        lease.sent.push_back(Instant::now());
        if let Err(e) = keeper.keep_alive().await {
            debug!("keep-alive send failed: {e}");
            lease.keeper = None;
            lease.stream = None;
            lease.sent.clear();
            self.due = true;
        }
    }

    fn on_keepalive(&mut self, answer: std::result::Result<i64, String>) {
        let held = self.tracker.is_held();
        let Some(lease) = self.lease.as_mut() else {
            return;
        };
        match answer {
            Ok(ttl) if ttl > 0 => {
                let sent = lease.sent.pop_front();
                if let Some(sent) = sent {
                    let ttl = Duration::from_secs(u64::try_from(ttl).unwrap_or(0));
                    lease.good_until = lease.good_until.max(sent + ttl);
                }
                // The renewal's proof: a transaction on the key's create revision.
                if held || self.confirm_before_owning {
                    self.due = true;
                }
            }
            Ok(_) => self.lease_gone(),
            Err(why) => {
                debug!("keep-alive stream: {why}");
                lease.keeper = None;
                lease.stream = None;
                lease.sent.clear();
                if held {
                    self.tracker
                        .mark_suspect(&"the etcd keep-alive stream broke");
                }
                self.tracker
                    .count_failure(FailureKind::Disconnected, format!("{BACKEND}: {why}"));
                self.retry_at = Some(Instant::now() + self.retry());
            }
        }
    }

    fn on_watch(&mut self, change: std::result::Result<(), String>) {
        self.watch = None;
        match change {
            Ok(()) => {
                debug!("predecessor watch fired");
                if self.predecessor_owns {
                    #[cfg(feature = "bench")]
                    hops::record(Hop::WaiterWoken, &self.sh.prefix);
                    self.tracker.handoff_begins();
                }
                self.due = true;
            }
            Err(why) => {
                debug!("predecessor watch: {why}");
                self.retry_at = Some(Instant::now() + self.retry());
            }
        }
    }

    /// One pass ([`Run::check_calls`]); a pass of a contender that does not own is an
    /// acquire for `simba bench --explain` (an owner's pass is the proof of a renewal).
    async fn check(&mut self) -> Result<Step> {
        if self.tracker.is_held() {
            return self.check_calls().await;
        }
        #[cfg(feature = "bench")]
        hops::record(Hop::AcquireSent, &self.sh.prefix);
        let step = self.check_calls().await;
        #[cfg(feature = "bench")]
        hops::record(Hop::AcquireAnswered, &self.sh.prefix);
        step
    }

    /// One pass: revoke given-up leases, make sure lease, keep-alive and key exist, then
    /// in one transaction prove the key and read the owner and the predecessor; own, or
    /// watch the predecessor.
    async fn check_calls(&mut self) -> Result<Step> {
        let limit = self.limit();
        while let Some(&id) = self.stale.last() {
            match bounded("revoking an old lease", limit, self.leases.revoke(id)).await {
                Ok(_) => {}
                Err(e) if is_lease_not_found(&e) => {}
                Err(e) => return Err(e),
            }
            debug!(lease = id, "revoked the lease of a given-up ownership");
            self.stale.pop();
        }
        if self.lease.is_none() {
            self.grant().await?;
        }
        if self.lease.as_ref().is_some_and(|l| l.keeper.is_none()) {
            self.open_keepalive().await?;
            if self.lease.is_none() {
                return Ok(Step::Recheck);
            }
        }
        let key = match self.key.clone() {
            Some(k) => k,
            None => match self.create_key().await? {
                Some(k) => k,
                None => return Ok(Step::Recheck),
            },
        };
        let predecessor = GetOptions::new()
            .with_prefix()
            .with_max_create_revision(key.revision - 1)
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(1);
        let txn = Txn::new()
            .when([Compare::create_revision(
                key.key.clone(),
                CompareOp::Equal,
                key.revision,
            )])
            .and_then([
                TxnOp::get(self.sh.prefix.as_bytes(), Some(first_key())),
                TxnOp::get(self.sh.prefix.as_bytes(), Some(predecessor)),
            ]);
        let resp = bounded("checking the waiter key", limit, self.kv.txn(txn)).await?;
        if !resp.succeeded() {
            self.vanished();
            return Ok(Step::Recheck);
        }
        let revision = resp.header().map_or(0, |h| h.revision());
        let mut gets = resp.op_responses().into_iter().filter_map(|r| match r {
            TxnOpResponse::Get(g) => Some(g),
            _ => None,
        });
        let (Some(first), Some(pred)) = (gets.next(), gets.next()) else {
            return Err(Error::backend(
                BACKEND,
                "a transaction answer without its two reads",
            ));
        };
        let Some(owner_kv) = first.kvs().first() else {
            // The compare held, so the range cannot be empty: read again.
            return Ok(Step::Recheck);
        };
        if owner_kv.create_revision() == key.revision {
            return Ok(self.own(owner_kv));
        }
        if self.tracker.is_held() {
            self.tracker.lose(LossReason::TakenOver, MutexOwner::NONE);
        }
        let owner = seen_owner(&self.tracker, Some(owner_kv), self.config().lease_ttl);
        self.tracker.observe(owner);
        let Some(pred_kv) = pred.kvs().first() else {
            return Ok(Step::Recheck);
        };
        self.predecessor_owns = pred_kv.create_revision() == owner_kv.create_revision();
        self.tracker.handoff_missed();
        let pred_key = pred_kv.key().to_vec();
        let pred_revision = pred_kv.create_revision();
        let (stream, from) = watch_from_now(
            &mut self.watches,
            pred_key.clone(),
            WatchOptions::new(),
            "watching the predecessor",
            limit,
        )
        .await?;
        if from != revision {
            // Writes came between the transaction and the watch: a deletion of the
            // predecessor among them is not in the watch. Still there now, it is deleted
            // later, inside what the watch delivers.
            let now = bounded(
                "reading the predecessor",
                limit,
                self.kv
                    .get(pred_key, Some(GetOptions::new().with_keys_only())),
            )
            .await?;
            if now
                .kvs()
                .first()
                .map(etcd_client::KeyValue::create_revision)
                != Some(pred_revision)
            {
                return Ok(Step::Recheck);
            }
        }
        self.watch = Some(stream);
        Ok(Step::Settled)
    }

    async fn grant(&mut self) -> Result<()> {
        let secs = self.config().lease_secs();
        let sent = Instant::now();
        let resp = bounded(
            "granting a lease",
            self.limit(),
            self.leases.grant(secs, None),
        )
        .await?;
        let ttl = Duration::from_secs(u64::try_from(resp.ttl()).unwrap_or(0));
        if ttl.is_zero() {
            return Err(Error::backend(
                BACKEND,
                format!("lease grant answered without a TTL: {}", resp.error()),
            ));
        }
        debug!(lease = resp.id(), ?ttl, "lease granted");
        self.lease = Some(Lease {
            id: resp.id(),
            ttl,
            keeper: None,
            stream: None,
            sent: VecDeque::new(),
            good_until: sent + ttl,
        });
        Ok(())
    }

    /// Opens the keep-alive stream (its first keep-alive is answered by the call).
    async fn open_keepalive(&mut self) -> Result<()> {
        let limit = self.limit();
        let Some(lease) = self.lease.as_mut() else {
            return Ok(());
        };
        let sent = Instant::now();
        match bounded(
            "keeping the lease alive",
            limit,
            self.leases.keep_alive(lease.id),
        )
        .await
        {
            Ok((keeper, stream)) => {
                lease.good_until = lease.good_until.max(sent + lease.ttl);
                lease.keeper = Some(keeper);
                lease.stream = Some(stream);
                lease.sent.clear();
                if self.tracker.is_held() {
                    // Renewed: the next check proves the key and clears *suspect*.
                    self.due = true;
                }
                Ok(())
            }
            Err(e) if is_lease_not_found(&e) => {
                self.lease_gone();
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Puts the waiter key with the lease and its fence, or finds it when an earlier put's
    /// answer was lost. `None`: the lease is gone, or other puts kept moving the fence
    /// key: start over.
    ///
    /// The fence is `max(last fence + 1, now in µs)`, written to the fence key in the same
    /// transaction, which compares the fence key's mod revision with the one the last
    /// fence was read at: two puts never give the same fence, and a later put (a greater
    /// create revision) always gives a greater one.
    async fn create_key(&mut self) -> Result<Option<MyKey>> {
        let Some(lease) = self.lease.as_ref().map(|l| l.id) else {
            return Ok(None);
        };
        let key = format!("{}{:016x}", self.sh.prefix, lease).into_bytes();
        let fence_key = self.sh.fence_key.clone();
        for _ in 0..MAX_PUTS {
            let (last, at) = *lock(&self.sh.last_fence);
            let fence = last
                .checked_add(1)
                .ok_or_else(|| {
                    Error::backend(
                        BACKEND,
                        format!(
                            "the fence key {} holds the largest fence there is",
                            String::from_utf8_lossy(&fence_key)
                        ),
                    )
                })?
                .max(now_micros());
            // The fence key as last seen: absent, or that value at that mod revision (the
            // value too, as a cluster rebuilt empty counts its revisions again).
            let mut seen = vec![
                Compare::create_revision(key.clone(), CompareOp::Equal, 0),
                Compare::mod_revision(fence_key.clone(), CompareOp::Equal, at),
            ];
            if at != 0 {
                seen.push(Compare::value(
                    fence_key.clone(),
                    CompareOp::Equal,
                    last.to_string(),
                ));
            }
            let txn = Txn::new()
                .when(seen)
                .and_then([
                    TxnOp::put(
                        key.clone(),
                        waiter_value(fence, &self.sh.contender_id),
                        Some(PutOptions::new().with_lease(lease)),
                    ),
                    TxnOp::put(fence_key.clone(), fence.to_string(), None),
                ])
                .or_else([
                    TxnOp::get(key.clone(), None),
                    TxnOp::get(fence_key.clone(), None),
                ]);
            let resp = match bounded("putting the waiter key", self.limit(), self.kv.txn(txn)).await
            {
                Ok(r) => r,
                Err(e) if is_lease_not_found(&e) => {
                    self.lease_gone();
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
            if resp.succeeded() {
                let revision = resp.header().map_or(0, |h| h.revision());
                if revision <= 0 {
                    return Ok(None);
                }
                *lock(&self.sh.last_fence) = (fence, revision);
                return Ok(Some(self.keep_key(key, revision, fence)));
            }
            let mut gets = resp.op_responses().into_iter().filter_map(|r| match r {
                TxnOpResponse::Get(g) => Some(g),
                _ => None,
            });
            let (Some(mine), Some(fences)) = (gets.next(), gets.next()) else {
                return Err(Error::backend(
                    BACKEND,
                    "a transaction answer without its two reads",
                ));
            };
            if let Some(kv) = mine.kvs().first() {
                // An earlier put whose answer was lost.
                let (fence, _) = parse_waiter(kv);
                return Ok(Some(self.keep_key(key, kv.create_revision(), fence)));
            }
            // Another contender's put moved the fence key: try again from its value.
            let seen = match fences.kvs().first() {
                None => (0, 0),
                Some(kv) => {
                    let text = String::from_utf8_lossy(kv.value());
                    let canonical = text.parse::<u64>().ok().filter(|v| v.to_string() == text);
                    let value = canonical.ok_or_else(|| Error::Backend {
                        backend: BACKEND,
                        retryable: false,
                        source: None,
                        message: format!(
                            "the fence key {} holds `{text}`, not a fence: simba-etcd \
                                 writes only decimal numbers there; put back a number at \
                                 least the last fence given",
                            String::from_utf8_lossy(&fence_key)
                        ),
                    })?;
                    (value, kv.mod_revision())
                }
            };
            *lock(&self.sh.last_fence) = seen;
        }
        Ok(None)
    }

    fn keep_key(&mut self, key: Vec<u8>, revision: i64, fence: u64) -> MyKey {
        debug!(key = %String::from_utf8_lossy(&key), revision, fence, "waiter key in place");
        let k = MyKey {
            key,
            revision,
            fence,
        };
        self.key = Some(k.clone());
        k
    }

    /// Our key is not there any more (deleted, or its lease ended).
    fn vanished(&mut self) {
        if self.tracker.is_held() {
            warn!("the owner's key disappeared");
        }
        self.tracker.lose(LossReason::TakenOver, MutexOwner::NONE);
        self.drop_lease();
    }

    /// Our key is the lowest: own (or still own) the mutex.
    fn own(&mut self, kv: &etcd_client::KeyValue) -> Step {
        self.watch = None;
        self.predecessor_owns = false;
        let margin = self.config().drift_margin;
        let Some(good_until) = self.lease.as_ref().map(|l| l.good_until) else {
            return Step::Recheck;
        };
        let deadline = good_until.checked_sub(margin).unwrap_or(good_until);
        let fresh = Instant::now() + self.config().lease_ttl / 4;
        if !self.tracker.is_held() && deadline < fresh {
            // The last answered keep-alive is too old to own on: confirm first.
            self.confirm_before_owning = true;
            return Step::Settled;
        }
        self.confirm_before_owning = false;
        let owner = seen_owner(&self.tracker, Some(kv), self.config().lease_ttl);
        let fence = owner.fence;
        if self.tracker.hold(owner, Some(deadline)) {
            debug!(fence, "our waiter key is the lowest");
        }
        Step::Settled
    }

    /// Stop: apply a requested hold, report the release, delete the owner's key, revoke
    /// the leases.
    ///
    /// The key of an ownership held until now is deleted in a transaction on its create
    /// revision and its value (this contender's id). A key gone, re-created or rewritten
    /// (by hand: simba never rewrites it) means the ownership had ended before the
    /// release: that is reported as the loss found at the release
    /// ([`OwnershipTracker::lost_at_release`]). A call that fails proves nothing.
    async fn shutdown(mut self) {
        let owned = self.tracker.held().map(|h| h.fence);
        let mut release_key = owned.is_some();
        let mut found = None;
        let hold = lock(&self.sh.hold).take();
        if let Some(request) = hold {
            let result = self.hold_until(request.until).await;
            match &result {
                // Held: the key lives on under the hold's lease.
                Ok(true) => release_key = false,
                Ok(false) => {}
                Err(Error::Lost { reason, .. }) => {
                    found = Some(*reason);
                    release_key = false;
                }
                Err(_) => {}
            }
            let _ = request.reply.send(result.map(|_| ()));
        }
        self.tracker.lose(LossReason::Released, MutexOwner::NONE);
        let limit = self.limit();
        if release_key && let Some(key) = self.key.take() {
            #[cfg(feature = "bench")]
            hops::record(Hop::ReleaseSent, &self.sh.prefix);
            let txn = Txn::new()
                .when([
                    Compare::create_revision(key.key.clone(), CompareOp::Equal, key.revision),
                    Compare::value(
                        key.key.clone(),
                        CompareOp::Equal,
                        waiter_value(key.fence, &self.sh.contender_id),
                    ),
                ])
                .and_then([TxnOp::delete(key.key.clone(), None)]);
            let deleted = bounded("deleting the owner's key", limit, self.kv.txn(txn)).await;
            #[cfg(feature = "bench")]
            hops::record(Hop::ReleaseAnswered, &self.sh.prefix);
            match deleted {
                Ok(r) if r.succeeded() => debug!("stop: owner's key deleted"),
                Ok(_) => {
                    warn!("stop: the owner's key was gone or rewritten");
                    found = Some(LossReason::TakenOver);
                }
                Err(e) => debug!("stop: deleting the owner's key failed ({e}); revoking"),
            }
        }
        if let (Some(fence), Some(reason)) = (owned, found) {
            self.tracker.lost_at_release(fence, reason);
        }
        for id in self
            .lease
            .take()
            .map(|l| l.id)
            .into_iter()
            .chain(self.stale.drain(..))
        {
            #[cfg(feature = "bench")]
            hops::record(Hop::ReleaseSent, &self.sh.prefix);
            let revoked = bounded("revoking the lease", limit, self.leases.revoke(id)).await;
            #[cfg(feature = "bench")]
            hops::record(Hop::ReleaseAnswered, &self.sh.prefix);
            match revoked {
                Ok(_) => debug!(lease = id, "stop: lease revoked"),
                Err(e) => debug!(lease = id, "stop: revoke failed ({e}); it ends by its TTL"),
            }
        }
        self.tracker.finish();
    }

    /// Moves the owner key to a lease of its own that ends no sooner than `until`; whether
    /// it did (false: `until` had passed, nothing to hold).
    async fn hold_until(&mut self, until: Instant) -> Result<bool> {
        let lost = |reason| Error::Lost {
            mutex: self.sh.mutex.clone(),
            reason,
        };
        if !self.tracker.is_held() {
            let reason = self
                .tracker
                .last_loss()
                .map_or(LossReason::Released, |l| l.reason);
            return Err(lost(reason));
        }
        if self.deadline().is_some_and(|d| d <= Instant::now()) {
            return Err(lost(LossReason::LeaseExpired));
        }
        let Some(key) = self.key.clone() else {
            return Err(lost(LossReason::TakenOver));
        };
        let sent = Instant::now();
        let left = until.saturating_duration_since(sent);
        if left.is_zero() {
            return Ok(false);
        }
        // Whole seconds, rounded up: the leader starts the lease after `sent`.
        let secs =
            i64::try_from(left.as_secs() + u64::from(left.subsec_nanos() > 0)).unwrap_or(i64::MAX);
        let limit = self.limit();
        let grant = bounded(
            "granting the hold's lease",
            limit,
            self.leases.grant(secs, None),
        )
        .await?;
        let hold_lease = grant.id();
        let txn = Txn::new()
            .when([
                Compare::create_revision(key.key.clone(), CompareOp::Equal, key.revision),
                Compare::value(
                    key.key.clone(),
                    CompareOp::Equal,
                    waiter_value(key.fence, &self.sh.contender_id),
                ),
            ])
            .and_then([TxnOp::put(
                key.key.clone(),
                waiter_value(key.fence, &held_owner_id(&self.sh.contender_id)),
                Some(PutOptions::new().with_lease(hold_lease)),
            )]);
        match bounded(
            "moving the key to the hold's lease",
            limit,
            self.kv.txn(txn),
        )
        .await
        {
            Ok(r) if r.succeeded() => {
                debug!(secs, "held until the hold's lease ends");
                Ok(true)
            }
            Ok(_) => {
                let _ = bounded("revoking", limit, self.leases.revoke(hold_lease)).await;
                Err(lost(LossReason::TakenOver))
            }
            Err(e) => {
                let _ = bounded("revoking", limit, self.leases.revoke(hold_lease)).await;
                Err(e)
            }
        }
    }
}

fn is_lease_not_found(e: &Error) -> bool {
    e.to_string().contains("lease not found")
        || std::error::Error::source(e).is_some_and(|s| s.to_string().contains("lease not found"))
}

async fn sleep_opt(at: Option<Instant>) {
    match at {
        Some(at) => sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The next keep-alive answer's TTL, or why the stream ended; pending without a stream.
async fn next_keepalive(lease: &mut Option<Lease>) -> std::result::Result<i64, String> {
    let Some(stream) = lease.as_mut().and_then(|l| l.stream.as_mut()) else {
        return std::future::pending().await;
    };
    match stream.message().await {
        Ok(Some(resp)) => Ok(resp.ttl()),
        Ok(None) => Err("keep-alive stream ended".to_owned()),
        Err(e) => Err(format!("keep-alive stream failed: {e}")),
    }
}

/// The next change of the watched key, or why the watch ended; pending without a watch.
/// `prefix` names the mutex for `simba bench --explain`'s push hop.
async fn next_watch(
    watch: &mut Option<WatchStream>,
    prefix: &str,
) -> std::result::Result<(), String> {
    let change = match watch.as_mut() {
        Some(stream) => next_change(stream).await,
        None => std::future::pending().await,
    };
    #[cfg(feature = "bench")]
    if change.is_ok() {
        hops::record(Hop::PushReceived, prefix);
    }
    #[cfg(not(feature = "bench"))]
    let _ = prefix;
    change
}
