//! The store contracts over the table: [`LeaseStore`] for mutexes, [`PermitStore`] for
//! semaphores (the permits table, `super::permits`).

use super::*;

/// The id of the row's owner if it took the row outside simba (its id is not the one simba
/// writes beside its own ownerships, `waiter_id`), and is not a hold.
pub(super) fn foreign_owner(row: &OwnerRow) -> Option<String> {
    let owner = row.owner_id.as_deref()?.trim_end_matches(' ');
    let marked = row.waiter_id.as_deref().map(|w| w.trim_end_matches(' '));
    (!owner.is_empty() && !owner.starts_with(simba_core::HELD_PREFIX) && marked != Some(owner))
        .then(|| owner.to_owned())
}

/// Reads `mutex`'s row while `owner` holds it and a local contender waits, and wakes one
/// waiter once `owner` no longer owns it (the one holding the native lock, else the first
/// queued). Two kinds of owner are watched:
///
/// - a foreign owner (every [`SqlConfig::foreign_poll`]): a JVM Simba contender, which
///   takes and releases the row outside simba's native queue; the waiter woken may take a
///   row the JVM library released without the lock (such a release leaves
///   `transition_at = 0`, past any grace);
/// - any owner in another process when nothing tells this store of a release
///   ([`Dialect::polls_owner`]: PostgreSQL behind a transaction pooler without a direct
///   URL), first after the shorter interval, then twice as long each time up to the longer.
///
/// One watcher per mutex and store; it ends with that ownership, when nobody here waits
/// any more, or with the store.
pub(super) fn watch_owner(inner: &Arc<Inner>, mutex: &str, owner: String, every: Every) {
    {
        let mut watched = inner.foreign.lock().unwrap_or_else(|p| p.into_inner());
        if !watched.insert(mutex.to_owned()) {
            return;
        }
    }
    debug!(
        mutex,
        owner, "an owner whose release nothing announces: reading its row until it goes"
    );
    let weak = Arc::downgrade(inner);
    let mutex = mutex.to_owned();
    tokio::spawn(async move {
        let mut pause = None;
        loop {
            let Some(next) = weak.upgrade().map(|i| every.pause(pause, &i.config)) else {
                return;
            };
            pause = Some(next);
            tokio::time::sleep(next).await;
            let Some(inner) = weak.upgrade() else {
                return;
            };
            if !inner.gates.waiting(&mutex) {
                break;
            }
            let call = inner.call(&mutex);
            let read = run!(&inner, format!("read owner of mutex {mutex:?}"), |c| call
                .select(c));
            let gone = match read.and_then(|row| inner.reply(row, None)) {
                Ok(r) => r.owner.owner_id != owner,
                // Try again at the next tick (the waiter's own schedule still runs).
                Err(_) => false,
            };
            if gone {
                // The waiter here, and a wait beyond the native-wait cap (which then
                // tries the lock now rather than at its next poll).
                inner.gates.wake_one(&mutex);
                inner.gates.poke(&mutex);
                break;
            }
        }
        if let Some(inner) = weak.upgrade() {
            inner
                .foreign
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&mutex);
        }
    });
}

/// How often [`watch_owner`] reads the row.
#[derive(Debug, Clone, Copy)]
pub(super) enum Every {
    /// [`SqlConfig::foreign_poll`], read anew each time.
    Foreign,
    /// From the first interval, doubling, up to the second.
    Rising(Duration, Duration),
}

impl Every {
    /// The pause before the next read, `last` the one before the last read.
    fn pause(self, last: Option<Duration>, config: &SqlConfig) -> Duration {
        match self {
            Every::Foreign => config.foreign_poll(),
            Every::Rising(min, max) => last.map_or(min, |l| l.saturating_mul(2).min(max)),
        }
    }
}

/// How long a contender waits before it looks again at a row that a running job keeps
/// past its owner's lease (at most; the lease's ttl when shorter). The job's end frees
/// the native lock too, which wakes a queued contender at once: this is the fallback.
pub(super) const JOB_LOOK_MS: i64 = 1_000;

