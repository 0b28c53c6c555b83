//! Starts one private Redis, MariaDB, PostgreSQL, ZooKeeper and etcd from the locally installed
//! binaries, and two PgBouncers (transaction and session mode) in front of that PostgreSQL,
//! writes their `SIMBA_TEST_*` variables to a file (or stdout), then a `READY` line, and
//! keeps them until SIGTERM / SIGINT. `scripts/test.sh` shares them among all test processes
//! this way.
//!
//! With `--redis-sentinel` it starts instead a Redis primary, a replica and three
//! sentinels, and writes `SIMBA_TEST_REDIS_SENTINEL_URL` (for `simba bench` against
//! Sentinel).
//!
//! ```text
//! simba-test-servers [--env-file PATH] [--redis-sentinel]
//! ```

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use simba_test_kit::servers::{self, PGBOUNCER_DIRECT_URL_ENV, PoolMode, ServerKind};
use tokio::signal::unix::{SignalKind, signal};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut env_file = None;
    let mut sentinel = false;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--redis-sentinel" => sentinel = true,
            "--env-file" => match args.next() {
                Some(p) => env_file = Some(p),
                None => return usage(),
            },
            _ => return usage(),
        }
    }
    if sentinel {
        return match servers::redis_sentinel().await {
            Ok(d) => {
                let lines = format!("SIMBA_TEST_REDIS_SENTINEL_URL={}\nREADY\n", d.url());
                serve(env_file.as_deref(), &lines, d).await
            }
            Err(e) => {
                eprintln!("simba-test-servers: Redis Sentinel: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let kinds = [
        ServerKind::Redis,
        ServerKind::Mysql,
        ServerKind::Postgres,
        ServerKind::Zookeeper,
        ServerKind::Etcd,
    ];
    let started = futures_util::future::join_all(kinds.iter().map(|k| servers::private(*k))).await;
    let mut held = Vec::new();
    let mut lines = String::new();
    for (kind, r) in kinds.iter().zip(started) {
        match r {
            Ok(s) => {
                lines.push_str(&format!("{}={}\n", kind.env_var(), s.url()));
                held.push(Arc::new(s));
            }
            Err(e) => {
                eprintln!("simba-test-servers: {kind}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    // PgBouncer in each mode in front of the PostgreSQL above.
    let Some(postgres) = held.iter().find(|s| s.kind() == ServerKind::Postgres) else {
        eprintln!("simba-test-servers: no PostgreSQL among the servers started");
        return ExitCode::FAILURE;
    };
    let postgres = Arc::clone(postgres);
    lines.push_str(&format!("{PGBOUNCER_DIRECT_URL_ENV}={}\n", postgres.url()));
    let mut poolers = Vec::new();
    for mode in [PoolMode::Transaction, PoolMode::Session] {
        match servers::pgbouncer_in_front_of(Arc::clone(&postgres), mode).await {
            Ok(p) => {
                lines.push_str(&format!("{}={}\n", mode.env_var(), p.url()));
                poolers.push(p);
            }
            Err(e) => {
                eprintln!("simba-test-servers: PgBouncer ({}): {e}", mode.as_str());
                return ExitCode::FAILURE;
            }
        }
    }
    lines.push_str("READY\n");
    // The poolers first: each stops its PgBouncer before the PostgreSQL goes.
    serve(env_file.as_deref(), &lines, (poolers, held)).await
}

fn usage() -> ExitCode {
    eprintln!("usage: simba-test-servers [--env-file PATH] [--redis-sentinel]");
    ExitCode::from(64)
}

/// Writes the variables, then keeps `held` (the servers) until SIGTERM / SIGINT.
async fn serve<T>(env_file: Option<&str>, lines: &str, held: T) -> ExitCode {
    let written = match &env_file {
        Some(p) => std::fs::write(p, lines),
        None => std::io::stdout().write_all(lines.as_bytes()),
    };
    if let Err(e) = written {
        eprintln!("simba-test-servers: cannot write the variables: {e}");
        return ExitCode::FAILURE;
    }
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        eprintln!("simba-test-servers: cannot install signal handlers");
        return ExitCode::FAILURE;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    // Dropping the servers stops them (by PID).
    drop(held);
    ExitCode::SUCCESS
}
