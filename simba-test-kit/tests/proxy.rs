//! The fault proxy forwards bytes and injects cut, refuse, blackhole and latency faults.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use simba_test_kit::proxy::FaultProxy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::timeout;

const STEP: Duration = Duration::from_secs(5);

/// An echo server on loopback; aborted when the handle is dropped at the end of the test.
struct Echo {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn echo_server() -> Echo {
    let listener = TcpListener::bind(("127.0.0.1", 0))
        .await
        .expect("bind echo");
    let addr = listener.local_addr().expect("echo addr");
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                loop {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if stream.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    Echo { addr, task }
}

async fn start_proxy(upstream: SocketAddr) -> FaultProxy {
    timeout(STEP, FaultProxy::start(upstream))
        .await
        .expect("proxy start timed out")
        .expect("proxy start")
}

async fn connect(addr: SocketAddr) -> TcpStream {
    timeout(STEP, TcpStream::connect(addr))
        .await
        .expect("connect timed out")
        .expect("connect")
}

/// Writes `msg` and reads back exactly as many bytes, within `limit`.
async fn round_trip(
    stream: &mut TcpStream,
    msg: &[u8],
    limit: Duration,
) -> Result<Vec<u8>, String> {
    let work = async {
        stream
            .write_all(msg)
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut back = vec![0u8; msg.len()];
        stream
            .read_exact(&mut back)
            .await
            .map_err(|e| format!("read: {e}"))?;
        Ok(back)
    };
    timeout(limit, work)
        .await
        .unwrap_or_else(|_| Err("timed out".to_owned()))
}

/// Whether the peer closed the connection (EOF or reset) within `limit`.
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
    let mut buf = [0u8; 64];
    match timeout(limit, stream.read(&mut buf)).await {
        Ok(Ok(0) | Err(_)) => true,
        Ok(Ok(_)) | Err(_) => false,
    }
}

async fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    check()
}

#[tokio::test]
async fn forwards_bytes_both_ways() {
    let echo = echo_server().await;
    let proxy = start_proxy(echo.addr).await;
    assert_eq!(proxy.upstream(), echo.addr);
    assert!(proxy.addr().ip().is_loopback());
    let mut a = connect(proxy.addr()).await;
    let mut b = connect(proxy.addr()).await;
    assert_eq!(
        round_trip(&mut a, b"hello", STEP).await.as_deref(),
        Ok(&b"hello"[..])
    );
    assert_eq!(
        round_trip(&mut b, b"world", STEP).await.as_deref(),
        Ok(&b"world"[..])
    );
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(round_trip(&mut a, &big, STEP).await, Ok(big));
    assert!(eventually(STEP, || proxy.connection_count() == 2).await);
    assert_eq!(proxy.total_connections(), 2);
    drop(a);
    drop(b);
    assert!(eventually(STEP, || proxy.connection_count() == 0).await);
}

#[tokio::test]
async fn cut_closes_open_connections_and_new_ones_work() {
    let echo = echo_server().await;
    let proxy = start_proxy(echo.addr).await;
    let mut a = connect(proxy.addr()).await;
    round_trip(&mut a, b"x", STEP).await.expect("before cut");
    proxy.cut();
    assert!(
        closed_within(&mut a, STEP).await,
        "the client side stayed open after cut()"
    );
    assert!(eventually(STEP, || proxy.connection_count() == 0).await);
    let mut b = connect(proxy.addr()).await;
    assert_eq!(
        round_trip(&mut b, b"again", STEP).await.as_deref(),
        Ok(&b"again"[..])
    );
}

#[tokio::test]
async fn blackhole_stalls_and_lifting_it_delivers_held_bytes() {
    let echo = echo_server().await;
    let proxy = start_proxy(echo.addr).await;
    let mut a = connect(proxy.addr()).await;
    round_trip(&mut a, b"x", STEP)
        .await
        .expect("before blackhole");

    proxy.blackhole(true);
    a.write_all(b"held")
        .await
        .expect("write into the blackhole");
    let mut buf = [0u8; 4];
    let stalled = timeout(Duration::from_millis(400), a.read_exact(&mut buf)).await;
    assert!(stalled.is_err(), "bytes crossed the blackhole: {stalled:?}");
    // A new connection during the blackhole is accepted but stalls too.
    let mut b = connect(proxy.addr()).await;
    assert!(
        round_trip(&mut b, b"y", Duration::from_millis(300))
            .await
            .is_err()
    );
    assert_eq!(
        proxy.connection_count(),
        2,
        "blackholed connections must stay open"
    );

    proxy.blackhole(false);
    timeout(STEP, a.read_exact(&mut buf))
        .await
        .expect("held bytes not delivered")
        .expect("read");
    assert_eq!(&buf, b"held");
    let mut one = [0u8; 1];
    timeout(STEP, b.read_exact(&mut one))
        .await
        .expect("held bytes of the new connection not delivered")
        .expect("read");
    assert_eq!(&one, b"y");

    // cut() also ends blackholed connections.
    proxy.blackhole(true);
    proxy.cut();
    assert!(closed_within(&mut a, STEP).await);
    assert!(closed_within(&mut b, STEP).await);
}

