//! [`ZkPermitStore`]: semaphores on ZooKeeper, as a [`PermitStore`], run by simba-core's
//! one lease engine through [`Semaphore`](simba_core::Semaphore).
//!
//! Layout: the semaphore `s` is the container node `{root}/%semaphores/{s}` whose data is
//! the permit count N (text); each contender is an ephemeral sequential child
//! `_p_{hex of contender id}-{sequence}` whose data is its lease (`{ttl_ms}
//! {transition_ms}`, then a mark, a line break, its contender id). The mark is absent on a
//! new node, ` w` on a waiter that kept its place, ` h` on the write that made a waiter
//! that kept its place a holder, and ` {fence}` on a holder's later renewals.
//!
//! The first N children by sequence whose lease has not ended have the permits; a holder's
//! node has been written as a holder at least once (version ≥ 1, not marked ` w`). Every
//! node's lease ends at its `mtime` (the server's clock at its latest write) plus its
//! lease, a waiter's as a holder's: a waiter keeps its place by writing ` w` again every
//! half ttl, so a waiter that stopped (paused, or gone without its session ending) loses
//! its place within its lease, and the nodes behind it move up. Nodes past their lease
//! are removed by whoever reads them, version-checked: a node written meanwhile stays.
//!
//! A holder's fence is the `mzxid` of the version-checked write that made it a holder
//! (from version 0 to 1, or the ` h` write): zxids only grow, so a permit taken later has a
//! greater fence than every permit taken before it, whatever the order the nodes were
//! made in. Later renewals keep it in the data (a node written by an older simba, whose
//! fence was its `czxid`, keeps that). Lease ends are compared with the server's clock:
//! the `mtime` of a write to `{root}/%semaphores` (a name [`encode_name`] never makes: its
//! `%` is not followed by two hex digits).
//!
//! Wake-ups: a waiter with fewer than 2N live nodes ahead watches the children of the
//! semaphore, so that any node going (a release, a waiter leaving or losing its place)
//! wakes it, even when the node just ahead of it is a waiter that never writes again;
//! one further back watches the node just ahead only (no herd), and looks again when that
//! node's lease ends.
//!
//! # Claim window
//!
//! A waiter among the first N live nodes that has not taken its permit (never written as
//! a holder: version 0, or marked ` w`) is *owed* one. A stopped owed waiter would hold
//! that permit up until its lease ends, so every waiter that looks behind it records, in
//! its store instance, the server time it first saw each owed node at each version, looks
//! again by then + the claim window
//! ([`ZkConfig::permit_claim`](crate::ZkConfig::permit_claim)), and if the node still has
//! that version then, deletes it, version-checked: the owed waiter loses its place (when
//! it calls again it finds no node and joins again at the back). The recipe cannot pass
//! a waiter over and keep its place, as the in-memory store does, because the order of
//! the nodes is what says who holds; so [`PermitStore::permit_claim`] stays `None`.
//!
//! This keeps at most N holders: the holders are still the first N live nodes in
//! sequence order, and the node deleted never held (it had not been written as a holder
//! at the version read). The delete and the owed waiter's take are both conditional on
//! that same version of the same node, so exactly one succeeds: a take that came first
//! makes the delete fail (the node holds, and stays), a delete that came first makes the
//! take fail (no node: the waiter joins again). A waiter behind only takes after reading
//! the nodes again.
//!
//! Not only the waiters near the front run the claims: each store instance (each process)
//! has its own sightings, and with a permit held up the others cycle fast, so a waiter
//! near the front usually takes the other permit before its own claim ends. The first
//! waiter anywhere behind to look with a sighting a claim window old removes the node
//! (in a `chaos` run with a waiter paused, running them near the front only left the
//! held-up permit idle about twice as long).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use simba_core::backend::{Lease, LeaseReply, PermitHolders, PermitStore, StoreEvent};
use simba_core::events::{self, EventReceiver, EventSender};
use simba_core::{Error, LeaseConfig, MutexOwner, Result};
use zookeeper_async::{CreateMode, Stat, WatchedEvent, ZkError};

use crate::config::encode_name;
use crate::session::{BACKEND, Core, Fail, Session};

/// The node under the base below which every semaphore lives; also the clock node.
pub(crate) const SEMAPHORES: &str = "%semaphores";

/// The prefix of every permit node's name.
const NODE: &str = "_p_";

/// How many times one operation reads again after the nodes changed under it.
const MAX_ROUNDS: usize = 8;

/// The length of ZooKeeper's sequence suffix.
const SEQ_DIGITS: usize = 10;

/// The store of ZooKeeper semaphores over one session (see the crate docs, *Semaphores*).
///
/// It implements [`PermitStore`] only: a ZooKeeper mutex is a
/// [`ZkFactory`](crate::ZkFactory) service (a session-bound latch, no lease), not a
/// [`LeaseStore`](simba_core::backend::LeaseStore). Cloning shares the session. Make one
/// with [`ZkFactory::permit_store`](crate::ZkFactory::permit_store), or a
/// [`Semaphore`](simba_core::Semaphore) at once with
/// [`ZkFactory::semaphore`](crate::ZkFactory::semaphore).
///
/// Its claim window (see the module docs, *Claim window*) is
/// [`ZkConfig::permit_claim`](crate::ZkConfig::permit_claim);
/// [`ZkPermitStore::with_claim`] sets another.
#[derive(Clone)]
pub struct ZkPermitStore {
    inner: Arc<Inner>,
    /// The claim window in milliseconds; `None`: owed waiters are never removed.
    claim_ms: Option<i64>,
}

impl std::fmt::Debug for ZkPermitStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkPermitStore")
            .field("dir", &self.inner.dir)
            .field("claim_ms", &self.claim_ms)
            .finish_non_exhaustive()
    }
}

type Subscribers = StdMutex<HashMap<(String, String), EventSender>>;

