//! The semaphore and read-write lock cases of the kit on every SQL database: MariaDB/MySQL,
//! PostgreSQL and SQLite, each on a table of its own (`{table}_permits` beside it).
#![allow(missing_docs)]
#![cfg(any(feature = "mysql", feature = "postgres", feature = "sqlite"))]

mod common;

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::common;

    simba_test_kit::semaphore_tests!(common::SqlHarness::sqlite());
    simba_test_kit::rw_lock_tests!(common::SqlHarness::sqlite());
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::common;

    simba_test_kit::semaphore_tests!(common::SqlHarness::mysql().await);
    simba_test_kit::rw_lock_tests!(common::SqlHarness::mysql().await);
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::common;

    simba_test_kit::semaphore_tests!(common::SqlHarness::postgres().await);
    simba_test_kit::rw_lock_tests!(common::SqlHarness::postgres().await);
}

/// The store-level behaviour of the SQL semaphores beyond the kit's cases: FIFO, one
/// in-process wake-up per freed permit, the wake-up of another store's waiter, and the
/// refusal without the table.
mod store_level {
    use std::time::Duration;

    use simba_core::backend::{Lease, PermitStore, StoreEvent};
    use simba_jdbc::SqlStore;
    use simba_test_kit::support::unique_name;
    use tokio::time::timeout;

    /// Long enough that no lease ends during a case on a loaded machine.
    const LONG: Lease = Lease {
        ttl: Duration::from_secs(20),
        transition: Duration::from_secs(5),
    };

    async fn holds(store: &SqlStore, sem: &str, who: &str, n: u32) -> bool {
        let reply = store
            .permit_acquire(sem, who, n, LONG)
            .await
            .unwrap_or_else(|e| panic!("acquire by {who}: {e}"));
        reply.owner.is_owned_by_at(who, reply.now)
    }

    /// Two waiters queue in order on a full 1-permit semaphore; a release wakes the first
    /// (in-process push) and the next, and only the first may take the permit: the second,
    /// asking first, is told to wait although the permit is free.
    pub(super) async fn fifo_and_one_wakeup_per_permit(store: SqlStore) {
        let sem = unique_name("sem_fifo");
        assert!(
            holds(&store, &sem, "h", 1).await,
            "the first contender holds"
        );
        let mut rx1 = store
            .permit_subscribe(&sem, "w1")
            .await
            .expect("subscribe w1")
            .expect("SQL stores push to their own waiters");
        let mut rx2 = store
            .permit_subscribe(&sem, "w2")
            .await
            .expect("subscribe w2")
            .expect("SQL stores push to their own waiters");
        assert!(!holds(&store, &sem, "w1", 1).await, "w1 queues");
        assert!(!holds(&store, &sem, "w2", 1).await, "w2 queues");
        assert!(store.permit_release(&sem, "h").await.expect("release"));
        // Bound: a push is sent when the release returns; 10 s is only a guard.
        let event = timeout(Duration::from_secs(10), rx1.recv())
            .await
            .expect("w1 was not woken");
        assert_eq!(event, Some(StoreEvent::Released));
        // w2 is woken too, as the next in line: it looks again when w1's claim ends (so a
        // stopped w1 would not hold the permit up); asking now, it waits.
        let event = timeout(Duration::from_secs(10), rx2.recv())
            .await
            .expect("w2 was not woken as the next in line");
        assert_eq!(event, Some(StoreEvent::Released));
        assert!(!holds(&store, &sem, "w2", 1).await, "w2 jumped the queue");
        assert!(holds(&store, &sem, "w1", 1).await, "w1 was owed the permit");
        let holders = store.permit_owners(&sem).await.expect("owners");
        assert_eq!(holders.permits, Some(1));
        assert_eq!(holders.holders.len(), 1);
        assert_eq!(holders.holders[0].owner_id, "w1");
        // w1 releases: now w2 is woken and takes it.
        assert!(store.permit_release(&sem, "w1").await.expect("release"));
        let event = timeout(Duration::from_secs(10), rx2.recv())
            .await
            .expect("w2 was not woken");
        assert_eq!(event, Some(StoreEvent::Released));
        assert!(holds(&store, &sem, "w2", 1).await, "w2's turn");
        assert!(store.permit_release(&sem, "w2").await.expect("release"));
        assert!(
            !store.permit_release(&sem, "w2").await.expect("release"),
            "a second release found a permit"
        );
    }

