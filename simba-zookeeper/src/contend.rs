//! [`ZkContendService`]: the leader latch on ephemeral sequential nodes.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use simba_core::backend::{
    BoxFuture, ContendHandle, OwnershipTracker, Reporter, ServiceHandle, ServiceStatus,
};
#[cfg(feature = "bench")]
use simba_core::hops::Hop;
use simba_core::metrics::FailureKind;
use simba_core::{Contender, LossReason, MutexOwner, MutexState, Result};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{Instrument, debug, warn};
use zookeeper_async::{CreateMode, Stat, ZkError, ZkResult};

use crate::common::{new_token, node_prefix, owner_at, owner_of, sort_latch};
use crate::recipe::{self, Recipe, Schedule};
use crate::session::{BACKEND, Core, Fail, Orphan, OwnerMark, Session, View};

/// After this many immediate re-checks in a row, wait a retry interval before the next.
const MAX_RECHECKS: u32 = 10;

struct Shared {
    session: Arc<Session>,
    /// The server-side path of the mutex node (`{chroot}{root}/{encoded mutex}`).
    parent: String,
}

/// A contend service on ZooKeeper: the leader-latch recipe.
///
/// - Contending creates an ephemeral sequential node `_c_{uuid}-latch-{seq}` under
///   `{root}/{mutex}` holding the contender id; the lowest sequence owns. Each waiter
///   watches only its predecessor, and checks again at once when the predecessor is already
///   gone. The owner watches its own node.
/// - The fence is the owning node's creation zxid (`czxid`).
/// - When the connection drops, an owner becomes *suspect* ([`Held::suspect`](simba_core::Held::suspect)) and keeps
///   the ownership only until its local deadline: the send time of the last *write* the
///   leader answered in this session, plus half the session timeout, minus the drift
///   margin — before the leader can expire the session, even when the owner's server is
///   a follower cut off from the leader that still answers reads (while it owns, the
///   session probes with a write that changes nothing every tenth of the session
///   timeout). If no write is answered by
///   then it reports [`LossReason::LeaseExpired`], deletes its node once it can, and
///   contends again with a new node (a new fence). When the session is found expired it
///   reports [`LossReason::SessionLost`] at once.
/// - After every reconnect it lists the children again and sets its watch again (the
///   client loses watches on reconnect); watch callbacks carry a generation number so that
///   stale ones are ignored.
/// - `stop` deletes its node, so the next waiter's watch fires at once; when the delete
///   cannot be done now, the session deletes the node as soon as it can.
pub struct ZkContendService {
    shared: Arc<Shared>,
    handle: ServiceHandle,
}

impl fmt::Debug for ZkContendService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkContendService")
            .field("path", &self.path())
            .field("service", &self.handle)
            .finish()
    }
}

impl ZkContendService {
    pub(crate) fn new(
        session: Arc<Session>,
        mutex: String,
        contender_id: String,
        parent: String,
        contender: Arc<dyn Contender>,
        mutex_label: bool,
    ) -> Self {
        let out = ServiceStatus::new(Reporter::Contender(contender)).with_identity(
            BACKEND,
            &mutex,
            &contender_id,
            mutex_label,
        );
        let shared = Arc::new(Shared { session, parent });
        let driver = shared.clone();
        let handle = ServiceHandle::new(out, move |tracker, stop| {
            let (latch, watches) = Latch::new(driver.clone(), tracker);
            Box::pin(recipe::run(latch, watches, stop))
        });
        ZkContendService { shared, handle }
    }

    /// The server-side path of this mutex's node, under which the latch nodes live.
    pub fn path(&self) -> &str {
        &self.shared.parent
    }

    /// A receiver of the last owner change this service observed (waiters learn of a new
    /// owner when their predecessor changes, not on every change).
    pub fn owner_state(&self) -> watch::Receiver<MutexState> {
        self.handle.service_status().owner_state()
    }
}

impl ContendHandle for ZkContendService {
    fn handle(&self) -> &ServiceHandle {
        &self.handle
    }

    /// Not supported: ZooKeeper has sessions, not leases (the service keeps running).
    fn stop_holding_until(&self, _until: Instant) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Err(crate::common::hold_unsupported()) })
    }
}

impl Recipe for Latch {
    type Step = Step;

    fn core(&self) -> &Arc<Core> {
        &self.core
    }

