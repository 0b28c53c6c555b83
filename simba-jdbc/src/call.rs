//! The statement functions of a store ([`Call`]): an acquisition, a release, a hold, an
//! owner read, on one connection of whatever dialect, as its gate let it ([`Pass`]).

use diesel::result::QueryResult;
use simba_core::backend::{Lease, held_owner_id};

use crate::conn::{Arg, SqlConn};
#[cfg(feature = "sqlite")]
use crate::conn::{OwnedArg, Prepared};
use crate::rows::OwnerRow;
use crate::sql::{OneStatement, Statements};

/// How a contender may run its acquisition, as its gate decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// This process holds the native lock for the contender: it may take a free row (and
    /// on SQLite the row of an owner whose process is gone, if that owner's gated flag is
    /// this value: the identity of the database file this lock is on, see
    /// `crate::native::Held::mark`). The contender writes the value to its row's gated flag.
    Locked(i64),
    /// It does not: it may renew its own row, and take a row only when its owner's lease
    /// has run out (never a released one: that belongs to whoever holds the native lock).
    Unlocked,
}

/// The per-call context the statement functions need.
pub(crate) struct Call<'a> {
    pub(crate) st: &'a Statements,
    pub(crate) mutex: &'a str,
    /// The acquisition in one statement, where the server runs it (MariaDB ≥ 10.5).
    pub(crate) one: Option<&'a OneStatement>,
}

impl Call<'_> {
    pub(crate) async fn select<C: SqlConn>(&self, c: &mut C) -> QueryResult<Option<OwnerRow>> {
        Ok(c.load_owner(&self.st.select, &[Arg::Text(self.mutex)])
            .await?
            .pop())
    }

    /// Acquire: one conditional UPDATE on the database clock, which may take a free row
    /// only with the native lock ([`Pass::Locked`]), then the owner and the database's
    /// time (PostgreSQL and MariaDB: all in one statement, MariaDB's inserting the row of a
    /// first use too). Inserts the row first when it does not exist yet. On SQLite a
    /// contender without the native lock reads first and writes only when its UPDATE could
    /// change the row. `job`: on SQLite, the gated flag of the rows whose owner's job still
    /// runs (`Statements::file_marks`), if one does.
    pub(crate) async fn acquire<C: SqlConn>(
        &self,
        c: &mut C,
        me: &str,
        lease: Lease,
        pass: Pass,
        job: Option<i64>,
    ) -> QueryResult<Option<OwnerRow>> {
        let ttl = lease.ttl_ms();
        let total = ttl.saturating_add(lease.transition_ms());
        let (sql, gated) = match pass {
            Pass::Locked(mark) => (&self.st.acquire_locked, mark),
            Pass::Unlocked => (&self.st.acquire_unlocked, 0),
        };
        let mut args = Vec::with_capacity(12);
        if self.st.waiter_columns {
            args.extend([Arg::Text(me), Arg::Text(me), Arg::Int(gated)]);
        }
        args.extend([
            Arg::Text(me),
            Arg::Text(me),
            Arg::Int(ttl),
            Arg::Int(total),
            Arg::Text(me),
            Arg::Text(self.mutex),
            Arg::Text(me),
        ]);
        match pass {
            Pass::Unlocked => args.push(Arg::Int(total)),
            // SQLite: the gated rows this lock may take over at once.
            Pass::Locked(mark) if self.st.file_marks => args.push(Arg::Int(mark)),
            Pass::Locked(_) => {}
        }
        if self.st.file_marks {
            // The gated flag of the rows a running job keeps; -1 matches no row.
            args.push(Arg::Int(job.unwrap_or(-1)));
        }
        if self.st.returns_row {
            args.push(Arg::Text(self.mutex));
        }
        let first = OwnedRow {
            ttl,
            total,
            gated,
            waiter_columns: self.st.waiter_columns,
        };
        if let Some(one) = self.one {
            // MariaDB: the insert of a first use, the UPDATE and the read, in one statement.
            let (sql, graces) = match pass {
                Pass::Locked(_) => (&one.locked, 0),
                Pass::Unlocked => (&one.unlocked, one.grace_args),
            };
            let mut args = first.args(self.mutex, me);
            args.extend(std::iter::repeat_n(Arg::Int(total), graces));
            return Ok(c.load_owner(sql, &args).await?.pop());
        }
        #[cfg(feature = "sqlite")]
        if C::THREADED && !self.st.returns_row {
            // All of it on the connection's thread, in one hop (a hop costs more than
            // SQLite's work on a statement, and the store's turn is held meanwhile).
            let statements = AcquireOnThread {
                acquire: sql.clone(),
                insert_owned: self.st.insert_owned.clone(),
                select: self.st.select.clone(),
                mutex: self.mutex.to_owned(),
                me: me.to_owned(),
                args: OwnedArg::all(&args),
                first,
                unlocked_grace: (pass == Pass::Unlocked).then_some(total),
            };
            return c.on_thread(move |conn| statements.run(conn)).await;
        }
        let row = self.run_acquire(c, sql, &args).await?;
        if row.as_ref().is_some_and(|r| r.owner_id.is_some()) {
            return Ok(row);
        }
        // First use of this mutex: its row inserted already owned (one commit). A racing
        // insert that came first leaves its row, which the UPDATE then decides on.
        c.exec(&self.st.insert_owned, &first.args(self.mutex, me))
            .await?;
        let row = self.select(c).await?;
        if owned_by(&row, me) {
            return Ok(row);
        }
        self.run_acquire(c, sql, &args).await
    }

    pub(crate) async fn run_acquire<C: SqlConn>(
        &self,
        c: &mut C,
        sql: &str,
        args: &[Arg<'_>],
    ) -> QueryResult<Option<OwnerRow>> {
        if self.st.returns_row {
            return Ok(c.load_owner(sql, args).await?.pop());
        }
        c.exec(sql, args).await?;
        self.select(c).await
    }

    /// Release with a hold: one owner-checked UPDATE that hands the ownership to the hold's
    /// id until `now + hold_ms` on the database clock.
    pub(crate) async fn release_after<C: SqlConn>(
        &self,
        c: &mut C,
        me: &str,
        hold_ms: i64,
    ) -> QueryResult<bool> {
        let holder = held_owner_id(me);
        let args = [
            Arg::Text(&holder),
            Arg::Int(hold_ms),
            Arg::Int(hold_ms),
            Arg::Text(self.mutex),
            Arg::Text(me),
        ];
        Ok(c.exec(&self.st.release_after, &args).await? > 0)
    }

    /// Release: owner-checked UPDATE.
    pub(crate) async fn release<C: SqlConn>(&self, c: &mut C, me: &str) -> QueryResult<bool> {
        let args = [Arg::Text(self.mutex), Arg::Text(me)];
        Ok(c.exec(&self.st.release, &args).await? > 0)
    }
}

