//! What a store knows of its table ([`Table`]).

use super::*;
use crate::sql::{Columns, FenceRule, Statements};

/// What a store knows of its table: the statements for its columns and fence rule, and
/// its bounds. Chosen once, when the table is known (the first successful
/// [`SqlStore::migrate`]); until then, simba's own table with 64-bit fences.
#[derive(Debug)]
pub(super) struct Table {
    /// The statements for the table's columns ([`Columns`]) and fence rule ([`FenceRule`]).
    pub(super) st: Statements,
    /// Whether the server runs an acquisition in one statement (MariaDB ≥ 10.5, and
    /// [`SqlConfig::with_one_statement_acquire`]).
    pub(super) one_statement: bool,
    /// The largest value of the `version` column when it is narrower than 64 bits (then
    /// fences are `version + 1`), else `i64::MAX`.
    pub(super) fence_max: i64,
    /// The longest contender id the `owner_id` column holds (with a hold's prefix).
    pub(super) max_contender: usize,
    /// The width of the `mutex` column (names are also bounded by
    /// `SqlConfig::max_name_len`).
    pub(super) max_name: usize,
}

impl Table {
    /// The table of `shape`, with or without simba's waiter columns.
    pub(super) fn new(
        kind: Backend,
        name: &str,
        shape: &Shape,
        waiter_columns: bool,
        one: bool,
    ) -> Table {
        let fence_max = shape.fence_max.unwrap_or(i64::MAX);
        let rule = if fence_max < i64::MAX {
            FenceRule::Counter
        } else {
            FenceRule::Clock
        };
        let columns = if waiter_columns {
            Columns::All
        } else {
            Columns::Lease
        };
        Table {
            st: Statements::new(kind, name, rule, columns),
            one_statement: one,
            fence_max,
            max_contender: shape.max_contender_len(),
            max_name: shape.name_len,
        }
    }

    /// Whether fences are `version + 1` (a narrow `version` column).
    pub(super) fn counter_fence(&self) -> bool {
        self.fence_max < i64::MAX
    }

    /// Whether `other` runs other statements or bounds than this one.
    pub(super) fn differs(&self, other: &Table) -> bool {
        (self.st.waiter_columns, self.one_statement, self.fence_max)
            != (
                other.st.waiter_columns,
                other.one_statement,
                other.fence_max,
            )
            || (self.max_contender, self.max_name) != (other.max_contender, other.max_name)
    }
}
