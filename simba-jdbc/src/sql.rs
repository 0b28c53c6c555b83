//! The SQL text of every statement, per backend.
//!
//! All statements are written once with `?` placeholders; PostgreSQL gets them renumbered
//! to `$1, $2, …`. Every placeholder is bound on its own (MySQL and SQLite cannot reuse one),
//! so the argument lists in `conn.rs` (`Call`) follow the order of the `?` here.

use crate::config::Backend;

/// The DDL of each backend, with `{table}` standing for the quoted table name.
const CREATE_MYSQL: &str = include_str!("../migrations/mysql/create_table.sql");
const CREATE_POSTGRES: &str = include_str!("../migrations/postgres/create_table.sql");
const CREATE_SQLITE: &str = include_str!("../migrations/sqlite/create_table.sql");

/// Key of the PostgreSQL advisory lock that serialises concurrent migrations (concurrent
/// `CREATE TABLE IF NOT EXISTS` can fail on PostgreSQL with a duplicate `pg_type` row).
const PG_MIGRATION_LOCK: i64 = 0x7369_6d62_615f_6d69; // "simba_mi"

/// The SQL expression of the lease clock: the database's current time in milliseconds
/// since the Unix epoch, as a BIGINT. Every time simba stores or compares is this value.
///
/// Each value is fixed for the whole statement (MySQL `UTC_TIMESTAMP(3)` is the statement's
/// start, PostgreSQL `statement_timestamp()` likewise, SQLite's `'now'` is fixed per step),
/// so every comparison and assignment in one UPDATE sees the same instant.
///
/// None depends on a session or server time zone. On MySQL / MariaDB that takes care:
/// `UNIX_TIMESTAMP(NOW(3))` reads the local time of the session's zone and converts it back,
/// which in a zone with daylight saving is an hour off during the repeated autumn hour and
/// then steps forward; `UTC_TIMESTAMP(3)` has no such hour, and the difference from the
/// epoch is plain date arithmetic.
pub fn lease_clock_sql(backend: Backend) -> &'static str {
    match backend {
        Backend::Mysql => {
            "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(3)) DIV 1000)"
        }
        Backend::Postgres => {
            "CAST(FLOOR(EXTRACT(EPOCH FROM statement_timestamp()) * 1000) AS BIGINT)"
        }
        Backend::Sqlite => "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
    }
}

/// Quotes a validated `[schema.]table` name for `backend`.
pub(crate) fn quote_table(backend: Backend, table: &str) -> String {
    let (open, close) = match backend {
        Backend::Mysql => ('`', '`'),
        Backend::Postgres | Backend::Sqlite => ('"', '"'),
    };
    table
        .split('.')
        .map(|part| format!("{open}{part}{close}"))
        .collect::<Vec<_>>()
        .join(".")
}

/// Rewrites `?` placeholders as `$1, $2, …` for PostgreSQL.
pub(crate) fn numbered(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut n = 0;
    for c in sql.chars() {
        if c == '?' {
            n += 1;
            out.push('$');
            out.push_str(&n.to_string());
        } else {
            out.push(c);
        }
    }
    out
}

/// The `CREATE TABLE IF NOT EXISTS` statement that [`SqlStore::migrate`](crate::SqlStore::migrate)
/// runs for `backend`, for DBAs who create the table themselves.
///
/// # Errors
/// [`simba_core::Error::InvalidConfig`] if `table` is not a plain identifier
/// (`[schema.]table`).
pub fn create_table_sql(backend: Backend, table: &str) -> simba_core::Result<String> {
    crate::config::validate_table(table)?;
    let template = match backend {
        Backend::Mysql => CREATE_MYSQL,
        Backend::Postgres => CREATE_POSTGRES,
        Backend::Sqlite => CREATE_SQLITE,
    };
    Ok(template
        .trim_end()
        .replace("{table}", &quote_table(backend, table)))
}

