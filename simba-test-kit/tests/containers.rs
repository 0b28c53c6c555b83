//! The kit's containers (feature `containers`): each image answers its protocol on a port
//! published on 127.0.0.1 only, carries the label the cleanup looks for, and the container
//! is gone once its server is dropped, also when the test holding it panics.
//!
//! Needs a Docker daemon and the images (`scripts/containers.sh build`); without them the
//! tests fail with the kit's message saying what is missing.
#![cfg(feature = "containers")]
// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use simba_test_kit::servers::{self, LABEL, ServerKind, TestServer};
use testcontainers::bollard::Docker;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn started(kind: ServerKind) -> TestServer {
    tokio::time::timeout(Duration::from_secs(150), servers::container(kind))
        .await
        .unwrap_or_else(|_| panic!("no {kind} container within 150 s"))
        .unwrap_or_else(|e| panic!("{kind} container: {e}"))
}

/// Whether the engine still knows the container (removal is finished when it does not).
async fn exists(docker: &Docker, id: &str) -> bool {
    match docker.inspect_container(id, None).await {
        Ok(_) => true,
        Err(testcontainers::bollard::errors::Error::DockerResponseServerError {
            status_code: 404,
            ..
        }) => false,
        Err(e) => panic!("inspecting container {id}: {e}"),
    }
}

/// Checks the labels and the port binding of a running container.
async fn check_running(docker: &Docker, server: &TestServer) {
    let id = server.container_id().unwrap();
    let details = docker.inspect_container(id, None).await.unwrap();
    let labels = details.config.and_then(|c| c.labels).unwrap_or_default();
    assert_eq!(
        labels.get(LABEL).map(String::as_str),
        Some("1"),
        "{labels:?}"
    );
    assert_eq!(
        labels.get("simba.test.pid"),
        Some(&std::process::id().to_string())
    );
    let ports = details
        .network_settings
        .and_then(|n| n.ports)
        .unwrap_or_default();
    let bindings: Vec<_> = ports.values().flatten().flatten().collect();
    assert!(!bindings.is_empty(), "no published port: {ports:?}");
    for binding in bindings {
        assert_eq!(binding.host_ip.as_deref(), Some("127.0.0.1"), "{ports:?}");
        assert_eq!(
            binding.host_port.as_deref(),
            Some(server.port().to_string().as_str())
        );
    }
    assert_eq!(server.host(), "127.0.0.1");
    assert!(!server.is_private());
}

