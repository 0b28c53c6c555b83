//! The rows a store reads, as diesel maps them (PostgreSQL's executor builds the same
//! from its own rows), and the reply an owner read makes of its row ([`owner_reply`]).
//! They come from a server: nothing here trusts them.

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Nullable, Text};
use simba_core::backend::LeaseReply;
use simba_core::{Error, MutexOwner, Result};

use crate::config::Backend;

/// The row every owner read returns: the database's time, and the mutex's row if any.
/// It comes from a server: [`owner_reply`](crate::rows::owner_reply) trusts none of it (the fuzz target `sql_row`
/// builds these from fuzz input).
#[derive(Debug, Clone, QueryableByName)]
pub(crate) struct OwnerRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) now_ms: i64,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) owner_id: Option<String>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) acquired_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) ttl_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) transition_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) version: Option<i64>,
    /// The id simba wrote beside its own ownerships (see `schema`, *foreign owners*): an
    /// owner whose id differs took the row without simba (the JVM library).
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) waiter_id: Option<String>,
}

/// A row of one text column `value` (the server's version).
#[derive(Debug, Clone, QueryableByName)]
pub(crate) struct TextRow {
    #[diesel(sql_type = Text)]
    pub(crate) value: String,
}

/// A row of the batched renewal's read: the database's time, and one row of the batch
/// (all `None` when no row of the batch exists).
#[derive(Debug, Clone, QueryableByName)]
pub(crate) struct BatchRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) now_ms: i64,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) mutex: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) owner_id: Option<String>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) acquired_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) ttl_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) transition_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) version: Option<i64>,
}

/// A row of the permits table with the database's time (all `None` when the semaphore
/// has no row). From a server: the permits view (`crate::store::permits`) checks what it uses.
#[derive(Debug, Clone, QueryableByName)]
pub(crate) struct PermitRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) now_ms: i64,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) contender: Option<String>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) permits: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) ticket: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) acquired_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) ttl_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) transition_at: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) fence: Option<i64>,
}

/// The reply from the row. `grace` is given to a contender that may not take a free
/// row yet (it has not got the native lock): a row released less than `grace` ms ago
/// is, to it, held by nobody (empty id) until then, so that the engine looks again
/// when the grace ends if no push came before.
pub(crate) fn owner_reply(
    kind: Backend,
    row: Option<OwnerRow>,
    grace: Option<i64>,
) -> Result<LeaseReply> {
    let backend = kind.name();
    let Some(row) = row else {
        return Err(Error::backend(
            backend,
            "the owner query returned no row (it always returns one)",
        ));
    };
    let now = row.now_ms;
    let transition_at = row.transition_at.unwrap_or(0);
    // A `CHAR(n)` column (a JVM Simba table) comes back padded with spaces on
    // PostgreSQL; contender ids hold no whitespace, so trailing spaces are padding.
    let owner_id = row.owner_id.map(|mut id| {
        id.truncate(id.trim_end_matches(' ').len());
        id
    });
    let owner = match owner_id {
        Some(owner_id) if !owner_id.is_empty() => {
            if transition_at > now {
                let version = row.version.unwrap_or(0);
                let fence = u64::try_from(version).map_err(|_| {
                    Error::backend(
                        backend,
                        format!("the version (fence) of the row is negative: {version}"),
                    )
                })?;
                MutexOwner {
                    owner_id,
                    acquired_at: row.acquired_at.unwrap_or(0),
                    ttl_at: row.ttl_at.unwrap_or(0),
                    transition_at,
                    fence,
                }
            } else {
                // An ownership past its lease is no ownership.
                MutexOwner::NONE
            }
        }
        Some(_) => match grace {
            Some(grace) if transition_at.saturating_add(grace) > now => {
                let until = transition_at.saturating_add(grace);
                MutexOwner {
                    owner_id: String::new(),
                    acquired_at: 0,
                    ttl_at: until,
                    transition_at: until,
                    fence: 0,
                }
            }
            _ => MutexOwner::NONE,
        },
        None => MutexOwner::NONE,
    };
    Ok(LeaseReply { owner, now })
}
