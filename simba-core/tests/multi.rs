//! `MultiLocker` semantics in paused tokio time over the in-memory store: one canonical
//! order (no deadlock between two orders), nothing held after a give-up or a cancelled
//! acquisition, a loss of any part seen by the guard, a release of every part.

use std::sync::Arc;
use std::time::Duration;

use simba_core::backend::LeaseStore;
use simba_core::fault::{Behavior, FaultStore};
use simba_core::{
    ContendServiceFactory, Error, LeaseConfig, LeaseServiceFactory, Locker, LossReason,
    MAX_MULTI_LOCK_NAMES, MemoryStore, MultiLocker,
};

fn config() -> LeaseConfig {
    LeaseConfig {
        drift_margin: Duration::from_millis(100),
        request_timeout: Duration::from_secs(3),
        retry_interval: Duration::from_millis(100),
        ..LeaseConfig::with_lease(Duration::from_millis(1000), Duration::from_millis(500))
    }
}

fn factory_over<S: LeaseStore>(store: S) -> Arc<dyn ContendServiceFactory> {
    Arc::new(LeaseServiceFactory::new(store, config()).expect("config"))
}

async fn is_free(memory: &MemoryStore, mutex: &str) -> bool {
    !memory.owner(mutex).await.expect("owner").owner.has_owner()
}

