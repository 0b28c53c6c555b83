//! [`RedisStore`]: the [`LeaseStore`] over Redis.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::{ClientInterface, ClientLike};
use fred::types::config::{
    ConnectionConfig, PerformanceConfig, ReconnectPolicy, TcpConfig, UnresponsiveConfig,
};
use fred::types::{Builder, Value, scripts::Script};
use simba_core::backend::{
    Lease, LeaseReply, LeaseStore, PERMIT_CLAIM_MS, PermitHolders, PermitStore, held_owner_id,
    hold_millis,
};
use simba_core::events::EventReceiver;
use simba_core::{Error, Result, check_common_contender_id, check_common_mutex_name};
use tokio::task::JoinHandle;
use tracing::debug;

use crate::config::{RedisConfig, ReplicaAcks, WaitMode};
use crate::error::{BACKEND, backend, lease_reply, release_reply};
use crate::keys::KeySpace;
use crate::keys::MESSAGE_SEPARATOR;
use crate::subscriptions::Subscriptions;
use crate::watchdog::Watchdog;

/// How many queued waiters one release tries before it broadcasts instead.
const HANDOFF_TRIES: u32 = 64;

/// How long the waiter a release woke alone may take the mutex (no barging); a waiter that
/// does not take it within this time (it died or is paused) leaves it to the other waiters,
/// whose stores wake them when it lapses (see `subscriptions.rs`).
const HANDOFF_RESERVE: Duration = Duration::from_millis(250);

/// Capacity of fred's pub/sub broadcast channel (its default, 32, loses messages under load).
const BROADCAST_CAPACITY: usize = 4096;

const ACQUIRE_LUA: &str = include_str!("scripts/acquire.lua");
const GUARD_LUA: &str = include_str!("scripts/guard.lua");
const RELEASE_LUA: &str = include_str!("scripts/release.lua");
const OWNER_LUA: &str = include_str!("scripts/owner.lua");
const LEAVE_LUA: &str = include_str!("scripts/leave.lua");
const RELEASE_AFTER_LUA: &str = include_str!("scripts/release_after.lua");
const RETRACT_LUA: &str = include_str!("scripts/retract.lua");
const CONFIRM_LUA: &str = include_str!("scripts/confirm.lua");
// Each semaphore script starts with the common part (key names, pruning, helpers).
const SEM_ACQUIRE_LUA: &str = concat!(
    include_str!("scripts/sem_common.lua"),
    include_str!("scripts/sem_acquire.lua")
);
const SEM_GUARD_LUA: &str = concat!(
    include_str!("scripts/sem_common.lua"),
    include_str!("scripts/sem_guard.lua")
);
const SEM_RELEASE_LUA: &str = concat!(
    include_str!("scripts/sem_common.lua"),
    include_str!("scripts/sem_release.lua")
);
const SEM_OWNERS_LUA: &str = concat!(
    include_str!("scripts/sem_common.lua"),
    include_str!("scripts/sem_owners.lua")
);

/// How soon at the latest a waiter whose free permit is owed to earlier waiters looks again
/// (they were woken and should take theirs by then; it looks sooner when their claims end).
const PERMIT_TURN: Duration = Duration::from_millis(250);

struct Scripts {
    acquire: Script,
    guard: Script,
    release: Script,
    owner: Script,
    leave: Script,
    release_after: Script,
    retract: Script,
    confirm: Script,
    sem_acquire: Script,
    sem_guard: Script,
    sem_release: Script,
    sem_owners: Script,
}

impl Scripts {
    fn new() -> Self {
        Scripts {
            acquire: Script::from_lua(ACQUIRE_LUA),
            guard: Script::from_lua(GUARD_LUA),
            release: Script::from_lua(RELEASE_LUA),
            owner: Script::from_lua(OWNER_LUA),
            leave: Script::from_lua(LEAVE_LUA),
            release_after: Script::from_lua(RELEASE_AFTER_LUA),
            retract: Script::from_lua(RETRACT_LUA),
            confirm: Script::from_lua(CONFIRM_LUA),
            sem_acquire: Script::from_lua(SEM_ACQUIRE_LUA),
            sem_guard: Script::from_lua(SEM_GUARD_LUA),
            sem_release: Script::from_lua(SEM_RELEASE_LUA),
            sem_owners: Script::from_lua(SEM_OWNERS_LUA),
        }
    }

