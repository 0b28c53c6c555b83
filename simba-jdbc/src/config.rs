//! [`SqlConfig`]: where the database is and how the store talks to it.

use std::fmt;
use std::time::Duration;

use simba_core::{Error, MAX_MUTEX_NAME_LEN, Result, validate_duration};

pub use crate::url_query::redact_url;

/// The table name used when none is configured (as in Simba).
pub const DEFAULT_TABLE: &str = "simba_mutex";
/// The default number of pooled connections per store.
pub const DEFAULT_POOL_SIZE: usize = 8;
/// The default bound on one store call (pool checkout plus its statements).
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);
/// The width of the `mutex` column created by [`SqlStore::migrate`](crate::SqlStore::migrate),
/// in characters; the default for [`SqlConfig::with_max_name_len`].
pub const MUTEX_COLUMN_LEN: usize = 200;
/// The width of the `owner_id` column created by the migration, in characters.
pub const OWNER_COLUMN_LEN: usize = 200;
/// How often a waiting process reads a row that a contender outside simba's native queue
/// owns (see [`SqlConfig::with_foreign_poll`]): 5 ms. The JVM Simba library's contenders
/// look again on their own schedule (at most every 50 ms in the mixed-fleet tests); simba's
/// waiters read more often so that a mixed fleet gives them their share.
pub const DEFAULT_FOREIGN_POLL: Duration = Duration::from_millis(5);
/// The longest table name accepted, in bytes (PostgreSQL channel names derived from it must
/// stay under 64 bytes).
pub const MAX_TABLE_NAME_LEN: usize = 48;
/// The largest pool accepted.
pub const MAX_POOL_SIZE: usize = 1024;

/// The URL schemes this crate understands, for error messages.
const SCHEMES: &str =
    "mysql://, mariadb://, postgres://, postgresql://, sqlite://PATH, sqlite::memory:";

/// A SQL database backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// MySQL or MariaDB (`mysql://`, `mariadb://`).
    Mysql,
    /// PostgreSQL (`postgres://`, `postgresql://`).
    Postgres,
    /// SQLite (`sqlite://PATH`, `sqlite::memory:`).
    Sqlite,
}

impl Backend {
    /// The name used in errors and traces: `"mysql"`, `"postgres"` or `"sqlite"`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Mysql => "mysql",
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
        }
    }

    /// Whether the cargo feature for this backend is enabled in this build.
    pub fn is_enabled(self) -> bool {
        match self {
            Backend::Mysql => cfg!(feature = "mysql"),
            Backend::Postgres => cfg!(feature = "postgres"),
            Backend::Sqlite => cfg!(feature = "sqlite"),
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The backend features enabled in this build, e.g. `"sqlite, mysql, postgres"`.
fn enabled_features() -> String {
    let list: Vec<&str> = [Backend::Sqlite, Backend::Mysql, Backend::Postgres]
        .into_iter()
        .filter(|b| b.is_enabled())
        .map(Backend::name)
        .collect();
    if list.is_empty() {
        "none".to_owned()
    } else {
        list.join(", ")
    }
}

/// Where to connect, parsed from the URL.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// A `mysql://` URL for mysql_async (`mariadb://` rewritten).
    Mysql(String),
    /// A `postgres://` / `postgresql://` URL for tokio-postgres.
    Postgres(String),
    /// A SQLite file name, or `:memory:`.
    Sqlite {
        /// What SQLite opens.
        path: String,
        /// An in-memory database (one connection, lives as long as the store).
        memory: bool,
    },
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Mysql(url) => f.debug_tuple("Mysql").field(&redact_url(url)).finish(),
            Target::Postgres(url) => f.debug_tuple("Postgres").field(&redact_url(url)).finish(),
            Target::Sqlite { path, memory } => f
                .debug_struct("Sqlite")
                .field("path", path)
                .field("memory", memory)
                .finish(),
        }
    }
}

impl Target {
    pub(crate) fn backend(&self) -> Backend {
        match self {
            Target::Mysql(_) => Backend::Mysql,
            Target::Postgres(_) => Backend::Postgres,
            Target::Sqlite { .. } => Backend::Sqlite,
        }
    }
}