    /// Two stores, as two processes would be: a waiter of `b` is woken by a release in `a`,
    /// through the database (PostgreSQL: a NOTIFY naming the waiters owed; SQLite on Linux:
    /// the bell file). Without that push no event reaches the waiter's channel at all (it
    /// would find the permit only at its own next look, which this does not make), so the
    /// case fails. `listening` is a mutex subscription of `b` that gets
    /// [`StoreEvent::Resync`] once `b`'s LISTEN connection is up (PostgreSQL), so the
    /// release cannot come before `b` listens.
    pub(super) async fn a_release_in_another_store_wakes_its_waiter(
        a: SqlStore,
        b: SqlStore,
        listening: bool,
    ) {
        use simba_core::backend::LeaseStore;

        let sem = unique_name("sem_push");
        // Subscribed before anything else of `b` starts its LISTEN connection: the Resync
        // goes to the subscribers present when the connection comes up.
        let probe = if listening {
            Some(
                LeaseStore::subscribe(&b, &unique_name("probe"), "probe")
                    .await
                    .expect("subscribe a probe")
                    .expect("PostgreSQL observers hear"),
            )
        } else {
            None
        };
        assert!(holds(&a, &sem, "h", 1).await, "the first contender holds");
        let mut rx = b
            .permit_subscribe(&sem, "w")
            .await
            .expect("subscribe w")
            .expect("SQL stores push to their waiters");
        assert!(!holds(&b, &sem, "w", 1).await, "w queues");
        if let Some(mut probe) = probe {
            // Bound: one connection and a LISTEN; 10 s is only a guard.
            let event = timeout(Duration::from_secs(10), probe.recv())
                .await
                .expect("the LISTEN connection did not come up");
            assert_eq!(event, Some(StoreEvent::Resync));
        }
        assert!(a.permit_release(&sem, "h").await.expect("release"));
        // Bound: the push leaves once the release commits; 10 s is only a guard.
        let event = timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("the waiter of the other store was not woken");
        assert_eq!(event, Some(StoreEvent::Released));
        assert!(holds(&b, &sem, "w", 1).await, "w was owed the permit");
        assert!(b.permit_release(&sem, "w").await.expect("release"));
    }

    /// A renewal keeps the fence and never takes a permit; a waiter that leaves gives its
    /// place up.
    pub(super) async fn renewal_keeps_the_fence_and_leave_gives_up(store: SqlStore) {
        let sem = unique_name("sem_renew");
        let first = store.permit_acquire(&sem, "a", 1, LONG).await.expect("a");
        let again = store.permit_guard(&sem, "a", 1, LONG).await.expect("renew");
        assert_eq!(again.owner.fence, first.owner.fence);
        assert_eq!(again.owner.acquired_at, first.owner.acquired_at);
        let guard = store
            .permit_guard(&sem, "b", 1, LONG)
            .await
            .expect("guard b");
        assert!(
            !guard.owner.is_owned_by_at("b", guard.now),
            "a renewal took a permit"
        );
        assert!(!holds(&store, &sem, "b", 1).await, "b queues");
        assert!(!holds(&store, &sem, "c", 1).await, "c queues behind b");
        store.permit_leave(&sem, "b").await.expect("leave");
        assert!(store.permit_release(&sem, "a").await.expect("release"));
        let taken = store.permit_acquire(&sem, "c", 1, LONG).await.expect("c");
        assert!(
            taken.owner.is_owned_by_at("c", taken.now),
            "the place b left still blocks c"
        );
        assert!(taken.owner.fence > first.owner.fence);
        assert!(store.permit_release(&sem, "c").await.expect("release"));
    }

    #[cfg(feature = "sqlite")]
    mod sqlite {
        use super::super::common::SqlHarness;

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn fifo_and_one_wakeup_per_permit() {
            let h = SqlHarness::sqlite();
            super::fifo_and_one_wakeup_per_permit(h.store().await.expect("store")).await;
        }