    fn all(&self) -> [(&'static str, &Script); 12] {
        [
            ("acquire", &self.acquire),
            ("guard", &self.guard),
            ("release", &self.release),
            ("owner", &self.owner),
            ("leave", &self.leave),
            ("release_after", &self.release_after),
            ("retract", &self.retract),
            ("confirm", &self.confirm),
            ("semaphore acquire", &self.sem_acquire),
            ("semaphore guard", &self.sem_guard),
            ("semaphore release", &self.sem_release),
            ("semaphore owners", &self.sem_owners),
        ]
    }
}

struct Inner {
    client: Client,
    subscriptions: Option<Arc<Subscriptions>>,
    keys: KeySpace,
    /// `PUBLISH`, or `SPUBLISH` on Redis Cluster.
    publish: &'static str,
    scripts: Scripts,
    watchdog: Watchdog,
    /// Whether acquisitions keep the restart quarantine (see the crate docs).
    quarantine: bool,
    /// Whether acquisitions keep the failover quarantine (see the crate docs).
    failover_quarantine: bool,
    /// Replicas that must confirm each acquisition and renewal (`WAIT`).
    replica_acks: ReplicaAcks,
    /// How long to wait for them (ms).
    replica_ack_timeout_ms: u64,
    tasks: Vec<JoinHandle<()>>,
    config: RedisConfig,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        // fred's connection tasks run until told to quit.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let client = self.client.clone();
            let subscriber = self.subscriptions.as_ref().map(|s| s.client().clone());
            rt.spawn(async move {
                let _ = client.quit().await;
                if let Some(s) = subscriber {
                    let _ = s.quit().await;
                }
            });
        }
    }
}

/// A [`LeaseStore`] on Redis (standalone, Sentinel or Cluster), wire-compatible at the safety
/// level with the JVM Simba.
///
/// One store holds one command connection (per Cluster node) and, in
/// [`WaitMode::PubSub`], one subscriber connection shared by all its mutexes. Cloning is
/// cheap and shares the connections; they close when the last clone is dropped.
///
/// See the [crate documentation](crate) for keys, scripts and messages.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("config", &self.inner.config)
            .field("subscriptions", &self.inner.subscriptions)
            .finish()
    }
}

