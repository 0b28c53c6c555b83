//! The fenced resource: a loopback TCP service that contender processes write to.
//!
//! Line protocol, one request per line, each answered with one line:
//!
//! | request | meaning | answer |
//! |---|---|---|
//! | `HELLO <id>` | who is on this connection | `OK` |
//! | `BEGIN <fence> <valid_ms>` | I own the mutex with `fence`, for at most `valid_ms` more | `OK` |
//! | `BEGIN <fence> <valid_ms> read` | I read-hold the read-write lock with `fence` (a `BEGIN` without `read` is its writer) | `OK` |
//! | `WRITE <fence> <valid_ms>` | a write under `fence`; I still own for `valid_ms` | `OK` or `REJECT` |
//! | `READ <fence> <valid_ms>` | a read under `fence`; I still read-hold for `valid_ms` | `OK` or `REJECT` |
//! | `END <fence> <reason>` | I stopped owning | `OK` |
//! | `WAIT` | I start waiting to acquire (my next `BEGIN`, or my death, ends the wait) | `OK` |
//!
//! The resource **rejects a write whose fence is lower than one it already accepted** (and
//! one that says its lease already ran out).
//!
//! For a semaphore of N permits ([`FencedResource::start_with_permits`]) a fence alone
//! cannot tell a resource whether a lower-fenced writer still holds (the N−1 others may
//! have come and gone), so the rules are:
//!
//! - **rejected** (what a resource that only sees fences can do): a write whose fence is
//!   below N distinct fences it already accepted. With N = 1 this is the mutex rule. It is
//!   conservative: it may also turn away a holder that still holds, after N shorter ones
//!   wrote;
//! - **stale** (the verdict, from what the run knows): a write accepted while N ownerships
//!   with higher fences were open (begun, not ended, and within the local deadline their
//!   last message announced). Those N believed at that instant, so the writer made N + 1:
//!   the backend must have taken its permit, and the lowest fence is the one that lost.
//!
//! For a read-write lock ([`FencedResource::start_rw`]) writes follow the mutex rule, with
//! the fences of readers and writers in one sequence (the lock's gate's): a write is
//! **stale** when an ownership with a higher fence, reader or writer, had begun. A read
//! whose fence is below the last accepted write's is a **stale read**: the resource refuses
//! it (`REJECT`, as it refuses a read that says its lease already ran out; what a resource that only sees fences can do to keep a reader from seeing a
//! version newer than its fence) and counts it. A stale read is not a violation by itself:
//! a reader paused past its lease may send one after a writer came in, and the refusal is
//! the fence doing its job. What is a violation is a reader that still *believed* while the
//! writer held: that is an overlap of their intervals, which
//! [`history::check_rw`] reports.
//!
//! It records, per ownership, when it began and the latest instant its holder could still
//! believe it owned: the end is the earlier of the `END` and the last message's arrival
//! plus its `valid_ms`. A holder that was killed or paused sends nothing, so its belief ends where its last message said — or, for a holder
//! whose process the run killed ([`FencedResource::died`]), when it died: a dead process
//! believes nothing (SQLite hands its mutex over at once).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::history::{self, Interval, Violation, Wait};
use simba_core::LossReason;

#[derive(Debug, Clone)]
struct Open {
    contender: String,
    fence: u64,
    start: Instant,
    bound: Instant,
    end: Option<Instant>,
    reason: Option<LossReason>,
    /// When its last message arrived.
    last: Instant,
    /// A reader of a read-write lock (`BEGIN … read`).
    read: bool,
}

impl Open {
    /// Whether its contender still believes in it at `now`: not ended, and within the
    /// validity it claimed.
    fn believed_at(&self, now: Instant) -> bool {
        self.end.is_none() && self.bound > now
    }
}

