//! The SQL [`Connector`]: `sqlite://PATH`, `mysql://` / `mariadb://` and `postgres://` /
//! `postgresql://` URLs through [`simba_core::connect`].

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use simba_core::backend::{BoxFuture, LeaseReply, LeaseStore};
use simba_core::connect::{Capabilities, ConnectOptions, Connection, Connector, Ownership};
use simba_core::{
    ContendServiceFactory, Error, LeaseConfig, LeaseServiceFactory, Result, Semaphore,
};

use crate::config::{Backend, SqlConfig, Target, redact_url};
#[cfg(feature = "bench")]
use crate::floor::SqlFloors;
use crate::store::SqlStore;

/// The SQL connector, for [`Connectors`](simba_core::connect::Connectors).
///
/// It owns the schemes of every SQL database, whether its feature is on or not (a URL of
/// a database compiled out is refused with the feature to enable). It connects with
/// [`SqlConfig::new`]'s defaults and two URL options of its own, which it takes out of the
/// URL before the driver sees it: `simba_table=NAME` ([`SqlConfig::with_table`]) and
/// `simba_ddl=false` ([`SqlConfig::with_ddl`]: the migration changes nothing, for a JVM
/// Simba table the database user may not alter), and one for MariaDB,
/// `simba_one_statement=false` ([`SqlConfig::with_one_statement_acquire`]). It creates the table if needed and
/// allowed ([`SqlStore::migrate`]), and
/// takes [`ConnectOptions`]'s lease timing. Where nothing pushes owner changes to observers
/// (SQLite, MySQL), they read every [`OBSERVER_POLL`] unless the lease timing chose a
/// [`LeaseConfig::waiter_poll`].
///
/// An in-memory SQLite database (`sqlite::memory:`) is refused: a URL given to a
/// connector names a database that other processes share, and an in-memory one lives in
/// one process. Use [`crate::factory`] for it.
///
/// ```no_run
/// use simba_core::connect::{ConnectOptions, Connectors};
/// # async fn run() -> simba_core::Result<()> {
/// let connectors = Connectors::new(vec![&simba_jdbc::CONNECTOR]);
/// let backend = connectors
///     .connect("sqlite:///var/lib/app/simba.db", &ConnectOptions::default())
///     .await?;
/// let locker = simba_core::Locker::new(backend.factory(), "nightly-report")?;
/// # let _ = locker; Ok(()) }
/// ```
pub static CONNECTOR: SqlConnector = SqlConnector;

/// How often an observer reads the owner on SQLite and MySQL, where nothing pushes
/// changes to it (unless [`LeaseConfig::waiter_poll`] says otherwise). Waiters are woken by
/// the database's lock queue and use this pace only while they cannot wait in it.
pub const OBSERVER_POLL: Duration = Duration::from_millis(200);

/// See [`CONNECTOR`].
#[derive(Debug, Clone, Copy)]
pub struct SqlConnector;

impl SqlConnector {
    /// The [`SqlConfig`] this connector makes of `url`: its own URL options
    /// ([`URL_TABLE_OPTION`], [`URL_DDL_OPTION`], [`URL_ONE_STATEMENT_OPTION`]) taken out
    /// and applied, the rest left to the driver. Nothing is connected or checked beyond
    /// those options (see [`SqlConfig::validate`]).
    ///
    /// ```
    /// let config = simba_jdbc::SqlConnector::config("mysql://app@db/orders?simba_table=jobs")?;
    /// assert_eq!((config.url(), config.table()), ("mysql://app@db/orders", "jobs"));
    /// # Ok::<(), simba_core::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the option whose value is bad or empty.
    pub fn config(url: &str) -> Result<SqlConfig> {
        url_config(url)
    }
}

/// A SQL store's factory, from [`SqlConnector`].
#[derive(Debug)]
struct SqlConnection {
    factory: Arc<LeaseServiceFactory<SqlStore>>,
}