impl RedisStore {
    /// Connects to the server(s) named by `config`, loads the scripts and, in
    /// [`WaitMode::PubSub`], opens the subscriber connection.
    ///
    /// After this returns, connections that break are re-established forever (with
    /// backoff up to [`RedisConfig::reconnect_max_delay`]); calls made meanwhile fail
    /// after [`RedisConfig::command_timeout`].
    ///
    /// # Errors
    /// - [`Error::InvalidConfig`] if the config does not validate (bad URL, prefix, timeouts);
    /// - [`Error::Backend`] if the server cannot be reached within
    ///   [`RedisConfig::connect_timeout`] (retryable), or rejects the credentials or the
    ///   script load (not retryable).
    ///
    /// # Cancel safety
    /// Dropping the future closes whatever connections it opened.
    pub async fn connect(config: RedisConfig) -> Result<RedisStore> {
        let resolved = config.resolve()?;
        #[cfg(not(feature = "tls"))]
        let fred_config = {
            // Without the feature a TLS URL does not validate: there is nothing to set.
            debug_assert!(resolved.tls.is_none());
            resolved.fred
        };
        #[cfg(feature = "tls")]
        let mut fred_config = resolved.fred;
        let clustered = fred_config.server.is_clustered();
        #[cfg(feature = "tls")]
        let tls_config = match &resolved.tls {
            Some(tls) => {
                let rustls = std::sync::Arc::new(crate::tls::client_config(tls)?);
                fred_config.tls =
                    Some(fred::types::config::TlsConnector::from((*rustls).clone()).into());
                Some((rustls, tls.clone()))
            }
            None => None,
        };
        let first_host = first_host(&fred_config.server);
        let perf = PerformanceConfig {
            default_command_timeout: config.command_timeout,
            broadcast_channel_capacity: BROADCAST_CAPACITY,
            ..PerformanceConfig::default()
        };
        let connection = ConnectionConfig {
            connection_timeout: config.connect_timeout,
            internal_command_timeout: config.command_timeout,
            unresponsive: UnresponsiveConfig {
                max_timeout: Some(config.unresponsive_timeout),
                interval: (config.unresponsive_timeout / 4).max(Duration::from_millis(10)),
            },
            tcp: TcpConfig {
                nodelay: Some(true),
                ..TcpConfig::default()
            },
            ..ConnectionConfig::default()
        };
        let max_delay = u32::try_from(config.reconnect_max_delay.as_millis()).unwrap_or(u32::MAX);
        let mut policy = ReconnectPolicy::new_exponential(0, 50.min(max_delay), max_delay, 2);
        policy.set_jitter(50);
        let mut builder = Builder::from_config(fred_config);
        builder
            .set_performance_config(perf)
            .set_connection_config(connection)
            .set_policy(policy);

        let client = builder
            .build()
            .map_err(|e| backend("building the Redis client", e))?;
        #[cfg(feature = "resolver")]
        if let Some(resolver) = &config.resolver {
            client.set_resolver(Arc::clone(resolver)).await;
        }
        let client_guard = QuitOnDrop(Some(client.clone()));
        if let Err(e) = init(&client, &config).await {
            // The probes below dial the configured host themselves, not where a custom
            // resolver sends the client: they would diagnose the wrong address.
            #[cfg(feature = "resolver")]
            if config.resolver.is_some() {
                return Err(e);
            }
            // Say why, where it can be told: a certificate, or TLS on one side only.
            let (host, port) = first_host;
            #[cfg(feature = "tls")]
            if let Some((rustls, tls)) = tls_config {
                if crate::tls::speaks_plain(&host, port).await {
                    return Err(crate::tls::into_error(
                        crate::tls::failure(crate::tls::TlsProblem::NotOffered),
                        &connecting(&config),
                    ));
                }
                if let Some(failure) = crate::tls::tls_probe(rustls, &host, port, &tls).await {
                    return Err(crate::tls::into_error(failure, &connecting(&config)));
                }
                return Err(e);
            }
            if let Some(failure) = crate::tls::plain_probe(&host, port).await {
                return Err(crate::tls::into_error(failure, &connecting(&config)));
            }
            return Err(e);
        }

        let scripts = Scripts::new();
        for (name, script) in scripts.all() {
            script
                .load(&client)
                .await
                .map_err(|e| backend(&format!("loading the {name} script"), e))?;
        }

        let mut tasks = Vec::new();
        let subscriptions = match config.wait_mode {
            WaitMode::Polling => None,
            WaitMode::PubSub => {
                let subscriber = builder
                    .build_subscriber_client()
                    .map_err(|e| backend("building the Redis subscriber client", e))?;
                #[cfg(feature = "resolver")]
                if let Some(resolver) = &config.resolver {
                    subscriber.set_resolver(Arc::clone(resolver)).await;
                }
                let guard = QuitOnDrop(Some(subscriber.clone()));
                init(&subscriber, &config).await?;
                guard.defuse();
                let subs = Subscriptions::new(subscriber, clustered, watchdog(&config));
                tasks.push(tokio::spawn(subs.clone().run()));
                tasks.push(tokio::spawn(
                    subs.clone().heartbeat(config.heartbeat_interval),
                ));
                Some(subs)
            }
        };
        client_guard.defuse();
        Ok(RedisStore {
            inner: Arc::new(Inner {
                client,
                subscriptions,
                keys: KeySpace::new(&config.key_prefix, config.hash_tag),
                publish: if clustered { "SPUBLISH" } else { "PUBLISH" },
                scripts,
                watchdog: watchdog(&config),
                quarantine: config.restart_quarantine && !clustered,
                failover_quarantine: config.restart_quarantine,
                replica_acks: resolved.replica_acks,
                replica_ack_timeout_ms: u64::try_from(resolved.replica_ack_timeout.as_millis())
                    .unwrap_or(u64::MAX),
                tasks,
                config,
            }),
        })
    }

    /// The arguments of the acquire and guard scripts (see `acquire.lua`).
    fn lease_script_args(&self, id: &str, lease: Lease, handed: bool) -> Result<Vec<String>> {
        let flag = |on: bool| if on { "1" } else { "0" }.to_owned();
        let mut args = lease_args(id, lease, self.inner.publish)?;
        args.push(flag(self.inner.quarantine));
        args.push(flag(handed));
        args.push(flag(self.inner.failover_quarantine));
        args.push(flag(self.inner.replica_acks.is_on()));
        Ok(args)
    }