/// Every statement of one store.
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    /// `true` when the acquire statements return the row themselves (PostgreSQL: one
    /// statement, `UPDATE … RETURNING` joined with the row); else `select` follows.
    pub(crate) returns_row: bool,
    /// `true` when the table has simba's waiter columns and the acquire statements write
    /// them (their first three arguments: me, me, the gated flag); `false` for a JVM
    /// Simba table left as it is ([`Columns::Lease`]).
    pub(crate) waiter_columns: bool,
    /// Acquire while this process holds the mutex's native lock: takes a free row (SQLite:
    /// also the row of an owner whose process is gone). Args: me, me, the gated flag, me,
    /// me, ttl, ttl+transition, me, mutex, me [, the gated flag, the job flag when
    /// `file_marks`] [, mutex when `returns_row`].
    pub(crate) acquire_locked: String,
    /// SQLite with the waiter columns, whose gated flags are database files' identities:
    /// `acquire_locked` takes over at once a gated row whose flag is the taker's own,
    /// bound after the `WHERE`'s id; and both acquire statements bind one more value,
    /// last: the gated flag of the rows a running job keeps (the owner's `simba exec`
    /// command holds the mutex's job byte, `crate::sqlite::DbFile::check_job`), which
    /// neither takes, not even by lease; `-1` (no row's flag) when no job runs.
    pub(crate) file_marks: bool,
    /// Acquire without the native lock: renews its own row, takes a row only when its
    /// lease ran out (never a released one before `grace` ms). Args: me, me, 0, me, me, ttl,
    /// ttl+transition, me, mutex, me, grace [, the job flag when `file_marks`] [, mutex when
    /// `returns_row`].
    pub(crate) acquire_unlocked: String,
    /// The parts of the batched renewal ([`Statements::renew_batch`]).
    pub(crate) batch: BatchParts,
    /// Args: mutex, me.
    pub(crate) release: String,
    /// Args: holder, hold ms, hold ms, mutex, me. Hands `me`'s
    /// ownership to the hold's id until `now + hold`.
    pub(crate) release_after: String,
    /// A mutex's first acquisition: its row inserted already owned, with the row the
    /// acquire statements would have written into a fresh one (the fence
    /// `max(1, the database clock)`, or 1 on a narrow column); a no-op when the row
    /// exists. Args: mutex, ttl, ttl+transition, me [, me, the gated flag when
    /// `waiter_columns`].
    pub(crate) insert_owned: String,
    /// Args: mutex. One row: now_ms, and the nullable columns of the mutex's row.
    pub(crate) select: String,
    /// MariaDB ≥ 10.5 only (`None` for the other dialects): each acquisition as one
    /// statement, see [`OneStatement`].
    pub(crate) one_statement: Option<OneStatement>,
    /// Runs once per migration (may hold several statements).
    pub(crate) migrate: String,
    /// Fails unless the table has every column the store uses.
    pub(crate) check: String,
}

/// An acquisition in one statement on MariaDB (10.5 and later): `INSERT … ON DUPLICATE KEY
/// UPDATE … RETURNING`, where MySQL (which has no `RETURNING`) runs the `UPDATE` of
/// [`Statements::acquire_locked`] / [`Statements::acquire_unlocked`], then
/// [`Statements::select`], and on a mutex's first use [`Statements::insert_owned`] between
/// them: one round trip and one statement of the server's in place of two or four.
///
/// A new row is inserted already owned, as `insert_owned` writes it; an existing one gets
/// the acquire `UPDATE`'s assignments, each guarded by that `UPDATE`'s `WHERE` (`take`):
/// when it does not hold, every column is assigned its own value and the statement changes
/// nothing. MariaDB runs the assignments left to right and each sees the ones before it, so
/// `take` reads the old `owner_id` and `transition_at` in every assignment but the last:
/// `owner_id` is assigned before `transition_at`, and once it is the contender's own (it
/// is only where `take` held), `take` holds again for `transition_at` (the contender owns
/// it with `transition_at > now`, or `transition_at <= now` is the locked take, or an
/// owner that is not `''` the unlocked one; contender ids are never empty). `RETURNING`
/// gives the row as the statement left it, and the database's time.
#[derive(Debug, Clone)]
pub(crate) struct OneStatement {
    /// As `acquire_locked`. Args: those of `insert_owned`.
    pub(crate) locked: String,
    /// As `acquire_unlocked`. Args: those of `insert_owned`, then the grace
    /// [`OneStatement::grace_args`] times.
    pub(crate) unlocked: String,
    /// How many times `unlocked` takes the grace.
    pub(crate) grace_args: usize,
}

