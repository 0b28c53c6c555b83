//! The dialect of a store: which database module (`crate::mysql`, `crate::postgres`,
//! `crate::sqlite`) holds its pool and what else it needs, chosen once from the URL.
//!
//! An enum, not a trait object: each dialect's pool is a `deadpool` pool of its own
//! diesel-async connection type, and the store's statement functions are generic over
//! that type ([`SqlConn`](crate::conn::SqlConn) has `async` methods, so it cannot be a
//! `dyn` trait), so a call is monomorphised per dialect by [`on_pool!`] and
//! [`with_fast!`]. This module and `crate::native` (the native locks) are the only places
//! that name the dialects' cargo features.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use simba_core::events::EventSender;
use simba_core::tls::TlsFailure;
use simba_core::{Error, Result};

use crate::config::{SqlConfig, Target};
use crate::native::Kind as GateKind;

/// The per-dialect part of a store.
pub(crate) enum Dialect {
    #[cfg(feature = "mysql")]
    Mysql(crate::mysql::Store),
    #[cfg(feature = "postgres")]
    Postgres(crate::postgres::Store),
    #[cfg(feature = "sqlite")]
    Sqlite(crate::sqlite::Store),
    /// No backend feature is enabled: no store can be built.
    #[cfg(not(any(feature = "mysql", feature = "postgres", feature = "sqlite")))]
    #[allow(dead_code)]
    Never(std::convert::Infallible),
}

impl Dialect {
    /// The dialect's part of a store on `target` (no I/O); `channel` is PostgreSQL's
    /// NOTIFY channel.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `target`'s backend is not enabled in this build or its
    /// TLS options are wrong; [`Error::Backend`] when the pool cannot be built.
    pub(crate) fn new(target: &Target, config: &SqlConfig, channel: &str) -> Result<Dialect> {
        match target {
            #[cfg(feature = "mysql")]
            Target::Mysql(url) => crate::mysql::Store::new(url, config).map(Dialect::Mysql),
            #[cfg(feature = "postgres")]
            Target::Postgres(url) => {
                crate::postgres::Store::new(url, config, channel).map(Dialect::Postgres)
            }
            #[cfg(feature = "sqlite")]
            Target::Sqlite { path, memory } => {
                crate::sqlite::Store::new(path, *memory, config).map(Dialect::Sqlite)
            }
            #[allow(unreachable_patterns)]
            other => {
                let _ = (config, channel);
                Err(Error::config(
                    "url",
                    format!(
                        "the {} backend is not enabled in this build of simba-jdbc",
                        other.backend()
                    ),
                ))
            }
        }
    }

    /// Where the native locks of the store live.
    pub(crate) fn gate_kind(&self) -> GateKind {
        match self {
            #[cfg(feature = "mysql")]
            Dialect::Mysql(d) => GateKind::Mysql { url: d.url.clone() },
            #[cfg(feature = "postgres")]
            Dialect::Postgres(d) => match &d.native {
                Some(pg) => GateKind::Postgres { pg: pg.clone() },
                // Behind a transaction pooler without a direct URL: no session holds a
                // lock, so waiters queue in this process only (and read the row for
                // another process's release, `Dialect::polls_owner`).
                None => GateKind::Local,
            },
            #[cfg(feature = "sqlite")]
            Dialect::Sqlite(d) if !d.memory => GateKind::Files {
                db: crate::sqlite::DbFile::new(&d.path),
            },
            #[allow(unreachable_patterns)]
            _ => GateKind::Local,
        }
    }

    /// The TLS failure behind a connection error whose text is `msg`, if it was one, and
    /// the message to report with it.
    pub(crate) fn tls_failure(&self, msg: &str) -> Option<(String, TlsFailure)> {
        match self {
            #[cfg(feature = "mysql")]
            Dialect::Mysql(d) => d.tls_failure(msg),
            #[cfg(feature = "postgres")]
            Dialect::Postgres(d) => d.tls_failure(msg),
            #[allow(unreachable_patterns)]
            _ => {
                let _ = msg;
                None
            }
        }
    }

