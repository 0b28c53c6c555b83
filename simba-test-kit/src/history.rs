//! Ownership histories and the safety checker.
//!
//! Contenders record every ownership interval they believed in (monotonic start and end,
//! fence); [`check`] reports intervals of different ownerships of a mutex that overlap in
//! time and fences that do not increase; [`check_permits`] does the same for a semaphore
//! of N permits: more than N holders at one instant, a fence handed to two holders, a
//! holder's later permit with a fence not above its earlier one; [`check_rw`] checks a
//! read-write lock: no writer beside any other holder, writers' fences increasing, and no
//! reader with a fence below a writer that ended before it began.
//!
//! [`load`] and [`holder_time`] measure instead of check: how many acquisitions a run made,
//! how long waiters waited, and how many permits were held while someone waited (or
//! during given spans, such as a waiter's pause).

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// A writer of a read-write lock believed at the same time as another holder (a
    /// reader or another writer).
    RwOverlap {
        /// The writer.
        writer: Interval,
        /// The other holder.
        other: Interval,
        /// Whether the other holder was a reader or a writer.
        other_access: Access,
    },
    /// A reader of a read-write lock began after a writer ended, with a fence below that
    /// writer's: it passed the gate before the writer did, yet read after it.
    ReadBelowWrite {
        /// The writer that ended before the reader began.
        writer: Interval,
        /// The reader.
        reader: Interval,
    },
}

/// How a holder of a read-write lock held it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Shared with other readers.
    Read,
    /// Alone.
    Write,
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::Read => "reader",
            Access::Write => "writer",
        })
    }
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
            Violation::RwOverlap {
                writer,
                other,
                other_access,
            } => {
                let (a, b) = if writer.start <= other.start {
                    (writer, other)
                } else {
                    (other, writer)
                };
                write!(
                    f,
                    "a writer beside another holder: writer {} (fence {}) and {other_access} \
                     {} (fence {}) overlapped by {:?}",
                    writer.contender,
                    writer.fence,
                    other.contender,
                    other.fence,
                    a.end_or(Instant::now())
                        .min(b.end_or(Instant::now()))
                        .saturating_duration_since(b.start)
                )
            }
            Violation::ReadBelowWrite { writer, reader } => write!(
                f,
                "reader {} (fence {}) began after writer {} (fence {}) ended, with a lower fence",
                reader.contender, reader.fence, writer.contender, writer.fence
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

/// Checks the history of a read-write lock, each holder with its [`Access`]:
///
/// - no writer's interval overlaps any other holder's, reader or writer
///   ([`Violation::RwOverlap`], one per pair); readers may overlap each other;
/// - writers' fences strictly increase in the order their intervals begin
///   ([`Violation::FenceRegression`] between consecutive writers);
/// - every reader's fence is at least the fence of every writer whose interval ended
///   before the reader's began ([`Violation::ReadBelowWrite`], one per reader, against the
///   highest such writer).
///
/// Intervals are counted as in [`check`]: from when the holder learned it held until it
/// stopped believing; one that ends at the instant another begins does not overlap it, and
/// two intervals of one contender with one fence are one ownership seen twice, not two.
pub fn check_rw(intervals: &[(Access, Interval)]) -> Vec<Violation> {
    let now = Instant::now();
    let mut sorted: Vec<&(Access, Interval)> = intervals.iter().collect();
    sorted.sort_by_key(|(_, i)| i.start);
    let mut out = Vec::new();
    for (n, (access_a, a)) in sorted.iter().enumerate() {
        for (access_b, b) in &sorted[n + 1..] {
            // Sorted by start: neither this one nor any later one began before `a` ended.
            if b.start >= a.end_or(now) {
                break;
            }
            let same_ownership = a.contender == b.contender && a.fence == b.fence;
            if same_ownership {
                continue;
            }
            match (access_a, access_b) {
                (Access::Read, Access::Read) => {}
                (Access::Write, other) => out.push(Violation::RwOverlap {
                    writer: a.clone(),
                    other: b.clone(),
                    other_access: *other,
                }),
                (Access::Read, Access::Write) => out.push(Violation::RwOverlap {
                    writer: b.clone(),
                    other: a.clone(),
                    other_access: Access::Read,
                }),
            }
        }
    }
    let writers: Vec<&Interval> = sorted
        .iter()
        .filter(|(a, _)| *a == Access::Write)
        .map(|(_, i)| i)
        .collect();
    for pair in writers.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        let same_ownership = a.contender == b.contender && a.fence == b.fence;
        if b.fence <= a.fence && !same_ownership {
            out.push(Violation::FenceRegression {
                earlier: a.clone(),
                later: b.clone(),
            });
        }
    }
    // Readers by start, writers by end: the highest fence of the writers that ended
    // before each reader began.
    let mut by_end = writers.clone();
    by_end.sort_by_key(|w| w.end_or(now));
    let mut ended = 0;
    let mut highest: Option<&Interval> = None;
    for (access, r) in &sorted {
        if *access != Access::Read {
            continue;
        }
        while ended < by_end.len() && by_end[ended].end_or(now) <= r.start {
            let w = by_end[ended];
            if highest.is_none_or(|h| w.fence > h.fence) {
                highest = Some(w);
            }
            ended += 1;
        }
        if let Some(w) = highest
            && r.fence < w.fence
        {
            out.push(Violation::ReadBelowWrite {
                writer: w.clone(),
                reader: r.clone(),
            });
        }
    }
    out
}

