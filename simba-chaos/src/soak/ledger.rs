//! The soak's ledger: a fenced resource for many mutexes at once, served by the parent to
//! its worker processes over one loopback TCP connection each.
//!
//! Line protocol, every request answered by one line, in order:
//!
//! | request | meaning | answer |
//! |---|---|---|
//! | `HELLO <worker>` | who is on this connection | `OK` |
//! | `B <mutex> <fence> <valid_ms>` | I own `mutex` with `fence` for at most `valid_ms` more | `OK` |
//! | `W <mutex> <fence> <valid_ms>` | a write under `fence`; I still own for `valid_ms` | `OK` or `REJECT` |
//! | `E <mutex> <fence> <reason>` | I stopped owning | `OK` |
//! | `S <key>=<n> …` | the worker's counters now | `OK` |
//!
//! Per mutex it keeps the rules of the chaos run's resource (`simba_test_kit::chaos`): a
//! write whose fence is below one already accepted is rejected, an accepted write below the
//! highest fence begun is a *stale write accepted*, and an ownership is believed from its
//! `B` until the earlier of its `E` and its last message's arrival plus its `valid_ms`.
//! [`Ledger::check`] runs the kit's history checker over every mutex's recent ownerships,
//! counts each violation once, and forgets ownerships that ended long before.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use simba_core::LossReason;
use simba_test_kit::history::{self, Interval, Violation};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Ownerships that ended longer ago than this are forgotten by [`Ledger::check`] (the last
/// one of each mutex is kept, for its fence): a minute is far beyond any lease of a soak,
/// so a late write of a forgotten ownership would have to come from a holder silent for a
/// minute past its own bound, and is still caught as a stale write.
const FORGET_AFTER: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
struct Own {
    worker: String,
    fence: u64,
    start: Instant,
    bound: Instant,
    end: Option<Instant>,
    reason: Option<LossReason>,
    last: Instant,
}

impl Own {
    fn believed_until(&self) -> Instant {
        self.end.map_or(self.bound, |e| e.min(self.bound))
    }
}

#[derive(Debug, Default)]
struct Name {
    max_accepted: u64,
    max_begun: u64,
    last_worker: Option<String>,
    ownerships: Vec<Own>,
}

impl Name {
    fn current(&mut self, worker: &str, fence: u64) -> Option<&mut Own> {
        self.ownerships
            .iter_mut()
            .rev()
            .find(|o| o.worker == worker && o.fence == fence)
    }
}

#[derive(Debug, Default)]
struct State {
    names: HashMap<String, Name>,
    stats: HashMap<String, Vec<(String, u64)>>,
    totals: Totals,
    reported: HashSet<(String, String, u64, String, u64)>,
    first_violations: Vec<String>,
}

/// What the ledger counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    /// Ownerships begun.
    pub ownerships: u64,
    /// Ownerships begun by another worker than the one before, on the same mutex.
    pub handoffs: u64,
    /// Writes accepted.
    pub writes_accepted: u64,
    /// Writes refused (stale fence, or a lease already over): the fence doing its job.
    pub writes_rejected: u64,
    /// Writes accepted although an ownership with a higher fence had begun.
    pub stale_writes_accepted: u64,
    /// Overlapping ownerships found by the history checker.
    pub overlaps: u64,
    /// Fences that did not increase.
    pub fence_regressions: u64,
    /// Malformed requests.
    pub protocol_errors: u64,
}

/// The running ledger; dropping it stops it.
#[derive(Debug)]
pub(crate) struct Ledger {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: JoinHandle<()>,
}

impl Drop for Ledger {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn reason_of(s: &str) -> LossReason {
    match s {
        "lease_expired" => LossReason::LeaseExpired,
        "taken_over" => LossReason::TakenOver,
        "session_lost" => LossReason::SessionLost,
        _ => LossReason::Released,
    }
}

/// The word of `reason` in an `E` request.
pub(crate) fn reason_word(reason: LossReason) -> &'static str {
    match reason {
        LossReason::Released => "released",
        LossReason::LeaseExpired => "lease_expired",
        LossReason::TakenOver => "taken_over",
        LossReason::SessionLost => "session_lost",
        _ => "lost",
    }
}

