//! [`EtcdPermitStore`]: semaphores on etcd, as a [`PermitStore`], run by simba-core's one
//! lease engine through [`Semaphore`](simba_core::Semaphore).
//!
//! Layout, below the configured prefix (`%sem` is no encoded mutex name: a `%` in a name
//! is written `%25`):
//! - `{prefix}/%sem/{name}`: the permit count the holders agreed on (decimal), written
//!   by every transaction that gives a permit;
//! - `{prefix}/%sem/{name}/{contender id}` (name and id percent-encoded as mutex names
//!   are): one key per contender, holder or waiter. A holder's value is
//!   `h {fence} {acquired_at} {ttl_at} {transition_at} {lease_until}`, a line break, the
//!   contender id; a waiter's is `w {keep_until}`, a line break, the id.
//!
//! The queue order is the contender keys' **create revision**; [`admit_permit`] decides
//! every acquisition on the keys read in one snapshot, and the decision is written by one
//! transaction that compares what the decision rests on (the count key's mod revision for
//! a take; the contender's own key's mod revision, or its absence, always).
//!
//! A holder's **fence** is the revision of the transaction that made its key a holder
//! (written as `0` there, read back as the key's mod revision, and written out by the
//! first renewal). Every take compares and rewrites the count key, so takes are ordered
//! and each one's revision is greater than every earlier take's: a waiter that takes later
//! gets a greater fence than everyone before it, whenever its key was created.
//!
//! **A holder holds exactly while its key exists.** No contender judges another's permit
//! over by a clock: the times a holder writes are its own clock's and tell the others only
//! when to look again. A holder's key goes when its release deletes it or when its etcd
//! lease ends — which only the leader decides. Every take and every renewal puts the key
//! on a lease granted during that call, after the engine sent it, with a TTL of `ttl +
//! transition` rounded up to whole seconds, and revokes the key's previous lease once the
//! put succeeded; the engine's local deadline (send time + ttl + transition − drift margin)
//! therefore passes before the leader can end the key's lease, as for the mutex. A holder
//! judges only its *own* key by its own clock: past its own `transition_at` it deletes the
//! key and takes anew (a new fence), as the engine has already given the permit up.
//!
//! **Waiters** are judged by clocks, as the admission rule says: a waiter's place is kept
//! until its `keep_until` (its own clock), and another contender may drop it once that is
//! past on the other's clock. A place dropped early costs the waiter its turn, never a
//! permit too many. A waiter's key is attached to the store's *presence* lease
//! ([`EtcdConfig::lease_ttl`]), which a task of the store keeps alive: a waiter whose
//! process stops (killed, SIGSTOPped, partitioned) loses its key, and its place, when that
//! lease ends, and the deletion wakes the waiters behind it.
//!
//! Times are milliseconds since the Unix epoch on the writer's clock (etcd keeps no times
//! on keys).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex, Weak};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, DeleteOptions, EventType, GetOptions, KeyValue, PutOptions,
    SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse, WatchOptions, WatchStream,
};
use simba_core::backend::{
    AdmissionHolder, AdmissionWaiter, Lease, LeaseReply, PermitDecision, PermitHolders,
    PermitRequest, PermitStore, SemaphoreState, StoreEvent, admit_permit,
};
use simba_core::events::{self, EventReceiver, EventSender};
use simba_core::{Error, LeaseConfig, MutexOwner, Result};
use tokio::task::JoinHandle;
use tracing::debug;

use crate::common::{BACKEND, bounded, call_limit, now_millis, watch_from_now};
use crate::config::{EtcdConfig, encode_name};

/// How soon a waiter whose free permit is owed to an earlier waiter looks again (ms).
const TURN_MS: i64 = 250;

/// How many times one call reads again after the keys changed under its transaction.
const MAX_ROUNDS: usize = 16;

/// How soon a waiter looks again when a holder's `transition_at` is past on our clock
/// while its key still exists (ms): its key goes when its etcd lease ends, and the
/// deletion wakes us through the watch first; this is the backstop.
const HELD_LOOK_MS: i64 = 1000;

/// How often a semaphore's watch task checks whether anyone still listens.
const IDLE_CHECK: Duration = Duration::from_secs(5);

/// The store of etcd semaphores over one client (see the module docs of this crate's
/// README, *Semaphores*).
///
/// Cloning shares the client, the presence lease and the watches. Make one with
/// [`EtcdFactory::permit_store`](crate::EtcdFactory::permit_store), or a
/// [`Semaphore`](simba_core::Semaphore) at once with
/// [`EtcdFactory::semaphore`](crate::EtcdFactory::semaphore).
#[derive(Clone)]
pub struct EtcdPermitStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EtcdPermitStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdPermitStore")
            .field("dir", &self.inner.dir)
            .finish_non_exhaustive()
    }
}