#[tokio::test]
async fn latency_delays_each_direction() {
    let echo = echo_server().await;
    let proxy = start_proxy(echo.addr).await;
    let mut a = connect(proxy.addr()).await;
    let t = Instant::now();
    round_trip(&mut a, b"fast", STEP).await.expect("no latency");
    let fast = t.elapsed();

    let delay = Duration::from_millis(150);
    proxy.set_latency(delay);
    let t = Instant::now();
    round_trip(&mut a, b"slow", STEP)
        .await
        .expect("with latency");
    let slow = t.elapsed();
    // One chunk each way: at least twice the delay.
    assert!(
        slow >= delay * 2,
        "round trip took {slow:?} with latency {delay:?}"
    );
    assert!(slow < Duration::from_secs(3), "round trip took {slow:?}");

    proxy.set_latency(Duration::ZERO);
    let t = Instant::now();
    round_trip(&mut a, b"fast", STEP)
        .await
        .expect("latency off");
    assert!(
        t.elapsed() < delay,
        "latency still applied ({:?}, before {fast:?})",
        t.elapsed()
    );
}

#[tokio::test]
async fn refuse_closes_new_connections_only() {
    let echo = echo_server().await;
    let proxy = start_proxy(echo.addr).await;
    let mut open = connect(proxy.addr()).await;
    round_trip(&mut open, b"x", STEP)
        .await
        .expect("before refuse");

    proxy.refuse(true);
    for _ in 0..3 {
        let mut refused = connect(proxy.addr()).await;
        assert!(
            closed_within(&mut refused, STEP).await,
            "a refused connection stayed open"
        );
    }
    // The connection that was open before keeps working.
    round_trip(&mut open, b"still", STEP)
        .await
        .expect("open connection during refuse");

    proxy.heal();
    let mut fresh = connect(proxy.addr()).await;
    round_trip(&mut fresh, b"back", STEP)
        .await
        .expect("after refuse");
    assert_eq!(proxy.total_connections(), 5);
}

#[tokio::test]
async fn unreachable_upstream_closes_the_client() {
    let free = TcpListener::bind(("127.0.0.1", 0)).await.expect("bind");
    let dead = free.local_addr().expect("addr");
    drop(free);
    let proxy = start_proxy(dead).await;
    let mut a = connect(proxy.addr()).await;
    assert!(closed_within(&mut a, STEP).await);
    assert!(eventually(STEP, || proxy.connection_count() == 0).await);
}

#[tokio::test]
async fn dropping_the_proxy_closes_everything() {
    let echo = echo_server().await;
    let proxy = start_proxy(echo.addr).await;
    let addr = proxy.addr();
    let mut a = connect(addr).await;
    round_trip(&mut a, b"x", STEP).await.expect("before drop");
    drop(proxy);
    assert!(
        closed_within(&mut a, STEP).await,
        "connection survived the proxy"
    );
    let mut refused = false;
    for _ in 0..100 {
        if TcpStream::connect(addr).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(refused, "the proxy port still accepts connections");
}

#[tokio::test]
async fn proxies_a_real_redis() {
    let server = timeout(
        Duration::from_secs(60),
        simba_test_kit::servers::redis_private(),
    )
    .await
    .expect("redis start timed out")
    .expect("redis");
    let proxy = start_proxy(server.socket_addr().expect("addr")).await;
    assert_eq!(
        server.url_via(proxy.addr()),
        format!("redis://{}", proxy.addr())
    );
    let mut a = connect(proxy.addr()).await;
    a.write_all(b"PING\r\n").await.expect("write");
    let mut buf = [0u8; 7];
    timeout(STEP, a.read_exact(&mut buf))
        .await
        .expect("PONG timed out")
        .expect("read");
    assert_eq!(&buf, b"+PONG\r\n");
    proxy.cut();
    assert!(closed_within(&mut a, STEP).await);
}