/// Parses a database URL into a [`Target`].
pub(crate) fn parse_url(url: &str) -> Result<Target> {
    let bad = |reason: String| Err(Error::config("url", reason));
    let url = url.trim();
    if url.is_empty() {
        return bad(format!("the database URL is empty; use one of {SCHEMES}"));
    }
    if url.chars().any(char::is_control) {
        return bad("the database URL contains a control character".to_owned());
    }
    let Some((scheme, rest)) = url.split_once(':') else {
        return bad(format!(
            "`{}` has no scheme; use one of {SCHEMES}",
            redact_url(url)
        ));
    };
    let scheme_lc = scheme.to_ascii_lowercase();
    let backend = match scheme_lc.as_str() {
        "mysql" | "mariadb" => Backend::Mysql,
        "postgres" | "postgresql" => Backend::Postgres,
        "sqlite" => Backend::Sqlite,
        _ => {
            return bad(format!(
                "unsupported scheme `{scheme}`: simba-jdbc understands {SCHEMES} \
                 (backend features enabled in this build: {})",
                enabled_features()
            ));
        }
    };
    if !backend.is_enabled() {
        return bad(format!(
            "`{scheme}://` needs the cargo feature `{}` of simba-jdbc, which is not enabled \
             (enabled: {})",
            backend.name(),
            enabled_features()
        ));
    }
    match backend {
        Backend::Sqlite => {
            let path = rest.strip_prefix("//").unwrap_or(rest);
            if path.is_empty() {
                return bad(
                    "a SQLite URL needs a file: `sqlite://PATH` (e.g. sqlite:///var/lib/app/simba.db) \
                     or `sqlite::memory:`"
                        .to_owned(),
                );
            }
            if path == ":memory:" {
                return Ok(Target::Sqlite {
                    path: ":memory:".to_owned(),
                    memory: true,
                });
            }
            if path.starts_with("file:") {
                return bad("write `sqlite://PATH`, not `sqlite://file:...`".to_owned());
            }
            Ok(Target::Sqlite {
                path: path.to_owned(),
                memory: false,
            })
        }
        Backend::Mysql => {
            let Some(after) = rest.strip_prefix("//") else {
                return bad(format!(
                    "`{}` is not a URL; write mysql://USER:PASSWORD@HOST:PORT/DATABASE",
                    redact_url(url)
                ));
            };
            let url = format!("mysql://{after}");
            check_mysql_url(&url)?;
            Ok(Target::Mysql(url))
        }
        Backend::Postgres => {
            if !rest.starts_with("//") {
                return bad(format!(
                    "`{}` is not a URL; write postgres://USER:PASSWORD@HOST:PORT/DATABASE",
                    redact_url(url)
                ));
            }
            check_postgres_url(url)?;
            Ok(Target::Postgres(url.to_owned()))
        }
    }
}

#[cfg(feature = "mysql")]
fn check_mysql_url(url: &str) -> Result<()> {
    crate::mysql::connect::check_url(url)
}

#[cfg(not(feature = "mysql"))]
fn check_mysql_url(_url: &str) -> Result<()> {
    Ok(())
}

/// Checks what tokio-postgres would refuse only when connecting (see
/// `crate::postgres::connect::check_url`).
#[cfg(feature = "postgres")]
fn check_postgres_url(url: &str) -> Result<()> {
    crate::postgres::connect::check_url(url)
}

#[cfg(not(feature = "postgres"))]
fn check_postgres_url(_url: &str) -> Result<()> {
    Ok(())
}

/// Checks a table name: `[schema.]table`, each part an ASCII letter or `_` followed by
/// letters, digits or `_`, at most [`MAX_TABLE_NAME_LEN`] bytes in all.
pub(crate) fn validate_table(name: &str) -> Result<()> {
    let bad = |reason: String| Err(Error::config("table", reason));
    if name.is_empty() {
        return bad("the table name must not be empty".to_owned());
    }
    if name.len() > MAX_TABLE_NAME_LEN {
        return bad(format!(
            "`{name}` is {} bytes, longer than the limit of {MAX_TABLE_NAME_LEN}",
            name.len()
        ));
    }
    let parts: Vec<&str> = name.split('.').collect();
    if parts.len() > 2 {
        return bad(format!("`{name}`: write `table` or `schema.table`"));
    }
    for part in parts {
        let mut chars = part.chars();
        let first_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return bad(format!(
                "`{name}` is not a plain SQL identifier: use ASCII letters, digits and `_`, \
                 not starting with a digit (optionally `schema.table`)"
            ));
        }
    }
    Ok(())
}

