//! The native wait queues, store by store (each store has its own sessions, as a separate
//! process would): FIFO order across three waiters, one wake-up per release, a killed
//! waiter skipped, and on SQLite the takeover from a killed owner process and none from a
//! paused one before its lease ends.
//!
//! Killed and paused processes are real: the test re-runs its own binary with
//! [`CHILD_ENV`] set, and the child acts as an owner or a waiter until it is killed.
#![allow(missing_docs)]
// With only some backend features, parts of this file are unused.
#![cfg_attr(
    not(all(feature = "sqlite", feature = "mysql", feature = "postgres")),
    allow(unused)
)]

mod common;

use std::process::Stdio;
use std::time::Duration;

use simba_core::backend::{Lease, LeaseStore, StoreEvent};
use simba_core::events::EventReceiver as Receiver;
use simba_jdbc::SqlStore;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::{Instant, timeout};

use common::{LEASE, SqlHarness, sqlite_blocked};
use simba_test_kit::suite::Harness;

/// Set in the children: `ROLE|URL|TABLE|MUTEX|ID|TTL MS`.
const CHILD_ENV: &str = "SIMBA_JDBC_WAIT_QUEUE_CHILD";

/// Long enough that nothing in these tests ends by the lease unless it waits for that.
const LONG: Lease = Lease {
    ttl: Duration::from_secs(30),
    transition: Duration::from_secs(0),
};

/// How long a push may take on a loaded machine: the native lock hands over in well under
/// a millisecond on loopback; this bound only catches "never".
const PUSH: Duration = Duration::from_secs(5);

/// How long we watch for an event that must not come. The handoffs in these tests take
/// about a millisecond; a second is far longer, short enough to keep the test quick.
const QUIET: Duration = Duration::from_secs(1);

async fn next_event(rx: &mut Receiver, who: &str) -> StoreEvent {
    timeout(PUSH, rx.recv())
        .await
        .unwrap_or_else(|_| panic!("{who} was not woken within {PUSH:?}"))
        .unwrap_or_else(|| panic!("{who}'s channel closed"))
}

/// Whether an event other than a Resync comes within [`QUIET`].
async fn woken(rx: &mut Receiver) -> Option<StoreEvent> {
    let until = Instant::now() + QUIET;
    loop {
        match tokio::time::timeout_at(until, rx.recv()).await {
            Ok(Some(StoreEvent::Resync)) => {}
            Ok(other) => return other,
            Err(_) => return None,
        }
    }
}

/// How many sessions wait for a native lock of this harness: PostgreSQL and MariaDB say
/// so in their catalogs, SQLite's lock file in `/proc/locks` (blocked requests start
/// with `->`). The tests wait on it until a waiter has reached the server's queue before the
/// next one joins, so that the queue's order is the order of the test.
async fn queued(h: &SqlHarness) -> usize {
    match h.name().as_str() {
        #[cfg(feature = "postgres")]
        "postgres" => {
            let (client, conn) = tokio_postgres::connect(h.url(), tokio_postgres::NoTls)
                .await
                .expect("connect");
            let driver = tokio::spawn(conn);
            let row = client
                .query_one(
                    "SELECT COUNT(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                     AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                    &[],
                )
                .await
                .expect("pg_locks");
            driver.abort();
            usize::try_from(row.get::<_, i64>(0)).unwrap_or(0)
        }
        #[cfg(feature = "mysql")]
        "mysql" => {
            use mysql_async::prelude::Queryable;
            let mut conn = mysql_async::Conn::from_url(h.url()).await.expect("connect");
            let n: Option<i64> = conn
                .query_first(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
                     WHERE STATE = 'User lock' AND INFO LIKE '%GET_LOCK%'",
                )
                .await
                .expect("processlist");
            let _ = conn.disconnect().await;
            usize::try_from(n.unwrap_or(0)).unwrap_or(0)
        }
        // `/proc/locks` is read in pieces, and a line can come twice when other processes
        // change their locks between two pieces (the test command runs many at once): a
        // waiter counted twice let the FIFO case go on before the next waiter had queued
        // ("w2 was not woken", seen once under load). Such a count does not last: the
        // least of three reads.
        _ => {
            let mut least = sqlite_blocked(h, false);
            for _ in 0..2 {
                tokio::time::sleep(Duration::from_millis(2)).await;
                least = least.min(sqlite_blocked(h, false));
            }
            least
        }
    }
}

