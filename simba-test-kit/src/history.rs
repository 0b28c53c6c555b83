//! Ownership histories and the safety checker.
//!
//! Contenders record every ownership interval they believed in (monotonic start and end,
//! fence); [`check`] reports intervals of different ownerships of a mutex that overlap in
//! time and fences that do not increase; [`check_permits`] does the same for a semaphore
//! of N permits: more than N holders at one instant, a fence handed to two holders, a
//! holder's later permit with a fence not above its earlier one.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use simba_core::{Contender, LossReason, MutexState};

/// One ownership as its holder saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interval {
    /// Who held it.
    pub contender: String,
    /// Its fencing token.
    pub fence: u64,
    /// When the holder learned it owned.
    pub start: Instant,
    /// When the holder stopped believing it owned (`None`: still holds).
    pub end: Option<Instant>,
    /// Why it ended.
    pub reason: Option<LossReason>,
}

impl Interval {
    fn end_or(&self, now: Instant) -> Instant {
        self.end.unwrap_or(now)
    }
}

/// A safety violation found by [`check`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// Two ownerships overlapped in time.
    Overlap {
        /// The earlier-starting interval.
        first: Interval,
        /// The interval that started before `first` ended.
        second: Interval,
    },
    /// More holders of a semaphore believed at one instant than it has permits: the
    /// holders that believed at the instant the excess began (the one that began last is
    /// last). One report per excess: a new one only after the count came back to N.
    OverCapacity {
        /// The semaphore's permits.
        permits: usize,
        /// The holders believing at that instant, by start.
        holders: Vec<Interval>,
    },
    /// Two different holders of a semaphore got the same fence.
    FenceReuse {
        /// The earlier-starting holder.
        first: Interval,
        /// The other holder with the same fence.
        second: Interval,
    },
    /// An ownership that started later carried a fence not greater than an earlier one.
    FenceRegression {
        /// The earlier interval.
        earlier: Interval,
        /// The later interval with a fence not greater than `earlier`'s.
        later: Interval,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::Overlap { first, second } => write!(
                f,
                "two owners at once: {} (fence {}) and {} (fence {}) overlapped by {:?}",
                first.contender,
                first.fence,
                second.contender,
                second.fence,
                first
                    .end_or(Instant::now())
                    .saturating_duration_since(second.start)
            ),
            Violation::OverCapacity { permits, holders } => {
                write!(f, "{} holders of {permits} permits at once:", holders.len())?;
                for h in holders {
                    write!(f, " {} (fence {})", h.contender, h.fence)?;
                }
                Ok(())
            }
            Violation::FenceReuse { first, second } => write!(
                f,
                "fence {} handed out twice: to {} and to {}",
                first.fence, first.contender, second.contender
            ),
            Violation::FenceRegression { earlier, later } => write!(
                f,
                "fence did not increase: {} got {} after {} had {}",
                later.contender, later.fence, earlier.contender, earlier.fence
            ),
        }
    }
}

/// Checks a history: no two different ownerships overlap, and fences increase with time.
///
/// Two intervals are the same ownership when they share contender and fence (an owner that
/// lost its lease locally and then heard that its renewal went through); those may touch
/// but not overlap either.
pub fn check(intervals: &[Interval]) -> Vec<Violation> {
    let now = Instant::now();
    let mut sorted: Vec<&Interval> = intervals.iter().collect();
    sorted.sort_by_key(|i| i.start);
    let mut out = Vec::new();
    for (n, a) in sorted.iter().enumerate() {
        for b in &sorted[n + 1..] {
            // Sorted by start: neither this one nor any later one began before `a` ended.
            if b.start >= a.end_or(now) {
                break;
            }
            out.push(Violation::Overlap {
                first: (*a).clone(),
                second: (*b).clone(),
            });
        }
    }
    for pair in sorted.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        let same_ownership = a.contender == b.contender && a.fence == b.fence;
        if b.fence <= a.fence && !same_ownership {
            out.push(Violation::FenceRegression {
                earlier: a.clone(),
                later: b.clone(),
            });
        }
    }
    out
}

