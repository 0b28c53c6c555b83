//! [`LeaseServiceFactory`]: makes lease services over one store.

use std::fmt;
use std::sync::Arc;

use super::{LeaseConfig, LeaseContendService, LeaseRetrievalService};
use crate::backend::{Reporter, ServiceFactory, contender_id_for};
use crate::error::Result;
use crate::id::{check_common_contender_id, check_common_mutex_name};
#[cfg(doc)]
use crate::service::ContendServiceFactory;
use crate::service::{Contender, MutexRetriever};
use crate::store::LeaseStore;

/// Makes lease contend services over one store.
pub struct LeaseServiceFactory<S> {
    store: Arc<S>,
    /// Shared by the services (one copy, not one per service).
    config: Arc<LeaseConfig>,
}

impl<S: LeaseStore> fmt::Debug for LeaseServiceFactory<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseServiceFactory")
            .field("backend", &self.store.backend())
            .field("config", &self.config)
            .finish()
    }
}

impl<S: LeaseStore> LeaseServiceFactory<S> {
    /// A factory over `store` with `config`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig) if the config does not validate.
    pub fn new(store: S, config: LeaseConfig) -> Result<Self> {
        Self::from_arc(Arc::new(store), config)
    }

    /// A factory over a shared store.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig) if the config does not validate.
    pub fn from_arc(store: Arc<S>, config: LeaseConfig) -> Result<Self> {
        config.validate()?;
        Ok(LeaseServiceFactory {
            store,
            config: Arc::new(config),
        })
    }

    /// The store.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// The config.
    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// A concrete (not boxed) contend service.
    ///
    /// # Errors
    /// As [`ContendServiceFactory::create_contend_service`].
    pub fn contend_service(
        &self,
        mutex: &str,
        contender: Arc<dyn Contender>,
    ) -> Result<LeaseContendService<S>> {
        ServiceFactory::check_mutex_name(self, mutex)?;
        let id = contender_id_for(contender.as_ref())?;
        self.store.check_contender_id(&id)?;
        Ok(LeaseContendService::new(
            self.store.clone(),
            mutex.to_owned(),
            id,
            self.config.clone(),
            Reporter::Contender(contender),
        ))
    }

    /// A concrete (not boxed) retrieval service.
    ///
    /// # Errors
    /// As [`ContendServiceFactory::create_retrieval_service`].
    pub fn retrieval_service(
        &self,
        mutex: &str,
        retriever: Arc<dyn MutexRetriever>,
    ) -> Result<LeaseRetrievalService<S>> {
        ServiceFactory::check_mutex_name(self, mutex)?;
        Ok(LeaseRetrievalService::new(
            self.store.clone(),
            mutex.to_owned(),
            self.config.clone(),
            retriever,
        ))
    }
}

/// The object-safe [`ContendServiceFactory`](crate::ContendServiceFactory) comes with this.
impl<S: LeaseStore> ServiceFactory for LeaseServiceFactory<S> {
    type Contend = LeaseContendService<S>;
    type Retrieve = LeaseRetrievalService<S>;

    fn backend(&self) -> &'static str {
        self.store.backend()
    }

    /// Every lease store can keep a released mutex held ([`LeaseStore::release_after`]).
    fn check_hold(&self) -> Result<()> {
        Ok(())
    }

    /// The shared rules, then the store's ([`LeaseStore::check_mutex_name`]).
    fn check_mutex_name(&self, mutex: &str) -> Result<()> {
        check_common_mutex_name(mutex)?;
        self.store.check_mutex_name(mutex)
    }

    /// The shared rules, then the store's ([`LeaseStore::check_contender_id`]).
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        check_common_contender_id(contender_id)?;
        self.store.check_contender_id(contender_id)
    }

    fn contend_service(&self, mutex: &str, contender: Arc<dyn Contender>) -> Result<Self::Contend> {
        LeaseServiceFactory::contend_service(self, mutex, contender)
    }

    fn retrieval_service(
        &self,
        mutex: &str,
        retriever: Arc<dyn MutexRetriever>,
    ) -> Result<Self::Retrieve> {
        LeaseServiceFactory::retrieval_service(self, mutex, retriever)
    }
}