#[derive(Debug, Default)]
struct State {
    ownerships: Vec<Open>,
    /// Index into `ownerships` of each contender's current one.
    current: HashMap<String, usize>,
    max_accepted: u64,
    max_begun: u64,
    writes_accepted: u64,
    writes_rejected: u64,
    stale_writes_accepted: u64,
    protocol_errors: u64,
    /// The permits of the semaphore under test (1: a mutex or a read-write lock).
    permits: usize,
    /// A read-write lock is under test.
    rw: bool,
    reads_accepted: u64,
    stale_reads: u64,
    /// The highest distinct fences accepted, at most `permits`, highest first (semaphores).
    top_accepted: Vec<u64>,
    /// Every wait announced with `WAIT`, in order.
    waits: Vec<Wait>,
    /// Index into `waits` of each contender's open wait.
    waiting: HashMap<String, usize>,
}

impl State {
    /// Ends `contender`'s open wait at `at` (`acquired`: it ended in a `BEGIN`).
    fn end_wait(&mut self, contender: &str, at: Instant, acquired: bool) {
        if let Some(i) = self.waiting.remove(contender)
            && let Some(w) = self.waits.get_mut(i)
        {
            w.end = Some(at);
            w.acquired = acquired;
        }
    }
}

/// What the resource saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResourceReport {
    /// Ownerships begun.
    pub ownerships: usize,
    /// Ownerships that passed to a different contender than the one before.
    pub handoffs: usize,
    /// Writes accepted.
    pub writes_accepted: u64,
    /// Writes refused for a stale fence or an expired lease (the fence doing its job).
    pub writes_rejected: u64,
    /// Writes accepted although an ownership with a higher fence had already begun
    /// (semaphores: although N ownerships with higher fences were open).
    pub stale_writes_accepted: u64,
    /// Malformed requests.
    pub protocol_errors: u64,
    /// Read ownerships begun (`BEGIN … read`); the others were writers.
    pub read_ownerships: usize,
    /// Reads accepted.
    pub reads_accepted: u64,
    /// Reads refused because their fence was below the last accepted write's.
    pub stale_reads: u64,
}

/// The running resource; dropping it stops it.
#[derive(Debug)]
pub struct FencedResource {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: JoinHandle<()>,
}

impl Drop for FencedResource {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FencedResource {
    /// Starts listening on a free loopback port.
    ///
    /// # Errors
    /// The bind error.
    pub async fn start() -> std::io::Result<FencedResource> {
        Self::start_with_permits(1).await
    }

