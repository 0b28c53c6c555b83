//! Floors: the bare backend operations every figure is compared to, measured in the same
//! run on the same kind of connection.

use std::time::Duration;

use simba_core::connect::{Connection, Floor, Probe};
use tokio::time::Instant;

use super::stats::Samples;

/// How long one floor probe may take before the floor is given up.
const PROBE_LIMIT: Duration = Duration::from_secs(5);

/// The floors of one backend.
#[derive(Debug)]
pub(crate) struct Floors {
    /// What one round trip is (`PING`, `SELECT 1`, `exists`).
    pub(crate) rtt_what: &'static str,
    /// One bare round trip.
    pub(crate) rtt: Samples,
    /// Where the backend has pub/sub (Redis): a message published on the command
    /// connection until delivered on the subscriber one.
    pub(crate) pubsub: Option<Samples>,
    /// Where the backend has a script-less lock (Redis: `SET NX PX` + `DEL`).
    pub(crate) raw_lock: Option<Samples>,
    /// Where the backend has a wait queue of its own: two sessions handing its lock over,
    /// from the release answered to the waiter's lock answered.
    pub(crate) handoff: Option<Samples>,
    /// What [`handoff`](Floors::handoff) is.
    pub(crate) handoff_what: &'static str,
    /// SQL, with `--explain`: the store's acquisition statement alone (no engine, no
    /// gate), a change of owner committed each time.
    pub(crate) acquisition: Option<Samples>,
    /// The engine alone (over `MemoryStore`): acquire + release p50, µs.
    pub(crate) engine_uncontended: Option<f64>,
    /// The engine alone (over `MemoryStore`): handoff p50 from `release()` called, µs.
    pub(crate) engine_handoff: Option<f64>,
    /// The server's durability settings as it reported them (`Probe::durability`; empty:
    /// the backend reports none), or why they could not be read.
    pub(crate) durability: Result<Vec<(String, String)>, String>,
}

impl Default for Floors {
    fn default() -> Self {
        Floors {
            rtt_what: "",
            rtt: Samples::default(),
            pubsub: None,
            raw_lock: None,
            handoff: None,
            handoff_what: "",
            acquisition: None,
            engine_uncontended: None,
            engine_handoff: None,
            durability: Ok(Vec::new()),
        }
    }
}

impl Floors {
    /// The handoff floor's p50 and what it is: the native handoff where measured, else
    /// (Redis) a pub/sub delivery plus one round trip.
    pub(crate) fn handoff_floor(&self) -> Option<(f64, &'static str)> {
        if let Some(p) = self.handoff.as_ref().and_then(Samples::p50) {
            return Some((p, self.handoff_what));
        }
        let pubsub = self.pubsub.as_ref().and_then(Samples::p50)?;
        Some((pubsub + self.rtt.p50()?, "pub/sub delivery + round trip"))
    }
}

/// Measures `n` samples of each floor the backend's probe offers (after a warm-up).
pub(crate) async fn measure(conn: &dyn Connection, n: usize, run: &str) -> anyhow::Result<Floors> {
    let mut probe = conn.probe(run).await?;
    let mut floors = Floors {
        rtt_what: probe.round_trip_name(),
        ..Floors::default()
    };
    // What a commit waits for on this server, read first: a failure to read it is shown
    // in its row, not a failure of the floors.
    floors.durability = probe.durability().await.map_err(|e| e.to_string());
    // Every floor, then close the probe whatever happened: the first failure is reported.
    let measured = async {
        for floor in probe.floors() {
            if floor == Floor::Handoff {
                floors.handoff_what = probe.handoff_name();
                floors.handoff = Some(sample_handoff(probe.as_mut(), n).await?);
                continue;
            }
            let samples = sample(probe.as_mut(), floor, n).await?;
            match floor {
                Floor::RoundTrip => floors.rtt = samples,
                Floor::PubSub => floors.pubsub = Some(samples),
                Floor::RawLock => floors.raw_lock = Some(samples),
                Floor::Handoff => {}
            }
        }
        anyhow::Ok(())
    }
    .await;
    probe.close().await?;
    measured.map(|()| floors)
}

/// Times `n` measurements of `floor` after a warm-up.
async fn sample(probe: &mut dyn Probe, floor: Floor, n: usize) -> anyhow::Result<Samples> {
    let warm = warm_up(n);
    let mut samples = Samples::with_capacity(n);
    for i in 0..warm + n {
        let t0 = Instant::now();
        probe.measure(floor, PROBE_LIMIT).await?;
        if i >= warm {
            samples.push(t0.elapsed());
        }
    }
    Ok(samples)
}

/// Warm-up rounds before `n` measured ones.
pub(crate) fn warm_up(n: usize) -> usize {
    (n / 10).clamp(1, 200)
}

/// `n` handoffs of the backend's own lock after a warm-up (each times itself: the setup of
/// a handoff is not part of it).
async fn sample_handoff(probe: &mut dyn Probe, n: usize) -> anyhow::Result<Samples> {
    let mut samples = Samples::with_capacity(n);
    for i in 0..warm_up(n) + n {
        let took = probe.handoff(PROBE_LIMIT).await?;
        if i >= warm_up(n) {
            samples.push(took);
        }
    }
    Ok(samples)
}

/// The SQL backends' handoff floor (PostgreSQL `pg_advisory_lock`, MySQL/MariaDB
/// `GET_LOCK`, SQLite an OFD lock), on connections of its own to `url`.
#[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
pub(crate) async fn sql_handoff(
    url: &str,
    n: usize,
    run: &str,
) -> anyhow::Result<(&'static str, Samples)> {
    // The connector's options (`simba_table`, …) are not the driver's.
    let config = simba_jdbc::SqlConnector::config(url)?;
    let store = simba_jdbc::SqlStore::connect_lazy(config)?;
    let mut probe = store.handoff_probe(run).await?;
    let mut samples = Samples::with_capacity(n);
    for i in 0..warm_up(n) + n {
        let took = probe.handoff(PROBE_LIMIT).await?;
        if i >= warm_up(n) {
            samples.push(took);
        }
    }
    let what = probe.name();
    Ok((what, samples))
}

/// The SQL backends' acquisition statement alone: `n` acquisitions of a mutex of this run
/// that two contenders take from one another, each after the other's release, on the
/// store's own connection path and without the engine (see
/// `simba_jdbc::SqlStore::acquisition_floor`), on a store of its own to `url`.
#[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
pub(crate) async fn sql_acquisition(url: &str, n: usize, mutex: &str) -> anyhow::Result<Samples> {
    let config = simba_jdbc::SqlConnector::config(url)?;
    let store = simba_jdbc::SqlStore::connect_lazy(config)?;
    // The migration reads the table's shape and the server's version, which choose the
    // statement (MariaDB's one statement, a narrow fence).
    store.migrate().await?;
    let d = simba_core::LeaseConfig::default();
    let lease = simba_core::backend::Lease {
        ttl: d.ttl,
        transition: d.transition,
    };
    let took = store.acquisition_floor(mutex, lease, warm_up(n), n).await?;
    let mut samples = Samples::with_capacity(n);
    for d in took {
        samples.push(d);
    }
    Ok(samples)
}
