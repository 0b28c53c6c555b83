//! [`ServiceFactory`]: the typed factory a backend implements; the object-safe
//! [`ContendServiceFactory`] comes with it.

use std::fmt;
use std::sync::Arc;

use crate::error::Result;
use crate::service::{
    ContendService, ContendServiceFactory, Contender, MutexRetriever, RetrievalService,
    unsupported_hold,
};

/// The factory a backend implements: concrete service types, no boxing. Every
/// `ServiceFactory` is a [`ContendServiceFactory`] (a blanket implementation boxes its
/// services), so a backend writes the factory once and applications can still choose the
/// backend at run time with `Arc<dyn ContendServiceFactory>`.
pub trait ServiceFactory: Send + Sync + fmt::Debug {
    /// The contend service this backend makes.
    type Contend: ContendService + 'static;
    /// The retrieval service this backend makes.
    type Retrieve: RetrievalService + 'static;

    /// The backend's name ([`ContendServiceFactory::backend`]).
    fn backend(&self) -> &'static str;

    /// [`ContendServiceFactory::check_hold`]; by default the backend cannot hold.
    fn check_hold(&self) -> Result<()> {
        Err(unsupported_hold(self.backend()))
    }

    /// [`ContendServiceFactory::check_mutex_name`]; by default the rules every backend
    /// shares.
    fn check_mutex_name(&self, mutex: &str) -> Result<()> {
        crate::check_common_mutex_name(mutex)
    }

    /// [`ContendServiceFactory::check_contender_id`]; by default the rules every backend
    /// shares.
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        crate::check_common_contender_id(contender_id)
    }

    /// A new contend service for `mutex`, reporting to `contender`; not started.
    ///
    /// # Errors
    /// [`Error::InvalidName`](crate::Error::InvalidName) /
    /// [`Error::InvalidContenderId`](crate::Error::InvalidContenderId) for bad input.
    fn contend_service(&self, mutex: &str, contender: Arc<dyn Contender>) -> Result<Self::Contend>;

    /// A new retrieval service for `mutex`, reporting to `retriever`; not started.
    ///
    /// # Errors
    /// [`Error::InvalidName`](crate::Error::InvalidName) for a bad name.
    fn retrieval_service(
        &self,
        mutex: &str,
        retriever: Arc<dyn MutexRetriever>,
    ) -> Result<Self::Retrieve>;
}

impl<F: ServiceFactory> ContendServiceFactory for F {
    fn backend(&self) -> &'static str {
        ServiceFactory::backend(self)
    }

    fn check_hold(&self) -> Result<()> {
        ServiceFactory::check_hold(self)
    }

    fn check_mutex_name(&self, mutex: &str) -> Result<()> {
        ServiceFactory::check_mutex_name(self, mutex)
    }

    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        ServiceFactory::check_contender_id(self, contender_id)
    }

    fn create_contend_service(
        &self,
        mutex: &str,
        contender: Arc<dyn Contender>,
    ) -> Result<Arc<dyn ContendService>> {
        Ok(Arc::new(self.contend_service(mutex, contender)?))
    }

    fn create_retrieval_service(
        &self,
        mutex: &str,
        retriever: Arc<dyn MutexRetriever>,
    ) -> Result<Arc<dyn RetrievalService>> {
        Ok(Arc::new(self.retrieval_service(mutex, retriever)?))
    }
}
