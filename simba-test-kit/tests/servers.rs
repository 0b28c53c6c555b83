//! The test servers start from the local binaries, answer real protocol requests and
//! obey stop/start/kill/pause/resume.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use simba_test_kit::servers::{self, ServerError, ServerKind, TestServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::Command;
use tokio::time::timeout;

const START: Duration = Duration::from_secs(90);
const STEP: Duration = Duration::from_secs(30);

async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    timeout(limit, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {limit:?}"))
}

async fn started(
    what: &str,
    fut: impl Future<Output = Result<TestServer, ServerError>>,
) -> TestServer {
    let t = Instant::now();
    let server = within(START, what, fut)
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    eprintln!("{what}: ready in {:?} at {}", t.elapsed(), server.url());
    server
}

/// Sends raw bytes and reads until `done` accepts the answer, EOF, or the timeout.
async fn exchange(
    addr: SocketAddr,
    request: &[u8],
    limit: Duration,
    done: impl Fn(&[u8]) -> bool + Send + Sync,
) -> Result<Vec<u8>, String> {
    let work = async {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        stream
            .write_all(request)
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = stream
                .read(&mut buf)
                .await
                .map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                return Ok(answer);
            }
            answer.extend_from_slice(&buf[..n]);
            if done(&answer) {
                return Ok(answer);
            }
        }
    };
    timeout(limit, work)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {limit:?}")))
}

/// Whether `answer` holds one complete simple, error, integer or bulk RESP reply.
fn resp_complete(answer: &[u8]) -> bool {
    let Some(end) = answer.windows(2).position(|w| w == b"\r\n") else {
        return false;
    };
    if answer.first() != Some(&b'$') {
        return true;
    }
    let len: i64 = String::from_utf8_lossy(&answer[1..end])
        .parse()
        .unwrap_or(-1);
    match usize::try_from(len) {
        Ok(len) => answer.len() >= end + 2 + len + 2,
        Err(_) => true,
    }
}

