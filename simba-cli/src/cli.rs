//! The command line, as clap sees it.

use std::ffi::OsString;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use simba_core::{LeaseConfig, MAX_DURATION};

use crate::duration::{self, show};
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
    /// lost while it runs, the whole group is stopped and simba exits with 79: SIGKILL at
    /// once when the lease ran out, SIGTERM then SIGKILL after --grace when the loss came
    /// earlier. A guardian process kills the group as soon as simba dies (SIGKILL, crash)
    /// or is stopped past its lease.
    ///
    /// With --mutex given several times, simba holds every mutex (all or none, taken in
    /// sorted order) while the command runs; the loss of any one is a loss, and the
    /// earliest lease deadline of them all is the guardian's.
    ///
    /// With --permits N, simba holds one of the N permits of a semaphore instead: at most
    /// N commands run at once, across hosts, and each is guarded as with a mutex.
    #[command(after_help = EXIT_STATUS_HELP)]
    Exec(ExecArgs),

    /// Print the current owner of the mutex (or "no owner"); with --permits, every holder
    /// of the semaphore; with --rwlock, the writer and every reader of the lock.
    #[command(after_help = EXIT_STATUS_HELP)]
    Owner(OwnerArgs),

    /// Print one line per ownership change until interrupted (SIGINT ends with 0).
    #[command(after_help = EXIT_STATUS_HELP)]
    Watch(WatchArgs),

    /// Measure the backend: floors, uncontended latency, handoff, failover, scale.
    ///
    /// Every figure is printed beside the floor it compares to (a bare round trip of the
    /// backend, measured in the same run): machines are noisy, ratios are what carry over.
    /// Runs against a live backend; mutex names start with `bench-<pid>-`. With --json,
    /// one JSON object is printed on stdout (progress goes to stderr).
    #[command(after_help = BENCH_HELP)]
    Bench(BenchArgs),
}

#[derive(Debug, Args)]
pub(crate) struct ExecArgs {
    /// The mutex name (or give the names with --mutex); with --permits, the semaphore's.
    #[arg(value_name = "MUTEX", required_unless_present = "mutexes")]
    pub(crate) mutex: Option<String>,

