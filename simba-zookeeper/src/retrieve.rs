//! [`ZkRetrievalService`]: observe a mutex's owner by watching the latch's children.

use std::fmt;
use std::sync::Arc;

use simba_core::backend::{BoxFuture, OwnershipTracker, Reporter, ServiceRunner, ServiceStatus};
use simba_core::{MutexOwner, MutexRetriever, MutexState, Result, RetrievalService};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, warn};
use zookeeper_async::{WatchedEvent, ZkError};

use crate::common::{owner_of, sleep_until_opt, sort_latch};
use crate::session::{BACKEND, Core, Fail, Session, View};

struct Shared {
    session: Arc<Session>,
    mutex: String,
    parent: String,
    out: ServiceStatus,
}

/// Observes the owner of a mutex on ZooKeeper without contending.
///
/// It watches the children of the mutex node (`get_children` with a watch, or `exists`
/// with a watch while the node does not exist), reads the lowest latch node's data when it
/// changes, and reports every change of owner. After every reconnect it lists and watches
/// again (the client loses watches on reconnect). While disconnected it keeps reporting
/// the last owner it saw.
pub struct ZkRetrievalService {
    shared: Arc<Shared>,
    runner: ServiceRunner,
}

impl fmt::Debug for ZkRetrievalService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkRetrievalService")
            .field("mutex", &self.shared.mutex)
            .field("path", &self.shared.parent)
            .field("state", &self.shared.out.current_owner())
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
        ZkRetrievalService {
            shared: Arc::new(Shared {
                session,
                mutex,
                parent,
                out,
            }),
            runner: ServiceRunner::new(),
        }
    }

    /// The server-side path of this mutex's node.
    pub fn path(&self) -> &str {
        &self.shared.parent
    }
}

impl RetrievalService for ZkRetrievalService {
    fn mutex(&self) -> &str {
        &self.shared.mutex
    }

    fn start(&self) -> Result<()> {
        let shared = self.shared.clone();
        let what = format!("retrieval service for mutex {:?}", shared.mutex);
        self.runner.start(what, move |stop| {
            let tracker = shared.out.begin();
            let span =
                tracing::debug_span!("simba-retriever", backend = BACKEND, mutex = %shared.mutex);
            Observer::new(shared, tracker, stop).run().instrument(span)
        })
    }

    fn stop(&self) -> BoxFuture<'_, Result<()>> {
        // Signalled now, so that dropping the returned future still stops; the driver
        // deletes what it created (dropping the service does the same, in the background).
        self.runner.stop()
    }

    fn state(&self) -> watch::Receiver<MutexState> {
        self.shared.out.owner_state()
    }
}

struct Observer {
    stop: CancellationToken,
    view: watch::Receiver<View>,
    events: mpsc::UnboundedReceiver<u64>,
    inner: Inner,
}

struct Inner {
    shared: Arc<Shared>,
    core: Arc<Core>,
    tx: mpsc::UnboundedSender<u64>,
    generation: u64,
    link: u64,
    /// Publishes the owner changes (and calls the retriever).
    tracker: OwnershipTracker,
    known_lowest: Option<String>,
    dirty: bool,
    retry_at: Option<Instant>,
    failures: u32,
}

impl Observer {
    fn new(shared: Arc<Shared>, tracker: OwnershipTracker, stop: CancellationToken) -> Self {
        let core = shared.session.core().clone();
        let (tx, events) = mpsc::unbounded_channel();
        Observer {
            stop,
            view: core.view(),
            events,
            inner: Inner {
                shared,
                core,
                tx,
                generation: 0,
                link: 0,
                tracker,
                known_lowest: None,
                dirty: true,
                retry_at: None,
                failures: 0,
            },
        }
    }

    async fn run(mut self) {
        loop {
            if self.stop.is_cancelled() {
                break;
            }
            let view = *self.view.borrow_and_update();
            let inner = &mut self.inner;
            if view.link != inner.link {
                inner.link = view.link;
                inner.dirty = true;
                inner.retry_at = None;
            }
            let due =
                inner.dirty && view.ready && inner.retry_at.is_none_or(|t| t <= Instant::now());
            if due {
                let r = tokio::select! {
                    biased;
                    () = self.stop.cancelled() => break,
                    r = inner.check() => r,
                };
                inner.after_check(r);
                continue;
            }
            let retry_at = inner.retry_at.filter(|_| inner.dirty);
            tokio::select! {
                biased;
                () = self.stop.cancelled() => break,
                _ = self.view.changed() => {}
                Some(generation) = self.events.recv() => {
                    if generation == inner.generation {
                        inner.dirty = true;
                        inner.retry_at = None;
                    }
                }
                () = sleep_until_opt(retry_at) => {}
            }
        }
    }
}

impl Inner {
    fn after_check(&mut self, r: Result<bool>) {
        match r {
            Ok(settled) => {
                self.failures = 0;
                self.dirty = !settled;
                self.retry_at = None;
            }
            Err(e) => {
                self.failures = self.failures.saturating_add(1);
                if self.failures == 1 {
                    warn!("observing the owner failed, retrying: {e}");
                }
                self.dirty = true;
                self.retry_at = Some(Instant::now() + self.core.timing().retry);
            }
        }
    }

    /// Lists (and watches) the children and reads the owner. `Ok(false)`: check again now.
    async fn check(&mut self) -> Result<bool> {
        self.generation += 1;
        let core = self.core.clone();
        let parent = self.shared.parent.clone();
        let generation = self.generation;
        let tx = self.tx.clone();
        let on_event = move |_e: WatchedEvent| {
            let _ = tx.send(generation);
        };
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
