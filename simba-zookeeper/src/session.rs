//! The internal session adapter over zookeeper-async.
//!
//! It assumes the client restores **nothing** after a reconnect (see the crate docs for
//! the defects this works around):
//! - [`connect`] bounds the whole connection set-up with the connect timeout (the client's
//!   own `connect` never returns while the server is unreachable);
//! - every `Connected` is followed by a fresh `add_auth` (digest auth is not replayed) and
//!   only then is the session reported ready again, with a new `link` number, so that
//!   every service re-lists its children and sets its watches again (watches are lost);
//! - the deprecated `ZkState::NotConnected` (the only sign of an expired session, after
//!   which the client silently opens a new one) bumps the session `epoch`: every node
//!   created in an earlier epoch is gone;
//! - the state listener runs synchronously in the client's IO task under a `std` mutex,
//!   so it only updates atomics and does a non-blocking, never-panicking channel send;
//! - a probe every tenth of the session timeout keeps `last_good`, the send time of the
//!   latest request the server answered in this session (readiness), and, while a service
//!   of the session owns a mutex, `last_confirmed`, the send time of the latest answered
//!   *write*. An owner's local deadline counts from `last_confirmed`, not from reads: see
//!   [`Core::deadline`] for why, and for the bound;
//! - the session is always closed (`close()`) when the adapter ends: dropping the client
//!   would keep the session (and its ephemeral nodes) alive.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use simba_core::{Error, Result};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior, timeout, timeout_at};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};
use zookeeper_async::{Acl, CreateMode, WatchedEvent, ZkError, ZkResult, ZkState, ZooKeeper};

use crate::config::{MIN_SESSION_TIMEOUT, Resolved, ZkConfig};

/// The backend name used in errors.
pub(crate) const BACKEND: &str = "zookeeper";

/// The pause between failed TCP connects inside zookeeper-async (its default is a hot loop).
const RECONNECT_DELAY: Duration = Duration::from_millis(250);

/// How many probes may be in flight at once.
const MAX_PROBES: usize = 3;

/// The version a confirming probe writes with: no node ever has it (ZooKeeper versions are
/// never negative, and -1 means "any"), so the write changes nothing and is answered with
/// `BadVersion` — after the leader has ordered it and a quorum has logged it.
const CONFIRM_VERSION: i32 = -2;

/// How long closing the session may take when the adapter ends.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a ZooKeeper call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fail {
    /// The server (or the client library) answered with this error.
    Zk(ZkError),
    /// No answer within the request timeout.
    Timeout(Duration),
}

impl Fail {
    /// Whether the failure is about the connection or session (worth retrying as is).
    pub(crate) fn retryable(self) -> bool {
        match self {
            Fail::Timeout(_) => true,
            Fail::Zk(e) => matches!(
                e,
                ZkError::ConnectionLoss
                    | ZkError::OperationTimeout
                    | ZkError::SessionExpired
                    | ZkError::SessionMoved
                    | ZkError::NoNode
                    | ZkError::NodeExists
            ),
        }
    }

    /// Maps the failure of `what` into simba's error.
    pub(crate) fn into_error(self, what: &str) -> Error {
        match self {
            Fail::Timeout(d) => Error::backend(BACKEND, format!("{what}: no answer within {d:?}")),
            Fail::Zk(e) => {
                let hint = match e {
                    ZkError::NoAuth => {
                        " (the node's ACL does not allow this session: configure the same digest \
                         credentials as the processes that created it)"
                    }
                    ZkError::InvalidACL => {
                        " (the session is not authenticated for the creator ACL: check the digest \
                         credentials)"
                    }
                    ZkError::AuthFailed => " (the server rejected the digest credentials)",
                    ZkError::ConnectionLoss => " (not connected to ZooKeeper)",
                    _ => "",
                };
                Error::backend_source(BACKEND, format!("{what}: {e:?}{hint}"), self.retryable(), e)
            }
        }
    }
}

