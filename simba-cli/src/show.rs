//! `simba owner` and `simba watch`.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;
use simba_core::connect::Connection;
use simba_core::{MutexOwner, RetrievalService, SilentRetriever, check_common_mutex_name};
use tokio::sync::watch;

use crate::backend::Backend;
use crate::cli::{OwnerArgs, WatchArgs};
use crate::signals::Signals;
use crate::status::{Failure, Outcome, Status};

/// How long a retrieval service (ZooKeeper) is given to report a first owner before
/// "no owner" is concluded.
const FIRST_READ: Duration = Duration::from_millis(1500);

/// Upper bound for one owner read (the stores bound their calls too).
const READ_BOUND: Duration = Duration::from_secs(10);

/// What is known about a mutex's owner at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Snapshot {
    /// The owner within its lease, if any.
    owner: Option<MutexOwner>,
    /// The backend's clock at the read (ms since the epoch), or the local clock.
    now: i64,
    /// The backend's clock at the read, when the line comes from a read that told it;
    /// `None` for what an observer reported without a time (ZooKeeper's watches).
    backend_time: Option<i64>,
}

impl Snapshot {
    fn key(&self) -> Option<(&str, u64)> {
        self.owner.as_ref().map(|o| (o.owner_id.as_str(), o.fence))
    }
}

/// Where snapshots come from: one read (`simba owner` on lease backends), or a retrieval
/// service's state (`simba watch`, and ZooKeeper). The retrieval service is pushed where
/// the backend pushes and reads at a bounded interval otherwise (`--interval`).
enum Source {
    Read(Arc<dyn Connection>),
    Observe {
        service: Arc<dyn RetrievalService>,
        state: watch::Receiver<simba_core::MutexState>,
        /// A one-call read for the first snapshot (lease backends).
        reader: Option<Arc<dyn Connection>>,
    },
}

impl Source {
    /// `observe`: follow changes (watch) rather than read once (owner).
    async fn open(backend: &Backend, mutex: &str, observe: bool) -> Result<Source, Failure> {
        check_common_mutex_name(mutex).map_err(|e| Failure::simba(e, "bad mutex name"))?;
        let reader = backend.has_leases().then(|| backend.conn.clone());
        if let Some(reader) = reader.as_ref().filter(|_| !observe) {
            return Ok(Source::Read(reader.clone()));
        }
        let service = backend
            .factory()
            .create_retrieval_service(mutex, Arc::new(SilentRetriever))
            .map_err(|e| Failure::simba(e, "cannot observe the mutex"))?;
        let state = service.state();
        service
            .start()
            .map_err(|e| Failure::simba(e, "cannot observe the mutex"))?;
        Ok(Source::Observe {
            service,
            state,
            reader,
        })
    }

    /// The current owner. For an observed backend, waits up to [`FIRST_READ`] for the
    /// first report and treats silence as "no owner".
    async fn first(&mut self, mutex: &str) -> Result<Snapshot, Failure> {
        match self {
            Source::Read(reader)
            | Source::Observe {
                reader: Some(reader),
                ..
            } => read(reader.as_ref(), mutex).await,
            Source::Observe { state, .. } => {
                let _ = tokio::time::timeout(FIRST_READ, state.changed()).await;
                Ok(observed(&state.borrow_and_update().after))
            }
        }
    }

    /// The next snapshot: at the next change the observer reports.
    async fn next(&mut self, mutex: &str) -> Result<Snapshot, Failure> {
        match self {
            Source::Read(_) => Err(Failure::new(
                Status::Internal,
                "a one-read source cannot follow changes",
            )),
            Source::Observe { state, reader, .. } => {
                if state.changed().await.is_err() {
                    return Err(Failure::new(
                        Status::Unavailable,
                        "the observer of the mutex stopped",
                    ));
                }
                let seen = observed(&state.borrow_and_update().after);
                // A lease backend's observer does not pass the backend's clock on: one
                // read gives it, when it still shows what the observer reported.
                if let Some(reader) = reader
                    && let Ok(read) = read(reader.as_ref(), mutex).await
                    && read.key() == seen.key()
                {
                    return Ok(read);
                }
                Ok(seen)
            }
        }
    }