    /// Hold one of the N permits of the semaphore MUTEX instead of a mutex: at most N
    /// commands hold one at once. Every exec of one semaphore must give the same N while
    /// it has holders (else 64). The command gets SIMBA_SEMAPHORE, SIMBA_PERMITS (N),
    /// SIMBA_PERMIT (this holder's id) and SIMBA_FENCE (the permit's fence). A lost permit
    /// stops the command as a lost mutex does (79). Semaphore names are apart from mutex
    /// names. One name only: not with --mutex, nor with --hold-at-least (a permit cannot
    /// be kept held past its release). On SQLite the lock file is not handed to the
    /// command's processes: the lease deadline guards a permit, as on the other backends.
    #[arg(
        long,
        value_name = "N",
        value_parser = parse_permits,
        conflicts_with_all = ["mutexes", "hold_at_least"]
    )]
    pub(crate) permits: Option<u32>,

    /// Hold a read of the read-write lock MUTEX instead of a mutex: any number of --read
    /// commands run at once, none beside a --write. A waiting --write goes first: a --read
    /// that comes after it waits for it. The command gets SIMBA_RWLOCK, SIMBA_RW_MODE
    /// (`read`), SIMBA_OWNER_ID and SIMBA_FENCE (above the fence of every write before
    /// it). The lock is the mutex MUTEX (its gate) and the semaphore MUTEX (its readers):
    /// do not use the name for a plain mutex or semaphore too. One name only; not with
    /// --permits or --hold-at-least.
    #[arg(long, conflicts_with_all = ["mutexes", "hold_at_least", "permits", "write"])]
    pub(crate) read: bool,

    /// Hold the write of the read-write lock MUTEX: the command runs alone, after every
    /// read that started before it ended. SIMBA_RW_MODE is `write`; its fence is above
    /// every earlier read's and write's. As --read otherwise.
    #[arg(long, conflicts_with_all = ["mutexes", "hold_at_least", "permits"])]
    pub(crate) write: bool,

    /// A mutex to hold; repeat it to hold several at once (at most 32), all or none. They
    /// are taken in one order (sorted by name), so execs that ask for the same mutexes in
    /// any order never deadlock. The command gets SIMBA_MUTEX_COUNT and, for each mutex in
    /// the order given, SIMBA_MUTEX_i, SIMBA_FENCE_i and SIMBA_OWNER_ID_i (i from
    /// 1), and SIMBA_FENCES (the fences, comma separated); SIMBA_MUTEX, SIMBA_FENCE and
    /// SIMBA_OWNER_ID only when there is one mutex.
    #[arg(long = "mutex", value_name = "NAME")]
    pub(crate) mutexes: Vec<String>,

    /// Give up waiting after this long (e.g. 300ms, 10s, 2m) and exit with 75.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, conflicts_with = "no_wait")]
    pub(crate) timeout: Option<Duration>,

    /// Do not wait: exit with 75 at once if another contender holds the mutex (with
    /// --permits: if every permit is held). With --hold-at-least: run at most once per
    /// period, and skip if someone else did.
    #[arg(long)]
    pub(crate) no_wait: bool,

    /// Keep the mutex held for at least this long from its acquisition, even when the
    /// command ends earlier (ShedLock's lockAtLeastFor): nobody, this host included, can
    /// take it before then, whatever their clocks say. Not on ZooKeeper (exits 64).
    #[arg(long, value_name = "DURATION", value_parser = duration::parse)]
    pub(crate) hold_at_least: Option<Duration>,

    /// Stop the command (SIGTERM, then SIGKILL after --grace) once it has held the mutex
    /// this long, as when ownership is lost, and exit with 79.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse)]
    pub(crate) hold_at_most: Option<Duration>,

    #[command(flatten)]
    pub(crate) lease: LeaseArgs,

    /// When simba stops the command's group (--hold-at-most, a loss before the lease ran
    /// out, processes the command left behind): time between SIGTERM and SIGKILL.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, default_value = "10s")]
    pub(crate) grace: Duration,

    /// The command and its arguments (after `--`).
    #[arg(required = true, last = true, value_name = "COMMAND")]
    pub(crate) command: Vec<OsString>,
}

/// `--permits N`: a whole number of at least 1.
fn parse_permits(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u32>() {
        Ok(0) => Err("`0`: a semaphore needs at least one permit".to_owned()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "`{s}` is not a permit count (a whole number from 1 to {})",
            u32::MAX
        )),
    }
}

impl ExecArgs {
    /// The mutex names: the argument, then each --mutex, each name once, in that order.
    pub(crate) fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for name in self.mutex.iter().chain(&self.mutexes) {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
        names
    }
}

const BENCH_HELP: &str = "\
Scenarios (all by default; run in this order):
  scale        --scale-mutexes mutexes held by one process (connections, renewals,
               memory), and --scale-waiters waiters on one mutex (wake-ups per
               release, handoff latency)
  uncontended  acquire + release by one contender (Locker), back to back
  handoff      --contenders contenders on separate connections, each holding --hold;
               latency from a release returning to the next owner's acquisition
  many         --many-mutexes mutexes at once, each handed between --contenders
               contenders (one connection each) holding --hold: the throughput of
               many independent locks, beside 1/hold per mutex
  semaphore    a permit's acquire + release (3 permits) and hand-over (1 permit,
               --contenders contenders), beside the mutex's; \"no semaphores\" on
               backends without them
  failover     an owner process (`simba exec`) is SIGKILLed; time from the end of
               its lease to a waiter owning (ZooKeeper: from session expiry)

Exit status: 0 when every scenario ran, 69 when one failed (the others still run and
are reported), 70 when a safety check failed (two owners at once).";