type Listeners = Arc<StdMutex<HashMap<String, EventSender>>>;

struct Watched {
    listeners: Listeners,
    task: JoinHandle<()>,
}

/// The store's presence lease: the lease of its waiter keys.
#[derive(Clone)]
struct Presence {
    id: i64,
    /// Cleared by the keep-alive task when the lease is gone (or the task stopped).
    alive: Arc<AtomicBool>,
}

struct Inner {
    client: Client,
    config: Arc<EtcdConfig>,
    /// `{prefix}/%sem`.
    dir: String,
    presence: tokio::sync::Mutex<Option<Presence>>,
    watches: tokio::sync::Mutex<HashMap<String, Watched>>,
    /// Added to this machine's clock (ms): `0`, except in tests that play a contender
    /// whose clock is off ([`EtcdPermitStore::with_clock_offset`]).
    clock_offset_ms: i64,
}

/// A contender key, read.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Holder {
        /// `0`: the key's mod revision (the take's, not renewed since).
        fence: u64,
        acquired_at: i64,
        ttl_at: i64,
        transition_at: i64,
        /// The writer's time before which the key's etcd lease cannot end (informative:
        /// nobody decides on it).
        lease_until: i64,
    },
    Waiter {
        keep_until: i64,
    },
}

/// A contender key with what it says.
#[derive(Debug)]
struct Read {
    key: Vec<u8>,
    id: String,
    entry: Entry,
    mod_revision: i64,
    lease: i64,
}

impl Read {
    fn fence(&self) -> u64 {
        match self.entry {
            Entry::Holder { fence: 0, .. } => u64::try_from(self.mod_revision).unwrap_or(0),
            Entry::Holder { fence, .. } => fence,
            Entry::Waiter { .. } => 0,
        }
    }

    /// A holder: its key exists, so its etcd lease has not ended.
    fn holds(&self) -> bool {
        matches!(self.entry, Entry::Holder { .. })
    }

    fn owner(&self) -> Option<MutexOwner> {
        match self.entry {
            Entry::Holder {
                acquired_at,
                ttl_at,
                transition_at,
                ..
            } => Some(MutexOwner {
                owner_id: self.id.clone(),
                acquired_at,
                ttl_at,
                transition_at,
                fence: self.fence(),
            }),
            Entry::Waiter { .. } => None,
        }
    }
}

fn entry_value(entry: &Entry, id: &str) -> String {
    match entry {
        Entry::Holder {
            fence,
            acquired_at,
            ttl_at,
            transition_at,
            lease_until,
        } => format!("h {fence} {acquired_at} {ttl_at} {transition_at} {lease_until}\n{id}"),
        Entry::Waiter { keep_until } => format!("w {keep_until}\n{id}"),
    }
}

/// A contender key's value; `None` when it is not one simba-etcd writes.
fn parse_entry(value: &[u8]) -> Option<(Entry, String)> {
    let text = std::str::from_utf8(value).ok()?;
    let (head, id) = text.split_once('\n')?;
    let mut words = head.split(' ');
    let entry = match words.next()? {
        "h" => {
            let mut n = || words.next().and_then(|w| w.parse::<i64>().ok());
            let fence = n()?;
            let (acquired_at, ttl_at, transition_at, lease_until) = (n()?, n()?, n()?, n()?);
            Entry::Holder {
                fence: u64::try_from(fence).ok()?,
                acquired_at,
                ttl_at,
                transition_at,
                lease_until,
            }
        }
        "w" => Entry::Waiter {
            keep_until: words.next()?.parse().ok()?,
        },
        _ => return None,
    };
    if words.next().is_some() {
        return None;
    }
    Some((entry, id.to_owned()))
}

/// The TTL (whole seconds) of a holder key's lease for `lease`: `ttl + transition`,
/// rounded up, at least 1 s.
///
/// No margin beyond the rounding: the lease is granted after the engine sent the call, and
/// the leader sets its expiry to its own now + TTL when it applies the grant (a new leader
/// only extends it), so it cannot end before `send + ttl + transition`; the engine stops
/// believing at that minus the drift margin, which covers the clocks' rates as it does for
/// the mutex's keep-alives. etcd raises a TTL below its minimum, which only makes it later.
fn holder_lease_secs(lease: Lease) -> i64 {
    let ms = lease.ttl_ms().saturating_add(lease.transition_ms());
    ms.saturating_add(999)
        .checked_div(1000)
        .unwrap_or(i64::MAX)
        .max(1)
}

