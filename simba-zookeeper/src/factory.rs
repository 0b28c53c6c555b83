//! [`ZkFactory`]: one ZooKeeper session, many contend and retrieval services.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use simba_core::backend::{ServiceFactory, contender_id_for};
use simba_core::{
    Contender, LeaseConfig, MutexRetriever, Result, Semaphore, check_common_mutex_name,
};

use crate::config::{ZkConfig, encode_name};
use crate::contend::ZkContendService;
use crate::permits::{self, ZkPermitStore};
use crate::retrieve::ZkRetrievalService;
use crate::session::{self, BACKEND, Session};

/// Makes ZooKeeper contend and retrieval services that share **one session**.
///
/// One session per factory is what ZooKeeper deployments expect (a server tracks and
/// pings every session, and `maxClientCnxns` limits connections per host), and what the
/// other backends do (one connection set per factory). Every service of a factory
/// follows the same session: when it expires, each owner reports
/// [`LossReason::SessionLost`](simba_core::LossReason::SessionLost) and contends again in
/// the new session. Build one factory per process (or per independent failure domain) and
/// share it; cloning is cheap and shares the session.
///
/// The session ends when the last clone of the factory and the last service made by it
/// are dropped (closed in the background), or at once with [`ZkFactory::close`].
#[derive(Clone)]
pub struct ZkFactory {
    session: Arc<Session>,
    config: Arc<ZkConfig>,
}

impl fmt::Debug for ZkFactory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkFactory")
            .field("config", &self.config)
            .field("session", &self.session)
            .finish()
    }
}

