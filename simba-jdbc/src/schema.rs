//! What [`SqlStore::migrate`](crate::SqlStore::migrate) learns of an existing table, and
//! the additive migration that lets simba-jdbc share a table made by the JVM Simba library.
//!
//! JVM Simba's table has the six columns of the lease (`mutex`, `acquired_at`, `ttl_at`,
//! `transition_at`, `owner_id`, `version`) and on MySQL narrower types: `owner_id CHAR(32)`
//! and `version INT UNSIGNED`. simba adds its two waiter columns with defaults (no type
//! change, no rewrite of existing rows, and the JVM library's statements, which name their
//! columns, keep working), and adapts to the rest:
//!
//! - a `version` column narrower than 64 bits gets fences `version + 1` (simba's own
//!   table: `max(version + 1, database clock in ms)`, which a 32-bit column cannot hold).
//!   Both rules are strictly increasing across a mixed history, since the JVM library
//!   also writes `version + 1`; at the column's maximum the database refuses the write
//!   (out of range) and the store says so (see [`fence_exhausted`]).
//! - contender ids must fit `owner_id` with the `held@@` prefix of a hold: a narrower
//!   column lowers the longest id the store accepts, checked when a contender is made,
//!   before any statement.

use simba_core::HELD_PREFIX;

use crate::config::{Backend, MUTEX_COLUMN_LEN, OWNER_COLUMN_LEN};

/// The columns of the lease, which a table must have (simba's and the JVM library's).
pub(crate) const LEASE_COLUMNS: [&str; 6] = [
    "mutex",
    "acquired_at",
    "ttl_at",
    "transition_at",
    "owner_id",
    "version",
];

/// The columns simba adds to a JVM Simba table.
pub(crate) const WAITER_COLUMNS: [&str; 2] = ["waiter_id", "waiter_until"];

/// One column of the table, as the database describes it.
#[derive(Debug, Clone, diesel::QueryableByName)]
pub(crate) struct ColumnRow {
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub(crate) name: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub(crate) data_type: String,
    /// The declared character width (`CHAR(32)`: 32), where the database reports one.
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::BigInt>)]
    pub(crate) width: Option<i64>,
    /// 1 for a MySQL `UNSIGNED` integer column.
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub(crate) is_unsigned: i64,
}

/// The statement that describes the table's columns, and its arguments (schema, if the
/// table name has one, then the table).
pub(crate) fn describe(backend: Backend, table: &str) -> (String, Vec<String>) {
    let (schema, name) = match table.split_once('.') {
        Some((s, t)) => (Some(s.to_owned()), t.to_owned()),
        None => (None, table.to_owned()),
    };
    match backend {
        Backend::Mysql => {
            let which = if schema.is_some() { "?" } else { "DATABASE()" };
            let sql = format!(
                "SELECT CAST(COLUMN_NAME AS CHAR) AS name, CAST(DATA_TYPE AS CHAR) AS data_type, \
                 CAST(CHARACTER_MAXIMUM_LENGTH AS SIGNED) AS width, \
                 CAST(COLUMN_TYPE LIKE '%unsigned%' AS SIGNED) AS is_unsigned \
                 FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = {which} AND TABLE_NAME = ?"
            );
            (sql, schema.into_iter().chain([name]).collect())
        }
        Backend::Postgres => {
            let which = if schema.is_some() {
                "$1"
            } else {
                "current_schema()"
            };
            let table_arg = if schema.is_some() { "$2" } else { "$1" };
            let sql = format!(
                "SELECT CAST(column_name AS TEXT) AS name, CAST(data_type AS TEXT) AS data_type, \
                 CAST(character_maximum_length AS BIGINT) AS width, CAST(0 AS BIGINT) AS is_unsigned \
                 FROM information_schema.columns WHERE table_schema = {which} \
                 AND table_name = {table_arg}"
            );
            (sql, schema.into_iter().chain([name]).collect())
        }
        Backend::Sqlite => {
            // SQLite does not enforce a declared width: no width is reported.
            let from = if schema.is_some() {
                "pragma_table_info(?, ?)"
            } else {
                "pragma_table_info(?)"
            };
            let sql = format!(
                "SELECT name AS name, type AS data_type, CAST(NULL AS INTEGER) AS width, \
                 0 AS is_unsigned FROM {from}"
            );
            // The table first, then its schema.
            (sql, [name].into_iter().chain(schema).collect())
        }
    }
}

/// What the store adapts to, from the columns of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    /// The largest value of a `version` column narrower than 64 bits; `None` for a 64-bit
    /// one (simba's own table).
    pub(crate) fence_max: Option<i64>,
    /// The width of `owner_id`.
    pub(crate) owner_len: usize,
    /// The width of `mutex`.
    pub(crate) name_len: usize,
}

impl Default for Shape {
    fn default() -> Self {
        Shape {
            fence_max: None,
            owner_len: OWNER_COLUMN_LEN,
            name_len: MUTEX_COLUMN_LEN,
        }
    }
}

