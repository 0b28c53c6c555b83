//! The permits view and statements, without a database.

use super::view::Header;
use super::*;

fn slot(c: &str, ticket: i64, until: i64, fence: i64) -> Slot {
    Slot {
        contender: c.to_owned(),
        ticket,
        // A holder's acquisition time; a waiter's claim deadline (none).
        acquired_at: i64::from(fence > 0),
        ttl_at: until,
        transition_at: until,
        fence,
    }
}

fn view(holders: Vec<Slot>, waiters: Vec<Slot>, permits: u32) -> View {
    View {
        now: 1000,
        header: Some(Header {
            permits,
            ticket: 7,
            fence: 5000,
        }),
        holders,
        waiters,
        expired: Vec::new(),
    }
}

const LEASE: Lease = Lease {
    ttl: Duration::from_secs(1),
    transition: Duration::ZERO,
};

const CLAIM: i64 = 50;

fn decided(v: &View, who: &str, permits: u32) -> PermitDecision {
    decide(v, who, permits, LEASE, CLAIM)
        .expect("rows simba writes")
        .decision
}

#[test]
fn a_free_permit_goes_to_the_earliest_waiter() {
    let v = view(
        vec![slot("a", 0, 2000, 10)],
        vec![slot("w1", 3, 9000, 0), slot("w2", 4, 9000, 0)],
        2,
    );
    assert!(matches!(
        decided(&v, "w1", 2),
        PermitDecision::Take {
            fence: 5001,
            queued: Some(0),
            ..
        }
    ));
    assert!(matches!(
        decided(&v, "w2", 2),
        PermitDecision::Wait {
            queued: Some(1),
            look_at: 1050,
            ..
        }
    ));
    assert!(matches!(
        decided(&v, "new", 2),
        PermitDecision::Wait { queued: None, .. }
    ));
    // w1 owed, w2 the next.
    assert_eq!(v.wakes(), ["w1", "w2"]);
}

#[test]
fn a_waiter_whose_claim_ended_is_passed_over() {
    let mut late = slot("w1", 3, 9000, 0);
    late.acquired_at = 1000;
    let v = view(
        vec![slot("a", 0, 2000, 10)],
        vec![late, slot("w2", 4, 9000, 0), slot("w3", 5, 9000, 0)],
        2,
    );
    assert_eq!(v.waiters[0].claim_by(), Some(1000));
    assert!(matches!(
        decided(&v, "w2", 2),
        PermitDecision::Take {
            queued: Some(1),
            ..
        }
    ));
    // w1 counts again when it calls.
    assert!(matches!(
        decided(&v, "w1", 2),
        PermitDecision::Take {
            queued: Some(0),
            ..
        }
    ));
    let d = decide(&v, "w3", 2, LEASE, CLAIM).expect("rows simba writes");
    assert_eq!(d.claims, [(1, 1050)]);
    assert_eq!(v.wakes(), ["w2", "w3"]);
}

#[test]
fn never_more_than_n_and_counts_must_agree() {
    let v = view(
        vec![slot("a", 0, 2000, 10), slot("b", 0, 1100, 11)],
        vec![],
        2,
    );
    // The first lease end is sooner than the poll.
    assert!(matches!(
        decided(&v, "c", 2),
        PermitDecision::Wait { look_at: 1100, .. }
    ));
    assert_eq!(
        decided(&v, "c", 3),
        PermitDecision::Mismatch { existing: 2 }
    );
    assert!(matches!(
        decided(&v, "a", 2),
        PermitDecision::Renew { holder: 0, .. }
    ));
    // No holder: the count is the newcomer's.
    let empty = view(vec![], vec![], 2);
    assert!(matches!(
        decided(&empty, "c", 3),
        PermitDecision::Take { .. }
    ));
}

#[test]
fn rows_past_their_time_are_dropped_and_come_last() {
    let mut v = view(vec![slot("a", 0, 2000, 10)], vec![], 1);
    v.expired = vec![slot("old", 0, 900, 9), slot("gone", 2, 1000, 0)];
    let d = decide(&v, "c", 1, LEASE, CLAIM).expect("rows simba writes");
    assert_eq!((d.expired_holders, d.stale_waiters), (vec![1], vec![0]));
    let mut bad_fence = view(vec![slot("a", 0, 2000, -1)], vec![], 1);
    bad_fence.header = None;
    assert!(decide(&bad_fence, "c", 1, LEASE, CLAIM).is_err());
}

#[test]
fn fences_are_floored_by_the_clock() {
    let mut v = view(vec![], vec![], 1);
    v.header = Some(Header::default());
    assert!(matches!(
        decided(&v, "c", 1),
        PermitDecision::Take { fence: 1000, .. }
    ));
}

#[test]
fn statements_have_their_placeholders() {
    for backend in [Backend::Mysql, Backend::Sqlite] {
        let s = PermitSql::new(backend, "simba_mutex");
        assert_eq!(s.insert.matches('?').count(), 8);
        assert_eq!(s.renew.matches('?').count(), 4);
        assert_eq!(s.set_header.matches('?').count(), 4);
    }
    let pg = PermitSql::new(Backend::Postgres, "simba_mutex");
    assert!(pg.insert.contains("$8") && !pg.insert.contains('?'));
    assert!(pg.lock.ends_with("FOR UPDATE"));
    let ddl = create_permits_table_sql(Backend::Sqlite, "a.locks").expect("valid");
    assert!(ddl.starts_with("CREATE TABLE IF NOT EXISTS \"a\".\"locks_permits\""));
}
