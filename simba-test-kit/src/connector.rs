//! The check every backend's [`Connector`] must pass, on a real server: a URL goes in, and
//! what comes out is a working backend that a generic tool (the `simba` command, its bench)
//! can use without knowing which one it is.

use std::time::Duration;

#[cfg(feature = "bench")]
use simba_core::connect::Floor;
use simba_core::connect::{ConnectOptions, Connection, Connector, Connectors, Ownership};
use simba_core::{Error, LeaseConfig, Locker};

use crate::support::unique_name;

/// How long one step may take (a connection, an acquisition, a floor): generous, because a
/// loaded CI machine is slow, and a step that hangs must still end the test.
const STEP: Duration = Duration::from_secs(20);

/// What the check expects of a connector beyond the common rules.
#[derive(Debug, Clone, Copy)]
pub struct Expect {
    /// Lease or session.
    pub ownership: Ownership,
    /// What one round trip is called (`"PING"`); checked with the kit's `bench` feature.
    pub round_trip: &'static str,
    /// Whether the server can count its client connections.
    pub counts_connections: bool,
    /// Whether the backend has semaphores (`Connection::open_semaphore`).
    pub semaphores: bool,
}

/// Connects `url` (whose scheme `connector` owns) twice through a [`Connectors`] list
/// holding only `connector`, and checks that:
/// - `url` validates, and its redaction hides `secret` when one is given;
/// - a URL of another scheme is refused with [`Error::InvalidConfig`] naming the forms;
/// - the capabilities match `expect` (leases can be held past release, sessions not);
/// - a [`Locker`] on one connection acquires, and one on the other cannot meanwhile
///   ([`Error::WouldBlock`]);
/// - on a lease backend, the owner read names the guard's contender and fence; a session
///   backend has none;
/// - a semaphore opens on one connection where `expect` says the backend has them, and its
///   one permit, held there, is refused to the same semaphore opened on the other; a
///   backend without semaphores refuses to open one with [`Error::Unsupported`];
/// - with the kit's `bench` feature, every floor of the probe measures, `Floor::RoundTrip`
///   among them (a backend crate's tests enable that feature and the backend's own
///   `bench`);
/// - the server's connection count is there exactly when `expect` says so.
///
/// # Panics
/// On the first check that fails, with what was seen.
pub async fn check(
    connector: &'static dyn Connector,
    url: &str,
    secret: Option<&str>,
    expect: Expect,
) {
    let connectors = Connectors::new(vec![connector]);
    connectors
        .validate(url)
        .unwrap_or_else(|e| panic!("{} refuses its own URL: {e}", connector.name()));
    let shown = connectors.redact(url);
    if let Some(secret) = secret {
        assert!(
            !shown.contains(secret),
            "the redaction kept the secret: {shown}"
        );
    }
    match connectors.find("no-such-scheme://h") {
        Err(Error::InvalidConfig { reason, .. }) => {
            for form in connector.forms() {
                assert!(reason.contains(form), "{reason:?} does not list {form:?}");
            }
        }
        other => panic!(
            "an unknown scheme was not refused: {:?}",
            other.map(|c| c.name())
        ),
    }

    let options = ConnectOptions::new()
        .with_lease(LeaseConfig::with_lease(
            Duration::from_secs(10),
            Duration::from_secs(2),
        ))
        .with_connect_timeout(STEP);
    let connect = || async {
        tokio::time::timeout(STEP, connectors.connect(url, &options))
            .await
            .unwrap_or_else(|_| panic!("{shown}: no connection within {STEP:?}"))
            .unwrap_or_else(|e| panic!("{shown}: {e}"))
    };
    let (a, b) = (connect().await, connect().await);

    let caps = a.capabilities();
    assert_eq!(caps.ownership, expect.ownership, "{shown}");
    assert_eq!(a.factory().check_hold().is_ok(), caps.holds(), "{shown}");

    let mutex = unique_name("connector");
    let guard = tokio::time::timeout(
        STEP,
        Locker::new(a.factory(), &mutex)
            .unwrap_or_else(|e| panic!("{e}"))
            .acquire_timeout(STEP),
    )
    .await
    .unwrap_or_else(|_| panic!("{shown}: no acquisition within {STEP:?}"))
    .unwrap_or_else(|e| panic!("{shown}: not acquired: {e}"));
    let other = Locker::new(b.factory(), &mutex).unwrap_or_else(|e| panic!("{e}"));
    match tokio::time::timeout(STEP, other.try_acquire()).await {
        Ok(Err(Error::WouldBlock { .. })) => {}
        Ok(Ok(_)) => panic!("{shown}: two connections held {mutex} at once"),
        Ok(Err(e)) => panic!("{shown}: try_acquire failed: {e}"),
        Err(_) => panic!("{shown}: try_acquire did not answer within {STEP:?}"),
    }

    match (expect.ownership, b.read_owner(&mutex)) {
        (Ownership::Lease, Some(read)) => {
            let reply = tokio::time::timeout(STEP, read)
                .await
                .unwrap_or_else(|_| panic!("{shown}: no owner read within {STEP:?}"))
                .unwrap_or_else(|e| panic!("{shown}: owner read: {e}"));
            assert!(reply.owner.is_in_lease(reply.now), "{shown}: {reply:?}");
            assert_eq!(reply.owner.owner_id, guard.contender_id(), "{shown}");
            assert_eq!(reply.owner.fence, guard.fence(), "{shown}");
        }
        (Ownership::Session, None) => {}
        (ownership, read) => panic!(
            "{shown}: a {ownership:?} backend {} an owner read",
            if read.is_some() { "has" } else { "lacks" }
        ),
    }
    guard
        .release()
        .await
        .unwrap_or_else(|e| panic!("{shown}: release: {e}"));

    check_semaphore(&shown, &*a, &*b, expect.semaphores).await;

    #[cfg(feature = "bench")]
    check_floors(&shown, &*a, expect.round_trip).await;

    assert!(!a.connections().is_empty(), "{shown}");
    let counted = a.server_connections().await;
    assert_eq!(
        counted.is_some(),
        expect.counts_connections,
        "{shown}: server connections {counted:?}"
    );
    if let Some(n) = counted {
        assert!(
            n >= 2,
            "{shown}: two connected factories, yet {n} connections"
        );
    }
}

