//! The `memory` floor: the engine alone over a [`MemoryStore`] (no network, no server),
//! uncontended and handoff, beside a bare tokio task-to-task wake-up measured in the same
//! run. What a backend figure costs above its network floors, the engine costs here.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;
use simba_core::{ContendServiceFactory, LeaseConfig, LeaseServiceFactory, Locker, MemoryStore};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::handoff::{self, Contended};
use super::stats::Samples;
use super::{Ctx, Row, Section, num, ratio, us};

/// Bound of one acquisition over memory (nothing can be slow but the machine).
const ACQUIRE_LIMIT: Duration = Duration::from_secs(30);

/// What the memory floor measured, for the other scenarios to compare with.
pub(crate) struct MemoryFloor {
    /// One tokio task waking another (`mpsc` send → the receiving task runs).
    pub(crate) wake: Samples,
    /// The engine's acquire + release over memory.
    pub(crate) uncontended: Samples,
    /// The engine's handoff over memory. Its figure is `from_call` (release called → next
    /// acquire returned): over memory the next owner has the mutex before the releaser's
    /// `release()` returns, so release returned → next acquire returned is negative.
    pub(crate) handoff: Option<Contended>,
}

fn factory(store: &MemoryStore) -> anyhow::Result<Arc<dyn ContendServiceFactory>> {
    Ok(Arc::new(LeaseServiceFactory::new(
        store.clone(),
        LeaseConfig::default(),
    )?))
}

/// Measures `n` tokio wake-ups: a task waiting on a channel is sent the instant of the
/// send, and times its own wake-up; it answers on another channel (not timed).
async fn wake_ups(n: usize) -> anyhow::Result<Samples> {
    let (to_tx, mut to_rx) = mpsc::channel::<Instant>(1);
    let (back_tx, mut back_rx) = mpsc::channel::<Duration>(1);
    let echo = tokio::spawn(async move {
        while let Some(sent) = to_rx.recv().await {
            if back_tx.send(sent.elapsed()).await.is_err() {
                break;
            }
        }
    });
    let warm = super::floor::warm_up(n);
    let mut samples = Samples::with_capacity(n);
    for i in 0..warm + n {
        to_tx
            .send(Instant::now())
            .await
            .context("the wake-up task ended")?;
        let took = back_rx.recv().await.context("the wake-up task ended")?;
        if i >= warm {
            samples.push(took);
        }
    }
    drop(to_tx);
    let _ = echo.await;
    Ok(samples)
}

/// The engine alone: `--iterations` acquire + release cycles through a `Locker` over a
/// `MemoryStore`, and, if `handoff`, `--contenders` contenders (each its own factory over
/// the same store) taking turns with `--hold`.
pub(crate) async fn measure(ctx: &Ctx, handoff: bool) -> anyhow::Result<MemoryFloor> {
    let n = ctx.iterations();
    let wake = wake_ups(n).await?;
    let store = MemoryStore::new();
    let locker = Locker::new(factory(&store)?, &ctx.mutex("memory-uncontended"))?;
    let warm = super::floor::warm_up(n);
    let mut uncontended = Samples::with_capacity(n);
    for i in 0..warm + n {
        let t0 = Instant::now();
        let guard = locker.acquire_timeout(ACQUIRE_LIMIT).await?;
        guard.release().await?;
        if i >= warm {
            uncontended.push(t0.elapsed());
        }
    }
    let handoff = if handoff {
        let mutex = ctx.mutex("memory-handoff");
        let lockers = (0..ctx.args.contenders)
            .map(|_| Ok(Locker::new(factory(&store)?, &mutex)?))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Some(handoff::contend(ctx, lockers).await?)
    } else {
        None
    };
    Ok(MemoryFloor {
        wake,
        uncontended,
        handoff,
    })
}

/// The memory floor as a table section.
pub(crate) fn section(m: &MemoryFloor) -> Section {
    let mut s = Section::default();
    let wake = m.wake.p50();
    s.json.insert("wake_p50_us".into(), num(wake));
    s.json.insert("wake_p99_us".into(), num(m.wake.p99()));
    s.json
        .insert("uncontended_p50_us".into(), num(m.uncontended.p50()));
    s.json
        .insert("uncontended_p99_us".into(), num(m.uncontended.p99()));
    s.rows.push(Row::new(
        "tokio task → task wake-up p50 / p99",
        format!("{} / {}", us(wake), us(m.wake.p99())),
        "mpsc send → the waiting task runs",
    ));
    s.rows.push(Row::new(
        "engine acquire + release p50 / p99",
        format!("{} / {}", us(m.uncontended.p50()), us(m.uncontended.p99())),
        format!(
            "Locker over MemoryStore; {:.1} wake-ups; goal ≤ 10 µs",
            ratio(m.uncontended.p50(), wake).unwrap_or(0.0)
        ),
    ));
    if let Some(h) = &m.handoff {
        let pct = ratio(h.acq_per_s, h.ideal).map(|r| r * 100.0);
        s.json
            .insert("handoff_p50_us".into(), num(h.from_call.p50()));
        s.json
            .insert("handoff_p99_us".into(), num(h.from_call.p99()));
        s.json
            .insert("handoff_from_return_p50_us".into(), num(h.handoff.p50()));
        s.json.insert("handoff_acq_pct_of_ideal".into(), num(pct));
        s.json
            .insert("handoff_overlaps".into(), json!(h.safety.overlaps));
        s.unsafe_ = h.safety.overlaps > 0 || h.safety.fence_regressions > 0;
        s.rows.push(Row::new(
            "engine handoff p50 / p99",
            format!("{} / {}", us(h.from_call.p50()), us(h.from_call.p99())),
            format!(
                "{} contenders over MemoryStore, from release() called (from its return: {}); {:.1} wake-ups; {:.0} % of 1/hold",
                h.contenders,
                us(h.handoff.p50()),
                ratio(h.from_call.p50(), wake).unwrap_or(0.0),
                pct.unwrap_or(0.0)
            ),
        ));
    }
    s
}