/// What [`Statements::insert_owned`] writes besides the names: the ttl and the
/// ttl+transition in ms, the gated flag, and whether the table has the waiter columns.
#[derive(Debug, Clone, Copy)]
struct OwnedRow {
    ttl: i64,
    total: i64,
    gated: i64,
    waiter_columns: bool,
}

impl OwnedRow {
    /// The arguments of [`Statements::insert_owned`].
    fn args<'b>(&self, mutex: &'b str, me: &'b str) -> Vec<Arg<'b>> {
        let mut args = vec![
            Arg::Text(mutex),
            Arg::Int(self.ttl),
            Arg::Int(self.total),
            Arg::Text(me),
        ];
        if self.waiter_columns {
            args.extend([Arg::Text(me), Arg::Int(self.gated)]);
        }
        args
    }
}

/// Whether the row read after the owned insert is `me`'s: the insert made it, else
/// another contender's insert came first and the acquire `UPDATE` decides.
fn owned_by(row: &Option<OwnerRow>, me: &str) -> bool {
    row.as_ref()
        .is_some_and(|r| r.owner_id.as_deref() == Some(me))
}

/// [`Call::acquire`]'s statements on a SQLite connection's thread: the conditional
/// UPDATE and the owner read, and on a mutex's first use the owned insert of its row, the
/// read, and when another's insert came first both again.
#[cfg(feature = "sqlite")]
struct AcquireOnThread {
    acquire: String,
    insert_owned: String,
    select: String,
    mutex: String,
    me: String,
    args: Vec<OwnedArg>,
    first: OwnedRow,
    /// Without the native lock ([`Pass::Unlocked`]): the grace of a released row.
    unlocked_grace: Option<i64>,
}