struct Inner {
    session: Arc<Session>,
    /// `{base}/%semaphores`.
    dir: String,
    subscribers: Subscribers,
    /// The task that tells subscribers to read again after a reconnect runs.
    following: AtomicBool,
    /// The server time each owed waiter's node (path, version) was first seen owed (see
    /// the module docs, *Claim window*).
    owed: StdMutex<HashMap<(String, i32), i64>>,
    /// Each contender's own node (key: the semaphore node's path, the contender id) as
    /// this store last made or wrote it: its path, data and the stat the server returned.
    /// Every write of it is version-checked and only its contender writes it (others only
    /// delete it), so a take, renewal or release sends that write without listing and
    /// reading the node; a write that finds the node gone or at another version forgets
    /// the entry, and the call reads the node.
    mine: StdMutex<HashMap<(String, String), Node>>,
}

/// What the claims of the owed waiters ahead came to.
enum Claims {
    /// A node was removed, or changed under the read: read again.
    Again,
    /// When the first claim still running ends (`None`: none runs).
    Until(Option<i64>),
}

/// What a node's data says after its lease (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    /// Nothing: a new node (version 0), or the write that made it a holder (version 1;
    /// fence: that write's `mzxid`), or an older simba's holder (fence: its `czxid`).
    Plain,
    /// ` w`: a waiter that kept its place (not a holder, whatever its version).
    Waiting,
    /// ` h`: the write that made a waiter that had kept its place a holder (fence: this
    /// write's `mzxid`).
    Taken,
    /// ` {fence}`: a holder's renewal.
    Fence(u64),
}

/// One permit node, read (or as this store last wrote it, see [`Inner::mine`]).
#[derive(Debug)]
struct Node {
    path: String,
    owner: String,
    ttl_ms: i64,
    total_ms: i64,
    mark: Mark,
    stat: Stat,
}

impl Node {
    /// `contender_id`'s node at `path` as a write of `mark` with `lease` left it (`stat`:
    /// what the server returned).
    fn written(path: String, contender_id: &str, lease: Lease, mark: Mark, stat: Stat) -> Node {
        Node {
            path,
            owner: contender_id.to_owned(),
            ttl_ms: lease.ttl_ms(),
            total_ms: lease.ttl_ms().saturating_add(lease.transition_ms()),
            mark,
            stat,
        }
    }

    /// A copy (the client's `Stat` is not `Clone`).
    fn copy(&self) -> Node {
        let s = &self.stat;
        Node {
            path: self.path.clone(),
            owner: self.owner.clone(),
            stat: Stat {
                czxid: s.czxid,
                mzxid: s.mzxid,
                ctime: s.ctime,
                mtime: s.mtime,
                version: s.version,
                cversion: s.cversion,
                aversion: s.aversion,
                ephemeral_owner: s.ephemeral_owner,
                data_length: s.data_length,
                num_children: s.num_children,
                pzxid: s.pzxid,
            },
            ..*self
        }
    }

    /// The path of the semaphore node the node is a child of.
    fn parent(&self) -> &str {
        self.path.rsplit_once('/').map_or("", |(parent, _)| parent)
    }
}

/// The fence of a holder's node marked `mark` (see the module docs).
fn fence_of(mark: Mark, stat: &Stat) -> u64 {
    let zxid = match mark {
        Mark::Fence(f) => return f,
        Mark::Taken => stat.mzxid,
        Mark::Plain if stat.version == 1 => stat.mzxid,
        Mark::Plain | Mark::Waiting => stat.czxid,
    };
    u64::try_from(zxid).unwrap_or(0)
}

impl Node {
    /// Its fence, once it is a holder.
    fn fence(&self) -> u64 {
        fence_of(self.mark, &self.stat)
    }

    /// Whether the node has been written as a holder (a waiter's node never is).
    fn renewed(&self) -> bool {
        self.stat.version >= 1 && self.mark != Mark::Waiting
    }

    /// Whether the node's lease ended by the server's `now` (a holder's or a waiter's:
    /// a waiter that does not keep its place loses it).
    fn expired(&self, now: i64) -> bool {
        self.stat.mtime.saturating_add(self.total_ms) <= now
    }

    /// When the node's permit may come free at the latest, as far as `now` can tell: the
    /// end of its lease (for a node without one, the end of its session).
    fn ends_at(&self, now: i64, session_ms: i64) -> i64 {
        let end = self.stat.mtime.saturating_add(self.total_ms);
        if self.renewed() {
            end
        } else {
            end.min(now.saturating_add(session_ms))
        }
    }

    fn owner(&self, now: i64, session_ms: i64) -> MutexOwner {
        let end = self.ends_at(now, session_ms);
        let ttl_at = if self.renewed() {
            self.stat.mtime.saturating_add(self.ttl_ms)
        } else {
            end
        };
        MutexOwner {
            owner_id: self.owner.clone(),
            acquired_at: self.stat.ctime,
            ttl_at,
            transition_at: end,
            fence: self.fence(),
        }
    }
}

/// What one round of an operation came to.
enum Round<T> {
    Done(T),
    /// The nodes changed under the round: read again.
    Again,
}

/// Hex of the contender id: node names then never hold `/` or `-` from an id.
fn hex(id: &str) -> String {
    id.bytes().map(|b| format!("{b:02x}")).collect()
}

/// The name prefix of `contender_id`'s node (the server appends the sequence).
fn node_prefix(contender_id: &str) -> String {
    format!("{NODE}{}-", hex(contender_id))
}

/// The sequence number of a permit node's name; `None` for other names.
fn sequence(name: &str) -> Option<u64> {
    if !name.starts_with(NODE) || name.len() < SEQ_DIGITS {
        return None;
    }
    let (head, seq) = name.split_at(name.len() - SEQ_DIGITS);
    if !head.ends_with('-') || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    seq.parse().ok()
}