impl Connector for SqlConnector {
    fn name(&self) -> &'static str {
        "SQL"
    }

    fn schemes(&self) -> Vec<&'static str> {
        vec!["sqlite", "mysql", "mariadb", "postgres", "postgresql"]
    }

    fn forms(&self) -> Vec<&'static str> {
        let mut forms = Vec::new();
        if Backend::Sqlite.is_enabled() {
            forms.push("sqlite://PATH");
        }
        if Backend::Mysql.is_enabled() {
            forms.push("mysql://USER:PASSWORD@HOST[:PORT]/DB");
        }
        if Backend::Postgres.is_enabled() {
            forms.push("postgres://USER:PASSWORD@HOST[:PORT]/DB");
        }
        forms
    }

    fn redact(&self, url: &str) -> String {
        redact_url(url)
    }

    fn validate(&self, url: &str) -> Result<()> {
        checked_target(&url_config(url)?).map(drop)
    }

    fn connect<'a>(
        &'a self,
        url: &'a str,
        options: &'a ConnectOptions,
    ) -> BoxFuture<'a, Result<Box<dyn Connection>>> {
        Box::pin(async move {
            let config = url_config(url)?;
            let target = checked_target(&config)?;
            let mut lease = options.lease().clone();
            if target.backend() != Backend::Postgres {
                lease = LeaseConfig {
                    waiter_poll: lease.waiter_poll.or(Some(OBSERVER_POLL)),
                    ..lease
                };
            }
            lease.validate()?;
            // `SqlStore::connect` retries the WAL switch that races when processes open a
            // new SQLite file together.
            let connected = async {
                let store = SqlStore::connect(config).await?;
                store.migrate().await?;
                Ok::<_, Error>(store)
            }
            .await;
            let store = match (connected, &target) {
                (Ok(store), _) => store,
                (Err(e), Target::Sqlite { path, .. }) => {
                    return Err(with_sqlite_hint(e, Path::new(path)));
                }
                (Err(e), _) => return Err(e),
            };
            let factory = Arc::new(LeaseServiceFactory::new(store, lease)?);
            Ok(Box::new(SqlConnection { factory }) as Box<dyn Connection>)
        })
    }
}

impl Connection for SqlConnection {
    fn factory(&self) -> Arc<dyn ContendServiceFactory> {
        self.factory.clone()
    }

    fn capabilities(&self) -> Capabilities {
        // Waiters wait in the database's own lock queue; only PostgreSQL's NOTIFY tells
        // observers.
        let notifies = self.factory.store().kind() == Backend::Postgres;
        Capabilities::new(Ownership::Lease, true, notifies)
    }

    fn read_owner<'a>(&'a self, mutex: &'a str) -> Option<BoxFuture<'a, Result<LeaseReply>>> {
        Some(Box::pin(self.factory.store().owner(mutex)))
    }

    /// On this connection's store (the `{table}_permits` table) with its lease timing.
    fn open_semaphore<'a>(
        &'a self,
        name: &'a str,
        permits: u32,
    ) -> BoxFuture<'a, Result<Semaphore>> {
        Box::pin(async move { Semaphore::from_factory(&self.factory, name, permits) })
    }

    #[cfg(feature = "bench")]
    fn probe<'a>(
        &'a self,
        _name: &'a str,
    ) -> BoxFuture<'a, Result<Box<dyn simba_core::connect::Probe>>> {
        Box::pin(async move {
            let probe = self.factory.store().probe().await?;
            Ok(Box::new(SqlFloors {
                probe,
                kind: self.factory.store().kind(),
            }) as Box<dyn simba_core::connect::Probe>)
        })
    }

    fn connections(&self) -> String {
        let store = self.factory.store();
        let listen = if store.kind() == Backend::Postgres {
            " + 1 LISTEN"
        } else {
            ""
        };
        format!("pool of at most {}{listen}", store.config().pool_size())
    }

    #[cfg(all(unix, feature = "sqlite"))]
    fn owner_anchor(
        &self,
        mutex: &str,
        contender_id: &str,
    ) -> std::io::Result<Option<simba_core::connect::Anchor>> {
        Ok(self.factory.store().anchor(mutex, contender_id))
    }
}

/// The URL option naming the table (default [`DEFAULT_TABLE`](crate::DEFAULT_TABLE)).
pub const URL_TABLE_OPTION: &str = "simba_table";

/// The URL option that forbids DDL: `simba_ddl=false` (or `true`, the default).
pub const URL_DDL_OPTION: &str = "simba_ddl";

/// The URL option that makes MariaDB acquire with an `UPDATE` and a `SELECT`, as MySQL
/// does: `simba_one_statement=false` (or `true`, the default;
/// [`SqlConfig::with_one_statement_acquire`]).
pub const URL_ONE_STATEMENT_OPTION: &str = "simba_one_statement";