    async fn close(self) {
        if let Source::Observe { service, .. } = self {
            let _ = service.stop().await;
        }
    }
}

async fn read(reader: &dyn Connection, mutex: &str) -> Result<Snapshot, Failure> {
    let Some(read) = reader.read_owner(mutex) else {
        return Err(Failure::new(
            Status::Internal,
            "this backend has no one-call owner read",
        ));
    };
    let reply = match tokio::time::timeout(READ_BOUND, read).await {
        Ok(r) => r.map_err(|e| Failure::simba(e, "cannot read the owner"))?,
        Err(_) => {
            return Err(Failure::new(
                Status::Unavailable,
                format!("cannot read the owner: no answer within {READ_BOUND:?}"),
            ));
        }
    };
    let owner = Some(reply.owner).filter(|o| o.is_in_lease(reply.now));
    Ok(Snapshot {
        owner,
        now: reply.now,
        backend_time: Some(reply.now),
    })
}

fn observed(owner: &MutexOwner) -> Snapshot {
    Snapshot {
        owner: Some(owner.clone()).filter(MutexOwner::has_owner),
        now: now_ms(),
        backend_time: None,
    }
}

/// Runs `simba owner` (`--permits`: [`permit_holders`]).
pub(crate) async fn owner(backend: Backend, args: OwnerArgs) -> Outcome {
    if args.permits {
        return permit_holders(backend, args).await;
    }
    if args.rwlock {
        return rw_holders(backend, args).await;
    }
    backend.announce_quarantine("`simba exec` would wait").await;
    let mut source = Source::open(&backend, &args.mutex, false).await?;
    let snap = source.first(&args.mutex).await;
    source.close().await;
    let snap = snap?;
    let leases = backend.has_leases();
    let text = if args.json {
        json!({
            "mutex": args.mutex,
            "backend": backend.factory().backend(),
            "owner": snap.owner,
            "fence": snap.owner.as_ref().map(|o| o.fence),
            "now": snap.now,
            "backend_time": snap.backend_time,
        })
        .to_string()
    } else {
        describe(&args.mutex, &snap, leases)
    };
    emit(&text);
    Ok(0)
}

/// Runs `simba owner --permits`: every holder of the semaphore within its lease, and the
/// count they agreed on, in one read.
async fn permit_holders(backend: Backend, args: OwnerArgs) -> Outcome {
    let name = args.mutex.as_str();
    // The count is only needed to open the semaphore: reading its holders asks for none.
    let semaphore = backend
        .conn
        .open_semaphore(name, 1)
        .await
        .map_err(|e| backend.open_failed(e, "--permits", format!("semaphore {name:?}")))?;
    let read = match tokio::time::timeout(READ_BOUND, semaphore.holders()).await {
        Ok(r) => r.map_err(|e| Failure::simba(e, "cannot read the permit holders"))?,
        Err(_) => {
            return Err(Failure::new(
                Status::Unavailable,
                format!("cannot read the permit holders: no answer within {READ_BOUND:?}"),
            ));
        }
    };
    let text = if args.json {
        json!({
            "semaphore": name,
            "backend": backend.factory().backend(),
            "permits": read.permits,
            "holders": read.holders,
            "fences": read.holders.iter().map(|h| h.fence).collect::<Vec<_>>(),
            "now": read.now,
        })
        .to_string()
    } else {
        describe_holders(name, &read, backend.has_leases())
    };
    emit(&text);
    Ok(0)
}

/// Runs `simba owner --rwlock`: the owner of the lock's gate (the writer, or one waiting
/// for the readers to leave, or a reader passing through) and every reader within its
/// lease.
async fn rw_holders(backend: Backend, args: OwnerArgs) -> Outcome {
    let name = args.mutex.as_str();
    let lock = backend
        .conn
        .open_rwlock(name)
        .await
        .map_err(|e| backend.open_failed(e, "--rwlock", format!("read-write lock {name:?}")))?;
    let mut source = Source::open(&backend, name, false).await?;
    let gate = source.first(name).await;
    source.close().await;
    let gate = gate?;
    let readers = match tokio::time::timeout(READ_BOUND, lock.readers()).await {
        Ok(r) => r.map_err(|e| Failure::simba(e, "cannot read the readers"))?,
        Err(_) => {
            return Err(Failure::new(
                Status::Unavailable,
                format!("cannot read the readers: no answer within {READ_BOUND:?}"),
            ));
        }
    };
    let text = if args.json {
        json!({
            "rwlock": name,
            "backend": backend.factory().backend(),
            "gate": gate.owner,
            "readers": readers.holders,
            "now": readers.now,
        })
        .to_string()
    } else {
        describe_rw(name, gate.owner.as_ref(), &readers, backend.has_leases())
    };
    emit(&text);
    Ok(0)
}