/// The permit nodes among `children`, in sequence order.
fn sort_nodes(children: &[String]) -> Vec<&str> {
    let mut nodes: Vec<(u64, &str)> = children
        .iter()
        .filter_map(|c| sequence(c).map(|s| (s, c.as_str())))
        .collect();
    nodes.sort_unstable();
    nodes.into_iter().map(|(_, c)| c).collect()
}

fn node_data(contender_id: &str, lease: Lease, mark: Mark) -> Vec<u8> {
    let mark = match mark {
        Mark::Plain => String::new(),
        Mark::Waiting => " w".to_owned(),
        Mark::Taken => " h".to_owned(),
        Mark::Fence(f) => format!(" {f}"),
    };
    format!(
        "{} {}{mark}\n{contender_id}",
        lease.ttl_ms(),
        lease.transition_ms()
    )
    .into_bytes()
}

/// A node's data, parsed.
#[derive(Debug, PartialEq, Eq)]
struct NodeData {
    ttl_ms: i64,
    transition_ms: i64,
    mark: Mark,
    owner: String,
}

/// A node's data: `{ttl_ms} {transition_ms}[ {mark}]`, a line break, the contender id.
fn parse_node(data: &[u8]) -> Option<NodeData> {
    let text = std::str::from_utf8(data).ok()?;
    let (lease, owner) = text.split_once('\n')?;
    let mut words = lease.split(' ');
    let ttl_ms = words.next()?.parse().ok()?;
    let transition_ms = words.next()?.parse().ok()?;
    let mark = match words.next() {
        None => Mark::Plain,
        Some("w") => Mark::Waiting,
        Some("h") => Mark::Taken,
        Some(f) => Mark::Fence(f.parse().ok()?),
    };
    if words.next().is_some() {
        return None;
    }
    Some(NodeData {
        ttl_ms,
        transition_ms,
        mark,
        owner: owner.to_owned(),
    })
}

fn parse_count(data: &[u8]) -> Option<u32> {
    std::str::from_utf8(data).ok()?.trim().parse().ok()
}

fn wall_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 2))
        .unwrap_or(0)
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 2)
}

/// The reply naming `contender_id` the holder of its renewed node (`stat` after the
/// write that marked it `mark`).
fn holder_reply(contender_id: &str, stat: &Stat, lease: Lease, mark: Mark) -> LeaseReply {
    LeaseReply {
        owner: MutexOwner {
            owner_id: contender_id.to_owned(),
            acquired_at: stat.ctime,
            ttl_at: stat.mtime.saturating_add(lease.ttl_ms()),
            transition_at: stat
                .mtime
                .saturating_add(lease.ttl_ms())
                .saturating_add(lease.transition_ms()),
            fence: fence_of(mark, stat),
        },
        now: stat.mtime,
    }
}

/// The longest permit lease a session of timeout `session` keeps safe: half of it (see
/// [`ZkPermitStore`]'s checks).
pub(crate) fn max_lease(session: Duration) -> Duration {
    session / 2
}

/// A lease config whose lease (ttl + transition) is [`max_lease`] of `session`, in whole
/// milliseconds: ttl two thirds, transition one third.
pub(crate) fn lease_config(session: Duration) -> LeaseConfig {
    let total = u64::try_from(max_lease(session).as_millis()).unwrap_or(u64::MAX);
    let ttl = total * 2 / 3;
    LeaseConfig::with_lease(
        Duration::from_millis(ttl),
        Duration::from_millis(total - ttl),
    )
}

impl ZkPermitStore {
    pub(crate) fn new(session: Arc<Session>, claim: Option<Duration>) -> Self {
        let dir = format!("{}/{SEMAPHORES}", session.core().base());
        ZkPermitStore {
            inner: Arc::new(Inner {
                session,
                dir,
                subscribers: StdMutex::default(),
                following: AtomicBool::new(false),
                owed: StdMutex::default(),
                mine: StdMutex::default(),
            }),
            claim_ms: None,
        }
        .with_claim(claim)
    }

    /// This store with the claim window `claim` (see the module docs, *Claim window*):
    /// how long a waiter owed a free permit has to take it before a waiter behind it
    /// removes its node; `None`: never (a stopped waiter's place lasts its lease). A
    /// window under 1 ms counts as 1 ms. It shares everything else with `self` (session,
    /// subscriptions).
    #[must_use]
    pub fn with_claim(mut self, claim: Option<Duration>) -> Self {
        self.claim_ms = claim.map(|c| millis(c).max(1));
        self
    }

    /// The claim window in effect (see [`ZkPermitStore::with_claim`]). Not
    /// [`PermitStore::permit_claim`], which stays `None`: that promises a waiter passed
    /// over keeps its place, and here it loses it.
    pub fn claim(&self) -> Option<Duration> {
        self.claim_ms
            .map(|ms| Duration::from_millis(ms.unsigned_abs()))
    }

    /// The server-side path of semaphore `name`'s node: `{chroot}{root}/%semaphores/{name}`
    /// (the name encoded as a mutex name is).
    pub fn semaphore_path(&self, name: &str) -> String {
        self.inner.parent(name)
    }
}

impl Inner {
    fn core(&self) -> &Core {
        self.session.core()
    }

    fn parent(&self, semaphore: &str) -> String {
        format!("{}/{}", self.dir, encode_name(semaphore))
    }

    fn session_ms(&self) -> i64 {
        millis(self.core().timing().session_timeout)
    }