/// Whether a failed *write* was still ordered by a leader with a quorum: the errors the
/// leader's request preparation produces, which ZooKeeper proposes as error transactions.
/// `NotReadOnly` (a read-only server answering on its own) is not one.
fn leader_error(e: ZkError) -> bool {
    matches!(
        e,
        ZkError::NoNode
            | ZkError::NodeExists
            | ZkError::NoAuth
            | ZkError::BadVersion
            | ZkError::NotEmpty
            | ZkError::InvalidACL
            | ZkError::NoChildrenForEphemerals
    )
}

/// Whether a write's result shows that a leader with a quorum ordered it.
fn confirmed<T>(r: &ZkResult<T>) -> bool {
    r.as_ref().err().is_none_or(|e| leader_error(*e))
}

/// Whether a result is an answer from the server (as opposed to a connection failure).
fn answered<T>(r: &ZkResult<T>) -> bool {
    r.as_ref()
        .err()
        .is_none_or(|e| leader_error(*e) || matches!(e, ZkError::NotReadOnly | ZkError::NoWatcher))
}

/// State shared with the client's state listener. It must not refer to the client (the
/// client owns the listener).
#[derive(Debug)]
struct Link {
    /// Bumped on every session expiry (`NotConnected`), before the client opens a new
    /// session, so a call that reads the same epoch before it is sent and after it is
    /// answered was answered by the session of that epoch.
    epoch: AtomicU64,
    connected: AtomicBool,
    /// Nanoseconds after `origin` at which the latest answered request was sent.
    last_good: AtomicU64,
    /// Nanoseconds after `origin` at which the latest write that a leader with a quorum
    /// answered was sent (see [`Core::deadline`]).
    last_confirmed: AtomicU64,
    origin: Instant,
    /// How many services of this session own their mutex or are next in line (see
    /// [`OwnerMark`]): while there are any, the probes are confirming writes.
    confirming: AtomicUsize,
}

impl Link {
    fn since_origin(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.origin).as_nanos()).unwrap_or(u64::MAX)
    }

    fn touch(&self, sent: Instant) {
        self.last_good
            .fetch_max(self.since_origin(sent), Ordering::SeqCst);
    }

    fn last_good(&self) -> Instant {
        self.origin + Duration::from_nanos(self.last_good.load(Ordering::SeqCst))
    }

    fn confirm(&self, sent: Instant) {
        self.last_confirmed
            .fetch_max(self.since_origin(sent), Ordering::SeqCst);
    }

    fn last_confirmed(&self) -> Instant {
        self.origin + Duration::from_nanos(self.last_confirmed.load(Ordering::SeqCst))
    }

    /// Runs inside zookeeper-async's IO task, under its listener mutex: atomics only.
    #[allow(deprecated)]
    fn on_state(&self, state: ZkState) {
        match state {
            ZkState::NotConnected => {
                self.epoch.fetch_add(1, Ordering::SeqCst);
                self.connected.store(false, Ordering::SeqCst);
            }
            ZkState::Connected | ZkState::ConnectedReadOnly => {
                self.connected.store(true, Ordering::SeqCst);
            }
            _ => self.connected.store(false, Ordering::SeqCst),
        }
    }
}

/// What services see of the session, published on every change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct View {
    /// The session epoch (see [`Core::epoch`]).
    pub(crate) epoch: u64,
    /// Bumped each time the session becomes ready again: watches set before may be lost,
    /// so services re-list and watch again.
    pub(crate) link: u64,
    /// Connected, authenticated, and probes are being answered.
    pub(crate) ready: bool,
    /// The session was closed; nothing works any more.
    pub(crate) closed: bool,
}

/// A node left behind by a stopped service (a delete that failed, or a create whose
/// answer was lost): every child of `parent` whose name contains `token` is ours to delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Orphan {
    pub(crate) parent: String,
    pub(crate) token: String,
}

