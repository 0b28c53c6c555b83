//! The permits view and statements, without a database.

use super::view::Header;
use super::*;

fn slot(c: &str, ticket: i64, until: i64, fence: i64) -> Slot {
    Slot {
        contender: c.to_owned(),
        ticket,
        acquired_at: 1,
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

fn decided(v: &View, who: &str, permits: u32) -> PermitDecision {
    decide(v, who, permits, LEASE)
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
            look_at: 1250,
            ..
        }
    ));
    assert!(matches!(
        decided(&v, "new", 2),
        PermitDecision::Wait { queued: None, .. }
    ));
    assert_eq!(v.owed().collect::<Vec<_>>(), ["w1"]);
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
    let d = decide(&v, "c", 1, LEASE).expect("rows simba writes");
    assert_eq!((d.expired_holders, d.stale_waiters), (vec![1], vec![0]));
    let mut bad_fence = view(vec![slot("a", 0, 2000, -1)], vec![], 1);
    bad_fence.header = None;
    assert!(decide(&bad_fence, "c", 1, LEASE).is_err());
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