    /// `sem_release.lua`: releases (or, `leave_only`, only leaves the queue), and wakes
    /// the waiters owed a free permit and the next.
    async fn sem_release(
        &self,
        semaphore: &str,
        contender_id: &str,
        leave_only: bool,
    ) -> Result<bool> {
        check(semaphore, contender_id)?;
        let flag = |on: bool| if on { "1" } else { "0" }.to_owned();
        let args = vec![
            contender_id.to_owned(),
            self.inner.publish.to_owned(),
            HANDOFF_TRIES.to_string(),
            flag(self.inner.subscriptions.is_some()),
            flag(leave_only),
        ];
        let keys = self.inner.keys.semaphore_keys(semaphore);
        let script = &self.inner.scripts.sem_release;
        let reply = self
            .eval_keys("semaphore release script", script, keys, args)
            .await;
        if let Some(subs) = &self.inner.subscriptions {
            subs.request_sweep();
        }
        yes_no("semaphore release script", reply?)
    }

    /// Subscribes `contender_id` to `channels`, in [`WaitMode::PubSub`] (`None` otherwise:
    /// the engine polls).
    async fn subscribe_to(
        &self,
        channels: Vec<String>,
        contender_id: &str,
    ) -> Result<Option<EventReceiver>> {
        let Some(subs) = &self.inner.subscriptions else {
            return Ok(None);
        };
        subs.subscribe(channels, contender_id).await.map(Some)
    }

    /// The configuration this store was connected with.
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// The owner key of `mutex` (`simba:{mutex}` by default), which holds the owner's
    /// contender id; other keys of the mutex start with it.
    pub fn owner_key(&self, mutex: &str) -> String {
        self.inner.keys.owner(mutex)
    }

    /// The command connection (for the floor probes in `floor.rs` and the server reads in
    /// `server.rs`).
    pub(crate) fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The subscriber connection, in [`WaitMode::PubSub`] (for the pub/sub floor).
    #[cfg(feature = "bench")]
    pub(crate) fn subscriber(&self) -> Option<&fred::clients::SubscriberClient> {
        self.inner
            .subscriptions
            .as_deref()
            .map(Subscriptions::client)
    }

    /// Whether pub/sub is sharded (Redis Cluster: `SPUBLISH` / `SSUBSCRIBE`; for the
    /// pub/sub floor).
    #[cfg(feature = "bench")]
    pub(crate) fn sharded(&self) -> bool {
        self.inner.publish == "SPUBLISH"
    }

    async fn eval(
        &self,
        what: &str,
        script: &Script,
        mutex: &str,
        args: Vec<String>,
    ) -> Result<Value> {
        self.eval_keys(what, script, self.inner.keys.keys(mutex), args)
            .await
    }

    async fn eval_keys(
        &self,
        what: &str,
        script: &Script,
        keys: Vec<String>,
        args: Vec<String>,
    ) -> Result<Value> {
        let client = &self.inner.client;
        let watch = self.inner.watchdog.watch(client);
        let result = script
            .evalsha_with_reload::<Value, _, _>(client, keys, args)
            .await;
        watch.finish(&result);
        result.map_err(|e| backend(what, e))
    }

