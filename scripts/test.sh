#!/usr/bin/env bash
# The whole check, as CI runs it, on a machine that has only Rust (rustup) and Debian:
# installs what is missing (server packages, cargo-nextest, cargo-deny, the crates of every
# platform), starts one shared Redis, MariaDB, PostgreSQL and ZooKeeper for the tests (fault
# tests start private ones), then format, lints (also of the kit's `containers` feature),
# dependency rules, docs, cargo-deny, packaging of every crate, every test (doctests too,
# which include every Rust block of the READMEs and docs/), the examples against the shared
# servers, and prints how long each step took.
#
#   scripts/test.sh            # everything
#   SIMBA_SKIP_INSTALL=1 ...   # do not apt-get (servers already installed)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"
export PATH="$PATH:$cargo_bin"
# Every build here starts from a cold or an old target directory: incremental compilation
# only adds its caches' writing. The debug info of the workspace's profile (line tables)
# for every cargo run, whatever workspace it is in (the check of the unpacked packages,
# last, has one of its own).
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
export CARGO_PROFILE_DEV_DEBUG=${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}

# --- step timing ---------------------------------------------------------------------------
step_names=()
step_secs=()
current_step=
step_started=$SECONDS
end_step() {
  if [ -n "$current_step" ]; then
    step_names+=("$current_step")
    step_secs+=($((SECONDS - step_started)))
  fi
  current_step=
}
step() {
  end_step
  current_step="$*"
  step_started=$SECONDS
  printf '\n== %s (%s)\n' "$*" "$(date +%T)"
}
report() {
  end_step
  echo
  echo "== time per step"
  local i
  for i in "${!step_names[@]}"; do
    printf '%6ss  %s\n' "${step_secs[$i]}" "${step_names[$i]}"
  done
  printf '%6ss  total\n' "$SECONDS"
}

cleanup_actions=()
on_exit() {
  local rc=$?
  local a
  for a in "${cleanup_actions[@]}"; do eval "$a" || true; done
  report
  exit $rc
}
trap on_exit EXIT