/// The timing of a session, derived from the configuration and the granted session timeout.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SessionTiming {
    pub(crate) session_timeout: Duration,
    pub(crate) drift_margin: Duration,
    /// What an owner's deadline gives up for touches that a follower has not passed on to
    /// the leader yet (see [`Core::deadline`]): half the session timeout.
    pub(crate) confirm_allowance: Duration,
    /// Bound of one call (the session timeout: a live session answers well within it).
    pub(crate) request_timeout: Duration,
    /// Pause before a failed check is retried.
    pub(crate) retry: Duration,
    probe_interval: Duration,
    /// Probes unanswered for this long make the session not ready.
    stale_after: Duration,
}

impl SessionTiming {
    /// The timing of a session whose server-side timeout is `t`.
    fn new(config: &ZkConfig, t: Duration) -> Self {
        let probe_interval = t / 10;
        SessionTiming {
            session_timeout: t,
            // Validated below half the requested timeout; a lower negotiated one keeps it
            // below a quarter.
            drift_margin: config.drift_margin.min(t / 4),
            confirm_allowance: t / 2,
            request_timeout: t,
            retry: (t / 5).clamp(Duration::from_millis(100), Duration::from_secs(1)),
            probe_interval,
            stale_after: t / 2,
        }
    }
}

/// The client and everything the services need from the session.
pub(crate) struct Core {
    zk: ZooKeeper,
    link: Arc<Link>,
    view: watch::Sender<View>,
    timing: SessionTiming,
    resolved: Resolved,
    acl: Vec<Acl>,
    auth: Option<Vec<u8>>,
    orphans: StdMutex<Vec<Orphan>>,
    servers: String,
}

impl fmt::Debug for Core {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("servers", &self.servers)
            .field("base", &self.resolved.base)
            .field("view", &*self.view.borrow())
            .finish()
    }
}

impl Core {
    /// The client. Call it only through [`Core::call`].
    pub(crate) fn zk(&self) -> &ZooKeeper {
        &self.zk
    }

    pub(crate) fn timing(&self) -> SessionTiming {
        self.timing
    }

    /// The server-side path below which mutex nodes live (`chroot + root`).
    pub(crate) fn base(&self) -> &str {
        &self.resolved.base
    }

    /// The ACL for nodes simba creates.
    pub(crate) fn acl(&self) -> Vec<Acl> {
        self.acl.clone()
    }

    /// The current session epoch.
    pub(crate) fn epoch(&self) -> u64 {
        self.link.epoch.load(Ordering::SeqCst)
    }

    /// A receiver of the session's view.
    pub(crate) fn view(&self) -> watch::Receiver<View> {
        self.view.subscribe()
    }

    /// An owner's local deadline: it must stop believing it owns by then unless a later
    /// write is confirmed. It is `last_confirmed + session timeout − confirm allowance −
    /// drift margin`.
    ///
    /// Why writes, and why the allowance: only the *leader* expires sessions, counting the
    /// timeout from the last touch it heard of. A client on a follower touches its session
    /// there; the follower passes its touches on to the leader in its answers to the
    /// leader's pings, every tickTime / 2. A follower cut off from the leader keeps
    /// answering reads until it notices (syncLimit × tickTime, seconds), while the leader,
    /// hearing nothing, expires the session and another contender takes over: counting
    /// from answered reads let an owner believe for up to that long after the next owner
    /// began (the ensemble chaos run found it, issue #17). A write is answered only after
    /// the leader ordered it, and the follower sends the leader its ping answers and
    /// forwarded requests on one ordered connection, so when a write sent at `s` is
    /// answered, the leader has applied every touch the follower reported before it
    /// forwarded the write: the touches of requests made more than one ping period (at
    /// most tickTime / 2 ≤ a quarter of any session timeout the server grants) before `s`,
    /// of which, with a probe every tenth of the timeout, there is one at most 0.35 × the
    /// timeout before `s`. Half the timeout covers that, with room for late pings.
    pub(crate) fn deadline(&self) -> Instant {
        (self.link.last_confirmed() + self.timing.session_timeout)
            .checked_sub(self.timing.confirm_allowance + self.timing.drift_margin)
            .unwrap_or_else(Instant::now)
    }

