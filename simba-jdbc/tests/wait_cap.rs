//! The cap on native waits ([`simba_jdbc::MAX_NATIVE_WAITS`]): a store that waits for far
//! more distinct mutexes than the cap opens no more lock sessions than the cap (plus its
//! pool and its fixed connections), waits on the server with exactly the cap, and every
//! waiter, within the cap or beyond it, is woken and acquires once its mutex is released.
//!
//! The sessions are counted on the server, only the waiting store's: on PostgreSQL by an
//! `application_name` of its own (`pg_stat_activity`); on MariaDB by a database of its own
//! (`information_schema.PROCESSLIST.DB`), less the owner store's sessions counted before
//! the waiters came. Not by `HOST`: mysql_async moves a connection to a local server onto
//! its Unix socket unless the URL says `prefer_socket=false` (the harness's do), and
//! `PROCESSLIST` then shows `localhost` instead of `127.0.0.1:port` (seen in `simba
//! bench` runs), so a count by address misses them. On SQLite the cap bounds the blocking
//! lock-file waits, counted in `/proc/locks`.
#![allow(missing_docs)]
#![cfg_attr(
    not(all(feature = "sqlite", feature = "mysql", feature = "postgres")),
    allow(unused)
)]

mod common;

use std::time::Duration;

use futures_util::future::join_all;
use simba_core::backend::{Lease, LeaseStore, StoreEvent};
use simba_core::events::EventReceiver as Receiver;
use simba_jdbc::{MAX_NATIVE_WAITS, NATIVE_WAIT_POLL, SqlStore};
use simba_test_kit::suite::Harness;
use simba_test_kit::support::unique_name;
use tokio::time::Instant;

use common::{SqlHarness, sqlite_blocked};

/// Waiters on distinct mutexes: five times the cap.
const WAITERS: usize = 5 * MAX_NATIVE_WAITS;

/// The pool size of the test stores (`SqlHarness::config`).
const POOL: usize = 4;

/// Long enough that nothing here ends by the lease.
const LONG: Lease = Lease {
    ttl: Duration::from_secs(60),
    transition: Duration::from_secs(0),
};

/// How long the waits may take to reach the server's queue: each opens a session (tens of
/// milliseconds on a loaded 2-core machine, at most 16 of them); generous, it only
/// catches "never".
const QUEUED_LIMIT: Duration = Duration::from_secs(30);

/// How long we watch the session count once the waits are queued: several polls of the
/// waits beyond the cap (each would open a session if the cap did not hold).
const WATCH: Duration = Duration::from_secs(3);

/// How long every waiter may take to acquire after the releases: a wait beyond the cap
/// tries once per [`NATIVE_WAIT_POLL`] (1 s); the bound is many polls, for a loaded machine.
const ACQUIRE_LIMIT: Duration = Duration::from_secs(60);

/// How one backend's sessions are counted.
enum Counter {
    /// PostgreSQL: the waiting store's URL carries this `application_name`.
    #[cfg(feature = "postgres")]
    Postgres { admin_url: String, app: String },
    /// MariaDB: the stores use this database; `baseline` is the owner store's sessions.
    #[cfg(feature = "mysql")]
    Mysql {
        admin_url: String,
        db: String,
        baseline: usize,
    },
    /// SQLite: blocked requests on the lock file.
    Sqlite,
}

/// The waiting store's sessions and, among them, those waiting for a native lock.
async fn count(h: &SqlHarness, c: &Counter) -> (usize, usize) {
    match c {
        #[cfg(feature = "postgres")]
        Counter::Postgres { admin_url, app } => {
            let (client, conn) = tokio_postgres::connect(admin_url, tokio_postgres::NoTls)
                .await
                .expect("connect");
            let driver = tokio::spawn(conn);
            let row = client
                .query_one(
                    "SELECT (SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1), \
                     (SELECT COUNT(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                      WHERE a.application_name = $1 AND l.locktype = 'advisory' AND NOT l.granted)",
                    &[app],
                )
                .await
                .expect("pg_stat_activity");
            driver.abort();
            let n = |i: usize| usize::try_from(row.get::<_, i64>(i)).unwrap_or(0);
            (n(0), n(1))
        }
        #[cfg(feature = "mysql")]
        Counter::Mysql {
            admin_url,
            db,
            baseline,
        } => {
            use mysql_async::prelude::Queryable;
            let mut conn = mysql_async::Conn::from_url(admin_url.as_str())
                .await
                .expect("connect");
            // Our own session's DB is the harness's, not `db`: it is not counted.
            let row: Option<(i64, i64)> = conn
                .exec_first(
                    "SELECT COUNT(*), COALESCE(SUM(STATE = 'User lock'), 0) \
                     FROM information_schema.PROCESSLIST WHERE DB = ?",
                    (db.as_str(),),
                )
                .await
                .expect("processlist");
            let _ = conn.disconnect().await;
            let (all, waiting) = row.unwrap_or((0, 0));
            let all = usize::try_from(all).unwrap_or(0);
            (
                all.saturating_sub(*baseline),
                usize::try_from(waiting).unwrap_or(0),
            )
        }
        Counter::Sqlite => {
            let blocked = sqlite_blocked(h, true);
            (blocked, blocked)
        }
    }
}

