//! A worker that works only while it is the leader, on Redis. Start it on several hosts (or
//! in several shells): one works, the others wait; stop the leader with Ctrl-C and another
//! takes over at once (the release is pushed to it), or kill it and another takes over
//! when its lease ends. Ctrl-C stops the work, then releases the mutex, then exits.
//!
//! ```sh
//! cargo run -p simba-redis --example leader_worker -- redis://127.0.0.1:6379
//! ```
//!
//! Arguments: the Redis URL (or `-` to read `REDIS_URL`) and the mutex name
//! (`leader-worker`).

use std::process::ExitCode;
use std::time::Duration;

use simba_core::{LeaderScheduler, LeaseConfig, Schedule, WorkContext};

#[tokio::main]
async fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let url = match args.next().filter(|a| a != "-") {
        Some(url) => url,
        None => match std::env::var("REDIS_URL") {
            Ok(url) => url,
            Err(_) => {
                eprintln!(
                    "usage: leader_worker REDIS_URL [MUTEX], or set REDIS_URL \
                     (e.g. redis://127.0.0.1:6379)"
                );
                return ExitCode::from(2);
            }
        },
    };
    let mutex = args.next().unwrap_or_else(|| "leader-worker".to_owned());
    match run(&url, &mutex).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leader_worker: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(url: &str, mutex: &str) -> Result<(), Box<dyn std::error::Error>> {
    // Simba's timing: ttl 10 s, transition 6 s.
    let factory = simba_redis::factory(url, LeaseConfig::default()).await?;
    let every_second = Schedule::FixedDelay {
        initial_delay: Duration::ZERO,
        delay: Duration::from_secs(1),
    };
    let scheduler = LeaderScheduler::new(&factory, mutex, every_second, work)?;
    scheduler.start()?;
    println!("{mutex}: contending (Ctrl-C stops)");

    tokio::signal::ctrl_c().await?;
    // Cancels the running work, then releases the mutex: the next leader starts at once.
    scheduler.stop().await?;
    println!("{mutex}: stopped, mutex released");
    Ok(())
}

/// One run of the work; runs only while this process leads.
async fn work(ctx: WorkContext) {
    if ctx.run == 0 {
        println!("{}: leader now, fence {}", ctx.mutex, ctx.fence);
    }
    println!("working as leader (run {})", ctx.run);
    tokio::select! {
        // Leadership ended (or the scheduler stops): stop before the next step. The
        // scheduler also aborts this run at its next `.await`.
        () = ctx.cancelled() => println!("leadership ended: work stopped"),
        () = tokio::time::sleep(Duration::from_millis(300)) => {}
    }
}