/// One request in the server's own protocol; returns the answer's first bytes.
async fn ask(server: &TestServer, request: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(server.socket_addr().unwrap())
        .await
        .unwrap();
    if !request.is_empty() {
        stream.write_all(request).await.unwrap();
    }
    let mut buf = vec![0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
        .await
        .expect("no answer within 10 s")
        .unwrap();
    buf.truncate(n);
    buf
}

async fn round_trip(kind: ServerKind) {
    let docker = Docker::connect_with_defaults().unwrap();
    let server = started(kind).await;
    check_running(&docker, &server).await;
    let id = server.container_id().unwrap().to_owned();
    match kind {
        ServerKind::Redis => {
            assert_eq!(server.url(), format!("redis://127.0.0.1:{}", server.port()));
            assert_eq!(ask(&server, b"PING\r\n").await, b"+PONG\r\n");
        }
        ServerKind::Mysql => {
            assert!(server.url().starts_with("mysql://root:simba@127.0.0.1:"));
            assert!(server.url().ends_with("/simba"), "{}", server.url());
            // The server speaks first: a handshake packet of protocol version 10.
            let greeting = ask(&server, b"").await;
            assert_eq!(greeting.get(4), Some(&10), "{greeting:?}");
        }
        ServerKind::Postgres => {
            assert!(
                server
                    .url()
                    .starts_with("postgres://postgres:simba@127.0.0.1:")
            );
            // SSLRequest: a server without TLS answers 'N'.
            let answer = ask(&server, &[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f]).await;
            assert_eq!(answer, b"N");
        }
        ServerKind::Zookeeper => {
            assert_eq!(server.url(), format!("127.0.0.1:{}", server.port()));
            let answer = String::from_utf8(ask(&server, b"ruok").await).unwrap();
            assert_eq!(answer, "imok");
        }
        other => panic!("no round trip for {other}"),
    }
    drop(server);
    assert!(
        !exists(&docker, &id).await,
        "container {id} is still there after its server was dropped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_container() {
    round_trip(ServerKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_container() {
    round_trip(ServerKind::Mysql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_container() {
    round_trip(ServerKind::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_container() {
    round_trip(ServerKind::Zookeeper).await;
}

/// A test that panics while it holds a container leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_is_removed_when_the_test_panics() {
    let docker = Docker::connect_with_defaults().unwrap();
    let server = started(ServerKind::Redis).await;
    let id = server.container_id().unwrap().to_owned();
    assert!(exists(&docker, &id).await);
    let task = tokio::spawn(async move {
        let _server = server;
        panic!("a failing test");
    });
    assert!(task.await.unwrap_err().is_panic());
    assert!(
        !exists(&docker, &id).await,
        "container {id} survived the panic"
    );
}

/// The names of what the engine holds with this test process's label: containers (`ps`) or
/// networks (`network ls`).
fn labelled(what: &[&str]) -> Vec<String> {
    let pid = format!("label=simba.test.pid={}", std::process::id());
    let output = std::process::Command::new("docker")
        .args(what)
        .args(["--filter", &pid, "--format"])
        .arg(if what[0] == "ps" {
            "{{.Names}}"
        } else {
            "{{.Name}}"
        })
        .output()
        .unwrap();
    assert!(output.status.success(), "docker {what:?}: {output:?}");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Whether a TCP connection to `addr` is made within `within`, trying again after errors
/// (right after a network is connected again, the host's neighbour entry for the address
/// may still be the failed one of the cut, which gives "no route to host" at once).
async fn reachable(addr: &str, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Ok(Ok(_)) = tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The three-node ensemble: one leader, and the handle's faults do what they say — a killed
/// leader is replaced by an election among the other two and rejoins as a follower; a
/// follower parted from the others stops serving and serves again when healed; a cut client
/// network reaches no node while the other client network still does. Containers and
/// networks are gone after the drop, also when a test panics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_ensemble() {
    use simba_test_kit::servers::{ENSEMBLE_SIZE, NodeMode, ZkEnsemble};
    let ens = tokio::time::timeout(Duration::from_secs(180), ZkEnsemble::start(2))
        .await
        .expect("no ensemble within 180 s")
        .unwrap_or_else(|e| panic!("ensemble: {e}"));
    assert_eq!(labelled(&["ps", "-a"]).len(), ENSEMBLE_SIZE);
    assert_eq!(
        labelled(&["network", "ls"]).len(),
        4,
        "peers, control, 2 clients"
    );
    let mut modes = Vec::new();
    for i in 0..ENSEMBLE_SIZE {
        modes.push(ens.mode(i).await);
    }
    let leader = ens.leader().await.expect("a leader");
    assert_eq!(modes[leader], NodeMode::Leader, "{modes:?}");
    assert_eq!(
        modes.iter().filter(|m| **m == NodeMode::Follower).count(),
        2,
        "{modes:?}"
    );

    // Leader killed: the two others elect one of themselves.
    ens.kill(leader).await.unwrap();
    assert_eq!(ens.mode(leader).await, NodeMode::Down);
    let new = ens
        .wait_for_quorum(Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(new, leader);
    ens.start_node(leader).await.unwrap();
    assert_eq!(ens.mode(leader).await, NodeMode::Follower);

    // A follower parted from the others: no quorum for it, so it stops serving.
    let follower = (0..ENSEMBLE_SIZE).find(|&i| i != new).unwrap();
    ens.partition(follower).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while ens.mode(follower).await != NodeMode::NotServing {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a partitioned follower still serves after 30 s: {:?}",
            ens.mode(follower).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        ens.leader().await,
        Some(new),
        "the majority keeps its leader"
    );
    ens.heal(follower).await.unwrap();
    ens.wait_serving(follower, Duration::from_secs(60))
        .await
        .unwrap();

    // Client 0 cut off: no node reachable on its network; client 1 unaffected.
    let first = |c: usize| ens.connect_string(c).split(',').next().unwrap().to_owned();
    assert!(reachable(&first(0), Duration::from_secs(5)).await);
    ens.cut_client(0).await.unwrap();
    assert!(!reachable(&first(0), Duration::from_secs(3)).await);
    assert!(reachable(&first(1), Duration::from_secs(5)).await);
    ens.restore_client(0).await.unwrap();
    assert!(reachable(&first(0), Duration::from_secs(5)).await);
    let addr = first(0).parse().unwrap();
    assert_eq!(ens.node_of(addr), Some(0));

    drop(ens);
    assert_eq!(labelled(&["ps", "-a"]), Vec::<String>::new());
    assert_eq!(labelled(&["network", "ls"]), Vec::<String>::new());

    // A panic while the ensemble is held removes it too.
    let task = tokio::spawn(async move {
        let _ens = ZkEnsemble::start(1).await.unwrap();
        panic!("a failing test");
    });
    assert!(task.await.unwrap_err().is_panic());
    assert_eq!(labelled(&["ps", "-a"]), Vec::<String>::new());
    assert_eq!(labelled(&["network", "ls"]), Vec::<String>::new());
}

/// The three-member etcd cluster: one leader followed by the two others, and the handle's
/// faults do what they say — a killed leader is replaced by an election among the other two
/// and rejoins (its data kept) as a follower; a member parted from the others loses its
/// leader while its client port still answers, and serves again when healed; a restarted
/// member serves again; a cut client network reaches no member while the other one still
/// does. Containers and networks are gone after the drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_cluster() {
    use simba_test_kit::servers::{CLUSTER_SIZE, EtcdCluster, MemberState};
    let cluster = tokio::time::timeout(Duration::from_secs(180), EtcdCluster::start(2))
        .await
        .expect("no cluster within 180 s")
        .unwrap_or_else(|e| panic!("cluster: {e}"));
    assert_eq!(labelled(&["ps", "-a"]).len(), CLUSTER_SIZE);
    assert_eq!(
        labelled(&["network", "ls"]).len(),
        4,
        "peers, control, 2 clients"
    );
    assert!(
        cluster.url().starts_with("etcd://127.0.0.1:"),
        "{}",
        cluster.url()
    );
    let leader = cluster
        .wait_for_quorum(Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut states = Vec::new();
    for i in 0..CLUSTER_SIZE {
        states.push(cluster.state(i).await);
    }
    assert_eq!(states[leader], MemberState::Leader, "{states:?}");
    assert_eq!(
        states
            .iter()
            .filter(|s| **s == MemberState::Follower)
            .count(),
        2,
        "{states:?}"
    );

    // Leader killed: the two others elect one of themselves; it comes back as a follower.
    cluster.kill(leader).await.unwrap();
    assert_eq!(cluster.state(leader).await, MemberState::Down);
    let new = cluster
        .wait_for_quorum(Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(new, leader);
    cluster.start_member(leader).await.unwrap();
    assert_eq!(cluster.state(leader).await, MemberState::Follower);

    // A follower parted from the others loses its leader; its client port still answers.
    let follower = (0..CLUSTER_SIZE).find(|&i| i != new).unwrap();
    cluster.partition(follower).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let state = cluster.state(follower).await;
        if state == MemberState::NoLeader {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a partitioned member still has a leader after 30 s: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        cluster.leader().await,
        Some(new),
        "the majority keeps its leader"
    );
    cluster.heal(follower).await.unwrap();
    cluster
        .wait_serving(follower, Duration::from_secs(60))
        .await
        .unwrap();

    // A restarted member serves again.
    cluster.restart(follower).await.unwrap();
    assert_ne!(cluster.state(follower).await, MemberState::Down);

    // Client 0 cut off: no member reachable on its network; client 1 unaffected.
    let first = |c: usize| cluster.client_endpoint(c, 0).to_string();
    assert!(reachable(&first(0), Duration::from_secs(5)).await);
    cluster.cut_client(0).await.unwrap();
    assert!(!reachable(&first(0), Duration::from_secs(3)).await);
    assert!(reachable(&first(1), Duration::from_secs(5)).await);
    cluster.restore_client(0).await.unwrap();
    assert!(reachable(&first(0), Duration::from_secs(5)).await);

    drop(cluster);
    assert_eq!(labelled(&["ps", "-a"]), Vec::<String>::new());
    assert_eq!(labelled(&["network", "ls"]), Vec::<String>::new());
}

/// The first column of the first row of `sql` on a new tokio-postgres connection to `url`.
async fn pg_one(client: &tokio_postgres::Client, sql: &str) -> String {
    let messages = tokio::time::timeout(Duration::from_secs(10), client.simple_query(sql))
        .await
        .unwrap_or_else(|_| panic!("{sql}: no answer within 10 s"))
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    messages
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{sql}: no row"))
}

async fn pg_connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio::time::timeout(
        Duration::from_secs(10),
        tokio_postgres::connect(url, tokio_postgres::NoTls),
    )
    .await
    .unwrap_or_else(|_| panic!("{url}: no connection within 10 s"))
    .unwrap_or_else(|e| panic!("{url}: {e}"));
    tokio::spawn(connection);
    client
}

/// `simba/pgbouncer`: PgBouncer and the PostgreSQL behind it, both published on 127.0.0.1
/// only; both modes' databases reach PostgreSQL's `simba`; in transaction mode two clients
/// share a server connection; the container goes with the `Pooler`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_container() {
    let docker = Docker::connect_with_defaults().unwrap();
    for mode in [servers::PoolMode::Transaction, servers::PoolMode::Session] {
        let pooler =
            tokio::time::timeout(Duration::from_secs(150), servers::pgbouncer_container(mode))
                .await
                .expect("no PgBouncer container within 150 s")
                .unwrap_or_else(|e| panic!("PgBouncer container: {e}"));
        let id = pooler.pooler().container_id().unwrap().to_owned();
        let details = docker.inspect_container(&id, None).await.unwrap();
        let labels = details.config.and_then(|c| c.labels).unwrap_or_default();
        assert_eq!(labels.get(LABEL).map(String::as_str), Some("1"));
        let ports = details
            .network_settings
            .and_then(|n| n.ports)
            .unwrap_or_default();
        let bindings: Vec<_> = ports.values().flatten().flatten().collect();
        assert_eq!(bindings.len(), 2, "{ports:?}");
        for binding in &bindings {
            assert_eq!(binding.host_ip.as_deref(), Some("127.0.0.1"), "{ports:?}");
        }
        assert!(!pooler.pooler().is_private() && !pooler.postgres().is_private());
        assert_ne!(pooler.pooler().port(), pooler.postgres().port());
        assert!(
            pooler.url().ends_with(&format!("/{}", mode.database())),
            "{}",
            pooler.url()
        );

        let through = pg_connect(pooler.url()).await;
        assert_eq!(pg_one(&through, "select current_database()").await, "simba");
        let direct = pg_connect(pooler.direct_url()).await;
        assert_eq!(pg_one(&direct, "select current_database()").await, "simba");
        let admin = pg_connect(&format!(
            "postgres://postgres@127.0.0.1:{}/pgbouncer",
            pooler.pooler().port()
        ))
        .await;
        let databases = admin.simple_query("SHOW DATABASES").await.unwrap();
        let pool_mode = databases.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r)
                if r.get("name") == Some(mode.database()) =>
            {
                r.get("pool_mode").map(str::to_owned)
            }
            _ => None,
        });
        assert_eq!(pool_mode.as_deref(), Some(mode.as_str()));

        if mode == servers::PoolMode::Transaction {
            // `through` used the only server connection; C's transaction gets it, and
            // `through`'s next statement, while C holds it, another one.
            let b1 = pg_one(&through, "select pg_backend_pid()").await;
            let c = pg_connect(pooler.url()).await;
            c.simple_query("begin").await.unwrap();
            let c1 = pg_one(&c, "select pg_backend_pid()").await;
            let b2 = pg_one(&through, "select pg_backend_pid()").await;
            c.simple_query("commit").await.unwrap();
            assert_eq!(c1, b1, "C did not get the idle server connection");
            assert_ne!(b2, b1, "B kept its server connection while C held it");
        }
        drop((through, direct, admin));
        drop(pooler);
        assert!(
            !exists(&docker, &id).await,
            "container {id} is still there after its Pooler was dropped"
        );
    }
}