impl Shape {
    /// The longest contender id the table can hold: simba's own column holds every id
    /// (a hold's `held@@` id is cut to the column's width by simba-core); a narrower one
    /// keeps room for that prefix.
    pub(crate) fn max_contender_len(&self) -> usize {
        if self.owner_len >= OWNER_COLUMN_LEN {
            OWNER_COLUMN_LEN
        } else {
            self.owner_len.saturating_sub(HELD_PREFIX.len())
        }
    }
}

/// What the columns say: the missing lease columns (the table is not one simba can use),
/// the missing waiter columns (simba adds them), and the shape of the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Inspection {
    pub(crate) missing_lease: Vec<&'static str>,
    pub(crate) missing_waiter: Vec<&'static str>,
    pub(crate) shape: Shape,
}

/// Reads `columns` (an empty list: no such table).
pub(crate) fn inspect(backend: Backend, columns: &[ColumnRow]) -> Inspection {
    let find = |name: &str| columns.iter().find(|c| c.name.eq_ignore_ascii_case(name));
    let missing = |names: &[&'static str]| {
        names
            .iter()
            .copied()
            .filter(|n| find(n).is_none())
            .collect::<Vec<_>>()
    };
    let mut shape = Shape::default();
    if let Some(v) = find("version") {
        shape.fence_max = integer_max(backend, &v.data_type, v.is_unsigned != 0);
    }
    if let Some(o) = find("owner_id")
        && let Some(w) = o.width.and_then(|w| usize::try_from(w).ok())
    {
        shape.owner_len = w.min(OWNER_COLUMN_LEN);
    }
    if let Some(m) = find("mutex")
        && let Some(w) = m.width.and_then(|w| usize::try_from(w).ok())
    {
        shape.name_len = w.min(MUTEX_COLUMN_LEN);
    }
    Inspection {
        missing_lease: missing(&LEASE_COLUMNS),
        missing_waiter: missing(&WAITER_COLUMNS),
        shape,
    }
}

/// The largest value of an integer column type narrower than 64 bits, `None` otherwise.
fn integer_max(backend: Backend, data_type: &str, unsigned: bool) -> Option<i64> {
    let t = data_type.to_ascii_lowercase();
    match backend {
        Backend::Mysql => match (t.as_str(), unsigned) {
            ("int" | "integer", false) => Some(i64::from(i32::MAX)),
            ("int" | "integer", true) => Some(i64::from(u32::MAX)),
            ("mediumint", false) => Some(8_388_607),
            ("mediumint", true) => Some(16_777_215),
            ("smallint", false) => Some(i64::from(i16::MAX)),
            ("smallint", true) => Some(i64::from(u16::MAX)),
            ("tinyint", false) => Some(i64::from(i8::MAX)),
            ("tinyint", true) => Some(i64::from(u8::MAX)),
            _ => None,
        },
        Backend::Postgres => match t.as_str() {
            "integer" => Some(i64::from(i32::MAX)),
            "smallint" => Some(i64::from(i16::MAX)),
            _ => None,
        },
        // SQLite keeps 64 bits whatever the type says, but the JVM library reads what it
        // declared: a declared `INT` (not `BIGINT`) is taken at its word.
        Backend::Sqlite if t.contains("int") && !t.contains("bigint") => {
            Some(if t.contains("unsigned") {
                i64::from(u32::MAX)
            } else {
                i64::from(i32::MAX)
            })
        }
        Backend::Sqlite => None,
    }
}

/// The statements that add the missing waiter columns, one per column (SQLite takes one
/// column per `ALTER TABLE`). Online everywhere: MySQL 8 and MariaDB ≥ 10.3 add a column
/// with a default in place without copying the table (`ALGORITHM=INSTANT`, tried first;
/// see [`alter_fallback`]), PostgreSQL ≥ 11 stores a constant default in the catalogue,
/// SQLite only edits the schema.
pub(crate) fn add_columns(backend: Backend, quoted_table: &str, missing: &[&str]) -> Vec<String> {
    missing
        .iter()
        .map(|column| {
            let def = column_definition(backend, column);
            match backend {
                Backend::Mysql => {
                    format!("ALTER TABLE {quoted_table} ADD COLUMN {def}, ALGORITHM=INSTANT")
                }
                Backend::Postgres => {
                    format!("ALTER TABLE {quoted_table} ADD COLUMN IF NOT EXISTS {def}")
                }
                Backend::Sqlite => format!("ALTER TABLE {quoted_table} ADD COLUMN {def}"),
            }
        })
        .collect()
}

/// A MySQL server without `ALGORITHM=INSTANT` (MySQL 5.7, MariaDB < 10.3): the same
/// change in place, without blocking writes.
pub(crate) fn alter_fallback(statement: &str) -> Option<String> {
    statement
        .strip_suffix(", ALGORITHM=INSTANT")
        .map(|s| format!("{s}, ALGORITHM=INPLACE, LOCK=NONE"))
}

