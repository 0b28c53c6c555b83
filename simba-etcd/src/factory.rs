//! [`EtcdFactory`]: one etcd client (one gRPC channel), many contend and retrieval services.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use simba_core::backend::{ServiceFactory, contender_id_for};
use simba_core::{
    Contender, Error, LeaseConfig, MutexRetriever, Result, Semaphore, check_common_mutex_name,
};

use crate::common::{BACKEND, backend_error};
use crate::config::EtcdConfig;
use crate::contend::EtcdContendService;
use crate::permits::EtcdPermitStore;
use crate::retrieve::EtcdRetrievalService;

/// Makes etcd contend and retrieval services that share one client (one gRPC channel to
/// the endpoints). Each contend service has its own lease and its own streams. Cloning is
/// cheap and shares the client.
#[derive(Clone)]
pub struct EtcdFactory {
    client: Client,
    config: Arc<EtcdConfig>,
}

impl fmt::Debug for EtcdFactory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdFactory")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl EtcdFactory {
    /// Validates `config`, connects (authenticating when a user is set) and reads once to
    /// check that a member answers, within [`EtcdConfig::connect_timeout`].
    ///
    /// # Errors
    /// - [`Error::InvalidConfig`] for a bad configuration ([`EtcdConfig::validate`]);
    /// - [`Error::Backend`] with backend `"etcd"` when no member answers in time or the
    ///   credentials are refused.
    ///
    /// # Cancel safety
    /// Dropping the future leaves nothing running.
    pub async fn connect(config: EtcdConfig) -> Result<EtcdFactory> {
        config.validate()?;
        let client = connect_client(&config).await?;
        Ok(EtcdFactory {
            client,
            config: Arc::new(config),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EtcdConfig {
        &self.config
    }

    /// The client, for reads of your own.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The store of this client's semaphores, a
    /// [`PermitStore`](simba_core::backend::PermitStore) for [`Semaphore`] (see the crate
    /// docs, *Semaphores*). Each call makes a new store (its own presence lease and
    /// watches) over this factory's client.
    pub fn permit_store(&self) -> EtcdPermitStore {
        EtcdPermitStore::new(self.client.clone(), self.config.clone())
    }

    /// The lease config of permits: a permit lease (ttl + transition) of
    /// [`EtcdConfig::lease_ttl`], ttl two thirds of it, other settings as
    /// [`LeaseConfig::default`].
    pub fn permit_lease(&self) -> LeaseConfig {
        crate::permits::lease_config(self.config.lease_ttl)
    }

    /// The semaphore `name` with `permits` permits over a new
    /// [`permit_store`](Self::permit_store), timed by [`permit_lease`](Self::permit_lease).
    ///
    /// # Errors
    /// As [`Semaphore::new`].
    pub fn semaphore(&self, name: &str, permits: u32) -> Result<Semaphore> {
        Semaphore::new(self.permit_store(), self.permit_lease(), name, permits)
    }

    /// The key prefix of `mutex`'s waiter keys, `{prefix}/{mutex}/` with `/` and `%` in
    /// the name percent-encoded.
    ///
    /// # Errors
    /// [`Error::InvalidName`] for a bad name.
    pub fn mutex_prefix(&self, mutex: &str) -> Result<String> {
        check_common_mutex_name(mutex)?;
        Ok(self.config.mutex_prefix(mutex))
    }

    /// A concrete (not boxed) contend service for `mutex`; not started.
    ///
    /// # Errors
    /// [`Error::InvalidName`] / [`Error::InvalidContenderId`] for bad input.
    pub fn contend_service(
        &self,
        mutex: &str,
        contender: Arc<dyn Contender>,
    ) -> Result<EtcdContendService> {
        let prefix = self.mutex_prefix(mutex)?;
        let id = contender_id_for(contender.as_ref())?;
        Ok(EtcdContendService::new(
            self.client.clone(),
            self.config.clone(),
            mutex.to_owned(),
            id,
            prefix,
            contender,
        ))
    }

    /// A concrete (not boxed) retrieval service for `mutex`; not started.
    ///
    /// # Errors
    /// [`Error::InvalidName`] for a bad name.
    pub fn retrieval_service(
        &self,
        mutex: &str,
        retriever: Arc<dyn MutexRetriever>,
    ) -> Result<EtcdRetrievalService> {
        let prefix = self.mutex_prefix(mutex)?;
        Ok(EtcdRetrievalService::new(
            self.client.clone(),
            self.config.clone(),
            mutex.to_owned(),
            prefix,
            retriever,
        ))
    }
}

/// A client on `config`'s endpoints that has answered one read.
pub(crate) async fn connect_client(config: &EtcdConfig) -> Result<Client> {
    // HTTP/2 pings find a dead connection (so the channel reconnects) within about
    // three quarters of the lease; a slow link (an answer within half the lease) is not
    // taken for a dead one. The owner's deadline does not depend on them.
    let ping = (config.lease_ttl / 4).max(Duration::from_millis(500));
    let patience = (config.lease_ttl / 2).max(Duration::from_secs(1));
    let mut options = ConnectOptions::new()
        .with_connect_timeout(config.connect_timeout)
        .with_keep_alive(ping, patience)
        .with_keep_alive_while_idle(true);
    if let Some((user, password)) = &config.user {
        options = options.with_user(user.clone(), password.clone());
    }
    #[cfg(feature = "tls")]
    let tls = if config.tls {
        let (tls_options, tls) = crate::tls::options(config)?;
        options = options.with_tls(tls_options);
        Some(tls)
    } else {
        None
    };
    let endpoints = config.endpoints.join(",");
    let connect = async {
        let mut client = Client::connect(&config.endpoints, Some(options))
            .await
            .map_err(|e| backend_error(format!("connecting to {endpoints}"), e))?;
        client
            .get(config.prefix.as_bytes(), None)
            .await
            .map_err(|e| backend_error(format!("a first read from {endpoints}"), e))?;
        Ok::<_, Error>(client)
    };
    let result = match tokio::time::timeout(config.connect_timeout, connect).await {
        Ok(r) => r,
        Err(_) => Err(Error::backend(
            BACKEND,
            format!(
                "connecting to {endpoints}: no answer within {:?}",
                config.connect_timeout
            ),
        )),
    };
    // A certificate problem shows only as no answer (the channel retries in the
    // background): one handshake of our own tells what it is.
    #[cfg(feature = "tls")]
    if let (Err(_), Some(tls), Some(first)) = (&result, &tls, config.endpoints.first())
        && let Some(failure) = crate::tls::diagnose(tls, config, first).await
    {
        return Err(Error::backend_source(
            BACKEND,
            format!("connecting to {endpoints}: {failure}"),
            false,
            failure,
        ));
    }
    result
}

/// The object-safe [`ContendServiceFactory`](simba_core::ContendServiceFactory) comes
/// with this.
impl ServiceFactory for EtcdFactory {
    type Contend = EtcdContendService;
    type Retrieve = EtcdRetrievalService;

    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// Supported: a hold moves the owner key to a lease of its own that ends at the
    /// instant asked for, on the server's clock.
    fn check_hold(&self) -> Result<()> {
        Ok(())
    }

    fn contend_service(&self, mutex: &str, c: Arc<dyn Contender>) -> Result<EtcdContendService> {
        EtcdFactory::contend_service(self, mutex, c)
    }

    fn retrieval_service(
        &self,
        mutex: &str,
        r: Arc<dyn MutexRetriever>,
    ) -> Result<EtcdRetrievalService> {
        EtcdFactory::retrieval_service(self, mutex, r)
    }
}