#[test]
fn names_are_deduplicated_and_sorted_and_bad_sets_refused() {
    let f = factory_over(MemoryStore::new());
    let m = Locker::all(f.clone(), ["b", "a", "c", "a"]).expect("multi");
    assert_eq!(m.names().collect::<Vec<_>>(), ["a", "b", "c"]);
    let none: [&str; 0] = [];
    assert!(matches!(
        MultiLocker::new(f.clone(), none),
        Err(Error::InvalidConfig {
            field: "mutexes",
            ..
        })
    ));
    let many = (0..=MAX_MULTI_LOCK_NAMES).map(|i| format!("m{i}"));
    let e = MultiLocker::new(f.clone(), many).expect_err("too many");
    assert!(
        matches!(&e, Error::InvalidConfig { field: "mutexes", reason } if reason.contains("32")),
        "{e}"
    );
    // Duplicates do not count against the limit.
    let repeated = (0..100).map(|i| format!("m{}", i % MAX_MULTI_LOCK_NAMES));
    assert_eq!(
        MultiLocker::new(f.clone(), repeated)
            .expect("multi")
            .names()
            .len(),
        MAX_MULTI_LOCK_NAMES
    );
    assert!(matches!(
        MultiLocker::new(f, ["ok", ""]),
        Err(Error::InvalidName { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn two_orders_never_deadlock() {
    let memory = MemoryStore::new();
    let mut tasks = Vec::new();
    for names in [["a", "b"], ["b", "a"]] {
        // Separate factories: two processes.
        let multi = Locker::all(factory_over(memory.clone()), names).expect("multi");
        tasks.push(tokio::spawn(async move {
            for _ in 0..50 {
                let g = multi.acquire().await.expect("acquire");
                assert!(g.is_held());
                tokio::task::yield_now().await;
                g.release().await.expect("release");
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(600), t)
            .await
            .expect("two orders deadlocked")
            .expect("task");
    }
}

#[tokio::test(start_paused = true)]
async fn a_timeout_leaves_no_part_held() {
    let memory = MemoryStore::new();
    let holder = Locker::new(factory_over(memory.clone()), "b").expect("locker");
    let hb = holder.acquire().await.expect("acquire b");
    let multi = Locker::all(factory_over(memory.clone()), ["b", "a"]).expect("multi");
    let e = multi
        .acquire_timeout(Duration::from_millis(700))
        .await
        .expect_err("b is held");
    assert!(
        matches!(&e, Error::Timeout { mutex, waited } if mutex == "b" && *waited == Duration::from_millis(700)),
        "{e}"
    );
    // "a" was won first; the give-up released it before returning.
    assert!(
        is_free(&memory, "a").await,
        "a part stayed held after the timeout"
    );
    let e = multi.try_acquire().await.expect_err("b is held");
    assert!(
        matches!(&e, Error::WouldBlock { mutex } if mutex == "b"),
        "{e}"
    );
    assert!(
        is_free(&memory, "a").await,
        "a part stayed held after try_acquire"
    );
    hb.release().await.expect("release");
    let g = multi.try_acquire().await.expect("both free");
    assert_eq!(g.names().collect::<Vec<_>>(), ["a", "b"]);
    assert!(g.fence("a").is_some_and(|f| f > 0) && g.fence("zz").is_none());
    g.release().await.expect("release");
    assert!(is_free(&memory, "a").await && is_free(&memory, "b").await);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_acquisition_leaves_no_part_held() {
    let memory = MemoryStore::new();
    let holder = Locker::new(factory_over(memory.clone()), "b").expect("locker");
    let hb = holder.acquire().await.expect("acquire b");
    let multi = Locker::all(factory_over(memory.clone()), ["a", "b"]).expect("multi");
    let r = tokio::time::timeout(Duration::from_millis(500), multi.acquire()).await;
    assert!(r.is_err(), "acquired although b is held");
    multi.settled().await;
    assert!(
        is_free(&memory, "a").await,
        "a stayed held after the cancel"
    );
    hb.release().await.expect("release");
}

#[tokio::test(start_paused = true)]
async fn the_loss_of_one_part_is_the_loss_of_the_guard() {
    let memory = MemoryStore::new();
    let faulty = FaultStore::new(memory.clone());
    let a = Locker::new(factory_over(memory.clone()), "a").expect("a");
    let b = Locker::new(factory_over(faulty.clone()), "b").expect("b");
    let multi = MultiLocker::from_lockers([b, a]).expect("multi");
    let g = multi.acquire().await.expect("acquire");
    assert!(g.is_held() && g.valid_for().is_some_and(|d| d > Duration::ZERO));
    faulty.control().set_all(Behavior::Hang);
    let lost = tokio::time::timeout(Duration::from_secs(10), g.lost())
        .await
        .expect("lost() did not fire");
    assert_eq!(lost.mutex, "b");
    assert_eq!(lost.reason, LossReason::LeaseExpired);
    assert!(!g.is_held());
    assert_eq!(g.valid_for(), Some(Duration::ZERO));
    assert!(g.part("a").is_some_and(|p| p.is_held()), "only b was lost");
    let e = g.release().await.expect_err("b had ended");
    assert!(
        matches!(&e, Error::Lost { mutex, .. } if mutex == "b"),
        "{e}"
    );
    assert!(
        is_free(&memory, "a").await,
        "the part still held was not released"
    );
}

#[tokio::test(start_paused = true)]
async fn a_part_lost_while_a_later_one_is_awaited_makes_it_start_over() {
    let memory = MemoryStore::new();
    let faulty = FaultStore::new(memory.clone());
    let holder = Locker::new(factory_over(memory.clone()), "b").expect("locker");
    let hb = holder.acquire().await.expect("acquire b");
    let a = Locker::new(factory_over(faulty.clone()), "a").expect("a");
    let b = Locker::new(factory_over(memory.clone()), "b").expect("b");
    let multi = MultiLocker::from_lockers([a, b]).expect("multi");
    let waiting = tokio::spawn(async move { multi.acquire().await });
    // "a" is taken first, then "b" is awaited.
    while is_free(&memory, "a").await {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let first_a = memory.owner("a").await.expect("owner").owner.fence;
    // "a" goes silent past its lease (its deadline passes), then comes back.
    faulty.control().set_all(Behavior::Hang);
    tokio::time::sleep(Duration::from_secs(3)).await;
    faulty.control().set_all(Behavior::Pass);
    hb.release().await.expect("release b");
    let g = tokio::time::timeout(Duration::from_secs(60), waiting)
        .await
        .expect("the multi-lock did not start over")
        .expect("task")
        .expect("acquire");
    assert!(g.is_held());
    assert!(
        g.fence("a").is_some_and(|f| f > first_a),
        "the lost part was not taken anew: {:?} after fence {first_a}",
        g.fences()
    );
    g.release().await.expect("release");
}