    /// Whether a subscriber that does not contend hears of changes (PostgreSQL's
    /// LISTEN/NOTIFY).
    pub(crate) fn observers_hear(&self) -> bool {
        match self {
            #[cfg(feature = "postgres")]
            Dialect::Postgres(d) => d.listener.is_some(),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// How often a waiter reads a row another process owns, when nothing tells it of
    /// that owner's release (PostgreSQL behind a transaction pooler without a direct URL:
    /// no native lock, no LISTEN): from the first interval, doubling, to the second.
    pub(crate) fn polls_owner(&self) -> Option<(std::time::Duration, std::time::Duration)> {
        match self {
            #[cfg(feature = "postgres")]
            Dialect::Postgres(d) if d.native.is_none() => {
                use crate::postgres::pooler::{POLL_MAX, POLL_MIN};
                Some((POLL_MIN, POLL_MAX))
            }
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// Registers `contender` for the pushed events about `mutex` (PostgreSQL's NOTIFY hub;
    /// nothing elsewhere).
    pub(crate) fn listen(
        &self,
        mutex: &str,
        contender: &str,
        tx: &EventSender,
        contending: &Arc<AtomicBool>,
    ) {
        match self {
            #[cfg(feature = "postgres")]
            Dialect::Postgres(d) => {
                if let Some(l) = &d.listener {
                    l.subscribe(mutex, contender, tx.clone(), contending.clone());
                }
            }
            #[allow(unreachable_patterns)]
            _ => {
                let _ = (mutex, contender, tx, contending);
            }
        }
    }

    /// Tells observers of a change that has committed: PostgreSQL queues the NOTIFY
    /// `payload()` makes ([`crate::postgres::Notifier`]); elsewhere nothing is sent (and
    /// no payload is made).
    pub(crate) fn notify(&self, payload: impl FnOnce() -> String) {
        match self {
            #[cfg(feature = "postgres")]
            Dialect::Postgres(d) => d.notifier.send(payload()),
            #[allow(unreachable_patterns)]
            _ => {
                let _ = payload;
            }
        }
    }

    /// Tells `poke` the mutex of every release another process makes that the store hears
    /// (PostgreSQL's LISTEN; nothing elsewhere).
    pub(crate) fn on_release(&self, poke: Box<dyn Fn(&str) + Send + Sync>) {
        match self {
            #[cfg(feature = "postgres")]
            Dialect::Postgres(d) => {
                if let Some(l) = &d.listener {
                    l.on_release(poke);
                }
            }
            #[allow(unreachable_patterns)]
            _ => drop(poke),
        }
    }

    /// Whether the store tells other stores (other processes) that it freed permits their
    /// waiters are owed, and hears them ([`Dialect::permits_freed`],
    /// [`Dialect::hear_permits`]): PostgreSQL with LISTEN, SQLite's file databases on Linux.
    pub(crate) fn pushes_permits(&self) -> bool {
        match self {
            #[cfg(feature = "postgres")]
            Dialect::Postgres(d) => d.listener.is_some(),
            #[cfg(all(feature = "sqlite", any(target_os = "linux", target_os = "android")))]
            Dialect::Sqlite(d) => d.bells.is_some(),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Sets what the store does with the news of permits freed by another store (wakes
    /// its waiters: see [`crate::push`]). Without push, nothing is heard.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) fn on_permit(&self, f: crate::push::OnPermit) {
        match self {
            #[cfg(feature = "postgres")]
            Dialect::Postgres(d) => {
                if let Some(l) = &d.listener {
                    l.on_permit(f);
                }
            }
            #[cfg(all(feature = "sqlite", any(target_os = "linux", target_os = "android")))]
            Dialect::Sqlite(d) => {
                if let Some(b) = &d.bells {
                    b.on_permit(f);
                }
            }
            #[allow(unreachable_patterns)]
            _ => drop(f),
        }
    }

    /// Makes sure the store hears of permits freed by other stores, for a
    /// waiter about to wait (PostgreSQL: the LISTEN connection runs; SQLite: the
    /// database's bell file is watched).
    pub(crate) fn hear_permits(&self) {
        match self {
            #[cfg(feature = "postgres")]
            Dialect::Postgres(d) => {
                if let Some(l) = &d.listener {
                    l.start();
                }
            }
            #[cfg(all(feature = "sqlite", any(target_os = "linux", target_os = "android")))]
            Dialect::Sqlite(d) => {
                if let Some(b) = &d.bells {
                    b.watch();
                }
            }
            #[allow(unreachable_patterns)]
            _ => {}
        }
    }

    /// Tells other stores that permits of `semaphore` were freed and are owed to `owed`
    /// (PostgreSQL: a NOTIFY naming them, sent after the commit; SQLite: the semaphore's
    /// slot of the bell file). Nothing when `owed` is empty or the store does not push.
    pub(crate) fn permits_freed(&self, semaphore: &str, owed: &[&str]) {
        if owed.is_empty() {
            return;
        }
        match self {
            #[cfg(feature = "postgres")]
            Dialect::Postgres(d) => {
                if let Some(payload) =
                    crate::postgres::permit_payload(semaphore, owed.iter().copied())
                {
                    d.notifier.send(payload);
                }
            }
            #[cfg(all(feature = "sqlite", any(target_os = "linux", target_os = "android")))]
            Dialect::Sqlite(d) => {
                if let Some(b) = &d.bells {
                    b.ring(semaphore);
                }
            }
            #[allow(unreachable_patterns)]
            _ => {
                let _ = semaphore;
            }
        }
    }

    /// Opens one connection of the same kind as the pool's (same driver, same URL, same
    /// SQLite file; PostgreSQL's through the store's connector, with its TLS), outside the
    /// pool: for floor measurements (`crate::floor`). With `native`, where the native locks
    /// are (PostgreSQL behind a transaction pooler: the direct URL's server; an error
    /// without one).
    #[cfg(feature = "bench")]
    pub(crate) async fn probe(&self, native: bool) -> diesel::ConnectionResult<ProbeConn> {
        match self {
            #[cfg(feature = "mysql")]
            Dialect::Mysql(d) => {
                let _ = native;
                crate::mysql::diesel(&d.url).await.map(ProbeConn::Mysql)
            }
            #[cfg(feature = "postgres")]
            Dialect::Postgres(d) => {
                let pg = match (native, &d.native) {
                    (false, _) => &d.pg,
                    (true, Some(n)) => n,
                    (true, None) => {
                        return Err(diesel::ConnectionError::BadConnection(
                            "no native lock is used behind a transaction pooler without \
                             simba_direct_url"
                                .to_owned(),
                        ));
                    }
                };
                pg.diesel().await.map(|c| ProbeConn::Postgres(Box::new(c)))
            }
            #[cfg(feature = "sqlite")]
            Dialect::Sqlite(d) => {
                let _ = native;
                <crate::sqlite::SqliteConn as diesel_async::AsyncConnection>::establish(&d.path)
                    .await
                    .map(ProbeConn::Sqlite)
            }
            #[cfg(not(any(feature = "mysql", feature = "postgres", feature = "sqlite")))]
            Dialect::Never(never) => match *never {},
        }
    }
}

/// A connection of a store's dialect outside its pool ([`Dialect::probe`]).
#[cfg(feature = "bench")]
pub(crate) enum ProbeConn {
    #[cfg(feature = "mysql")]
    Mysql(diesel_async::AsyncMysqlConnection),
    #[cfg(feature = "postgres")]
    Postgres(Box<diesel_async::AsyncPgConnection>),
    #[cfg(feature = "sqlite")]
    Sqlite(crate::sqlite::SqliteConn),
    /// No backend feature is enabled: no probe can be opened.
    #[cfg(not(any(feature = "mysql", feature = "postgres", feature = "sqlite")))]
    #[allow(dead_code)]
    Never(std::convert::Infallible),
}

#[cfg(feature = "bench")]
impl ProbeConn {
    /// Runs `SELECT 1`: one round trip (SQLite: one hop to the connection's thread and back).
    pub(crate) async fn select_one(&mut self) -> diesel::QueryResult<()> {
        use diesel_async::SimpleAsyncConnection;
        match self {
            #[cfg(feature = "mysql")]
            ProbeConn::Mysql(c) => c.batch_execute("SELECT 1").await,
            #[cfg(feature = "postgres")]
            ProbeConn::Postgres(c) => c.batch_execute("SELECT 1").await,
            #[cfg(feature = "sqlite")]
            ProbeConn::Sqlite(c) => c.batch_execute("SELECT 1").await,
            #[cfg(not(any(feature = "mysql", feature = "postgres", feature = "sqlite")))]
            ProbeConn::Never(never) => match *never {},
        }
    }
}

/// The NOTIFY payloads of an acquisition and a release (PostgreSQL; elsewhere no
/// statement sends one, and they are empty).
#[cfg(feature = "postgres")]
pub(crate) use crate::postgres::{
    acquired_payload as notify_acquired, released_payload as notify_released,
};

/// The NOTIFY payload of an acquisition: none without PostgreSQL.
#[cfg(not(feature = "postgres"))]
pub(crate) fn notify_acquired(_mutex: &str, _me: &str) -> String {
    String::new()
}

/// The NOTIFY payload of a release: none without PostgreSQL.
#[cfg(not(feature = "postgres"))]
pub(crate) fn notify_released(_mutex: &str, _me: &str) -> String {
    String::new()
}

/// Evaluates `$body` with `$pool` bound to the store's pool (`&deadpool::Pool<C>` of the
/// dialect's connection type `C`): `$body` is compiled once per dialect.
/// With `renew` first, the connections of renewal batches ([`split_pool`](crate::pool::split_pool); the pool itself
/// when it is not split).
macro_rules! on_pool {
    (@pick $dialect:expr, |$d:ident| $which:expr, |$pool:ident| $body:expr) => {{
        match $dialect {
            #[cfg(feature = "mysql")]
            $crate::dialect::Dialect::Mysql($d) => {
                let $pool = $which;
                $body
            }
            #[cfg(feature = "postgres")]
            $crate::dialect::Dialect::Postgres($d) => {
                let $pool = $which;
                $body
            }
            #[cfg(feature = "sqlite")]
            $crate::dialect::Dialect::Sqlite($d) => {
                let $pool = $which;
                $body
            }
            #[cfg(not(any(feature = "mysql", feature = "postgres", feature = "sqlite")))]
            $crate::dialect::Dialect::Never(never) => match *never {},
        }
    }};
    (renew $dialect:expr, |$pool:ident| $body:expr) => {{
        $crate::dialect::on_pool!(@pick $dialect, |d| d.renew.as_ref().unwrap_or(&d.pool), |$pool| $body)
    }};
    ($dialect:expr, |$pool:ident| $body:expr) => {{
        $crate::dialect::on_pool!(@pick $dialect, |d| &d.pool, |$pool| $body)
    }};
}
pub(crate) use on_pool;

/// `Some($body)` with `$fast` bound to PostgreSQL's fast path
/// ([`crate::postgres::Fast`]) when the store has one, else `None`.
macro_rules! with_fast {
    ($dialect:expr, |$fast:ident| $body:expr) => {{
        match $dialect {
            #[cfg(feature = "postgres")]
            $crate::dialect::Dialect::Postgres(d) => {
                let $fast = &d.fast;
                Some($body)
            }
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }};
}
pub(crate) use with_fast;

/// `Some($body)` with `$fast` bound to PostgreSQL's fast path when the store is behind a
/// transaction pooler (every call runs there, none on the pool), else `None`.
macro_rules! with_pooled {
    ($dialect:expr, |$fast:ident| $body:expr) => {{
        match $dialect {
            #[cfg(feature = "postgres")]
            $crate::dialect::Dialect::Postgres(d) if d.pooled => {
                let $fast = &d.fast;
                Some($body)
            }
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }};
}
pub(crate) use with_pooled;