/// Whether `row` is the row of an owner other than `me` whose lease has run out: a row
/// that a running job of that owner may keep (SQLite, `Statements::file_marks`).
pub(super) fn past_lease_of_another(row: &OwnerRow, me: &str) -> bool {
    row.owner_id
        .as_deref()
        .is_some_and(|o| !o.is_empty() && o != me)
        && row.transition_at.is_some_and(|t| t <= row.now_ms)
}

/// SQLite: such a row ([`past_lease_of_another`]), read while the owner's job runs (the
/// acquire statements left it), is shown as that owner's for `look_ms` more, not as
/// free: a contender then waits instead of trying again at once, and observers (`simba
/// owner`, `watch`) name who keeps it.
pub(super) fn keep_for_job(row: &mut Option<OwnerRow>, me: &str, look_ms: i64) {
    if let Some(r) = row.as_mut().filter(|r| past_lease_of_another(r, me)) {
        let until = r.now_ms.saturating_add(look_ms.max(1));
        r.ttl_at = Some(until);
        r.transition_at = Some(until);
    }
}

impl LeaseStore for SqlStore {
    fn backend(&self) -> &'static str {
        self.inner.kind.name()
    }

    /// At most [`SqlConfig::with_max_name_len`] characters (the `mutex` column).
    fn check_mutex_name(&self, mutex: &str) -> Result<()> {
        self.inner.check_name(mutex)
    }

    /// At most [`OWNER_COLUMN_LEN`](crate::OWNER_COLUMN_LEN) characters (the `owner_id` column), or
    /// the width of a narrower one less 6 (a JVM Simba table; see [`SqlStore::migrate`]).
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        self.inner.check_contender(contender_id)
    }

    /// # Cancel safety
    /// Dropping the future may leave the acquisition applied or not (the connection is then
    /// closed); acquiring again is idempotent for the same contender.
    async fn acquire(&self, mutex: &str, contender_id: &str, lease: Lease) -> Result<LeaseReply> {
        // Boxed: the statement futures of three dialects take about 4.5 KB, and a
        // contender's driver future would hold that much for its whole life (10,000
        // contenders: 45 MB); boxed, only calls in flight use it.
        Box::pin(async move {
            let inner = &*self.inner;
            let call = inner.start(mutex, Some(contender_id))?;
            #[cfg(feature = "sqlite")]
            let job = inner.check_db_file(false, Some(mutex))?;
            #[cfg(not(feature = "sqlite"))]
            let job: Option<i64> = None;
            let pass = inner.gates.enter(mutex, contender_id).await;
            #[cfg(feature = "bench")]
            simba_core::hops::record(simba_core::hops::Hop::StatementSent, mutex);
            let mut row: Option<OwnerRow> = run_fast!(
                inner,
                format!("acquire mutex {mutex:?}"),
                |c| call.acquire(c, contender_id, lease, pass, job)
            )?;
            #[cfg(feature = "bench")]
            simba_core::hops::record(simba_core::hops::Hop::StatementAnswered, mutex);
            if job.is_some() {
                keep_for_job(&mut row, contender_id, JOB_LOOK_MS.min(lease.ttl_ms()));
            }
            let grace = match pass {
                Pass::Locked(_) => None,
                Pass::Unlocked => Some(lease.ttl_ms().saturating_add(lease.transition_ms())),
            };
            let foreign = row.as_ref().and_then(foreign_owner);
            let reply = inner.reply(row, grace)?;
            let owns = reply.owner.is_owned_by_at(contender_id, reply.now);
            // Until the whole lease from the answer (see `Gates::outcome`).
            let answered = tokio::time::Instant::now();
            let new = inner
                .gates
                .outcome(mutex, contender_id, owns, answered + lease.total());
            if new {
                // Observers hear of a new owner (not of an owner's acquire that renews).
                inner
                    .dialect
                    .notify(|| notify_acquired(mutex, contender_id));
            }
            if let Some(foreign) = foreign
                && !owns
                && reply.owner.owner_id == foreign
            {
                watch_owner(&self.inner, mutex, foreign, Every::Foreign);
            } else if let Some((min, max)) = inner.dialect.polls_owner()
                && !owns
                && !reply.owner.owner_id.is_empty()
            {
                let owner = reply.owner.owner_id.clone();
                watch_owner(&self.inner, mutex, owner, Every::Rising(min, max));
            }
            // SQLite stores any integer whatever the declared type: a narrow `version` is
            // checked here (MySQL and PostgreSQL refuse the write themselves).
            let max = inner.table().fence_max;
            if owns && i64::try_from(reply.owner.fence).unwrap_or(i64::MAX) > max {
                let _ = self.release(mutex, contender_id).await;
                return Err(permanent(
                    inner.kind.name(),
                    format!(
                        "acquire mutex {mutex:?}: the fence {} is past the largest value of \
                         the `version` column of {} ({max}); widen the column",
                        reply.owner.fence,
                        inner.config.table()
                    ),
                ));
            }
            Ok(reply)
        })
        .await
    }

    /// Renews only: never takes a mutex that `contender_id` does not own within its lease.
    /// Concurrent renewals of this store share statements: one `UPDATE` renews every
    /// ownership whose call waits, and each call gets its own row's answer (see the crate
    /// README, *Renewals in batches*).
    ///
    /// # Cancel safety
    /// Dropping the future may leave the renewal applied or not; a renewal changes nothing
    /// but the lease of a row the contender owns.
    async fn guard(&self, mutex: &str, contender_id: &str, lease: Lease) -> Result<LeaseReply> {
        self.inner.start(mutex, Some(contender_id))?;
        renew::Renewals::renew(&self.inner, mutex, contender_id, lease).await
    }

    async fn release(&self, mutex: &str, contender_id: &str) -> Result<bool> {
        // Boxed, as `acquire`.
        Box::pin(async move {
            let inner = &*self.inner;
            let call = inner.start(mutex, Some(contender_id))?;
            let released = run_fast!(inner, format!("release mutex {mutex:?}"), |c| call
                .release(c, contender_id));
            if matches!(released, Ok(true)) {
                inner
                    .dialect
                    .notify(|| notify_released(mutex, contender_id));
            }
            // The row first, then the native lock: the waiter it wakes finds the row free.
            // On failure too: the engine releases only what it no longer believes it owns.
            inner.gates.done(mutex, contender_id, false).await;
            released
        })
        .await
    }

    /// One conditional UPDATE on the database clock (see [`LeaseStore::release_after`]).
    async fn release_after(&self, mutex: &str, contender_id: &str, hold: Duration) -> Result<bool> {
        // Boxed, as `acquire`.
        Box::pin(async move {
            let inner = &*self.inner;
            let call = inner.start(mutex, Some(contender_id))?;
            let ms = hold_millis(hold)?;
            if ms == 0 {
                return self.release(mutex, contender_id).await;
            }
            let held = run!(inner, format!("release mutex {mutex:?} with a hold"), |c| {
                call.release_after(c, contender_id, ms)
            });
            // Observers hear of the hold as of a new owner (the hold's id).
            if matches!(held, Ok(true)) {
                inner.dialect.notify(|| {
                    notify_acquired(mutex, &simba_core::backend::held_owner_id(contender_id))
                });
            }
            // The next waiter gets the native lock, finds the row held, and waits for the
            // hold's end on the lease clock.
            inner.gates.done(mutex, contender_id, false).await;
            held
        })
        .await
    }

    async fn owner(&self, mutex: &str) -> Result<LeaseReply> {
        // Boxed, as `acquire`.
        Box::pin(async move {
            let inner = &*self.inner;
            let call = inner.start(mutex, None)?;
            let mut row: Option<OwnerRow> =
                run!(inner, format!("read owner of mutex {mutex:?}"), |c| call
                    .select(c))?;
            // SQLite: an owner whose lease ran out while its `simba exec` job still runs
            // keeps the mutex (nobody may take it): shown as the owner, not as free. The
            // job byte is probed only for such a row.
            if row.as_ref().is_some_and(|r| past_lease_of_another(r, ""))
                && inner.job_runs(mutex)?
            {
                keep_for_job(&mut row, "", JOB_LOOK_MS);
            }
            inner.reply(row, None)
        })
        .await
    }

    /// Takes the contender out of the mutex's wait queue: its place in the local queue,
    /// and the native lock if it had been handed to it.
    async fn leave(&self, mutex: &str, contender_id: &str) -> Result<()> {
        let inner = &*self.inner;
        inner.start(mutex, Some(contender_id))?;
        inner.gates.done(mutex, contender_id, true).await;
        Ok(())
    }

    /// Every backend pushes to contenders: a contender that waits is woken with
    /// [`StoreEvent::Released`](simba_core::backend::StoreEvent::Released) when the database (or, on SQLite, the kernel) hands its
    /// process the mutex's native lock, and gets [`StoreEvent::Resync`](simba_core::backend::StoreEvent::Resync) when waiting
    /// failed (a lost session). On PostgreSQL a subscriber that does not contend (an
    /// observer) hears every change by LISTEN/NOTIFY; on MySQL and SQLite an observer gets
    /// `None` (the engine reads on its schedule). A contender is one that called
    /// [`LeaseStore::acquire`] on this store and has not released or left since.
    async fn subscribe(&self, mutex: &str, contender_id: &str) -> Result<Option<EventReceiver>> {
        self.inner.check_name(mutex)?;
        let observers_hear = self.dialect().observers_hear();
        if !observers_hear && !self.inner.gates.contends(mutex, contender_id) {
            // An observer on MySQL / SQLite: nothing tells it of other processes'
            // changes, so the engine reads on its own schedule.
            return Ok(None);
        }
        let (rx, tx, contending) = self.inner.gates.subscribe(mutex, contender_id);
        self.dialect().listen(mutex, contender_id, &tx, &contending);
        drop((tx, contending));
        Ok(Some(rx))
    }
}

