//! Usage errors that name what the user typed and what is allowed, without a server: each
//! is refused before anything is contacted.

mod common;

use std::time::Duration;

use common::*;

/// Runs `simba` with `args` (after `--backend URL`) and returns its stderr, asserting the
/// usage status.
fn usage(backend: &str, args: &[&str], what: &str) -> String {
    let out = run(
        simba(Some(backend)).args(args),
        Duration::from_secs(30),
        what,
    );
    assert_eq!(out.status.code(), Some(USAGE), "{what}: {out:?}");
    text(&out.stderr)
}

#[test]
fn watch_with_a_zero_interval_names_the_interval() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    let err = usage(&url, &["watch", "m", "--interval", "0s"], "--interval 0s");
    assert!(
        err.contains("--interval") && err.contains("`0s` is zero") && err.contains("at least 1ms"),
        "{err}"
    );
    assert!(
        !err.contains("--ttl") && !err.contains("--transition"),
        "{err}"
    );
}

#[test]
fn a_lease_too_short_names_ttl_and_transition_not_a_library_setting() {
    let dir = tempdir();
    let url = sqlite_url(dir.path(), "x.db");
    let err = usage(
        &url,
        &[
            "exec",
            "m",
            "--ttl",
            "150ms",
            "--transition",
            "0s",
            "--",
            "true",
        ],
        "--ttl 150ms --transition 0s",
    );
    assert!(
        err.contains("--ttl 150ms --transition 0s")
            && err.contains("ttl + transition = 150ms")
            && err.contains("longer than 200ms"),
        "{err}"
    );
    assert!(!err.contains("drift_margin"), "{err}");
}

#[cfg(feature = "sqlite")]
#[test]
fn a_sqlite_url_without_a_path_asks_for_a_file_only() {
    let err = usage("sqlite://", &["owner", "m"], "sqlite://");
    assert!(
        err.contains("`sqlite://` names no SQLite file") && err.contains("sqlite://PATH"),
        "{err}"
    );
    assert!(!err.contains("memory"), "{err}");
}

#[cfg(feature = "redis")]
#[test]
fn a_redis_database_out_of_range_is_named_with_the_range() {
    // Port 1 on loopback: nothing is contacted, the URL is refused first.
    let err = usage(
        "redis://127.0.0.1:1/99999",
        &["owner", "m"],
        "redis database 99999",
    );
    assert!(
        err.contains("database `99999`") && err.contains("0 to 255"),
        "{err}"
    );
    assert!(!err.contains("Invalid integer"), "{err}");
}
