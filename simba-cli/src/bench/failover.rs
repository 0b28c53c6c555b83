//! Failover: an owner process (`simba exec` of this very binary) is killed with SIGKILL;
//! a waiter in this process takes over.
//!
//! The figure is the time from the end of the killed owner's lease to the waiter owning.
//! On lease backends the end of the lease is read from the backend right after the kill
//! (the owner's `transition_at` against the backend's clock, so it accounts for the last
//! renewal the owner sent); on ZooKeeper it is the kill plus the session timeout (the
//! server's expiry, approximately: it expires sessions on its tick).
//!
//! Each run is done twice on lease backends: with the library's default jitter of
//! non-owners' wake-ups (what an application gets), and with no jitter (what the
//! mechanism itself costs).

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use serde_json::{Map, Value, json};
use simba_core::connect::Connection;
use simba_core::{DEFAULT_JITTER, Locker};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::Instant;

use super::stats::Samples;
use super::{Ctx, Row, Section, ms, num};
use crate::backend::{Backend, LeaseArgs};
use crate::duration::show;

/// How long the owner process may take to start its command (it then owns).
const START_LIMIT: Duration = Duration::from_secs(30);

/// Bound of the waiter's acquisition.
const ACQUIRE_LIMIT: Duration = Duration::from_secs(60);

/// One failover.
#[derive(Debug, Clone, Copy)]
struct Takeover {
    /// From the end of the lease to the waiter owning (ms, negative if before).
    after_lease_ms: f64,
    /// From the kill to the waiter owning (ms).
    after_kill_ms: f64,
}

pub(super) async fn run(ctx: &Ctx) -> anyhow::Result<Section> {
    let zk = ctx.is_zookeeper();
    let (ttl, transition) = lease(ctx.args.failover_ttl, zk);
    let mut s = Section::default();
    s.json.insert("runs".into(), json!(ctx.args.failover_runs));
    s.json.insert("ttl_ms".into(), ms(ttl));
    s.json.insert("transition_ms".into(), ms(transition));
    s.json.insert(
        "lease_end".into(),
        json!(if zk {
            "approximate: the kill + the session timeout (ttl + transition)"
        } else {
            "from the backend: the killed owner's transition_at (last renewal + ttl + \
             transition), read right after the kill"
        }),
    );
    let modes: &[(&str, Option<(i64, i64)>)] = if zk {
        &[("session", None)]
    } else {
        &[("default", None), ("no_jitter", Some((0, 1)))]
    };
    for (mode, jitter) in modes {
        let waiter = ctx
            .connect(LeaseArgs {
                ttl: Some(ttl),
                transition: Some(transition),
                waiter_poll: Some(ctx.args.poll),
                jitter: *jitter,
            })
            .await?;
        let mut after_lease = Samples::default();
        let mut after_kill = Samples::default();
        for i in 0..ctx.args.failover_runs {
            let t = once(
                ctx,
                &waiter,
                &format!("failover-{mode}-{i}"),
                ttl,
                transition,
            )
            .await
            .with_context(|| format!("failover run {i} ({mode})"))?;
            after_lease.push_value(t.after_lease_ms * 1e3);
            after_kill.push_value(t.after_kill_ms * 1e3);
        }
        let ms_of = |v: Option<f64>| v.map(|us| us / 1e3);
        let mut m = Map::new();
        m.insert("after_lease_p50_ms".into(), num(ms_of(after_lease.p50())));
        m.insert("after_lease_max_ms".into(), num(ms_of(after_lease.max())));
        m.insert("after_kill_p50_ms".into(), num(ms_of(after_kill.p50())));
        let jitter_text = match jitter {
            None if zk => "predecessor watch".to_owned(),
            None => format!(
                "default jitter [{}, {}) ms",
                DEFAULT_JITTER.start, DEFAULT_JITTER.end
            ),
            Some((a, b)) => format!("jitter [{a}, {b}) ms"),
        };
        m.insert("waiter_wakeup".into(), json!(jitter_text));
        m.insert(
            "waiters_poll_ms".into(),
            if waiter.polls() {
                json!(ctx.args.poll.as_millis() as u64)
            } else {
                json!(null)
            },
        );
        let value = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{:.1} ms", v / 1e3));
        s.rows.push(Row::new(
            format!(
                "after {} p50 / max{}",
                if zk { "session expiry" } else { "lease end" },
                if *mode == "no_jitter" {
                    " (no jitter)"
                } else {
                    ""
                }
            ),
            format!(
                "{} / {}",
                value(after_lease.p50()),
                value(after_lease.max())
            ),
            format!(
                "{} runs; lease {} + {}; {jitter_text}{}; after the kill p50 {}",
                ctx.args.failover_runs,
                show(ttl),
                show(transition),
                if waiter.polls() {
                    format!(", waiters poll every {}", show(ctx.args.poll))
                } else {
                    String::new()
                },
                value(after_kill.p50())
            ),
        ));
        if *mode == "no_jitter" {
            s.json.insert("no_jitter".into(), Value::Object(m));
        } else {
            s.json.extend(m);
        }
    }
    Ok(s)
}

/// The killed owner's lease: ttl and half of it as transition; on ZooKeeper a session
/// timeout of at least 2 s (the minimum simba-zookeeper accepts).
fn lease(ttl: Duration, zk: bool) -> (Duration, Duration) {
    let ms = |d: Duration| Duration::from_millis(d.as_millis() as u64);
    let ttl = ms(ttl).max(Duration::from_millis(2));
    let transition = ms(ttl / 2);
    let min = simba_zookeeper_min_session();
    if zk && ttl + transition < min {
        let ttl = ms(min * 2 / 3);
        return (ttl, min - ttl);
    }
    (ttl, transition)
}