    /// A lease script (acquire or guard) whose write must be confirmed by the replicas
    /// when it left `id` the owner (see *Failover* in the crate docs). `acquire`: the
    /// caller does not hold the mutex, so a new ownership that the replicas did not confirm
    /// is taken back (`retract.lua`) before the error is returned.
    async fn eval_confirmed(
        &self,
        what: &str,
        script: &Script,
        keys: Vec<String>,
        args: Vec<String>,
        id: &str,
        acquire: bool,
    ) -> Result<LeaseReply> {
        if !self.inner.replica_acks.is_on() {
            let reply = self.eval_keys(what, script, keys, args).await?;
            return lease_reply_ext(what, reply).map(|(reply, _, _)| reply);
        }
        let client = &self.inner.client;
        // On Cluster, `WAIT` must reach the primary that took the write: the node of the
        // mutex's slot (all its keys share one hash tag). A single server ignores it.
        let slot = keys
            .first()
            .map(|key| fred::util::redis_keyslot(key.as_bytes()));
        let connections = client.connection_ids();
        let reply = self.eval_keys(what, script, keys.clone(), args).await?;
        let (reply, online, status) = lease_reply_ext(what, reply)?;
        if reply.owner.owner_id != id {
            if !acquire && status == Status::Pending {
                // The caller's key is gone and another contender's acquisition stands in
                // its place, not confirmed yet: it may still be taken back, so it says
                // nothing yet (the caller stays on its deadline, retrying).
                return Err(Error::backend(
                    BACKEND,
                    format!(
                        "{what}: the mutex is held by {}'s acquisition, which its replicas \
                         have not confirmed yet; not counted either way, will retry",
                        reply.owner.owner_id
                    ),
                ));
            }
            return Ok(reply);
        }
        let wanted = match self.inner.replica_acks {
            ReplicaAcks::Count(n) => n,
            ReplicaAcks::AllOnline => u32::try_from(online.max(1)).unwrap_or(u32::MAX),
        };
        let watch = self.inner.watchdog.watch(client);
        let acked = client
            .custom::<i64, String>(
                fred::cmd!("WAIT", hash: fred::types::ClusterHash::from(slot)),
                vec![
                    wanted.to_string(),
                    self.inner.replica_ack_timeout_ms.to_string(),
                ],
            )
            .await;
        watch.finish(&acked);
        let refused = match acked {
            Err(e) => Some(backend(&format!("{what}: WAIT for the replicas"), e)),
            // WAIT covers the writes made on *its* connection: had fred replaced the
            // connection between the script and WAIT, WAIT would vouch for nothing.
            Ok(_) if client.connection_ids() != connections => Some(Error::backend(
                BACKEND,
                format!(
                    "{what}: the connection was replaced between the write and the replica \
                     check; not counted, will retry"
                ),
            )),
            Ok(acked) if acked < i64::from(wanted) => Some(Error::backend(
                BACKEND,
                format!(
                    "{what}: only {acked} of the {wanted} replica(s) asked for confirmed it \
                     within {} ms, so a failover could lose it; not counted, will retry. If \
                     this server has fewer replicas, lower replicaAcks (0 turns the check off)",
                    self.inner.replica_ack_timeout_ms
                ),
            )),
            Ok(_) => None,
        };
        let fence = reply.owner.fence.to_string();
        match refused {
            Some(e) => {
                // Only an acquisition's new ownership is taken back: a renewal's caller
                // still counts on its previous one until its deadline.
                if acquire && status == Status::New {
                    let args = vec![id.to_owned(), fence, self.inner.publish.to_owned()];
                    match self
                        .eval_keys("retract script", &self.inner.scripts.retract, keys, args)
                        .await
                    {
                        Ok(_) => {
                            debug!(%id, "took back an acquisition the replicas did not confirm")
                        }
                        Err(e) => {
                            debug!(%id, "could not take back an unconfirmed acquisition: {e}")
                        }
                    }
                }
                Err(e)
            }
            None => {
                if status == Status::New {
                    // Confirmed: no longer pending, and announced (`acquired@@<id>`). Not
                    // awaited: nothing depends on it but the waiters' wake-up.
                    let store = self.clone();
                    let id = id.to_owned();
                    tokio::spawn(async move {
                        let args = vec![id, fence, store.inner.publish.to_owned()];
                        let script = &store.inner.scripts.confirm;
                        if let Err(e) = store.eval_keys("confirm script", script, keys, args).await
                        {
                            debug!("announcing a confirmed acquisition failed: {e}");
                        }
                    });
                }
                Ok(reply)
            }
        }
    }
}

/// What a lease script says of the call besides the owner (its 8th value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    /// The caller just became the owner.
    New,
    /// The caller owned the mutex already.
    Renewed,
    /// Another contender owns it by an acquisition its replicas have not confirmed yet.
    Pending,
    /// Anything else.
    Other,
}

/// A lease script's reply: the owner, the replicas online at the primary (-1: not
/// counted), and the [`Status`].
fn lease_reply_ext(what: &str, reply: Value) -> Result<(LeaseReply, i64, Status)> {
    let Value::Array(mut items) = reply else {
        return lease_reply(what, reply).map(|r| (r, -1, Status::Other));
    };
    if items.len() != 8 {
        return lease_reply(what, Value::Array(items)).map(|r| (r, -1, Status::Other));
    }
    let status = match items.pop() {
        Some(Value::String(s)) if &*s == "new" => Status::New,
        Some(Value::String(s)) if &*s == "renewed" => Status::Renewed,
        Some(Value::String(s)) if &*s == "pending" => Status::Pending,
        Some(Value::Bytes(b)) if &b[..] == b"new" => Status::New,
        Some(Value::Bytes(b)) if &b[..] == b"renewed" => Status::Renewed,
        Some(Value::Bytes(b)) if &b[..] == b"pending" => Status::Pending,
        _ => Status::Other,
    };
    let online = items.pop().and_then(|v| v.as_i64()).unwrap_or(-1);
    Ok((lease_reply(what, Value::Array(items))?, online, status))
}

/// Quits a client when dropped, unless defused: a `connect` that fails or is cancelled
/// halfway leaves no connection task behind.
struct QuitOnDrop<C: ClientLike + 'static>(Option<C>);

