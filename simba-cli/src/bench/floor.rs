//! Floors: the bare backend operations every figure is compared to, measured in the same
//! run on the same kind of connection.

use std::time::Duration;

use tokio::time::Instant;

use super::stats::Samples;
use crate::backend::Native;

/// How long one floor probe may take before the floor is given up.
const PROBE_LIMIT: Duration = Duration::from_secs(5);

/// The floors of one backend.
#[derive(Debug, Default)]
pub(crate) struct Floors {
    /// What one round trip is (`PING`, `SELECT 1`, `exists`).
    pub(crate) rtt_what: &'static str,
    /// One bare round trip.
    pub(crate) rtt: Samples,
    /// Redis: `PUBLISH` on the command connection until delivered on the subscriber one.
    pub(crate) pubsub: Option<Samples>,
    /// Redis: `SET NX PX` + `DEL`.
    pub(crate) raw_lock: Option<Samples>,
}

/// Measures `n` samples of each floor of `native` (after a warm-up).
pub(crate) async fn measure(native: &Native, n: usize, run: &str) -> anyhow::Result<Floors> {
    let warm = warm_up(n);
    #[allow(unreachable_patterns, unused_variables)]
    match native {
        #[cfg(feature = "redis")]
        Native::Redis(store) => {
            let rtt = sample(n, move || async move { store.ping().await }).await?;
            let key = format!("{run}-raw-lock");
            let key = key.as_str();
            let raw_lock = sample(n, move || async move {
                store.raw_lock(key, Duration::from_secs(10)).await.map(drop)
            })
            .await?;
            let mut probe = store.pubsub_probe(&format!("{run}-pubsub")).await?;
            let mut pubsub = Samples::with_capacity(n);
            for i in 0..warm + n {
                let t0 = Instant::now();
                probe.round_trip(PROBE_LIMIT).await?;
                if i >= warm {
                    pubsub.push(t0.elapsed());
                }
            }
            Ok(Floors {
                rtt_what: "PING",
                rtt,
                pubsub: Some(pubsub),
                raw_lock: Some(raw_lock),
            })
        }
        #[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
        Native::Sql(store) => {
            let mut probe = store.probe().await?;
            let mut rtt = Samples::with_capacity(n);
            for i in 0..warm + n {
                let t0 = Instant::now();
                probe.select_one().await?;
                if i >= warm {
                    rtt.push(t0.elapsed());
                }
            }
            Ok(Floors {
                rtt_what: "SELECT 1",
                rtt,
                ..Floors::default()
            })
        }
        #[cfg(feature = "zookeeper")]
        Native::Zookeeper(factory) => {
            let probe = simba_zookeeper::floor::ZkProbe::connect(factory.config()).await?;
            let p = &probe;
            let rtt = sample(n, move || async move { p.exists(PROBE_LIMIT).await }).await?;
            probe.close().await?;
            Ok(Floors {
                rtt_what: "exists",
                rtt,
                ..Floors::default()
            })
        }
        _ => anyhow::bail!("no floor for this backend"),
    }
}

/// Times `n` calls of `op` after a warm-up.
async fn sample<F, Fut>(n: usize, mut op: F) -> anyhow::Result<Samples>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = simba_core::Result<()>>,
{
    let warm = warm_up(n);
    let mut samples = Samples::with_capacity(n);
    for i in 0..warm + n {
        let t0 = Instant::now();
        op().await?;
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
