//! A mixed fleet: contenders that speak the JVM Simba's Redis protocol and simba contenders
//! on one mutex are served in arrival order both ways, and never own it at once.
//!
//! The JVM side is written here from the protocol's description: `SET P:{M} <id> NX PX
//! <lease>`; on failure `ZADD P:{M}:contender NX <TIME seconds> <id>` and a subscription to
//! `P:{M}:<id>`; release = owner-checked `DEL`, then `ZREM` of the lowest-scored waiter and
//! `PUBLISH P:{M}:<that waiter> released@@<owner>`.
//!
//! The test runs 20 s. A longer run (e.g. the 60 s of the original report):
//! `SIMBA_JVM_FLEET_SECS=60 cargo nextest run -p simba-redis --test jvm_fleet`.

// Tests fail by panicking; unwrap on a setup step is the clearest report.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{cmd, raw, test_config};
use fred::interfaces::{ClientLike, EventInterface, PubsubInterface};
use fred::types::scripts::Script;
use simba_core::{ContendService, LeaseServiceFactory, LossReason};
use simba_redis::RedisStore;
use simba_test_kit::history::{History, Violation};
use simba_test_kit::support::{init_tracing, lease, unique_name};
use tokio::time::Instant;

/// How long each owner holds the mutex, and rests before contending again.
const HOLD: Duration = Duration::from_millis(20);
const REST: Duration = Duration::from_millis(30);

/// The JVM contenders' lease (`PX`), the same as the simba contenders' ttl + transition.
const LEASE_MS: u64 = 3000;

const JVM_ACQUIRE: &str = r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    redis.call('ZREM', KEYS[2], ARGV[1])
    redis.call('PUBLISH', KEYS[1], 'acquired@@' .. ARGV[1])
    return 1
end
redis.call('ZADD', KEYS[2], 'NX', redis.call('TIME')[1], ARGV[1])
return 0
";

const JVM_RELEASE: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return 0
end
redis.call('DEL', KEYS[1])
local head = redis.call('ZRANGE', KEYS[2], 0, 0)
if #head > 0 then
    redis.call('ZREM', KEYS[2], head[1])
    redis.call('PUBLISH', KEYS[1] .. ':' .. head[1], 'released@@' .. ARGV[1])
end
return 1
";

/// One JVM-protocol contender: takes the mutex whenever it can until `end`.
async fn jvm_contender(url: String, owner_key: String, id: String, history: History, end: Instant) {
    let keys = vec![owner_key.clone(), format!("{owner_key}:contender")];
    let commands = raw(&url).await;
    let subscriber = raw(&url).await;
    let channel = format!("{owner_key}:{id}");
    let mut messages = subscriber.message_rx();
    subscriber.subscribe(channel.clone()).await.unwrap();
    let acquire = Script::from_lua(JVM_ACQUIRE);
    let release = Script::from_lua(JVM_RELEASE);
    let mut n: u64 = 0;
    while Instant::now() < end {
        let got: i64 = acquire
            .evalsha_with_reload(
                &commands,
                keys.clone(),
                vec![id.clone(), LEASE_MS.to_string()],
            )
            .await
            .unwrap();
        if got == 1 {
            history.begin(&id, 0);
            tokio::time::sleep(HOLD).await;
            history.end(&id, LossReason::Released);
            let _: i64 = release
                .evalsha_with_reload(&commands, keys.clone(), vec![id.clone()])
                .await
                .unwrap();
            tokio::time::sleep(REST).await;
            continue;
        }
        // Queued: wait for a release message for us, or (as the JVM's timer does) look
        // again when the owner's lease could have ended, plus some jitter.
        let pttl = cmd(&commands, "PTTL", &[&owner_key])
            .await
            .as_i64()
            .unwrap_or(0);
        n += 1;
        let jitter = (n * 7919 + id.len() as u64 * 131) % 500;
        let wait = Duration::from_millis(u64::try_from(pttl.max(0)).unwrap_or(0) + jitter);
        let wake = (Instant::now() + wait).min(end);
        loop {
            match tokio::time::timeout_at(wake, messages.recv()).await {
                Ok(Ok(m)) if m.channel == channel => break,
                Ok(Ok(_)) => continue,
                Ok(Err(_)) | Err(_) => break,
            }
        }
    }
    let _ = subscriber.quit().await;
    let _ = commands.quit().await;
}

/// One simba contender: a contend service of its own store, started, held for [`HOLD`] once
/// acquired, stopped (released), rested and started again until `end`.
async fn simba_contender(url: String, prefix: String, id: String, history: History, end: Instant) {
    let store = RedisStore::connect(test_config(&url, &prefix))
        .await
        .unwrap();
    let factory =
        LeaseServiceFactory::new(store, lease(Duration::from_secs(2), Duration::from_secs(1)))
            .unwrap();
    let svc = factory
        .contend_service(MUTEX, history.contender(id))
        .unwrap();
    while Instant::now() < end {
        svc.start().unwrap();
        let mut status = svc.status();
        let held = matches!(
            tokio::time::timeout_at(end, status.wait_for(|s| s.held.is_some())).await,
            Ok(Ok(_))
        );
        if !held {
            break;
        }
        tokio::time::sleep(HOLD).await;
        svc.stop().await.unwrap();
        tokio::time::sleep(REST).await;
    }
    svc.stop().await.unwrap();
}

const MUTEX: &str = "fleet";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jvm_and_simba_contenders_share_one_mutex_fairly() {
    init_tracing();
    let server = simba_test_kit::servers::redis()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let url = server.url().to_owned();
    let prefix = unique_name("t");
    let owner_key = RedisStore::connect(test_config(&url, &prefix))
        .await
        .unwrap()
        .owner_key(MUTEX);
    let secs = std::env::var("SIMBA_JVM_FLEET_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let end = Instant::now() + Duration::from_secs(secs);
    let history = History::new();

    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..3 {
        tasks.spawn(jvm_contender(
            url.clone(),
            owner_key.clone(),
            format!("jvm-{i}"),
            history.clone(),
            end,
        ));
    }
    for i in 0..2 {
        tasks.spawn(simba_contender(
            url.clone(),
            prefix.clone(),
            format!("simba-{i}"),
            history.clone(),
            end,
        ));
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }

    let intervals = history.intervals();
    let simba = intervals
        .iter()
        .filter(|i| i.contender.starts_with("simba-"))
        .count();
    let total = intervals.len();
    println!(
        "{secs} s: {total} ownerships, {simba} by simba, {} by JVM-protocol contenders",
        total - simba
    );
    // The JVM protocol has no fences (its intervals carry 0): only overlaps are checked.
    let overlaps: Vec<Violation> = history
        .violations()
        .into_iter()
        .filter(|v| matches!(v, Violation::Overlap { .. }))
        .collect();
    assert!(overlaps.is_empty(), "{overlaps:?}");
    assert!(total >= 50, "only {total} ownerships in {secs} s");
    // In arrival order each of the five gets about a fifth: simba's two about 40 %.
    assert!(
        simba * 4 >= total,
        "simba got {simba} of {total} ownerships (less than 25 %)"
    );
}
