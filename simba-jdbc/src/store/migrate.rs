//! [`SqlStore::migrate`]: the table made, completed or checked, and what the store learns of it.

use super::*;

impl SqlStore {
    /// Creates the table if it does not exist (`CREATE TABLE IF NOT EXISTS`, see
    /// [`create_table_sql`](crate::create_table_sql)) and the semaphores' table beside it
    /// ([`create_permits_table_sql`](crate::create_permits_table_sql)), adds simba's two waiter columns to
    /// a table that lacks them (a table made by the JVM Simba library: see the crate
    /// README's migration guide), learns the widths of `owner_id` and `version`, and checks
    /// that the table has every column the store uses. Idempotent, and safe to run from
    /// many processes at once (PostgreSQL serialises it with an advisory lock; elsewhere a
    /// column another process added first is found on a second look). With
    /// [`SqlConfig::with_ddl`]`(false)` it changes nothing and only checks.
    ///
    /// A table whose `version` is narrower than 64 bits (JVM Simba's `INT UNSIGNED`) gets
    /// fences `version + 1`; one whose `owner_id` is narrower than 200 characters lowers
    /// the longest contender id accepted to its width less 6 (the `held@@` prefix).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a SQLite database file with more than one name (hard
    /// links). [`Error::Backend`] if the database fails, denies the DDL, or the table lacks a
    /// column (and may not or cannot get it). Bounded by the statement timeout, but at
    /// least 30 s.
    ///
    /// # Cancel safety
    /// Dropping the future may leave the table created or a column added, or not; running
    /// it again is fine.
    pub async fn migrate(&self) -> Result<()> {
        let inner = &*self.inner;
        let limit = inner.config.statement_timeout().max(MIGRATE_TIMEOUT_MIN);
        let ddl = inner.config.ddl();
        // SQLite: a hard-linked database is refused before SQLite opens it (a database
        // not made yet is made by the DDL, and checked after it).
        #[cfg(feature = "sqlite")]
        inner.check_db_file(true, None)?;
        let (describe, describe_args) = schema::describe(inner.kind, inner.config.table());
        let columns = || async {
            inner
                .bounded::<Vec<schema::ColumnRow>>("migrate", limit, async {
                    on_conn!(inner, |c| async {
                        let args: Vec<Arg<'_>> =
                            describe_args.iter().map(|a| Arg::Text(a)).collect();
                        c.load_columns(&describe, &args).await
                    })
                })
                .await
        };
        if ddl {
            let st = &inner.default_table.st;
            inner
                .bounded::<()>("migrate", limit, async {
                    on_conn!(inner, |c| c.batch(&st.migrate))
                })
                .await?;
        }
        // SQLite: the database file exists now; one with several names is refused.
        #[cfg(feature = "sqlite")]
        inner.check_db_file(false, None)?;
        let mut found = schema::inspect(inner.kind, &columns().await?);
        if ddl && found.missing_lease.is_empty() && !found.missing_waiter.is_empty() {
            let quoted = crate::sql::quote_table(inner.kind, inner.config.table());
            for statement in schema::add_columns(inner.kind, &quoted, &found.missing_waiter) {
                info!(
                    backend = inner.kind.name(),
                    table = inner.config.table(),
                    "adding a column simba uses: {statement}"
                );
                let added = inner
                    .bounded::<()>("migrate", limit, async {
                        on_conn!(inner, |c| c.batch(&statement))
                    })
                    .await;
                let fallback = schema::alter_fallback(&statement);
                if let (Err(e), Some(fallback)) = (&added, fallback) {
                    debug!("{e}; trying {fallback}");
                    let _ = inner
                        .bounded::<()>("migrate", limit, async {
                            on_conn!(inner, |c| c.batch(&fallback))
                        })
                        .await;
                } else if let Err(e) = added {
                    // Another process may have added it first: the second look decides.
                    debug!("{e}");
                }
            }
            found = schema::inspect(inner.kind, &columns().await?);
        }
        let quoted = crate::sql::quote_table(inner.kind, inner.config.table());
        if !found.missing_lease.is_empty()
            && found.missing_lease.len() < schema::LEASE_COLUMNS.len()
        {
            return Err(permanent(
                inner.kind.name(),
                format!(
                    "migrate: the table {} lacks the column(s) {}: it is neither simba's nor \
                     the JVM Simba library's; compare it with create_table_sql()",
                    inner.config.table(),
                    found.missing_lease.join(", ")
                ),
            ));
        }
        let lease_only = found.missing_lease.is_empty() && !found.missing_waiter.is_empty();
        if lease_only {
            let statements = schema::add_columns(inner.kind, &quoted, &found.missing_waiter);
            if ddl {
                return Err(permanent(
                    inner.kind.name(),
                    format!(
                        "migrate: the table {} lacks the waiter column(s) {} and adding them \
                         failed (see the log); add them (online, and the JVM Simba library's \
                         statements keep working): {}; or run without them with \
                         SqlConfig::with_ddl(false), in a connector URL (simba exec) \
                         `simba_ddl=false` (see the crate README, migration guide)",
                        inner.config.table(),
                        found.missing_waiter.join(", "),
                        statements.join("; ")
                    ),
                ));
            }
            warn!(
                backend = inner.kind.name(),
                table = inner.config.table(),
                "the table lacks simba's waiter column(s) {} and DDL is off: running without \
                 them. Every owner outside this process looks foreign, so waiters read the \
                 row every {:?} while another process owns it{}. To add them: {}",
                found.missing_waiter.join(", "),
                inner.config.foreign_poll(),
                if inner.kind == Backend::Sqlite {
                    ", and the row of an owner whose process died is taken at its lease end"
                } else {
                    ""
                },
                statements.join("; ")
            );
        }
        let mut one = false;
        if inner.kind == Backend::Mysql && inner.config.one_statement_acquire() {
            let version = inner
                .bounded::<Vec<crate::rows::TextRow>>("migrate", limit, async {
                    on_conn!(inner, |c| c.load_text("SELECT VERSION() AS value"))
                })
                .await?;
            let version = version.first().map_or("", |r| r.value.as_str());
            one = returning_acquire(version);
            debug!(
                version,
                one_statement = one,
                "MySQL / MariaDB: an acquisition in one statement where the server is MariaDB ≥ 10.5"
            );
        }
        let table = Table::new(
            inner.kind,
            inner.config.table(),
            &found.shape,
            !lease_only,
            one,
        );
        if found.shape != Shape::default() {
            info!(
                backend = inner.kind.name(),
                table = inner.config.table(),
                fence_max = ?found.shape.fence_max,
                owner_len = found.shape.owner_len,
                name_len = found.shape.name_len,
                "a narrow table (JVM Simba's?): fences are version + 1 and contender ids at \
                 most {} characters",
                found.shape.max_contender_len()
            );
        }
        inner
            .bounded::<()>("migrate", limit, async {
                on_conn!(inner, |c| c.batch(&table.st.check))
            })
            .await?;
        if let Err(found) = inner.table.set(table)
            && inner.table().differs(&found)
        {
            warn!(
                backend = inner.kind.name(),
                table = inner.config.table(),
                "the table changed since this store's first migration: the store keeps \
                 running the statements it chose then ({:?}); a new store (a restart) uses \
                 the table as it is now ({:?})",
                inner.table(),
                found
            );
        }
        self.permit_ops().migrate(limit, ddl).await
    }
}
