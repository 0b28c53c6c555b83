//! The conformance harness of simba-jdbc, shared by the test files.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use simba_core::backend::BoxFuture;
use simba_core::fault::FaultStore;
use simba_core::{ContendServiceFactory, LeaseServiceFactory};
use simba_jdbc::{SqlConfig, SqlStore};
use simba_test_kit::memory::{HangFault, lease_capabilities, lease_config};
use simba_test_kit::proxy::{FaultProxy, ProxyFault};
use simba_test_kit::servers::TestServer;
use simba_test_kit::store_cases::StoreSource;
use simba_test_kit::suite::{
    Fault, Harness, Intrusion, SetupError, SuiteCapabilities, SuiteTiming, intrude_through_store,
};
use simba_test_kit::support::unique_name;

/// The shared parts of the TLS test files.
#[cfg(feature = "tls")]
pub mod tls;

/// The statement timeout of test stores: below the engine's 2 s request timeout, so a
/// hung call ends in the store (which closes its connection) rather than being dropped.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_millis(1500);

/// mysql_async switches from TCP to the server's Unix socket when the server is local
/// (`prefer_socket`), which would bypass a [`FaultProxy`]: keep MySQL URLs on TCP.
pub fn tcp_only(url: &str) -> String {
    if !url.starts_with("mysql://") || url.contains("prefer_socket") {
        return url.to_owned();
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}prefer_socket=false")
}

/// Where the harness's database lives.
enum Place {
    /// A server (MariaDB, PostgreSQL) that faults reach through a [`FaultProxy`].
    Server(TestServer),
    /// A SQLite file in a temporary directory; faults hang a [`FaultStore`].
    File(tempfile::TempDir),
}

/// One SQL database as the conformance suite sees it: every factory is a new
/// [`SqlStore`] with its own pool (as a separate process would have) over one table.
pub struct SqlHarness {
    name: &'static str,
    place: Place,
    url: String,
    table: String,
    pushes_release: bool,
    /// Appended to every URL made from the server's (TLS options).
    query: String,
    /// The URL of the test's own connections (the table made by hand, an intrusion) when
    /// not [`SqlHarness::url`]: the PostgreSQL behind a pooler, without simba's options.
    plain_url: Option<String>,
    /// [`SqlConfig::with_one_statement_acquire`] (MariaDB).
    one_statement: bool,
    /// Kept alive as long as the harness (the certificate files of a TLS server).
    _keep: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl std::fmt::Debug for SqlHarness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlHarness")
            .field("name", &self.name)
            .field("url", &simba_jdbc::redact_url(&self.url))
            .field("table", &self.table)
            .finish()
    }
}

