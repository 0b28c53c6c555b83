//! The expiry queue of a store's gates: when the ownerships held here end unless renewed.

use super::*;

/// An ownership's place in the expiry queue: its end, and a sequence number that tells
/// two ends at the same instant apart.
pub(super) type ExpiryKey = (Instant, u64);

/// The expiry queue of a store's gates: the ends of the local ownerships ([`State::owner_until`]),
/// earliest first, served by one task ([`Gates::expiry_task`]) that runs while the queue
/// holds an entry. An ownership costs an entry (its key and its gate), and a renewal moves
/// it: no task and no spawn per owned mutex or per renewal.
#[derive(Default)]
pub(super) struct Expiries {
    queue: StdMutex<ExpiryQueue>,
    /// Signalled when an entry earlier than every other is queued (the task sleeps until
    /// the earliest entry).
    sooner: Arc<tokio::sync::Notify>,
}

#[derive(Default)]
pub(super) struct ExpiryQueue {
    pub(super) due: BTreeMap<ExpiryKey, Arc<Gate>>,
    next: u64,
    /// The task runs (it ends when the queue is empty).
    pub(super) running: bool,
}

impl Expiries {
    pub(super) fn lock(&self) -> MutexGuard<'_, ExpiryQueue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `key` out of the queue (the ownership was renewed, released or lost).
    pub(super) fn remove(&self, key: ExpiryKey) {
        let removed = self.lock().due.remove(&key);
        // The gate's last reference may go here: outside the queue's lock.
        drop(removed);
    }
}

impl Gates {
    /// Queues the end of `gate`'s ownership at `until` (in place of `old`, its earlier end),
    /// starting the expiry task if it does not run, and returns the entry's key. Called
    /// with the gate's state locked (the queue's lock is taken inside it, never the other
    /// way round).
    pub(super) fn schedule(
        self: &Arc<Self>,
        gate: &Arc<Gate>,
        until: Instant,
        old: Option<ExpiryKey>,
    ) -> ExpiryKey {
        let mut q = self.expiries.lock();
        let replaced = old.and_then(|k| q.due.remove(&k));
        let key = (until, q.next);
        q.next = q.next.wrapping_add(1);
        let sooner = q
            .due
            .first_key_value()
            .is_none_or(|(first, _)| key < *first);
        q.due.insert(key, gate.clone());
        if !q.running {
            q.running = true;
            tokio::spawn(Self::expiry_task(
                Arc::downgrade(self),
                self.expiries.sooner.clone(),
            ));
        } else if sooner {
            self.expiries.sooner.notify_one();
        }
        drop(q);
        drop(replaced);
        key
    }

    /// The expiry task: ends every queued ownership whose end has come ([`Gates::expire`]),
    /// sleeps until the next one (or until a sooner one is queued), and ends when the
    /// queue is empty or the store is gone.
    pub(super) async fn expiry_task(this: Weak<Self>, sooner: Arc<tokio::sync::Notify>) {
        enum Then {
            Sleep(Instant),
            Again,
        }
        loop {
            let then = {
                let Some(gates) = this.upgrade() else {
                    return;
                };
                let now = Instant::now();
                let mut due = Vec::new();
                let then = {
                    let mut q = gates.expiries.lock();
                    while let Some(entry) = q.due.first_entry() {
                        if entry.key().0 > now {
                            break;
                        }
                        let key = *entry.key();
                        due.push((key, entry.remove()));
                    }
                    match q.due.first_key_value() {
                        Some((first, _)) => Then::Sleep(first.0),
                        // The expiries below may queue more: look again after them.
                        None if !due.is_empty() => Then::Again,
                        None => {
                            q.running = false;
                            return;
                        }
                    }
                };
                // Outside the queue's lock: `expire` locks the gate, and the gate's
                // holders take the queue's lock inside the gate's.
                for (key, gate) in due {
                    gates.expire(&gate, key);
                }
                then
            };
            // Asleep, the task holds no reference to the store.
            if let Then::Sleep(at) = then {
                tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    () = sooner.notified() => {}
                }
            }
        }
    }

    /// The ownership of `id` was not renewed by `until`: its engine has given it up by
    /// now, so the native lock goes on as after a release (an owner that comes back
    /// contends anew).
    pub(super) fn expire(self: &Arc<Self>, gate: &Arc<Gate>, key: ExpiryKey) {
        let mut s = gate.lock();
        if s.expiry != Some(key) {
            // Renewed, released or lost since it was taken out of the queue.
            return;
        }
        let Some(id) = s.owner.clone() else {
            s.expiry = None;
            return;
        };
        let id = id.as_str();
        if s.is(&s.calling, id) && s.held.is_some() && s.granted.is_none() {
            // A call of the owner is in flight, and may renew the row (or take it, with
            // the lock) after this instant: unlocking now would let another process take
            // the lock, and with it (on SQLite) the row of a live owner. The lock stays
            // with the contender as a grant; its call's outcome makes it owner again, or
            // its release or leave lets the lock go.
            debug!(mutex = %gate.mutex, "local ownership ran out with a call in flight; keeping the native lock for it");
            s.owner = None;
            s.owner_until = None;
            s.expiry = None;
            s.calling = None;
            s.granted = Some(id.to_owned());
            return;
        }
        debug!(mutex = %gate.mutex, "local ownership ran out unrenewed; passing the native lock on");
        s.owner = None;
        s.owner_until = None;
        s.expiry = None;
        if s.held.is_some() && s.granted.is_none() && !s.busy {
            drop(self.unlock(gate, &mut s));
        }
    }
}