/// The text form of `simba owner --rwlock`.
fn describe_rw(
    name: &str,
    gate: Option<&MutexOwner>,
    readers: &simba_core::backend::PermitHolders,
    leases: bool,
) -> String {
    let mut out = match (gate, readers.holders.len()) {
        (None, 0) => return format!("{name}: free"),
        (Some(_), 0) => format!("{name}: written"),
        (None, n) => format!("{name}: read by {n}"),
        (Some(_), n) => format!("{name}: read by {n}, a writer waiting (or a reader passing)"),
    };
    if let Some(g) = gate {
        out.push_str("\n  gate:\n");
        out.push_str(&times(g, readers.now, leases, "    "));
    }
    for h in &readers.holders {
        out.push_str("\n  reader:\n");
        out.push_str(&times(h, readers.now, leases, "    "));
    }
    out
}

/// The text form of `simba owner --permits`.
fn describe_holders(
    semaphore: &str,
    read: &simba_core::backend::PermitHolders,
    leases: bool,
) -> String {
    let (Some(permits), false) = (read.permits, read.holders.is_empty()) else {
        return format!("{semaphore}: no holder");
    };
    let mut out = format!(
        "{semaphore}: {} of {permits} permits held",
        read.holders.len()
    );
    for h in &read.holders {
        out.push('\n');
        out.push_str(&times(h, read.now, leases, "  "));
    }
    out
}

/// `ID (fence F)` and the acquisition and lease times of `o`, relative to `now`, each
/// line after `indent`.
fn times(o: &MutexOwner, now: i64, leases: bool, indent: &str) -> String {
    let rel = |at: i64| {
        let d = at - now;
        if d >= 0 {
            format!("in {}", secs(d))
        } else {
            format!("{} ago", secs(-d))
        }
    };
    let mut out = format!(
        "{indent}{} (fence {})\n{indent}  acquired:   {} ({})",
        o.owner_id,
        o.fence,
        iso(o.acquired_at),
        rel(o.acquired_at)
    );
    if leases {
        out.push_str(&format!(
            "\n{indent}  renews by:  {} ({})\n{indent}  lease ends: {} ({})",
            iso(o.ttl_at),
            rel(o.ttl_at),
            iso(o.transition_at),
            rel(o.transition_at)
        ));
    }
    out
}

/// The text form of `simba owner`.
fn describe(mutex: &str, snap: &Snapshot, leases: bool) -> String {
    let Some(o) = &snap.owner else {
        return format!("{mutex}: no owner");
    };
    let rel = |at: i64| {
        let d = at - snap.now;
        if d >= 0 {
            format!("in {}", secs(d))
        } else {
            format!("{} ago", secs(-d))
        }
    };
    if let Some(by) = o.held_after_release_by() {
        return format!(
            "{mutex}: held until {} ({}) after a release by {by} (fence {}); nobody can take \
             it before then",
            iso(o.transition_at),
            rel(o.transition_at),
            o.fence
        );
    }
    let mut out = format!(
        "{mutex}: owned by {} (fence {})\n  acquired:   {} ({})",
        o.owner_id,
        o.fence,
        iso(o.acquired_at),
        rel(o.acquired_at)
    );
    if leases {
        out.push_str(&format!(
            "\n  renews by:  {} ({})\n  lease ends: {} ({})",
            iso(o.ttl_at),
            rel(o.ttl_at),
            iso(o.transition_at),
            rel(o.transition_at)
        ));
    }
    out
}