impl SqlHarness {
    /// The same harness on a table made as the JVM Simba library's init script makes it
    /// (`mutex VARCHAR(66)`, `owner_id CHAR(32)`, `version INT UNSIGNED`, no waiter
    /// columns): the suite then runs on what `migrate()` makes of it.
    // Without MariaDB and PostgreSQL (a SQLite-only build) every arm but the panic is gone.
    #[cfg_attr(
        not(any(feature = "mysql", feature = "postgres")),
        allow(unreachable_code, unused_variables)
    )]
    pub async fn on_jvm_table(self) -> Self {
        let t = &self.table;
        match self.name {
            #[cfg(feature = "mysql")]
            "mysql" => {
                use mysql_async::prelude::Queryable;
                let mut c = mysql_async::Conn::from_url(self.plain())
                    .await
                    .unwrap_or_else(|e| panic!("connect: {e}"));
                c.query_drop(format!(
                    "CREATE TABLE `{t}` (mutex VARCHAR(66) NOT NULL PRIMARY KEY, \
                     acquired_at BIGINT UNSIGNED NOT NULL, ttl_at BIGINT UNSIGNED NOT NULL, \
                     transition_at BIGINT UNSIGNED NOT NULL, owner_id CHAR(32) NOT NULL, \
                     version INT UNSIGNED NOT NULL)"
                ))
                .await
                .unwrap_or_else(|e| panic!("the JVM table: {e}"));
                let _ = c.disconnect().await;
            }
            #[cfg(feature = "postgres")]
            "postgres" => {
                let (client, conn) = tokio_postgres::connect(self.plain(), tokio_postgres::NoTls)
                    .await
                    .unwrap_or_else(|e| panic!("connect: {e}"));
                let task = tokio::spawn(conn);
                client
                    .batch_execute(&format!(
                        "CREATE TABLE \"{t}\" (mutex VARCHAR(66) NOT NULL PRIMARY KEY, \
                         acquired_at BIGINT NOT NULL, ttl_at BIGINT NOT NULL, \
                         transition_at BIGINT NOT NULL, owner_id CHAR(32) NOT NULL, \
                         version INTEGER NOT NULL)"
                    ))
                    .await
                    .unwrap_or_else(|e| panic!("the JVM table: {e}"));
                drop(client);
                let _ = task.await;
            }
            other => panic!("no JVM table for {other}"),
        }
        self
    }

    /// A MariaDB (env URL or private instance).
    pub async fn mysql() -> Self {
        let server = simba_test_kit::servers::mysql()
            .await
            .unwrap_or_else(|e| panic!("no MySQL/MariaDB for the tests: {e}"));
        Self::on_server("mysql", server, false)
    }

    /// A PostgreSQL (env URL or private instance).
    pub async fn postgres() -> Self {
        let server = simba_test_kit::servers::postgres()
            .await
            .unwrap_or_else(|e| panic!("no PostgreSQL for the tests: {e}"));
        Self::on_server("postgres", server, true)
    }

    /// A SQLite file in a new temporary directory.
    pub fn sqlite() -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
        let url = format!("sqlite://{}", dir.path().join("simba.db").display());
        SqlHarness {
            name: "sqlite",
            place: Place::File(dir),
            url,
            table: unique_name("simba_t"),
            pushes_release: false,
            query: String::new(),
            plain_url: None,
            one_statement: true,
            _keep: None,
        }
    }

    pub fn on_server(name: &'static str, server: TestServer, pushes_release: bool) -> Self {
        SqlHarness {
            name,
            url: tcp_only(server.url()),
            place: Place::Server(server),
            table: unique_name("simba_t"),
            pushes_release,
            query: String::new(),
            plain_url: None,
            one_statement: true,
            _keep: None,
        }
    }

    /// Adds `query` (e.g. `?sslmode=verify-full&…`) to every URL of this harness.
    #[allow(dead_code)]
    pub fn with_query(mut self, query: &str) -> Self {
        match query.strip_prefix('?') {
            // A MySQL URL already has `?prefer_socket=false` (tcp_only).
            Some(rest) if self.url.contains('?') => {
                self.url.push('&');
                self.url.push_str(rest);
            }
            _ => self.url.push_str(query),
        }
        self.query = query.to_owned();
        self
    }

    /// PostgreSQL through PgBouncer in `mode` (env URLs or private instances): in
    /// transaction mode with `simba_pooler=transaction`, and with `direct` the PostgreSQL
    /// behind it as `simba_direct_url` (native wait queue and LISTEN there); in session
    /// mode with `simba_pooler=session`. The test's own connections go to the PostgreSQL
    /// directly.
    #[cfg(feature = "postgres")]
    #[allow(dead_code)]
    pub async fn pgbouncer(mode: simba_test_kit::servers::PoolMode, direct: bool) -> Self {
        use simba_test_kit::servers::{PoolMode, ServerKind};
        let pooler = simba_test_kit::servers::pgbouncer(mode)
            .await
            .unwrap_or_else(|e| panic!("no PgBouncer for the tests: {e}"));
        let server = TestServer::external(ServerKind::Postgres, pooler.url())
            .unwrap_or_else(|e| panic!("PgBouncer's URL: {e}"));
        let query = match (mode, direct) {
            (PoolMode::Session, _) => "?simba_pooler=session".to_owned(),
            (PoolMode::Transaction, false) => "?simba_pooler=transaction".to_owned(),
            (PoolMode::Transaction, true) => format!(
                "?simba_pooler=transaction&simba_direct_url={}",
                simba_test_kit::support::percent_encode(pooler.direct_url())
            ),
        };
        let pushes = mode == PoolMode::Session || direct;
        let mut h = Self::on_server("postgres", server, pushes).with_query(&query);
        h.plain_url = Some(pooler.direct_url().to_owned());
        h.keeping(pooler)
    }

    /// The URL of the test's own connections (see `plain_url`).
    fn plain(&self) -> &str {
        self.plain_url.as_deref().unwrap_or(&self.url)
    }

    /// Every store of this harness acquires with the `UPDATE` and `SELECT` that MySQL runs,
    /// not MariaDB's one statement ([`SqlConfig::with_one_statement_acquire`]).
    #[allow(dead_code)]
    pub fn with_two_statement_acquire(mut self) -> Self {
        self.one_statement = false;
        self
    }

    /// Keeps `value` alive as long as the harness.
    #[allow(dead_code)]
    pub fn keeping(mut self, value: impl std::any::Any + Send + Sync) -> Self {
        self._keep = Some(Box::new(value));
        self
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    pub fn server(&self) -> Option<&TestServer> {
        match &self.place {
            Place::Server(s) => Some(s),
            Place::File(_) => None,
        }
    }

    /// The config of a test store on `url`.
    pub fn config(&self, url: &str) -> SqlConfig {
        SqlConfig::new(url)
            .with_table(&self.table)
            .with_pool_size(4)
            .with_statement_timeout(STATEMENT_TIMEOUT)
            .with_one_statement_acquire(self.one_statement)
    }

    /// A new store with its own pool; the table is created if needed.
    pub async fn store(&self) -> Result<SqlStore, SetupError> {
        self.store_at(&self.url).await
    }

    async fn store_at(&self, url: &str) -> Result<SqlStore, SetupError> {
        let store = SqlStore::connect(self.config(url)).await?;
        store.migrate().await?;
        Ok(store)
    }
}