/// The lease config of permits on a store whose etcd lease is `lease_ttl`: a permit lease
/// (ttl + transition) of that length, ttl two thirds, other settings as
/// [`LeaseConfig::default`].
pub(crate) fn lease_config(lease_ttl: Duration) -> LeaseConfig {
    let total = u64::try_from(lease_ttl.as_millis()).unwrap_or(u64::MAX);
    let ttl = total * 2 / 3;
    LeaseConfig::with_lease(
        Duration::from_millis(ttl),
        Duration::from_millis(total - ttl),
    )
}

fn is_lease_not_found(e: &Error) -> bool {
    let mut text = e.to_string();
    if let Some(s) = std::error::Error::source(e) {
        text.push_str(&s.to_string());
    }
    text.contains("lease not found")
}

/// What a round of a call came to.
enum Round<T> {
    Done(T),
    /// The keys changed under the round's transaction: read again.
    Again,
}

impl EtcdPermitStore {
    pub(crate) fn new(client: Client, config: Arc<EtcdConfig>) -> Self {
        Self::with_offset(client, config, 0)
    }

    fn with_offset(client: Client, config: Arc<EtcdConfig>, clock_offset_ms: i64) -> Self {
        let dir = format!("{}/%sem", config.prefix.trim_end_matches('/'));
        EtcdPermitStore {
            inner: Arc::new(Inner {
                client,
                config,
                dir,
                presence: tokio::sync::Mutex::new(None),
                watches: tokio::sync::Mutex::new(HashMap::new()),
                clock_offset_ms,
            }),
        }
    }

    /// A store on the same client and settings whose clock reads `offset_ms` later than
    /// this machine's (earlier when negative), with a presence lease and watches of its
    /// own: a contender on a host whose clock is off. For tests only.
    #[doc(hidden)]
    #[must_use]
    pub fn with_clock_offset(&self, offset_ms: i64) -> Self {
        Self::with_offset(
            self.inner.client.clone(),
            self.inner.config.clone(),
            offset_ms,
        )
    }

    /// The key below which semaphore `name`'s contender keys live (followed by `/`), which
    /// also holds its permit count.
    pub fn semaphore_key(&self, name: &str) -> String {
        self.inner.count_key(name)
    }
}

impl Inner {
    /// This store's clock (ms since the Unix epoch).
    fn now(&self) -> i64 {
        now_millis().saturating_add(self.clock_offset_ms)
    }

    fn count_key(&self, semaphore: &str) -> String {
        format!("{}/{}", self.dir, encode_name(semaphore))
    }

    fn range(&self, semaphore: &str) -> String {
        format!("{}/", self.count_key(semaphore))
    }

    fn key_of(&self, semaphore: &str, contender_id: &str) -> Vec<u8> {
        format!("{}{}", self.range(semaphore), encode_name(contender_id)).into_bytes()
    }

    fn limit(&self) -> Duration {
        call_limit(self.config.lease_ttl)
    }

