//! The rows a store reads, as diesel maps them (PostgreSQL's executor builds the same
//! from its own rows). They come from a server: nothing here trusts them.

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Nullable, Text};

/// The row every owner read returns: the database's time, and the mutex's row if any.
/// It comes from a server: [`owner_reply`](crate::store::owner_reply) trusts none of it (the fuzz target `sql_row`
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