/// What `simba bench` runs, in the order it runs them (scale first, so that the memory it
/// reports is that of a process that did nothing else yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub(crate) enum Scenario {
    /// Many mutexes held, many waiters on one.
    Scale,
    /// Acquire + release by one contender.
    Uncontended,
    /// Contenders handing the mutex to each other.
    Handoff,
    /// Many mutexes handed over at once.
    Many,
    /// A semaphore's permit: acquire + release, and hand-over, beside the mutex's.
    Semaphore,
    /// An owner process killed; a waiter takes over.
    Failover,
}

#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Scenarios to run (repeat or separate with commas) [default: all].
    #[arg(
        long = "scenario",
        value_name = "NAME",
        value_enum,
        value_delimiter = ','
    )]
    pub(crate) scenarios: Vec<Scenario>,

    /// Print one JSON object on stdout instead of the table.
    #[arg(long)]
    pub(crate) json: bool,

    /// Break one handoff into its hops (release sent → release answered → push received
    /// → waiter woken → acquire sent → acquire answered → guard returned), p50 per hop,
    /// over two contenders handing one mutex back and forth.
    #[arg(long)]
    pub(crate) explain: bool,

    /// Samples per floor, uncontended acquire + release cycles, and handoff acquisitions
    /// (all after a warm-up); lower it for a smoke run.
    #[arg(long, value_name = "N", default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub(crate) iterations: u32,

    /// Contenders in the handoff scenario, each with its own connections.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..=64))]
    pub(crate) contenders: u32,

    /// How long a handoff contender holds the mutex.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, default_value = "1ms")]
    pub(crate) hold: Duration,

    /// How often waiters look where the backend cannot push a release (every backend
    /// pushes to waiters today; this is the fallback while a subscription fails), in the
    /// uncontended, handoff and failover scenarios.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse_positive, default_value = "10ms")]
    pub(crate) poll: Duration,

    /// Owner processes killed in the failover scenario (each measured twice: with the
    /// default jitter of non-owners' wake-ups, and without jitter).
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub(crate) failover_runs: u32,

    /// The killed owner's ttl (its transition is half of it). On ZooKeeper, ttl +
    /// transition is the session timeout (at least 2s).
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, default_value = "600ms")]
    pub(crate) failover_ttl: Duration,

    /// Mutexes handed over at once in the many scenario (each by --contenders contenders).
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub(crate) many_mutexes: u32,

    /// Mutexes held by one process in the scale scenario.
    #[arg(long, value_name = "N", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub(crate) scale_mutexes: u32,

    /// Waiters on one mutex in the scale scenario.
    #[arg(long, value_name = "N", default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(2..=100_000))]
    pub(crate) scale_waiters: u32,

    /// The ttl of the scale scenario's held mutexes (transition: half of it); renewals are
    /// counted over two ttls.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, default_value = "3s")]
    pub(crate) scale_ttl: Duration,

    /// How often the scale scenario's waiters look where the backend cannot push a release
    /// (the fallback while a subscription fails).
    #[arg(long, value_name = "DURATION", value_parser = duration::parse_positive, default_value = "1s")]
    pub(crate) scale_poll: Duration,
}

#[derive(Debug, Args)]
pub(crate) struct LeaseArgs {
    /// Lease time to live: the owner renews from here on [default: 10s]. On ZooKeeper,
    /// ttl + transition is the session timeout.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse_positive)]
    pub(crate) ttl: Option<Duration>,

    /// Transition period after the ttl in which only the owner may renew [default: 6s].
    /// A silent owner keeps the mutex for ttl + transition.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse)]
    pub(crate) transition: Option<Duration>,
}