/// What a SQLite harness's directory may hold: the database, its WAL and shared-memory
/// files, and the semaphores' bell file (on Linux simba locks in the database file itself;
/// elsewhere it adds a lock file per mutex, which this does not allow).
#[allow(dead_code)]
pub fn sqlite_dir_files_allowed(name: &str) -> bool {
    matches!(
        name,
        "simba.db" | "simba.db-wal" | "simba.db-shm" | "simba.db-simba-permits"
    )
}

/// The files of `dir` that a SQLite harness's directory must not hold (see
/// [`sqlite_dir_files_allowed`]).
#[allow(dead_code)]
pub fn sqlite_dir_extra_files(dir: &std::path::Path) -> Vec<String> {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    entries
        .map(|e| {
            e.unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| !sqlite_dir_files_allowed(n))
        .collect()
}

/// Every case that used a SQLite harness leaves at most a constant number of files beside
/// the database, however many mutex names it used (checked unless the case failed).
impl Drop for SqlHarness {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        if let Place::File(dir) = &self.place
            && !std::thread::panicking()
        {
            let extra = sqlite_dir_extra_files(dir.path());
            assert!(
                extra.is_empty(),
                "files beside the SQLite database besides the database, its WAL/SHM and its \
                 lock file: {extra:?}"
            );
        }
    }
}

impl Harness for SqlHarness {
    fn name(&self) -> String {
        self.name.to_owned()
    }

    fn capabilities(&self, timing: SuiteTiming) -> SuiteCapabilities {
        // failover: ttl + transition + 1.5 s; loss: ttl + transition + 500 ms.
        lease_capabilities(timing, self.pushes_release)
    }

    fn factory(
        &self,
        timing: SuiteTiming,
    ) -> BoxFuture<'_, Result<Arc<dyn ContendServiceFactory>, SetupError>> {
        Box::pin(async move {
            let store = self.store().await?;
            let f = LeaseServiceFactory::new(store, lease_config(timing))?;
            Ok(Arc::new(f) as Arc<dyn ContendServiceFactory>)
        })
    }

    fn faulty_factory(
        &self,
        timing: SuiteTiming,
    ) -> BoxFuture<'_, Result<(Arc<dyn ContendServiceFactory>, Box<dyn Fault>), SetupError>> {
        Box::pin(async move {
            match &self.place {
                Place::Server(server) => {
                    let proxy = FaultProxy::start(server.socket_addr()?).await?;
                    let store = self
                        .store_at(&tcp_only(&format!(
                            "{}{}",
                            server.url_via(proxy.addr()),
                            self.query
                        )))
                        .await?;
                    let f = LeaseServiceFactory::new(store, lease_config(timing))?;
                    Ok((
                        Arc::new(f) as Arc<dyn ContendServiceFactory>,
                        Box::new(ProxyFault(proxy)) as Box<dyn Fault>,
                    ))
                }
                Place::File(_) => {
                    let store = FaultStore::new(self.store().await?);
                    let fault = HangFault(store.control());
                    let f = LeaseServiceFactory::new(store, lease_config(timing))?;
                    Ok((
                        Arc::new(f) as Arc<dyn ContendServiceFactory>,
                        Box::new(fault) as Box<dyn Fault>,
                    ))
                }
            }
        })
    }

    /// `UPDATE <table> SET owner_id = 'intruder'` on a plain connection; on a TLS server
    /// (no plain connection), the owner's release by a store of its own.
    fn intrude(&self, mutex: &str, owner_id: &str) -> BoxFuture<'_, Result<Intrusion, SetupError>> {
        let (mutex, owner_id) = (mutex.to_owned(), owner_id.to_owned());
        Box::pin(async move {
            if !self.query.is_empty() && self.plain_url.is_none() {
                let store = self.store().await?;
                return intrude_through_store(&store, &mutex, &owner_id, None).await;
            }
            let changed = self
                .set_owner_by_hand(&mutex, &owner_id, simba_test_kit::suite::INTRUDER)
                .await?;
            if changed != 1 {
                return Err(
                    format!("intruding: {changed} rows of {mutex:?} owned by {owner_id}").into(),
                );
            }
            // On SQLite the owner's lock file is the proof that it lives: the intruder
            // holds none, so the next holder of the lock takes its row at once.
            Ok(if self.name == "sqlite" {
                Intrusion::Freed
            } else {
                Intrusion::TakenOver
            })
        })
    }
}

