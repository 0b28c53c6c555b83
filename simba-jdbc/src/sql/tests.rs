use super::*;

#[test]
fn postgres_placeholders_are_numbered() {
    let s = Statements::new(
        Backend::Postgres,
        "simba_mutex",
        FenceRule::Clock,
        Columns::All,
    );
    assert!(!s.acquire_locked.contains('?'), "{}", s.acquire_locked);
    // The arguments of MySQL's and SQLite's, and the mutex of the row joined to the
    // UPDATE's; no NOTIFY channel or payload (sent after the commit).
    assert!(s.acquire_locked.contains("$11"), "{}", s.acquire_locked);
    assert!(!s.acquire_locked.contains("$12"), "{}", s.acquire_locked);
    assert!(s.acquire_unlocked.contains("$12") && !s.acquire_unlocked.contains("$13"));
    assert!(s.release.contains("$2") && !s.release.contains("$3"));
    assert!(s.release_after.contains("$5") && !s.release_after.contains("$6"));
    assert!(s.insert_owned.contains("$6") && !s.insert_owned.contains("$7"));
    for sql in [
        &s.acquire_locked,
        &s.acquire_unlocked,
        &s.release,
        &s.release_after,
    ] {
        assert!(!sql.contains("pg_notify"), "{sql}");
    }
}

#[test]
fn placeholder_counts_match_arguments() {
    for backend in [Backend::Mysql, Backend::Sqlite] {
        let s = Statements::new(backend, "simba_mutex", FenceRule::Clock, Columns::All);
        // SQLite binds the taker's identity and the flag of a running job's rows too
        // (`file_marks`).
        let marks = usize::from(s.file_marks);
        assert_eq!(s.file_marks, backend == Backend::Sqlite);
        assert_eq!(s.acquire_locked.matches('?').count(), 10 + 2 * marks);
        assert_eq!(s.acquire_unlocked.matches('?').count(), 11 + marks);
        assert_eq!(s.release.matches('?').count(), 2);
        assert_eq!(s.release_after.matches('?').count(), 5);
        assert_eq!(s.insert_owned.matches('?').count(), 6);
        assert_eq!(s.select.matches('?').count(), 1);
    }
}

#[test]
fn only_mysql_has_the_one_statement_acquire_and_its_arguments_add_up() {
    for backend in [Backend::Postgres, Backend::Sqlite] {
        let s = Statements::new(backend, "t", FenceRule::Clock, Columns::All);
        assert!(s.one_statement.is_none());
    }
    for (columns, values, graces) in [(Columns::All, 6, 7), (Columns::Lease, 4, 5)] {
        let s = Statements::new(Backend::Mysql, "t", FenceRule::Counter, columns);
        let one = s.one_statement.expect("MySQL / MariaDB");
        // The VALUES are `insert_owned`'s; the grace comes once per assignment.
        assert_eq!(one.locked.matches('?').count(), values, "{}", one.locked);
        assert_eq!(one.grace_args, graces, "{}", one.unlocked);
        assert_eq!(one.unlocked.matches('?').count(), values + graces);
        assert!(one.locked.contains("RETURNING"));
        // `owner_id` is assigned before `transition_at`, the last (see `OneStatement`).
        let owner = one.locked.find("owner_id = IF(").expect("owner_id");
        let transition = one
            .locked
            .find("transition_at = IF(")
            .expect("transition_at");
        let rest = &one.locked[transition + "transition_at = IF(".len()..];
        let assignments = rest.split("RETURNING").next().unwrap_or(rest);
        assert!(owner < transition && !assignments.contains(" = IF("));
    }
}

#[test]
fn a_table_without_waiter_columns_gets_statements_that_never_name_them() {
    for backend in [Backend::Mysql, Backend::Sqlite, Backend::Postgres] {
        for fence in [FenceRule::Clock, FenceRule::Counter] {
            let s = Statements::new(backend, "jvm", fence, Columns::Lease);
            assert!(!s.waiter_columns);
            for sql in [
                &s.acquire_locked,
                &s.acquire_unlocked,
                &s.release,
                &s.release_after,
                &s.select,
                &s.check,
                &s.insert_owned,
            ] {
                // `waiter_id` appears only as the alias of a NULL.
                let named = sql.replace("AS waiter_id", "");
                assert!(!named.contains("waiter_"), "{backend:?}: {sql}");
            }
            // The three waiter arguments are gone: 10 - 3, 11 - 3 (PostgreSQL: one more,
            // the mutex of the joined row).
            if backend == Backend::Postgres {
                assert!(s.acquire_locked.contains("$8") && !s.acquire_locked.contains("$9"));
                assert!(s.acquire_unlocked.contains("$9") && !s.acquire_unlocked.contains("$10"));
                assert!(s.insert_owned.contains("$4") && !s.insert_owned.contains("$5"));
            } else {
                assert_eq!(s.acquire_locked.matches('?').count(), 7);
                assert_eq!(s.acquire_unlocked.matches('?').count(), 8);
                assert_eq!(s.insert_owned.matches('?').count(), 4);
            }
        }
    }
    // SQLite's takeover of a dead owner's row needs the gated flag, and only a flag
    // that names a file (2 or more) and is the taker's own.
    let all = Statements::new(Backend::Sqlite, "t", FenceRule::Clock, Columns::All);
    assert!(
        all.acquire_locked
            .contains("waiter_until = ? AND waiter_until > 1")
    );
    assert!(!all.acquire_locked.contains("waiter_until = 1"));
    for backend in [Backend::Mysql, Backend::Postgres] {
        let s = Statements::new(backend, "t", FenceRule::Clock, Columns::All);
        assert!(!s.file_marks);
        // Their WHERE never reads the gated flag (it is written only).
        let take = s.acquire_locked.split(" WHERE ").nth(1).unwrap_or_default();
        assert!(!take.contains("waiter_until"), "{backend:?}: {take}");
    }
}

#[test]
fn batch_renewal_placeholders_match_arguments() {
    for backend in [Backend::Mysql, Backend::Sqlite, Backend::Postgres] {
        let s = Statements::new(backend, "simba_mutex", FenceRule::Clock, Columns::All);
        for n in [1usize, 2, 7] {
            let (update, select) = s.renew_batch(n);
            let args = 2 + 3 * n;
            if backend == Backend::Postgres {
                assert!(update.contains(&format!("${args}")), "{update}");
                assert!(!update.contains(&format!("${}", args + 1)), "{update}");
                assert!(select.contains(&format!("${n}")), "{select}");
                assert!(!select.contains(&format!("${}", n + 1)), "{select}");
            } else {
                assert_eq!(update.matches('?').count(), args, "{update}");
                assert_eq!(select.matches('?').count(), n, "{select}");
            }
        }
    }
}

#[test]
fn tables_are_quoted() {
    assert_eq!(quote_table(Backend::Mysql, "a.b"), "`a`.`b`");
    assert_eq!(
        quote_table(Backend::Postgres, "simba_mutex"),
        "\"simba_mutex\""
    );
    let ddl = create_table_sql(Backend::Sqlite, "locks").expect("valid");
    assert!(
        ddl.starts_with("CREATE TABLE IF NOT EXISTS \"locks\""),
        "{ddl}"
    );
    assert!(create_table_sql(Backend::Mysql, "x;drop").is_err());
}
