//! A fenced write: the protected resource, a PostgreSQL table, keeps the fence of the last
//! write it accepted and refuses a write that carries an older one. An owner that was
//! paused past its lease (a GC pause, a frozen VM) and wakes up believing it still owns
//! cannot overwrite what the next owner wrote: its fence is older.
//!
//! ```sh
//! cargo run -p simba-jdbc --example fenced_write -- postgres://app:secret@localhost/app
//! ```
//!
//! The argument is the database URL (or set `POSTGRES_URL`). The program creates a table
//! `simba_example_report`, writes to it as one owner, then plays a late writer with the
//! previous owner's fence and shows the table refusing it.

use std::process::ExitCode;
use std::sync::Arc;

use simba_core::{LeaseConfig, Locker};
use tokio_postgres::{Client, NoTls};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    let Some(url) = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("POSTGRES_URL").ok())
    else {
        eprintln!(
            "usage: fenced_write POSTGRES_URL, or set POSTGRES_URL \
             (e.g. postgres://app:secret@localhost:5432/app)"
        );
        return ExitCode::from(2);
    };
    match run(&url).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fenced_write: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(url: &str) -> Result<(), BoxError> {
    let factory = simba_jdbc::factory(url, LeaseConfig::default()).await?;
    let locker = Locker::new(Arc::new(factory), "example-report")?;

    let (db, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("fenced_write: the table's connection failed: {e}");
        }
    });
    db.batch_execute(
        "CREATE TABLE IF NOT EXISTS simba_example_report \
             (id INT PRIMARY KEY, body TEXT NOT NULL, fence BIGINT NOT NULL);
         INSERT INTO simba_example_report VALUES (1, '', 0) ON CONFLICT (id) DO NOTHING;",
    )
    .await?;

    // One ownership: its writes carry its fence.
    let guard = locker.acquire().await?;
    let first = guard.fence();
    write(&db, first, "written by the first owner").await?;
    guard.release().await?;

    // The next ownership has a larger fence and writes too.
    let guard = locker.acquire().await?;
    let second = guard.fence();
    write(&db, second, "written by the second owner").await?;

    // The first owner, waking from a pause, still tries to write with its fence.
    write(&db, first, "a late write from the first owner").await?;
    guard.release().await?;
    Ok(())
}

/// Writes `body` if `fence` is not older than the table's: the check is in the statement,
/// so no owner can slip a write in between a check and the write.
async fn write(db: &Client, fence: u64, body: &str) -> Result<(), BoxError> {
    let fence = i64::try_from(fence)?;
    let accepted = db
        .execute(
            "UPDATE simba_example_report SET body = $1, fence = $2 WHERE id = 1 AND fence <= $2",
            &[&body, &fence],
        )
        .await?;
    if accepted == 1 {
        println!("fence {fence}: accepted \"{body}\"");
    } else {
        let row = db
            .query_one("SELECT fence FROM simba_example_report WHERE id = 1", &[])
            .await?;
        let newest: i64 = row.get(0);
        println!("fence {fence}: refused \"{body}\" (the table holds fence {newest})");
    }
    Ok(())
}
