//! No secret ever reaches simba's output: every URL form each backend accepts, with a
//! password in every place it can go, through every output (error messages, `-vvv` logs,
//! `owner --json`, `watch`, `bench --json`), on failing and on working connections.

mod common;

use std::process::Output;
use std::time::Duration;

use common::*;
use simba_test_kit::servers;

const SECRET: &str = "S3CRETpw";

/// URLs that cannot connect (port 1 refuses; `notaport` does not parse; a scheme that is
/// not compiled in or does not exist), with the password in the userinfo or the query.
fn unreachable_urls() -> Vec<String> {
    let s = SECRET;
    vec![
        format!("redis://app:{s}@127.0.0.1:1/0"),
        format!("redis://:{s}@127.0.0.1:1"),
        format!("redis://127.0.0.1:1/0?password={s}"),
        format!("valkey://app:{s}@127.0.0.1:1"),
        format!("redis-cluster://app:{s}@127.0.0.1:1"),
        format!(
            "redis-sentinel://app:{s}@127.0.0.1:1/0?sentinelServiceName=m&sentinelUsername=su&sentinelPassword={s}"
        ),
        format!("rediss://app:{s}@127.0.0.1:1"),
        format!("mysql://app:{s}@127.0.0.1:1/db"),
        format!("mysql://app@127.0.0.1:1/db?password={s}"),
        format!("mariadb://app:{s}@127.0.0.1:1/db"),
        format!("postgres://app:{s}@127.0.0.1:1/db"),
        format!("postgresql://app@127.0.0.1:1/db?password={s}&sslmode=disable"),
        format!("postgres://app:{s}@127.0.0.1:notaport/db"),
        format!("mysql://app:{s}@127.0.0.1:notaport/db"),
        format!("redis://app:{s}@127.0.0.1:notaport"),
        format!("zk://app:{s}@127.0.0.1:notaport/c"),
        format!("zk://{s}@127.0.0.1:2181/c"),
        format!("bogus://app:{s}@h/x?token={s}"),
    ]
}

/// `url` with `user:SECRET@` in its userinfo (replacing any given user and password).
fn with_password(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let scheme = if scheme.is_empty() { "zk" } else { scheme };
    format!("{scheme}://{user}:{SECRET}@{host}")
}

fn assert_no_secret(out: &Output, what: &str) {
    let all = format!("{}\n{}", text(&out.stdout), text(&out.stderr));
    assert!(
        !all.contains(SECRET),
        "{what} printed the password ({:?}):\n{all}",
        out.status
    );
}

fn check(url: &str, args: &[&str], limit: Duration) -> Output {
    let what = format!("simba {args:?} on {url}");
    let out = run(simba(Some(url)).args(args), limit, &what);
    assert_no_secret(&out, &what);
    out
}

#[test]
fn failing_connections_never_print_a_password() {
    let limit = Duration::from_secs(60);
    for url in unreachable_urls() {
        let m = mutex_name("secret-fail");
        let out = check(&url, &["-vvv", "owner", &m, "--json"], limit);
        assert!(!out.status.success(), "{url}: owner should fail");
        check(
            &url,
            &["-vvv", "exec", "--timeout", "1s", &m, "--", "true"],
            limit,
        );
        check(&url, &["-vvv", "watch", &m], limit);
        check(
            &url,
            &[
                "bench",
                "--json",
                "--scenario",
                "uncontended",
                "--iterations",
                "2",
            ],
            limit,
        );
    }
}

/// Working connections with a password in the URL: PostgreSQL (the kit's server trusts
/// loopback, so any password is accepted), ZooKeeper (digest credentials from the URL),
/// and servers that refuse the password (Redis without `requirepass`, MariaDB's root).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn working_connections_never_print_a_password() {
    let pg = servers::postgres().await.expect("a PostgreSQL server");
    let zk = servers::zookeeper().await.expect("a ZooKeeper server");
    let redis = servers::redis().await.expect("a Redis server");
    let mysql = servers::mysql().await.expect("a MySQL/MariaDB server");
    let pg_url = with_password(pg.url(), "postgres");
    let pg_query_url = format!("{}?password={SECRET}", pg.url());
    // In a chroot of its own: nodes made with digest credentials get a creator-only ACL,
    // which would lock other tests on the shared server out of the default root.
    let zk_url = format!(
        "{}/secrets-{}",
        with_password(zk.url(), "app"),
        mutex_name("chroot")
    );
    let refused = [
        with_password(redis.url(), "default"),
        with_password(mysql.url(), "root"),
    ];
    tokio::task::spawn_blocking(move || {
        let limit = Duration::from_secs(60);
        for url in [&pg_url, &pg_query_url, &zk_url] {
            let m = mutex_name("secret-ok");
            let out = check(url, &["-vvv", "exec", &m, "--", "true"], limit);
            assert!(out.status.success(), "{url}: exec failed: {out:?}");
            let out = check(url, &["-vvv", "owner", &m, "--json"], limit);
            assert!(out.status.success(), "{url}: owner failed: {out:?}");
        }
        let out = check(
            &pg_url,
            &[
                "-vvv",
                "bench",
                "--json",
                "--scenario",
                "uncontended",
                "--iterations",
                "3",
            ],
            limit,
        );
        assert!(out.status.success(), "bench failed: {out:?}");
        assert!(
            text(&out.stdout).contains("\"url\":\"postgres://postgres:***@"),
            "bench --json names the redacted URL: {}",
            text(&out.stdout)
        );
        for url in &refused {
            let m = mutex_name("secret-refused");
            check(url, &["-vvv", "owner", &m, "--json"], limit);
            check(
                url,
                &["-vvv", "exec", "--timeout", "2s", &m, "--", "true"],
                limit,
            );
        }
    })
    .await
    .expect("test body");
}