impl<C: ClientLike + 'static> QuitOnDrop<C> {
    fn defuse(mut self) {
        self.0 = None;
    }
}

impl<C: ClientLike + 'static> Drop for QuitOnDrop<C> {
    fn drop(&mut self) {
        if let Some(c) = self.0.take()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(async move {
                let _ = c.quit().await;
            });
        }
    }
}

fn connecting(config: &RedisConfig) -> String {
    format!("connecting to {}", crate::config::redact_url(&config.url))
}

/// The first address a client dials: the host, the first sentinel, the first Cluster node.
fn first_host(server: &fred::types::config::ServerConfig) -> (String, u16) {
    use fred::types::config::ServerConfig;
    let first = match server {
        ServerConfig::Centralized { server } => Some(server),
        ServerConfig::Clustered { hosts, .. } | ServerConfig::Sentinel { hosts, .. } => {
            hosts.first()
        }
    };
    first.map_or_else(
        || ("127.0.0.1".to_owned(), 6379),
        |s| (s.host.to_string(), s.port),
    )
}

/// Connects `client` within the connect timeout.
///
/// Behind Sentinel, a connection can fail while a failover is being completed (the
/// sentinels name a primary that is not ready yet, or close the clients of the node they
/// reconfigure: "Broken pipe"), so Sentinel errors are retried until the timeout.
async fn init<C: ClientLike>(client: &C, config: &RedisConfig) -> Result<()> {
    let deadline = tokio::time::Instant::now() + config.connect_timeout;
    let sentinel = matches!(
        client.client_config().server,
        fred::types::config::ServerConfig::Sentinel { .. }
    );
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(left, client.init()).await {
            Ok(Ok(_handle)) => return Ok(()),
            Ok(Err(e))
                if sentinel
                    && e.kind() != &fred::error::ErrorKind::Auth
                    && tokio::time::Instant::now() + Duration::from_millis(100) < deadline =>
            {
                debug!(error = %e, "connecting through the sentinels failed, retrying");
                let _ = client.quit().await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(Err(e)) => return Err(backend(&connecting(config), e)),
            Err(_) => {
                return Err(Error::backend(
                    BACKEND,
                    format!(
                        "{} did not succeed within {:?}",
                        connecting(config),
                        config.connect_timeout
                    ),
                ));
            }
        }
    }
}

fn watchdog(config: &RedisConfig) -> Watchdog {
    Watchdog::new(
        config.command_timeout,
        config.connect_timeout.max(config.unresponsive_timeout),
    )
}

fn check(mutex: &str, contender_id: &str) -> Result<()> {
    check_name(mutex)?;
    check_id(contender_id)
}

/// The shared rules (which refuse `{` and `}` on every backend: they would make a Redis
/// Cluster hash tag of part of the name, and every key of a mutex must hash to one slot:
/// `P:{M}`).
fn check_name(mutex: &str) -> Result<()> {
    check_common_mutex_name(mutex)
}

/// The shared rules, and no [`MESSAGE_SEPARATOR`] (`@@`): messages are `event@@id`.
fn check_id(contender_id: &str) -> Result<()> {
    check_common_contender_id(contender_id)?;
    if contender_id.contains(MESSAGE_SEPARATOR) {
        return Err(Error::InvalidContenderId {
            id: contender_id.to_owned(),
            reason: format!(
                "contains `{MESSAGE_SEPARATOR}`, the separator of simba's Redis messages"
            ),
        });
    }
    Ok(())
}

fn lease_args(contender_id: &str, lease: Lease, publish: &str) -> Result<Vec<String>> {
    if lease.total() < Duration::from_millis(1) {
        return Err(Error::config(
            "ttl",
            format!(
                "the lease ttl + transition = {:?} is shorter than 1 ms",
                lease.total()
            ),
        ));
    }
    Ok(vec![
        contender_id.to_owned(),
        lease.ttl_ms().to_string(),
        lease.transition_ms().to_string(),
        publish.to_owned(),
    ])
}

impl RedisStore {
    /// Whether acquisitions keep the restart quarantine.
    pub(crate) fn keeps_restart_quarantine(&self) -> bool {
        self.inner.quarantine
    }

    /// The boot marker's key.
    pub(crate) fn boot_key(&self) -> String {
        self.inner.keys.boot()
    }
}