fn simba_zookeeper_min_session() -> Duration {
    #[cfg(feature = "zookeeper")]
    {
        simba_zookeeper::MIN_SESSION_TIMEOUT
    }
    #[cfg(not(feature = "zookeeper"))]
    {
        Duration::from_secs(2)
    }
}

/// When the lease of the mutex's owner (not `me`) ends, by the backend's clock read now
/// (the middle of the read, plus what the owner had left).
async fn lease_left(reader: &dyn Connection, mutex: &str, me: &str) -> anyhow::Result<Instant> {
    let sent = Instant::now();
    let Some(read) = reader.read_owner(mutex) else {
        bail!("this backend has no one-call owner read");
    };
    let reply = read.await.context("reading the owner")?;
    let answered = Instant::now();
    let owner = &reply.owner;
    if owner.owner_id.is_empty() || owner.owner_id == me {
        bail!("the killed process did not own the mutex when it was killed");
    }
    let left = Duration::from_millis(u64::try_from(owner.transition_at - reply.now).unwrap_or(0));
    Ok(sent + (answered - sent) / 2 + left)
}

/// Whether `me` owns the mutex already.
async fn taken_by(reader: &dyn Connection, mutex: &str, me: &str) -> bool {
    match reader.read_owner(mutex) {
        Some(read) => read.await.is_ok_and(|r| r.owner.owner_id == me),
        None => false,
    }
}

fn random_below(n: Duration) -> Duration {
    let r = RandomState::new().hash_one(std::time::SystemTime::now());
    let n_ms = n.as_millis().max(1) as u64;
    Duration::from_millis(r % n_ms)
}

async fn once(
    ctx: &Ctx,
    waiter: &Backend,
    what: &str,
    ttl: Duration,
    transition: Duration,
) -> anyhow::Result<Takeover> {
    let mutex = ctx.mutex(what);
    let exe = std::env::current_exe().context("cannot find this program to run `simba exec`")?;
    let mut child = tokio::process::Command::new(exe)
        .env_remove("SIMBA_LOG")
        .env_remove("SIMBA_BACKEND")
        .args(["--backend", &ctx.url, "exec", &mutex])
        .args(["--ttl", &format!("{}ms", ttl.as_millis())])
        .args(["--transition", &format!("{}ms", transition.as_millis())])
        .args(["--", "sh", "-c", "echo $$; exec sleep 600"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("cannot start the owner process (`simba exec`)")?;
    let stdout = child
        .stdout
        .take()
        .context("no stdout of the owner process")?;
    let mut lines = BufReader::new(stdout).lines();
    // The command runs only once `simba exec` owns the mutex: its first line says so.
    let line = match tokio::time::timeout(START_LIMIT, lines.next_line()).await {
        Ok(Ok(Some(line))) => line,
        Ok(_) => bail!("the owner process (`simba exec`) ended before running its command"),
        Err(_) => bail!("the owner process did not acquire the mutex within {START_LIMIT:?}"),
    };
    let command_pid: i32 = line
        .trim()
        .parse()
        .with_context(|| format!("the owner's command printed {line:?}, not its pid"))?;

    // A known id, to tell the waiter's ownership from the killed owner's below.
    let me = simba_core::generate_contender_id();
    let locker = Locker::with_contender_id(waiter.factory(), &mutex, me.clone())?;
    let acquiring =
        tokio::spawn(async move { (locker.acquire_timeout(ACQUIRE_LIMIT).await, Instant::now()) });
    // Kill at a random point of the owner's renewal cycle, once the waiter waits.
    tokio::time::sleep(Duration::from_millis(50) + random_below(ttl)).await;

    // The owner's lease as read right before the kill: on SQLite the waiter may take
    // over before a read after the kill could see the killed owner (the kernel frees the
    // owner's lock file at once); a renewal after this read only makes the lease end later.
    let reader = waiter.has_leases().then(|| waiter.conn.clone());
    let before = match &reader {
        Some(reader) => Some(lease_left(reader.as_ref(), &mutex, &me).await?),
        None => None,
    };
    let killed = Instant::now();
    child.start_kill().context("SIGKILL to the owner process")?;
    kill_group(command_pid);
    let lease_end = match &reader {
        Some(reader) => match lease_left(reader.as_ref(), &mutex, &me).await {
            Ok(end) => end,
            Err(_) if taken_by(reader.as_ref(), &mutex, &me).await => match before {
                Some(end) => end,
                None => bail!("the killed process did not own the mutex when it was killed"),
            },
            Err(e) => return Err(e),
        },
        None => killed + ttl + transition,
    };
    let (acquired, at) = acquiring.await.context("waiter task")?;
    let guard = acquired.context("the waiter did not take over")?;
    let _ = child.wait().await;
    guard.release().await?;
    let signed_ms = |a: Instant, b: Instant| {
        if b >= a {
            (b - a).as_secs_f64() * 1e3
        } else {
            -((a - b).as_secs_f64() * 1e3)
        }
    };
    Ok(Takeover {
        after_lease_ms: signed_ms(lease_end, at),
        after_kill_ms: signed_ms(killed, at),
    })
}

/// SIGKILL to the process group of the owner's command (it runs in its own group).
fn kill_group(pid: i32) {
    use nix::sys::signal::{Signal, killpg};
    use nix::unistd::Pid;
    if pid > 1 {
        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
    }
}