    fn schedule(&mut self) -> &mut Schedule {
        &mut self.schedule
    }

    fn sync(&mut self, view: View) {
        self.follow_session(view);
        if self.deadline_passed() {
            self.expire();
        }
        self.publish_deadline();
    }

    fn deadline(&self) -> Option<Instant> {
        self.local_deadline()
    }

    /// As often as the session probes, so the published deadline keeps up.
    fn republish_every(&self) -> Option<Duration> {
        let every = self.core.timing().session_timeout / 10;
        Some(every.max(Duration::from_millis(10)))
    }

    fn not_ready(&mut self, view: View) {
        self.count_not_ready(view);
    }

    fn check(&mut self) -> impl Future<Output = Result<Step>> + Send {
        self.pass()
    }

    fn after_check(&mut self, step: Result<Step>) {
        self.apply_step(step);
    }

    fn on_watch(&mut self) {
        debug!("watch fired");
        if self.predecessor_owns {
            #[cfg(feature = "bench")]
            simba_core::hops::record(Hop::WaiterWoken, self.parent());
            // The owner's node changed or went: the handoff to this waiter begins.
            self.tracker.handoff_begins();
        }
    }

    fn shutdown(self, ready: bool) -> impl Future<Output = ()> + Send {
        self.close(ready)
    }
}

/// This contender's latch node.
#[derive(Debug, Clone)]
struct Node {
    name: String,
    path: String,
    token: String,
    czxid: i64,
    ctime: i64,
    /// The data version it was created with: a node whose data was rewritten since (by
    /// hand: simba never writes it again) names another owner.
    version: i32,
    /// The session epoch it was created in (it dies with that session).
    epoch: u64,
}

impl Node {
    fn new(name: String, path: String, token: String, stat: &Stat, epoch: u64) -> Self {
        Node {
            name,
            path,
            token,
            czxid: stat.czxid,
            ctime: stat.ctime,
            version: stat.version,
            epoch,
        }
    }
}

/// The outcome of a check that did not fail.
enum Step {
    /// Decided: owner, or waiting on the predecessor's watch.
    Settled,
    /// Something changed under the check: check again now.
    Recheck,
}

struct Latch {
    shared: Arc<Shared>,
    core: Arc<Core>,
    /// When the next check is due.
    schedule: Schedule,
    /// The session epoch last seen.
    epoch: u64,
    node: Option<Node>,
    /// The token of a create whose answer was lost (the node may exist).
    pending: Option<String>,
    /// Our nodes that must be deleted (ownership given up while they may still exist).
    stale: Vec<Node>,
    /// The ownership state machine; the only writer of the status.
    tracker: OwnershipTracker,
    /// The name of the lowest node whose data `known` holds.
    known_lowest: Option<String>,
    /// Checks in a row that asked for another at once.
    rechecks: u32,
    /// The node this waiter watches is the owner's: its watch firing starts a handoff.
    predecessor_owns: bool,
    /// The kind of the last failed request (for the backend-error metric).
    last_fail: StdMutex<Option<FailureKind>>,
    /// Counts this service among the session's confirming services while it owns or is
    /// next in line.
    owner_mark: OwnerMark,
}

impl Latch {
    fn new(shared: Arc<Shared>, tracker: OwnershipTracker) -> (Self, recipe::Watches) {
        let core = shared.session.core().clone();
        let (schedule, watches) = Schedule::new();
        let owner_mark = OwnerMark::new(core.clone());
        let latch = Latch {
            shared,
            epoch: core.epoch(),
            core,
            schedule,
            node: None,
            pending: None,
            stale: Vec::new(),
            tracker,
            known_lowest: None,
            rechecks: 0,
            predecessor_owns: false,
            last_fail: StdMutex::new(None),
            owner_mark,
        };
        (latch, watches)
    }

    fn contender_id(&self) -> &str {
        self.tracker.service_status().contender_id()
    }

    fn parent(&self) -> &str {
        &self.shared.parent
    }