/// One wait of a contender for an ownership, as the run saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wait {
    /// Who waited.
    pub contender: String,
    /// When it began waiting.
    pub start: Instant,
    /// When the wait ended (`None`: still waiting).
    pub end: Option<Instant>,
    /// Whether it ended in an ownership (otherwise the contender gave up or died).
    pub acquired: bool,
}

/// The load figures of a run between two instants, from [`load`].
#[derive(Debug, Clone, PartialEq)]
pub struct Load {
    /// The length of the measured window.
    pub window: Duration,
    /// Ownerships that began in the window.
    pub acquisitions: usize,
    /// Time in the window during which at least one contender waited.
    pub queued: Duration,
    /// Of `queued`: the time with `k` holders believing, for `k` in `0..=permits` (more
    /// than `permits` counts as `permits`).
    pub holders_while_queued: Vec<Duration>,
    /// Waits that ended in an ownership within the window, in ascending order of length.
    pub waits: Vec<Duration>,
}

impl Load {
    /// Acquisitions per second of the window.
    pub fn per_second(&self) -> f64 {
        let secs = self.window.as_secs_f64();
        if secs > 0.0 {
            self.acquisitions as f64 / secs
        } else {
            0.0
        }
    }

    /// The share (0 to 1) of the queued time with `k` holders; 0 when nobody ever waited.
    pub fn share_while_queued(&self, k: usize) -> f64 {
        share(&self.holders_while_queued, self.queued, k)
    }

    /// The median wait (the lower middle one of an even count), if any wait ended.
    pub fn wait_p50(&self) -> Option<Duration> {
        let n = self.waits.len();
        (n > 0).then(|| self.waits[(n - 1) / 2])
    }

    /// The longest wait that ended, if any.
    pub fn wait_max(&self) -> Option<Duration> {
        self.waits.last().copied()
    }
}

impl fmt::Display for Load {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms =
            |d: Option<Duration>| d.map_or_else(|| "-".to_owned(), |d| d.as_millis().to_string());
        write!(
            f,
            "load: acquisitions_per_s={:.1} holders_while_queued=",
            self.per_second()
        )?;
        for k in 0..self.holders_while_queued.len() {
            let sep = if k == 0 { "" } else { "/" };
            write!(f, "{sep}{:.1}", self.share_while_queued(k) * 100.0)?;
        }
        write!(
            f,
            "% queued_s={:.1} window_s={:.1} wait_p50_ms={} wait_max_ms={}",
            self.queued.as_secs_f64(),
            self.window.as_secs_f64(),
            ms(self.wait_p50()),
            ms(self.wait_max())
        )
    }
}