impl Ledger {
    /// Listens on a free loopback port.
    pub(crate) async fn start() -> std::io::Result<Ledger> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                tokio::spawn(serve(sock, st.clone()));
            }
        });
        Ok(Ledger { addr, state, task })
    }

    /// Where workers connect.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The counters `worker` sent last.
    pub(crate) fn stats(&self, worker: &str) -> Vec<(String, u64)> {
        self.lock().stats.get(worker).cloned().unwrap_or_default()
    }

    /// Records that `worker`'s process is dead, killed at `killed`: its open ownerships
    /// end at their last message or the kill, whichever is later.
    pub(crate) fn died(&self, worker: &str, killed: Instant) {
        let mut s = self.lock();
        for name in s.names.values_mut() {
            for o in name.ownerships.iter_mut().rev() {
                if o.worker == worker && o.end.is_none() {
                    o.end = Some(killed.max(o.last));
                }
            }
        }
    }

    /// Runs the history checker over every mutex's ownerships, counts the violations not
    /// seen before, forgets ownerships that ended more than [`FORGET_AFTER`] ago, and
    /// returns the totals.
    pub(crate) fn check(&self) -> Totals {
        let now = Instant::now();
        let mut guard = self.lock();
        let s = &mut *guard;
        for (mutex, name) in &mut s.names {
            if name.ownerships.len() > 1 {
                let intervals: Vec<Interval> = name
                    .ownerships
                    .iter()
                    .map(|o| Interval {
                        contender: o.worker.clone(),
                        fence: o.fence,
                        start: o.start,
                        end: Some(o.believed_until()),
                        reason: o.reason,
                    })
                    .collect();
                for v in history::check(&intervals) {
                    let (a, b, overlap) = match &v {
                        Violation::Overlap { first, second } => (first, second, true),
                        Violation::FenceRegression { earlier, later } => (earlier, later, false),
                        // The semaphores' and read-write locks' kinds: `check` (a mutex's)
                        // reports none of them.
                        Violation::OverCapacity { .. }
                        | Violation::FenceReuse { .. }
                        | Violation::RwOverlap { .. }
                        | Violation::ReadBelowWrite { .. } => continue,
                    };
                    let key = (
                        mutex.clone(),
                        a.contender.clone(),
                        a.fence,
                        b.contender.clone(),
                        b.fence,
                    );
                    if s.reported.insert(key) {
                        if overlap {
                            s.totals.overlaps += 1;
                        } else {
                            s.totals.fence_regressions += 1;
                        }
                        if s.first_violations.len() < 10 {
                            s.first_violations.push(format!("{mutex}: {v}"));
                        }
                    }
                }
            }
            let keep_from = now.checked_sub(FORGET_AFTER).unwrap_or(now);
            let last = name.ownerships.len().saturating_sub(1);
            let mut n = 0;
            name.ownerships.retain(|o| {
                let keep = n == last || o.believed_until() >= keep_from;
                n += 1;
                keep
            });
        }
        s.totals
    }

    /// The first violations found, described.
    pub(crate) fn first_violations(&self) -> Vec<String> {
        self.lock().first_violations.clone()
    }
}

fn num(words: &[&str], i: usize) -> Option<u64> {
    words.get(i).and_then(|w| w.parse().ok())
}