/// How a new ownership's fence is computed from the row's `version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FenceRule {
    /// `max(version + 1, the database clock in ms)`: simba's own 64-bit column. Floored by
    /// the clock, so a row deleted and made again never repeats a fence.
    Clock,
    /// `version + 1`: a narrower column (a JVM Simba table's `INT UNSIGNED`), which the
    /// clock would overflow. The JVM library writes `version + 1` too.
    Counter,
}

/// Which columns the statements may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Columns {
    /// simba's table: the lease and the two waiter columns.
    All,
    /// The lease's six columns only: a JVM Simba table that simba may not alter
    /// ([`SqlConfig::with_ddl`](crate::SqlConfig::with_ddl)`(false)`). No column marks
    /// simba's owners, so every owner outside this store looks foreign (its waiters read
    /// the row), and SQLite takes a dead owner's row at its lease end, not at once.
    Lease,
}

impl Statements {
    pub(crate) fn new(backend: Backend, table: &str, fence: FenceRule, columns: Columns) -> Self {
        let waiter_columns = columns == Columns::All;
        let t = quote_table(backend, table);
        let now = lease_clock_sql(backend);
        let greatest = match backend {
            Backend::Mysql | Backend::Postgres => "GREATEST",
            Backend::Sqlite => "MAX",
        };
        // MySQL runs SET assignments left to right and later ones see earlier results, so
        // everything that reads the old owner_id / transition_at is assigned before those
        // columns are.
        //
        // `waiter_until` is the *gated* flag: not 0 while the owner took the row holding the
        // native lock. On SQLite it is the identity of the database file whose lock the owner
        // holds (`crate::native::Held::mark`, at least 2), so that a waiter that gets that
        // same lock may take the row over at once; elsewhere 1 (and 1 on SQLite rows of
        // builds before that, never taken over at once).
        // PostgreSQL's driver reads BIGINT only; a JVM table's `version` is an INTEGER.
        let version_out = match backend {
            Backend::Postgres => "CAST(m.version AS BIGINT)",
            Backend::Mysql | Backend::Sqlite => "m.version",
        };
        let next_fence = match fence {
            FenceRule::Clock => format!("{greatest}(version + 1, {now})"),
            FenceRule::Counter => "version + 1".to_owned(),
        };
        let waiter_sets = if waiter_columns {
            format!(
                "waiter_id = ?, \
                 waiter_until = CASE WHEN owner_id = ? AND transition_at > {now} \
                     THEN waiter_until ELSE ? END, "
            )
        } else {
            String::new()
        };
        let update = |take: &str| {
            format!(
                "UPDATE {t} SET \
                 {waiter_sets}\
                 version = CASE WHEN owner_id = ? AND transition_at > {now} \
                     THEN version ELSE {next_fence} END, \
                 acquired_at = CASE WHEN owner_id = ? AND transition_at > {now} \
                     THEN acquired_at ELSE {now} END, \
                 ttl_at = {now} + ?, \
                 transition_at = {now} + ?, \
                 owner_id = ? \
                 WHERE mutex = ? AND ((owner_id = ? AND transition_at > {now}) OR {take})"
            )
        };
        // With the native lock: any row whose lease is over (released or run out). On
        // SQLite the lock also proves that the process of a gated owner is gone (the
        // kernel frees a lock only with its process, or when it unlocks after its
        // release), but only if it is the lock the owner held: the owner's flag is the
        // identity of the database file it locked, the taker's (bound) the identity of the
        // file it holds the lock of. Such a row is taken over at once, unless it is a hold
        // (`held@@…`), which must be waited out whoever made it. A row gated by another
        // file (a database moved or copied over this one), by an earlier build (1) or
        // outside Linux (0) is left to its lease.
        //
        // On SQLite, neither statement takes a row whose gated flag is the bound job flag:
        // the row of an owner whose job still runs (see `Statements::file_marks`).
        let job_kept = "(waiter_until IS NULL OR waiter_until <> ?)";
        let locked_take = match backend {
            Backend::Sqlite if waiter_columns => format!(
                "(transition_at <= {now} \
                  OR (waiter_until = ? AND waiter_until > 1 AND waiter_id = owner_id \
                      AND substr(owner_id, 1, 6) <> 'held@@')) \
                 AND {job_kept}"
            ),
            Backend::Mysql | Backend::Postgres | Backend::Sqlite => {
                format!("transition_at <= {now}")
            }
        };
        // Without it: only a row whose owner's lease ran out (lease-bound failover); a
        // released row (owner_id = '') is for the holder of the native lock, unless it
        // has lain free for `grace` (its holder went silent).
        let unlocked_take =
            format!("(transition_at <= {now} AND (owner_id <> '' OR transition_at <= {now} - ?))");
        let unlocked_take = match backend {
            Backend::Sqlite if waiter_columns => format!("({unlocked_take} AND {job_kept})"),
            Backend::Mysql | Backend::Postgres | Backend::Sqlite => unlocked_take,
        };
        let acquire_locked = update(&locked_take);
        let acquire_unlocked = update(&unlocked_take);
        // The release time stays in transition_at: waiters without the native lock leave a
        // released row alone for a grace period after it.
        let ungate = if waiter_columns {
            ", waiter_until = 0"
        } else {
            ""
        };
        let release = format!(
            "UPDATE {t} SET acquired_at = 0, ttl_at = {now}, transition_at = {now}, \
             owner_id = ''{ungate} \
             WHERE mutex = ? AND owner_id = ? AND transition_at > {now}"
        );
        // Keeps version (the fence) and acquired_at: the same ownership, ending at a fixed
        // instant, by an id no contender has, so nobody renews it.
        let release_after = format!(
            "UPDATE {t} SET owner_id = ?, ttl_at = {now} + ?, transition_at = {now} + ? \
             WHERE mutex = ? AND owner_id = ? AND transition_at > {now}"
        );
        let batch = BatchParts {
            postgres: backend == Backend::Postgres,
            update: format!(
                "UPDATE {t} SET ttl_at = {now} + ?, transition_at = {now} + ? \
                 WHERE transition_at > {now} AND mutex IN "
            ),
            select: format!(
                "SELECT n.now_ms AS now_ms, m.mutex AS mutex, m.owner_id AS owner_id, \
                 m.acquired_at AS acquired_at, m.ttl_at AS ttl_at, \
                 m.transition_at AS transition_at, {version_out} AS version \
                 FROM (SELECT {now} AS now_ms) n LEFT JOIN {t} m ON m.mutex IN "
            ),
        };
        let columns = "(mutex, acquired_at, ttl_at, transition_at, owner_id, version)";
        let if_new = match backend {
            Backend::Mysql => "ON DUPLICATE KEY UPDATE mutex = mutex",
            Backend::Postgres | Backend::Sqlite => "ON CONFLICT (mutex) DO NOTHING",
        };
        // What the acquire statements write into a fresh row (version 0, owner ''), in
        // one statement: one commit where the insert and the UPDATE made two.
        let first_fence = match fence {
            FenceRule::Clock => format!("{greatest}(1, {now})"),
            FenceRule::Counter => "1".to_owned(),
        };
        let insert_values = if waiter_columns {
            format!(
                "INSERT INTO {t} (mutex, acquired_at, ttl_at, transition_at, owner_id, version, \
                 waiter_id, waiter_until) \
                 VALUES (?, {now}, {now} + ?, {now} + ?, ?, {first_fence}, ?, ?)"
            )
        } else {
            format!(
                "INSERT INTO {t} {columns} \
                 VALUES (?, {now}, {now} + ?, {now} + ?, ?, {first_fence})"
            )
        };
        let insert_owned = format!("{insert_values} {if_new}");
        // Without the column, no owner is marked as simba's (`waiter_id` NULL).
        let no_waiter = match backend {
            Backend::Mysql => "CAST(NULL AS CHAR)",
            Backend::Postgres => "CAST(NULL AS TEXT)",
            Backend::Sqlite => "NULL",
        };
        let waiter_out = if waiter_columns {
            "m.waiter_id AS waiter_id".to_owned()
        } else {
            format!("{no_waiter} AS waiter_id")
        };
        let select = format!(
            "SELECT n.now_ms AS now_ms, m.owner_id AS owner_id, m.acquired_at AS acquired_at, \
             m.ttl_at AS ttl_at, m.transition_at AS transition_at, {version_out} AS version, \
             {waiter_out} \
             FROM (SELECT {now} AS now_ms) n LEFT JOIN {t} m ON m.mutex = ?"
        );
        let create = create_table_sql(backend, table).unwrap_or_default();
        let waiter_check = if waiter_columns {
            ", waiter_id, waiter_until"
        } else {
            ""
        };
        let check = format!(
            "SELECT mutex, acquired_at, ttl_at, transition_at, owner_id, version{waiter_check} \
             FROM {t} WHERE 1 = 0"
        );
        let one_statement = (backend == Backend::Mysql).then(|| {
            let own = format!("(owner_id = VALUES(owner_id) AND transition_at > {now})");
            let one = |take: &str| {
                let take = format!("({own} OR {take})");
                let set = |col: &str| format!("{col} = IF({take}, VALUES({col}), {col})");
                let unless_own = |col: &str, new: &str| {
                    format!("{col} = IF({take}, IF({own}, {col}, {new}), {col})")
                };
                let mut sets = Vec::with_capacity(7);
                if waiter_columns {
                    sets.push(set("waiter_id"));
                    sets.push(unless_own("waiter_until", "VALUES(waiter_until)"));
                }
                sets.push(unless_own("version", &next_fence));
                sets.push(unless_own("acquired_at", now));
                sets.push(set("ttl_at"));
                // `owner_id` before `transition_at` (see `OneStatement`).
                sets.push(set("owner_id"));
                sets.push(set("transition_at"));
                let waiter_out = if waiter_columns {
                    "waiter_id".to_owned()
                } else {
                    format!("{no_waiter} AS waiter_id")
                };
                format!(
                    "{insert_values} ON DUPLICATE KEY UPDATE {} \
                     RETURNING {now} AS now_ms, owner_id, acquired_at, ttl_at, transition_at, \
                     version, {waiter_out}",
                    sets.join(", ")
                )
            };
            let unlocked = one(&unlocked_take);
            OneStatement {
                locked: one(&locked_take),
                // Every `?` past the VALUES' is a grace.
                grace_args: unlocked.matches('?').count() - insert_values.matches('?').count(),
                unlocked,
            }
        });
        match backend {
            Backend::Postgres => {
                // One statement: the UPDATE, the row after it (the UPDATE's own row if it
                // changed one, else the row as it is: `m` is the row before the UPDATE) and
                // the time. No NOTIFY in it: a transaction that notifies holds PostgreSQL's
                // notification lock, one for the whole server, through its commit's WAL
                // flush, so notifying writes commit one after another, each with a flush of
                // its own; the store notifies after the commit instead
                // (`crate::postgres::Notifier`).
                let (returned_waiter, waiter_out) = if waiter_columns {
                    (", waiter_id", "COALESCE(u.waiter_id, m.waiter_id)")
                } else {
                    ("", no_waiter)
                };
                let returning = |update: &str| {
                    numbered(&format!(
                        "WITH u AS ({update} RETURNING owner_id, acquired_at, ttl_at, \
                         transition_at, version{returned_waiter}), \
                         n AS (SELECT {now} AS now_ms) \
                         SELECT n.now_ms AS now_ms, \
                         COALESCE(u.owner_id, m.owner_id) AS owner_id, \
                         COALESCE(u.acquired_at, m.acquired_at) AS acquired_at, \
                         COALESCE(u.ttl_at, m.ttl_at) AS ttl_at, \
                         COALESCE(u.transition_at, m.transition_at) AS transition_at, \
                         CAST(COALESCE(u.version, m.version) AS BIGINT) AS version, \
                         {waiter_out} AS waiter_id \
                         FROM n LEFT JOIN u ON TRUE LEFT JOIN {t} m ON m.mutex = ?"
                    ))
                };
                Statements {
                    returns_row: true,
                    waiter_columns,
                    file_marks: false,
                    acquire_locked: returning(&acquire_locked),
                    acquire_unlocked: returning(&acquire_unlocked),
                    batch,
                    release: numbered(&release),
                    release_after: numbered(&release_after),
                    insert_owned: numbered(&insert_owned),
                    select: numbered(&select),
                    one_statement,
                    // One implicit transaction: the advisory lock is held until the end.
                    migrate: format!("SELECT pg_advisory_xact_lock({PG_MIGRATION_LOCK}); {create}"),
                    check,
                }
            }
            Backend::Mysql | Backend::Sqlite => Statements {
                returns_row: false,
                waiter_columns,
                file_marks: backend == Backend::Sqlite && waiter_columns,
                acquire_locked,
                acquire_unlocked,
                batch,
                release,
                release_after,
                insert_owned,
                select,
                one_statement,
                migrate: create,
                check,
            },
        }
    }
}