#[cfg(feature = "sqlite")]
impl AcquireOnThread {
    fn run(&self, conn: &mut diesel::SqliteConnection) -> QueryResult<Option<OwnerRow>> {
        use diesel::RunQueryDsl;
        let key = [Arg::Text(&self.mutex)];
        let read = |conn: &mut diesel::SqliteConnection| -> QueryResult<Option<OwnerRow>> {
            Ok(Prepared {
                sql: &self.select,
                args: &key,
            }
            .load::<OwnerRow>(conn)?
            .pop())
        };
        let args = OwnedArg::borrow(&self.args);
        let attempt = |conn: &mut diesel::SqliteConnection| -> QueryResult<Option<OwnerRow>> {
            Prepared {
                sql: &self.acquire,
                args: &args,
            }
            .execute(conn)?;
            read(conn)
        };
        if let Some(grace) = self.unlocked_grace {
            // Without the native lock a contender mostly loses (it renews, or takes a row
            // whose lease ran out): read first, and write only when the UPDATE could
            // change the row. An UPDATE that changes nothing still takes SQLite's one
            // write lock, and the contender that holds the native lock, writing at the
            // same instant, would find it busy and sleep in SQLite's busy handler (1 ms
            // first), which is most of a handoff's tail. When the UPDATE runs, it decides.
            let row = read(conn)?;
            if let Some(r) = &row
                && r.owner_id.is_some()
                && !unlocked_may_change(r, &self.me, grace)
            {
                return Ok(row);
            }
        }
        let row = attempt(conn)?;
        if row.as_ref().is_some_and(|r| r.owner_id.is_some()) {
            return Ok(row);
        }
        // First use of this mutex, as in `Call::acquire`.
        Prepared {
            sql: &self.insert_owned,
            args: &self.first.args(&self.mutex, &self.me),
        }
        .execute(conn)?;
        let row = read(conn)?;
        if owned_by(&row, &self.me) {
            return Ok(row);
        }
        attempt(conn)
    }
}

/// Whether the acquire `UPDATE` without the native lock ([`Pass::Unlocked`]) would change
/// `row` as read at its `now_ms`: `me` owns it within its lease (a renewal), or its lease
/// is over and it is not a row released less than `grace` ms ago (the `WHERE` of
/// `Statements::acquire_unlocked`). `true` when a column is missing: the `UPDATE` decides.
#[cfg(feature = "sqlite")]
fn unlocked_may_change(row: &OwnerRow, me: &str, grace: i64) -> bool {
    let (Some(owner), Some(transition_at)) = (row.owner_id.as_deref(), row.transition_at) else {
        return true;
    };
    let now = row.now_ms;
    let own = owner == me && transition_at > now;
    let take =
        transition_at <= now && (!owner.is_empty() || transition_at <= now.saturating_sub(grace));
    own || take
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::{OwnerRow, unlocked_may_change};

    fn row(owner: &str, transition_at: i64) -> OwnerRow {
        OwnerRow {
            now_ms: 10_000,
            owner_id: Some(owner.to_owned()),
            acquired_at: Some(1),
            ttl_at: Some(transition_at),
            transition_at: Some(transition_at),
            version: Some(1),
            waiter_id: Some(owner.to_owned()),
        }
    }

    #[test]
    fn an_unlocked_acquire_writes_only_where_its_update_would_change_the_row() {
        let grace = 3_000;
        // Its own row within the lease: a renewal.
        assert!(unlocked_may_change(&row("me", 10_001), "me", grace));
        // Another's row within its lease: nothing to do.
        assert!(!unlocked_may_change(&row("other", 10_001), "me", grace));
        // Another's lease ran out (at now exactly, too): a takeover.
        assert!(unlocked_may_change(&row("other", 10_000), "me", grace));
        // Its own lease ran out: taken again like any other.
        assert!(unlocked_may_change(&row("me", 9_000), "me", grace));
        // Released less than the grace ago: the native lock's holder's.
        assert!(!unlocked_may_change(&row("", 9_000), "me", grace));
        // Released the grace ago or more: anyone's.
        assert!(unlocked_may_change(&row("", 7_000), "me", grace));
        // A column missing: the UPDATE decides.
        let mut missing = row("other", 10_001);
        missing.transition_at = None;
        assert!(unlocked_may_change(&missing, "me", grace));
    }
}