impl ZkFactory {
    /// Validates `config`, connects, authenticates and waits until the session is
    /// established, all within [`ZkConfig::connect_timeout`].
    ///
    /// # Errors
    /// - [`Error::InvalidConfig`](simba_core::Error::InvalidConfig) for a bad configuration
    ///   (see [`ZkConfig::validate`]);
    /// - [`Error::Backend`](simba_core::Error::Backend) with backend `"zookeeper"` when a
    ///   host cannot be resolved, when no session is established within the connect
    ///   timeout (server down, unreachable, hung or partitioned; `retryable` is true), or
    ///   when the server rejects the credentials.
    ///
    /// # Cancel safety
    /// Dropping the future before it completes leaves nothing running, except in one case
    /// zookeeper-async cannot undo: a client whose TCP connection was made but whose
    /// session was not established is closed best-effort (bounded to 2 s).
    pub async fn connect(config: ZkConfig) -> Result<ZkFactory> {
        let session = session::connect(&config).await?;
        Ok(ZkFactory {
            session: Arc::new(session),
            config: Arc::new(config),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ZkConfig {
        &self.config
    }

    /// Whether the session is connected and answering now.
    pub fn is_connected(&self) -> bool {
        let view = *self.session.core().view().borrow();
        view.ready && !view.closed
    }

    /// The session timeout in effect: [`ZkConfig::session_timeout`], or the lower value the
    /// server granted (its `maxSessionTimeout`), which the owner's local deadline then uses.
    pub fn session_timeout(&self) -> Duration {
        self.session.core().timing().session_timeout
    }

    /// How many times the session expired since [`ZkFactory::connect`] (each time, the
    /// factory opened a new session and its services contended again).
    pub fn session_expirations(&self) -> u64 {
        self.session.core().epoch()
    }

    /// The server-side path of `mutex`'s node: `{chroot}{root}/{mutex}`, with `/`, `%` and
    /// characters ZooKeeper refuses in the name percent-encoded.
    ///
    /// # Errors
    /// [`Error::InvalidName`](simba_core::Error::InvalidName) for a bad name.
    pub fn mutex_path(&self, mutex: &str) -> Result<String> {
        check_common_mutex_name(mutex)?;
        Ok(format!(
            "{}/{}",
            self.session.core().base(),
            encode_name(mutex)
        ))
    }

    /// A concrete (not boxed) contend service for `mutex`; not started.
    ///
    /// # Errors
    /// [`Error::InvalidName`](simba_core::Error::InvalidName) /
    /// [`Error::InvalidContenderId`](simba_core::Error::InvalidContenderId) for bad input.
    pub fn contend_service(
        &self,
        mutex: &str,
        contender: Arc<dyn Contender>,
    ) -> Result<ZkContendService> {
        let parent = self.mutex_path(mutex)?;
        let id = contender_id_for(contender.as_ref())?;
        Ok(ZkContendService::new(
            self.session.clone(),
            mutex.to_owned(),
            id,
            parent,
            contender,
            self.config.metrics_mutex_label,
        ))
    }

    /// A concrete (not boxed) retrieval service for `mutex`; not started.
    ///
    /// # Errors
    /// [`Error::InvalidName`](simba_core::Error::InvalidName) for a bad name.
    pub fn retrieval_service(
        &self,
        mutex: &str,
        retriever: Arc<dyn MutexRetriever>,
    ) -> Result<ZkRetrievalService> {
        let parent = self.mutex_path(mutex)?;
        Ok(ZkRetrievalService::new(
            self.session.clone(),
            mutex.to_owned(),
            parent,
            retriever,
            self.config.metrics_mutex_label,
        ))
    }

    /// The store of this session's semaphores, a
    /// [`PermitStore`](simba_core::backend::PermitStore) for [`Semaphore`] (see the crate
    /// docs, *Semaphores*), with the claim window [`ZkConfig::permit_claim`].
    pub fn permit_store(&self) -> ZkPermitStore {
        ZkPermitStore::new(self.session.clone(), self.config.permit_claim)
    }

    /// The lease config for permits of this session: the longest lease the store accepts
    /// (half the session timeout, ttl two thirds of it), other settings as
    /// [`LeaseConfig::default`]. A longer lease is refused with
    /// [`Error::Unsupported`](simba_core::Error::Unsupported): the session could expire,
    /// and the permit node go, while its holder still believes.
    pub fn permit_lease(&self) -> LeaseConfig {
        permits::lease_config(self.session_timeout())
    }

    /// The semaphore `name` with `permits` permits on this session, timed by
    /// [`ZkFactory::permit_lease`].
    ///
    /// # Errors
    /// As [`Semaphore::new`].
    pub fn semaphore(&self, name: &str, permits: u32) -> Result<Semaphore> {
        Semaphore::new(self.permit_store(), self.permit_lease(), name, permits)
    }

    /// Closes the session now. Owners among this factory's services report
    /// [`LossReason::SessionLost`](simba_core::LossReason::SessionLost) and their nodes
    /// disappear; stop the services first for an orderly
    /// [`Released`](simba_core::LossReason::Released). Services made by this factory stop
    /// working (every attempt fails) until they are stopped.
    ///
    /// # Errors
    /// Never fails today: if the server does not confirm within 2 s, the session expires
    /// on its own after the session timeout.
    ///
    /// # Cancel safety
    /// Dropping the future still closes the session, in the background.
    pub async fn close(&self) -> Result<()> {
        self.session.close().await;
        Ok(())
    }
}

/// The object-safe [`ContendServiceFactory`](simba_core::ContendServiceFactory) comes
/// with this.
impl ServiceFactory for ZkFactory {
    type Contend = ZkContendService;
    type Retrieve = ZkRetrievalService;

    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// Not supported: ZooKeeper has sessions, not leases.
    fn check_hold(&self) -> Result<()> {
        Err(crate::common::hold_unsupported())
    }

    fn contend_service(&self, mutex: &str, c: Arc<dyn Contender>) -> Result<ZkContendService> {
        ZkFactory::contend_service(self, mutex, c)
    }

    fn retrieval_service(
        &self,
        mutex: &str,
        r: Arc<dyn MutexRetriever>,
    ) -> Result<ZkRetrievalService> {
        ZkFactory::retrieval_service(self, mutex, r)
    }
}