    /// The count and the contender keys of `semaphore` in queue order (create revision),
    /// read in one snapshot.
    async fn read(&self, semaphore: &str) -> Result<(Option<(u32, i64)>, Vec<Read>)> {
        let count_key = self.count_key(semaphore);
        let txn = Txn::new().and_then([
            TxnOp::get(count_key.clone(), None),
            TxnOp::get(
                self.range(semaphore),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Create, SortOrder::Ascend),
                ),
            ),
        ]);
        let mut kv = self.client.kv_client();
        let resp = bounded("reading a semaphore", self.limit(), kv.txn(txn)).await?;
        let mut gets = resp.op_responses().into_iter().filter_map(|r| match r {
            TxnOpResponse::Get(g) => Some(g),
            _ => None,
        });
        let (Some(count), Some(keys)) = (gets.next(), gets.next()) else {
            return Err(Error::backend(
                BACKEND,
                "a transaction answer without its two reads",
            ));
        };
        let count = match count.kvs().first() {
            None => None,
            Some(kv) => {
                let text = String::from_utf8_lossy(kv.value());
                let n = text.parse::<u32>().map_err(|_| Error::Backend {
                    backend: BACKEND,
                    retryable: false,
                    source: None,
                    message: format!(
                        "{count_key} holds `{text}`, not a permit count: simba-etcd writes only \
                         a decimal count there; delete the key to reset the semaphore"
                    ),
                })?;
                Some((n, kv.mod_revision()))
            }
        };
        let reads = keys.kvs().iter().map(read_key).collect();
        Ok((count, reads))
    }

    /// The store's presence lease, granted (and kept alive by a task) when there is none.
    async fn presence(self: &Arc<Self>) -> Result<i64> {
        let mut slot = self.presence.lock().await;
        if let Some(p) = slot.as_ref().filter(|p| p.alive.load(Ordering::SeqCst)) {
            return Ok(p.id);
        }
        let limit = self.limit();
        let mut leases = self.client.lease_client();
        let ttl = self.config.lease_secs();
        let id = bounded(
            "granting the presence lease",
            limit,
            leases.grant(ttl, None),
        )
        .await?
        .id();
        let (keeper, stream) = bounded(
            "keeping the presence lease alive",
            limit,
            leases.keep_alive(id),
        )
        .await?;
        let alive = Arc::new(AtomicBool::new(true));
        let every = self.config.lease_ttl / 3;
        tokio::spawn(keep_presence(
            Arc::downgrade(self),
            keeper,
            stream,
            alive.clone(),
            every,
        ));
        debug!(lease = id, "presence lease granted");
        *slot = Some(Presence { id, alive });
        Ok(id)
    }

    /// Forgets the presence lease `id` (the server no longer has it).
    async fn presence_gone(&self, id: i64) {
        let mut slot = self.presence.lock().await;
        if slot.as_ref().is_some_and(|p| p.id == id)
            && let Some(p) = slot.take()
        {
            p.alive.store(false, Ordering::SeqCst);
        }
    }

    /// Grants a holder key's lease for `lease`; its id and the local time before which it
    /// cannot end.
    async fn holder_lease(&self, lease: Lease) -> Result<(i64, i64)> {
        let secs = holder_lease_secs(lease);
        let sent = self.now();
        let mut leases = self.client.lease_client();
        let id = bounded(
            "granting a permit's lease",
            self.limit(),
            leases.grant(secs, None),
        )
        .await?
        .id();
        Ok((id, sent.saturating_add(secs.saturating_mul(1000))))
    }

    /// Revokes `id` in the background (a lease no key uses any more); it ends by its TTL
    /// if that fails.
    fn revoke_later(&self, id: i64) {
        let mut leases = self.client.lease_client();
        let limit = self.limit();
        tokio::spawn(async move {
            if let Err(e) = bounded("revoking an unused lease", limit, leases.revoke(id)).await {
                debug!(
                    lease = id,
                    "revoking an unused lease failed ({e}); it ends by its TTL"
                );
            }
        });
    }

    async fn acquire(
        self: &Arc<Self>,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
        renew_only: bool,
    ) -> Result<LeaseReply> {
        // A lease granted in a round whose transaction failed is used by the next round.
        let mut spare: Option<(i64, i64)> = None;
        let mut result = Err(Error::backend(
            BACKEND,
            format!(
                "the keys of semaphore {semaphore:?} changed under {MAX_ROUNDS} reads in a row"
            ),
        ));
        for _ in 0..MAX_ROUNDS {
            match self
                .round(
                    semaphore,
                    contender_id,
                    permits,
                    lease,
                    renew_only,
                    &mut spare,
                )
                .await
            {
                Ok(Round::Done(reply)) => {
                    result = Ok(reply);
                    break;
                }
                Ok(Round::Again) => {}
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if let Some((id, _)) = spare {
            self.revoke_later(id);
        }
        result
    }

    /// One read, decision and guarded write of an acquisition.
    async fn round(
        self: &Arc<Self>,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
        renew_only: bool,
        spare: &mut Option<(i64, i64)>,
    ) -> Result<Round<LeaseReply>> {
        // Taken before the read: every time written counts from no later than this.
        let now = self.now();
        let (count, reads) = self.read(semaphore).await?;
        let key = self.key_of(semaphore, contender_id);
        let mine = reads.iter().find(|r| r.key == key);
        let mut holders: Vec<&Read> = reads
            .iter()
            .filter(|r| matches!(r.entry, Entry::Holder { .. }))
            .collect();
        holders.sort_by_key(|r| r.fence());
        // Another contender's key holds while it exists, whatever its transition_at says on
        // our clock (see the module docs): the rule sees it within its lease, and looks
        // again at its transition_at or a second from now, whichever is later (the watch
        // wakes us first when the key goes). Our own key is judged by our own clock.
        let admission_holders: Vec<AdmissionHolder<'_>> = holders
            .iter()
            .map(|r| AdmissionHolder {
                contender_id: &r.id,
                transition_at: match r.entry {
                    Entry::Holder { transition_at, .. } if r.key == key => transition_at,
                    Entry::Holder { transition_at, .. } => {
                        transition_at.max(now.saturating_add(HELD_LOOK_MS))
                    }
                    Entry::Waiter { .. } => 0,
                },
                fence: r.fence(),
            })
            .collect();
        let waiters: Vec<&Read> = reads
            .iter()
            .filter(|r| matches!(r.entry, Entry::Waiter { .. }))
            .collect();
        let admission_waiters: Vec<AdmissionWaiter<'_>> = waiters
            .iter()
            .map(|r| AdmissionWaiter {
                contender_id: &r.id,
                keep_until: match r.entry {
                    Entry::Waiter { keep_until } => keep_until,
                    Entry::Holder { .. } => 0,
                },
                // Waiters are never passed over here: a waiter's place is kept only while
                // its store's presence lease lives (see the module docs).
                claim_by: None,
            })
            .collect();
        let state = SemaphoreState {
            permits: count.map_or(permits, |(n, _)| n),
            last_fence: 0,
            holders: &admission_holders,
            waiters: &admission_waiters,
        };
        let request = PermitRequest {
            contender_id,
            permits,
            lease,
            now,
            turn_ms: TURN_MS,
            poll_ms: None,
            fence_floor: 0,
            claim_ms: i64::MAX,
        };
        let admission = admit_permit(&state, &request);
        let decision = admission.decision;
        // What the rule dropped: waiters past their kept place (never another's holder key,
        // see above); a take deletes those keys, if they did not change since the read.
        let dropped: Vec<&Read> = admission
            .expired_holders
            .iter()
            .map(|&i| holders[i])
            .chain(admission.stale_waiters.iter().map(|&i| waiters[i]))
            .filter(|r| r.key != key)
            .collect();
        let not_held = || Ok(Round::Done(LeaseReply::look_again_at(now, now)));
        // Our own key, unless the rule dropped it (past its lease or its kept place): it
        // goes, and we join again at the end of the queue.
        let live_mine = match decision {
            PermitDecision::Renew { .. } => mine,
            PermitDecision::Take { queued, .. } | PermitDecision::Wait { queued, .. } => {
                queued.map(|i| waiters[i])
            }
            PermitDecision::Mismatch { .. } => None,
        };
        if let (Some(old), None) = (mine, live_mine)
            && !matches!(decision, PermitDecision::Mismatch { .. })
        {
            if renew_only {
                return not_held();
            }
            return self.delete_stale(old).await;
        }
        let guard_mine = match live_mine {
            Some(r) => Compare::mod_revision(key.clone(), CompareOp::Equal, r.mod_revision),
            None => Compare::create_revision(key.clone(), CompareOp::Equal, 0),
        };
        match decision {
            PermitDecision::Mismatch { existing } => Err(Error::PermitsMismatch {
                semaphore: semaphore.to_owned(),
                asked: permits,
                existing,
            }),
            PermitDecision::Renew {
                ttl_at,
                transition_at,
                ..
            } => {
                let Some(r) = mine else { return not_held() };
                let Entry::Holder { acquired_at, .. } = r.entry else {
                    return not_held();
                };
                let fence = r.fence();
                // A lease granted during this call: it cannot end before the engine's new
                // local deadline. The old one is revoked once the key has moved.
                let (lease_id, lease_until) = match spare.take() {
                    Some(s) => s,
                    None => self.holder_lease(lease).await?,
                };
                let entry = Entry::Holder {
                    fence,
                    acquired_at,
                    ttl_at,
                    transition_at,
                    lease_until,
                };
                let txn = Txn::new().when([guard_mine]).and_then([TxnOp::put(
                    key.clone(),
                    entry_value(&entry, contender_id),
                    Some(PutOptions::new().with_lease(lease_id)),
                )]);
                match self.write("renewing a permit", txn, None).await {
                    Ok(true) => {}
                    Ok(false) => {
                        *spare = Some((lease_id, lease_until));
                        return Ok(Round::Again);
                    }
                    // The lease ended before the put (a very slow call): grant another.
                    Err(e) if is_lease_not_found(&e) => return Ok(Round::Again),
                    Err(e) => return Err(e),
                }
                if r.lease != 0 && r.lease != lease_id {
                    self.revoke_later(r.lease);
                }
                Ok(Round::Done(LeaseReply {
                    owner: MutexOwner {
                        owner_id: contender_id.to_owned(),
                        acquired_at,
                        ttl_at,
                        transition_at,
                        fence,
                    },
                    now,
                }))
            }
            _ if renew_only => not_held(),
            PermitDecision::Take {
                ttl_at,
                transition_at,
                ..
            } => {
                let (lease_id, lease_until) = match spare.take() {
                    Some(s) => s,
                    None => self.holder_lease(lease).await?,
                };
                let count_key = self.count_key(semaphore);
                let guard_count = match count {
                    Some((_, rev)) => {
                        Compare::mod_revision(count_key.clone(), CompareOp::Equal, rev)
                    }
                    None => Compare::create_revision(count_key.clone(), CompareOp::Equal, 0),
                };
                let entry = Entry::Holder {
                    fence: 0,
                    acquired_at: now,
                    ttl_at,
                    transition_at,
                    lease_until,
                };
                let mut compares = vec![guard_count, guard_mine];
                let mut ops = vec![
                    TxnOp::put(count_key, permits.to_string(), None),
                    TxnOp::put(
                        key.clone(),
                        entry_value(&entry, contender_id),
                        Some(PutOptions::new().with_lease(lease_id)),
                    ),
                ];
                for r in &dropped {
                    compares.push(Compare::mod_revision(
                        r.key.clone(),
                        CompareOp::Equal,
                        r.mod_revision,
                    ));
                    ops.push(TxnOp::delete(r.key.clone(), None));
                }
                let txn = Txn::new().when(compares).and_then(ops);
                let mut revision = 0;
                match self
                    .write("taking a permit", txn, Some(&mut revision))
                    .await
                {
                    Ok(true) if revision > 0 => {}
                    Ok(_) => {
                        *spare = Some((lease_id, lease_until));
                        return Ok(Round::Again);
                    }
                    // The lease ended before the put (a very slow call): grant another.
                    Err(e) if is_lease_not_found(&e) => return Ok(Round::Again),
                    Err(e) => return Err(e),
                }
                debug!(semaphore, contender_id, fence = revision, "permit taken");
                Ok(Round::Done(LeaseReply {
                    owner: MutexOwner {
                        owner_id: contender_id.to_owned(),
                        acquired_at: now,
                        ttl_at,
                        transition_at,
                        fence: u64::try_from(revision).unwrap_or(0),
                    },
                    now,
                }))
            }
            PermitDecision::Wait {
                look_at,
                keep_until,
                ..
            } => {
                let presence = self.presence().await?;
                let entry = Entry::Waiter { keep_until };
                let txn = Txn::new().when([guard_mine]).and_then([TxnOp::put(
                    key.clone(),
                    entry_value(&entry, contender_id),
                    Some(PutOptions::new().with_lease(presence)),
                )]);
                match self.write("queueing for a permit", txn, None).await {
                    Ok(true) => Ok(Round::Done(LeaseReply::look_again_at(look_at, now))),
                    Ok(false) => Ok(Round::Again),
                    Err(e) if is_lease_not_found(&e) => {
                        self.presence_gone(presence).await;
                        Ok(Round::Again)
                    }
                    Err(e) => Err(e),
                }
            }
        }
    }

    /// Runs `txn`; whether its comparisons held. `revision` receives the revision it wrote
    /// at.
    async fn write(&self, what: &str, txn: Txn, revision: Option<&mut i64>) -> Result<bool> {
        let mut kv = self.client.kv_client();
        let resp = bounded(what, self.limit(), kv.txn(txn)).await?;
        if let Some(r) = revision {
            *r = resp.header().map_or(0, |h| h.revision());
        }
        Ok(resp.succeeded())
    }

    /// Deletes our own key the rule dropped (if nobody changed it meanwhile); read again.
    async fn delete_stale(&self, old: &Read) -> Result<Round<LeaseReply>> {
        let txn = Txn::new()
            .when([Compare::mod_revision(
                old.key.clone(),
                CompareOp::Equal,
                old.mod_revision,
            )])
            .and_then([TxnOp::delete(old.key.clone(), None)]);
        if self
            .write("removing a key past its time", txn, None)
            .await?
            && old.holds()
            && old.lease != 0
        {
            self.revoke_later(old.lease);
        }
        Ok(Round::Again)
    }

    /// Deletes `contender_id`'s key: always (`release`), or only while it waits; whether
    /// it held a permit (its holder key existed, so its etcd lease had not ended) and so
    /// freed one.
    async fn remove(&self, semaphore: &str, contender_id: &str, release: bool) -> Result<bool> {
        let key = self.key_of(semaphore, contender_id);
        let mut kv = self.client.kv_client();
        if release {
            let resp = bounded(
                "releasing a permit",
                self.limit(),
                kv.delete(key, Some(DeleteOptions::new().with_prev_key())),
            )
            .await?;
            let Some(prev) = resp.prev_kvs().first().map(read_key) else {
                return Ok(false);
            };
            if prev.holds() && prev.lease != 0 {
                // The holder's own lease, which no key uses any more.
                self.revoke_later(prev.lease);
            }
            return Ok(prev.holds());
        }
        let resp = bounded(
            "reading a waiter's key",
            self.limit(),
            kv.get(key.clone(), None),
        )
        .await?;
        let Some(r) = resp.kvs().first().map(read_key) else {
            return Ok(false);
        };
        if matches!(r.entry, Entry::Holder { .. }) {
            // A permit held stays held until its lease ends.
            return Ok(false);
        }
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                r.mod_revision,
            )])
            .and_then([TxnOp::delete(key, None)]);
        self.write("leaving the queue", txn, None).await?;
        Ok(false)
    }

    /// Every holder key, whatever its `transition_at` says on our clock: it holds until
    /// its etcd lease ends.
    async fn owners(&self, semaphore: &str) -> Result<PermitHolders> {
        let now = self.now();
        let (count, reads) = self.read(semaphore).await?;
        let mut holders: Vec<&Read> = reads.iter().filter(|r| r.holds()).collect();
        holders.sort_by_key(|r| r.fence());
        let holders: Vec<MutexOwner> = holders.iter().filter_map(|r| r.owner()).collect();
        Ok(PermitHolders {
            permits: if holders.is_empty() {
                None
            } else {
                count.map(|(n, _)| n)
            },
            holders,
            now,
        })
    }

    async fn subscribe(
        self: &Arc<Self>,
        semaphore: &str,
        contender_id: &str,
    ) -> Result<EventReceiver> {
        let (tx, rx) = events::channel(4);
        let mut watches = self.watches.lock().await;
        watches.retain(|_, w| !w.task.is_finished());
        if let Some(w) = watches.get(semaphore) {
            let mut listeners = lock(&w.listeners);
            listeners.retain(|_, tx| !tx.is_closed());
            listeners.insert(contender_id.to_owned(), tx);
            return Ok(rx);
        }
        let range = self.range(semaphore);
        let mut client = self.client.watch_client();
        let (stream, _) = watch_from_now(
            &mut client,
            range.clone().into_bytes(),
            WatchOptions::new().with_prefix(),
            "watching a semaphore",
            self.limit(),
        )
        .await?;
        let listeners: Listeners = Arc::new(StdMutex::new(HashMap::new()));
        lock(&listeners).insert(contender_id.to_owned(), tx);
        let task = tokio::spawn(follow(
            self.client.clone(),
            range,
            stream,
            listeners.clone(),
            self.limit(),
        ));
        watches.insert(semaphore.to_owned(), Watched { listeners, task });
        Ok(rx)
    }
}

