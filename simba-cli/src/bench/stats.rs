//! Percentiles, fairness and the overlap check of `simba bench`.

use std::time::{Duration, Instant};

/// Latency samples in microseconds (signed: a handoff can be observed before the release
/// call returned).
#[derive(Debug, Default, Clone)]
pub(crate) struct Samples(Vec<f64>);

impl Samples {
    pub(crate) fn with_capacity(n: usize) -> Self {
        Samples(Vec::with_capacity(n))
    }

    pub(crate) fn push(&mut self, d: Duration) {
        self.0.push(d.as_secs_f64() * 1e6);
    }

    /// `later - earlier` in µs, negative when `later` is before `earlier`.
    pub(crate) fn push_between(&mut self, earlier: Instant, later: Instant) {
        let us = if later >= earlier {
            (later - earlier).as_secs_f64() * 1e6
        } else {
            -((earlier - later).as_secs_f64() * 1e6)
        };
        self.0.push(us);
    }

    /// A raw value: µs for latencies, a count for counts.
    pub(crate) fn push_value(&mut self, v: f64) {
        self.0.push(v);
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// Adds every sample of `other`.
    pub(crate) fn extend(&mut self, other: &Samples) {
        self.0.extend_from_slice(&other.0);
    }

    /// The `p`-th percentile (nearest rank on the sorted samples); `None` when empty.
    pub(crate) fn percentile(&self, p: f64) -> Option<f64> {
        if self.0.is_empty() {
            return None;
        }
        let mut sorted = self.0.clone();
        sorted.sort_by(f64::total_cmp);
        let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
        Some(sorted[rank.clamp(1, sorted.len()) - 1])
    }

    pub(crate) fn p50(&self) -> Option<f64> {
        self.percentile(50.0)
    }

    pub(crate) fn p99(&self) -> Option<f64> {
        self.percentile(99.0)
    }

    pub(crate) fn max(&self) -> Option<f64> {
        self.percentile(100.0)
    }

    pub(crate) fn mean(&self) -> Option<f64> {
        (!self.0.is_empty()).then(|| self.0.iter().sum::<f64>() / self.0.len() as f64)
    }
}

/// Jain's fairness index of `counts`: 1 when all are equal, 1/n when one got everything.
pub(crate) fn jain(counts: &[u64]) -> Option<f64> {
    let n = counts.len() as f64;
    let sum: f64 = counts.iter().map(|&c| c as f64).sum();
    let squares: f64 = counts.iter().map(|&c| (c as f64) * (c as f64)).sum();
    (squares > 0.0).then(|| sum * sum / (n * squares))
}

/// One ownership as its holder saw it: from `acquire` returning to the call of `release`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ownership {
    pub(crate) contender: usize,
    pub(crate) fence: u64,
    pub(crate) start: Instant,
    pub(crate) end: Instant,
}

/// What the safety check found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Safety {
    /// Ownerships that began before an earlier one ended.
    pub(crate) overlaps: usize,
    /// Ownerships whose fence was not greater than the one before.
    pub(crate) fence_regressions: usize,
}

/// Checks that no two ownerships overlap and that fences increase with time.
pub(crate) fn check(ownerships: &[Ownership]) -> Safety {
    let mut sorted: Vec<&Ownership> = ownerships.iter().collect();
    sorted.sort_by_key(|o| o.start);
    let mut safety = Safety::default();
    let mut latest_end: Option<Instant> = None;
    let mut last_fence: Option<u64> = None;
    for o in sorted {
        if latest_end.is_some_and(|end| o.start < end) {
            safety.overlaps += 1;
        }
        if last_fence.is_some_and(|f| o.fence <= f) {
            safety.fence_regressions += 1;
        }
        latest_end = Some(latest_end.map_or(o.end, |e| e.max(o.end)));
        last_fence = Some(o.fence);
    }
    safety
}

/// The resident set size of this process in MiB (`VmRSS` of `/proc/self/status`).
pub(crate) fn rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let mut s = Samples::default();
        for us in 1..=100 {
            s.push_value(f64::from(us));
        }
        assert_eq!(s.p50(), Some(50.0));
        assert_eq!(s.p99(), Some(99.0));
        assert_eq!(s.max(), Some(100.0));
        assert_eq!(s.percentile(0.0), Some(1.0));
        assert_eq!(Samples::default().p50(), None);
    }

    #[test]
    fn jain_index() {
        assert_eq!(jain(&[5, 5, 5, 5]), Some(1.0));
        assert_eq!(jain(&[4, 0, 0, 0]), Some(0.25));
        assert_eq!(jain(&[0, 0]), None);
    }

    #[test]
    fn overlaps_and_regressions_are_counted() {
        let t = Instant::now();
        let ms = |n| t + Duration::from_millis(n);
        let o = |contender, fence, s, e| Ownership {
            contender,
            fence,
            start: ms(s),
            end: ms(e),
        };
        assert_eq!(
            check(&[o(0, 1, 0, 10), o(1, 2, 10, 20), o(0, 3, 25, 30)]),
            Safety::default()
        );
        let bad = check(&[o(0, 1, 0, 10), o(1, 2, 9, 20), o(2, 2, 30, 40)]);
        assert_eq!((bad.overlaps, bad.fence_regressions), (1, 1));
        // An ownership inside a long one overlaps it, even after a short one in between.
        let nested = check(&[o(0, 1, 0, 100), o(1, 2, 10, 20), o(2, 3, 30, 40)]);
        assert_eq!(nested.overlaps, 2);
    }

    #[test]
    fn rss_is_read() {
        assert!(rss_mib().is_some_and(|m| m > 0.0));
    }
}