/// Runs `simba watch`.
pub(crate) async fn watch(backend: Backend, args: WatchArgs) -> Outcome {
    let mut signals = Signals::new()?;
    let mutex = args.show.mutex.as_str();
    let json = args.show.json;
    backend.announce_quarantine("`simba exec` would wait").await;
    let mut source = Source::open(&backend, mutex, true).await?;
    let first = tokio::select! {
        r = source.first(mutex) => r,
        _ = signals.recv() => {
            source.close().await;
            return Ok(0);
        }
    };
    let mut known = match first {
        Ok(s) => s,
        Err(f) => {
            source.close().await;
            return Err(f);
        }
    };
    if !emit(&line(mutex, "current", &known, None, json)) {
        source.close().await;
        return Ok(0);
    }
    loop {
        let next = tokio::select! {
            r = source.next(mutex) => r,
            _ = signals.recv() => break,
        };
        let snap = match next {
            Ok(s) => s,
            Err(f) => {
                source.close().await;
                return Err(f);
            }
        };
        if snap.key() == known.key() {
            known = snap;
            continue;
        }
        let event = match (&known.owner, &snap.owner) {
            (_, Some(o)) if o.held_after_release_by().is_some() => "held",
            (None, Some(_)) => "acquired",
            (Some(_), None) => "released",
            _ => "changed",
        };
        let ok = emit(&line(mutex, event, &snap, known.owner.as_ref(), json));
        known = snap;
        if !ok {
            break;
        }
    }
    source.close().await;
    Ok(0)
}

/// One line of `simba watch`.
fn line(
    mutex: &str,
    event: &str,
    snap: &Snapshot,
    previous: Option<&MutexOwner>,
    json: bool,
) -> String {
    let at = now_ms();
    if json {
        return json!({
            "time": at,
            "mutex": mutex,
            "event": event,
            "fence": snap.owner.as_ref().map(|o| o.fence),
            "backend_time": snap.backend_time,
            "owner": snap.owner,
            "previous": previous,
        })
        .to_string();
    }
    let who = |o: &MutexOwner| format!("{} (fence {})", o.owner_id, o.fence);
    let what = match (event, &snap.owner, previous) {
        (_, None, Some(p)) => format!("released by {}", who(p)),
        (_, None, None) => "no owner".to_owned(),
        (_, Some(o), _) if o.held_after_release_by().is_some() => format!(
            "released by {} (fence {}), held until {}",
            o.held_after_release_by().unwrap_or_default(),
            o.fence,
            iso(o.transition_at)
        ),
        ("current", Some(o), _) => format!("owned by {}", who(o)),
        (_, Some(o), Some(p)) => format!("taken by {} from {}", who(o), who(p)),
        (_, Some(o), None) => format!("acquired by {}", who(o)),
    };
    format!("{} {mutex} {event}: {what}", iso(at))
}

/// Prints a line on stdout; false when stdout is gone (a closed pipe ends the command).
pub(crate) fn emit(line: &str) -> bool {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|()| out.flush()).is_ok()
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// `1.2s`, `45s`, `3m 20s`.
fn secs(ms: i64) -> String {
    if ms < 60_000 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else {
        format!("{}m {}s", ms / 60_000, (ms % 60_000) / 1000)
    }
}

/// Milliseconds since the epoch as `2026-05-01T12:00:00.123Z` (UTC).
pub(crate) fn iso(ms: i64) -> String {
    let days = ms.div_euclid(86_400_000);
    let rem = ms.rem_euclid(86_400_000);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3_600_000,
        rem / 60_000 % 60,
        rem / 1000 % 60,
        rem % 1000
    )
}