    /// Starts the resource of a semaphore with `permits` permits (at least 1; 1 is
    /// [`FencedResource::start`]): its rules are in the module docs.
    ///
    /// # Errors
    /// The bind error.
    pub async fn start_with_permits(permits: usize) -> std::io::Result<FencedResource> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            permits: permits.max(1),
            ..State::default()
        }));
        let st = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                tokio::spawn(serve(sock, st.clone()));
            }
        });
        Ok(FencedResource { addr, state, task })
    }

    /// Starts the resource of a read-write lock: writes follow the mutex's rule, reads
    /// are refused below the last accepted write's fence (see the module docs).
    ///
    /// # Errors
    /// The bind error.
    pub async fn start_rw() -> std::io::Result<FencedResource> {
        let r = Self::start_with_permits(1).await?;
        r.lock().rw = true;
        Ok(r)
    }

    /// Where contenders connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The contender that holds an open ownership now, if any (the most recent begun).
    pub fn current_owner(&self) -> Option<String> {
        let s = self.lock();
        let now = Instant::now();
        s.ownerships
            .iter()
            .rev()
            .find(|o| o.believed_at(now))
            .map(|o| o.contender.clone())
    }

    /// Whether `contender` believes it owns now: its current ownership is begun, not ended
    /// and within the validity it claimed.
    pub fn believes(&self, contender: &str) -> bool {
        let s = self.lock();
        let now = Instant::now();
        s.current
            .get(contender)
            .and_then(|&i| s.ownerships.get(i))
            .is_some_and(|o| o.believed_at(now))
    }

    /// Records that the process of `contender` is dead (reaped): the run killed it, sending
    /// the kill at `killed`, or it exited by itself (`None`). Its open ownership ends at its
    /// last message, or at the kill if that came later: a dead process acts no more, and
    /// nothing it did can come after both.
    pub fn died(&self, contender: &str, killed: Option<Instant>) {
        let mut s = self.lock();
        s.end_wait(contender, killed.unwrap_or_else(Instant::now), false);
        if let Some(&i) = s.current.get(contender) {
            let o = &mut s.ownerships[i];
            if o.end.is_none() {
                o.end = Some(killed.map_or(o.last, |k| k.max(o.last)));
            }
        }
    }

    /// The ownerships as intervals of belief, for [`history::check`].
    pub fn intervals(&self) -> Vec<Interval> {
        self.lock()
            .ownerships
            .iter()
            .map(|o| Interval {
                contender: o.contender.clone(),
                fence: o.fence,
                start: o.start,
                end: Some(o.end.map_or(o.bound, |e| e.min(o.bound))),
                reason: o.reason,
            })
            .collect()
    }

    /// The ownerships as intervals of belief with their access, for
    /// [`history::check_rw`]: a `BEGIN … read` is a reader, any other a writer.
    pub fn rw_intervals(&self) -> Vec<(history::Access, Interval)> {
        let access: Vec<history::Access> = self
            .lock()
            .ownerships
            .iter()
            .map(|o| {
                if o.read {
                    history::Access::Read
                } else {
                    history::Access::Write
                }
            })
            .collect();
        access.into_iter().zip(self.intervals()).collect()
    }

    /// The waits announced with `WAIT` (open ones have no end), for
    /// [`history::load`].
    pub fn waits(&self) -> Vec<Wait> {
        self.lock().waits.clone()
    }

    /// Whether `contender` announced a wait that has not ended (no `BEGIN` since).
    pub fn is_waiting(&self, contender: &str) -> bool {
        self.lock().waiting.contains_key(contender)
    }

    /// Safety violations in what was recorded: [`history::check`] for a mutex,
    /// [`history::check_permits`] for a semaphore, [`history::check_rw`] for a read-write
    /// lock.
    pub fn violations(&self) -> Vec<Violation> {
        let (permits, rw) = {
            let s = self.lock();
            (s.permits, s.rw)
        };
        if rw {
            history::check_rw(&self.rw_intervals())
        } else if permits > 1 {
            history::check_permits(&self.intervals(), permits)
        } else {
            history::check(&self.intervals())
        }
    }

    /// Counts so far.
    pub fn report(&self) -> ResourceReport {
        let s = self.lock();
        let handoffs = s
            .ownerships
            .windows(2)
            .filter(|w| w[0].contender != w[1].contender)
            .count();
        ResourceReport {
            ownerships: s.ownerships.len(),
            handoffs,
            writes_accepted: s.writes_accepted,
            writes_rejected: s.writes_rejected,
            stale_writes_accepted: s.stale_writes_accepted,
            protocol_errors: s.protocol_errors,
            read_ownerships: s.ownerships.iter().filter(|o| o.read).count(),
            reads_accepted: s.reads_accepted,
            stale_reads: s.stale_reads,
        }
    }
}

fn parse_reason(s: &str) -> LossReason {
    match s {
        "lease_expired" => LossReason::LeaseExpired,
        "taken_over" => LossReason::TakenOver,
        "session_lost" => LossReason::SessionLost,
        _ => LossReason::Released,
    }
}

