//! MySQL / MariaDB's native lock: `GET_LOCK` / `RELEASE_LOCK` on a named user lock, for
//! the wait queue (`crate::gate`).

use mysql_async::Conn;
use mysql_async::prelude::Queryable;

/// `GET_LOCK`'s timeout for a blocking wait, in seconds: a year (some servers read a
/// negative timeout as "no wait").
const FOREVER_S: i64 = 365 * 24 * 3600;

/// A MySQL / MariaDB session for user locks.
pub(crate) struct Session(Conn);

/// Ends the statement that connection `id` runs (a blocking `GET_LOCK`), from a
/// connection of its own.
pub(crate) async fn kill_query(url: &str, id: u32) -> Result<(), String> {
    let mut killer = Session::connect(url).await?;
    let killed = killer.0.query_drop(format!("KILL QUERY {id}")).await;
    let _ = killer.0.disconnect().await;
    killed.map_err(text)
}

fn text(e: mysql_async::Error) -> String {
    format!("mysql lock session: {e}")
}

impl Session {
    pub(crate) async fn connect(url: &str) -> Result<Session, String> {
        // The URL's TLS options (`super::connect`), as every connection of the store.
        let opts = super::opts(url).map_err(|e| format!("mysql lock session: {e}"))?;
        let conn = Conn::new(opts).await.map_err(text)?;
        Ok(Session(conn))
    }

    async fn get(&mut self, name: &str, wait_s: i64) -> Result<Option<i64>, String> {
        self.0
            .exec_first::<Option<i64>, _, _>("SELECT GET_LOCK(?, ?)", (name, wait_s))
            .await
            .map(Option::flatten)
            .map_err(text)
    }

    /// The server's id of this session's connection.
    pub(crate) fn id(&self) -> u32 {
        self.0.id()
    }

    pub(crate) async fn try_lock(&mut self, name: &str) -> Result<bool, String> {
        match self.get(name, 0).await? {
            Some(1) => Ok(true),
            Some(_) => Ok(false),
            None => Err("GET_LOCK returned NULL (an error on the server)".to_owned()),
        }
    }

    pub(crate) async fn lock(&mut self, name: &str) -> Result<(), String> {
        loop {
            match self.get(name, FOREVER_S).await? {
                Some(1) => return Ok(()),
                Some(_) => {}
                None => {
                    return Err("GET_LOCK returned NULL (an error on the server)".to_owned());
                }
            }
        }
    }

    pub(crate) async fn unlock(&mut self, name: &str) -> Result<(), String> {
        match self
            .0
            .exec_first::<Option<i64>, _, _>("SELECT RELEASE_LOCK(?)", (name,))
            .await
            .map(Option::flatten)
            .map_err(text)?
        {
            Some(1) => Ok(()),
            other => Err(format!(
                "RELEASE_LOCK returned {other:?}: the lock was not this session's"
            )),
        }
    }
}