    /// A write that changes nothing (`setData` on the base node with a version no node
    /// has), to move `last_confirmed`: `Ok` when a leader with a quorum answered it.
    pub(crate) async fn confirm(&self) -> std::result::Result<(), Fail> {
        let probe = self
            .zk
            .set_data(self.base(), Vec::new(), Some(CONFIRM_VERSION));
        match self.write(probe).await {
            Ok(_) => Ok(()),
            Err(Fail::Zk(e)) if leader_error(e) => Ok(()),
            Err(f) => Err(f),
        }
    }

    /// Runs one ZooKeeper read, bounded by the request timeout. An answer from the server
    /// in an unchanged session epoch moves `last_good` to the time the call was sent.
    pub(crate) async fn call<T>(
        &self,
        fut: impl Future<Output = ZkResult<T>> + Send,
    ) -> std::result::Result<T, Fail> {
        self.request(false, fut).await
    }

    /// Runs one ZooKeeper write like [`call`](Self::call); an answer that shows a leader
    /// ordered it (see [`confirmed`]) also moves `last_confirmed`.
    pub(crate) async fn write<T>(
        &self,
        fut: impl Future<Output = ZkResult<T>> + Send,
    ) -> std::result::Result<T, Fail> {
        self.request(true, fut).await
    }

    async fn request<T>(
        &self,
        write: bool,
        fut: impl Future<Output = ZkResult<T>> + Send,
    ) -> std::result::Result<T, Fail> {
        let epoch = self.epoch();
        let sent = Instant::now();
        let bound = self.timing.request_timeout;
        match timeout(bound, fut).await {
            Err(_) => Err(Fail::Timeout(bound)),
            Ok(r) => {
                if answered(&r) && self.epoch() == epoch {
                    self.link.touch(sent);
                    if write && confirmed(&r) {
                        self.link.confirm(sent);
                    }
                }
                r.map_err(Fail::Zk)
            }
        }
    }

    /// Creates `path` and its missing ancestors below `/`: persistent nodes, except the
    /// last one, which is a container (the server removes it once it is empty).
    pub(crate) async fn ensure_path(&self, path: &str) -> Result<()> {
        let mut prefix = String::new();
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        for (i, part) in parts.iter().enumerate() {
            prefix.push('/');
            prefix.push_str(part);
            let mode = if i + 1 == parts.len() {
                CreateMode::Container
            } else {
                CreateMode::Persistent
            };
            match self
                .write(self.zk.create(&prefix, Vec::new(), self.acl(), mode))
                .await
            {
                Ok(_) | Err(Fail::Zk(ZkError::NodeExists)) => {}
                Err(e) => return Err(e.into_error(&format!("creating {prefix}"))),
            }
        }
        Ok(())
    }

    /// Hands nodes of a stopped service to the session, which deletes them when it can.
    pub(crate) fn add_orphan(&self, orphan: Orphan) {
        debug!(parent = %orphan.parent, token = %orphan.token, "node left for the session to delete");
        self.orphans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(orphan);
    }