    /// Refuses a lease that could outlast the session's guarantee: a holder believes until
    /// its renewal's send time plus its lease, and its node is sure to live only until
    /// half the session timeout after an answered write (see `Core::deadline`).
    fn check_lease(&self, lease: Lease) -> Result<()> {
        let session = self.core().timing().session_timeout;
        if lease.total() > max_lease(session) {
            return Err(Error::unsupported(
                BACKEND,
                "a permit lease longer than half the session timeout",
                format!(
                    "the lease {:?} (ttl + transition) is longer than half the session \
                     timeout {session:?}: the session could expire, and the permit node go, \
                     while its holder still believes; use ZkFactory::permit_lease or a \
                     longer session timeout",
                    lease.total()
                ),
            ));
        }
        Ok(())
    }

    /// The server's clock now: the `mtime` of a write to the semaphores node.
    async fn clock(&self) -> Result<i64> {
        let core = self.core();
        for _ in 0..2 {
            match core
                .write(core.zk().set_data(&self.dir, Vec::new(), None))
                .await
            {
                Ok(stat) => return Ok(stat.mtime),
                Err(Fail::Zk(ZkError::NoNode)) => self.make_dir().await?,
                Err(e) => return Err(e.into_error(&format!("reading the clock at {}", self.dir))),
            }
        }
        Err(Error::backend(
            BACKEND,
            format!("{} keeps disappearing", self.dir),
        ))
    }

    /// Creates `{base}/%semaphores` (persistent) and the base above it.
    async fn make_dir(&self) -> Result<()> {
        let core = self.core();
        core.ensure_path(core.base()).await?;
        match core
            .write(
                core.zk()
                    .create(&self.dir, Vec::new(), core.acl(), CreateMode::Persistent),
            )
            .await
        {
            Ok(_) | Err(Fail::Zk(ZkError::NodeExists)) => Ok(()),
            Err(e) => Err(e.into_error(&format!("creating {}", self.dir))),
        }
    }

    /// The children of `parent`; `None` when it does not exist.
    async fn children(&self, parent: &str) -> Result<Option<Vec<String>>> {
        let core = self.core();
        match core.call(core.zk().get_children(parent, false)).await {
            Ok(c) => Ok(Some(c)),
            Err(Fail::Zk(ZkError::NoNode)) => Ok(None),
            Err(e) => Err(e.into_error(&format!("listing {parent}"))),
        }
    }

    /// Reads the nodes `names` of `parent` in order, skipping those gone meanwhile.
    async fn read_nodes(&self, parent: &str, names: &[&str]) -> Result<Vec<Node>> {
        let core = self.core();
        let mut nodes = Vec::with_capacity(names.len());
        for name in names {
            let path = format!("{parent}/{name}");
            match core.call(core.zk().get_data(&path, false)).await {
                Ok((data, stat)) => {
                    // A node whose data is not a lease (written by something else) holds a
                    // slot with no lease of its own: it lasts as long as its session.
                    let NodeData {
                        ttl_ms,
                        transition_ms,
                        mark,
                        owner,
                    } = parse_node(&data).unwrap_or(NodeData {
                        ttl_ms: 0,
                        transition_ms: 0,
                        mark: Mark::Plain,
                        owner: String::new(),
                    });
                    let total_ms = if ttl_ms > 0 {
                        ttl_ms.saturating_add(transition_ms)
                    } else {
                        i64::MAX / 2
                    };
                    nodes.push(Node {
                        path,
                        owner,
                        ttl_ms,
                        total_ms,
                        mark,
                        stat,
                    });
                }
                Err(Fail::Zk(ZkError::NoNode)) => {}
                Err(e) => return Err(e.into_error(&format!("reading {path}"))),
            }
        }
        Ok(nodes)
    }

    /// Removes the nodes whose lease ended by `now` (version-checked: a holder that renewed
    /// meanwhile keeps its node); returns the others.
    async fn prune(&self, nodes: Vec<Node>, now: i64) -> Result<Vec<Node>> {
        let core = self.core();
        let mut live = Vec::with_capacity(nodes.len());
        for node in nodes {
            if !node.expired(now) {
                live.push(node);
                continue;
            }
            match core
                .write(core.zk().delete(&node.path, Some(node.stat.version)))
                .await
            {
                Ok(()) | Err(Fail::Zk(ZkError::NoNode)) => {
                    tracing::debug!(path = %node.path, "removed a permit node past its lease");
                }
                Err(Fail::Zk(ZkError::BadVersion)) => live.push(node),
                Err(e) => return Err(e.into_error(&format!("removing {}", node.path))),
            }
        }
        Ok(live)
    }