fn column_definition(backend: Backend, column: &str) -> String {
    match (backend, column) {
        (Backend::Mysql, "waiter_id") => "waiter_id VARCHAR(200) CHARACTER SET utf8mb4 \
             COLLATE utf8mb4_bin NOT NULL DEFAULT ''"
            .to_owned(),
        (_, "waiter_id") => "waiter_id VARCHAR(200) NOT NULL DEFAULT ''".to_owned(),
        (_, other) => format!("{other} BIGINT NOT NULL DEFAULT 0"),
    }
}

/// Whether a failed statement's message says a narrow `version` column is full: the
/// database refused `version + 1` (MySQL/MariaDB "Out of range value", PostgreSQL
/// "integer out of range").
pub(crate) fn fence_exhausted(message: &str) -> bool {
    let lower = message.to_ascii_lowercase();
    lower.contains("out of range")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(name: &str, data_type: &str, width: Option<i64>, unsigned: bool) -> ColumnRow {
        ColumnRow {
            name: name.into(),
            data_type: data_type.into(),
            width,
            is_unsigned: i64::from(unsigned),
        }
    }

    fn jvm_mysql() -> Vec<ColumnRow> {
        vec![
            col("mutex", "varchar", Some(66), false),
            col("acquired_at", "bigint", None, true),
            col("ttl_at", "bigint", None, true),
            col("transition_at", "bigint", None, true),
            col("owner_id", "char", Some(32), false),
            col("version", "int", None, true),
        ]
    }

    #[test]
    fn a_jvm_table_is_narrow_and_lacks_the_waiter_columns() {
        let i = inspect(Backend::Mysql, &jvm_mysql());
        assert!(i.missing_lease.is_empty());
        assert_eq!(i.missing_waiter, vec!["waiter_id", "waiter_until"]);
        assert_eq!(i.shape.fence_max, Some(4_294_967_295));
        assert_eq!(i.shape.owner_len, 32);
        assert_eq!(i.shape.name_len, 66);
        assert_eq!(i.shape.max_contender_len(), 26);
    }

    #[test]
    fn simbas_own_table_is_wide() {
        let mut cols = jvm_mysql();
        cols[0] = col("mutex", "varchar", Some(200), false);
        cols[4] = col("owner_id", "varchar", Some(200), false);
        cols[5] = col("version", "bigint", None, false);
        cols.push(col("waiter_id", "varchar", Some(200), false));
        cols.push(col("waiter_until", "bigint", None, false));
        let i = inspect(Backend::Mysql, &cols);
        assert!(i.missing_waiter.is_empty());
        assert_eq!(i.shape, Shape::default());
        assert_eq!(i.shape.max_contender_len(), OWNER_COLUMN_LEN);
    }

    #[test]
    fn no_table_lacks_everything_and_sqlite_takes_the_declared_type() {
        let i = inspect(Backend::Postgres, &[]);
        assert_eq!(i.missing_lease.len(), 6);
        let i = inspect(
            Backend::Sqlite,
            &[col("version", "INT UNSIGNED", None, false)],
        );
        assert_eq!(i.shape.fence_max, Some(4_294_967_295));
        let i = inspect(Backend::Sqlite, &[col("version", "BIGINT", None, false)]);
        assert_eq!(i.shape.fence_max, None);
        let i = inspect(Backend::Postgres, &[col("version", "integer", None, false)]);
        assert_eq!(i.shape.fence_max, Some(i64::from(i32::MAX)));
    }

    #[test]
    fn the_alter_statements_are_additive() {
        let s = add_columns(Backend::Mysql, "`t`", &["waiter_id", "waiter_until"]);
        assert_eq!(s.len(), 2);
        assert!(s[0].ends_with("DEFAULT '', ALGORITHM=INSTANT"), "{}", s[0]);
        assert_eq!(
            alter_fallback(&s[1]).as_deref(),
            Some(
                "ALTER TABLE `t` ADD COLUMN waiter_until BIGINT NOT NULL DEFAULT 0, \
                 ALGORITHM=INPLACE, LOCK=NONE"
            )
        );
        let s = add_columns(Backend::Postgres, "\"t\"", &["waiter_until"]);
        assert_eq!(
            s,
            vec![
                "ALTER TABLE \"t\" ADD COLUMN IF NOT EXISTS waiter_until BIGINT NOT NULL DEFAULT 0"
            ]
        );
        assert!(alter_fallback(&s[0]).is_none());
    }

    #[test]
    fn describe_binds_the_schema_when_given() {
        let (sql, args) = describe(Backend::Postgres, "app.locks");
        assert!(sql.contains("table_schema = $1"), "{sql}");
        assert_eq!(args, vec!["app".to_owned(), "locks".to_owned()]);
        let (sql, args) = describe(Backend::Mysql, "locks");
        assert!(sql.contains("DATABASE()"), "{sql}");
        assert_eq!(args, vec!["locks".to_owned()]);
        let (_, args) = describe(Backend::Sqlite, "main.locks");
        assert_eq!(args, vec!["locks".to_owned(), "main".to_owned()]);
    }
}