impl PermitStore for SqlStore {
    fn backend(&self) -> &'static str {
        self.inner.kind.name()
    }

    fn permit_claim(&self) -> Option<Duration> {
        let ms = crate::store::permits::claim_ms(self.inner.dialect.pushes_permits());
        Some(Duration::from_millis(ms.unsigned_abs()))
    }

    /// At most [`SqlConfig::with_max_name_len`] characters (the `semaphore` column holds as
    /// much).
    fn check_semaphore_name(&self, semaphore: &str) -> Result<()> {
        self.inner.check_name(semaphore)
    }

    /// As [`LeaseStore::check_contender_id`].
    fn check_contender_id(&self, contender_id: &str) -> Result<()> {
        self.inner.check_contender(contender_id)
    }

    /// One transaction on the permits table (see the crate README, *Semaphores*).
    ///
    /// # Cancel safety
    /// The transaction runs in a task of its own and ends (commit or rollback) even when
    /// the future is dropped; acquiring again is idempotent for the same contender.
    async fn permit_acquire(
        &self,
        semaphore: &str,
        contender_id: &str,
        permits: u32,
        lease: Lease,
    ) -> Result<LeaseReply> {
        Box::pin(
            self.permit_ops()
                .acquire(semaphore, contender_id, permits, lease),
        )
        .await
    }

    /// Renews only, in one statement on the database clock.
    async fn permit_guard(
        &self,
        semaphore: &str,
        contender_id: &str,
        _permits: u32,
        lease: Lease,
    ) -> Result<LeaseReply> {
        Box::pin(self.permit_ops().guard(semaphore, contender_id, lease)).await
    }

    async fn permit_release(&self, semaphore: &str, contender_id: &str) -> Result<bool> {
        Box::pin(self.permit_ops().release(semaphore, contender_id)).await
    }

    async fn permit_owners(&self, semaphore: &str) -> Result<simba_core::backend::PermitHolders> {
        Box::pin(self.permit_ops().owners(semaphore)).await
    }

    /// Waiters of this store are woken by its releases; others look again every
    /// [`PERMIT_POLL`] at most.
    async fn permit_subscribe(
        &self,
        semaphore: &str,
        contender_id: &str,
    ) -> Result<Option<EventReceiver>> {
        self.permit_ops().subscribe(semaphore, contender_id)
    }

    async fn permit_leave(&self, semaphore: &str, contender_id: &str) -> Result<()> {
        Box::pin(self.permit_ops().leave(semaphore, contender_id)).await
    }
}