/// Applies one request; returns the answer.
fn apply(state: &Mutex<State>, who: &mut Option<String>, line: &str) -> &'static str {
    let now = Instant::now();
    let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
    let words: Vec<&str> = line.split_whitespace().collect();
    let Some(worker) = who.clone() else {
        if let ["HELLO", id] = words.as_slice() {
            *who = Some((*id).to_owned());
            return "OK";
        }
        s.totals.protocol_errors += 1;
        return "ERR";
    };
    let s = &mut *s;
    match words.first().copied() {
        Some("B") => {
            let (Some(mutex), Some(fence), Some(valid)) =
                (words.get(1), num(&words, 2), num(&words, 3))
            else {
                s.totals.protocol_errors += 1;
                return "ERR";
            };
            let name = s.names.entry((*mutex).to_owned()).or_default();
            name.max_begun = name.max_begun.max(fence);
            if name.last_worker.as_deref().is_some_and(|w| w != worker) {
                s.totals.handoffs += 1;
            }
            name.last_worker = Some(worker.clone());
            name.ownerships.push(Own {
                worker,
                fence,
                start: now,
                bound: now + Duration::from_millis(valid),
                end: None,
                reason: None,
                last: now,
            });
            s.totals.ownerships += 1;
            "OK"
        }
        Some("W") => {
            let (Some(mutex), Some(fence), Some(valid)) =
                (words.get(1), num(&words, 2), num(&words, 3))
            else {
                s.totals.protocol_errors += 1;
                return "ERR";
            };
            let name = s.names.entry((*mutex).to_owned()).or_default();
            if fence < name.max_accepted || valid == 0 {
                s.totals.writes_rejected += 1;
                return "REJECT";
            }
            name.max_accepted = fence;
            s.totals.writes_accepted += 1;
            if fence < name.max_begun {
                s.totals.stale_writes_accepted += 1;
                if s.first_violations.len() < 10 {
                    s.first_violations.push(format!(
                        "{mutex}: {worker} wrote under fence {fence} after fence {} began",
                        name.max_begun
                    ));
                }
            }
            if let Some(o) = name.current(&worker, fence)
                && o.end.is_none()
            {
                o.bound = o.bound.max(now + Duration::from_millis(valid));
                o.last = now;
            }
            "OK"
        }
        Some("E") => {
            let (Some(mutex), Some(fence)) = (words.get(1), num(&words, 2)) else {
                s.totals.protocol_errors += 1;
                return "ERR";
            };
            let reason = reason_of(words.get(3).copied().unwrap_or(""));
            if let Some(o) = s
                .names
                .get_mut(*mutex)
                .and_then(|n| n.current(&worker, fence))
                && o.end.is_none()
            {
                o.end = Some(now);
                o.reason = Some(reason);
                o.last = now;
            }
            "OK"
        }
        Some("S") => {
            let parsed: Option<Vec<(String, u64)>> = words[1..]
                .iter()
                .map(|kv| {
                    let (k, v) = kv.split_once('=')?;
                    Some((k.to_owned(), v.parse().ok()?))
                })
                .collect();
            match parsed {
                Some(kv) => {
                    s.stats.insert(worker, kv);
                    "OK"
                }
                None => {
                    s.totals.protocol_errors += 1;
                    "ERR"
                }
            }
        }
        _ => {
            s.totals.protocol_errors += 1;
            "ERR"
        }
    }
}

async fn serve(sock: TcpStream, state: Arc<Mutex<State>>) {
    let _ = sock.set_nodelay(true);
    let (r, mut w) = sock.into_split();
    let mut lines = BufReader::new(r).lines();
    let mut who = None;
    let mut out = Vec::new();
    while let Ok(Some(line)) = lines.next_line().await {
        out.clear();
        out.extend_from_slice(apply(&state, &mut who, &line).as_bytes());
        out.push(b'\n');
        if w.write_all(&out).await.is_err() {
            break;
        }
    }
}

type Pending = Arc<Mutex<std::collections::VecDeque<tokio::sync::oneshot::Sender<String>>>>;

/// A worker's connection to the ledger: requests from any task, answered in order.
#[derive(Debug, Clone)]
pub(crate) struct LedgerClient {
    tx: tokio::sync::mpsc::UnboundedSender<(String, tokio::sync::oneshot::Sender<String>)>,
}