impl LeaseStore for RedisStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// The shared rules only (`{` and `}` are refused by them).
    fn check_mutex_name(&self, mutex: &str) -> Result<()> {
        check_name(mutex)
    }

    /// No [`MESSAGE_SEPARATOR`] (`@@`).
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        check_id(contender_id)
    }

    async fn acquire(&self, mutex: &str, contender_id: &str, lease: Lease) -> Result<LeaseReply> {
        check(mutex, contender_id)?;
        let mut keys = self.inner.keys.keys(mutex);
        if self.inner.quarantine {
            keys.push(self.inner.keys.boot());
        }
        let handed = self.inner.subscriptions.as_ref().is_some_and(|subs| {
            subs.take_handoff(&self.inner.keys.contender_channel(mutex, contender_id))
        });
        let args = self.lease_script_args(contender_id, lease, handed)?;
        self.eval_confirmed(
            "acquire script",
            &self.inner.scripts.acquire,
            keys,
            args,
            contender_id,
            true,
        )
        .await
    }

    async fn guard(&self, mutex: &str, contender_id: &str, lease: Lease) -> Result<LeaseReply> {
        check(mutex, contender_id)?;
        let args = self.lease_script_args(contender_id, lease, false)?;
        self.eval_confirmed(
            "guard script",
            &self.inner.scripts.guard,
            self.inner.keys.keys(mutex),
            args,
            contender_id,
            false,
        )
        .await
    }

    async fn release(&self, mutex: &str, contender_id: &str) -> Result<bool> {
        check(mutex, contender_id)?;
        let args = vec![
            contender_id.to_owned(),
            self.inner.publish.to_owned(),
            HANDOFF_TRIES.to_string(),
            HANDOFF_RESERVE.as_millis().to_string(),
        ];
        let reply = self
            .eval("release script", &self.inner.scripts.release, mutex, args)
            .await;
        if let Some(subs) = &self.inner.subscriptions {
            subs.request_sweep();
        }
        let (released, waiter) = release_reply(reply?)?;
        if released {
            if waiter.is_empty() {
                debug!(%mutex, "released; no live waiter in the queue, broadcast instead");
            } else {
                debug!(%mutex, %waiter, "released and handed to waiter");
            }
        }
        Ok(released)
    }

    /// One script (`release_after.lua`): owner-checked, the owner key keeps the JVM
    /// Simba's rules (an id with a `PX` lease, taken only with `NX`) and holds the hold's
    /// id ([`held_owner_id`]) until it expires.
    async fn release_after(&self, mutex: &str, contender_id: &str, hold: Duration) -> Result<bool> {
        check(mutex, contender_id)?;
        let ms = hold_millis(hold)?;
        if ms == 0 {
            return self.release(mutex, contender_id).await;
        }
        let args = vec![
            contender_id.to_owned(),
            held_owner_id(contender_id),
            ms.to_string(),
        ];
        let reply = self
            .eval(
                "release-after script",
                &self.inner.scripts.release_after,
                mutex,
                args,
            )
            .await?;
        yes_no("release-after script", reply)
    }

    async fn owner(&self, mutex: &str) -> Result<LeaseReply> {
        check_common_mutex_name(mutex)?;
        let reply = self
            .eval("owner script", &self.inner.scripts.owner, mutex, vec![])
            .await?;
        lease_reply("owner script", reply)
    }

    async fn subscribe(&self, mutex: &str, contender_id: &str) -> Result<Option<EventReceiver>> {
        check(mutex, contender_id)?;
        let channels = vec![
            self.inner.keys.owner(mutex),
            self.inner.keys.contender_channel(mutex, contender_id),
            self.inner.keys.handoff_channel(mutex),
        ];
        self.subscribe_to(channels, contender_id).await
    }

    async fn leave(&self, mutex: &str, contender_id: &str) -> Result<()> {
        check(mutex, contender_id)?;
        let result = self
            .eval(
                "leave script",
                &self.inner.scripts.leave,
                mutex,
                vec![contender_id.to_owned()],
            )
            .await;
        if let Some(subs) = &self.inner.subscriptions {
            subs.request_sweep();
        }
        result.map(|_| ())
    }
}

