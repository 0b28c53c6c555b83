//! MySQL / MariaDB's native lock: `GET_LOCK` / `RELEASE_LOCK` on a named user lock, for
//! the store's wait queue.

use mysql_async::Conn;
use mysql_async::prelude::Queryable;

use crate::lock_error::LockError;

/// `GET_LOCK`'s timeout for a blocking wait, in seconds: a year (some servers read a
/// negative timeout as "no wait").
const FOREVER_S: i64 = 365 * 24 * 3600;

/// A MySQL / MariaDB session for user locks.
pub(crate) struct Session(Conn);

/// Ends the statement that connection `id` runs (a blocking `GET_LOCK`), from a
/// connection of its own.
pub(crate) async fn kill_query(url: &str, id: u32) -> Result<(), LockError> {
    let mut killer = Session::connect(url).await?;
    let killed = killer.0.query_drop(format!("KILL QUERY {id}")).await;
    let _ = killer.0.disconnect().await;
    killed.map_err(failed)
}

fn failed(e: mysql_async::Error) -> LockError {
    LockError::session("mysql", e)
}

/// `GET_LOCK`'s answer when the server failed the call.
fn null_answer() -> LockError {
    LockError::Answer {
        call: "GET_LOCK",
        answer: "NULL".to_owned(),
        meaning: "an error on the server",
    }
}

impl Session {
    pub(crate) async fn connect(url: &str) -> Result<Session, LockError> {
        // The URL's TLS options (`super::connect`), as every connection of the store.
        let opts = super::opts(url).map_err(|e| LockError::session("mysql", e))?;
        let conn = Conn::new(opts).await.map_err(failed)?;
        Ok(Session(conn))
    }

    async fn get(&mut self, name: &str, wait_s: i64) -> Result<Option<i64>, LockError> {
        self.0
            .exec_first::<Option<i64>, _, _>("SELECT GET_LOCK(?, ?)", (name, wait_s))
            .await
            .map(Option::flatten)
            .map_err(failed)
    }

    /// The server's id of this session's connection.
    pub(crate) fn id(&self) -> u32 {
        self.0.id()
    }

    pub(crate) async fn try_lock(&mut self, name: &str) -> Result<bool, LockError> {
        match self.get(name, 0).await? {
            Some(1) => Ok(true),
            Some(_) => Ok(false),
            None => Err(null_answer()),
        }
    }

    pub(crate) async fn lock(&mut self, name: &str) -> Result<(), LockError> {
        loop {
            match self.get(name, FOREVER_S).await? {
                Some(1) => return Ok(()),
                Some(_) => {}
                None => return Err(null_answer()),
            }
        }
    }

    pub(crate) async fn unlock(&mut self, name: &str) -> Result<(), LockError> {
        match self
            .0
            .exec_first::<Option<i64>, _, _>("SELECT RELEASE_LOCK(?)", (name,))
            .await
            .map(Option::flatten)
            .map_err(failed)?
        {
            Some(1) => Ok(()),
            other => Err(LockError::Answer {
                call: "RELEASE_LOCK",
                answer: format!("{other:?}"),
                meaning: "the lock was not this session's",
            }),
        }
    }
}