impl LedgerClient {
    /// Connects as `worker`. The connection's tasks end when it breaks; every call then
    /// fails.
    pub(crate) async fn connect(addr: SocketAddr, worker: &str) -> std::io::Result<Self> {
        let sock = TcpStream::connect(addr).await?;
        sock.set_nodelay(true)?;
        let (r, mut w) = sock.into_split();
        let pending: Pending = Arc::default();
        let (tx, mut rx) =
            tokio::sync::mpsc::unbounded_channel::<(String, tokio::sync::oneshot::Sender<String>)>(
            );
        let p = pending.clone();
        tokio::spawn(async move {
            while let Some((line, reply)) = rx.recv().await {
                p.lock().unwrap_or_else(|e| e.into_inner()).push_back(reply);
                if w.write_all(line.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
        tokio::spawn(async move {
            let mut lines = BufReader::new(r).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let next = pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .pop_front();
                match next {
                    Some(reply) => {
                        let _ = reply.send(line);
                    }
                    None => break,
                }
            }
            // Dropping what is left fails its callers.
            pending.lock().unwrap_or_else(|e| e.into_inner()).clear();
        });
        let client = LedgerClient { tx };
        client.call(format!("HELLO {worker}")).await?;
        Ok(client)
    }

    /// Sends one request line and returns the answer.
    pub(crate) async fn call(&self, line: String) -> std::io::Result<String> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let broken = || std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the ledger is gone");
        self.tx.send((line + "\n", reply)).map_err(|_| broken())?;
        let answer = answer.await.map_err(|_| broken())?;
        if answer == "ERR" {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "the ledger refused a request",
            ));
        }
        Ok(answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(state: &Mutex<State>, who: &mut Option<String>, lines: &[&str]) -> Vec<&'static str> {
        lines.iter().map(|l| apply(state, who, l)).collect()
    }

    #[test]
    fn stale_writes_and_rejections_are_counted_per_mutex() {
        let state = Mutex::new(State::default());
        let (mut a, mut b) = (None, None);
        feed(&state, &mut a, &["HELLO a", "B m 1 5000", "B n 9 5000"]);
        feed(&state, &mut b, &["HELLO b"]);
        assert_eq!(
            feed(&state, &mut a, &["W m 1 5000", "E m 1 released"]),
            ["OK", "OK"]
        );
        assert_eq!(
            feed(&state, &mut b, &["B m 2 5000", "W m 2 5000"]),
            ["OK", "OK"]
        );
        // a's old fence is refused; n's fence 9 does not matter to m.
        assert_eq!(
            feed(&state, &mut a, &["W m 1 5000", "W n 9 5000"]),
            ["REJECT", "OK"]
        );
        let s = state.lock().unwrap_or_else(|p| p.into_inner());
        assert_eq!(
            (
                s.totals.writes_accepted,
                s.totals.writes_rejected,
                s.totals.handoffs
            ),
            (3, 1, 1)
        );
        assert_eq!(s.totals.stale_writes_accepted, 0);
    }

    #[test]
    fn unknown_requests_are_errors() {
        let state = Mutex::new(State::default());
        let mut w = None;
        assert_eq!(feed(&state, &mut w, &["B m 1 1"]), ["ERR"]);
        assert_eq!(
            feed(
                &state,
                &mut w,
                &["HELLO w", "B m x 1", "S a=1 b", "S tasks=3"]
            ),
            ["OK", "ERR", "ERR", "OK"]
        );
    }

    #[tokio::test]
    async fn overlaps_are_counted_once_and_ended_ownerships_forgotten() {
        let ledger = Ledger::start().await.expect("bind");
        let a = LedgerClient::connect(ledger.addr(), "a").await.expect("a");
        let b = LedgerClient::connect(ledger.addr(), "b").await.expect("b");
        a.call("B m 1 60000".into()).await.expect("a begins");
        b.call("B m 2 60000".into()).await.expect("b begins");
        b.call("E m 2 released".into()).await.expect("b ends");
        let first = ledger.check();
        assert_eq!((first.overlaps, first.handoffs), (1, 1), "{first:?}");
        // Seen again, counted once.
        assert_eq!(ledger.check().overlaps, 1);
        a.call("E m 1 released".into()).await.expect("a ends");
        assert!(ledger.first_violations()[0].contains("two owners at once"));
        let stats = a.call("S tasks=7".into()).await.expect("stats");
        assert_eq!(stats, "OK");
        assert_eq!(ledger.stats("a"), [("tasks".to_owned(), 7)]);
    }
}
