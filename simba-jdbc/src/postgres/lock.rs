//! PostgreSQL's native lock: session advisory locks (`pg_try_advisory_lock` /
//! `pg_advisory_lock` / `pg_advisory_unlock`) on a 64-bit key, for the wait queue
//! (the store's wait queue).

use tokio_postgres::{AsyncMessage, Client, Statement};

use super::Connector;
use crate::lock_error::LockError;

/// A PostgreSQL session for advisory locks, its statements prepared once.
pub(crate) struct Session {
    client: Client,
    try_lock: Statement,
    lock: Statement,
    unlock: Statement,
    driver: tokio::task::JoinHandle<()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

fn failed(e: impl std::error::Error + Send + Sync + 'static) -> LockError {
    LockError::session("postgres", e)
}

impl Session {
    pub(crate) async fn connect(pg: &Connector) -> Result<Session, LockError> {
        let (client, mut connection) = pg.connect().await.map_err(failed)?;
        let driver = tokio::spawn(async move {
            while let Some(msg) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                match msg {
                    Ok(AsyncMessage::Notice(_) | AsyncMessage::Notification(_)) => {}
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        });
        // A wait may last as long as an ownership: no server-side statement bound.
        client
            .batch_execute("SET statement_timeout = 0")
            .await
            .map_err(failed)?;
        let try_lock = client
            .prepare("SELECT pg_try_advisory_lock($1)")
            .await
            .map_err(failed)?;
        let lock = client
            .prepare("SELECT pg_advisory_lock($1)::text")
            .await
            .map_err(failed)?;
        let unlock = client
            .prepare("SELECT pg_advisory_unlock($1)")
            .await
            .map_err(failed)?;
        Ok(Session {
            client,
            try_lock,
            lock,
            unlock,
            driver,
        })
    }

    pub(crate) fn cancel_token(&self) -> tokio_postgres::CancelToken {
        self.client.cancel_token()
    }

    pub(crate) async fn try_lock(&mut self, key: i64) -> Result<bool, LockError> {
        let row = self
            .client
            .query_one(&self.try_lock, &[&key])
            .await
            .map_err(failed)?;
        row.try_get::<_, bool>(0).map_err(failed)
    }

    pub(crate) async fn lock(&mut self, key: i64) -> Result<(), LockError> {
        self.client
            .query_one(&self.lock, &[&key])
            .await
            .map(|_| ())
            .map_err(failed)
    }

    pub(crate) async fn unlock(&mut self, key: i64) -> Result<(), LockError> {
        let row = self
            .client
            .query_one(&self.unlock, &[&key])
            .await
            .map_err(failed)?;
        match row.try_get::<_, bool>(0).map_err(failed)? {
            true => Ok(()),
            false => Err(LockError::Answer {
                call: "pg_advisory_unlock",
                answer: "false".to_owned(),
                meaning: "the advisory lock was not held by its session",
            }),
        }
    }
}