/// How a [`SqlStore`](crate::SqlStore) connects: database URL, table, pool and timeouts.
///
/// Timing of leases (ttl, transition, …) is not here: it lives in
/// [`simba_core::LeaseConfig`], whose defaults are Simba's (ttl 10 s, transition 6 s).
///
/// ```
/// use std::time::Duration;
/// use simba_jdbc::SqlConfig;
///
/// let config = SqlConfig::new("postgres://app:secret@db.internal:5432/app")
///     .with_table("app_mutex")
///     .with_pool_size(4)
///     .with_statement_timeout(Duration::from_secs(2));
/// config.validate()?;
/// // The password never shows in Debug output or errors.
/// assert!(!format!("{config:?}").contains("secret"));
/// # Ok::<(), simba_core::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct SqlConfig {
    url: String,
    table: String,
    pool_size: usize,
    statement_timeout: Duration,
    max_name_len: usize,
    ddl: bool,
    foreign_poll: Duration,
    one_statement_acquire: bool,
}

impl fmt::Debug for SqlConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlConfig")
            .field("url", &redact_url(&self.url))
            .field("table", &self.table)
            .field("pool_size", &self.pool_size)
            .field("statement_timeout", &self.statement_timeout)
            .field("max_name_len", &self.max_name_len)
            .field("ddl", &self.ddl)
            .field("foreign_poll", &self.foreign_poll)
            .field("one_statement_acquire", &self.one_statement_acquire)
            .finish()
    }
}

impl SqlConfig {
    /// A config for the database at `url`, with the defaults: table [`DEFAULT_TABLE`], pool
    /// of [`DEFAULT_POOL_SIZE`], statement timeout [`DEFAULT_STATEMENT_TIMEOUT`], names up
    /// to [`MUTEX_COLUMN_LEN`] characters.
    ///
    /// URL forms: `mysql://USER:PASSWORD@HOST:PORT/DB` (or `mariadb://`),
    /// `postgres://USER:PASSWORD@HOST:PORT/DB` (or `postgresql://`), `sqlite://PATH`
    /// (`sqlite:///abs/path.db`, `sqlite://relative.db`) and `sqlite::memory:` (one process
    /// only). PostgreSQL URLs take libpq's TLS options `sslmode`, `sslrootcert`, `sslcert`
    /// and `sslkey`; MySQL/MariaDB URLs take `ssl-mode`, `ssl-ca`, `ssl-cert` and `ssl-key`
    /// (both feature `tls`; see the crate documentation). Nothing is checked until
    /// [`SqlConfig::validate`] or [`SqlStore::connect`](crate::SqlStore::connect).
    pub fn new(url: impl Into<String>) -> Self {
        SqlConfig {
            url: url.into(),
            table: DEFAULT_TABLE.to_owned(),
            pool_size: DEFAULT_POOL_SIZE,
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            max_name_len: MUTEX_COLUMN_LEN,
            ddl: true,
            foreign_poll: DEFAULT_FOREIGN_POLL,
            one_statement_acquire: true,
        }
    }

    /// Uses the table `name` (`table` or `schema.table`, plain identifiers).
    pub fn with_table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// At most `size` pooled connections (1 to [`MAX_POOL_SIZE`]). PostgreSQL stores open one
    /// more connection for LISTEN once a contender subscribes. `sqlite::memory:` always uses
    /// one connection.
    pub fn with_pool_size(mut self, size: usize) -> Self {
        self.pool_size = size;
        self
    }

    /// Bounds every store call: checking a connection out of the pool and running the
    /// call's statements. Also set on the server where cheap (PostgreSQL
    /// `statement_timeout`, MariaDB `max_statement_time`, SQLite `busy_timeout`). A call
    /// that runs out of time fails with a retryable backend error, and its connection is
    /// closed rather than reused.
    pub fn with_statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// The longest mutex name accepted, in characters: set it to the width of the `mutex`
    /// column if you created the table yourself with a narrower one. Longer names are
    /// rejected with [`Error::InvalidName`] before any SQL runs. At most
    /// [`simba_core::MAX_MUTEX_NAME_LEN`].
    pub fn with_max_name_len(mut self, chars: usize) -> Self {
        self.max_name_len = chars;
        self
    }

    /// Whether [`SqlStore::migrate`](crate::SqlStore::migrate) may change the schema
    /// (default `true`): create the table when it is missing, and add simba's two waiter
    /// columns to a table that lacks them (one made by the JVM Simba library), an
    /// additive, online change. With `false` it only inspects the table; a table without
    /// the waiter columns (a JVM Simba table as it is) is then used without them, with a
    /// warning that names the statements that would add them: simba's contenders still
    /// queue on the native locks, but no column tells simba's owners from the JVM
    /// library's, so while a contender of another process owns a mutex, a waiter here
    /// reads its row every [`SqlConfig::with_foreign_poll`]; and SQLite takes the row of an
    /// owner whose process died at its lease end rather than at once. Safety is the same:
    /// it rests on the row alone.
    pub fn with_ddl(mut self, allowed: bool) -> Self {
        self.ddl = allowed;
        self
    }