/// Applies one request; returns the answer.
fn apply(state: &Mutex<State>, who: &mut Option<String>, line: &str) -> &'static str {
    let now = Instant::now();
    let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
    let words: Vec<&str> = line.split_whitespace().collect();
    let num = |i: usize| words.get(i).and_then(|w| w.parse::<u64>().ok());
    match (words.first().copied(), who.clone()) {
        (Some("HELLO"), _) if words.len() == 2 => {
            *who = Some(words[1].to_owned());
            "OK"
        }
        (Some("BEGIN"), Some(id)) => {
            let (Some(fence), Some(valid)) = (num(1), num(2)) else {
                s.protocol_errors += 1;
                return "ERR";
            };
            let read = match words.get(3).copied() {
                None => false,
                Some("read") if words.len() == 4 => true,
                Some(_) => {
                    s.protocol_errors += 1;
                    return "ERR";
                }
            };
            s.max_begun = s.max_begun.max(fence);
            s.end_wait(&id, now, true);
            let n = s.ownerships.len();
            s.ownerships.push(Open {
                contender: id.clone(),
                fence,
                start: now,
                bound: now + Duration::from_millis(valid),
                end: None,
                reason: None,
                last: now,
                read,
            });
            s.current.insert(id, n);
            "OK"
        }
        (Some("WRITE"), Some(id)) => {
            let (Some(fence), Some(valid)) = (num(1), num(2)) else {
                s.protocol_errors += 1;
                return "ERR";
            };
            if s.permits > 1 {
                let permits = s.permits;
                let fenced_off =
                    s.top_accepted.len() == permits && s.top_accepted[permits - 1] > fence;
                if fenced_off || valid == 0 {
                    s.writes_rejected += 1;
                    return "REJECT";
                }
                if !s.top_accepted.contains(&fence) {
                    let at = s.top_accepted.partition_point(|&f| f > fence);
                    s.top_accepted.insert(at, fence);
                    s.top_accepted.truncate(permits);
                }
                s.writes_accepted += 1;
                let above = s
                    .ownerships
                    .iter()
                    .filter(|o| o.fence > fence && o.believed_at(now))
                    .count();
                if above >= permits {
                    s.stale_writes_accepted += 1;
                }
            } else {
                if fence < s.max_accepted || valid == 0 {
                    s.writes_rejected += 1;
                    return "REJECT";
                }
                s.max_accepted = fence;
                s.writes_accepted += 1;
                if fence < s.max_begun {
                    s.stale_writes_accepted += 1;
                }
            }
            if let Some(&i) = s.current.get(&id)
                && s.ownerships[i].fence == fence
            {
                let b = now + Duration::from_millis(valid);
                let o = &mut s.ownerships[i];
                o.bound = o.bound.max(b);
                o.last = now;
            }
            "OK"
        }
        (Some("READ"), Some(id)) => {
            let (Some(fence), Some(valid)) = (num(1), num(2)) else {
                s.protocol_errors += 1;
                return "ERR";
            };
            if valid == 0 {
                return "REJECT";
            }
            if fence < s.max_accepted {
                s.stale_reads += 1;
                return "REJECT";
            }
            s.reads_accepted += 1;
            if let Some(&i) = s.current.get(&id)
                && s.ownerships[i].fence == fence
            {
                let b = now + Duration::from_millis(valid);
                let o = &mut s.ownerships[i];
                o.bound = o.bound.max(b);
                o.last = now;
            }
            "OK"
        }
        (Some("WAIT"), Some(id)) if words.len() == 1 => {
            // A wait not ended by a BEGIN (a give-up) ends where the next one starts.
            s.end_wait(&id, now, false);
            let n = s.waits.len();
            s.waits.push(Wait {
                contender: id.clone(),
                start: now,
                end: None,
                acquired: false,
            });
            s.waiting.insert(id, n);
            "OK"
        }
        (Some("END"), Some(id)) => {
            let Some(fence) = num(1) else {
                s.protocol_errors += 1;
                return "ERR";
            };
            let reason = parse_reason(words.get(2).copied().unwrap_or(""));
            if let Some(&i) = s.current.get(&id)
                && s.ownerships[i].fence == fence
                && s.ownerships[i].end.is_none()
            {
                s.ownerships[i].end = Some(now);
                s.ownerships[i].reason = Some(reason);
            }
            "OK"
        }
        _ => {
            s.protocol_errors += 1;
            "ERR"
        }
    }
}

