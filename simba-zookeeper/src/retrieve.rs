//! [`ZkRetrievalService`]: observe a mutex's owner by watching the latch's children.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use simba_core::backend::{
    OwnershipTracker, Reporter, RetrievalHandle, ServiceHandle, ServiceStatus,
};
use simba_core::{MutexOwner, MutexRetriever, Result};
use tracing::{debug, warn};
use zookeeper_async::ZkError;

use crate::common::{owner_of, sort_latch};
use crate::recipe::{self, Recipe, Schedule};
use crate::session::{BACKEND, Core, Fail, Session};

/// Observes the owner of a mutex on ZooKeeper without contending.
///
/// It watches the children of the mutex node (`get_children` with a watch, or `exists`
/// with a watch while the node does not exist), reads the lowest latch node's data when it
/// changes, and reports every change of owner. After every reconnect it lists and watches
/// again (the client loses watches on reconnect). While disconnected it keeps reporting
/// the last owner it saw.
pub struct ZkRetrievalService {
    /// The server-side path of the mutex node.
    parent: String,
    handle: ServiceHandle,
}

impl fmt::Debug for ZkRetrievalService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkRetrievalService")
            .field("path", &self.path())
            .field("service", &self.handle)
            .finish()
    }
}

impl ZkRetrievalService {
    pub(crate) fn new(
        session: Arc<Session>,
        mutex: String,
        parent: String,
        retriever: Arc<dyn MutexRetriever>,
        mutex_label: bool,
    ) -> Self {
        let out = ServiceStatus::new(Reporter::Retriever(retriever)).with_identity(
            BACKEND,
            &mutex,
            "",
            mutex_label,
        );
        let path = parent.clone();
        let handle = ServiceHandle::new(out, move |tracker, stop| {
            let (schedule, watches) = Schedule::new();
            let observer = Observer {
                core: session.core().clone(),
                parent: path.clone(),
                schedule,
                tracker,
                known_lowest: None,
            };
            Box::pin(recipe::run(observer, watches, stop))
        });
        ZkRetrievalService { parent, handle }
    }

    /// The server-side path of this mutex's node.
    pub fn path(&self) -> &str {
        &self.parent
    }
}

impl RetrievalHandle for ZkRetrievalService {
    fn handle(&self) -> &ServiceHandle {
        &self.handle
    }
}

struct Observer {
    core: Arc<Core>,
    /// The server-side path of the mutex node.
    parent: String,
    /// When the next check is due.
    schedule: Schedule,
    /// Publishes the owner changes (and calls the retriever).
    tracker: OwnershipTracker,
    known_lowest: Option<String>,
}

impl Recipe for Observer {
    /// Whether the check settled the owner (`false`: check again now).
    type Step = bool;

    fn core(&self) -> &Arc<Core> {
        &self.core
    }

    fn schedule(&mut self) -> &mut Schedule {
        &mut self.schedule
    }

    fn check(&mut self) -> impl Future<Output = Result<bool>> + Send {
        self.pass()
    }

    fn after_check(&mut self, r: Result<bool>) {
        match r {
            Ok(true) => self.schedule.settled(),
            Ok(false) => {
                self.schedule.reset_failures();
                self.schedule.wake();
            }
            Err(e) => {
                if self.schedule.failed(self.core.timing().retry) == 1 {
                    warn!("observing the owner failed, retrying: {e}");
                } else {
                    debug!("observing the owner failed again: {e}");
                }
            }
        }
    }
}

impl Observer {
    /// Lists (and watches) the children and reads the owner. `Ok(false)`: check again now.
    async fn pass(&mut self) -> Result<bool> {
        let on_event = self.schedule.begin_check();
        let core = self.core.clone();
        let parent = self.parent.clone();
        let children = match core
            .call(core.zk().get_children_w(&parent, on_event.clone()))
            .await
        {
            Ok(c) => c,
            Err(Fail::Zk(ZkError::NoNode)) => {
                // No mutex node yet: watch for its creation.
                return match core.call(core.zk().exists_w(&parent, on_event)).await {
                    Ok(Some(_)) => Ok(false),
                    Ok(None) => {
                        self.known_lowest = None;
                        self.observe(MutexOwner::NONE);
                        Ok(true)
                    }
                    Err(e) => Err(e.into_error(&format!("watching {parent}"))),
                };
            }
            Err(e) => return Err(e.into_error(&format!("listing {parent}"))),
        };
        let sorted = sort_latch(&children);
        let Some(lowest) = sorted.first() else {
            self.known_lowest = None;
            self.observe(MutexOwner::NONE);
            return Ok(true);
        };
        if self.known_lowest.as_deref() == Some(*lowest) {
            return Ok(true);
        }
        let path = format!("{parent}/{lowest}");
        match core.call(core.zk().get_data(&path, false)).await {
            Ok((data, stat)) => {
                self.known_lowest = Some((*lowest).to_owned());
                self.observe(owner_of(&data, &stat, core.timing().session_timeout));
                Ok(true)
            }
            Err(Fail::Zk(ZkError::NoNode)) => Ok(false),
            Err(e) => Err(e.into_error(&format!("reading the owner {path}"))),
        }
    }

    fn observe(&mut self, owner: MutexOwner) {
        self.tracker.observe(owner);
    }
}