impl PermitStore for RedisStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// The shared rules only, as for a mutex name (`{` and `}` are refused by them).
    fn check_semaphore_name(&self, semaphore: &str) -> Result<()> {
        check_name(semaphore)
    }

    /// No [`MESSAGE_SEPARATOR`] (`@@`).
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        check_id(contender_id)
    }

    /// [`PERMIT_CLAIM_MS`]: a woken waiter takes its permit within a round trip or two.
    fn permit_claim(&self) -> Option<Duration> {
        Some(Duration::from_millis(PERMIT_CLAIM_MS.unsigned_abs()))
    }

    /// `sem_acquire.lua` (see the crate docs, *Semaphores*).
    async fn permit_acquire(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> Result<LeaseReply> {
        check(semaphore, contender_id)?;
        let mut keys = self.inner.keys.semaphore_keys(semaphore);
        let mut args = lease_args(contender_id, lease, self.inner.publish)?;
        args.truncate(3);
        args.push(permits.to_string());
        args.push(PERMIT_TURN.as_millis().to_string());
        args.push(if self.inner.quarantine { "1" } else { "0" }.to_owned());
        args.push(PERMIT_CLAIM_MS.to_string());
        if self.inner.quarantine {
            keys.push(self.inner.keys.boot());
        }
        let reply = self
            .eval_keys(
                "semaphore acquire script",
                &self.inner.scripts.sem_acquire,
                keys,
                args,
            )
            .await?;
        permit_reply("semaphore acquire script", semaphore, permits, reply)
    }

    /// `sem_guard.lua`: renews (starting the claims of waiters owed a free permit, as a
    /// renewal by `sem_acquire.lua` does), never takes.
    async fn permit_guard(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> Result<LeaseReply> {
        check(semaphore, contender_id)?;
        let mut args = lease_args(contender_id, lease, self.inner.publish)?;
        args.truncate(3);
        args.push(PERMIT_CLAIM_MS.to_string());
        let keys = self.inner.keys.semaphore_keys(semaphore);
        let reply = self
            .eval_keys(
                "semaphore guard script",
                &self.inner.scripts.sem_guard,
                keys,
                args,
            )
            .await?;
        permit_reply("semaphore guard script", semaphore, permits, reply)
    }

    /// `sem_release.lua`: owner-checked; wakes the waiters owed a free permit and the next
    /// (`simba_core::backend::permit_wakes`).
    async fn permit_release(&self, semaphore: &str, contender_id: &str) -> Result<bool> {
        self.sem_release(semaphore, contender_id, false).await
    }

    async fn permit_owners(&self, semaphore: &str) -> Result<PermitHolders> {
        check_name(semaphore)?;
        let keys = self.inner.keys.semaphore_keys(semaphore);
        let reply = self
            .eval_keys(
                "semaphore owners script",
                &self.inner.scripts.sem_owners,
                keys,
                vec![],
            )
            .await?;
        crate::error::permit_holders(reply)
    }

    async fn permit_subscribe(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> Result<Option<EventReceiver>> {
        check(semaphore, contender_id)?;
        let keys = &self.inner.keys;
        let channels = vec![
            keys.semaphore_keys(semaphore).swap_remove(0),
            keys.semaphore_waiter_channel(semaphore, contender_id),
        ];
        self.subscribe_to(channels, contender_id).await
    }

    /// The release script, leaving the queue only: a permit the caller holds is left to
    /// its lease (the caller lost track of it).
    async fn permit_leave(&self, semaphore: &str, contender_id: &str) -> Result<()> {
        self.sem_release(semaphore, contender_id, true)
            .await
            .map(|_| ())
    }
}

/// A script's `1` (true) or `0` (false).
fn yes_no(what: &str, reply: Value) -> Result<bool> {
    match reply {
        Value::Integer(1) => Ok(true),
        Value::Integer(0) => Ok(false),
        other => Err(crate::error::bad_reply(
            what,
            format_args!("expected 0 or 1, got {other:?}"),
        )),
    }
}

/// A semaphore acquire or guard script's reply (see `sem_acquire.lua`): a lease reply, or
/// the holders' other count.
fn permit_reply(what: &str, semaphore: &str, asked: u32, reply: Value) -> Result<LeaseReply> {
    let Value::Array(mut items) = reply else {
        return Err(crate::error::bad_reply(
            what,
            format_args!("expected an array, got {reply:?}"),
        ));
    };
    if items.len() != 8 {
        return Err(crate::error::bad_reply(
            what,
            format_args!("expected 8 values, got {}", items.len()),
        ));
    }
    let count = items.pop().and_then(|v| v.as_i64());
    let status = items.pop().and_then(|v| v.as_string());
    if status.as_deref() == Some("mismatch") {
        let existing = count
            .and_then(|c| u32::try_from(c).ok())
            .ok_or_else(|| crate::error::bad_reply(what, "a mismatch without a valid count"))?;
        return Err(Error::PermitsMismatch {
            semaphore: semaphore.to_owned(),
            asked,
            existing,
        });
    }
    lease_reply(what, Value::Array(items))
}