    fn take_orphans(&self) -> Vec<Orphan> {
        std::mem::take(&mut *self.orphans.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Re-authenticates (after every reconnect) and checks the session answers.
    async fn establish(&self) -> std::result::Result<(), Fail> {
        if let Some(auth) = &self.auth {
            self.call(self.zk.add_auth("digest", auth.clone())).await?;
        }
        self.call(self.zk.exists("/", false)).await.map(|_| ())
    }

    /// Deletes what orphans name; returns those that could not be handled yet.
    pub(crate) async fn clean(&self, orphans: Vec<Orphan>) -> Vec<Orphan> {
        let mut left = Vec::new();
        for o in orphans {
            let children = match self.call(self.zk.get_children(&o.parent, false)).await {
                Ok(c) => c,
                Err(Fail::Zk(ZkError::NoNode)) => continue,
                Err(e) => {
                    debug!("orphan clean-up: listing {} failed: {e:?}", o.parent);
                    left.push(o);
                    continue;
                }
            };
            let mut done = true;
            for child in children.iter().filter(|c| c.contains(&o.token)) {
                let path = format!("{}/{child}", o.parent);
                match self.write(self.zk.delete(&path, None)).await {
                    Ok(()) | Err(Fail::Zk(ZkError::NoNode)) => {
                        debug!(%path, "orphan clean-up: deleted")
                    }
                    Err(e) => {
                        debug!("orphan clean-up: deleting {path} failed: {e:?}");
                        done = false;
                    }
                }
            }
            if !done {
                left.push(o);
            }
        }
        left
    }
}

/// Counts a service (an owner, or the next in line) among those its session confirms for
/// while set: the session's probes are then writes, which move the owners' deadline (see
/// [`Core::deadline`]). Dropping it un-counts.
#[derive(Debug)]
pub(crate) struct OwnerMark {
    core: Arc<Core>,
    on: bool,
}

impl OwnerMark {
    pub(crate) fn new(core: Arc<Core>) -> Self {
        OwnerMark { core, on: false }
    }

    /// Counts (`true`) or un-counts (`false`) the service; idempotent.
    pub(crate) fn set(&mut self, owning: bool) {
        if owning == self.on {
            return;
        }
        self.on = owning;
        let count = &self.core.link.confirming;
        if owning {
            count.fetch_add(1, Ordering::SeqCst);
        } else {
            let _ = count.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        }
    }
}

impl Drop for OwnerMark {
    fn drop(&mut self) {
        self.set(false);
    }
}

/// A session shared by a factory and its services. Dropping the last handle closes it.
pub(crate) struct Session {
    core: Arc<Core>,
    close: CancellationToken,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.core.fmt(f)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // The adapter task closes the session (if the runtime still runs).
        self.close.cancel();
    }
}

impl Session {
    pub(crate) fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// Closes the session now and waits (bounded) until it is closed.
    pub(crate) async fn close(&self) {
        self.close.cancel();
        let mut view = self.core.view();
        let _ = timeout(CLOSE_TIMEOUT * 2, view.wait_for(|v| v.closed)).await;
    }
}

fn unreachable(servers: &str, within: Duration, what: &str) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!(
            "could not connect to ZooKeeper at {servers} within the connect timeout of \
             {within:?}: {what}"
        ),
        retryable: true,
        source: None,
    }
}

/// Resolves every host (asynchronously: the client itself would block in `to_socket_addrs`
/// and keep only the first address of each host).
async fn resolve_hosts(hosts: &[(String, u16)]) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for (host, port) in hosts {
        let addrs = tokio::net::lookup_host((host.as_str(), *port))
            .await
            .map_err(|e| {
                Error::backend_source(BACKEND, format!("cannot resolve host {host:?}"), true, e)
            })?;
        out.extend(addrs.map(|a| a.to_string()));
    }
    if out.is_empty() {
        return Err(Error::backend(
            BACKEND,
            "the connect string resolved to no address",
        ));
    }
    Ok(out)
}

const NO_SESSION: &str = "no session was established: the server did not answer (is it hung, or the network \
     partitioned?)";

