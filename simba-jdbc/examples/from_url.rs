//! A service that takes its backend from one URL in its configuration, and so works on
//! any backend it was built with: Redis, PostgreSQL, MariaDB/MySQL, SQLite or ZooKeeper.
//! Each backend crate owns its URL schemes ([`simba_core::connect::Connector`]); the
//! program keeps a list of those it links and connects whatever the URL names.
//!
//! ```sh
//! LOCK_URL=sqlite:///tmp/locks.db cargo run -p simba-jdbc --example from_url
//! cargo run -p simba-jdbc --example from_url -- redis://127.0.0.1:6379
//! ```
//!
//! The argument is the URL (or set `LOCK_URL`).

use std::process::ExitCode;
use std::time::Duration;

use simba_core::Locker;
use simba_core::connect::{ConnectOptions, Connector, Connectors};

#[tokio::main]
async fn main() -> ExitCode {
    let connectors = Connectors::new(built_with());
    let Some(url) = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("LOCK_URL").ok())
    else {
        eprintln!(
            "usage: from_url URL, or set LOCK_URL; URL is one of: {}",
            connectors.forms()
        );
        return ExitCode::from(2);
    };
    match run(&connectors, &url).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Errors never carry the URL's password.
            eprintln!("from_url: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The backends this program links.
fn built_with() -> Vec<&'static dyn Connector> {
    vec![
        &simba_jdbc::CONNECTOR,
        &simba_redis::CONNECTOR,
        &simba_zookeeper::CONNECTOR,
    ]
}

async fn run(connectors: &Connectors, url: &str) -> simba_core::Result<()> {
    // Safe to log: the password is masked (`postgres://app:***@db/app`).
    println!("locks on {}", connectors.redact(url));
    // An unknown scheme or a bad option is `Error::InvalidConfig` before any connection.
    let backend = connectors.connect(url, &ConnectOptions::new()).await?;
    println!("connected: {:?}", backend.capabilities());

    let locker = Locker::new(backend.factory(), "from-url-job")?;
    let guard = locker.acquire_timeout(Duration::from_secs(30)).await?;
    println!("owner of from-url-job with fence {}", guard.fence());
    guard.release().await?;
    println!("released");
    Ok(())
}
