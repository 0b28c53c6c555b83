//! The check every backend's [`Connector`] must pass, on a real server: a URL goes in, and
//! what comes out is a working backend that a generic tool (the `simba` command, its bench)
//! can use without knowing which one it is.

use std::time::Duration;

use simba_core::connect::{ConnectOptions, Connector, Connectors, Floor, Ownership};
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
    /// What one round trip is called (`"PING"`).
    pub round_trip: &'static str,
    /// Whether the server can count its client connections.
    pub counts_connections: bool,
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
/// - every floor of the probe measures, [`Floor::RoundTrip`] among them;
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

    let mut probe = tokio::time::timeout(STEP, a.probe(&unique_name("probe")))
        .await
        .unwrap_or_else(|_| panic!("{shown}: no probe within {STEP:?}"))
        .unwrap_or_else(|e| panic!("{shown}: probe: {e}"));
    assert_eq!(probe.round_trip_name(), expect.round_trip, "{shown}");
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