fn lock<T>(m: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn read_key(kv: &KeyValue) -> Read {
    // A value simba-etcd did not write holds no permit and keeps no place: a waiter whose
    // place is over (the next acquisition by its contender replaces it).
    let (entry, id) = parse_entry(kv.value()).unwrap_or_else(|| {
        (
            Entry::Waiter { keep_until: 0 },
            String::from_utf8_lossy(kv.key()).into_owned(),
        )
    });
    Read {
        key: kv.key().to_vec(),
        id,
        entry,
        mod_revision: kv.mod_revision(),
        lease: kv.lease(),
    }
}

/// Keeps the presence lease alive every `every` until the store is dropped or the lease is
/// gone; clears `alive` when it stops.
async fn keep_presence(
    store: Weak<Inner>,
    mut keeper: etcd_client::LeaseKeeper,
    mut stream: etcd_client::LeaseKeepAliveStream,
    alive: Arc<AtomicBool>,
    every: Duration,
) {
    let every = every.max(Duration::from_millis(200));
    loop {
        tokio::time::sleep(every).await;
        if store.upgrade().is_none() || !alive.load(Ordering::SeqCst) {
            break;
        }
        if let Err(e) = keeper.keep_alive().await {
            debug!("presence keep-alive send failed: {e}");
            break;
        }
        match tokio::time::timeout(every, stream.message()).await {
            Ok(Ok(Some(r))) if r.ttl() > 0 => {}
            Ok(Ok(Some(_))) => {
                debug!("the presence lease is gone");
                break;
            }
            Ok(Ok(None) | Err(_)) => {
                debug!("the presence keep-alive stream ended");
                break;
            }
            // Unanswered: try again at the next tick (the lease may still live).
            Err(_) => {}
        }
    }
    alive.store(false, Ordering::SeqCst);
}

/// Wakes `listeners` whenever a contender key of the watched range is deleted (a permit
/// freed, or a waiter gone); after a broken watch it watches again and tells them to read
/// again. Ends when nobody listens.
async fn follow(
    client: Client,
    range: String,
    mut stream: WatchStream,
    listeners: Listeners,
    limit: Duration,
) {
    let mut idle = tokio::time::interval(IDLE_CHECK);
    idle.tick().await;
    let notify = |event: StoreEvent| {
        for tx in lock(&listeners).values() {
            // A full channel already holds an event that makes the contender look again.
            let _ = tx.try_send(event.clone());
        }
    };
    loop {
        tokio::select! {
            message = stream.message() => match message {
                Ok(Some(resp)) => {
                    if resp.events().iter().any(|e| e.event_type() == EventType::Delete) {
                        notify(StoreEvent::Released);
                    }
                    if resp.canceled() {
                        let Some(s) = rewatch(&client, &range, &listeners, limit).await else {
                            break;
                        };
                        stream = s;
                        notify(StoreEvent::Resync);
                    }
                }
                Ok(None) | Err(_) => {
                    let Some(s) = rewatch(&client, &range, &listeners, limit).await else {
                        break;
                    };
                    stream = s;
                    notify(StoreEvent::Resync);
                }
            },
            _ = idle.tick() => {
                let mut l = lock(&listeners);
                l.retain(|_, tx| !tx.is_closed());
                if l.is_empty() {
                    break;
                }
            }
        }
    }
}

/// A new watch on `range`, retried every `limit` until it is created; `None` once nobody
/// listens.
async fn rewatch(
    client: &Client,
    range: &str,
    listeners: &Listeners,
    limit: Duration,
) -> Option<WatchStream> {
    loop {
        {
            let mut l = lock(listeners);
            l.retain(|_, tx| !tx.is_closed());
            if l.is_empty() {
                return None;
            }
        }
        let mut watches = client.watch_client();
        match watch_from_now(
            &mut watches,
            range.as_bytes().to_vec(),
            WatchOptions::new().with_prefix(),
            "watching a semaphore again",
            limit,
        )
        .await
        {
            Ok((stream, _)) => return Some(stream),
            Err(e) => debug!("watching a semaphore again failed: {e}"),
        }
        tokio::time::sleep(limit).await;
    }
}

impl PermitStore for EtcdPermitStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn permit_acquire(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> Result<LeaseReply> {
        self.inner
            .acquire(semaphore, contender_id, permits, lease, false)
            .await
    }

    async fn permit_guard(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> Result<LeaseReply> {
        self.inner
            .acquire(semaphore, contender_id, permits, lease, true)
            .await
    }

    async fn permit_release(&self, semaphore: &str, contender_id: &str) -> Result<bool> {
        self.inner.remove(semaphore, contender_id, true).await
    }

    async fn permit_owners(&self, semaphore: &str) -> Result<PermitHolders> {
        self.inner.owners(semaphore).await
    }

    async fn permit_subscribe(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> Result<Option<EventReceiver>> {
        Ok(Some(self.inner.subscribe(semaphore, contender_id).await?))
    }

    /// Leaves the queue only: a permit held stays held until its lease ends.
    async fn permit_leave(&self, semaphore: &str, contender_id: &str) -> Result<()> {
        self.inner.remove(semaphore, contender_id, false).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip() {
        let holder = Entry::Holder {
            fence: 42,
            acquired_at: 1,
            ttl_at: 2,
            transition_at: 3,
            lease_until: 4,
        };
        let v = entry_value(&holder, "a\nb c");
        assert_eq!(
            parse_entry(v.as_bytes()),
            Some((holder, "a\nb c".to_owned()))
        );
        let waiter = Entry::Waiter { keep_until: -5 };
        let v = entry_value(&waiter, "w");
        assert_eq!(parse_entry(v.as_bytes()), Some((waiter, "w".to_owned())));
        assert_eq!(parse_entry(b"garbage"), None);
        assert_eq!(parse_entry(b"h 1 2 3\nx"), None);
        assert_eq!(parse_entry(b"w 1 2\nx"), None);
        assert_eq!(parse_entry(b"h -1 2 3 4 5\nx"), None);
    }

    #[test]
    fn holder_leases_are_the_permit_lease_rounded_up() {
        let lease = |ttl, transition| Lease {
            ttl: Duration::from_millis(ttl),
            transition: Duration::from_millis(transition),
        };
        assert_eq!(holder_lease_secs(lease(1000, 500)), 2);
        assert_eq!(holder_lease_secs(lease(2000, 1000)), 3);
        assert_eq!(holder_lease_secs(lease(20_000, 5_001)), 26);
        assert_eq!(holder_lease_secs(lease(1, 0)), 1);
        let c = lease_config(Duration::from_secs(3));
        assert_eq!(c.ttl + c.transition, Duration::from_secs(3));
        assert!(c.validate().is_ok());
    }
}