/// The config of a connector URL: [`SqlConfig::new`] of the URL without simba's own
/// options ([`URL_TABLE_OPTION`], [`URL_DDL_OPTION`], [`URL_ONE_STATEMENT_OPTION`]), with
/// those applied.
fn url_config(url: &str) -> Result<SqlConfig> {
    let mut table = None;
    let mut ddl = true;
    let mut one_statement = true;
    let driver_url = crate::url_query::take_query_options(
        url,
        &[URL_TABLE_OPTION, URL_DDL_OPTION, URL_ONE_STATEMENT_OPTION],
        |name, value| {
            if name == URL_TABLE_OPTION {
                table = Some(value);
                return Ok(());
            }
            let on = match value.as_str() {
                "true" => true,
                "false" => false,
                other => {
                    return Err(Error::config(
                        name,
                        format!("{name}={other:?}: write true or false"),
                    ));
                }
            };
            if name == URL_DDL_OPTION {
                ddl = on;
            } else {
                one_statement = on;
            }
            Ok(())
        },
    )?;
    let config = SqlConfig::new(&driver_url)
        .with_ddl(ddl)
        .with_one_statement_acquire(one_statement);
    Ok(match table {
        Some(t) => config.with_table(&t),
        None => config,
    })
}

/// The config's target after every check a connection makes ([`SqlConfig::validate`])
/// and the connector's own: no in-memory SQLite database, a SQLite path that can be a file.
fn checked_target(config: &SqlConfig) -> Result<Target> {
    let url = config.url();
    if let Some(given) = sqlite_without_path(url) {
        // The library's own parse also offers `sqlite::memory:`, which a connector refuses.
        return Err(Error::config(
            "url",
            format!(
                "`{given}` names no SQLite file: write sqlite://PATH, e.g. \
                 sqlite:///var/lib/app/simba.db (an absolute path) or sqlite://simba.db \
                 (relative to the working directory); every process that shares the mutex \
                 must name the same file"
            ),
        ));
    }
    let target = config.target()?;
    match &target {
        Target::Sqlite { memory: true, .. } => {
            return Err(Error::config(
                "url",
                "an in-memory SQLite database lives in one process, so it cannot exclude \
                 other processes: name a file, sqlite://PATH",
            ));
        }
        Target::Sqlite { path, .. } => check_sqlite_path(Path::new(path))?,
        Target::Mysql(_) | Target::Postgres(_) => {}
    }
    Ok(target)
}

/// `url`, trimmed, when it is a SQLite URL with an empty path (`sqlite://`, `sqlite:`).
fn sqlite_without_path(url: &str) -> Option<&str> {
    let url = url.trim();
    let (scheme, rest) = url.split_once(':')?;
    (scheme.eq_ignore_ascii_case("sqlite") && rest.strip_prefix("//").unwrap_or(rest).is_empty())
        .then_some(url)
}

/// A SQLite file's directory must exist, and the path, if it exists, must be a regular
/// file: SQLite's own errors ("unable to open database file", "disk I/O error", or a
/// "database is locked" that lasts until the timeout for `/dev/null`) do not say so.
///
/// The error's field is `path`: a local path the backend needs is unusable.
fn check_sqlite_path(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if let Ok(meta) = std::fs::metadata(path)
        && !meta.is_file()
    {
        let kind = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file (a device, socket or pipe)"
        };
        return Err(Error::config(
            "path",
            format!(
                "the SQLite path {} is {kind}; SQLite needs a regular file, and writes \
                 `-wal` and `-shm` files beside it: choose a file in a writable directory, \
                 e.g. sqlite:///var/tmp/simba.db",
                path.display()
            ),
        ));
    }
    if dir.is_dir() {
        Ok(())
    } else {
        Err(Error::config(
            "path",
            format!(
                "the directory {} of the SQLite file {} does not exist; create it or choose \
                 another path",
                dir.display(),
                path.display()
            ),
        ))
    }
}

