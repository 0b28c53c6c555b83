//! The command line, as clap sees it.

use std::ffi::OsString;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::duration;
use crate::status::EXIT_STATUS_HELP;

const BACKEND_HELP: &str = "\
Backend URL (default: a SQLite file in the user's state directory,
$XDG_STATE_HOME/simba/simba.db or ~/.local/state/simba/simba.db):
  sqlite://PATH                       SQLite file shared by processes on one machine
  redis://HOST[:PORT][/DB]            Redis / Valkey (rediss:// for TLS, feature `tls`)
  mysql://USER:PASS@HOST[:PORT]/DB    MySQL / MariaDB
  postgres://USER:PASS@HOST[:PORT]/DB PostgreSQL
  zk://HOST:PORT[,HOST:PORT]/CHROOT   ZooKeeper";

/// Distributed mutex from the shell: run a command while holding a mutex, show and watch
/// who holds it.
#[derive(Debug, Parser)]
#[command(
    name = "simba",
    version,
    about,
    after_help = EXIT_STATUS_HELP,
    arg_required_else_help = true
)]
pub(crate) struct Cli {
    /// Backend URL; `simba --help` lists the schemes.
    #[arg(long, global = true, env = "SIMBA_BACKEND", value_name = "URL", long_help = BACKEND_HELP)]
    pub(crate) backend: Option<String>,

    /// More output on stderr: -v info, -vv debug, -vvv trace (SIMBA_LOG=filter overrides).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub(crate) verbose: u8,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Wait for the mutex, then run a command while holding it.
    ///
    /// The command runs in its own process group, with SIMBA_MUTEX, SIMBA_FENCE (the
    /// fencing token of this ownership) and SIMBA_OWNER_ID in its environment. SIGINT,
    /// SIGTERM, SIGHUP and SIGQUIT received by simba are passed to the group, and simba
    /// exits with the command's status (128+N when signal N killed it). If ownership is
    /// lost while it runs (backend unreachable until the lease ran out, or taken over),
    /// the whole group gets SIGTERM, then SIGKILL after --grace, and simba exits with 79.
    #[command(after_help = EXIT_STATUS_HELP)]
    Exec(ExecArgs),

    /// Print the current owner of the mutex (or "no owner").
    #[command(after_help = EXIT_STATUS_HELP)]
    Owner(ShowArgs),

    /// Print one line per ownership change until interrupted (SIGINT ends with 0).
    #[command(after_help = EXIT_STATUS_HELP)]
    Watch(WatchArgs),

    /// A contender process of `simba-chaos` (orders come from SIMBA_CHAOS_* variables).
    #[cfg(feature = "chaos")]
    #[command(hide = true)]
    ChaosContender,
}

#[derive(Debug, Args)]
pub(crate) struct ExecArgs {
    /// The mutex name.
    pub(crate) mutex: String,

    /// Give up waiting after this long (e.g. 300ms, 10s, 2m) and exit with 75.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, conflicts_with = "no_wait")]
    pub(crate) timeout: Option<Duration>,

    /// Do not wait: exit with 75 at once if another contender holds the mutex.
    #[arg(long)]
    pub(crate) no_wait: bool,

    #[command(flatten)]
    pub(crate) lease: LeaseArgs,

    /// After ownership is lost: time between SIGTERM and SIGKILL to the command's group.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, default_value = "10s")]
    pub(crate) grace: Duration,

    /// The command and its arguments (after `--`).
    #[arg(required = true, last = true, value_name = "COMMAND")]
    pub(crate) command: Vec<OsString>,
}

#[derive(Debug, Args)]
pub(crate) struct LeaseArgs {
    /// Lease time to live: the owner renews from here on [default: 10s]. On ZooKeeper,
    /// ttl + transition is the session timeout.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse)]
    pub(crate) ttl: Option<Duration>,

    /// Transition period after the ttl in which only the owner may renew [default: 6s].
    /// A silent owner keeps the mutex for ttl + transition.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse)]
    pub(crate) transition: Option<Duration>,
}

#[derive(Debug, Args)]
pub(crate) struct ShowArgs {
    /// The mutex name.
    pub(crate) mutex: String,

    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct WatchArgs {
    #[command(flatten)]
    pub(crate) show: ShowArgs,

    /// How often lease backends (SQL, Redis) are read; an ownership shorter than this may
    /// go unseen. ZooKeeper pushes changes.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, default_value = "250ms")]
    pub(crate) interval: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn exec_parses() {
        let cli = Cli::try_parse_from([
            "simba", "exec", "m", "--ttl", "1s", "--grace", "2s", "--", "sh", "-c", "exit 7",
        ])
        .expect("parses");
        let Command::Exec(a) = cli.command else {
            panic!("not exec");
        };
        assert_eq!(a.lease.ttl, Some(Duration::from_secs(1)));
        assert_eq!(a.grace, Duration::from_secs(2));
        assert_eq!(a.command, ["sh", "-c", "exit 7"]);
    }

    #[test]
    fn bad_duration_names_the_value() {
        let e = Cli::try_parse_from(["simba", "exec", "m", "--ttl", "10", "--", "true"])
            .expect_err("bad ttl");
        let text = e.to_string();
        assert!(text.contains("--ttl") && text.contains("`10`"), "{text}");
    }
}