async fn redis_cmd(server: &TestServer, request: &str, limit: Duration) -> Result<String, String> {
    let addr = server.socket_addr().map_err(|e| e.to_string())?;
    let answer = exchange(addr, request.as_bytes(), limit, resp_complete).await?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

async fn ping(server: &TestServer, limit: Duration) -> Result<(), String> {
    match redis_cmd(server, "PING\r\n", limit).await? {
        answer if answer == "+PONG\r\n" => Ok(()),
        other => Err(format!("PING answered {other:?}")),
    }
}

async fn four_letter(server: &TestServer, word: &str, limit: Duration) -> Result<String, String> {
    let addr = server.socket_addr().map_err(|e| e.to_string())?;
    let answer = exchange(addr, word.as_bytes(), limit, |_| false).await?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

/// Runs a command-line client with a hard timeout; returns trimmed stdout.
async fn cli(
    program: &str,
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
) -> Result<String, String> {
    let run = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = timeout(limit, run)
        .await
        .map_err(|_| format!("{program} did not finish within {limit:?}"))?
        .map_err(|e| format!("{program}: {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    } else {
        Err(format!(
            "{program} failed with {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

async fn mariadb_sql(server: &TestServer, sql: &str) -> Result<String, String> {
    let port = server.port().to_string();
    cli(
        "mariadb",
        &[
            "-uroot",
            "-h127.0.0.1",
            "-P",
            &port,
            "--connect-timeout=3",
            "-N",
            "-B",
            "simba",
            "-e",
            sql,
        ],
        &[],
        Duration::from_secs(20),
    )
    .await
}

async fn psql(server: &TestServer, sql: &str) -> Result<String, String> {
    let port = server.port().to_string();
    cli(
        "psql",
        &[
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-U",
            "postgres",
            "-d",
            "simba",
            "-tAc",
            sql,
        ],
        &[("PGCONNECT_TIMEOUT", "3")],
        Duration::from_secs(20),
    )
    .await
}

/// ZooKeeper's own command-line client (a JVM, about half a second).
async fn zk_cli(server: &TestServer, args: &[&str]) -> Result<String, String> {
    let target = server.url().to_owned();
    let mut all = vec![
        "-cp",
        "/usr/share/java/zookeeper.jar:/usr/share/java/slf4j-nop.jar",
        "org.apache.zookeeper.ZooKeeperMain",
        "-server",
        &target,
    ];
    all.extend_from_slice(args);
    cli("java", &all, &[], Duration::from_secs(30)).await
}

// ---- Redis ------------------------------------------------------------------------------

#[tokio::test]
async fn redis_answers_ping() {
    let server = started("redis_private", servers::redis_private()).await;
    assert_eq!(server.kind(), ServerKind::Redis);
    assert!(server.is_private());
    assert_eq!(server.host(), "127.0.0.1");
    assert_eq!(server.url(), format!("redis://127.0.0.1:{}", server.port()));
    ping(&server, Duration::from_secs(5)).await.expect("PING");
    assert!(server.pid().is_some());
}

#[tokio::test]
async fn redis_resolves_from_env_or_local_binary() {
    let server = started("redis()", servers::redis()).await;
    ping(&server, Duration::from_secs(5)).await.expect("PING");
}

#[tokio::test]
async fn redis_stop_start_keeps_port_and_data_and_wipe_loses_it() {
    let server = started("redis_private", servers::redis_private()).await;
    let port = server.port();
    let reply = redis_cmd(&server, "SET simba:k v1\r\n", Duration::from_secs(5)).await;
    assert_eq!(reply.as_deref(), Ok("+OK\r\n"));

    within(STEP, "stop", server.stop()).await.expect("stop");
    assert!(!server.is_running().await.expect("is_running"));
    assert!(server.pid().is_none());
    assert!(
        ping(&server, Duration::from_secs(2)).await.is_err(),
        "stopped server answered"
    );
    // Stopping twice is fine.
    within(STEP, "stop again", server.stop())
        .await
        .expect("stop again");

    let t = Instant::now();
    within(STEP, "start", server.start()).await.expect("start");
    eprintln!("redis restart: {:?}", t.elapsed());
    assert_eq!(server.port(), port);
    ping(&server, Duration::from_secs(5))
        .await
        .expect("PING after start");
    let reply = redis_cmd(&server, "GET simba:k\r\n", Duration::from_secs(5)).await;
    assert_eq!(
        reply.as_deref(),
        Ok("$2\r\nv1\r\n"),
        "data lost across restart"
    );

    within(STEP, "kill", server.kill()).await.expect("kill");
    assert!(
        ping(&server, Duration::from_secs(2)).await.is_err(),
        "killed server answered"
    );
    within(STEP, "start after kill", server.start())
        .await
        .expect("start after kill");
    let reply = redis_cmd(&server, "GET simba:k\r\n", Duration::from_secs(5)).await;
    assert_eq!(
        reply.as_deref(),
        Ok("$2\r\nv1\r\n"),
        "data lost across kill"
    );

    within(STEP, "wipe_restart", server.wipe_restart())
        .await
        .expect("wipe_restart");
    assert_eq!(server.port(), port);
    let reply = redis_cmd(&server, "GET simba:k\r\n", Duration::from_secs(5)).await;
    assert_eq!(
        reply.as_deref(),
        Ok("$-1\r\n"),
        "data survived wipe_restart"
    );
}

#[tokio::test]
async fn redis_pause_stops_answers_until_resume() {
    let server = started("redis_private", servers::redis_private()).await;
    within(STEP, "pause", server.pause()).await.expect("pause");
    let err = ping(&server, Duration::from_millis(500))
        .await
        .expect_err("paused server answered");
    assert!(err.contains("no answer"), "{err}");
    within(STEP, "resume", server.resume())
        .await
        .expect("resume");
    ping(&server, Duration::from_secs(5))
        .await
        .expect("PING after resume");

    // Stopping a paused server works too.
    within(STEP, "pause", server.pause()).await.expect("pause");
    within(STEP, "stop paused", server.stop())
        .await
        .expect("stop paused");
    assert!(matches!(
        server.pause().await,
        Err(ServerError::NotRunning { .. })
    ));
    within(STEP, "start", server.start()).await.expect("start");
    ping(&server, Duration::from_secs(5))
        .await
        .expect("PING after start");
}

#[tokio::test]
async fn dropping_a_private_server_kills_it_and_removes_its_dir() {
    let server = started("redis_private", servers::redis_private()).await;
    let pid = server.pid().expect("pid");
    let dir = server.dir().expect("dir").to_path_buf();
    assert!(dir.join("server.log").exists());
    drop(server);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    assert!(
        stat.is_empty() || stat.contains(") Z"),
        "process {pid} still alive: {stat}"
    );
    assert!(!dir.exists(), "{} still exists", dir.display());
}

/// `(state, parent pid)` of a process, if it exists.
fn proc_stat(pid: u32) -> Option<(char, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?.chars().next()?;
    Some((state, fields.next()?.parse().ok()?))
}

fn children_of(parent: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| proc_stat(pid).is_some_and(|(_, ppid)| ppid == parent))
        .collect()
}

#[tokio::test]
async fn dropping_a_paused_postgres_leaves_no_processes() {
    let server = started("postgres_private", servers::postgres_private()).await;
    let pid = server.pid().expect("pid");
    let backends = children_of(pid);
    assert!(!backends.is_empty(), "the postmaster has no children");
    within(STEP, "pause", server.pause()).await.expect("pause");
    drop(server);
    for p in std::iter::once(pid).chain(backends) {
        match proc_stat(p) {
            None => {}
            Some((state, ppid)) => panic!("process {p} survived: state {state}, parent {ppid}"),
        }
    }
}

#[tokio::test]
async fn external_servers_refuse_control() {
    let server = TestServer::external(ServerKind::Redis, "redis://127.0.0.1:1").expect("external");
    assert_eq!(server.port(), 1);
    assert!(!server.is_private());
    for result in [
        server.stop().await,
        server.start().await,
        server.kill().await,
        server.pause().await,
        server.resume().await,
        server.wipe_restart().await,
    ] {
        let err = result.expect_err("control on an external server");
        assert!(matches!(err, ServerError::NotPrivate { .. }), "{err}");
        assert!(err.to_string().contains("not a private instance"), "{err}");
    }
    let zk = TestServer::external(ServerKind::Zookeeper, "zk1:2182,zk2:2183/app").expect("zk");
    assert_eq!((zk.host(), zk.port()), ("zk1", 2182));
    let addr: SocketAddr = ([127, 0, 0, 1], 7).into();
    assert_eq!(zk.url_via(addr), "127.0.0.1:7/app");
    assert!(matches!(
        TestServer::external(ServerKind::Mysql, "mysql://h:nope/db"),
        Err(ServerError::InvalidUrl { .. })
    ));
}

/// Two failovers of one shard in a row: the second finds the roles from the servers, so
/// it kills the node the first one promoted and promotes the first primary again, which
/// was restarted as a replica. Each time the shard's new primary takes a write of its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_fails_over_twice_and_restarts_each_old_primary_as_replica() {
    let cluster = within(
        START,
        "redis_cluster_with_replicas",
        servers::redis_cluster_with_replicas(3),
    )
    .await
    .expect("redis_cluster_with_replicas");
    let shard = 1;
    let mut key = None;
    for n in 0..100 {
        let k = format!("k{n}");
        if cluster.shard_of_key(&k).await.expect("CLUSTER KEYSLOT") == shard {
            key = Some(k);
            break;
        }
    }
    let key = key.expect("one of 100 keys hashes to the middle third of the slots");
    let first = &cluster.nodes()[shard];
    let second = &cluster.replicas()[shard];
    assert_eq!(
        cluster.primary_port(shard).await.expect("roles"),
        first.port()
    );
    // (new primary, new replica) after each failover.
    for (round, (primary, replica)) in [(second, first), (first, second)].into_iter().enumerate() {
        cluster.freeze_replication(shard).await.expect("freeze");
        within(
            Duration::from_secs(90),
            "failover",
            cluster.kill_primary_and_fail_over(shard, Duration::from_secs(60)),
        )
        .await
        .unwrap_or_else(|e| panic!("failover {round}: {e}"));
        assert_eq!(
            cluster.primary_port(shard).await.expect("roles"),
            primary.port(),
            "failover {round}"
        );
        let role = redis_cmd(primary, "ROLE\r\n", STEP).await.expect("ROLE");
        assert!(role.contains("master"), "failover {round}: {role}");
        let role = redis_cmd(replica, "ROLE\r\n", STEP).await.expect("ROLE");
        assert!(role.contains("slave"), "failover {round}: {role}");
        let set = redis_cmd(primary, &format!("SET {key} {round}\r\n"), STEP)
            .await
            .expect("SET");
        assert_eq!(set, "+OK\r\n", "failover {round}");
        within(STEP, "wait_ok", cluster.wait_ok(STEP))
            .await
            .unwrap_or_else(|e| panic!("failover {round}: {e}"));
    }
}

#[tokio::test]
async fn redis_cluster_of_three_primaries_is_ok() {
    let t = Instant::now();
    let cluster = within(START, "redis_cluster", servers::redis_cluster(3))
        .await
        .expect("redis_cluster");
    eprintln!(
        "redis cluster of 3: ok in {:?}: {}",
        t.elapsed(),
        cluster.cluster_url()
    );
    assert_eq!(cluster.nodes().len(), 3);
    for node in cluster.nodes() {
        let info = redis_cmd(node, "CLUSTER INFO\r\n", Duration::from_secs(5))
            .await
            .expect("CLUSTER INFO");
        assert!(info.contains("cluster_state:ok"), "{info}");
        assert!(info.contains("cluster_slots_assigned:16384"), "{info}");
        assert!(info.contains("cluster_known_nodes:3"), "{info}");
    }
    // A key is served by its owner and redirected by the others.
    let mut moved = 0;
    for node in cluster.nodes() {
        let reply = redis_cmd(node, "SET {simba}:k v\r\n", Duration::from_secs(5))
            .await
            .expect("SET");
        if reply.starts_with("-MOVED") {
            moved += 1;
        } else {
            assert_eq!(reply, "+OK\r\n");
        }
    }
    assert_eq!(moved, 2);
    assert!(cluster.seed_url().starts_with("redis://127.0.0.1:"));
}

// ---- MariaDB ----------------------------------------------------------------------------

#[tokio::test]
async fn mysql_answers_select_and_keeps_data_across_restart() {
    let server = started("mysql_private", servers::mysql_private()).await;
    assert_eq!(
        server.url(),
        format!("mysql://root@127.0.0.1:{}/simba", server.port())
    );
    assert_eq!(mariadb_sql(&server, "SELECT 1").await.as_deref(), Ok("1"));
    mariadb_sql(&server, "CREATE TABLE t (v INT); INSERT INTO t VALUES (42)")
        .await
        .expect("create");
    let port = server.port();

    let t = Instant::now();
    within(STEP, "restart", server.restart())
        .await
        .expect("restart");
    eprintln!("mariadb restart: {:?}", t.elapsed());
    assert_eq!(server.port(), port);
    assert_eq!(
        mariadb_sql(&server, "SELECT v FROM t").await.as_deref(),
        Ok("42")
    );

    within(STEP, "kill", server.kill()).await.expect("kill");
    assert!(
        mariadb_sql(&server, "SELECT 1").await.is_err(),
        "killed server answered"
    );
    within(STEP, "start after kill", server.start())
        .await
        .expect("start after kill");
    assert_eq!(
        mariadb_sql(&server, "SELECT v FROM t").await.as_deref(),
        Ok("42")
    );

    within(STEP, "pause", server.pause()).await.expect("pause");
    let paused = exchange(
        server.socket_addr().expect("addr"),
        b"",
        Duration::from_millis(500),
        |a| !a.is_empty(),
    )
    .await;
    assert!(paused.is_err(), "paused server sent a greeting: {paused:?}");
    within(STEP, "resume", server.resume())
        .await
        .expect("resume");
    assert_eq!(mariadb_sql(&server, "SELECT 1").await.as_deref(), Ok("1"));

    within(STEP, "wipe_restart", server.wipe_restart())
        .await
        .expect("wipe_restart");
    assert!(
        mariadb_sql(&server, "SELECT v FROM t").await.is_err(),
        "table survived a wipe"
    );
    assert_eq!(mariadb_sql(&server, "SELECT 1").await.as_deref(), Ok("1"));
}

// ---- PostgreSQL -------------------------------------------------------------------------

#[tokio::test]
async fn postgres_answers_select_and_keeps_data_across_restart() {
    let server = started("postgres_private", servers::postgres_private()).await;
    assert_eq!(
        server.url(),
        format!("postgres://postgres@127.0.0.1:{}/simba", server.port())
    );
    assert_eq!(psql(&server, "select 1").await.as_deref(), Ok("1"));
    psql(&server, "create table t (v int); insert into t values (42)")
        .await
        .expect("create");
    let port = server.port();

    let t = Instant::now();
    within(STEP, "restart", server.restart())
        .await
        .expect("restart");
    eprintln!("postgres restart: {:?}", t.elapsed());
    assert_eq!(server.port(), port);
    assert_eq!(psql(&server, "select v from t").await.as_deref(), Ok("42"));

    within(STEP, "kill", server.kill()).await.expect("kill");
    assert!(
        psql(&server, "select 1").await.is_err(),
        "killed server answered"
    );
    let t = Instant::now();
    within(STEP, "start after kill", server.start())
        .await
        .expect("start after kill");
    eprintln!(
        "postgres start after kill (crash recovery): {:?}",
        t.elapsed()
    );
    assert_eq!(psql(&server, "select v from t").await.as_deref(), Ok("42"));

    within(STEP, "pause", server.pause()).await.expect("pause");
    let paused = psql(&server, "select 1").await;
    assert!(paused.is_err(), "paused server answered: {paused:?}");
    within(STEP, "resume", server.resume())
        .await
        .expect("resume");
    assert_eq!(psql(&server, "select 1").await.as_deref(), Ok("1"));

    within(STEP, "wipe_restart", server.wipe_restart())
        .await
        .expect("wipe_restart");
    assert!(
        psql(&server, "select v from t").await.is_err(),
        "table survived a wipe"
    );
}

// ---- ZooKeeper --------------------------------------------------------------------------

#[tokio::test]
async fn zookeeper_answers_four_letter_words_and_keeps_data_across_restart() {
    let server = started("zookeeper_private", servers::zookeeper_private()).await;
    assert_eq!(server.url(), format!("127.0.0.1:{}", server.port()));
    let step = Duration::from_secs(5);
    assert_eq!(
        four_letter(&server, "ruok", step).await.as_deref(),
        Ok("imok")
    );
    let srvr = four_letter(&server, "srvr", step).await.expect("srvr");
    assert!(srvr.contains("Mode: standalone"), "{srvr}");
    let conf = four_letter(&server, "conf", step).await.expect("conf");
    assert!(conf.contains("tickTime=200"), "{conf}");
    assert!(conf.contains("minSessionTimeout=400"), "{conf}");

    zk_cli(&server, &["create", "/simba", "hello"])
        .await
        .expect("create");
    let port = server.port();
    let t = Instant::now();
    within(STEP, "restart", server.restart())
        .await
        .expect("restart");
    eprintln!("zookeeper restart: {:?}", t.elapsed());
    assert_eq!(server.port(), port);
    let data = zk_cli(&server, &["get", "/simba"]).await.expect("get");
    assert!(data.lines().any(|l| l == "hello"), "{data}");

    within(STEP, "kill", server.kill()).await.expect("kill");
    assert!(
        four_letter(&server, "ruok", step).await.is_err(),
        "killed server answered"
    );
    within(STEP, "start after kill", server.start())
        .await
        .expect("start after kill");
    let data = zk_cli(&server, &["get", "/simba"])
        .await
        .expect("get after kill");
    assert!(data.lines().any(|l| l == "hello"), "{data}");

    within(STEP, "pause", server.pause()).await.expect("pause");
    let paused = four_letter(&server, "ruok", Duration::from_millis(500)).await;
    assert!(paused.is_err(), "paused server answered: {paused:?}");
    within(STEP, "resume", server.resume())
        .await
        .expect("resume");
    assert_eq!(
        four_letter(&server, "ruok", step).await.as_deref(),
        Ok("imok")
    );

    within(STEP, "wipe_restart", server.wipe_restart())
        .await
        .expect("wipe_restart");
    let gone = zk_cli(&server, &["get", "/simba"]).await;
    assert!(
        !gone
            .as_deref()
            .unwrap_or_default()
            .lines()
            .any(|l| l == "hello"),
        "{gone:?}"
    );
}

/// etcd's `GET /health` on the client port: the body, or why there was none.
async fn etcd_health(server: &TestServer, limit: Duration) -> Result<String, String> {
    let addr = server.socket_addr().map_err(|e| e.to_string())?;
    let request = format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let answer = exchange(addr, request.as_bytes(), limit, |_| false).await?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

/// `etcdctl` (v3 API) against `server`.
async fn etcdctl(server: &TestServer, args: &[&str]) -> Result<String, String> {
    let endpoint = format!(
        "http://{}",
        server.socket_addr().map_err(|e| e.to_string())?
    );
    let out = within(
        STEP,
        "etcdctl",
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg("--endpoints")
            .arg(&endpoint)
            .args(args)
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .map_err(|e| format!("etcdctl: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test]
async fn etcd_answers_health_and_keeps_data_across_restart() {
    let server = started("etcd_private", servers::etcd_private()).await;
    assert_eq!(server.url(), format!("etcd://127.0.0.1:{}", server.port()));
    let step = Duration::from_secs(5);
    let health = etcd_health(&server, step).await.expect("health");
    assert!(health.contains("\"health\":\"true\""), "{health}");
    etcdctl(&server, &["put", "/simba", "hello"])
        .await
        .expect("put");
    let port = server.port();
    within(STEP, "restart", server.restart())
        .await
        .expect("restart");
    assert_eq!(server.port(), port);
    let data = etcdctl(&server, &["get", "/simba"]).await.expect("get");
    assert!(data.lines().any(|l| l == "hello"), "{data}");

    within(STEP, "pause", server.pause()).await.expect("pause");
    let paused = etcd_health(&server, Duration::from_millis(500)).await;
    assert!(paused.is_err(), "paused server answered: {paused:?}");
    within(STEP, "resume", server.resume())
        .await
        .expect("resume");
    let health = etcd_health(&server, step)
        .await
        .expect("health after resume");
    assert!(health.contains("\"health\":\"true\""), "{health}");
}

// ---- all at once ------------------------------------------------------------------------

#[tokio::test]
async fn all_four_start_concurrently() {
    let t = Instant::now();
    let (r, m, p, z) = within(
        START,
        "all four",
        futures_join(
            servers::redis(),
            servers::mysql(),
            servers::postgres(),
            servers::zookeeper(),
        ),
    )
    .await;
    let (r, m, p, z) = (
        r.expect("redis"),
        m.expect("mysql"),
        p.expect("postgres"),
        z.expect("zookeeper"),
    );
    eprintln!("all four concurrently: {:?}", t.elapsed());
    ping(&r, Duration::from_secs(5)).await.expect("PING");
    assert_eq!(mariadb_sql(&m, "SELECT 1").await.as_deref(), Ok("1"));
    assert_eq!(psql(&p, "select 1").await.as_deref(), Ok("1"));
    assert_eq!(
        four_letter(&z, "ruok", Duration::from_secs(5))
            .await
            .as_deref(),
        Ok("imok")
    );
}

async fn futures_join<A, B, C, D>(
    a: impl Future<Output = A>,
    b: impl Future<Output = B>,
    c: impl Future<Output = C>,
    d: impl Future<Output = D>,
) -> (A, B, C, D) {
    tokio::join!(a, b, c, d)
}
