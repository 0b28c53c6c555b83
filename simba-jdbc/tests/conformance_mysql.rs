//! The simba conformance suite against mysql.
#![allow(missing_docs)]
#![cfg(feature = "mysql")]

mod common;

simba_test_kit::conformance_tests!(common::SqlHarness::mysql().await);

/// The suite on a table the JVM Simba library made (issue #27): what `migrate()` makes of
/// it must behave like simba's own table.
mod jvm_table {
    use super::common;

    simba_test_kit::conformance_tests!(common::SqlHarness::mysql().await.on_jvm_table().await);
}

/// The lease clock of MySQL / MariaDB does not follow the session's time zone: on a session
/// in `America/New_York` whose clock is stepped across the autumn change (the hour
/// 01:00–02:00 local happens twice), it equals the true UTC epoch milliseconds and never
/// goes back. The old expression `UNIX_TIMESTAMP(NOW(3))` reads an hour off in the repeated
/// hour; the test checks that too, so that it shows the zone was really in effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mysql_lease_clock_ignores_the_session_time_zone() {
    use mysql_async::prelude::Queryable;

    let server = simba_test_kit::servers::mysql()
        .await
        .unwrap_or_else(|e| panic!("no MySQL/MariaDB for the tests: {e}"));
    let mut conn = mysql_async::Conn::from_url(common::tcp_only(server.url()))
        .await
        .expect("connect");
    load_new_york(&mut conn).await;
    conn.query_drop("SET time_zone = 'America/New_York'")
        .await
        .expect("the zone tables know America/New_York");

    let clock = simba_jdbc::lease_clock_sql(simba_jdbc::Backend::Mysql);
    let old = "CAST(ROUND(UNIX_TIMESTAMP(NOW(3)) * 1000) AS SIGNED)";
    // 2025-11-02 06:00:00 UTC: New York goes from 02:00 EDT back to 01:00 EST.
    let change: i64 = 1_762_063_200;
    let mut last = i64::MIN;
    let mut old_was_off = false;
    for step in -24..=24 {
        // Every 5 minutes and a bit, two hours either side, with milliseconds.
        let true_ms = (change + step * 301) * 1000 + 250;
        conn.query_drop(format!(
            "SET timestamp = {}.{:03}",
            true_ms / 1000,
            true_ms % 1000
        ))
        .await
        .expect("set the session clock");
        let (now, old_now): (i64, i64) = conn
            .query_first(format!("SELECT {clock}, {old}"))
            .await
            .expect("read the clock")
            .expect("one row");
        assert_eq!(now, true_ms, "the lease clock at step {step}");
        assert!(now > last, "the lease clock went back at step {step}");
        last = now;
        old_was_off |= old_now != true_ms;
    }
    assert!(
        old_was_off,
        "UNIX_TIMESTAMP(NOW(3)) was never off: the session zone was not in effect"
    );
}

/// Loads the time zone `America/New_York` into the server's zone tables (once per server).
async fn load_new_york(conn: &mut mysql_async::Conn) {
    use mysql_async::prelude::Queryable;

    let known: Option<i64> = conn
        .query_first("SELECT COUNT(*) FROM mysql.time_zone_name WHERE Name = 'America/New_York'")
        .await
        .expect("read the zone tables");
    if known.unwrap_or(0) > 0 {
        return;
    }
    let out = tokio::process::Command::new("mariadb-tzinfo-to-sql")
        .args(["/usr/share/zoneinfo/America/New_York", "America/New_York"])
        .output()
        .await
        .expect("mariadb-tzinfo-to-sql (package mariadb-server) and tzdata are installed");
    assert!(out.status.success(), "mariadb-tzinfo-to-sql: {out:?}");
    let sql = String::from_utf8(out.stdout).expect("UTF-8 SQL");
    conn.query_drop("USE mysql").await.expect("use mysql");
    conn.query_drop(sql).await.expect("load the zone");
}
