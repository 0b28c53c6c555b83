#![doc = include_str!("../README.md")]

/// `eprintln!` that never panics: a closed stderr (the reader of a pipe gone) must not turn
/// simba's exit status into a panic's.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod backend;
mod bench;
mod cgroup;
mod child;
mod cli;
mod duration;
mod exec;
mod guardian;
mod permits;
mod show;
mod signals;
mod status;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

use crate::cli::{Cli, Command};
use crate::status::{Failure, Outcome, Status};

fn main() -> ExitCode {
    // `simba exec`'s guardian (simba started again by itself): no command line of clap's.
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == guardian::ARG)
    {
        return guardian::main();
    }
    // Its helpers: the cgroup's watcher, and the command's own start.
    match std::env::args_os().nth(1) {
        Some(a) if a == guardian::WATCHER_ARG => return guardian::watcher_main(),
        Some(a) if a == guardian::START_ARG => return guardian::start_main(),
        _ => {}
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help / --version go to stdout with 0; real usage errors get 64.
            let code = if e.use_stderr() {
                Status::Usage.code()
            } else {
                0
            };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    init_logging(cli.verbose);
    let code = match run(cli) {
        Ok(code) => code,
        Err(f) => {
            say!("simba: {}", status::describe(&f.error));
            f.status.code()
        }
    };
    ExitCode::from(code)
}

fn run(cli: Cli) -> Outcome {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Failure::with(Status::Internal, e, "cannot start the async runtime"))?;
    let outcome = runtime.block_on(dispatch(cli));
    // Background tasks (a release in flight, blocking SQLite calls) get a moment, no more.
    runtime.shutdown_timeout(Duration::from_millis(500));
    outcome
}

async fn dispatch(cli: Cli) -> Outcome {
    let url = backend::resolve_url(cli.backend.as_deref())?;
    match cli.command {
        Command::Exec(args) => {
            args.lease.check().map_err(Failure::usage)?;
            exec::check_names(&args)?;
            let timing = backend::LeaseArgs {
                ttl: args.lease.ttl,
                transition: args.lease.transition,
                ..backend::LeaseArgs::default()
            };
            exec::run(connect(&url, timing).await?, args, cli.verbose > 0).await
        }
        Command::Owner(args) => show::owner(connect(&url, Default::default()).await?, args).await,
        Command::Watch(args) => {
            // The observer reads at --interval where the backend cannot push changes.
            let timing = backend::LeaseArgs {
                waiter_poll: Some(args.interval),
                ..backend::LeaseArgs::default()
            };
            show::watch(connect(&url, timing).await?, args).await
        }
        Command::Bench(args) => bench::run(url, args).await,
    }
}

async fn connect(url: &str, timing: backend::LeaseArgs) -> Result<backend::Backend, Failure> {
    let backend = backend::connect(url, timing).await?;
    tracing::debug!(?backend, "connected");
    Ok(backend)
}

/// The ZooKeeper client logs an ERROR for every failed connection attempt (four a second
/// while a server is down); simba_zookeeper reports what matters. Heard only with `-vvv`.
const QUIET_CLIENTS: &str = "zookeeper_async=off";

/// Tracing on stderr: warnings by default, `-v` info, `-vv` debug for simba, `-vvv` trace
/// (the ZooKeeper client's own log only then); `SIMBA_LOG` (an env-filter directive such as
/// `simba_core=debug`) overrides.
fn init_logging(verbose: u8) {
    use tracing_subscriber::EnvFilter;
    let directives = match std::env::var("SIMBA_LOG") {
        Ok(s) if !s.trim().is_empty() => s,
        _ => match verbose {
            0 => format!("warn,{QUIET_CLIENTS}"),
            1 => format!("info,{QUIET_CLIENTS}"),
            2 => format!(
                "info,simba=debug,simba_core=debug,simba_redis=debug,simba_jdbc=debug,\
                 simba_zookeeper=debug,{QUIET_CLIENTS}"
            ),
            _ => "trace".to_owned(),
        },
    };
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::new(directives))
        .with_writer(std::io::stderr)
        // Its own complaint about a failed write would go to a closed stderr and panic.
        .log_internal_errors(false)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(verbose >= 2)
        .init();
}
