//! How a gate's native lock changes hands: given to the contender first in line, unlocked,
//! waited for on the server (or the kernel), and followed after a cancelled lock-file wait.

use super::*;

impl Gates {
    /// Hands a held, unassigned native lock to the first live local waiter (one wake-up),
    /// or unlocks it when nobody here wants it.
    pub(super) fn assign(self: &Arc<Self>, gate: &Arc<Gate>, s: &mut State) {
        if s.held.is_none() || s.owner.is_some() {
            return;
        }
        if s.granted.is_some() {
            return;
        }
        while let Some(id) = s.queue.pop_front() {
            if s.subs.get(&id).is_some_and(|sub| sub.tx.is_closed()) {
                // A waiter that went away without leaving: skip it.
                s.subs.remove(&id);
                continue;
            }
            self.wake(s, &id);
            s.granted = Some(id);
            return;
        }
        if let Some(task) = self.unlock(gate, s) {
            drop(task);
        }
    }

    pub(super) fn wake(&self, s: &State, id: &str) {
        if let Some(sub) = s.subs.get(id) {
            let _ = sub.tx.try_send(StoreEvent::Released);
        }
    }

    /// Unlocks a held native lock in a task of its own; afterwards, queues on the server
    /// again if anyone here still waits.
    pub(super) fn unlock(
        self: &Arc<Self>,
        gate: &Arc<Gate>,
        s: &mut State,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let held = s.held.take()?;
        s.busy = true;
        let this = self.clone();
        let gate = gate.clone();
        Some(tokio::spawn(async move {
            if let Err(e) = this.locks.unlock(&gate.key, held).await {
                // The session is closed instead, which frees the lock on the server.
                debug!(mutex = %gate.mutex, "native unlock failed, its session was closed: {e}");
            }
            let mut s = gate.lock();
            s.busy = false;
            this.start_wait(&gate, &mut s);
            drop(s);
            this.tidy(&gate);
        }))
    }

    /// Starts a blocking wait for the native lock, if a contender here waits and nothing
    /// holds or changes it.
    pub(super) fn start_wait(self: &Arc<Self>, gate: &Arc<Gate>, s: &mut State) {
        if s.busy || s.held.is_some() || s.queue.is_empty() {
            return;
        }
        s.busy = true;
        let pause = if s.failures == 0 {
            Duration::ZERO
        } else {
            (RETRY_MIN * 2u32.saturating_pow(s.failures.min(5) - 1)).min(RETRY_MAX)
        };
        let this = self.clone();
        let task_gate = gate.clone();
        let (cancel, mut cancelled) = oneshot::channel();
        let task = tokio::spawn(async move {
            if !pause.is_zero() {
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    _ = &mut cancelled => {}
                }
            }
            let got = this
                .locks
                .wait(&task_gate.key, cancelled, &task_gate.poke)
                .await;
            let mut s = task_gate.lock();
            s.busy = false;
            s.wait = None;
            match got {
                Ok(Waited::Got(held)) => {
                    s.failures = 0;
                    s.held = Some(held);
                    this.assign(&task_gate, &mut s);
                }
                Ok(Waited::Lingering(blocking, slot)) => {
                    s.lingering = true;
                    this.linger(&task_gate, blocking, slot);
                }
                Ok(Waited::GaveUp) => {
                    // Given up (nobody here waited any more); whoever queued since waits anew.
                    this.start_wait(&task_gate, &mut s);
                }
                Err(e) => {
                    s.failures = s.failures.saturating_add(1);
                    if s.failures == 1 {
                        warn!(mutex = %task_gate.mutex, "waiting for the native lock failed (waiters fall back to the lease until it works again): {e}");
                    }
                    // Whatever happened meanwhile was not heard: everyone here looks again.
                    for sub in s.subs.values() {
                        let _ = sub.tx.try_send(StoreEvent::Resync);
                    }
                    this.start_wait(&task_gate, &mut s);
                }
            }
        });
        s.wait = Some(Wait { cancel, task });
    }

    /// Follows a cancelled lock-file wait that still blocks (`State::lingering`) until it
    /// returns: the lock it then holds goes to whoever here wants it (`assign`); when
    /// nobody does, or the gate holds or is changing the lock meanwhile, it is dropped
    /// (unlocked) at once.
    pub(super) fn linger(
        self: &Arc<Self>,
        gate: &Arc<Gate>,
        blocking: JoinHandle<Result<FileLock, crate::lock_error::LockError>>,
        slot: WaitSlot,
    ) {
        let this = self.clone();
        let gate = gate.clone();
        tokio::spawn(async move {
            let got = blocking.await;
            // Its thread is free: so is its place under the cap.
            drop(slot);
            {
                let mut s = gate.lock();
                s.lingering = false;
                match got {
                    Ok(Ok(file)) if s.held.is_none() && !s.busy && s.wants() => {
                        s.held = Some(Held::File(file));
                        this.assign(&gate, &mut s);
                    }
                    // Unlocked here and now (closing the file), not in an unlock task: a
                    // try right after must not find the gate busy with it.
                    Ok(Ok(file)) => drop(file),
                    Ok(Err(e)) => {
                        debug!(mutex = %gate.mutex, "a cancelled lock-file wait failed: {e}")
                    }
                    Err(e) => debug!(mutex = %gate.mutex, "a cancelled lock-file wait's task: {e}"),
                }
                // Whoever queued meanwhile and got nothing waits on the file again.
                this.start_wait(&gate, &mut s);
            }
            gate.lingered.notify_waiters();
            this.tidy(&gate);
        });
    }
}
