//! `simba` against PostgreSQL and MySQL/MariaDB servers.

mod common;

use common::*;
use simba_test_kit::servers;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_owner_and_watch_on_postgres() {
    let server = servers::postgres().await.expect("a PostgreSQL server");
    let url = server.url().to_owned();
    tokio::task::spawn_blocking(move || {
        concurrent_execs_never_overlap(Some(&url), &[], 2, "0.3", "pg-overlap");
        owner_and_watch_follow_exec(&url, "pg-show");
        not_acquired_while_held(&url, "pg-held");
    })
    .await
    .expect("test body");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_owner_and_watch_on_mysql() {
    let server = servers::mysql().await.expect("a MySQL/MariaDB server");
    let url = server.url().to_owned();
    tokio::task::spawn_blocking(move || {
        concurrent_execs_never_overlap(Some(&url), &[], 2, "0.3", "mysql-overlap");
        owner_and_watch_follow_exec(&url, "mysql-show");
        not_acquired_while_held(&url, "mysql-held");
    })
    .await
    .expect("test body");
}