    /// One ZooKeeper request of the contend path, in its own span `simba_call` with the
    /// fields `op`, `backend`, `mutex`, `contender`, `path`, `fence` (while owning) and
    /// `outcome` (`ok`, `timeout`, or the ZooKeeper error, e.g. `NoNode`). A failure that
    /// is not an answer (not `NoNode` / `NodeExists`) is remembered for the metrics.
    fn traced<'a, T: 'a>(
        &'a self,
        op: &'static str,
        path: &'a str,
        request: impl Future<Output = ZkResult<T>> + Send + 'a,
    ) -> impl Future<Output = std::result::Result<T, Fail>> + Send + 'a {
        let span = tracing::debug_span!(
            "simba_call",
            op,
            backend = BACKEND,
            mutex = %self.tracker.service_status().mutex(),
            contender = %self.contender_id(),
            path,
            fence = self.tracker.held().map(|h| h.fence),
            outcome = tracing::field::Empty,
        );
        async move {
            let r = if matches!(op, "create" | "delete") {
                self.core.write(request).instrument(span.clone()).await
            } else {
                self.core.call(request).instrument(span.clone()).await
            };
            let kind = match &r {
                Ok(_) => {
                    span.record("outcome", "ok");
                    None
                }
                Err(Fail::Timeout(_)) => {
                    span.record("outcome", "timeout");
                    Some(FailureKind::Timeout)
                }
                Err(Fail::Zk(e)) => {
                    span.record("outcome", tracing::field::debug(e));
                    match e {
                        ZkError::NoNode | ZkError::NodeExists => None,
                        ZkError::ConnectionLoss => Some(FailureKind::Disconnected),
                        _ if Fail::Zk(*e).retryable() => Some(FailureKind::Retryable),
                        _ => Some(FailureKind::Fatal),
                    }
                }
            };
            if kind.is_some() {
                *self.last_fail.lock().unwrap_or_else(|p| p.into_inner()) = kind;
            }
            r
        }
    }

    /// Applies what the session says: an expired session takes the node (and the
    /// ownership) with it, a new link needs a new check, a lost connection makes the owner
    /// suspect.
    fn follow_session(&mut self, view: View) {
        let epoch = self.core.epoch().max(view.epoch);
        if epoch != self.epoch {
            self.epoch = epoch;
            self.schedule.wake();
            self.stale.retain(|n| n.epoch == epoch);
            if self.node.as_ref().is_some_and(|n| n.epoch != epoch) {
                self.node = None;
                self.known_lowest = None;
                self.tracker.lose(LossReason::SessionLost, MutexOwner::NONE);
            }
        }
        if view.closed && self.node.take().is_some() {
            self.known_lowest = None;
            self.tracker.lose(LossReason::SessionLost, MutexOwner::NONE);
        }
        if !view.ready {
            self.mark_suspect("not connected to ZooKeeper");
        }
    }

    fn local_deadline(&self) -> Option<Instant> {
        self.tracker.is_held().then(|| self.core.deadline())
    }

    fn deadline_passed(&self) -> bool {
        self.local_deadline().is_some_and(|d| Instant::now() >= d)
    }

    /// No write was confirmed in time: the leader may expire the session any moment.
    fn expire(&mut self) {
        warn!(
            "no write confirmed by the ZooKeeper leader in time: giving up ownership before \
             the leader can expire the session"
        );
        self.tracker
            .lose(LossReason::LeaseExpired, MutexOwner::NONE);
        if let Some(node) = self.node.take() {
            // A new ownership needs a new node (and fence); this one goes as soon as the
            // session answers again.
            self.stale.push(node);
        }
        self.known_lowest = None;
        self.schedule.wake();
    }

    fn mark_suspect(&mut self, why: &str) {
        self.tracker.mark_suspect(&why);
    }

    fn count_not_ready(&mut self, view: View) {
        self.schedule.retry_after(self.core.timing().retry);
        let why = if view.closed {
            "the ZooKeeper session is closed"
        } else {
            "not connected to ZooKeeper (reconnecting)"
        };
        self.tracker.count_failure(
            FailureKind::Disconnected,
            format!("{BACKEND} backend: {why}"),
        );
    }

    fn apply_step(&mut self, step: Result<Step>) {
        match step {
            Ok(Step::Recheck) => {
                self.rechecks += 1;
                if self.rechecks > MAX_RECHECKS {
                    self.schedule.retry_after(self.core.timing().retry);
                } else {
                    self.schedule.wake();
                }
            }
            Ok(Step::Settled) => {
                self.rechecks = 0;
                self.schedule.settled();
                self.tracker.count_attempt(None);
            }
            Err(e) => {
                self.rechecks = 0;
                let failures = self.schedule.failed(self.core.timing().retry);
                self.mark_suspect("a ZooKeeper call failed");
                if failures == 1 {
                    warn!("contending failed, retrying: {e}");
                } else {
                    debug!("contending failed again: {e}");
                }
                let kind = self
                    .last_fail
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take()
                    .unwrap_or_else(|| FailureKind::of(&e));
                self.tracker.count_failure(kind, e.to_string());
            }
        }
    }

    /// One pass of the recipe: make sure our node exists, list the children, then own or
    /// watch the predecessor.
    async fn pass(&mut self) -> Result<Step> {
        #[cfg(feature = "bench")]
        simba_core::hops::record(Hop::AcquireSent, self.parent());
        let step = self.pass_calls().await;
        #[cfg(feature = "bench")]
        simba_core::hops::record(Hop::AcquireAnswered, self.parent());
        step
    }

    /// The calls of [`pass`](Self::pass).
    async fn pass_calls(&mut self) -> Result<Step> {
        let on_event = self.schedule.begin_check();
        self.predecessor_owns = false;
        *self.last_fail.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let core = self.core.clone();
        while let Some(old) = self.stale.last() {
            match self
                .traced("delete", &old.path, core.zk().delete(&old.path, None))
                .await
            {
                Ok(()) | Err(Fail::Zk(ZkError::NoNode)) => {
                    debug!(path = %old.path, "deleted the node of a lost ownership");
                    self.stale.pop();
                }
                Err(e) => {
                    return Err(e.into_error(&format!("deleting the old node {}", old.path)));
                }
            }
        }
        let node = match self.node.clone() {
            Some(n) => n,
            None => match self.create().await? {
                Some(n) => n,
                None => return Ok(Step::Recheck),
            },
        };
        let children = match self
            .traced(
                "get_children",
                self.parent(),
                core.zk().get_children(self.parent(), false),
            )
            .await
        {
            Ok(c) => c,
            Err(Fail::Zk(ZkError::NoNode)) => {
                self.vanished(&node);
                return Ok(Step::Recheck);
            }
            Err(e) => return Err(e.into_error(&format!("listing {}", self.parent()))),
        };
        // Nodes of ours from creates whose answer was lost: delete them.
        for extra in children
            .iter()
            .filter(|c| c.contains(&node.token) && **c != node.name)
        {
            let path = format!("{}/{extra}", self.parent());
            match self
                .traced("delete", &path, core.zk().delete(&path, None))
                .await
            {
                Ok(()) | Err(Fail::Zk(ZkError::NoNode)) => {
                    debug!(%path, "deleted a duplicate node")
                }
                Err(e) => return Err(e.into_error(&format!("deleting {path}"))),
            }
        }
        let sorted = sort_latch(&children);
        let Some(index) = sorted.iter().position(|c| *c == node.name) else {
            self.vanished(&node);
            return Ok(Step::Recheck);
        };
        if index == 0 {
            match self
                .traced(
                    "exists_w",
                    &node.path,
                    core.zk().exists_w(&node.path, on_event),
                )
                .await
            {
                Ok(Some(_)) => {}
                Ok(None) => {
                    self.vanished(&node);
                    return Ok(Step::Recheck);
                }
                Err(e) => return Err(e.into_error(&format!("watching {}", node.path))),
            }
            if node.epoch != core.epoch() {
                // The session expired meanwhile; `sync` reports the loss.
                return Ok(Step::Recheck);
            }
            // A waiter's session confirms nothing (its probes are reads): before it owns,
            // one write must show the leader still counts the session (`Core::deadline`).
            // A fresh create did that already.
            let fresh = Instant::now() + core.timing().session_timeout / 5;
            if !self.tracker.is_held() && core.deadline() < fresh {
                core.confirm().await.map_err(|e| {
                    e.into_error("confirming the session with the ZooKeeper leader")
                })?;
                if core.deadline() < Instant::now() || node.epoch != core.epoch() {
                    return Ok(Step::Recheck);
                }
            }
            self.own(&node);
            return Ok(Step::Settled);
        }
        if self.tracker.is_held() {
            self.tracker.lose(LossReason::TakenOver, MutexOwner::NONE);
        }
        let lowest = sorted[0];
        if self.known_lowest.as_deref() != Some(lowest) {
            let path = format!("{}/{lowest}", self.parent());
            match self
                .traced("get_data", &path, core.zk().get_data(&path, false))
                .await
            {
                Ok((data, stat)) => {
                    let owner = owner_of(&data, &stat, core.timing().session_timeout);
                    self.known_lowest = Some(lowest.to_owned());
                    self.tracker.observe(owner);
                }
                Err(Fail::Zk(ZkError::NoNode)) => return Ok(Step::Recheck),
                Err(e) => return Err(e.into_error(&format!("reading the owner {path}"))),
            }
        }
        let predecessor = format!("{}/{}", self.parent(), sorted[index - 1]);
        self.tracker.handoff_missed();
        self.predecessor_owns = index == 1;
        match self
            .traced(
                "exists_w",
                &predecessor,
                core.zk().exists_w(&predecessor, on_event),
            )
            .await
        {
            Ok(Some(_)) => Ok(Step::Settled),
            // Already gone: check again at once (a watch on it would never fire).
            Ok(None) => Ok(Step::Recheck),
            Err(e) => Err(e.into_error(&format!("watching {predecessor}"))),
        }
    }

    /// Creates our node, or finds the one an earlier create made when its answer was lost.
    /// `None` means "check again" (the parent had to be created first).
    async fn create(&mut self) -> Result<Option<Node>> {
        let core = self.core.clone();
        let parent = self.parent().to_owned();
        if let Some(token) = self.pending.clone() {
            let found = match self
                .traced(
                    "get_children",
                    &parent,
                    core.zk().get_children(&parent, false),
                )
                .await
            {
                Ok(children) => sort_latch(&children)
                    .into_iter()
                    .find(|c| c.contains(&token))
                    .map(str::to_owned),
                Err(Fail::Zk(ZkError::NoNode)) => None,
                Err(e) => return Err(e.into_error(&format!("listing {parent}"))),
            };
            if let Some(name) = found {
                let path = format!("{parent}/{name}");
                match self
                    .traced("exists", &path, core.zk().exists(&path, false))
                    .await
                {
                    Ok(Some(stat)) => {
                        debug!(%path, "found the node of a create whose answer was lost");
                        let node = Node::new(name, path, token, &stat, core.epoch());
                        self.pending = None;
                        self.node = Some(node.clone());
                        return Ok(Some(node));
                    }
                    Ok(None) => {}
                    Err(e) => return Err(e.into_error(&format!("reading {path}"))),
                }
            }
        }
        let token = self.pending.get_or_insert_with(new_token).clone();
        let prefix = format!("{parent}/{}", node_prefix(&token));
        let data = self.contender_id().as_bytes().to_vec();
        match self
            .traced(
                "create",
                &prefix,
                core.zk()
                    .create2(&prefix, data, core.acl(), CreateMode::EphemeralSequential),
            )
            .await
        {
            Ok((path, stat)) => {
                // An answer comes from the session that ran the create.
                let epoch = core.epoch();
                self.pending = None;
                let name = path.rsplit('/').next().unwrap_or_default().to_owned();
                debug!(%path, czxid = stat.czxid, "latch node created");
                let node = Node::new(name, path, token, &stat, epoch);
                self.node = Some(node.clone());
                Ok(Some(node))
            }
            Err(Fail::Zk(ZkError::NoNode)) => {
                core.ensure_path(&parent).await?;
                Ok(None)
            }
            Err(e) => Err(e.into_error(&format!("creating a latch node under {parent}"))),
        }
    }

    /// Our node is not there any more.
    fn vanished(&mut self, node: &Node) {
        self.node = None;
        self.known_lowest = None;
        let reason = if node.epoch != self.core.epoch() {
            LossReason::SessionLost
        } else {
            LossReason::TakenOver
        };
        if self.tracker.is_held() {
            warn!(path = %node.path, "the owner's node disappeared");
        }
        self.tracker.lose(reason, MutexOwner::NONE);
    }

    /// Our node is the lowest: we own (or still own) the mutex.
    fn own(&mut self, node: &Node) {
        let owner = owner_at(
            self.contender_id().to_owned(),
            node.ctime,
            node.czxid,
            self.core.timing().session_timeout,
        );
        self.known_lowest = Some(node.name.clone());
        if self.tracker.hold(owner, Some(self.core.deadline())) {
            debug!(path = %node.path, "our latch node is the lowest");
        }
        self.owner_mark.set(true);
    }

    /// Publishes the local deadline while owning, so that `LockGuard::is_held` can check it
    /// without this task (a process woken from a pause sees its loss at once). It moves
    /// with every answered request; the run loop republishes it at least every fifth of
    /// the session timeout, so the published value lags the real one by about that much,
    /// which only makes it earlier (safe).
    fn publish_deadline(&mut self) {
        let deadline = self.local_deadline();
        self.tracker.set_deadline(deadline);
        // The next in line confirms too, so that it can own at once when the owner goes.
        self.owner_mark
            .set(deadline.is_some() || self.predecessor_owns);
    }

    /// Stop: report the release first, then delete the node, and the node of a create cut
    /// off by the stop (left to the session when not connected, or when a delete fails).
    ///
    /// The node of an ownership held until now is deleted only at the data version it was
    /// created with. A node already gone (deleted by hand, or with an expired session) or
    /// rewritten (its data names another owner) means the ownership had ended before the
    /// release: that is reported as the loss found at the release
    /// ([`OwnershipTracker::lost_at_release`]); a rewritten node is deleted all the same.
    /// A delete that fails or is not sent (no connection) proves nothing.
    async fn close(mut self, ready: bool) {
        let owned = self.tracker.held().map(|h| h.fence);
        self.tracker.lose(LossReason::Released, MutexOwner::NONE);
        let core = self.core.clone();
        let parent = self.shared.parent.clone();
        let epoch = core.epoch();
        let mut leftovers: Vec<String> = Vec::new();
        let mine = self.node.take();
        if let (Some(fence), Some(node)) = (owned, &mine)
            && node.epoch != epoch
        {
            // The session that carried the node expired unseen: the node went with it.
            self.tracker.lost_at_release(fence, LossReason::SessionLost);
        }
        let owned_path = owned.and(mine.as_ref()).map(|n| n.path.clone());
        let nodes: Vec<Node> = mine.into_iter().chain(self.stale.drain(..)).collect();
        for node in nodes.into_iter().filter(|n| n.epoch == epoch) {
            if !ready {
                leftovers.push(node.token);
                continue;
            }
            let held = owned_path.as_deref() == Some(node.path.as_str());
            let version = held.then_some(node.version);
            #[cfg(feature = "bench")]
            simba_core::hops::record(Hop::ReleaseSent, &node.path);
            let deleted = self
                .traced("delete", &node.path, core.zk().delete(&node.path, version))
                .await;
            #[cfg(feature = "bench")]
            simba_core::hops::record(Hop::ReleaseAnswered, &node.path);
            let found_lost = |this: &mut Self| {
                if let Some(fence) = owned {
                    warn!(path = %node.path, "stop: the owner's node was gone or rewritten");
                    this.tracker.lost_at_release(fence, LossReason::TakenOver);
                }
            };
            match deleted {
                Ok(()) => debug!(path = %node.path, "stop: node deleted"),
                Err(Fail::Zk(ZkError::NoNode)) => {
                    debug!(path = %node.path, "stop: node already gone");
                    if held {
                        found_lost(&mut self);
                    }
                }
                Err(Fail::Zk(ZkError::BadVersion)) if held => {
                    found_lost(&mut self);
                    // Still our session's node: delete it, so the next waiter goes on.
                    match self
                        .traced("delete", &node.path, core.zk().delete(&node.path, None))
                        .await
                    {
                        Ok(()) | Err(Fail::Zk(ZkError::NoNode)) => {}
                        Err(e) => {
                            debug!(path = %node.path, "stop: delete failed ({e:?}); the session deletes it later");
                            leftovers.push(node.token);
                        }
                    }
                }
                Err(e) => {
                    debug!(path = %node.path, "stop: delete failed ({e:?}); the session deletes it later");
                    leftovers.push(node.token);
                }
            }
        }
        let mut orphans: Vec<Orphan> = leftovers
            .into_iter()
            .map(|token| Orphan {
                parent: parent.clone(),
                token,
            })
            .collect();
        if let Some(token) = self.pending.take() {
            let orphan = Orphan {
                parent: parent.clone(),
                token,
            };
            if ready {
                // A create cut off by the stop may have made a node (its name is known only
                // from its answer). The session sends requests in order, so a listing sent
                // now sees that node if the create was sent: delete it before returning, so
                // that a give-up leaves nothing owned.
                orphans.extend(core.clean(vec![orphan]).await);
            } else {
                orphans.push(orphan);
            }
        }
        for orphan in orphans {
            core.add_orphan(orphan);
        }
        self.tracker.finish();
    }
}