        #[cfg(target_os = "linux")]
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_release_in_another_store_wakes_its_waiter() {
            let h = SqlHarness::sqlite();
            let (a, b) = (h.store().await.expect("a"), h.store().await.expect("b"));
            super::a_release_in_another_store_wakes_its_waiter(a, b, false).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn renewal_keeps_the_fence_and_leave_gives_up() {
            let h = SqlHarness::sqlite();
            super::renewal_keeps_the_fence_and_leave_gives_up(h.store().await.expect("store"))
                .await;
        }

        /// With DDL off and no permits table, a permit operation fails for good with the
        /// statement that makes the table (the mutexes keep working).
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn without_the_table_the_error_holds_its_create_statement() {
            use diesel::Connection;
            use diesel::connection::SimpleConnection;
            use simba_core::backend::{LeaseStore, PermitStore};

            let h = SqlHarness::sqlite();
            let path = h.url().trim_start_matches("sqlite://").to_owned();
            let mut c = diesel::SqliteConnection::establish(&path).expect("open the file");
            let create = simba_jdbc::create_table_sql(simba_jdbc::Backend::Sqlite, h.table())
                .expect("valid table");
            c.batch_execute(&create)
                .expect("create the mutex table only");
            drop(c);
            let store = simba_jdbc::SqlStore::connect(h.config(h.url()).with_ddl(false))
                .await
                .expect("connect");
            store
                .migrate()
                .await
                .expect("a mutex table is all migrate needs");
            let err = store
                .permit_acquire("s", "c", 2, super::LONG)
                .await
                .expect_err("no permits table");
            let text = err.to_string();
            let want = simba_jdbc::create_permits_table_sql(simba_jdbc::Backend::Sqlite, h.table())
                .expect("valid table");
            assert!(text.contains(&want), "{text}");
            assert!(!err.is_retryable(), "a missing table is permanent: {err:?}");
            let mutex = store
                .acquire("m", "c", super::LONG)
                .await
                .expect("the mutexes work");
            assert!(mutex.owner.is_owned_by_at("c", mutex.now));
        }
    }

    #[cfg(feature = "mysql")]
    mod mysql {
        use super::super::common::SqlHarness;

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn fifo_and_one_wakeup_per_permit() {
            let h = SqlHarness::mysql().await;
            super::fifo_and_one_wakeup_per_permit(h.store().await.expect("store")).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn renewal_keeps_the_fence_and_leave_gives_up() {
            let h = SqlHarness::mysql().await;
            super::renewal_keeps_the_fence_and_leave_gives_up(h.store().await.expect("store"))
                .await;
        }
    }

    #[cfg(feature = "postgres")]
    mod postgres {
        use super::super::common::SqlHarness;

        /// A process stopped in the middle of an acquisition's transaction (here a session
        /// that ran simba's start of one, locked the semaphore's row as an acquisition does,
        /// and then sends nothing) holds the other acquisitions up only until the server
        /// ends that session (50 ms), not until it runs again. Without that, the next
        /// acquisition waits on the row lock until the tests' statement timeout (1.5 s)
        /// fails it.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_session_stopped_in_an_acquisition_does_not_hold_the_semaphore() {
            use simba_core::backend::PermitStore;

            let h = SqlHarness::postgres().await;
            let store = h.store().await.expect("store");
            let sem = simba_test_kit::support::unique_name("sem_stopped");
            // The semaphore's row is made by its first acquisition.
            assert!(super::holds(&store, &sem, "h", 1).await, "h holds");
            assert!(store.permit_release(&sem, "h").await.expect("release"));
            let (client, connection) = tokio_postgres::connect(h.url(), tokio_postgres::NoTls)
                .await
                .expect("connect");
            let connection = tokio::spawn(connection);
            client
                .batch_execute(simba_jdbc::permit_transaction_begin(
                    simba_jdbc::Backend::Postgres,
                ))
                .await
                .expect("begin");
            let lock = format!(
                "SELECT 1 FROM {}_permits WHERE semaphore = $1 AND contender = '' FOR UPDATE",
                h.table()
            );
            assert_eq!(
                client.execute(&lock, &[&sem]).await.expect("lock the row"),
                1
            );
            // The stalled session now sends nothing. Bound: 10 s is only a guard.
            let reply = super::timeout(
                super::Duration::from_secs(10),
                store.permit_acquire(&sem, "next", 1, super::LONG),
            )
            .await
            .expect("the acquisition never finished")
            .expect("the acquisition waited on the stalled session's lock until it failed");
            assert!(reply.owner.is_owned_by_at("next", reply.now), "{reply:?}");
            // The server ended the stalled session.
            assert!(client.execute("SELECT 1", &[]).await.is_err());
            drop(connection);
            assert!(store.permit_release(&sem, "next").await.expect("release"));
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn fifo_and_one_wakeup_per_permit() {
            let h = SqlHarness::postgres().await;
            super::fifo_and_one_wakeup_per_permit(h.store().await.expect("store")).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_release_in_another_store_wakes_its_waiter() {
            let h = SqlHarness::postgres().await;
            let (a, b) = (h.store().await.expect("a"), h.store().await.expect("b"));
            super::a_release_in_another_store_wakes_its_waiter(a, b, true).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn renewal_keeps_the_fence_and_leave_gives_up() {
            let h = SqlHarness::postgres().await;
            super::renewal_keeps_the_fence_and_leave_gives_up(h.store().await.expect("store"))
                .await;
        }
    }
}