/// Body of the fuzz target `chaos_lines` (see `fuzz/`): any sequence of request lines,
/// from any number of connections (a line `@N` switches to connection `N`), is answered
/// `OK`, `REJECT` or `ERR` without panicking, and a rejected write is never counted as
/// accepted.
#[cfg(any(test, fuzzing))]
pub fn fuzz_lines(data: &[u8]) {
    // The first byte picks a mutex or a semaphore of 2 or 3 permits.
    let permits = data.first().map_or(1, |b| usize::from(b % 3) + 1);
    let state = Mutex::new(State {
        permits,
        ..State::default()
    });
    let mut who: Vec<Option<String>> = vec![None; 4];
    let mut conn = 0;
    for line in String::from_utf8_lossy(data).split('\n') {
        if let Some(n) = line.strip_prefix('@') {
            conn = n.trim().parse::<usize>().unwrap_or(0) % who.len();
            continue;
        }
        let before = state.lock().map(|s| s.writes_accepted).unwrap_or(0);
        let answer = apply(&state, &mut who[conn], line);
        assert!(
            matches!(answer, "OK" | "REJECT" | "ERR"),
            "{line:?} -> {answer}"
        );
        let after = state.lock().map(|s| s.writes_accepted).unwrap_or(0);
        if answer != "OK" {
            assert_eq!(before, after, "{line:?} -> {answer} counted as accepted");
        }
    }
}

async fn serve(sock: TcpStream, state: Arc<Mutex<State>>) {
    let _ = sock.set_nodelay(true);
    let (r, mut w) = sock.into_split();
    let mut lines = BufReader::new(r).lines();
    let mut who = None;
    while let Ok(Some(line)) = lines.next_line().await {
        let answer = apply(&state, &mut who, &line);
        if w.write_all(format!("{answer}\n").as_bytes()).await.is_err() {
            break;
        }
    }
}

/// A client of the resource, for contender processes written in Rust.
#[derive(Debug)]
pub struct ResourceClient {
    lines: tokio::io::Lines<BufReader<tokio::net::tcp::OwnedReadHalf>>,
    w: tokio::net::tcp::OwnedWriteHalf,
}

impl ResourceClient {
    /// Connects and introduces itself as `id`.
    ///
    /// # Errors
    /// Connection or protocol errors.
    pub async fn connect(addr: SocketAddr, id: &str) -> std::io::Result<Self> {
        let sock = TcpStream::connect(addr).await?;
        sock.set_nodelay(true)?;
        let (r, w) = sock.into_split();
        let mut c = ResourceClient {
            lines: BufReader::new(r).lines(),
            w,
        };
        c.call(&format!("HELLO {id}")).await?;
        Ok(c)
    }

    async fn call(&mut self, line: &str) -> std::io::Result<bool> {
        self.w.write_all(format!("{line}\n").as_bytes()).await?;
        match self.lines.next_line().await? {
            Some(a) if a == "OK" => Ok(true),
            Some(a) if a == "REJECT" => Ok(false),
            Some(a) => Err(std::io::Error::other(format!(
                "resource answered {a:?} to {line:?}"
            ))),
            None => Err(std::io::Error::other("resource closed the connection")),
        }
    }

    /// Reports a new ownership.
    ///
    /// # Errors
    /// Connection or protocol errors.
    pub async fn begin(&mut self, fence: u64, valid: Duration) -> std::io::Result<()> {
        self.call(&format!("BEGIN {fence} {}", valid.as_millis()))
            .await
            .map(|_| ())
    }

    /// Reports a new read ownership of a read-write lock.
    ///
    /// # Errors
    /// Connection or protocol errors.
    pub async fn begin_read(&mut self, fence: u64, valid: Duration) -> std::io::Result<()> {
        self.call(&format!("BEGIN {fence} {} read", valid.as_millis()))
            .await
            .map(|_| ())
    }

    /// Reads under `fence`; `Ok(false)` when the resource refused it (a stale read).
    ///
    /// # Errors
    /// Connection or protocol errors.
    pub async fn read(&mut self, fence: u64, valid: Duration) -> std::io::Result<bool> {
        self.call(&format!("READ {fence} {}", valid.as_millis()))
            .await
    }

