//! The native locks' own tests (the queue's are in `crate::gate`).

#[cfg(all(test, feature = "sqlite"))]
mod waits {
    use super::super::*;
    use crate::sqlite::DbFile;

    /// A wait whose cancel sender is gone has been given up: it returns at once without
    /// polling the finished receiver again (which panicked in a gate's wait task, and left
    /// that mutex's acquisitions waiting for good; found by `simba-chaos soak` on
    /// PostgreSQL).
    #[tokio::test]
    async fn a_wait_whose_canceller_is_gone_gives_up() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("t.db").display().to_string();
        std::fs::write(&db, b"").expect("db file");
        for kind in [
            Kind::Files {
                db: DbFile::new(&db),
            },
            Kind::Local,
        ] {
            let locks = Locks::new(kind, Duration::from_secs(5));
            let key = locks.kind.key("simba_mutex", "m");
            let (tx, rx) = oneshot::channel::<()>();
            drop(tx);
            let waited = locks.wait(&key, rx, &Notify::new()).await;
            assert!(matches!(waited, Ok(Waited::GaveUp)), "{:?}", waited.is_ok());
        }
    }
}

/// A given-up wait whose first cancel request reached the server before the lock statement
/// (what a give-up that comes while the wait's session connects, or while its statement is
/// on the way, sends) still ends, long before the statement timeout: MariaDB forgets a
/// `KILL QUERY` of an idle connection (by hand: the `GET_LOCK` sent after it waited its
/// whole timeout), and PostgreSQL ignores a cancel request of an idle session.
#[cfg(all(test, any(feature = "mysql", feature = "postgres")))]
mod cancel_tests {
    use super::super::*;
    use tokio::time::Instant;

    /// Far longer than a handoff; the wait must end well within half of it.
    const BOUND: Duration = Duration::from_secs(10);

    async fn a_cancel_before_the_wait_still_ends_it(kind: Kind) {
        let locks = Locks::new(kind.clone(), BOUND);
        let key = kind.key("cancel_tests", "m");
        let mut holder = Session::connect(&kind).await.expect("holder session");
        assert!(
            holder.try_lock(&key).await.expect("try"),
            "the lock is free"
        );
        let mut waiter = Session::connect(&kind).await.expect("waiter session");
        let canceller = waiter.canceller(&kind);
        let started = Instant::now();
        // `end_wait` sends its first request before the statement has been polled at all.
        let lock = waiter.lock(&key);
        tokio::pin!(lock);
        let ended = locks.end_wait(&canceller, lock).await;
        let took = started.elapsed();
        assert!(
            ended.is_err(),
            "{kind:?}: the wait got a lock another session holds"
        );
        assert!(
            took < BOUND / 2,
            "{kind:?}: the cancelled wait ended after {took:?} (the statement timeout is {BOUND:?})"
        );
        holder.unlock(&key).await.expect("unlock");
    }

    #[cfg(feature = "mysql")]
    #[tokio::test]
    async fn mysql_a_cancel_before_the_wait_still_ends_it() {
        let server = simba_test_kit::servers::mysql().await.expect("MariaDB");
        let url = server.url().to_owned();
        a_cancel_before_the_wait_still_ends_it(Kind::Mysql { url }).await;
    }

    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn postgres_a_cancel_before_the_wait_still_ends_it() {
        let server = simba_test_kit::servers::postgres()
            .await
            .expect("PostgreSQL");
        let pg = crate::postgres::Connector::new(server.url()).expect("connector");
        a_cancel_before_the_wait_still_ends_it(Kind::Postgres {
            pg: std::sync::Arc::new(pg),
        })
        .await;
    }
}