/// A one-permit semaphore opened on `a` and on `b`: `a`'s permit keeps `b`'s out until
/// released; or, where the backend has none, [`Error::Unsupported`] from both.
async fn check_semaphore(shown: &str, a: &dyn Connection, b: &dyn Connection, supported: bool) {
    let name = unique_name("connector-sem");
    let open = |c: &'static str, conn| open_semaphore(shown, c, conn, &name);
    if !supported {
        for (c, conn) in [("a", a), ("b", b)] {
            match open(c, conn).await {
                Err(Error::Unsupported { what, .. }) => assert_eq!(what, "semaphores", "{shown}"),
                Err(e) => panic!("{shown}: a backend without semaphores said {e}"),
                Ok(s) => panic!("{shown}: semaphore {} opened", s.name()),
            }
        }
        return;
    }
    let sem_a = open("a", a)
        .await
        .unwrap_or_else(|e| panic!("{shown}: open_semaphore: {e}"));
    let sem_b = open("b", b)
        .await
        .unwrap_or_else(|e| panic!("{shown}: open_semaphore: {e}"));
    assert_eq!(sem_a.permits(), 1, "{shown}");
    let permit = tokio::time::timeout(STEP, sem_a.acquire_timeout(STEP))
        .await
        .unwrap_or_else(|_| panic!("{shown}: no permit within {STEP:?}"))
        .unwrap_or_else(|e| panic!("{shown}: no permit: {e}"));
    assert!(permit.is_held(), "{shown}");
    match tokio::time::timeout(STEP, sem_b.try_acquire()).await {
        Ok(Err(Error::WouldBlock { .. })) => {}
        Ok(Ok(_)) => panic!("{shown}: two holders of a one-permit semaphore"),
        Ok(Err(e)) => panic!("{shown}: try_acquire of a permit failed: {e}"),
        Err(_) => panic!("{shown}: try_acquire of a permit did not answer within {STEP:?}"),
    }
    permit
        .release()
        .await
        .unwrap_or_else(|e| panic!("{shown}: permit release: {e}"));
    let taken = tokio::time::timeout(STEP, sem_b.acquire_timeout(STEP))
        .await
        .unwrap_or_else(|_| panic!("{shown}: the freed permit not taken within {STEP:?}"))
        .unwrap_or_else(|e| panic!("{shown}: the freed permit not taken: {e}"));
    taken
        .release()
        .await
        .unwrap_or_else(|e| panic!("{shown}: permit release: {e}"));
}

/// `conn.open_semaphore(name, 1)`, bounded by [`STEP`].
async fn open_semaphore(
    shown: &str,
    c: &str,
    conn: &dyn Connection,
    name: &str,
) -> simba_core::Result<simba_core::Semaphore> {
    tokio::time::timeout(STEP, conn.open_semaphore(name, 1))
        .await
        .unwrap_or_else(|_| panic!("{shown}: no semaphore on connection {c} within {STEP:?}"))
}

/// Every floor of `conn`'s probe measures once, [`Floor::RoundTrip`] among them.
#[cfg(feature = "bench")]
async fn check_floors(shown: &str, conn: &dyn Connection, round_trip: &str) {
    let mut probe = tokio::time::timeout(STEP, conn.probe(&unique_name("probe")))
        .await
        .unwrap_or_else(|_| panic!("{shown}: no probe within {STEP:?}"))
        .unwrap_or_else(|e| panic!("{shown}: probe: {e}"));
    assert_eq!(probe.round_trip_name(), round_trip, "{shown}");
    let floors = probe.floors();
    assert!(floors.contains(&Floor::RoundTrip), "{shown}: {floors:?}");
    for floor in floors {
        probe
            .measure(floor, STEP)
            .await
            .unwrap_or_else(|e| panic!("{shown}: floor {floor:?}: {e}"));
    }
    probe
        .close()
        .await
        .unwrap_or_else(|e| panic!("{shown}: closing the probe: {e}"));
}