/// The next event other than a Resync, within `limit`.
async fn next_event(rx: &mut Receiver, limit: Duration) -> Option<StoreEvent> {
    let until = Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(until, rx.recv()).await {
            Ok(Some(StoreEvent::Resync)) => {}
            Ok(other) => return other,
            Err(_) => return None,
        }
    }
}

/// `owner` holds [`WAITERS`] mutexes; `waiting` waits for each of them (one contender per
/// mutex). The waiting store's sessions stay within the cap (`fixed`: the connections it
/// has besides its pool and its lock sessions), exactly the cap waits on the server, and
/// after the releases every waiter acquires.
async fn capped(
    h: &SqlHarness,
    owner: &SqlStore,
    waiting: &SqlStore,
    counter: &Counter,
    fixed: usize,
) {
    let name = h.name();
    let mutexes: Vec<String> = (0..WAITERS).map(|i| format!("cap-{i}")).collect();
    for m in &mutexes {
        let r = owner.acquire(m, "o", LONG).await.expect("acquire");
        assert!(r.owner.is_owned_by_at("o", r.now), "{name}: {r:?}");
    }
    // Sessions a store of this test may have: the cap, the pool, and its fixed ones.
    let bound = MAX_NATIVE_WAITS + POOL + fixed;
    let mut rxs = Vec::new();
    for (i, m) in mutexes.iter().enumerate() {
        let id = format!("w{i}");
        let r = waiting.acquire(m, &id, LONG).await.expect("acquire");
        assert!(r.owner.is_owner("o"), "{name}: {id} finds o: {r:?}");
        let rx = waiting
            .subscribe(m, &id)
            .await
            .expect("subscribe")
            .expect("every SQL store pushes to its contenders");
        rxs.push(rx);
    }
    // The waits reach the server's queue: exactly the cap of them.
    let give_up = Instant::now() + QUEUED_LIMIT;
    let mut most = 0;
    loop {
        let (sessions, queued) = count(h, counter).await;
        most = most.max(sessions);
        assert!(
            sessions <= bound && queued <= MAX_NATIVE_WAITS,
            "{name}: {sessions} sessions ({queued} waiting) for {WAITERS} waiters; the cap \
             allows {bound} ({MAX_NATIVE_WAITS} waits)"
        );
        if queued == MAX_NATIVE_WAITS {
            break;
        }
        assert!(
            Instant::now() < give_up,
            "{name}: {queued} waits on the server after {QUEUED_LIMIT:?}, expected \
             {MAX_NATIVE_WAITS} ({sessions} sessions)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The waits beyond the cap poll meanwhile: they open nothing.
    let watch_until = Instant::now() + WATCH;
    while Instant::now() < watch_until {
        let (sessions, queued) = count(h, counter).await;
        most = most.max(sessions);
        assert!(
            sessions <= bound && queued <= MAX_NATIVE_WAITS,
            "{name}: {sessions} sessions ({queued} waiting) while the waits beyond the cap \
             poll; the cap allows {bound}; /proc/locks:\n{}",
            std::fs::read_to_string("/proc/locks").unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "{name}: at most {most} sessions of the waiting store for {WAITERS} waiters \
         (bound {bound}: cap {MAX_NATIVE_WAITS} + pool {POOL} + {fixed} fixed)"
    );
    // Every mutex is released; every waiter is woken and acquires.
    let released = Instant::now();
    for m in &mutexes {
        assert!(owner.release(m, "o").await.expect("release"), "{name}");
    }
    let name = name.as_str();
    let waits = rxs.into_iter().enumerate().map(|(i, mut rx)| {
        let m = mutexes[i].clone();
        async move {
            let id = format!("w{i}");
            let give_up = Instant::now() + ACQUIRE_LIMIT;
            loop {
                let left = give_up.saturating_duration_since(Instant::now());
                let Some(ev) = next_event(&mut rx, left).await else {
                    panic!("{name}: {id} was not woken within {ACQUIRE_LIMIT:?} of its release");
                };
                let r = waiting.acquire(&m, &id, LONG).await.expect("acquire");
                if r.owner.is_owned_by_at(&id, r.now) {
                    return released.elapsed();
                }
                // A wake-up that was not the lock's (an Acquired on PostgreSQL): wait on.
                assert!(
                    !matches!(ev, StoreEvent::Released) || r.owner.owner_id.is_empty(),
                    "{name}: {id} woken by a release finds {r:?}"
                );
            }
        }
    });
    let took = join_all(waits).await;
    let slowest = took.iter().max().copied().unwrap_or_default();
    eprintln!(
        "{name}: all {WAITERS} waiters acquired; the last {slowest:?} after the releases began \
         (poll {NATIVE_WAIT_POLL:?})"
    );
    let (sessions, _) = count(h, counter).await;
    assert!(
        sessions <= bound,
        "{name}: {sessions} sessions with every mutex acquired; the cap allows {bound}"
    );
    for (i, m) in mutexes.iter().enumerate() {
        waiting.release(m, &format!("w{i}")).await.expect("release");
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_waits_beyond_the_cap_take_no_session() {
    let h = SqlHarness::postgres().await;
    let app = unique_name("simba_cap");
    let sep = if h.url().contains('?') { '&' } else { '?' };
    let url = format!("{}{sep}application_name={app}", h.url());
    let owner = h.store().await.expect("store");
    let waiting = SqlStore::connect(h.config(&url)).await.expect("store");
    let counter = Counter::Postgres {
        admin_url: h.url().to_owned(),
        app,
    };
    // Besides the pool and the lock sessions: the shared lock session, the LISTEN
    // connection and up to 4 prepared-statement connections (`postgres::fast::MAX_CONNS`).
    capped(&h, &owner, &waiting, &counter, 6).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_waits_beyond_the_cap_take_no_session() {
    use mysql_async::prelude::Queryable;
    let h = SqlHarness::mysql().await;
    // A database of the test's own, so that PROCESSLIST tells its sessions apart.
    let db = unique_name("simba_cap");
    let mut admin = mysql_async::Conn::from_url(h.url()).await.expect("connect");
    admin
        .query_drop(format!("CREATE DATABASE `{db}`"))
        .await
        .expect("create database");
    let url = with_database(h.url(), &db);
    let owner = SqlStore::connect(h.config(&url)).await.expect("store");
    owner.migrate().await.expect("migrate");
    let waiting = SqlStore::connect(h.config(&url)).await.expect("store");
    // The owner's sessions: its pool (one connection so far) and, once it holds locks,
    // its shared lock session. Taken one lock first, so that both exist.
    let warm = owner.acquire("cap-warm", "o", LONG).await.expect("acquire");
    assert!(warm.owner.is_owned_by_at("o", warm.now));
    let mut counter = Counter::Mysql {
        admin_url: h.url().to_owned(),
        db: db.clone(),
        baseline: 0,
    };
    let (before, _) = count(&h, &counter).await;
    if let Counter::Mysql { baseline, .. } = &mut counter {
        // The owner's, and the waiting store's one pooled connection (it connected).
        *baseline = before.saturating_sub(1);
    }
    // Besides the pool and the lock sessions: the shared lock session.
    capped(&h, &owner, &waiting, &counter, 1).await;
    drop((owner, waiting));
    let _ = admin.query_drop(format!("DROP DATABASE `{db}`")).await;
    let _ = admin.disconnect().await;
}

/// `url` with its database (the path) replaced by `db`.
#[cfg(feature = "mysql")]
fn with_database(url: &str, db: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let query = path.split_once('?').map(|(_, q)| q);
    match query {
        Some(q) => format!("{scheme}://{host}/{db}?{q}"),
        None => format!("{scheme}://{host}/{db}"),
    }
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_waits_beyond_the_cap_take_no_thread() {
    let h = SqlHarness::sqlite();
    let owner = h.store().await.expect("store");
    let waiting = h.store().await.expect("store");
    capped(&h, &owner, &waiting, &Counter::Sqlite, 0).await;
}
