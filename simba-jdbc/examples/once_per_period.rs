//! A job that runs at most once per period, however many hosts start it: run this program
//! from cron on every host, a little more often than the period. The first host to start
//! in a period runs the job; the mutex then stays held until the period has passed since
//! that start (a *hold*, ShedLock's `lockAtLeastFor`), so every other start in the period
//! skips it, on the database's clock whatever the hosts' clocks say.
//!
//! ```sh
//! cargo run -p simba-jdbc --example once_per_period -- postgres://app:secret@localhost/app
//! POSTGRES_URL=postgres://… cargo run -p simba-jdbc --example once_per_period -- - nightly-export
//! ```
//!
//! Arguments: the database URL (or `-` to read `POSTGRES_URL`) and the job's name
//! (`nightly-export`). Any simba-jdbc URL works (`mysql://…`, `sqlite://…`); a hold needs
//! a lease backend, which every SQL database is.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use simba_core::{Error, LeaseConfig, Locker};

/// The job runs at most once per this period.
const PERIOD: Duration = Duration::from_secs(10 * 60);

#[tokio::main]
async fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let url = match args.next().filter(|a| a != "-") {
        Some(url) => url,
        None => match std::env::var("POSTGRES_URL") {
            Ok(url) => url,
            Err(_) => {
                eprintln!(
                    "usage: once_per_period DATABASE_URL [JOB], or set POSTGRES_URL \
                     (e.g. postgres://app:secret@localhost:5432/app)"
                );
                return ExitCode::from(2);
            }
        },
    };
    let job = args.next().unwrap_or_else(|| "nightly-export".to_owned());
    match run(&url, &job).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("once_per_period: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(url: &str, job: &str) -> simba_core::Result<()> {
    // Connects, and creates simba's table if it is not there.
    let factory = simba_jdbc::factory(url, LeaseConfig::default()).await?;
    let locker = Locker::new(Arc::new(factory), job)?;
    match locker.try_acquire().await {
        Ok(guard) => {
            println!("{job}: running with fence {}", guard.fence());
            tokio::select! {
                reason = guard.lost() => {
                    // The ownership ended (the database was out of reach until the local
                    // deadline): the job stops here, unprotected work is not finished.
                    eprintln!("{job}: lost the mutex ({reason}); stopped");
                    return Ok(());
                }
                () = export(guard.fence()) => {}
            }
            // Nobody, this host included, takes the mutex until PERIOD after it was
            // acquired; nothing renews it meanwhile, and a crash now changes nothing.
            guard.release_at_least(PERIOD).await?;
            println!(
                "{job}: done; held until {} s after it began",
                PERIOD.as_secs()
            );
        }
        Err(Error::WouldBlock { .. }) => {
            println!("{job}: skipped: it ran (or is running) elsewhere this period");
        }
        Err(e) => return Err(e),
    }
    Ok(())
}

/// The job itself.
async fn export(fence: u64) {
    println!("exporting under fence {fence}");
    tokio::time::sleep(Duration::from_millis(200)).await;
}
