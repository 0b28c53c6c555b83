//! A loopback TCP proxy that injects network faults between a client and a server.
//!
//! ```no_run
//! # async fn demo(server: std::net::SocketAddr) -> std::io::Result<()> {
//! use simba_test_kit::proxy::FaultProxy;
//! let proxy = FaultProxy::start(server).await?;
//! // point the client at proxy.addr() instead of the server
//! proxy.blackhole(true); // the network hangs
//! proxy.cut(); // every open connection is closed
//! proxy.heal(); // back to normal
//! # Ok(()) }
//! ```
//!
//! The proxy never panics on I/O errors: a failing connection is closed and counted out.
//! Dropping the [`FaultProxy`] closes the listener and every connection.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use simba_core::backend::BoxFuture;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::suite::{Fault, SetupError};

/// Shared state between the handle and the proxy tasks.
#[derive(Debug)]
struct Shared {
    upstream: SocketAddr,
    refuse: AtomicBool,
    blackhole: watch::Sender<bool>,
    latency: watch::Sender<Duration>,
    /// Bumped by `cut()`; every connection closes when it changes.
    cuts: watch::Sender<u64>,
    live: AtomicUsize,
    accepted: AtomicU64,
}

/// A TCP proxy on `127.0.0.1` that forwards to one upstream address and can cut,
/// refuse, stall or delay connections on command.
///
/// All controls take effect immediately, also for connections that are already open
/// (except [`refuse`](Self::refuse), which only concerns new connections).
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.shared.upstream)
            .field("refuse", &self.shared.refuse.load(Ordering::SeqCst))
            .field("blackhole", &*self.shared.blackhole.borrow())
            .field("latency", &*self.shared.latency.borrow())
            .field("connections", &self.connection_count())
            .finish()
    }
}

impl FaultProxy {
    /// Starts a proxy for `upstream` on a free loopback port. It connects to the upstream
    /// once per accepted client connection.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            refuse: AtomicBool::new(false),
            blackhole: watch::Sender::new(false),
            latency: watch::Sender::new(Duration::ZERO),
            cuts: watch::Sender::new(0),
            live: AtomicUsize::new(0),
            accepted: AtomicU64::new(0),
        });
        let task = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        Ok(FaultProxy { addr, shared, task })
    }

    /// The address clients should connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address the proxy forwards to.
    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream
    }

    /// Closes every open connection now (both the client and the upstream side). New
    /// connections are served normally.
    pub fn cut(&self) {
        self.shared.cuts.send_modify(|n| *n += 1);
    }

    /// While `true`, new connections are accepted and immediately closed, so a client
    /// sees its connection drop before any byte arrives. Open connections are not
    /// touched; combine with [`cut`](Self::cut) for a server that went away.
    pub fn refuse(&self, on: bool) {
        self.shared.refuse.store(on, Ordering::SeqCst);
    }

    /// While `true`, no byte is forwarded in either direction and connections stay open,
    /// like a network partition or a hung server. Bytes already sent are held, not lost,
    /// and delivered when the blackhole is lifted (as TCP would after a healed
    /// partition). New connections are accepted but not connected upstream until then.
    pub fn blackhole(&self, on: bool) {
        self.shared.blackhole.send_replace(on);
    }

    /// Delays every forwarded chunk of bytes, in both directions, by `latency`
    /// (`Duration::ZERO` turns it off).
    pub fn set_latency(&self, latency: Duration) {
        self.shared.latency.send_replace(latency);
    }

    /// Turns off refuse, blackhole and latency.
    pub fn heal(&self) {
        self.refuse(false);
        self.blackhole(false);
        self.set_latency(Duration::ZERO);
    }

    /// The number of client connections open right now.
    pub fn connection_count(&self) -> usize {
        self.shared.live.load(Ordering::SeqCst)
    }

    /// The number of client connections accepted since the start (refused ones included).
    pub fn total_connections(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // Aborting the accept task drops its JoinSet, which aborts every connection.
        self.task.abort();
    }
}

/// A [`Fault`] that blackholes a factory's connections at a [`FaultProxy`]: on
/// [`partition`](Fault::partition) no byte moves in either direction and new connections
/// are accepted but never reach the server; [`heal`](Fault::heal) lets everything through
/// again. Open connections stay open throughout, as in a network partition.
#[derive(Debug)]
pub struct ProxyFault(pub FaultProxy);

impl Fault for ProxyFault {
    fn partition(&self) -> BoxFuture<'_, Result<(), SetupError>> {
        self.0.blackhole(true);
        Box::pin(async { Ok(()) })
    }

    fn heal(&self) -> BoxFuture<'_, Result<(), SetupError>> {
        self.0.heal();
        Box::pin(async { Ok(()) })
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((client, peer)) => {
                    shared.accepted.fetch_add(1, Ordering::SeqCst);
                    if shared.refuse.load(Ordering::SeqCst) {
                        tracing::trace!(%peer, "fault proxy: refusing connection");
                        drop(client);
                        continue;
                    }
                    connections.spawn(serve(client, Arc::clone(&shared)));
                }
                Err(e) => {
                    // E.g. too many open files: back off instead of spinning.
                    tracing::debug!(error = %e, "fault proxy: accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Counts a connection as live for as long as it exists (also when aborted).
struct LiveGuard(Arc<Shared>);

impl LiveGuard {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.live.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(shared))
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn serve(client: TcpStream, shared: Arc<Shared>) {
    let _live = LiveGuard::new(&shared);
    let mut cuts = shared.cuts.subscribe();
    cuts.mark_unchanged();
    let session = async {
        let mut blackhole = shared.blackhole.subscribe();
        if blackhole.wait_for(|on| !*on).await.is_err() {
            return;
        }
        let upstream = match TcpStream::connect(shared.upstream).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(upstream = %shared.upstream, error = %e, "fault proxy: upstream connect failed");
                return;
            }
        };
        let _ = client.set_nodelay(true);
        let _ = upstream.set_nodelay(true);
        let (client_read, client_write) = client.into_split();
        let (upstream_read, upstream_write) = upstream.into_split();
        let up = pump(client_read, upstream_write, &shared);
        let down = pump(upstream_read, client_write, &shared);
        // Ends when both directions are done, or at once when one fails.
        let _ = tokio::try_join!(up, down);
    };
    tokio::select! {
        () = session => {}
        _ = cuts.changed() => {}
    }
}

/// Copies bytes from `from` to `to`, obeying blackhole and latency. On end of stream it
/// half-closes `to` and returns `Ok`; an error ends the whole connection.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
) -> std::io::Result<()> {
    let mut blackhole = shared.blackhole.subscribe();
    let latency = shared.latency.subscribe();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        wait_open(&mut blackhole).await?;
        let n = from.read(&mut buf).await?;
        if n == 0 {
            let _ = to.shutdown().await;
            return Ok(());
        }
        let delay = *latency.borrow();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        // Bytes read while the blackhole was switched on are held until it is lifted.
        wait_open(&mut blackhole).await?;
        to.write_all(&buf[..n]).await?;
    }
}

async fn wait_open(blackhole: &mut watch::Receiver<bool>) -> std::io::Result<()> {
    blackhole
        .wait_for(|on| !*on)
        .await
        .map(|_| ())
        .map_err(|_| std::io::Error::other("fault proxy stopped"))
}