/// `e` with what to check added when SQLite gave one of its terse file errors ("disk I/O
/// error", "unable to open database file") for `path`.
fn with_sqlite_hint(e: Error, path: &Path) -> Error {
    let Error::Backend {
        backend,
        message,
        retryable,
        source,
    } = &e
    else {
        return e;
    };
    let (backend, retryable) = (*backend, *retryable);
    // What was said, the sources' words included, in the order it was said.
    let mut said = message.clone();
    let mut next = source
        .as_deref()
        .map(|s| s as &(dyn std::error::Error + 'static));
    while let Some(cause) = next {
        let text = cause.to_string();
        if !said.contains(&text) {
            said.push_str(": ");
            said.push_str(&text);
        }
        next = cause.source();
    }
    let terse = ["disk I/O error", "unable to open database file"];
    if !terse.iter().any(|t| said.contains(t)) {
        return e;
    }
    Error::Backend {
        backend,
        message: format!(
            "{said}. SQLite cannot read or write {} or create its -wal / -shm files beside \
             it: check that the file and its directory are writable and on a local file \
             system",
            path.display()
        ),
        retryable,
        source: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terse_sqlite_file_errors_get_a_hint() {
        let path = Path::new("/srv/x.db");
        let hinted =
            with_sqlite_hint(Error::backend("sqlite", "connect: disk I/O error"), path).to_string();
        assert_eq!(
            hinted,
            "sqlite backend: connect: disk I/O error. SQLite cannot read or write /srv/x.db \
             or create its -wal / -shm files beside it: check that the file and its \
             directory are writable and on a local file system"
        );
        let plain = with_sqlite_hint(Error::backend("sqlite", "no answer within 5s"), path);
        assert_eq!(plain.to_string(), "sqlite backend: no answer within 5s");
    }

    #[test]
    fn paths_that_are_no_file_are_refused_before_connecting() {
        let field = |p: &str| match check_sqlite_path(Path::new(p)) {
            Err(Error::InvalidConfig { field, reason }) => format!("{field}: {reason}"),
            other => format!("{other:?}"),
        };
        assert!(
            field("/dev/null").starts_with("path: ") && field("/dev/null").contains("regular file")
        );
        assert!(field("/").contains("a directory"));
        assert!(field("/no/such/dir/x.db").contains("does not exist"));
        assert!(check_sqlite_path(Path::new("/tmp/x-simba-connector.db")).is_ok());
    }

    #[test]
    fn a_sqlite_url_without_a_path_asks_for_a_file_only() {
        if Backend::Sqlite.is_enabled() {
            for url in ["sqlite://", " sqlite:", "SQLITE://"] {
                let e = CONNECTOR.validate(url).map_err(|e| e.to_string());
                let Err(e) = e else {
                    panic!("{url:?} accepted");
                };
                assert!(
                    e.contains(&format!("`{}` names no SQLite file", url.trim()))
                        && e.contains("sqlite://PATH")
                        && !e.contains("memory"),
                    "{url:?}: {e}"
                );
            }
        }
    }

    #[test]
    fn simbas_url_options_are_taken_out_of_the_url() {
        let c =
            url_config("mysql://u:p@h/db?simba_table=jvm_locks&ssl-mode=required&simba_ddl=false")
                .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.url(), "mysql://u:p@h/db?ssl-mode=required");
        assert_eq!(c.table(), "jvm_locks");
        assert!(!c.ddl());
        assert!(c.one_statement_acquire());
        let c = url_config("mariadb://u:p@h/db?simba_one_statement=false&prefer_socket=false")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.url(), "mariadb://u:p@h/db?prefer_socket=false");
        assert!(!c.one_statement_acquire() && c.ddl());
        let e = url_config("mysql://h/db?simba_one_statement=1").err();
        assert!(
            e.as_ref().is_some_and(|e| e
                .to_string()
                .contains("simba_one_statement=\"1\": write true or false")),
            "{e:?}"
        );
        let c = url_config("sqlite:///tmp/x.db?simba_ddl=true").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (c.url(), c.table(), c.ddl()),
            ("sqlite:///tmp/x.db", "simba_mutex", true)
        );
        let e = url_config("postgres://h/db?simba_ddl=no").err();
        assert!(
            e.as_ref()
                .is_some_and(|e| e.to_string().contains("write true or false")),
            "{e:?}"
        );
        // A bad table name is refused as the library refuses it, before connecting.
        let bad = url_config("postgres://h/db?simba_table=x;drop")
            .and_then(|c| checked_target(&c))
            .err();
        assert!(matches!(bad, Some(Error::InvalidConfig { .. })), "{bad:?}");
    }

    #[test]
    fn in_memory_sqlite_is_refused() {
        if Backend::Sqlite.is_enabled() {
            let e = CONNECTOR
                .validate("sqlite://:memory:")
                .map_err(|e| e.to_string());
            assert!(e.is_err_and(|e| e.contains("one process")));
        }
    }
}