impl LeaseArgs {
    /// Checks `--ttl` and `--transition` together (each alone is checked as it is parsed):
    /// the lease they make, ttl + transition, must be longer than twice the margin the
    /// library keeps off an owner's local deadline for clock drift (so that an owner has
    /// time to act), and at most one year. The error names the values given and what is
    /// allowed.
    pub(crate) fn check(&self) -> Result<(), String> {
        let defaults = LeaseConfig::default();
        let ttl = self.ttl.unwrap_or(defaults.ttl);
        let transition = self.transition.unwrap_or(defaults.transition);
        let lease = ttl.saturating_add(transition);
        let given = match (self.ttl, self.transition) {
            (Some(t), Some(tr)) => format!("--ttl {} --transition {}", show(t), show(tr)),
            (Some(t), None) => format!(
                "--ttl {} (with the default --transition {})",
                show(t),
                show(transition)
            ),
            (None, Some(tr)) => format!(
                "--transition {} (with the default --ttl {})",
                show(tr),
                show(ttl)
            ),
            (None, None) => "the default --ttl and --transition".to_owned(),
        };
        let margin = defaults.drift_margin;
        let least = margin * 2;
        if lease <= least {
            return Err(format!(
                "{given}: the lease, ttl + transition = {}, must be longer than {} (twice \
                 the {} that simba keeps off each ownership for clock drift between this \
                 machine and the backend); lengthen --ttl or --transition (e.g. --ttl 1s)",
                show(lease),
                show(least),
                show(margin)
            ));
        }
        if lease > MAX_DURATION {
            return Err(format!(
                "{given}: the lease, ttl + transition = {}, is longer than one year, the \
                 most allowed; shorten --ttl or --transition",
                show(lease)
            ));
        }
        Ok(())
    }
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
pub(crate) struct OwnerArgs {
    /// The mutex name (with --permits, the semaphore's).
    pub(crate) mutex: String,

    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,

    /// The name is a semaphore's (as for `exec --permits`): list every holder of a permit
    /// (its id, fence and lease times) and the permit count they agreed on.
    #[arg(long)]
    pub(crate) permits: bool,

    /// The name is a read-write lock's (as for `exec --read` / `--write`): the owner of
    /// its gate (the writer, one waiting for the readers to leave, or a reader passing)
    /// and every reader.
    #[arg(long, conflicts_with = "permits")]
    pub(crate) rwlock: bool,
}

#[derive(Debug, Args)]
pub(crate) struct WatchArgs {
    #[command(flatten)]
    pub(crate) show: ShowArgs,

    /// How often the owner is read on backends that cannot push changes (SQLite, MySQL,
    /// Redis in polling mode); an ownership shorter than this may go unseen there. Redis,
    /// PostgreSQL and ZooKeeper push every change as it happens.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse_positive, default_value = "250ms")]
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
        let cli = Cli::try_parse_from([
            "simba",
            "exec",
            "m",
            "--no-wait",
            "--hold-at-least",
            "1h",
            "--hold-at-most",
            "50m",
            "--",
            "true",
        ])
        .expect("parses");
        let Command::Exec(a) = cli.command else {
            panic!("not exec");
        };
        assert!(a.no_wait);
        assert_eq!(a.hold_at_least, Some(Duration::from_secs(3600)));
        assert_eq!(a.hold_at_most, Some(Duration::from_secs(3000)));
    }

    #[test]
    fn permits_parse_and_refuse_what_means_nothing_for_a_semaphore() {
        let cli = Cli::try_parse_from(["simba", "exec", "--permits", "3", "s", "--", "true"])
            .expect("parses");
        let Command::Exec(a) = cli.command else {
            panic!("not exec");
        };
        assert_eq!((a.permits, a.names()), (Some(3), vec!["s".to_owned()]));
        for (argv, expect) in [
            (&["--permits", "0", "s"][..], "at least one permit"),
            (&["--permits", "-1", "s"][..], "'-1'"),
            (&["--permits", "x", "s"][..], "not a permit count"),
            (&["--permits", "2", "s", "--mutex", "t"][..], "--mutex"),
            (
                &["--permits", "2", "s", "--hold-at-least", "1s"][..],
                "--hold-at-least",
            ),
        ] {
            let mut full = vec!["simba", "exec"];
            full.extend_from_slice(argv);
            full.extend_from_slice(&["--", "true"]);
            let e = Cli::try_parse_from(&full).expect_err("refused");
            let text = e.to_string();
            assert!(e.use_stderr() && text.contains(expect), "{argv:?}: {text}");
        }
        let cli =
            Cli::try_parse_from(["simba", "owner", "s", "--permits", "--json"]).expect("parses");
        let Command::Owner(a) = cli.command else {
            panic!("not owner");
        };
        assert!(a.permits && a.json && a.mutex == "s");
    }