/// Howard Hinnant's days-to-civil algorithm (proleptic Gregorian calendar).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso_times() {
        assert_eq!(iso(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(iso(1_767_225_599_999), "2025-12-31T23:59:59.999Z");
    }

    #[test]
    fn permit_holders_text() {
        let holder = |id: &str, fence| MutexOwner {
            owner_id: id.into(),
            acquired_at: 1_000,
            ttl_at: 11_000,
            transition_at: 17_000,
            fence,
        };
        let read = simba_core::backend::PermitHolders {
            permits: Some(3),
            holders: vec![holder("a", 4), holder("b", 5)],
            now: 3_000,
        };
        let text = describe_holders("s", &read, true);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "s: 2 of 3 permits held", "{text}");
        assert_eq!(lines[1], "  a (fence 4)", "{text}");
        assert!(
            lines[2].contains("acquired:") && lines[2].contains("(2.0s ago)"),
            "{text}"
        );
        assert!(
            lines[4].contains("lease ends:") && lines[4].contains("(in 14.0s)"),
            "{text}"
        );
        assert_eq!(lines[5], "  b (fence 5)", "{text}");
        assert_eq!(lines.len(), 9, "{text}");
        assert_eq!(describe_holders("s", &read, false).lines().count(), 5);
        let none = simba_core::backend::PermitHolders {
            permits: None,
            holders: Vec::new(),
            now: 3_000,
        };
        assert_eq!(describe_holders("s", &none, true), "s: no holder");
    }

    #[test]
    fn rw_holders_text() {
        let owner = |id: &str, fence| MutexOwner {
            owner_id: id.into(),
            acquired_at: 1_000,
            ttl_at: 11_000,
            transition_at: 17_000,
            fence,
        };
        let readers = |ids: &[&str]| simba_core::backend::PermitHolders {
            permits: (!ids.is_empty()).then_some(simba_core::MAX_READERS),
            holders: ids.iter().map(|id| owner(id, 9)).collect(),
            now: 3_000,
        };
        assert_eq!(describe_rw("l", None, &readers(&[]), true), "l: free");
        let gate = owner("w", 12);
        let written = describe_rw("l", Some(&gate), &readers(&[]), false);
        let lines: Vec<&str> = written.lines().collect();
        assert_eq!(
            lines[..3],
            ["l: written", "  gate:", "    w (fence 12)"],
            "{written}"
        );
        let read = describe_rw("l", None, &readers(&["a", "b"]), false);
        assert!(
            read.starts_with("l: read by 2\n  reader:\n    a (fence 9)"),
            "{read}"
        );
        let waiting = describe_rw("l", Some(&gate), &readers(&["a"]), false);
        assert!(
            waiting.starts_with("l: read by 1, a writer waiting (or a reader passing)"),
            "{waiting}"
        );
    }

    #[test]
    fn text_forms() {
        let owner = MutexOwner {
            owner_id: "a".into(),
            acquired_at: 1_000,
            ttl_at: 11_000,
            transition_at: 17_000,
            fence: 4,
        };
        let snap = Snapshot {
            owner: Some(owner.clone()),
            now: 3_000,
            backend_time: Some(3_000),
        };
        let text = describe("m", &snap, true);
        assert!(text.starts_with("m: owned by a (fence 4)"), "{text}");
        assert!(
            text.contains("(2.0s ago)") && text.contains("(in 14.0s)"),
            "{text}"
        );
        let none = Snapshot {
            owner: None,
            now: 0,
            backend_time: None,
        };
        assert_eq!(describe("m", &none, true), "m: no owner");
        let held = MutexOwner {
            owner_id: simba_core::backend::held_owner_id("a"),
            ttl_at: 61_000,
            transition_at: 61_000,
            ..owner.clone()
        };
        let held_snap = Snapshot {
            owner: Some(held),
            now: 1_000,
            backend_time: Some(1_000),
        };
        let text = describe("m", &held_snap, true);
        assert!(
            text.starts_with(
                "m: held until 1970-01-01T00:01:01.000Z (in 1m 0s) after a release by a (fence 4)"
            ),
            "{text}"
        );
        let l = line("m", "held", &held_snap, Some(&owner), false);
        assert!(
            l.ends_with("m held: released by a (fence 4), held until 1970-01-01T00:01:01.000Z"),
            "{l}"
        );
        let l = line("m", "released", &none, Some(&owner), false);
        assert!(l.ends_with("m released: released by a (fence 4)"), "{l}");
        let j: serde_json::Value =
            serde_json::from_str(&line("m", "acquired", &snap, None, true)).expect("json");
        assert_eq!(j["event"], "acquired");
        assert_eq!(j["owner"]["fence"], 4);
        assert_eq!(j["fence"], 4);
        assert_eq!(j["backend_time"], 3_000);
        assert!(j["previous"].is_null());
        let j: serde_json::Value =
            serde_json::from_str(&line("m", "released", &none, Some(&owner), true)).expect("json");
        assert!(j["fence"].is_null() && j["backend_time"].is_null(), "{j}");
    }
}