# --- server packages -----------------------------------------------------------------------
need_install=()
command -v redis-server >/dev/null || need_install+=(redis-server)
command -v mariadbd >/dev/null || command -v mysqld >/dev/null || need_install+=(mariadb-server)
{ [ -f /usr/share/java/zookeeper.jar ] || ls /usr/share/java/zookeeper-*.jar >/dev/null 2>&1; } || need_install+=(zookeeper)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_install+=(postgresql)
# PgBouncer in front of the kit's PostgreSQL (simba-jdbc's pooler mode).
{ command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ]; } || need_install+=(pgbouncer)
command -v java >/dev/null || need_install+=(default-jre-headless)
command -v etcd >/dev/null || need_install+=(etcd-server)
# etcdctl: the kit's own test of its etcd servers.
command -v etcdctl >/dev/null || need_install+=(etcd-client)
# etcd-client's build script compiles etcd's .proto files with protoc and the
# well-known types (google/protobuf/*.proto, in libprotobuf-dev).
command -v protoc >/dev/null || need_install+=(protobuf-compiler)
[ -f /usr/include/google/protobuf/descriptor.proto ] || need_install+=(libprotobuf-dev)
if [ ${#need_install[@]} -gt 0 ] && [ -z "${SIMBA_SKIP_INSTALL:-}" ]; then
  step "installing ${need_install[*]}"
  if [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    # Package scripts must not start system-wide servers: the tests start their own.
    made_policy=
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
      made_policy=1
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_install[@]}" >/dev/null
    [ -n "$made_policy" ] && rm -f /usr/sbin/policy-rc.d
  else
    echo "missing: ${need_install[*]}. Run as root, or: sudo apt-get install ${need_install[*]}" >&2
    echo "(or point SIMBA_TEST_REDIS_URL / SIMBA_TEST_MYSQL_URL / SIMBA_TEST_POSTGRES_URL / SIMBA_TEST_ZOOKEEPER / SIMBA_TEST_ETCD_URL /" >&2
    echo " SIMBA_TEST_PGBOUNCER_URL + SIMBA_TEST_PGBOUNCER_SESSION_URL + SIMBA_TEST_PGBOUNCER_DIRECT_URL at servers)" >&2
    exit 1
  fi
fi

# --- container images, in the background -------------------------------------------------
# The images (scripts/containers.sh) are made from Debian's packages: mostly downloads and
# unpacking, which overlap well with the compiling steps below. Waited for at the container
# step; without a Docker daemon that step says it skips.
images_pid=
images_log=$(mktemp)
cleanup_actions+=('[ -n "$images_pid" ] && kill "$images_pid" 2>/dev/null; rm -f "$images_log"')
if "${DOCKER:-docker}" info >/dev/null 2>&1; then
  scripts/containers.sh build >"$images_log" 2>&1 &
  images_pid=$!
fi

# The features of the test build: the kit's and simba-chaos's container fall-back, and
# simba-cli's `etcd` (off by default: it needs protoc), so that every test builds. Every
# build below with these features shares its dependencies with the others.
test_features=simba-test-kit/containers,simba-chaos/containers,simba-cli/etcd

# --- cargo tools and crates ----------------------------------------------------------------
if command -v rustup >/dev/null; then
  missing_components=()
  cargo fmt --version >/dev/null 2>&1 || missing_components+=(rustfmt)
  cargo clippy --version >/dev/null 2>&1 || missing_components+=(clippy)
  if [ ${#missing_components[@]} -gt 0 ]; then
    step "installing ${missing_components[*]}"
    rustup component add "${missing_components[@]}"
  fi
fi
# cargo-deny in a debug build: it compiles in 86 s instead of 218 s here, and its two checks
# below take 3.5-4.3 s each instead of 1.0 s (measured side by side, docs/testing.md).
for tool in cargo-nextest cargo-deny; do
  if ! command -v "$tool" >/dev/null; then
    step "installing $tool"
    profile=()
    [ "$tool" = cargo-deny ] && profile=(--debug)
    cargo install "$tool" --locked --quiet "${profile[@]}"
  fi
done

# A build fetches only the crates of this platform; cargo-deny and cargo package read the
# whole graph, every platform's crates included (windows-sys, wasm-bindgen, …). Fetch them
# all, so that no later step depends on what an earlier build happened to download.
step "cargo fetch (every platform)"
cargo fetch --locked

# The proof that the line above is enough: the deny step again, from an empty cargo
# registry cache (a fresh machine's), with nothing but that fetch before it. It runs in the
# background (it is network-bound) and is waited for at the deny step.
fresh_home=$(mktemp -d)
fresh_log=$(mktemp)
cleanup_actions+=('rm -rf "$fresh_home" "$fresh_log"')
[ -f "$HOME/.cargo/config.toml" ] && cp "$HOME/.cargo/config.toml" "$fresh_home/"
(
  export CARGO_HOME="$fresh_home"
  cargo fetch --locked --quiet && cargo-deny --offline check licenses bans sources
) >"$fresh_log" 2>&1 &
fresh_pid=$!

# --- servers -------------------------------------------------------------------------------
# Started first: the Redis restart quarantine keeps a freshly started Redis from granting
# ownership for one lease, so the servers get to age while the code is checked and built.
step "shared test servers"
servers_env=$(mktemp)
# Built with the test build's features over the whole workspace, so the dependencies it
# compiles are the ones the test build reuses (`cargo run -p simba-test-kit` would build
# them a second time, with the kit's features alone).
cargo build --quiet --workspace --bin simba-test-servers --features "$test_features"
"${CARGO_TARGET_DIR:-target}/debug/simba-test-servers" --env-file "$servers_env" &
servers_pid=$!
cleanup_actions+=('kill "$servers_pid" 2>/dev/null; wait "$servers_pid" 2>/dev/null; rm -f "$servers_env"')
for _ in $(seq 1 600); do
  grep -q '^READY' "$servers_env" 2>/dev/null && break
  kill -0 "$servers_pid" 2>/dev/null || { echo "test servers failed to start" >&2; exit 1; }
  sleep 0.2
done
grep -q '^READY' "$servers_env" || { echo "test servers not ready in 120 s" >&2; exit 1; }
set -a
# shellcheck disable=SC1090
. <(grep '^SIMBA_TEST_' "$servers_env")
set +a
env | grep '^SIMBA_TEST_' || true

# --- static checks -------------------------------------------------------------------------
step "cargo fmt --check"
cargo fmt --all -- --check

step "clippy"
# --all-targets: the examples (simba-jdbc/examples, simba-redis/examples) too.
# With the test build's features ($test_features), so that every test target builds, and
# simba-chaos's heap profiler (a soak tool, never in the test build).
cargo clippy --workspace --all-targets --features "$test_features,simba-chaos/heap-profile" \
  --quiet -- -D warnings

step "clippy, simba-chaos with mimalloc"
# The soak's other allocator (a diagnostic; it excludes the heap profiler above).
cargo clippy -p simba-chaos --all-targets --features mimalloc --quiet -- -D warnings

step "clippy, the kit without its containers feature"
# The kit has code for builds without `containers` (no container fall-back).
cargo clippy -p simba-test-kit --quiet -- -D warnings

step "clippy, one backend feature at a time (what a user who picks one builds)"
# The workspace build unifies features (simba-chaos turns on every TLS feature), so it
# cannot show that simba-jdbc builds without a backend feature, or the simba binary
# without one: these builds do.
for features in "" sqlite mysql postgres; do
  cargo clippy -p simba-jdbc --no-default-features ${features:+--features $features} --quiet -- -D warnings
done
cargo clippy -p simba-redis --quiet -- -D warnings
# simba-etcd without its `tls` feature (etcds:// refused), as the simba binary builds it.
cargo clippy -p simba-etcd --quiet -- -D warnings
# Every library without `bench` (the builds above too): the workspace build turns it on
# (simba-cli), so only these show that the crates build and lint without their floor code.
cargo clippy -p simba-core -p simba-zookeeper --quiet -- -D warnings
for features in "" sqlite redis zookeeper etcd; do
  cargo clippy -p simba-cli --no-default-features ${features:+--features $features} --quiet -- -D warnings
done

step "dependency rules"
if cargo tree -p simba-core -e normal --prefix none | grep -E '^(fred|diesel|zookeeper|etcd)' ; then
  echo "simba-core must not depend on a backend crate" >&2
  exit 1
fi
if cargo tree -p simba-etcd -e normal --prefix none | grep -E '^(simba-(redis|jdbc|zookeeper)|fred|diesel|zookeeper) ' ; then
  echo "simba-etcd must not depend on another backend" >&2
  exit 1
fi
# The product links no test tooling, with its default features or all of them.
for features in "" "--all-features"; do
  # shellcheck disable=SC2086
  if cargo tree -p simba-cli -e normal --prefix none $features | grep -E '^simba-(test-kit|chaos) '; then
    echo "simba-cli ($features) must not depend on simba-test-kit or simba-chaos" >&2
    exit 1
  fi
done
# Measurement (`bench`: floor probes, hop records) is for `simba bench` only: no library
# crate built alone with its default features may turn it on (`-e normal,features`: the
# backends' tests turn it on through dev-dependencies, which a user's build never sees).
# The simba command must turn it on, or its bench loses its floors — which also shows
# that the pattern matches what `cargo tree` prints.
for crate in simba-core simba-redis simba-jdbc simba-zookeeper simba-etcd simba-test-kit; do
  if cargo tree -p "$crate" -e normal,features -i simba-core --prefix none | grep 'feature "bench"'; then
    echo "$crate with its default features turns on \`bench\` (measurement for simba bench only)" >&2
    exit 1
  fi
done
bench_features=$(cargo tree -p simba-cli --features etcd -e normal,features -i simba-core --prefix none |
  grep -oE '^simba-(core|jdbc|redis|zookeeper|etcd) feature "bench"' | sort -u | wc -l)
if [ "$bench_features" != 5 ]; then
  echo "simba-cli must turn on \`bench\` in simba-core and its four backends (found $bench_features)" >&2
  exit 1
fi
echo "simba-core: no backend; simba-cli: no test tooling; bench only through simba-cli"

step "docs"
RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps --quiet

step "cargo deny"
cargo-deny --offline check licenses bans sources
if ! wait "$fresh_pid"; then
  cat "$fresh_log" >&2
  echo "cargo deny fails from an empty registry cache after 'cargo fetch': a fresh machine would fail here" >&2
  exit 1
fi
echo "cargo deny also passes from an empty registry cache ($(du -sh "$fresh_home" | cut -f1) fetched)"

# --- tests ---------------------------------------------------------------------------------
# The test binaries are built once, with the `containers` features: the local-binary runs
# below and the container runs after them use the same build. The test binaries named
# `containers` need Docker: they run in the container step only.
step "build tests"
cargo build --workspace --all-targets --features "$test_features" --quiet

step "tests"
# Four at a time on two cores: most tests wait on servers, leases and timers (the step's
# processes use about a fifth of the cores), and the two one-at-a-time groups of
# .config/nextest.toml (fault tests, chaos runs) each hold a slot most of the step.
cargo nextest run --workspace --features "$test_features" --profile ci --test-threads 4 \
  -E 'not binary(containers) and not binary(soak)' --no-tests fail

# The 3-minute soak (simba-chaos/tests/soak.rs: every backend at once, 18 worker processes)
# in a step of its own: beside the other tests, its load would share the 2 cores with tests
# whose subject is time (leases, failovers).
step "soak (3 minutes, every backend)"
cargo nextest run --workspace --features "$test_features" --profile ci \
  -E 'binary(soak)' --no-tests fail

step "doctests"
# The test build's features: the libraries are the ones built for the tests.
cargo test --workspace --doc --features "$test_features" --quiet

# The examples, as a user runs them, against the shared servers; each must print the
# outcome it exists to show. Their binaries come from the build step above.
step "examples"
examples="${CARGO_TARGET_DIR:-target}/debug/examples"
examples_tmp=$(mktemp -d)
cleanup_actions+=('rm -rf "$examples_tmp"')
expect_output() { # NAME PATTERN OUTPUT
  if ! grep -q -- "$2" <<<"$3"; then
    printf '%s\n' "$3" >&2
    echo "example $1: expected a line matching '$2'" >&2
    exit 1
  fi
}
job="once-$$"
out=$("$examples/once_per_period" "$SIMBA_TEST_POSTGRES_URL" "$job")
expect_output once_per_period "^$job: running with fence" "$out"
out=$("$examples/once_per_period" "$SIMBA_TEST_POSTGRES_URL" "$job")
expect_output once_per_period "^$job: skipped" "$out"
out=$("$examples/fenced_write" "$SIMBA_TEST_POSTGRES_URL")
expect_output fenced_write 'refused "a late write from the first owner"' "$out"
for url in "sqlite://$examples_tmp/locks.db" "$SIMBA_TEST_REDIS_URL" "$SIMBA_TEST_MYSQL_URL" \
  "$SIMBA_TEST_POSTGRES_URL" "zk://$SIMBA_TEST_ZOOKEEPER"; do
  out=$("$examples/from_url" "$url")
  expect_output from_url '^released$' "$out"
done
# The leader worker: leads, works, and on SIGINT (Ctrl-C) stops, releases and exits 0.
"$examples/leader_worker" "$SIMBA_TEST_REDIS_URL" "leader-$$" >"$examples_tmp/leader.out" 2>&1 &
leader_pid=$!
for _ in $(seq 1 300); do
  grep -q 'working as leader' "$examples_tmp/leader.out" && break
  kill -0 "$leader_pid" 2>/dev/null || break
  sleep 0.1
done
kill -INT "$leader_pid" 2>/dev/null || true
leader_rc=0
wait "$leader_pid" || leader_rc=$?
out=$(cat "$examples_tmp/leader.out")
expect_output leader_worker 'working as leader' "$out"
expect_output leader_worker 'stopped, mutex released' "$out"
[ "$leader_rc" = 0 ] || { printf '%s\n' "$out" >&2; echo "leader_worker exited with $leader_rc" >&2; exit 1; }
echo "examples: once_per_period, fenced_write, from_url (5 backends), leader_worker"

# Each backend's conformance suite once more, against servers in containers of the kit's
# own images (built from Debian's packages the first time, then reused). Skipped, saying
# so, only where no Docker daemon answers.
step "conformance through containers"
if [ -n "$images_pid" ]; then
  images_rc=0
  wait "$images_pid" || images_rc=$?
  images_pid=
  cat "$images_log" >&2
  [ "$images_rc" = 0 ] || { echo "building the container images failed (its output is above)" >&2; exit 1; }
fi
SIMBA_NEXTEST_PROFILE=ci scripts/containers.sh test

step "cargo package (every published crate; its package type-checked as a user builds it)"
# `cargo package --no-verify` makes each crate's package (the manifest as published, the
# files it ships, simba-cli's lock file). Then, in place of cargo's verification (a full
# debug build of each package, 305-311 s here), the unpacked packages are type-checked,
# each alone with its default features, as members of a workspace of their own whose
# simba-* dependencies are the unpacked packages (`[patch.crates-io]`) and whose lock
# file is this workspace's: a file a package lacks, a path dependency, a feature or a
# build script that fails outside the workspace fails here as it would for a user.
# simba-chaos and simba-docs (the guides' doctests, docs/) are not published.
published=(simba-core simba-test-kit simba-redis simba-jdbc simba-zookeeper simba-etcd simba-cli)
cargo package --workspace --exclude simba-chaos --exclude simba-docs --locked --allow-dirty \
  --no-verify --quiet
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
unpacked=$(mktemp -d)
cleanup_actions+=('rm -rf "$unpacked"')
{
  echo '[workspace]'
  echo 'resolver = "2"'
  printf 'members = ['
  for c in "${published[@]}"; do printf '"%s-%s", ' "$c" "$version"; done
  echo ']'
  echo '[patch.crates-io]'
  for c in "${published[@]}"; do echo "$c = { path = \"$c-$version\" }"; done
  # This workspace's profiles: the dependencies' check builds of the clippy steps are
  # reused.
  sed -n '/^\[profile/,$p' Cargo.toml
} >"$unpacked/Cargo.toml"
for c in "${published[@]}"; do
  tar -xzf "${CARGO_TARGET_DIR:-target}/package/$c-$version.crate" -C "$unpacked"
done
cp Cargo.lock "$unpacked/Cargo.lock"
target_dir=$(realpath "${CARGO_TARGET_DIR:-target}")
for c in "${published[@]}"; do
  (cd "$unpacked" && CARGO_TARGET_DIR="$target_dir" cargo check --offline --quiet -p "$c")
done

echo
echo "all checks passed"
