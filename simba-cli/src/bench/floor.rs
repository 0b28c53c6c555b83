//! Floors: the bare backend operations every figure is compared to, measured in the same
//! run on the same kind of connection.

use std::time::Duration;

use simba_core::connect::{Connection, Floor, Probe};
use tokio::time::Instant;

use super::stats::Samples;

/// How long one floor probe may take before the floor is given up.
const PROBE_LIMIT: Duration = Duration::from_secs(5);

/// The floors of one backend.
#[derive(Debug, Default)]
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
}

/// Measures `n` samples of each floor the backend's probe offers (after a warm-up).
pub(crate) async fn measure(conn: &dyn Connection, n: usize, run: &str) -> anyhow::Result<Floors> {
    let mut probe = conn.probe(run).await?;
    let mut floors = Floors {
        rtt_what: probe.round_trip_name(),
        ..Floors::default()
    };
    // Every floor, then close the probe whatever happened: the first failure is reported.
    let measured = async {
        for floor in probe.floors() {
            let samples = sample(probe.as_mut(), floor, n).await?;
            match floor {
                Floor::RoundTrip => floors.rtt = samples,
                Floor::PubSub => floors.pubsub = Some(samples),
                Floor::RawLock => floors.raw_lock = Some(samples),
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
