//! Where the memory of many held mutexes goes: `N` contend services of one factory acquire
//! a mutex each (as `simba bench --scenario scale` does), then the live heap is counted by
//! allocation size, next to the tokio tasks alive, the threads and the RSS.
//!
//! ```sh
//! cargo run --release -p simba-cli --example held_memory -- URL [N]
//! ```
//! `URL`: `memory` (the engine over `MemoryStore`), or any backend URL of the binary.
#![allow(missing_docs, unsafe_code, clippy::print_stdout)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use simba_core::connect::{ConnectOptions, Connectors};
use simba_core::{
    ContendService, ContendServiceFactory, LeaseConfig, LeaseServiceFactory, MemoryStore,
    SilentContender,
};

const BUCKET: usize = 16;
const BUCKETS: usize = 4096; // sizes up to 64 KiB by 16 bytes; the last: larger

struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);
static COUNT: AtomicI64 = AtomicI64::new(0);
static BY_SIZE: [AtomicI64; BUCKETS] = [const { AtomicI64::new(0) }; BUCKETS];
static BYTES_BIG: AtomicI64 = AtomicI64::new(0);

fn bucket(size: usize) -> usize {
    (size.div_ceil(BUCKET)).min(BUCKETS - 1)
}

fn add(size: usize, sign: i64) {
    LIVE.fetch_add(sign * size as i64, Ordering::Relaxed);
    COUNT.fetch_add(sign, Ordering::Relaxed);
    let b = bucket(size);
    BY_SIZE[b].fetch_add(sign, Ordering::Relaxed);
    if b == BUCKETS - 1 {
        BYTES_BIG.fetch_add(sign * size as i64, Ordering::Relaxed);
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            add(layout.size(), 1);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        add(layout.size(), -1);
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            add(layout.size(), 1);
        }
        p
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            add(layout.size(), -1);
            add(new_size, 1);
        }
        p
    }
}

unsafe extern "C" {
    /// glibc: per-arena system and in-use bytes, to stderr.
    fn malloc_stats();
}

#[global_allocator]
static GLOBAL: Counting = Counting;

struct Snapshot {
    live: i64,
    count: i64,
    by_size: Vec<i64>,
    big: i64,
}

fn snapshot() -> Snapshot {
    Snapshot {
        live: LIVE.load(Ordering::Relaxed),
        count: COUNT.load(Ordering::Relaxed),
        by_size: BY_SIZE.iter().map(|a| a.load(Ordering::Relaxed)).collect(),
        big: BYTES_BIG.load(Ordering::Relaxed),
    }
}

fn status(field: &str) -> String {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn report(what: &str, n: usize, a: &Snapshot, b: &Snapshot, tasks: (usize, usize)) {
    let per = |v: i64| v as f64 / n as f64;
    println!(
        "{what}: heap live {:.1} MiB (+{:.0} B/mutex, +{:.1} allocations/mutex), RSS {}, threads {}, tasks {} -> {} ({:.2}/mutex)",
        b.live as f64 / 1048576.0,
        per(b.live - a.live),
        per(b.count - a.count),
        status("VmRSS:"),
        status("Threads:"),
        tasks.0,
        tasks.1,
        (tasks.1 as f64 - tasks.0 as f64) / n as f64,
    );
    let mut rows: Vec<(usize, i64)> = (0..BUCKETS)
        .map(|i| (i, b.by_size[i] - a.by_size[i]))
        .filter(|(_, d)| *d != 0)
        .collect();
    rows.sort_by_key(|(i, d)| {
        let bytes = if *i == BUCKETS - 1 {
            b.big - a.big
        } else {
            d * (*i * BUCKET) as i64
        };
        -bytes.abs()
    });
    for (i, d) in rows.into_iter().take(25) {
        let bytes = if i == BUCKETS - 1 {
            b.big - a.big
        } else {
            d * (i * BUCKET) as i64
        };
        println!(
            "  size <= {:>6} B: {:>+8} allocations ({:>+6.2}/mutex), {:>+8.0} B/mutex",
            i * BUCKET,
            d,
            per(d),
            per(bytes)
        );
    }
}

#[tokio::main(worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or_else(|| "memory".to_owned());
    let n: usize = args.next().map_or(Ok(10_000), |s| s.parse())?;
    let lease = LeaseConfig::with_lease(Duration::from_secs(3), Duration::from_millis(1500));
    let mut _conn = None;
    let factory: Arc<dyn ContendServiceFactory> = if url == "memory" {
        Arc::new(LeaseServiceFactory::new(MemoryStore::new(), lease)?)
    } else {
        let connectors = Connectors::new(vec![&simba_jdbc::CONNECTOR, &simba_redis::CONNECTOR]);
        let options = ConnectOptions::new().with_lease(lease);
        let conn = connectors.find(&url)?.connect(&url, &options).await?;
        let f = conn.factory();
        _conn = Some(conn);
        f
    };
    let tasks = || {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    };
    println!(
        "sizes: Sleep {} B, LeaseConfig {} B, StoreEvent {} B, ContenderStatus {} B, MutexState {} B",
        size_of::<tokio::time::Sleep>(),
        size_of::<LeaseConfig>(),
        size_of::<simba_core::backend::StoreEvent>(),
        size_of::<simba_core::ContenderStatus>(),
        size_of::<simba_core::MutexState>(),
    );
    let t_base = tasks();
    let base = snapshot();
    let services: Vec<Arc<dyn ContendService>> = (0..n)
        .map(|i| factory.create_contend_service(&format!("mem-{i}"), Arc::new(SilentContender)))
        .collect::<simba_core::Result<_>>()?;
    let t_created = tasks();
    let created = snapshot();
    report(
        "created, not started (vs before)",
        n,
        &base,
        &created,
        (t_base, t_created),
    );
    let t0 = std::time::Instant::now();
    for batch in services.chunks(250) {
        for s in batch {
            s.start()?;
        }
        for s in batch {
            let mut rx = s.status();
            rx.wait_for(|st| st.held.is_some() || !st.running).await?;
        }
    }
    println!("acquired {n} in {:.1} s", t0.elapsed().as_secs_f64());
    let held = snapshot();
    report(
        "all held (vs created, not started)",
        n,
        &created,
        &held,
        (t_created, tasks()),
    );
    tokio::time::sleep(Duration::from_secs(6)).await;
    let later = snapshot();
    report(
        "after 6 s of renewals (vs created)",
        n,
        &created,
        &later,
        (t_created, tasks()),
    );
    let owning = services
        .iter()
        .filter(|s| s.status().borrow().owns_now())
        .count();
    let lost = services
        .iter()
        .filter(|s| s.status().borrow().last_loss.is_some())
        .count();
    println!("owning {owning}, lost {lost}");
    if std::env::var_os("MALLOC_STATS").is_some() {
        unsafe { malloc_stats() };
    }
    for batch in services.chunks(250) {
        futures_util::future::join_all(batch.iter().map(|s| s.stop())).await;
    }
    Ok(())
}