    /// How often a process whose contender waits for a mutex reads its row while the row's
    /// owner is one that took it outside simba's native wait queue (a JVM Simba contender
    /// in a mixed fleet): nothing else tells the waiter that this owner released. Default
    /// [`DEFAULT_FOREIGN_POLL`]; between 1 ms and 10 s. Costs one primary-key read per
    /// interval per such mutex and process, only while a foreign owner holds it and a simba
    /// contender of the process waits.
    pub fn with_foreign_poll(mut self, every: Duration) -> Self {
        self.foreign_poll = every;
        self
    }

    /// Whether an acquisition on MariaDB 10.5 or later is one statement, `INSERT … ON
    /// DUPLICATE KEY UPDATE … RETURNING` (the default, `true`), or the `UPDATE` then `SELECT`
    /// that MySQL runs (which has no `RETURNING`). [`SqlStore::migrate`](crate::SqlStore::migrate)
    /// asks the server for its version; a store that never migrates, and every server whose
    /// version does not name MariaDB 10.5 or later, runs the two statements. Both decide
    /// alike; the one statement saves a round trip and the server a statement (see the
    /// crate README, *How a decision is made*). Ignored by PostgreSQL (already one
    /// statement) and SQLite.
    pub fn with_one_statement_acquire(mut self, on: bool) -> Self {
        self.one_statement_acquire = on;
        self
    }

    /// See [`SqlConfig::with_one_statement_acquire`].
    pub fn one_statement_acquire(&self) -> bool {
        self.one_statement_acquire
    }

    /// See [`SqlConfig::with_foreign_poll`].
    pub fn foreign_poll(&self) -> Duration {
        self.foreign_poll
    }

    /// Whether the migration may change the schema.
    pub fn ddl(&self) -> bool {
        self.ddl
    }

    /// The database URL as given (it may hold a password: do not log it; `Debug` redacts it).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The URL with its password replaced by `***`.
    pub fn redacted_url(&self) -> String {
        redact_url(&self.url)
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The pool size.
    pub fn pool_size(&self) -> usize {
        self.pool_size
    }

    /// The statement timeout.
    pub fn statement_timeout(&self) -> Duration {
        self.statement_timeout
    }

    /// The longest mutex name accepted, in characters.
    pub fn max_name_len(&self) -> usize {
        self.max_name_len
    }

    /// The backend the URL selects.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for `url` as in [`SqlConfig::validate`].
    pub fn backend(&self) -> Result<Backend> {
        Ok(parse_url(&self.url)?.backend())
    }

    /// Checks every setting without connecting.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the bad setting: an unknown URL scheme (the message
    /// lists the supported schemes and the enabled features), a scheme whose feature is not
    /// enabled, a malformed URL, a bad PostgreSQL TLS option (named: `sslmode`,
    /// `sslrootcert`, `sslcert`, `sslkey`; TLS asked for without the `tls` feature), a bad
    /// MySQL TLS option (named: `ssl-mode`, `ssl-ca`, `ssl-cert`, `ssl-key`), a table name that is not a plain identifier, a pool size of
    /// zero or over [`MAX_POOL_SIZE`], a statement timeout of zero, over a year or not whole
    /// milliseconds, a name limit of zero or over [`simba_core::MAX_MUTEX_NAME_LEN`].
    pub fn validate(&self) -> Result<()> {
        self.target().map(|_| ())
    }

    pub(crate) fn target(&self) -> Result<Target> {
        let target = parse_url(&self.url)?;
        validate_table(&self.table)?;
        if self.pool_size == 0 || self.pool_size > MAX_POOL_SIZE {
            return Err(Error::config(
                "pool_size",
                format!(
                    "{} is out of range: use 1 to {MAX_POOL_SIZE}",
                    self.pool_size
                ),
            ));
        }
        validate_duration(
            "statement_timeout",
            self.statement_timeout,
            Duration::from_millis(1),
        )?;
        if self.max_name_len == 0 || self.max_name_len > MAX_MUTEX_NAME_LEN {
            return Err(Error::config(
                "max_name_len",
                format!(
                    "{} is out of range: use 1 to {MAX_MUTEX_NAME_LEN}",
                    self.max_name_len
                ),
            ));
        }
        if self.foreign_poll < Duration::from_millis(1)
            || self.foreign_poll > Duration::from_secs(10)
        {
            return Err(Error::config(
                "foreign_poll",
                format!("{:?} is out of range: use 1 ms to 10 s", self.foreign_poll),
            ));
        }
        Ok(target)
    }
}

#[cfg(test)]
mod tests;