/// Learns the session timeout the server at `addr` grants for `requested`: opens a session
/// with a bare ZooKeeper handshake, reads the timeout from the answer, and closes it.
///
/// zookeeper-async keeps the negotiated timeout to itself, and the server clamps the
/// requested one to its `minSessionTimeout..=maxSessionTimeout`: a lower value would make
/// the owner's local deadline come after the server may expire the session.
async fn negotiate(addr: &str, requested: Duration) -> std::io::Result<Duration> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned());
    let ms = i32::try_from(requested.as_millis()).unwrap_or(i32::MAX);
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    // ConnectRequest: protocolVersion, lastZxidSeen, timeOut, sessionId, passwd, readOnly.
    let mut body = Vec::with_capacity(45);
    body.extend_from_slice(&0i32.to_be_bytes());
    body.extend_from_slice(&0i64.to_be_bytes());
    body.extend_from_slice(&ms.to_be_bytes());
    body.extend_from_slice(&0i64.to_be_bytes());
    body.extend_from_slice(&16i32.to_be_bytes());
    body.extend_from_slice(&[0u8; 16]);
    body.push(0);
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    stream.write_all(&frame).await?;
    let len = stream.read_u32().await?;
    if !(8..=1024).contains(&len) {
        return Err(bad("unexpected ConnectResponse length"));
    }
    let mut answer = vec![0u8; len as usize];
    stream.read_exact(&mut answer).await?;
    // ConnectResponse: protocolVersion (4 bytes), timeOut (4 bytes), sessionId, passwd, …
    let granted = i32::from_be_bytes([answer[4], answer[5], answer[6], answer[7]]);
    if granted <= 0 {
        return Err(bad("the server refused the session"));
    }
    // CloseSession (xid 1, type -11), so that the probe session ends at once.
    let mut close = 8u32.to_be_bytes().to_vec();
    close.extend_from_slice(&1i32.to_be_bytes());
    close.extend_from_slice(&(-11i32).to_be_bytes());
    stream.write_all(&close).await?;
    let _ = timeout(Duration::from_millis(500), stream.read_u32()).await;
    Ok(Duration::from_millis(u64::try_from(granted).unwrap_or(0)))
}

/// Connects, authenticates and waits for the session, all within the connect timeout.
pub(crate) async fn connect(config: &ZkConfig) -> Result<Session> {
    let resolved = config.resolve()?;
    let started = Instant::now();
    let deadline = started + config.connect_timeout;
    let servers = config.connect.trim().to_owned();
    let within = config.connect_timeout;
    let addrs = match timeout_at(deadline, resolve_hosts(&resolved.hosts)).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(unreachable(
                &servers,
                within,
                "resolving the hosts timed out",
            ));
        }
    };
    let session_timeout = match timeout_at(deadline, negotiate(&addrs[0], config.session_timeout))
        .await
    {
        Ok(Ok(t)) if t < config.session_timeout => {
            warn!(
                requested = ?config.session_timeout,
                negotiated = ?t,
                "the server lowered the session timeout (its maxSessionTimeout); the owner's \
                 local deadline uses the lower value"
            );
            t
        }
        Ok(Ok(_)) => config.session_timeout,
        Ok(Err(e)) => {
            debug!("could not learn the negotiated session timeout ({e}); using the requested one");
            config.session_timeout
        }
        Err(_) => return Err(unreachable(&servers, within, NO_SESSION)),
    };
    if session_timeout < MIN_SESSION_TIMEOUT {
        return Err(Error::Backend {
            backend: BACKEND,
            message: format!(
                "the server grants session timeouts of at most {session_timeout:?}, below the \
                 {MIN_SESSION_TIMEOUT:?} zookeeper-async needs: raise the server's \
                 maxSessionTimeout"
            ),
            retryable: false,
            source: None,
        });
    }
    let timing = SessionTiming::new(config, session_timeout);
    // The chroot is handled here (every path is prefixed with it), so the client gets the
    // bare addresses: that lets simba create the chroot node, and watch paths stay whole.
    let connect_string = addrs.join(",");
    let link = Arc::new(Link {
        epoch: AtomicU64::new(0),
        connected: AtomicBool::new(false),
        last_good: AtomicU64::new(0),
        last_confirmed: AtomicU64::new(0),
        origin: started,
        confirming: AtomicUsize::new(0),
    });
    let client = ZooKeeper::connect_with_retry_time(
        &connect_string,
        session_timeout,
        // Events without a per-call watcher: nothing to do, and never panic here.
        |_event: WatchedEvent| {},
        RECONNECT_DELAY,
    );
    let zk = match timeout_at(deadline, client).await {
        Ok(Ok(zk)) => zk,
        Ok(Err(e)) => {
            return Err(Error::backend_source(
                BACKEND,
                format!("connecting to {servers}"),
                true,
                e,
            ));
        }
        Err(_) => {
            return Err(unreachable(
                &servers,
                within,
                "no TCP connection could be made (is the server running and reachable?)",
            ));
        }
    };
    let (state_tx, state_rx) = mpsc::unbounded_channel();
    let listener_link = link.clone();
    zk.add_listener(move |state: ZkState| {
        listener_link.on_state(state);
        // An unbounded send never blocks and never panics.
        let _ = state_tx.send(state);
    });
    let auth = config.digest.as_ref().map(|d| d.auth_bytes());
    let acl = if auth.is_some() {
        Acl::creator_all().clone()
    } else {
        Acl::open_unsafe().clone()
    };
    let core = Arc::new(Core {
        zk,
        link,
        view: watch::Sender::new(View::default()),
        timing,
        resolved,
        acl,
        auth,
        orphans: StdMutex::new(Vec::new()),
        servers: servers.clone(),
    });
    // The session is established once the server answers (the client queues requests
    // until then); the Connected event may have come before the listener was added.
    let established = timeout_at(deadline, core.establish()).await;
    let failure = match established {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.into_error(&format!("establishing a session with {servers}"))),
        Err(_) => Some(unreachable(&servers, within, NO_SESSION)),
    };
    if let Some(e) = failure {
        // Never leave the client running: dropping it would not end it.
        let _ = timeout(CLOSE_TIMEOUT, core.zk.close()).await;
        return Err(e);
    }
    core.link.connected.store(true, Ordering::SeqCst);
    core.view.send_replace(View {
        epoch: core.epoch(),
        link: 1,
        ready: true,
        closed: false,
    });
    info!(%servers, base = %core.base(), "ZooKeeper session established");
    let close = CancellationToken::new();
    let span = tracing::debug_span!("simba-zookeeper session", servers = %servers);
    tokio::spawn(
        Adapter::new(core.clone(), state_rx, close.clone())
            .run()
            .instrument(span),
    );
    Ok(Session { core, close })
}