/// Waits (bounded) until `n` sessions wait on the server.
async fn until_queued(h: &SqlHarness, n: usize) {
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        let q = queued(h).await;
        if q >= n {
            return;
        }
        assert!(
            Instant::now() < give_up,
            "{}: {q} sessions wait, expected {n}",
            h.name()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A waiter: its first look found the mutex held, and it subscribed (in this order, as
/// the engine's first attempt does: a store pushes to the contenders it knows).
async fn waiter(store: &SqlStore, m: &str, id: &str, owner: &str) -> Receiver {
    let r = store.acquire(m, id, LONG).await.expect("acquire");
    assert!(r.owner.is_owner(owner), "{id} finds {owner}: {r:?}");
    store
        .subscribe(m, id)
        .await
        .expect("subscribe")
        .expect("every SQL store pushes to its contenders")
}

/// Three waiters in three stores are woken one per release, in the order they came, and
/// each takes the mutex when woken; the releaser coming back queues behind them.
async fn fifo(h: &SqlHarness) {
    let m = "fifo";
    let owner = h.store().await.expect("store");
    let stores = [
        h.store().await.expect("store"),
        h.store().await.expect("store"),
        h.store().await.expect("store"),
    ];
    let ids = ["w1", "w2", "w3"];
    let first = owner.acquire(m, "o", LONG).await.expect("acquire");
    assert!(first.owner.is_owned_by_at("o", first.now), "{first:?}");
    let mut rxs = Vec::new();
    for (i, (s, id)) in stores.iter().zip(ids).enumerate() {
        rxs.push(waiter(s, m, id, "o").await);
        until_queued(h, i + 1).await;
    }
    assert!(owner.release(m, "o").await.expect("release"));
    // SQLite: the kernel does not hand a file lock over, it wakes the waiter, which takes
    // the lock when it next runs; a request made in between goes first (the crate
    // README, "why an entry byte"). The releaser's own wait would be such a request when
    // the woken waiter is slow to run (a loaded machine), so on SQLite the releaser
    // contends once w1 has been handed the lock and w2 has queued again (two blocked
    // requests: w2 on the lock byte, w3 behind it on the entry byte). The servers grant
    // the lock before the unlock returns: there it contends at once.
    let mut first_wake = None;
    if h.name() == "sqlite" {
        first_wake = Some(next_event(&mut rxs[0], ids[0]).await);
        until_queued(h, 2).await;
    }
    // The releaser contends again: it queues behind the three.
    let again = owner.acquire(m, "o", LONG).await.expect("acquire again");
    let back = owner
        .subscribe(m, "o")
        .await
        .expect("subscribe")
        .expect("push");
    assert!(
        !again.owner.is_owner("o"),
        "{}: the releaser barged past three waiters: {again:?}",
        h.name()
    );
    let mut fence = first.owner.fence;
    for i in 0..3 {
        let ev = match first_wake.take() {
            Some(ev) => ev,
            None => next_event(&mut rxs[i], ids[i]).await,
        };
        assert_eq!(ev, StoreEvent::Released, "{}", ids[i]);
        for (j, rx) in rxs.iter_mut().enumerate().skip(i + 1) {
            assert!(
                rx.try_recv().is_err(),
                "{}: {} was woken with {} (one wake-up per release)",
                h.name(),
                ids[j],
                ids[i]
            );
        }
        let r = stores[i].acquire(m, ids[i], LONG).await.expect("acquire");
        assert!(r.owner.is_owned_by_at(ids[i], r.now), "{}: {r:?}", ids[i]);
        assert!(r.owner.fence > fence, "fences grow");
        fence = r.owner.fence;
        assert!(stores[i].release(m, ids[i]).await.expect("release"));
    }
    let mut back = back;
    assert_eq!(next_event(&mut back, "o").await, StoreEvent::Released);
    let r = owner.acquire(m, "o", LONG).await.expect("acquire");
    assert!(r.owner.is_owned_by_at("o", r.now), "{r:?}");
    assert!(owner.release(m, "o").await.expect("release"));
}

/// A child process of this test binary in `role`, and its stdout lines.
struct Child {
    child: tokio::process::Child,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl Child {
    async fn start(h: &SqlHarness, role: &str, m: &str, id: &str, lease: Lease) -> Child {
        let exe = std::env::current_exe().expect("test binary");
        let spec = format!(
            "{role}|{}|{}|{m}|{id}|{}",
            h.url(),
            h.table(),
            lease.ttl.as_millis()
        );
        let mut child = tokio::process::Command::new(exe)
            .args(["--exact", "child", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, spec)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn child");
        let out = child.stdout.take().expect("stdout");
        Child {
            child,
            lines: BufReader::new(out).lines(),
        }
    }

    /// Waits for the child's line that starts with `word`; returns the rest.
    async fn said(&mut self, word: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.next_line())
                .await
                .unwrap_or_else(|_| panic!("the child never said {word:?}"))
                .expect("child stdout")
                .unwrap_or_else(|| panic!("the child ended before saying {word:?}"));
            // libtest prints `test child ... ` before the child's first line.
            if let Some((_, rest)) = line.split_once(&format!("{word} ")) {
                return rest.trim().to_owned();
            }
        }
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.id().expect("running child");
        let ok = std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .expect("kill(1)")
            .success();
        assert!(ok, "kill {sig} {pid}");
    }

    async fn kill(mut self) {
        self.child.kill().await.expect("SIGKILL");
    }
}

/// The child side; does nothing in a normal test run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split('|').collect();
    let [role, url, table, m, id, ttl_ms] = parts[..] else {
        panic!("bad {CHILD_ENV}: {spec}");
    };
    let lease = Lease {
        ttl: Duration::from_millis(ttl_ms.parse().expect("ttl")),
        transition: Duration::ZERO,
    };
    let store = SqlStore::connect(
        simba_jdbc::SqlConfig::new(url)
            .with_table(table)
            .with_statement_timeout(common::STATEMENT_TIMEOUT),
    )
    .await
    .expect("child connects");
    store.migrate().await.expect("child migrates");
    let r = store.acquire(m, id, lease).await.expect("acquire");
    let _rx = store.subscribe(m, id).await.expect("subscribe");
    match role {
        "own" => {
            assert!(r.owner.is_owned_by_at(id, r.now), "child owns: {r:?}");
            println!("owned {}", r.owner.fence);
        }
        _ => println!("waiting {}", r.owner.owner_id),
    }
    // Until killed.
    std::future::pending::<()>().await;
}

/// A waiter process killed while it waits (its session dies with it) is skipped: the
/// release goes to the waiter behind it.
async fn killed_waiter_skipped(h: &SqlHarness) {
    let m = "killed-waiter";
    let owner = h.store().await.expect("store");
    let after = h.store().await.expect("store");
    assert!(
        owner
            .acquire(m, "o", LONG)
            .await
            .expect("acquire")
            .owner
            .is_owner("o")
    );
    let mut dead = Child::start(h, "wait", m, "dead", LONG).await;
    assert_eq!(dead.said("waiting").await, "o");
    until_queued(h, 1).await;
    let mut rx = waiter(&after, m, "next", "o").await;
    until_queued(h, 2).await;
    dead.kill().await;
    assert!(owner.release(m, "o").await.expect("release"));
    assert_eq!(next_event(&mut rx, "next").await, StoreEvent::Released);
    let r = after.acquire(m, "next", LONG).await.expect("acquire");
    assert!(r.owner.is_owned_by_at("next", r.now), "{}: {r:?}", h.name());
    assert!(after.release(m, "next").await.expect("release"));
}

/// A contender that looks once, finds the mutex held and gives up at once (what
/// `try_acquire` does) leaves nothing waiting on the server: once the owner releases, a new
/// contender of the same store takes the mutex at its first look.
///
/// Each round uses a new store, so the waiter's gate has no spare session and its wait
/// connects one: a give-up that reaches it while it connects, or before its lock statement
/// has started on the server, once sent a single cancel request that ended nothing; the
/// wait blocked until the statement timeout, and the lock freed by the release went to it,
/// so `try_acquire` after the release said `WouldBlock` (CI, `tls_mysql
/// suite::try_acquire`, over TLS on a loaded machine). On an idle machine the statement is
/// usually on the server first and this passed with that code too; the unit tests
/// `native::cancel_tests` reproduce the early cancel every time.
async fn give_up_at_once(h: &SqlHarness) {
    for round in 0..12 {
        let m = format!("give_up_{round}");
        let owner = h.store().await.expect("store");
        let other = h.store().await.expect("store");
        let first = owner.acquire(&m, "o", LONG).await.expect("acquire");
        assert!(first.owner.is_owned_by_at("o", first.now), "{first:?}");
        let look = other.acquire(&m, "t1", LONG).await.expect("acquire");
        assert!(look.owner.is_owner("o"), "round {round}: t1 finds {look:?}");
        // The engine's give-up: release (it may have won unknowingly), then leave.
        let since = Instant::now();
        other.release(&m, "t1").await.expect("release");
        other.leave(&m, "t1").await.expect("leave");
        let gave_up = since.elapsed();
        assert!(
            owner.release(&m, "o").await.expect("release"),
            "round {round}"
        );
        let next = other.acquire(&m, "t2", LONG).await.expect("acquire");
        assert!(
            next.owner.is_owned_by_at("t2", next.now),
            "{} round {round}: after the owner's release, a new contender's first look \
             found {next:?} (the give-up before it took {gave_up:?})",
            h.name()
        );
        assert!(other.release(&m, "t2").await.expect("release"));
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_give_up_at_once() {
    give_up_at_once(&SqlHarness::postgres().await).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_give_up_at_once() {
    give_up_at_once(&SqlHarness::mysql().await).await;
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_give_up_at_once() {
    give_up_at_once(&SqlHarness::sqlite()).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_wait_queue() {
    let h = SqlHarness::postgres().await;
    fifo(&h).await;
    killed_waiter_skipped(&h).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_wait_queue() {
    let h = SqlHarness::mysql().await;
    fifo(&h).await;
    killed_waiter_skipped(&h).await;
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_wait_queue() {
    let h = SqlHarness::sqlite();
    fifo(&h).await;
    killed_waiter_skipped(&h).await;
}

/// SQLite: when the owner's process is SIGKILLed, the kernel frees its lock, and the
/// waiter takes the mutex over at once (fence + 1), long before the owner's 30 s lease
/// would have ended. (The time of this takeover is measured by `simba bench`; here the
/// bound is generous: 5 s of a 30 s lease.)
/// On MySQL and SQLite nothing pushes to an observer (a subscriber that never acquired):
/// it gets no channel, and the engine reads on its own schedule.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_observers_are_not_subscribed() {
    let h = SqlHarness::sqlite();
    let store = h.store().await.expect("store");
    assert!(
        store
            .subscribe("watched", "observer")
            .await
            .expect("subscribe")
            .is_none()
    );
    store.acquire("watched", "c", LONG).await.expect("acquire");
    assert!(
        store
            .subscribe("watched", "c")
            .await
            .expect("subscribe")
            .is_some(),
        "a contender is pushed"
    );
    assert!(store.release("watched", "c").await.expect("release"));
}

// Linux only: elsewhere the lock files are named by the path and prove nothing about an
// owner, so the lease decides (simba-jdbc's README, *SQLite: the lock*).
#[cfg(all(feature = "sqlite", target_os = "linux"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_takes_over_from_a_killed_owner() {
    let h = SqlHarness::sqlite();
    let m = "killed-owner";
    let mut owner = Child::start(&h, "own", m, "doomed", LONG).await;
    let fence: u64 = owner.said("owned").await.parse().expect("fence");
    let store = h.store().await.expect("store");
    let mut rx = waiter(&store, m, "heir", "doomed").await;
    owner.kill().await;
    let killed = Instant::now();
    assert_eq!(next_event(&mut rx, "heir").await, StoreEvent::Released);
    let r = store.acquire(m, "heir", LONG).await.expect("acquire");
    let took = killed.elapsed();
    assert!(r.owner.is_owned_by_at("heir", r.now), "{r:?}");
    assert!(
        r.owner.fence > fence,
        "a takeover is a new ownership: {r:?}"
    );
    assert!(
        took < Duration::from_secs(5),
        "took over {took:?} after the kill (the lease had 30 s left)"
    );
    assert!(store.release(m, "heir").await.expect("release"));
}

/// SQLite: a gated row is taken over at once only by a holder of the lock of the file
/// the owner locked: the owner's gated flag (`waiter_until`) is its database file's
/// identity. A row whose flag is another file's (a database copied or moved over this
/// one) or 1 (an earlier build's, whose lock was a file named by the path) is left to its
/// lease, though the killed owner's lock is free; with its own file's identity back, the
/// same row is taken over at once.
#[cfg(all(feature = "sqlite", target_os = "linux"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_takes_over_at_once_only_a_row_gated_by_its_own_file() {
    use diesel::Connection;
    use diesel::connection::SimpleConnection;
    #[derive(diesel::QueryableByName)]
    struct Flag {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        waiter_until: i64,
    }
    let h = SqlHarness::sqlite();
    let m = "gated-by-identity";
    let mut owner = Child::start(&h, "own", m, "doomed", LONG).await;
    owner.said("owned").await;
    owner.kill().await;
    let path = h.url().strip_prefix("sqlite://").expect("a sqlite url");
    let mut raw = diesel::SqliteConnection::establish(path).expect("open the file");
    let flag: Vec<Flag> = diesel::RunQueryDsl::load(
        diesel::sql_query(format!(
            "SELECT waiter_until FROM {} WHERE mutex = '{m}'",
            h.table()
        )),
        &mut raw,
    )
    .expect("read the flag");
    let own = flag.first().expect("the row").waiter_until;
    assert!(
        own >= 2,
        "the owner's gated flag is its file's identity, not {own}"
    );
    let store = h.store().await.expect("store");
    let set = |raw: &mut diesel::SqliteConnection, v: i64| {
        raw.batch_execute(&format!(
            "UPDATE {} SET waiter_until = {v} WHERE mutex = '{m}'",
            h.table()
        ))
        .expect("set the flag");
    };
    let other_file = if own == i64::MAX { own - 1 } else { own + 1 };
    for flag in [other_file, 1] {
        set(&mut raw, flag);
        for _ in 0..2 {
            let r = store.acquire(m, "heir", LONG).await.expect("acquire");
            assert!(
                r.owner.is_owner("doomed"),
                "a row gated with {flag} (this file's identity is {own}) was taken over at \
                 once: {r:?}"
            );
        }
    }
    set(&mut raw, own);
    let r = store.acquire(m, "heir", LONG).await.expect("acquire");
    assert!(
        r.owner.is_owned_by_at("heir", r.now),
        "a row gated by this file's lock, free, was not taken over: {r:?}"
    );
    assert!(store.release(m, "heir").await.expect("release"));
}

/// SQLite: a paused (SIGSTOP) owner process keeps its lock, so nobody takes its
/// mutex before its lease ends; after the end the waiter takes it by the lease.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_no_takeover_from_a_paused_owner() {
    let h = SqlHarness::sqlite();
    let m = "paused-owner";
    // Time is the subject: a 3 s lease, long against the push (about a millisecond), so
    // "no takeover before its end" is seen well before it, and short enough for a test.
    let lease = Lease {
        ttl: Duration::from_secs(3),
        transition: Duration::ZERO,
    };
    let mut owner = Child::start(&h, "own", m, "sleeper", lease).await;
    let fence: u64 = owner.said("owned").await.parse().expect("fence");
    owner.signal("-STOP");
    let store = h.store().await.expect("store");
    let mut rx = waiter(&store, m, "heir", "sleeper").await;
    let seen = store.owner(m).await.expect("owner");
    assert!(seen.owner.is_owner("sleeper"), "{seen:?}");
    let ends = seen.owner.transition_at;
    // No wake-up while the paused owner's lease runs (we watch for a second of it).
    assert_eq!(
        woken(&mut rx).await,
        None,
        "a paused owner's lock was taken"
    );
    let r = store.acquire(m, "heir", LEASE).await.expect("acquire");
    assert!(
        r.now >= ends || r.owner.is_owner("sleeper"),
        "taken before the paused owner's lease ended: {r:?}"
    );
    // After the lease's end (database clock), the waiter takes it by the lease.
    let give_up = Instant::now() + Duration::from_secs(10);
    let taken = loop {
        let r = store.acquire(m, "heir", LEASE).await.expect("acquire");
        if r.owner.is_owned_by_at("heir", r.now) {
            break r;
        }
        assert!(Instant::now() < give_up, "never taken: {r:?}");
        let left = u64::try_from(r.owner.transition_at - r.now).unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(left.clamp(1, 500))).await;
    };
    assert!(taken.now >= ends, "taken at {} < {ends}", taken.now);
    assert!(taken.owner.fence > fence);
    owner.signal("-CONT");
    owner.kill().await;
    assert!(store.release(m, "heir").await.expect("release"));
}

/// A SQLite contender without the mutex's native lock that cannot take the row does not
/// write: while another connection holds SQLite's write lock, its acquisition answers
/// "owned by the owner" at once. (An `UPDATE` that matches nothing still takes the write
/// lock: when the contender holding the native lock wrote at the same instant, it slept in
/// SQLite's busy handler, 1 ms first, the handoff's p99.) Without the read first, the
/// acquisition waits for the write lock until the busy timeout and fails.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_losing_contender_does_not_wait_for_the_write_lock() {
    use diesel::Connection;
    use diesel::connection::SimpleConnection;
    let h = SqlHarness::sqlite();
    let owner = h.store().await.expect("store");
    let r = owner.acquire("m", "a", LEASE).await.expect("acquire");
    assert!(r.owner.is_owned_by_at("a", r.now), "{r:?}");
    // Another store (another process's): the native lock is the owner's.
    let short = std::time::Duration::from_secs(2);
    let other = SqlStore::connect(h.config(h.url()).with_statement_timeout(short))
        .await
        .expect("connect");
    other.migrate().await.expect("migrate");
    let path = h.url().strip_prefix("sqlite://").expect("a sqlite url");
    let mut writer = diesel::SqliteConnection::establish(path).expect("open the file");
    writer
        .batch_execute("BEGIN IMMEDIATE")
        .expect("take the write lock");
    let lost = other.acquire("m", "b", LEASE).await;
    writer.batch_execute("ROLLBACK").expect("rollback");
    let lost = lost.expect("no write, so no wait for the write lock");
    assert_eq!(lost.owner.owner_id, "a", "{lost:?}");
    // A contender that may write still does (and the write lock is free again).
    let renewed = owner.acquire("m", "a", LEASE).await.expect("renew");
    assert!(
        renewed.owner.is_owned_by_at("a", renewed.now),
        "{renewed:?}"
    );
    assert_eq!(renewed.owner.fence, r.owner.fence);
}