    /// A watch callback that tells `contender_id`'s subscriber (if any, when it fires) to
    /// look again.
    fn waker(
        self: &Arc<Self>,
        semaphore: &str,
        contender_id: &str,
    ) -> impl FnOnce(WatchedEvent) + Send + 'static {
        let inner = Arc::downgrade(self);
        let key = (semaphore.to_owned(), contender_id.to_owned());
        move |_e: WatchedEvent| {
            if let Some(inner) = Weak::upgrade(&inner) {
                inner.notify(&key, StoreEvent::Released);
            }
        }
    }

    fn subscribers(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), EventSender>> {
        self.subscribers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn owed(&self) -> std::sync::MutexGuard<'_, HashMap<(String, i32), i64>> {
        self.owed.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn mine(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Node>> {
        self.mine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `contender_id`'s node of `parent` as this store last wrote it (see [`Inner::mine`]).
    fn cached(&self, parent: &str, contender_id: &str) -> Option<Node> {
        self.mine()
            .get(&(parent.to_owned(), contender_id.to_owned()))
            .map(Node::copy)
    }

    /// Remembers `node` (of `parent`) as its contender's own, just written.
    fn remember(&self, parent: &str, node: Node) {
        self.mine()
            .insert((parent.to_owned(), node.owner.clone()), node);
    }

    fn forget(&self, parent: &str, contender_id: &str) {
        self.mine()
            .remove(&(parent.to_owned(), contender_id.to_owned()));
    }

    fn notify(&self, key: &(String, String), event: StoreEvent) {
        if let Some(tx) = self.subscribers().get(key) {
            // A full channel already holds an event that makes the contender look again.
            let _ = tx.try_send(event);
        }
    }

    /// Starts (once) the task that sends [`StoreEvent::Resync`] to every subscriber when
    /// the session is ready again after a reconnect (the client loses watches then).
    fn follow_session(self: &Arc<Self>) {
        if self.following.swap(true, Ordering::SeqCst) {
            return;
        }
        let weak = Arc::downgrade(self);
        let mut view = self.core().view();
        tokio::spawn(async move {
            let mut link = view.borrow_and_update().link;
            while view.changed().await.is_ok() {
                let now = *view.borrow_and_update();
                let Some(inner) = weak.upgrade() else { break };
                if now.closed {
                    break;
                }
                if now.link != link {
                    link = now.link;
                    let mut subs = inner.subscribers();
                    subs.retain(|_, tx| !tx.is_closed());
                    for tx in subs.values() {
                        let _ = tx.try_send(StoreEvent::Resync);
                    }
                }
            }
        });
    }

    /// Finds `contender_id`'s node among `children`.
    fn find_mine<'a>(children: &'a [String], prefix: &str) -> Option<&'a str> {
        children.iter().map(String::as_str).find(|c| {
            c.starts_with(prefix) && c.len() == prefix.len() + SEQ_DIGITS && sequence(c).is_some()
        })
    }

    async fn acquire(
        self: &Arc<Self>,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
        claim_ms: Option<i64>,
    ) -> Result<LeaseReply> {
        self.check_lease(lease)?;
        let parent = self.parent(semaphore);
        let prefix = node_prefix(contender_id);
        let core = self.core();
        for _ in 0..MAX_ROUNDS {
            let Some(children) = self.children(&parent).await? else {
                // No semaphore node: make it with this count.
                let made = core
                    .write(core.zk().create(
                        &parent,
                        permits.to_string().into_bytes(),
                        core.acl(),
                        CreateMode::Container,
                    ))
                    .await;
                match made {
                    Ok(_) | Err(Fail::Zk(ZkError::NodeExists)) => {}
                    Err(Fail::Zk(ZkError::NoNode)) => self.make_dir().await?,
                    Err(e) => return Err(e.into_error(&format!("creating {parent}"))),
                }
                continue;
            };
            // The list just read serves the place when the node was in it: the nodes
            // ahead of a node only ever go, so its place there is its place now or a
            // later one (never nearer the back).
            let (mine, known) = match Self::find_mine(&children, &prefix) {
                Some(m) => (m.to_owned(), Some(children)),
                None => match self
                    .join(semaphore, &parent, &children, contender_id, permits, lease)
                    .await?
                {
                    Round::Done(name) => (name, None),
                    Round::Again => continue,
                },
            };
            match self
                .place(
                    semaphore,
                    &parent,
                    (&mine, known),
                    contender_id,
                    permits,
                    lease,
                    claim_ms,
                )
                .await?
            {
                Round::Done(reply) => return Ok(reply),
                Round::Again => continue,
            }
        }
        Err(Error::backend(
            BACKEND,
            format!("the nodes of {parent} changed under {MAX_ROUNDS} reads in a row"),
        ))
    }

    /// Adds `contender_id`'s node under `parent` if the count is `permits` (or nobody
    /// holds: the count becomes `permits`). Returns the node's name.
    async fn join(
        &self,
        semaphore: &str,
        parent: &str,
        children: &[String],
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> Result<Round<String>> {
        let core = self.core();
        let (data, pstat) = match core.call(core.zk().get_data(parent, false)).await {
            Ok(d) => d,
            Err(Fail::Zk(ZkError::NoNode)) => return Ok(Round::Again),
            Err(e) => return Err(e.into_error(&format!("reading {parent}"))),
        };
        let Some(count) = parse_count(&data) else {
            return Err(Error::backend(
                BACKEND,
                format!(
                    "{parent} holds {:?}, not a permit count: not a simba semaphore",
                    String::from_utf8_lossy(&data)
                ),
            ));
        };
        if count != permits {
            // The count changes only when nobody holds (holders past their lease dropped).
            let now = self.clock().await?;
            let nodes = self.read_nodes(parent, &sort_nodes(children)).await?;
            if !self.prune(nodes, now).await?.is_empty() {
                return Err(Error::PermitsMismatch {
                    semaphore: semaphore.to_owned(),
                    asked: permits,
                    existing: count,
                });
            }
            // Nobody holds: remove the semaphore node (refused if a node came meanwhile,
            // or if someone else made it again) and make it again with this count.
            match core
                .write(core.zk().delete(parent, Some(pstat.version)))
                .await
            {
                Ok(())
                | Err(Fail::Zk(ZkError::NoNode | ZkError::NotEmpty | ZkError::BadVersion)) => {}
                Err(e) => return Err(e.into_error(&format!("removing {parent}"))),
            }
            return Ok(Round::Again);
        }
        let path = format!("{parent}/{}", node_prefix(contender_id));
        let created = core
            .write(core.zk().create2(
                &path,
                node_data(contender_id, lease, Mark::Plain),
                core.acl(),
                CreateMode::EphemeralSequential,
            ))
            .await;
        let (made, stat) = match created {
            Ok(made) => made,
            Err(Fail::Zk(ZkError::NoNode)) => return Ok(Round::Again),
            Err(e) => return Err(e.into_error(&format!("creating a permit node under {parent}"))),
        };
        // The node must sit under the semaphore node whose count was read: one removed and
        // made again meanwhile (by a contender with another count) is another node.
        let same = match core.call(core.zk().exists(parent, false)).await {
            Ok(Some(s)) => s.czxid == pstat.czxid,
            Ok(None) => false,
            Err(e) => return Err(e.into_error(&format!("reading {parent}"))),
        };
        if !same {
            match core.write(core.zk().delete(&made, None)).await {
                Ok(()) | Err(Fail::Zk(ZkError::NoNode)) => {}
                Err(e) => return Err(e.into_error(&format!("removing {made}"))),
            }
            return Ok(Round::Again);
        }
        let name = made.rsplit('/').next().unwrap_or_default().to_owned();
        self.remember(
            parent,
            Node::written(made, contender_id, lease, Mark::Plain, stat),
        );
        Ok(Round::Done(name))
    }

    /// Decides what `contender_id`'s node `mine` is: a holder (renewed now) or a waiter
    /// (watching what can free its turn). `mine` comes with the children of `parent` when
    /// they were just read with it among them.
    #[allow(clippy::too_many_arguments)]
    async fn place(
        self: &Arc<Self>,
        semaphore: &str,
        parent: &str,
        (mine, known): (&str, Option<Vec<String>>),
        contender_id: &str,
        permits: u32,
        lease: Lease,
        claim_ms: Option<i64>,
    ) -> Result<Round<LeaseReply>> {
        let core = self.core();
        let children = match known {
            Some(children) => children,
            None => match self.children(parent).await? {
                Some(children) => children,
                None => return Ok(Round::Again),
            },
        };
        let sorted = sort_nodes(&children);
        let Some(at) = sorted.iter().position(|c| *c == mine) else {
            // Gone (session expired, or removed past its lease): join again.
            return Ok(Round::Again);
        };
        let n = usize::try_from(permits).unwrap_or(usize::MAX);
        if at < n {
            return self.take_or_renew(parent, mine, contender_id, lease).await;
        }
        let mut ahead = self.read_nodes(parent, &sorted[..=at]).await?;
        let Some(me) = ahead
            .pop()
            .filter(|m| m.path.ends_with(&format!("/{mine}")))
        else {
            // Gone meanwhile: join again.
            return Ok(Round::Again);
        };
        let now = self.clock().await?;
        let live = self.prune(ahead, now).await?;
        if live.len() < n {
            return self.renew(&me, contender_id, lease).await;
        }
        // The waiters owed the permits ahead have the claim window to take them; one that
        // did not is removed (see the module docs, *Claim window*).
        let mut claim_end = None;
        if let Some(claim_ms) = claim_ms {
            match self.end_claims(&live[..n], now, claim_ms).await? {
                Claims::Again => return Ok(Round::Again),
                Claims::Until(end) => claim_end = end,
            }
        }
        // A waiter keeps its place by writing within its lease: every half ttl.
        let half_ttl = lease.ttl_ms() / 2;
        let mut written = me.stat.mtime;
        // (A node written as a holder is never rewritten as a waiter: it cannot be this far
        // back, as no node comes ahead of one, but its fence must not be lost if it were.)
        if now >= written.saturating_add(half_ttl) && !me.renewed() {
            match self.keep_place(&me, contender_id, lease).await? {
                Some(stat) => written = stat.mtime,
                None => return Ok(Round::Again),
            }
        }
        let keep_by = written.saturating_add(half_ttl).saturating_add(1);
        let session_ms = self.session_ms();
        let waker = self.waker(semaphore, contender_id);
        if live.len() < 2 * n {
            // Near the front: any node going (a holder's release, a waiter leaving or
            // losing its place) may give it a permit or bring it nearer; a node that comes
            // behind it wakes it too. Not only the node just ahead: a waiter there that
            // stopped (paused) would never write again, and the permits freed ahead of it
            // would go unheard.
            let fresh = match core.call(core.zk().get_children_w(parent, waker)).await {
                Ok(c) => c,
                Err(Fail::Zk(ZkError::NoNode)) => return Ok(Round::Again),
                Err(e) => return Err(e.into_error(&format!("watching {parent}"))),
            };
            let gone = live
                .iter()
                .any(|h| !fresh.iter().any(|c| h.path.ends_with(&format!("/{c}"))));
            if gone {
                return Ok(Round::Again);
            }
            // Look again when the first lease ahead ends (one that stopped renewing or
            // keeping its place), when the first claim ahead ends, or when this one must
            // keep its place.
            let at = live
                .iter()
                .map(|h| h.ends_at(now, session_ms))
                .min()
                .unwrap_or(now)
                .saturating_add(1)
                .min(keep_by)
                .min(claim_end.unwrap_or(i64::MAX));
            return Ok(Round::Done(LeaseReply::look_again_at(at, now)));
        }
        // Further back: watch the node just ahead only. It goes, or it writes (it keeps its
        // place, or becomes a holder); and its lease ends if it stops writing.
        let Some(before) = live.last() else {
            return Ok(Round::Again);
        };
        match core.call(core.zk().exists_w(&before.path, waker)).await {
            Ok(Some(_)) => {
                let at = before
                    .ends_at(now, session_ms)
                    .saturating_add(1)
                    .min(keep_by)
                    .min(claim_end.unwrap_or(i64::MAX));
                Ok(Round::Done(LeaseReply::look_again_at(at, now)))
            }
            Ok(None) => Ok(Round::Again),
            Err(e) => Err(e.into_error(&format!("watching {}", before.path))),
        }
    }

    /// Runs the claims of the waiters owed a permit among `front` (the first N live nodes
    /// ahead, read before the server's `now`): one first seen owed (at its version) a claim
    /// window or more ago is removed, version-checked; the others' first sighting is
    /// recorded. Sightings older than the window plus the session timeout are forgotten.
    async fn end_claims(&self, front: &[Node], now: i64, claim_ms: i64) -> Result<Claims> {
        let forget_after = claim_ms.saturating_add(self.session_ms());
        let mut due = Vec::new();
        let mut next: Option<i64> = None;
        {
            let mut owed = self.owed();
            // A node keeps one version at most its lease (under half the session) after it
            // was written: an older sighting is of a node gone or changed.
            owed.retain(|_, seen| seen.saturating_add(forget_after) > now);
            // A node without a lease in its data (written by something else) is left
            // alone: it holds its slot as long as its session.
            for node in front.iter().filter(|n| !n.renewed() && n.ttl_ms > 0) {
                let key = (node.path.clone(), node.stat.version);
                let end = owed.entry(key).or_insert(now).saturating_add(claim_ms);
                if end <= now {
                    due.push(node);
                } else {
                    next = Some(next.map_or(end, |e| e.min(end)));
                }
            }
        }
        if due.is_empty() {
            return Ok(Claims::Until(next));
        }
        let core = self.core();
        for node in due {
            self.owed().remove(&(node.path.clone(), node.stat.version));
            match core
                .write(core.zk().delete(&node.path, Some(node.stat.version)))
                .await
            {
                Ok(()) => {
                    tracing::debug!(
                        path = %node.path,
                        "removed a waiter that did not take the permit it was owed in time"
                    );
                }
                // Gone, or written meanwhile (it took, or kept its place): it stays.
                Err(Fail::Zk(ZkError::NoNode | ZkError::BadVersion)) => {}
                Err(e) => return Err(e.into_error(&format!("removing {}", node.path))),
            }
        }
        Ok(Claims::Again)
    }

    /// Writes waiter `node`'s data again (version-checked), which keeps its place for
    /// another lease; the stat after the write, or `None` when the node went or changed
    /// meanwhile (it lost its place: join again).
    async fn keep_place(
        &self,
        node: &Node,
        contender_id: &str,
        lease: Lease,
    ) -> Result<Option<Stat>> {
        let core = self.core();
        match core
            .write(core.zk().set_data(
                &node.path,
                node_data(contender_id, lease, Mark::Waiting),
                Some(node.stat.version),
            ))
            .await
        {
            Ok(stat) => {
                let written =
                    Node::written(node.path.clone(), contender_id, lease, Mark::Waiting, stat);
                let stat = written.copy().stat;
                self.remember(node.parent(), written);
                Ok(Some(stat))
            }
            Err(Fail::Zk(ZkError::NoNode | ZkError::BadVersion)) => {
                self.forget(node.parent(), contender_id);
                Ok(None)
            }
            Err(e) => Err(e.into_error(&format!("keeping the place of {}", node.path))),
        }
    }

    /// Makes `contender_id`'s node `mine` of `parent` a holder, or renews it if it is one.
    async fn take_or_renew(
        &self,
        parent: &str,
        mine: &str,
        contender_id: &str,
        lease: Lease,
    ) -> Result<Round<LeaseReply>> {
        if let Some(node) = self.cached(parent, contender_id)
            && node.path.ends_with(&format!("/{mine}"))
            && let Round::Done(reply) = self.renew(&node, contender_id, lease).await?
        {
            return Ok(Round::Done(reply));
        }
        match self.read_nodes(parent, &[mine]).await?.pop() {
            Some(node) => self.renew(&node, contender_id, lease).await,
            None => Ok(Round::Again),
        }
    }

    /// Renews `node` (a write, which also stamps the lease start on the server's clock and
    /// wakes a waiter that watches it; version-checked, so that the write that makes it a
    /// holder is known) and names `contender_id` its holder.
    async fn renew(
        &self,
        node: &Node,
        contender_id: &str,
        lease: Lease,
    ) -> Result<Round<LeaseReply>> {
        let core = self.core();
        // A waiter's node becomes a holder by this write: its fence is this write's zxid
        // (a new node's version goes from 0 to 1; one that kept its place is marked).
        let mark = if node.renewed() {
            Mark::Fence(node.fence())
        } else if node.stat.version == 0 {
            Mark::Plain
        } else {
            Mark::Taken
        };
        match core
            .write(core.zk().set_data(
                &node.path,
                node_data(contender_id, lease, mark),
                Some(node.stat.version),
            ))
            .await
        {
            Ok(stat) => {
                let reply = holder_reply(contender_id, &stat, lease, mark);
                let path = node.path.clone();
                self.remember(
                    node.parent(),
                    Node::written(path, contender_id, lease, mark, stat),
                );
                Ok(Round::Done(reply))
            }
            Err(Fail::Zk(ZkError::NoNode | ZkError::BadVersion)) => {
                self.forget(node.parent(), contender_id);
                Ok(Round::Again)
            }
            Err(e) => Err(e.into_error(&format!("renewing {}", node.path))),
        }
    }

    /// `contender_id`'s node of `semaphore`, read: `None` when it has none.
    async fn read_mine(&self, semaphore: &str, contender_id: &str) -> Result<Option<Node>> {
        let parent = self.parent(semaphore);
        let Some(children) = self.children(&parent).await? else {
            return Ok(None);
        };
        let Some(mine) = Self::find_mine(&children, &node_prefix(contender_id)) else {
            return Ok(None);
        };
        Ok(self.read_nodes(&parent, &[mine]).await?.pop())
    }

    async fn guard(&self, semaphore: &str, contender_id: &str, lease: Lease) -> Result<LeaseReply> {
        self.check_lease(lease)?;
        let not_held = || {
            let now = wall_now();
            LeaseReply::look_again_at(now, now)
        };
        let parent = self.parent(semaphore);
        if let Some(node) = self.cached(&parent, contender_id)
            && node.renewed()
            && let Round::Done(reply) = self.renew(&node, contender_id, lease).await?
        {
            return Ok(reply);
        }
        match self.read_mine(semaphore, contender_id).await? {
            // Only a node that has held is renewed: a guard never takes a permit.
            Some(node) if node.renewed() => match self.renew(&node, contender_id, lease).await? {
                Round::Done(reply) => Ok(reply),
                Round::Again => Ok(not_held()),
            },
            _ => Ok(not_held()),
        }
    }

    /// Removes `contender_id`'s node: always (`release`), or only while it waits.
    async fn remove(&self, semaphore: &str, contender_id: &str, release: bool) -> Result<bool> {
        let parent = self.parent(semaphore);
        let core = self.core();
        let cached = self.cached(&parent, contender_id);
        self.forget(&parent, contender_id);
        if release && let Some(node) = cached.filter(Node::renewed) {
            // Deleted at the version this store wrote it as a holder: it held until now.
            match core
                .write(core.zk().delete(&node.path, Some(node.stat.version)))
                .await
            {
                Ok(()) => return Ok(true),
                Err(Fail::Zk(ZkError::NoNode)) => return Ok(false),
                // Written since (not by this store): read it.
                Err(Fail::Zk(ZkError::BadVersion)) => {}
                Err(e) => return Err(e.into_error(&format!("removing {}", node.path))),
            }
        }
        let Some(node) = self.read_mine(semaphore, contender_id).await? else {
            return Ok(false);
        };
        if !release && node.renewed() {
            // A permit held stays held until its lease (or session) ends.
            return Ok(false);
        }
        match core.write(core.zk().delete(&node.path, None)).await {
            Ok(()) => Ok(node.renewed()),
            Err(Fail::Zk(ZkError::NoNode)) => Ok(false),
            Err(e) => Err(e.into_error(&format!("removing {}", node.path))),
        }
    }

    async fn owners(&self, semaphore: &str) -> Result<PermitHolders> {
        let parent = self.parent(semaphore);
        let none = |now| PermitHolders {
            permits: None,
            holders: Vec::new(),
            now,
        };
        let Some(children) = self.children(&parent).await? else {
            return Ok(none(wall_now()));
        };
        let core = self.core();
        let (data, _) = match core.call(core.zk().get_data(&parent, false)).await {
            Ok(d) => d,
            Err(Fail::Zk(ZkError::NoNode)) => return Ok(none(wall_now())),
            Err(e) => return Err(e.into_error(&format!("reading {parent}"))),
        };
        let count = parse_count(&data).unwrap_or(0);
        let n = usize::try_from(count).unwrap_or(usize::MAX);
        let now = self.clock().await?;
        let sorted = sort_nodes(&children);
        let session_ms = self.session_ms();
        let mut holders = Vec::new();
        // The first `n` nodes within their lease have the permits; those renewed hold
        // them. A node never renewed is a waiter owed a permit it has not taken yet (it
        // does not believe it holds): it is not listed.
        let mut seats = 0;
        for node in self.read_nodes(&parent, &sorted).await? {
            if seats == n {
                break;
            }
            if !node.expired(now) {
                seats += 1;
                if node.renewed() {
                    holders.push(node.owner(now, session_ms));
                }
            }
        }
        Ok(PermitHolders {
            permits: (!holders.is_empty()).then_some(count),
            holders,
            now,
        })
    }
}

impl PermitStore for ZkPermitStore {
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
            .acquire(semaphore, contender_id, permits, lease, self.claim_ms)
            .await
    }

    async fn permit_guard(
        &self,
        semaphore: &str,
        contender_id: &str,
        _permits: u32,
        lease: Lease,
    ) -> Result<LeaseReply> {
        self.inner.guard(semaphore, contender_id, lease).await
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
        self.inner.follow_session();
        let (tx, rx) = events::channel(4);
        let mut subs = self.inner.subscribers();
        subs.retain(|_, tx| !tx.is_closed());
        subs.insert((semaphore.to_owned(), contender_id.to_owned()), tx);
        Ok(Some(rx))
    }

    /// Leaves the queue only: a permit held stays held until its lease or session ends.
    async fn permit_leave(&self, semaphore: &str, contender_id: &str) -> Result<()> {
        self.inner.remove(semaphore, contender_id, false).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_round_trip() {
        let prefix = node_prefix("a-b/c");
        assert_eq!(prefix, "_p_612d622f63-");
        let name = format!("{prefix}0000000042");
        assert_eq!(sequence(&name), Some(42));
        assert_eq!(sequence("_p_61-00000001"), None, "short sequence");
        assert_eq!(sequence("latch-0000000001"), None, "not a permit node");
        let children: Vec<String> = [
            "_p_62-0000000010",
            "foreign",
            "_p_61-0000000002",
            "_p_63-0000000007",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            sort_nodes(&children),
            vec!["_p_61-0000000002", "_p_63-0000000007", "_p_62-0000000010"]
        );
        assert_eq!(
            Inner::find_mine(&children, "_p_63-"),
            Some("_p_63-0000000007")
        );
        assert_eq!(Inner::find_mine(&children, "_p_6-"), None);
    }

    #[test]
    fn node_data_round_trips() {
        let lease = Lease {
            ttl: Duration::from_millis(4000),
            transition: Duration::from_millis(2000),
        };
        let parsed = |mark| NodeData {
            ttl_ms: 4000,
            transition_ms: 2000,
            mark,
            owner: "me".to_owned(),
        };
        for mark in [Mark::Plain, Mark::Waiting, Mark::Taken, Mark::Fence(77)] {
            assert_eq!(
                parse_node(&node_data("me", lease, mark)),
                Some(parsed(mark))
            );
        }
        assert_eq!(node_data("me", lease, Mark::Waiting), b"4000 2000 w\nme");
        assert_eq!(parse_node(b"garbage"), None);
        assert_eq!(parse_node(b"1 2 3 4\nme"), None);
        assert_eq!(parse_node(b"1 2 x\nme"), None);
        assert_eq!(parse_count(b"3"), Some(3));
        assert_eq!(parse_count(b"x"), None);
    }

    #[test]
    fn lease_config_fits_half_the_session() {
        let c = lease_config(Duration::from_secs(9));
        assert_eq!(c.ttl + c.transition, Duration::from_millis(4500));
        assert!(c.validate().is_ok());
    }
}