enum Done {
    Established { conn: u64, ok: bool },
    Probe { conn: u64, ok: bool },
    Cleaned(Vec<Orphan>),
}

/// The task that follows the client's state and keeps the view.
struct Adapter {
    core: Arc<Core>,
    states: mpsc::UnboundedReceiver<ZkState>,
    close: CancellationToken,
    tasks: JoinSet<Done>,
    /// Counts `Connected` events (each is a new TCP connection).
    conn: u64,
    /// The connection last authenticated and answered on.
    established: u64,
    establishing: bool,
    probes: usize,
    cleaning: bool,
}

impl Adapter {
    fn new(
        core: Arc<Core>,
        states: mpsc::UnboundedReceiver<ZkState>,
        close: CancellationToken,
    ) -> Self {
        Adapter {
            core,
            states,
            close,
            tasks: JoinSet::new(),
            conn: 0,
            established: 0,
            establishing: false,
            probes: 0,
            cleaning: false,
        }
    }

    fn set_ready(&self, ready: bool) {
        let epoch = self.core.epoch();
        self.core.view.send_if_modified(|v| {
            let mut changed = false;
            if v.epoch != epoch {
                v.epoch = epoch;
                changed = true;
            }
            if v.ready != ready {
                v.ready = ready;
                if ready {
                    v.link += 1;
                }
                changed = true;
            }
            changed
        });
    }