/// The text of the batched renewal, completed per batch size by
/// [`Statements::renew_batch`].
#[derive(Debug, Clone)]
pub(crate) struct BatchParts {
    postgres: bool,
    /// `UPDATE … WHERE transition_at > NOW AND mutex IN `, followed by the list.
    update: String,
    /// The owner read of many rows with the database's time, followed by the list.
    select: String,
}

impl Statements {
    /// The two statements of a renewal of `n` ownerships at once (`n` ≥ 1):
    ///
    /// - the UPDATE, args `ttl, ttl+transition, mutex₁ … mutexₙ, mutex₁, me₁ … mutexₙ, meₙ`:
    ///   `… WHERE transition_at > NOW AND mutex IN (…) AND ((mutex = ? AND owner_id = ?) OR …)`,
    ///   the renewal of each pair exactly as the single renewal's `WHERE` (the `IN` list lets
    ///   the database find the rows by the primary key);
    /// - the read, args `mutex₁ … mutexₙ`: the database's time, and every row of the list
    ///   (one row of NULLs beside the time when none exists).
    pub(crate) fn renew_batch(&self, n: usize) -> (String, String) {
        let list = |n: usize| {
            let mut l = String::with_capacity(2 + 3 * n);
            l.push('(');
            for i in 0..n {
                if i > 0 {
                    l.push_str(", ");
                }
                l.push('?');
            }
            l.push(')');
            l
        };
        let mut update = self.batch.update.clone();
        update.push_str(&list(n));
        update.push_str(" AND (");
        for i in 0..n {
            if i > 0 {
                update.push_str(" OR ");
            }
            update.push_str("(mutex = ? AND owner_id = ?)");
        }
        update.push(')');
        let mut select = self.batch.select.clone();
        select.push_str(&list(n));
        if self.batch.postgres {
            (numbered(&update), numbered(&select))
        } else {
            (update, select)
        }
    }
}

#[cfg(test)]
mod tests;
