//! Helpers shared by simba-core's integration tests.

use std::time::Duration;

use simba_core::ContenderStatus;
use tokio::sync::watch;

/// Waits until the status satisfies `f`. Meant for paused time: the 60 s bound is virtual,
/// it only turns a hang into a failure that names `what`.
pub(crate) async fn until(
    rx: &mut watch::Receiver<ContenderStatus>,
    what: &str,
    f: impl FnMut(&ContenderStatus) -> bool,
) {
    tokio::time::timeout(Duration::from_secs(60), rx.wait_for(f))
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
        .expect("service alive");
}