    async fn run(mut self) {
        let mut tick = tokio::time::interval(self.core.timing.probe_interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = self.close.cancelled() => break,
                Some(state) = self.states.recv() => self.on_state(state),
                Some(done) = self.tasks.join_next(), if !self.tasks.is_empty() => {
                    if let Ok(done) = done {
                        self.on_done(done);
                    }
                }
                _ = tick.tick() => self.on_tick(),
            }
        }
        self.tasks.abort_all();
        let core = self.core.clone();
        match timeout(CLOSE_TIMEOUT, core.zk.close()).await {
            Ok(Ok(())) => info!("ZooKeeper session closed"),
            Ok(Err(e)) => {
                warn!("closing the ZooKeeper session failed ({e:?}); it expires on its own")
            }
            Err(_) => warn!("closing the ZooKeeper session timed out; it expires on its own"),
        }
        core.link.connected.store(false, Ordering::SeqCst);
        core.view.send_modify(|v| {
            v.ready = false;
            v.closed = true;
        });
    }

    #[allow(deprecated)]
    fn on_state(&mut self, state: ZkState) {
        debug!(?state, "ZooKeeper state");
        match state {
            ZkState::Connected | ZkState::ConnectedReadOnly => {
                self.conn += 1;
                // Always authenticate again: the client does not replay add_auth.
                self.spawn_establish();
            }
            ZkState::NotConnected => {
                warn!(
                    epoch = self.core.epoch(),
                    "ZooKeeper session expired: its ephemeral nodes are gone; a new session \
                     is being opened"
                );
                self.set_ready(false);
            }
            ZkState::Connecting => {
                debug!("ZooKeeper connection lost; reconnecting");
                self.set_ready(false);
            }
            ZkState::AuthFailed => {
                warn!("ZooKeeper rejected the credentials (AuthFailed)");
                self.set_ready(false);
            }
            _ => self.set_ready(false),
        }
    }

    fn spawn_establish(&mut self) {
        let core = self.core.clone();
        let conn = self.conn;
        self.establishing = true;
        self.tasks.spawn(async move {
            let r = core.establish().await;
            if let Err(e) = &r {
                debug!("re-authenticating after a reconnect failed: {e:?}");
            }
            Done::Established {
                conn,
                ok: r.is_ok(),
            }
        });
    }

    fn on_done(&mut self, done: Done) {
        match done {
            Done::Established { conn, ok } => {
                self.establishing = false;
                if ok && conn == self.conn && self.core.link.connected.load(Ordering::SeqCst) {
                    self.established = conn;
                    self.set_ready(true);
                    // Nodes of services stopped while disconnected block their mutex: go now.
                    self.clean_orphans();
                }
            }
            Done::Probe { conn, ok } => {
                self.probes = self.probes.saturating_sub(1);
                if ok
                    && conn == self.conn
                    && self.established == self.conn
                    && self.core.link.connected.load(Ordering::SeqCst)
                {
                    self.set_ready(true);
                }
            }
            Done::Cleaned(left) => {
                self.cleaning = false;
                if !left.is_empty() {
                    let mut orphans = self.core.orphans.lock().unwrap_or_else(|p| p.into_inner());
                    orphans.extend(left);
                }
            }
        }
    }

    fn on_tick(&mut self) {
        let connected = self.core.link.connected.load(Ordering::SeqCst);
        let ready = self.core.view.borrow().ready;
        if connected && self.established != self.conn && !self.establishing {
            self.spawn_establish();
        }
        if connected && self.probes < MAX_PROBES {
            self.probes += 1;
            let core = self.core.clone();
            let conn = self.conn;
            let confirm = core.link.confirming.load(Ordering::SeqCst) > 0;
            self.tasks.spawn(async move {
                let ok = if confirm {
                    core.confirm().await.is_ok()
                } else {
                    core.call(core.zk.exists("/", false)).await.is_ok()
                };
                Done::Probe { conn, ok }
            });
        }
        if ready && self.core.link.last_good().elapsed() > self.core.timing.stale_after {
            debug!("ZooKeeper probes unanswered; session not ready");
            self.set_ready(false);
        }
        if ready {
            self.clean_orphans();
        }
    }

    /// Starts deleting orphaned nodes unless that is under way already.
    fn clean_orphans(&mut self) {
        if self.cleaning {
            return;
        }
        let orphans = self.core.take_orphans();
        if !orphans.is_empty() {
            self.cleaning = true;
            let core = self.core.clone();
            self.tasks
                .spawn(async move { Done::Cleaned(core.clean(orphans).await) });
        }
    }
}