impl SqlHarness {
    /// `UPDATE <table> SET owner_id = 'intruder' WHERE mutex = … AND owner_id = …` on a
    /// plain connection of its own (not simba's): the number of rows it changed.
    // Without some backend features, some arms are gone.
    #[allow(unreachable_code, unused_variables)]
    pub async fn set_owner_by_hand(
        &self,
        mutex: &str,
        from: &str,
        to: &str,
    ) -> Result<usize, SetupError> {
        let quote = |v: &str| v.replace('\'', "''");
        let (table, mutex, from, to) = (&self.table, quote(mutex), quote(from), quote(to));
        let set = |t: String| {
            format!(
                "UPDATE {t} SET owner_id = '{to}' WHERE mutex = '{mutex}' AND owner_id = '{from}'"
            )
        };
        match self.name {
            #[cfg(feature = "mysql")]
            "mysql" => {
                use diesel_async::AsyncConnection;
                let mut c = diesel_async::AsyncMysqlConnection::establish(self.plain()).await?;
                let sql = set(format!("`{table}`"));
                Ok(diesel_async::RunQueryDsl::execute(diesel::sql_query(sql), &mut c).await?)
            }
            #[cfg(feature = "postgres")]
            "postgres" => {
                use diesel_async::AsyncConnection;
                let mut c = diesel_async::AsyncPgConnection::establish(self.plain()).await?;
                let sql = set(format!("\"{table}\""));
                Ok(diesel_async::RunQueryDsl::execute(diesel::sql_query(sql), &mut c).await?)
            }
            #[cfg(feature = "sqlite")]
            "sqlite" => {
                use diesel::Connection;
                let path = self
                    .url
                    .strip_prefix("sqlite://")
                    .ok_or("a SQLite harness URL without sqlite://")?
                    .to_owned();
                let sql = set(format!("\"{table}\""));
                let changed = tokio::task::spawn_blocking(move || -> Result<usize, SetupError> {
                    let mut c = diesel::SqliteConnection::establish(&path)?;
                    // Wait for the write lock as simba's connections do, rather than fail.
                    diesel::connection::SimpleConnection::batch_execute(
                        &mut c,
                        "PRAGMA busy_timeout = 5000",
                    )?;
                    Ok(diesel::RunQueryDsl::execute(
                        diesel::sql_query(sql),
                        &mut c,
                    )?)
                })
                .await??;
                Ok(changed)
            }
            other => Err(format!("no plain connection to {other} in this build").into()),
        }
    }
}

/// The lease the store-level tests use.
pub const LEASE: simba_core::backend::Lease = simba_core::backend::Lease {
    ttl: Duration::from_millis(1000),
    transition: Duration::from_millis(500),
};

impl StoreSource for SqlHarness {
    type Store = SqlStore;

    fn name(&self) -> String {
        self.name.to_owned()
    }

    fn store(&self) -> BoxFuture<'_, Result<SqlStore, SetupError>> {
        Box::pin(SqlHarness::store(self))
    }

    fn pushes_release(&self) -> bool {
        self.pushes_release
    }
}

/// Blocked lock requests on the lock files of the harness's SQLite database.
///
/// With `distinct`, requests on the same byte range count once: `/proc/locks` is read in
/// pages, and a line can come twice when other processes change their locks between two
/// pages (seen with several test processes at once); use it where every waiter waits on
/// a byte of its own.
pub fn sqlite_blocked(h: &SqlHarness, distinct: bool) -> usize {
    use std::os::unix::fs::MetadataExt;
    let path = h.url().trim_start_matches("sqlite://");
    let dir = std::path::Path::new(path)
        .parent()
        .expect("the database file has a directory");
    let inodes: Vec<u64> = std::fs::read_dir(dir)
        .expect("read the database directory")
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            // Linux: the database file itself; elsewhere a `.lock` and `.entry` per mutex.
            name.ends_with(".db") || name.ends_with(".lock") || name.ends_with(".entry")
        })
        .filter_map(|e| e.metadata().ok().map(|m| m.ino()))
        .collect();
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    let blocked = locks.lines().filter(|l| l.contains("->")).filter(|l| {
        // `N: -> OFDLCK  ADVISORY  WRITE PID MAJ:MIN:INODE START END` (or `FLOCK`)
        l.split_whitespace()
            .find(|f| f.matches(':').count() == 2)
            .and_then(|f| f.rsplit(':').next())
            .and_then(|ino| ino.parse::<u64>().ok())
            .is_some_and(|ino| inodes.contains(&ino))
    });
    if distinct {
        // The line without its index: file, byte range.
        let ranges: std::collections::HashSet<&str> = blocked
            .filter_map(|l| l.split_once("->").map(|(_, rest)| rest))
            .collect();
        ranges.len()
    } else {
        blocked.count()
    }
}