fn share(buckets: &[Duration], total: Duration, k: usize) -> f64 {
    match buckets.get(k) {
        Some(d) if !total.is_zero() => d.as_secs_f64() / total.as_secs_f64(),
        _ => 0.0,
    }
}

/// Merges spans into sorted, disjoint ones, clipped to `[from, to)`; empty spans go.
fn merge(
    mut spans: Vec<(Instant, Instant)>,
    from: Instant,
    to: Instant,
) -> Vec<(Instant, Instant)> {
    spans.sort();
    let mut out: Vec<(Instant, Instant)> = Vec::new();
    for (a, b) in spans {
        let (a, b) = (a.max(from), b.min(to));
        if a >= b {
            continue;
        }
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// The parts of `span` during which a contender other than `who` was waiting (`waits`; a
/// wait not ended lasts to `now`): the time `who`'s absence could keep somebody waiting.
pub fn others_queued(
    waits: &[Wait],
    who: &str,
    span: (Instant, Instant),
    now: Instant,
) -> Vec<(Instant, Instant)> {
    let others = waits
        .iter()
        .filter(|w| w.contender != who)
        .map(|w| (w.start, w.end.unwrap_or(now)))
        .collect();
    merge(others, span.0, span.1)
}

/// The time within `spans` (which may overlap; counted once) during which `k` holders
/// believed, for `k` in `0..=permits` (more than `permits` counts as `permits`).
///
/// A holder counts from its start to its end (an open interval to `now`), as in
/// [`check_permits`]: one ending at the instant another starts is not counted with it.
pub fn holder_time(
    intervals: &[Interval],
    permits: usize,
    spans: &[(Instant, Instant)],
    now: Instant,
) -> Vec<Duration> {
    let mut buckets = vec![Duration::ZERO; permits + 1];
    let Some(from) = spans.iter().map(|s| s.0).min() else {
        return buckets;
    };
    let to = spans.iter().map(|s| s.1).max().unwrap_or(from);
    let spans = merge(spans.to_vec(), from, to);
    // Edges at one instant: ends (-1) before starts (+1); span edges carry no count.
    let mut edges: Vec<(Instant, i64)> = Vec::with_capacity(intervals.len() * 2);
    for iv in intervals {
        let end = iv.end_or(now);
        if end > iv.start {
            edges.push((iv.start, 1));
            edges.push((end, -1));
        }
    }
    edges.sort();
    let mut held: i64 = 0;
    let mut e = 0;
    for (a, b) in spans {
        // Holders at `a`: every edge up to and including `a`.
        while e < edges.len() && edges[e].0 <= a {
            held += edges[e].1;
            e += 1;
        }
        let mut t = a;
        while t < b {
            let next = edges.get(e).map_or(b, |x| x.0.min(b));
            let k = usize::try_from(held.max(0)).unwrap_or(0).min(permits);
            buckets[k] += next - t;
            t = next;
            while e < edges.len() && edges[e].0 <= t && t < b {
                held += edges[e].1;
                e += 1;
            }
        }
    }
    buckets
}

/// The load figures of a run's history between `from` and `to`: the ownerships that
/// began in it, the time at least one contender waited and how many of the `permits`
/// were held during it ([`holder_time`] over the waits), and the waits that ended in an
/// ownership in it. Open intervals and waits count as lasting until `to`.
pub fn load(
    intervals: &[Interval],
    waits: &[Wait],
    permits: usize,
    from: Instant,
    to: Instant,
) -> Load {
    let queued_spans = merge(
        waits
            .iter()
            .map(|w| (w.start, w.end.unwrap_or(to)))
            .collect(),
        from,
        to,
    );
    let queued = queued_spans.iter().map(|(a, b)| *b - *a).sum();
    let holders_while_queued = holder_time(intervals, permits, &queued_spans, to);
    let mut lengths: Vec<Duration> = waits
        .iter()
        .filter_map(|w| match w.end {
            Some(end) if w.acquired && end >= from && end < to => Some(end - w.start),
            _ => None,
        })
        .collect();
    lengths.sort();
    Load {
        window: to.saturating_duration_since(from),
        acquisitions: intervals
            .iter()
            .filter(|i| i.start >= from && i.start < to)
            .count(),
        queued,
        holders_while_queued,
        waits: lengths,
    }
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
    fn rw_readers_share_and_writers_are_alone() {
        let base = Instant::now();
        let r = |c: &str, f: u64, s: u64, e: u64| (Access::Read, iv(base, c, f, s, e));
        let w = |c: &str, f: u64, s: u64, e: u64| (Access::Write, iv(base, c, f, s, e));
        // Two readers side by side, a writer after both (touching the later end), readers
        // after it with higher fences, another writer.
        let ok = [
            r("a", 1, 0, 10),
            r("b", 2, 2, 12),
            w("c", 3, 12, 20),
            r("a", 4, 20, 30),
            r("b", 5, 21, 25),
            w("a", 6, 30, 40),
        ];
        assert!(check_rw(&ok).is_empty(), "{:?}", check_rw(&ok));
        // A reader seen twice by its holder (local loss, then the renewal's answer).
        let twice = [r("a", 1, 0, 10), r("a", 1, 9, 12), w("b", 2, 12, 20)];
        assert!(check_rw(&twice).is_empty(), "{:?}", check_rw(&twice));
    }

    #[test]
    fn rw_writer_beside_a_reader_is_reported() {
        let base = Instant::now();
        let r = |c: &str, f: u64, s: u64, e: u64| (Access::Read, iv(base, c, f, s, e));
        let w = |c: &str, f: u64, s: u64, e: u64| (Access::Write, iv(base, c, f, s, e));
        // A writer that began one millisecond before a reader ended.
        let v = check_rw(&[r("a", 1, 0, 10), w("b", 2, 9, 20)]);
        match v.as_slice() {
            [
                Violation::RwOverlap {
                    writer,
                    other,
                    other_access: Access::Read,
                },
            ] => assert_eq!((writer.fence, other.fence), (2, 1)),
            _ => panic!("{v:?}"),
        }
        assert!(
            v[0].to_string()
                .contains("writer b (fence 2) and reader a (fence 1) overlapped by 1ms"),
            "{}",
            v[0]
        );
        // A reader that began while a writer held.
        let v = check_rw(&[w("a", 1, 0, 10), r("b", 2, 5, 20), r("c", 3, 6, 20)]);
        assert_eq!(v.len(), 2, "{v:?}");
        assert!(v.iter().all(|v| matches!(
            v,
            Violation::RwOverlap { writer, other_access: Access::Read, .. } if writer.fence == 1
        )));
    }

    #[test]
    fn rw_two_writers_at_once_are_reported() {
        let base = Instant::now();
        let w = |c: &str, f: u64, s: u64, e: u64| (Access::Write, iv(base, c, f, s, e));
        let v = check_rw(&[w("a", 1, 0, 10), w("b", 2, 5, 20)]);
        assert!(
            matches!(
                v.as_slice(),
                [Violation::RwOverlap {
                    other_access: Access::Write,
                    ..
                }]
            ),
            "{v:?}"
        );
    }

    #[test]
    fn rw_writer_fences_increase() {
        let base = Instant::now();
        let r = |c: &str, f: u64, s: u64, e: u64| (Access::Read, iv(base, c, f, s, e));
        let w = |c: &str, f: u64, s: u64, e: u64| (Access::Write, iv(base, c, f, s, e));
        // The second writer's fence is below the first's; the reader between them is
        // not a writer and does not take part in the rule.
        let v = check_rw(&[w("a", 5, 0, 10), r("b", 9, 10, 20), w("c", 4, 20, 30)]);
        assert!(
            v.iter().any(|v| matches!(
                v,
                Violation::FenceRegression { earlier, later } if earlier.fence == 5 && later.fence == 4
            )),
            "{v:?}"
        );
        // An equal fence is a regression too.
        let v = check_rw(&[w("a", 5, 0, 10), w("c", 5, 20, 30)]);
        assert!(
            matches!(v.as_slice(), [Violation::FenceRegression { .. }]),
            "{v:?}"
        );
    }

    #[test]
    fn rw_reader_below_an_earlier_writer_is_reported() {
        let base = Instant::now();
        let r = |c: &str, f: u64, s: u64, e: u64| (Access::Read, iv(base, c, f, s, e));
        let w = |c: &str, f: u64, s: u64, e: u64| (Access::Write, iv(base, c, f, s, e));
        // Writers 3 and 7 ended; a reader with fence 5 begins after both.
        let v = check_rw(&[w("a", 3, 0, 10), w("b", 7, 10, 20), r("c", 5, 25, 30)]);
        match v.as_slice() {
            [Violation::ReadBelowWrite { writer, reader }] => {
                assert_eq!((writer.fence, reader.fence), (7, 5));
            }
            _ => panic!("{v:?}"),
        }
        assert!(
            v[0].to_string()
                .contains("reader c (fence 5) began after writer b (fence 7)")
        );
        // A reader that began before the writer ended (and not beside it) is not held to
        // its fence: here the reader ended as the writer began.
        let v = check_rw(&[r("c", 5, 0, 10), w("b", 7, 10, 20)]);
        assert!(v.is_empty(), "{v:?}");
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

    fn wait(base: Instant, c: &str, start: u64, end: Option<u64>, acquired: bool) -> Wait {
        Wait {
            contender: c.into(),
            start: base + Duration::from_millis(start),
            end: end.map(|e| base + Duration::from_millis(e)),
            acquired,
        }
    }

    #[test]
    fn load_counts_holders_while_someone_waits() {
        let base = Instant::now();
        let ms = Duration::from_millis;
        let mk = |c: &str, f: u64, s: u64, e: u64| iv(base, c, f, s, e);
        // Two permits, over 0..1000 ms:
        //   a holds 0..400, b 0..300, c 300..900 (after waiting 100..300),
        //   d 450..1000 (after waiting 200..450), e waits 500..700 and gives up.
        let intervals = [
            mk("a", 1, 0, 400),
            mk("b", 2, 0, 300),
            mk("c", 3, 300, 900),
            mk("d", 4, 450, 1000),
        ];
        let waits = [
            wait(base, "c", 100, Some(300), true),
            wait(base, "d", 200, Some(450), true),
            wait(base, "e", 500, Some(700), false),
        ];
        let l = load(&intervals, &waits, 2, base, base + ms(1000));
        assert_eq!(l.acquisitions, 4);
        assert!((l.per_second() - 4.0).abs() < 1e-9, "{}", l.per_second());
        // Queued: 100..450 and 500..700.
        assert_eq!(l.queued, ms(550));
        // 100..300: a, b (2); 300..400: a, c (2); 400..450: c (1);
        // 500..700: c, d (2).
        assert_eq!(l.holders_while_queued, [ms(0), ms(50), ms(500)]);
        assert!((l.share_while_queued(1) - 50.0 / 550.0).abs() < 1e-9);
        // The give-up is not a wait that ended in an ownership.
        assert_eq!(l.waits, [ms(200), ms(250)]);
        assert_eq!(l.wait_p50(), Some(ms(200)));
        assert_eq!(l.wait_max(), Some(ms(250)));
        let line = l.to_string();
        assert!(
            line.starts_with("load: acquisitions_per_s=4.0 holders_while_queued=0.0/9.1/90.9% "),
            "{line}"
        );
        assert!(line.ends_with("wait_p50_ms=200 wait_max_ms=250"), "{line}");
    }

    #[test]
    fn load_window_clips_and_open_waits_last_to_its_end() {
        let base = Instant::now();
        let ms = Duration::from_millis;
        let mk = |c: &str, f: u64, s: u64, e: u64| iv(base, c, f, s, e);
        // One permit; the window is 100..300. a holds 0..150; b waits from 50 and holds
        // 200..250; c waits from 260 on and never gets it.
        let intervals = [mk("a", 1, 0, 150), mk("b", 2, 200, 250)];
        let waits = [
            wait(base, "b", 50, Some(200), true),
            wait(base, "c", 260, None, false),
        ];
        let l = load(&intervals, &waits, 1, base + ms(100), base + ms(300));
        assert_eq!(l.acquisitions, 1, "a began before the window");
        // Queued 100..200 and 260..300: held 100..150 only.
        assert_eq!(l.queued, ms(140));
        assert_eq!(l.holders_while_queued, [ms(90), ms(50)]);
        assert_eq!(l.waits, [ms(150)]);
        // Nobody waited: every share is 0, and there is no median.
        let idle = load(&intervals, &[], 1, base, base + ms(300));
        assert_eq!(idle.queued, Duration::ZERO);
        assert_eq!(idle.share_while_queued(0), 0.0);
        assert_eq!(idle.wait_p50(), None);
        assert!(idle.to_string().contains("wait_p50_ms=- wait_max_ms=-"));
    }

    #[test]
    fn holder_time_over_spans() {
        let base = Instant::now();
        let ms = Duration::from_millis;
        let mk = |c: &str, f: u64, s: u64, e: u64| iv(base, c, f, s, e);
        let intervals = [
            mk("a", 1, 0, 100),
            mk("b", 2, 50, 200),
            mk("c", 3, 100, 120),
        ];
        let at = |a: u64, b: u64| (base + ms(a), base + ms(b));
        // 0..50: 1, 50..100: 2, 100..120: 2 (a ended as c began), 120..200: 1, after: 0.
        let t = holder_time(&intervals, 2, &[at(0, 300)], base + ms(300));
        assert_eq!(t, [ms(100), ms(130), ms(70)]);
        // Overlapping spans count once; a gap between spans is not counted.
        let t = holder_time(&intervals, 2, &[at(40, 60), at(50, 70), at(150, 250)], base);
        assert_eq!(t, [ms(50), ms(60), ms(20)]);
        // An open interval lasts until `now`; more than `permits` count as `permits`.
        let mut open = mk("d", 4, 0, 0);
        open.end = None;
        let t = holder_time(&[open, mk("e", 5, 0, 10)], 1, &[at(0, 20)], base + ms(15));
        assert_eq!(t, [ms(5), ms(15)]);
        assert_eq!(holder_time(&intervals, 2, &[], base), [Duration::ZERO; 3]);
    }

    #[test]
    fn others_queued_leaves_out_the_paused_one_and_the_time_nobody_else_waits() {
        let base = Instant::now();
        let ms = Duration::from_millis;
        let at = |a: u64, b: u64| (base + ms(a), base + ms(b));
        let waits = [
            // The paused one waits through the whole pause: not counted.
            wait(base, "p", 0, None, false),
            wait(base, "a", 10, Some(40), true),
            wait(base, "b", 30, Some(60), true),
            // Still waiting at `now` (90), and one outside the pause.
            wait(base, "c", 80, None, false),
            wait(base, "d", 200, Some(300), true),
        ];
        let spans = others_queued(&waits, "p", at(20, 100), base + ms(90));
        assert_eq!(spans, [at(20, 60), at(80, 90)]);
        assert!(others_queued(&waits[..1], "p", at(0, 100), base + ms(90)).is_empty());
    }
}
