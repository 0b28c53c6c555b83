//! PgBouncer in front of the kit's PostgreSQL: tokio-postgres (simba-jdbc's driver)
//! connects through it in both modes, transaction mode really shares server connections
//! between clients (and session mode does not), and a private pooler obeys
//! restart/kill/pause/resume on its port while the PostgreSQL behind it goes on.

use std::time::{Duration, Instant};

use simba_test_kit::servers::{self, PoolMode, Pooler, ServerError, ServerKind};
use tokio::time::timeout;
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

const START: Duration = Duration::from_secs(90);
const STEP: Duration = Duration::from_secs(30);

async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    timeout(limit, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {limit:?}"))
}

async fn started(what: &str, fut: impl Future<Output = Result<Pooler, ServerError>>) -> Pooler {
    let t = Instant::now();
    let pooler = within(START, what, fut)
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    eprintln!(
        "{what}: ready in {:?} at {} (direct {})",
        t.elapsed(),
        pooler.url(),
        pooler.direct_url()
    );
    pooler
}

/// A tokio-postgres client on `url`, its connection driven on a task; an error after 5 s.
async fn connect(url: &str) -> Result<Client, String> {
    let (client, connection) = timeout(Duration::from_secs(5), tokio_postgres::connect(url, NoTls))
        .await
        .map_err(|_| format!("connecting to {url}: no answer within 5 s"))?
        .map_err(|e| format!("connecting to {url}: {e}"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// The first column of the first row of `sql` (simple protocol), as text.
async fn one(client: &Client, sql: &str) -> Result<String, String> {
    let messages = timeout(Duration::from_secs(5), client.simple_query(sql))
        .await
        .map_err(|_| format!("{sql}: no answer within 5 s"))?
        .map_err(|e| format!("{sql}: {e}"))?;
    messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .ok_or_else(|| format!("{sql}: no row"))
}

/// Some bits that differ between runs (the clock's nanoseconds).
fn rand_seed() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0)
}

async fn backend_pid(client: &Client) -> String {
    one(client, "select pg_backend_pid()")
        .await
        .expect("pg_backend_pid")
}

/// Connects and runs a query, retrying for up to `limit` (a restarted PostgreSQL: the first
/// query on a server connection from before the restart fails, PgBouncer then drops it).
async fn answers_within(url: &str, limit: Duration) -> Result<String, String> {
    let deadline = Instant::now() + limit;
    loop {
        let attempt = async { one(&connect(url).await?, "select current_database()").await };
        match attempt.await {
            Ok(db) => return Ok(db),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

#[tokio::test]
async fn connects_through_pgbouncer_in_both_modes() {
    for mode in [PoolMode::Transaction, PoolMode::Session] {
        let pooler = started(&format!("pgbouncer({mode:?})"), servers::pgbouncer(mode)).await;
        assert_eq!(pooler.mode(), mode);
        assert_eq!(pooler.pooler().kind(), ServerKind::Pgbouncer);
        assert_eq!(pooler.postgres().kind(), ServerKind::Postgres);
        assert!(!pooler.url().contains("simba_pooler"), "{}", pooler.url());
        assert_ne!(pooler.url(), pooler.direct_url());
        let through = connect(pooler.url()).await.expect("through PgBouncer");
        // Both modes' databases are PostgreSQL's `simba`.
        assert_eq!(
            one(&through, "select current_database()").await.as_deref(),
            Ok("simba")
        );
        let direct = connect(pooler.direct_url()).await.expect("direct");
        // What one writes the other reads: the same database behind both URLs. (A table of
        // this run's own: the PostgreSQL may be a shared one.)
        let table = format!("seen_{}_{}", std::process::id(), rand_seed());
        direct
            .simple_query(&format!("create table {table} (mode text)"))
            .await
            .expect("create table directly");
        through
            .simple_query(&format!("insert into {table} values ('{}')", mode.as_str()))
            .await
            .expect("insert through PgBouncer");
        assert_eq!(
            one(&direct, &format!("select mode from {table}"))
                .await
                .as_deref(),
            Ok(mode.as_str())
        );
        direct
            .simple_query(&format!("drop table {table}"))
            .await
            .expect("drop table");
        // The admin console names the pool mode of the URL's database.
        let admin_url = format!(
            "postgres://postgres@{}:{}/pgbouncer",
            pooler.pooler().host(),
            pooler.pooler().port()
        );
        let admin = connect(&admin_url).await.expect("admin console");
        let pools = admin
            .simple_query("SHOW DATABASES")
            .await
            .expect("SHOW DATABASES");
        let database = mode.database();
        let row = pools
            .iter()
            .find_map(|m| match m {
                SimpleQueryMessage::Row(r) if r.get("name") == Some(database) => Some(r),
                _ => None,
            })
            .unwrap_or_else(|| panic!("SHOW DATABASES has no {database}"));
        assert_eq!(row.get("pool_mode"), Some(mode.as_str()));
        let size = match mode {
            PoolMode::Transaction => servers::TRANSACTION_POOL_SIZE,
            PoolMode::Session => servers::SESSION_POOL_SIZE,
        };
        assert_eq!(row.get("pool_size"), Some(size.to_string().as_str()));
    }
}

/// Client B runs a statement, then client C opens a transaction and runs one, then B runs
/// another while C's transaction is open: `(B's first pid, C's pid, B's second pid)`.
/// The pool starts empty, so B's first statement opens the only server connection.
async fn interleave(pooler: &Pooler) -> (String, String, String) {
    let b = connect(pooler.url()).await.expect("client B");
    let c = connect(pooler.url()).await.expect("client C");
    let b1 = backend_pid(&b).await;
    c.simple_query("begin").await.expect("begin");
    let c1 = backend_pid(&c).await;
    let b2 = backend_pid(&b).await;
    c.simple_query("commit").await.expect("commit");
    (b1, c1, b2)
}

#[tokio::test]
async fn transaction_mode_shares_server_connections_and_session_mode_does_not() {
    let pooler = started(
        "pgbouncer_private(Transaction)",
        servers::pgbouncer_private(PoolMode::Transaction),
    )
    .await;
    let (b1, c1, b2) = interleave(&pooler).await;
    // C's transaction ran on the server connection B had used: two clients, one server
    // connection. B's next statement, while C holds it, ran on another one.
    assert_eq!(
        c1, b1,
        "C did not get the idle server connection B had used"
    );
    assert_ne!(b2, b1, "B kept its server connection although C held it");

    // More clients than server connections, all connected at once: each statement still
    // runs, on at most the pool's 4 server connections.
    assert_eq!(servers::TRANSACTION_POOL_SIZE, 4);
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(connect(pooler.url()).await.expect("a client"));
    }
    let mut pids = std::collections::BTreeSet::new();
    for client in &clients {
        pids.insert(backend_pid(client).await);
    }
    assert!(
        pids.len() <= 4,
        "8 clients used {} server connections: {pids:?}",
        pids.len()
    );

    let session = started(
        "pgbouncer_private(Session)",
        servers::pgbouncer_private(PoolMode::Session),
    )
    .await;
    let (b1, c1, b2) = interleave(&session).await;
    assert_ne!(
        c1, b1,
        "session mode gave C the server connection of B's session"
    );
    assert_eq!(b2, b1, "session mode moved B to another server connection");
}

#[tokio::test]
async fn private_pooler_obeys_restart_kill_pause_and_postgres_restart() {
    let pooler = started(
        "pgbouncer_private(Transaction)",
        servers::pgbouncer_private(PoolMode::Transaction),
    )
    .await;
    assert!(pooler.pooler().is_private() && pooler.postgres().is_private());
    let url = pooler.url().to_owned();
    let port = pooler.pooler().port();
    let postgres_pid = pooler.postgres().pid();
    assert_eq!(answers_within(&url, STEP).await.as_deref(), Ok("simba"));

    let t = Instant::now();
    within(STEP, "restart", pooler.pooler().restart())
        .await
        .expect("restart PgBouncer");
    eprintln!("pgbouncer restart: {:?}", t.elapsed());
    assert_eq!(pooler.pooler().port(), port);
    assert_eq!(
        pooler.postgres().pid(),
        postgres_pid,
        "PostgreSQL was touched"
    );
    assert_eq!(connect(&url).await.map(drop), Ok(()));
    assert_eq!(answers_within(&url, STEP).await.as_deref(), Ok("simba"));

    within(STEP, "kill", pooler.pooler().kill())
        .await
        .expect("kill PgBouncer");
    assert!(connect(&url).await.is_err(), "a killed PgBouncer answered");
    // PostgreSQL itself goes on.
    assert_eq!(
        answers_within(pooler.direct_url(), STEP).await.as_deref(),
        Ok("simba")
    );
    within(STEP, "start", pooler.pooler().start())
        .await
        .expect("start PgBouncer");
    assert_eq!(answers_within(&url, STEP).await.as_deref(), Ok("simba"));

    // A client connected before the pause gets no answer while PgBouncer is stopped.
    let client = connect(&url).await.expect("client before the pause");
    within(STEP, "pause", pooler.pooler().pause())
        .await
        .expect("pause PgBouncer");
    let paused = one(&client, "select 1").await;
    assert!(paused.is_err(), "a paused PgBouncer answered: {paused:?}");
    within(STEP, "resume", pooler.pooler().resume())
        .await
        .expect("resume PgBouncer");
    assert_eq!(answers_within(&url, STEP).await.as_deref(), Ok("simba"));

    // PostgreSQL restarted behind PgBouncer: the pooler reconnects by itself.
    let t = Instant::now();
    within(STEP, "restart PostgreSQL", pooler.postgres().restart())
        .await
        .expect("restart PostgreSQL");
    assert_eq!(answers_within(&url, STEP).await.as_deref(), Ok("simba"));
    eprintln!(
        "PostgreSQL restart, answered through PgBouncer again after {:?}",
        t.elapsed()
    );
}

#[tokio::test]
async fn pgbouncer_without_postgres_says_which_function_to_use() {
    let error = servers::private(ServerKind::Pgbouncer)
        .await
        .map(drop)
        .expect_err("a PgBouncer without PostgreSQL");
    let text = error.to_string();
    assert!(text.contains("pgbouncer_private(PoolMode)"), "{text}");
}
