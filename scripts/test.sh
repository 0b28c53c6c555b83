#!/usr/bin/env bash
# The whole check, as CI runs it: installs what is missing, starts one shared Redis,
# MariaDB, PostgreSQL and ZooKeeper for the tests (fault tests start private ones), then
# format, lints, docs, every test (doctests too), cargo-deny, and short chaos/bench smokes.
#
#   scripts/test.sh            # everything
#   SIMBA_SKIP_INSTALL=1 ...   # do not apt-get (servers already installed)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

step() { printf '\n== %s (%s)\n' "$*" "$(date +%T)"; }

need_install=()
command -v redis-server >/dev/null || need_install+=(redis-server)
command -v mariadbd >/dev/null || command -v mysqld >/dev/null || need_install+=(mariadb-server)
{ [ -f /usr/share/java/zookeeper.jar ] || ls /usr/share/java/zookeeper-*.jar >/dev/null 2>&1; } || need_install+=(zookeeper)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_install+=(postgresql)
command -v java >/dev/null || need_install+=(default-jre-headless)
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
    echo "(or point SIMBA_TEST_REDIS_URL / SIMBA_TEST_MYSQL_URL / SIMBA_TEST_POSTGRES_URL / SIMBA_TEST_ZOOKEEPER at servers)" >&2
    exit 1
  fi
fi

if ! command -v cargo-deny >/dev/null; then
  step "installing cargo-deny"
  cargo install cargo-deny --locked --quiet
fi

# Started first: the Redis restart quarantine keeps a freshly started Redis from granting
# ownership for one lease, so the servers get to age while the code is checked and built.
step "shared test servers"
servers_env=$(mktemp)
cargo run --quiet -p simba-test-kit --bin simba-test-servers -- --env-file "$servers_env" &
servers_pid=$!
cleanup() { kill "$servers_pid" 2>/dev/null || true; wait "$servers_pid" 2>/dev/null || true; rm -f "$servers_env"; }
trap cleanup EXIT
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

step "cargo fmt --check"
cargo fmt --all -- --check

step "clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings

step "simba-core depends on no backend"
if cargo tree -p simba-core -e normal --prefix none | grep -E '^(fred|diesel|zookeeper)' ; then
  echo "simba-core must not depend on a backend crate" >&2
  exit 1
fi

step "docs"
RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps --quiet

step "cargo deny"
cargo deny --offline check licenses bans sources

step "build tests"
cargo build --workspace --all-targets --quiet

step "tests"
cargo nextest run --workspace --profile ci --test-threads 3 --no-tests fail

step "doctests"
cargo test --workspace --doc --quiet

echo
echo "all checks passed"