/// Checks the history of a semaphore with `permits` permits: never more than `permits`
/// holders believing at one instant ([`Violation::OverCapacity`]), no fence handed to two
/// different holders ([`Violation::FenceReuse`]), and each contender's fences increasing
/// from one permit to its next ([`Violation::FenceRegression`]).
///
/// A holder counts from when it learned it held until it stopped believing (for the
/// intervals of the chaos run's resource: its `END`, its death, or the local deadline its
/// last message announced, whichever came first), as [`check`] counts a mutex's owners.
/// An interval ending at the instant another starts does not overlap it.
///
/// Why the fence rule is per contender and not over all holders by start, as for a
/// mutex: with N permits, two acquisitions run side by side, and the one that got the
/// lower fence can learn of it (and report its start) after the other. What stays sound
/// is that the backend hands out fences in increasing order, each once: a contender
/// acquires one permit after the other, so its own fences increase, and no two holders
/// share one. With one permit this is weaker than [`check`]; use [`check`] for mutexes.
pub fn check_permits(intervals: &[Interval], permits: usize) -> Vec<Violation> {
    let now = Instant::now();
    let mut sorted: Vec<&Interval> = intervals.iter().collect();
    sorted.sort_by_key(|i| i.start);
    let mut out = Vec::new();
    // Sweep by start: the holders still believing when each one begins.
    let mut active: Vec<&Interval> = Vec::new();
    let mut over = false;
    for iv in &sorted {
        active.retain(|a| a.end_or(now) > iv.start);
        if active.len() <= permits {
            over = false;
        }
        active.push(iv);
        if active.len() > permits && !over {
            over = true;
            out.push(Violation::OverCapacity {
                permits,
                holders: active.iter().map(|a| (*a).clone()).collect(),
            });
        }
    }
    let mut by_fence: std::collections::HashMap<u64, &Interval> = std::collections::HashMap::new();
    let mut last_of: std::collections::HashMap<&str, &Interval> = std::collections::HashMap::new();
    for iv in &sorted {
        match by_fence.get(&iv.fence) {
            Some(first) if first.contender != iv.contender => {
                out.push(Violation::FenceReuse {
                    first: (*first).clone(),
                    second: (*iv).clone(),
                });
            }
            Some(_) => {}
            None => {
                by_fence.insert(iv.fence, iv);
            }
        }
        if let Some(prev) = last_of.get(iv.contender.as_str())
            && iv.fence < prev.fence
        {
            out.push(Violation::FenceRegression {
                earlier: (*prev).clone(),
                later: (*iv).clone(),
            });
        }
        last_of.insert(&iv.contender, iv);
    }
    out
}

/// A shared, append-only history.
#[derive(Debug, Clone, Default)]
pub struct History(Arc<Mutex<Vec<Interval>>>);

impl History {
    /// An empty history.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Interval>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that `contender` began owning with `fence`.
    pub fn begin(&self, contender: &str, fence: u64) {
        self.lock().push(Interval {
            contender: contender.to_owned(),
            fence,
            start: Instant::now(),
            end: None,
            reason: None,
        });
    }

    /// Records that `contender`'s open ownership ended.
    pub fn end(&self, contender: &str, reason: LossReason) {
        let mut h = self.lock();
        if let Some(i) = h
            .iter_mut()
            .rev()
            .find(|i| i.contender == contender && i.end.is_none())
        {
            i.end = Some(Instant::now());
            i.reason = Some(reason);
        }
    }

    /// A copy of the intervals so far.
    pub fn intervals(&self) -> Vec<Interval> {
        self.lock().clone()
    }

    /// How many ownerships began.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no ownership began yet.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Runs [`check`] over the history.
    pub fn violations(&self) -> Vec<Violation> {
        check(&self.intervals())
    }

    /// A contender that records into this history as `id`.
    pub fn contender(&self, id: impl Into<String>) -> Arc<RecordingContender> {
        Arc::new(RecordingContender {
            id: id.into(),
            history: self.clone(),
        })
    }
}

/// A [`Contender`] that records its ownership intervals into a [`History`].
#[derive(Debug)]
pub struct RecordingContender {
    id: String,
    history: History,
}

impl Contender for RecordingContender {
    fn contender_id(&self) -> Option<String> {
        Some(self.id.clone())
    }

    fn on_acquired(&self, state: &MutexState) {
        self.history.begin(&self.id, state.after.fence);
    }