    /// Reports that this contender starts waiting to acquire (its next
    /// [`begin`](Self::begin) ends the wait).
    ///
    /// # Errors
    /// Connection or protocol errors.
    pub async fn wait(&mut self) -> std::io::Result<()> {
        self.call("WAIT").await.map(|_| ())
    }

    /// Writes under `fence`; `Ok(false)` when the resource refused it.
    ///
    /// # Errors
    /// Connection or protocol errors.
    pub async fn write(&mut self, fence: u64, valid: Duration) -> std::io::Result<bool> {
        self.call(&format!("WRITE {fence} {}", valid.as_millis()))
            .await
    }

    /// Reports the end of an ownership.
    ///
    /// # Errors
    /// Connection or protocol errors.
    pub async fn end(&mut self, fence: u64, reason: LossReason) -> std::io::Result<()> {
        let r = match reason {
            LossReason::LeaseExpired => "lease_expired",
            LossReason::TakenOver => "taken_over",
            LossReason::SessionLost => "session_lost",
            _ => "released",
        };
        self.call(&format!("END {fence} {r}")).await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn corpus_chaos_lines() {
        simba_core::fuzzing::replay(env!("CARGO_MANIFEST_DIR"), "chaos_lines", super::fuzz_lines);
    }

    use super::*;

    #[tokio::test]
    async fn fences_and_intervals() {
        let r = FencedResource::start().await.expect("start");
        let mut a = ResourceClient::connect(r.addr(), "a").await.expect("a");
        let mut b = ResourceClient::connect(r.addr(), "b").await.expect("b");
        a.begin(1, Duration::from_secs(5)).await.expect("begin");
        assert!(a.write(1, Duration::from_secs(5)).await.expect("w"));
        a.end(1, LossReason::Released).await.expect("end");
        b.begin(2, Duration::from_secs(5)).await.expect("begin");
        // A paused ex-owner writes late with its old fence, before b wrote: accepted,
        // but counted stale because b's higher fence had begun.
        assert!(a.write(1, Duration::from_secs(5)).await.expect("w"));
        assert!(b.write(2, Duration::from_secs(5)).await.expect("w"));
        assert!(
            !a.write(1, Duration::from_secs(5)).await.expect("w"),
            "fenced off"
        );
        assert!(
            !b.write(2, Duration::ZERO).await.expect("w"),
            "an expired lease is refused"
        );
        b.end(2, LossReason::Released).await.expect("end");
        let rep = r.report();
        assert_eq!((rep.ownerships, rep.handoffs), (2, 1));
        assert_eq!(
            (
                rep.writes_accepted,
                rep.writes_rejected,
                rep.stale_writes_accepted
            ),
            (3, 2, 1)
        );
        assert!(r.violations().is_empty(), "{:?}", r.violations());
    }

    #[tokio::test]
    async fn semaphore_fences_and_stale_writes() {
        let r = FencedResource::start_with_permits(2).await.expect("start");
        let long = Duration::from_secs(60);
        let mut c: Vec<ResourceClient> = Vec::new();
        for id in ["a", "b", "c", "d"] {
            c.push(ResourceClient::connect(r.addr(), id).await.expect(id));
        }
        // a and b hold side by side; both write.
        c[0].begin(1, long).await.expect("begin");
        c[1].begin(2, long).await.expect("begin");
        assert!(c[0].write(1, long).await.expect("w"));
        assert!(c[1].write(2, long).await.expect("w"));
        // b releases, c comes in: a still holds, and its write is not stale. It is refused
        // all the same once c wrote: 1 is below two accepted fences (3 and 2), and the
        // resource cannot tell that 2 has gone (the conservative rule).
        c[1].end(2, LossReason::Released).await.expect("end");
        c[2].begin(3, long).await.expect("begin");
        assert!(c[0].write(1, long).await.expect("w"), "a still holds");
        assert!(c[2].write(3, long).await.expect("w"));
        assert!(!c[0].write(1, long).await.expect("w"), "fenced off");
        assert_eq!(r.report().stale_writes_accepted, 0);
        assert!(!c[2].write(3, Duration::ZERO).await.expect("w"));
        assert!(r.violations().is_empty(), "{:?}", r.violations());
        // Another semaphore of 2: d and e come in beside a, who believes it holds; its
        // write makes three. The resource saw fence 1 only: it accepts, and the write is
        // counted stale.
        let r = FencedResource::start_with_permits(2).await.expect("start");
        let mut c: Vec<ResourceClient> = Vec::new();
        for id in ["a", "d", "e"] {
            c.push(ResourceClient::connect(r.addr(), id).await.expect(id));
        }
        c[0].begin(1, long).await.expect("begin");
        assert!(c[0].write(1, long).await.expect("w"));
        c[1].begin(4, long).await.expect("begin");
        c[2].begin(5, long).await.expect("begin");
        assert!(c[0].write(1, long).await.expect("w"));
        let rep = r.report();
        assert_eq!((rep.writes_accepted, rep.stale_writes_accepted), (2, 1));
        let v = r.violations();
        assert!(
            matches!(v.as_slice(), [Violation::OverCapacity { permits: 2, holders }] if holders.len() == 3),
            "{v:?}"
        );
    }

    #[tokio::test]
    async fn a_holder_that_believes_too_long_is_an_overlap() {
        let r = FencedResource::start().await.expect("start");
        let mut a = ResourceClient::connect(r.addr(), "a").await.expect("a");
        let mut b = ResourceClient::connect(r.addr(), "b").await.expect("b");
        a.begin(1, Duration::from_secs(60)).await.expect("begin");
        b.begin(2, Duration::from_secs(60)).await.expect("begin");
        let v = r.violations();
        assert_eq!(v.len(), 1, "{v:?}");
        // A killed holder's belief ends with its lease: no overlap when the next begins later.
        let r = FencedResource::start().await.expect("start");
        let mut a = ResourceClient::connect(r.addr(), "a").await.expect("a");
        let mut b = ResourceClient::connect(r.addr(), "b").await.expect("b");
        a.begin(1, Duration::from_millis(30)).await.expect("begin");
        tokio::time::sleep(Duration::from_millis(60)).await;
        b.begin(2, Duration::from_secs(1)).await.expect("begin");
        assert!(r.violations().is_empty());
    }

    #[tokio::test]
    async fn a_dead_holder_believes_nothing() {
        let r = FencedResource::start().await.expect("start");
        let mut a = ResourceClient::connect(r.addr(), "a").await.expect("a");
        let mut b = ResourceClient::connect(r.addr(), "b").await.expect("b");
        a.begin(1, Duration::from_secs(60)).await.expect("begin");
        assert!(a.write(1, Duration::from_secs(60)).await.expect("write"));
        r.died("a", Some(Instant::now()));
        b.begin(2, Duration::from_secs(60)).await.expect("begin");
        assert!(r.violations().is_empty(), "{:?}", r.violations());
        // A holder that still wrote after the next one began overlapped it, whenever it died.
        let r = FencedResource::start().await.expect("start");
        let mut a = ResourceClient::connect(r.addr(), "a").await.expect("a");
        let mut b = ResourceClient::connect(r.addr(), "b").await.expect("b");
        let before = Instant::now();
        a.begin(1, Duration::from_secs(60)).await.expect("begin");
        b.begin(2, Duration::from_secs(60)).await.expect("begin");
        a.write(1, Duration::from_secs(60)).await.expect("write");
        r.died("a", Some(before));
        assert_eq!(r.violations().len(), 1, "{:?}", r.violations());
    }

    #[tokio::test]
    async fn rw_reads_writes_and_stale_reads() {
        let r = FencedResource::start_rw().await.expect("start");
        let long = Duration::from_secs(60);
        let mut a = ResourceClient::connect(r.addr(), "a").await.expect("a");
        let mut b = ResourceClient::connect(r.addr(), "b").await.expect("b");
        let mut c = ResourceClient::connect(r.addr(), "c").await.expect("c");
        // Two readers side by side, then a writer after both.
        a.begin_read(1, long).await.expect("begin");
        b.begin_read(2, long).await.expect("begin");
        assert!(a.read(1, long).await.expect("read"));
        assert!(b.read(2, long).await.expect("read"));
        a.end(1, LossReason::Released).await.expect("end");
        b.end(2, LossReason::Released).await.expect("end");
        c.begin(3, long).await.expect("begin");
        assert!(c.write(3, long).await.expect("write"));
        // A reader with an older fence reads after the write: refused and counted, and
        // not a violation (it had ended: it believed nothing).
        assert!(!a.read(1, long).await.expect("read"), "a stale read");
        c.end(3, LossReason::Released).await.expect("end");
        a.begin_read(4, long).await.expect("begin");
        assert!(a.read(4, long).await.expect("read"));
        let rep = r.report();
        assert_eq!(
            (
                rep.ownerships,
                rep.read_ownerships,
                rep.reads_accepted,
                rep.stale_reads,
                rep.writes_accepted,
                rep.stale_writes_accepted
            ),
            (4, 3, 3, 1, 1, 0)
        );
        assert!(r.violations().is_empty(), "{:?}", r.violations());
        // A writer that begins while a reader believes: an overlap, and the reader's
        // stale read after the write is counted.
        let r = FencedResource::start_rw().await.expect("start");
        let mut a = ResourceClient::connect(r.addr(), "a").await.expect("a");
        let mut b = ResourceClient::connect(r.addr(), "b").await.expect("b");
        a.begin_read(1, long).await.expect("begin");
        b.begin(2, long).await.expect("begin");
        assert!(b.write(2, long).await.expect("write"));
        assert!(!a.read(1, long).await.expect("read"));
        assert_eq!(r.report().stale_reads, 1);
        let v = r.violations();
        assert!(
            matches!(
                v.as_slice(),
                [Violation::RwOverlap {
                    other_access: history::Access::Read,
                    ..
                }]
            ),
            "{v:?}"
        );
        // A writer's write after a reader with a higher fence began is stale.
        let r = FencedResource::start_rw().await.expect("start");
        let mut a = ResourceClient::connect(r.addr(), "a").await.expect("a");
        let mut b = ResourceClient::connect(r.addr(), "b").await.expect("b");
        a.begin(1, Duration::from_millis(1)).await.expect("begin");
        b.begin_read(2, long).await.expect("begin");
        assert!(a.write(1, long).await.expect("write"));
        assert_eq!(r.report().stale_writes_accepted, 1);
        // An unknown access word is a protocol error.
        assert!(a.call("BEGIN 5 100 maybe").await.is_err());
        assert_eq!(r.report().protocol_errors, 1);
    }

    #[tokio::test]
    async fn waits_end_at_begin_or_death() {
        let r = FencedResource::start_with_permits(2).await.expect("start");
        let mut a = ResourceClient::connect(r.addr(), "a").await.expect("a");
        let mut b = ResourceClient::connect(r.addr(), "b").await.expect("b");
        a.wait().await.expect("wait");
        b.wait().await.expect("wait");
        assert!(r.is_waiting("a") && r.is_waiting("b"));
        a.begin(1, Duration::from_secs(60)).await.expect("begin");
        assert!(!r.is_waiting("a"));
        r.died("b", None);
        assert!(!r.is_waiting("b"));
        let waits = r.waits();
        assert_eq!(waits.len(), 2);
        assert!(waits[0].acquired && waits[0].end.is_some());
        assert!(!waits[1].acquired && waits[1].end.is_some());
        // A second WAIT without a BEGIN ends the first one as given up.
        a.wait().await.expect("wait");
        a.wait().await.expect("wait");
        let waits = r.waits();
        assert_eq!(waits.len(), 4);
        assert!(!waits[2].acquired && waits[2].end.is_some());
        assert!(waits[3].end.is_none());
    }
}