    #[test]
    fn bench_parses() {
        let cli = Cli::try_parse_from([
            "simba",
            "bench",
            "--scenario",
            "handoff,uncontended",
            "--scenario",
            "scale",
            "--iterations",
            "10",
            "--json",
        ])
        .expect("parses");
        let Command::Bench(a) = cli.command else {
            panic!("not bench");
        };
        assert_eq!(
            a.scenarios,
            [Scenario::Handoff, Scenario::Uncontended, Scenario::Scale]
        );
        assert_eq!((a.iterations, a.json, a.contenders), (10, true, 4));
        assert_eq!(a.hold, Duration::from_millis(1));
        assert!(Cli::try_parse_from(["simba", "bench", "--scenario", "nope"]).is_err());
        assert!(Cli::try_parse_from(["simba", "bench", "--iterations", "0"]).is_err());
    }

    fn lease(args: &[&str]) -> LeaseArgs {
        let mut argv = vec!["simba", "exec", "m"];
        argv.extend_from_slice(args);
        argv.extend_from_slice(&["--", "true"]);
        let cli = Cli::try_parse_from(argv).expect("parses");
        let Command::Exec(a) = cli.command else {
            panic!("not exec");
        };
        a.lease
    }

    #[test]
    fn a_lease_too_short_for_the_drift_margin_names_the_options() {
        let e = lease(&["--ttl", "150ms", "--transition", "0s"])
            .check()
            .expect_err("150ms lease");
        assert!(
            e.starts_with("--ttl 150ms --transition 0s:")
                && e.contains("ttl + transition = 150ms")
                && e.contains("longer than 200ms")
                && !e.contains("drift_margin"),
            "{e}"
        );
        let e = lease(&["--ttl", "100ms"]).check();
        assert!(e.is_ok(), "100ms + the default 6s transition: {e:?}");
        assert!(
            lease(&["--ttl", "150ms", "--transition", "51ms"])
                .check()
                .is_ok()
        );
        let e = lease(&["--ttl", "200ms", "--transition", "0s"])
            .check()
            .expect_err("200ms lease");
        assert!(e.contains("longer than 200ms"), "{e}");
        let e = lease(&["--ttl", "8760h", "--transition", "1s"])
            .check()
            .expect_err("over a year");
        assert!(e.contains("longer than one year"), "{e}");
        assert!(lease(&[]).check().is_ok());
    }

    #[test]
    fn a_zero_ttl_or_interval_names_the_option_and_the_least_allowed() {
        for argv in [
            &["simba", "exec", "m", "--ttl", "0s", "--", "true"][..],
            &["simba", "watch", "m", "--interval", "0s"][..],
        ] {
            let e = Cli::try_parse_from(argv).expect_err("zero");
            let text = e.to_string();
            let option = argv[3];
            assert!(
                text.contains(option)
                    && text.contains("`0s` is zero")
                    && text.contains("at least 1ms"),
                "{text}"
            );
            assert!(!text.contains("--transition"), "{text}");
        }
    }

    #[test]
    fn bad_duration_names_the_value() {
        let e = Cli::try_parse_from(["simba", "exec", "m", "--ttl", "10", "--", "true"])
            .expect_err("bad ttl");
        let text = e.to_string();
        assert!(text.contains("--ttl") && text.contains("`10`"), "{text}");
    }
}