    fn on_released(&self, _state: &MutexState, reason: LossReason) {
        self.history.end(&self.id, reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// `c`'s ownership with `fence` from `start` to `end` ms after `base`.
    fn iv(base: Instant, c: &str, fence: u64, start: u64, end: u64) -> Interval {
        Interval {
            contender: c.into(),
            fence,
            start: base + Duration::from_millis(start),
            end: Some(base + Duration::from_millis(end)),
            reason: Some(LossReason::Released),
        }
    }

    #[test]
    fn clean_history_passes() {
        let base = Instant::now();
        let mk = |c: &str, f: u64, s: u64, e: u64| iv(base, c, f, s, e);
        let h = vec![mk("a", 1, 0, 10), mk("b", 2, 10, 20), mk("a", 5, 30, 40)];
        assert!(check(&h).is_empty(), "{:?}", check(&h));
    }

    #[test]
    fn overlap_is_reported() {
        let base = Instant::now();
        let mk = |c: &str, f: u64, s: u64, e: u64| iv(base, c, f, s, e);
        let v = check(&[mk("a", 1, 0, 10), mk("b", 2, 9, 20)]);
        assert_eq!(v.len(), 1);
        assert!(matches!(v[0], Violation::Overlap { .. }));
        assert!(v[0].to_string().contains("two owners at once"));
    }

    #[test]
    fn every_overlapping_pair_is_reported_once() {
        let base = Instant::now();
        let mk = |c: &str, f: u64, s: u64, e: u64| iv(base, c, f, s, e);
        // Two short ownerships inside a long one, then one after all of them.
        let nested = [
            mk("a", 1, 0, 100),
            mk("b", 2, 10, 20),
            mk("c", 3, 30, 40),
            mk("d", 4, 200, 300),
        ];
        let pairs: Vec<(u64, u64)> = check(&nested)
            .iter()
            .map(|v| match v {
                Violation::Overlap { first, second } => (first.fence, second.fence),
                _ => panic!("{v}"),
            })
            .collect();
        assert_eq!(pairs, [(1, 2), (1, 3)]);
        // Three at once: three pairs.
        let three = [mk("a", 1, 0, 10), mk("b", 2, 1, 10), mk("c", 3, 2, 10)];
        assert_eq!(check(&three).len(), 3);
    }

    #[test]
    fn open_interval_overlaps_everything_after() {
        // Both in the past: an open interval lasts until the check.
        let base = Instant::now()
            .checked_sub(Duration::from_millis(50))
            .expect("the clock runs longer than 50 ms");
        let mut a = iv(base, "a", 1, 0, 0);
        a.end = None;
        let b = iv(base, "b", 2, 5, 6);
        assert_eq!(check(&[a, b]).len(), 1);
    }

    #[test]
    fn fence_regression_is_reported() {
        let base = Instant::now();
        let mk = |c: &str, f: u64, s: u64, e: u64| iv(base, c, f, s, e);
        let v = check(&[mk("a", 3, 0, 10), mk("b", 3, 10, 20)]);
        assert!(
            matches!(v.as_slice(), [Violation::FenceRegression { .. }]),
            "{v:?}"
        );
        // The same ownership seen twice by its holder is not a regression.
        assert!(check(&[mk("a", 3, 0, 10), mk("a", 3, 10, 20)]).is_empty());
    }

    #[test]
    fn permits_allow_n_holders_and_report_the_next() {
        let base = Instant::now();
        let mk = |c: &str, f: u64, s: u64, e: u64| iv(base, c, f, s, e);
        // Three at once with three permits; the fourth begins as the first ends.
        let three = [
            mk("a", 1, 0, 10),
            mk("b", 2, 1, 20),
            mk("c", 3, 2, 20),
            mk("d", 4, 10, 30),
        ];
        assert!(
            check_permits(&three, 3).is_empty(),
            "{:?}",
            check_permits(&three, 3)
        );
        // With two permits that is over capacity twice: a, b and c; then, after a ended
        // and the count came back to two, b, c and d.
        let v = check_permits(&three, 2);
        let excesses: Vec<Vec<&str>> = v
            .iter()
            .map(|v| match v {
                Violation::OverCapacity {
                    permits: 2,
                    holders,
                } => holders.iter().map(|h| h.contender.as_str()).collect(),
                _ => panic!("{v}"),
            })
            .collect();
        assert_eq!(excesses, [["a", "b", "c"], ["b", "c", "d"]]);
        assert!(v[0].to_string().contains("3 holders of 2 permits at once"));
        // A fourth that begins one millisecond before the first ends is one too many.
        let four = [
            mk("a", 1, 0, 10),
            mk("b", 2, 1, 20),
            mk("c", 3, 2, 20),
            mk("d", 4, 9, 30),
            // Back to one (d), then four again (d to g): a second report.
            mk("e", 5, 25, 40),
            mk("f", 6, 26, 40),
            mk("g", 7, 27, 40),
        ];
        let v = check_permits(&four, 3);
        assert_eq!(v.len(), 2, "{v:?}");
        assert!(
            v.iter()
                .all(|v| matches!(v, Violation::OverCapacity { .. }))
        );
    }

    #[test]
    fn permit_fences_are_unique_and_increase_per_contender() {
        let base = Instant::now();
        let mk = |c: &str, f: u64, s: u64, e: u64| iv(base, c, f, s, e);
        // Side by side, the lower fence may report its start later: not a violation.
        let ok = [mk("a", 2, 0, 10), mk("b", 1, 1, 10), mk("a", 3, 20, 30)];
        assert!(
            check_permits(&ok, 2).is_empty(),
            "{:?}",
            check_permits(&ok, 2)
        );
        let reuse = [mk("a", 2, 0, 10), mk("b", 2, 1, 10)];
        assert!(matches!(
            check_permits(&reuse, 2).as_slice(),
            [Violation::FenceReuse { .. }]
        ));
        let regress = [mk("a", 5, 0, 10), mk("a", 4, 20, 30)];
        assert!(matches!(
            check_permits(&regress, 2).as_slice(),
            [Violation::FenceRegression { .. }]
        ));
    }

    #[test]
    fn recorder_records() {
        let h = History::new();
        let c = h.contender("x");
        let mut st = MutexState::default();
        st.after.fence = 7;
        c.on_acquired(&st);
        c.on_released(&st, LossReason::LeaseExpired);
        let iv = h.intervals();
        assert_eq!(iv.len(), 1);
        assert_eq!(
            (iv[0].fence, iv[0].reason),
            (7, Some(LossReason::LeaseExpired))
        );
        assert!(iv[0].end.is_some());
    }
}
