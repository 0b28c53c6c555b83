#!/usr/bin/env bash
# Server images and the conformance suites through containers.
#
#   scripts/containers.sh build   # build the images that are missing or out of date
#   scripts/containers.sh build etcd zookeeper   # only these images (same rule)
#   scripts/containers.sh test    # build, then the kit's container tests and each backend's
#                                 # conformance suite once with SIMBA_TEST_SERVERS=containers;
#                                 # fails on leftover containers
#   scripts/containers.sh clean   # remove containers and networks labelled simba.test (leftovers)
#
# The images (simba/redis, simba/mariadb, simba/postgres, simba/zookeeper, simba/etcd,
# simba/pgbouncer: PostgreSQL and PgBouncer in one; tag $TAG) are
# built from Debian bookworm's packages with the Dockerfiles under docker/. Their base is
# debian:bookworm-slim when the Docker engine can pull it; otherwise this script makes
# simba/debian:bookworm itself with debootstrap from the Debian mirror apt uses on this
# machine (root and debootstrap needed; it apt-get installs debootstrap when missing).
# Every image carries a label simba.hash over its build inputs: an image is rebuilt only
# when its Dockerfile directory or its base changed.
#
# Settings (environment):
#   SIMBA_BASE_IMAGE      base image to build on, skipping the pull/debootstrap choice
#   SIMBA_DEBIAN_MIRROR   mirror for debootstrap (default: the one apt uses here)
#   DOCKER                docker client command (default: docker)
#
# Without a Docker daemon `test` prints "containers: skipped, no docker daemon" and exits 0;
# `build` fails.
set -euo pipefail
cd "$(dirname "$0")/.."
# debootstrap (and apt's helpers) live in the sbin directories, which a minimal PATH may
# lack (the cold CI check ran with PATH=/usr/local/bin:/usr/bin:/bin and apt installed
# debootstrap where `command -v` could not find it).
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

DOCKER=${DOCKER:-docker}
TAG=bookworm
SERVICES=(redis mariadb postgres zookeeper etcd pgbouncer)
LOCAL_BASE=simba/debian:$TAG
PULL_BASE=debian:bookworm-slim
# Changing how the debootstrap base is made: bump this to rebuild it.
BASE_RECIPE="minbase bookworm v1"
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
# The features of the container runs (scripts/test.sh builds with the same).
CONTAINER_FEATURES=simba-test-kit/containers,simba-chaos/containers,simba-cli/etcd

log() { printf 'containers: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }
now() { date +%s; }

daemon_answers() { "$DOCKER" info >/dev/null 2>&1; }

need_daemon() {
  daemon_answers && return 0
  die "no Docker daemon answers ('$DOCKER info' fails): start it (e.g. 'systemctl start docker' or 'dockerd &'), or set DOCKER_HOST; a non-root user needs to be in the 'docker' group"
}

# The label simba.hash of an image, empty when the image is missing.
image_hash() {
  "$DOCKER" image inspect -f '{{index .Config.Labels "simba.hash"}}' "$1" 2>/dev/null || true
}

image_id() { "$DOCKER" image inspect -f '{{.Id}}' "$1" 2>/dev/null || true; }

# The apt sources of this machine for bookworm's main component, one "URI CODENAME" per line.
host_sources() {
  command -v apt-get >/dev/null || return 0
  apt-get indextargets --format '$(REPO_URI) $(CODENAME) $(COMPONENT)' 'Identifier: Packages' 2>/dev/null \
    | awk '$2 ~ /^bookworm(-updates|-security)?$/ && $3 == "main" { print $1, $2 }' | sort -u
}

# Makes simba/debian:bookworm with debootstrap (minbase) and docker import.
build_local_base() {
  local sources mirror
  sources=$(host_sources)
  if [ -n "${SIMBA_DEBIAN_MIRROR:-}" ]; then
    mirror=$SIMBA_DEBIAN_MIRROR
    sources="$mirror bookworm"
  else
    mirror=$(awk '$2 == "bookworm" { print $1; exit }' <<<"$sources")
    if [ -z "$mirror" ]; then
      mirror=http://deb.debian.org/debian/
      sources="$mirror bookworm"
    fi
  fi
  local hash
  hash=$(printf '%s\n%s\n' "$BASE_RECIPE" "$sources" | sha256sum | cut -c1-16)
  if [ "$(image_hash "$LOCAL_BASE")" = "$hash" ]; then
    log "$LOCAL_BASE is up to date"
    return 0
  fi
  [ "$(id -u)" = 0 ] || die "making $LOCAL_BASE needs root (debootstrap); or set SIMBA_BASE_IMAGE to a Debian bookworm image this engine has"
  if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null \
      || die "apt-get install debootstrap failed"
  fi
  local start root
  start=$(now)
  root=$(mktemp -d /var/tmp/simba-debootstrap.XXXXXX)
  # shellcheck disable=SC2064
  trap "rm -rf '$root'" EXIT
  log "debootstrap bookworm (minbase) from $mirror"
  local keyring=()
  [ -f /usr/share/keyrings/debian-archive-keyring.gpg ] && keyring=(--keyring=/usr/share/keyrings/debian-archive-keyring.gpg)
  if ! debootstrap --variant=minbase "${keyring[@]}" bookworm "$root/fs" "$mirror" >"$root/log" 2>&1; then
    tail -n 20 "$root/log" >&2
    die "debootstrap failed (log above)"
  fi
  # The same sources as this machine; a snapshot mirror has expired Valid-Until dates.
  awk '{ print "deb " $1 " " $2 " main" }' <<<"$sources" >"$root/fs/etc/apt/sources.list"
  cat >"$root/fs/etc/apt/apt.conf.d/90simba" <<'EOF'
Acquire::Check-Valid-Until "false";
Acquire::Languages "none";
APT::Install-Recommends "false";
EOF
  # Like the registry's slim images: no documentation, manuals or translations.
  cat >"$root/fs/etc/dpkg/dpkg.cfg.d/90simba-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
  printf '#!/bin/sh\nexit 101\n' >"$root/fs/usr/sbin/policy-rc.d"
  chmod +x "$root/fs/usr/sbin/policy-rc.d"
  rm -rf "$root/fs/var/cache/apt/"*.bin "$root/fs/var/cache/apt/archives/"*.deb \
    "$root/fs/var/lib/apt/lists/"* "$root/fs/usr/share/man/"* "$root/fs/usr/share/info/"* \
    "$root/fs/var/log/"*.log "$root/fs/var/log/apt/"*
  find "$root/fs/usr/share/doc" -mindepth 2 ! -name copyright -delete 2>/dev/null || true
  find "$root/fs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
  tar -C "$root/fs" -c . | "$DOCKER" import \
    --change 'CMD ["/bin/bash"]' \
    --change "LABEL simba.hash=$hash" \
    - "$LOCAL_BASE" >/dev/null
  rm -rf "$root"
  trap - EXIT
  log "$LOCAL_BASE made in $(($(now) - start)) s ($("$DOCKER" image inspect -f '{{.Size}}' "$LOCAL_BASE" | awk '{ printf "%d MB", $1 / 1e6 }'))"
}

# Prints the base image to build on, making or pulling it when needed.
choose_base() {
  if [ -n "${SIMBA_BASE_IMAGE:-}" ]; then
    [ -n "$(image_id "$SIMBA_BASE_IMAGE")" ] || "$DOCKER" pull -q "$SIMBA_BASE_IMAGE" >/dev/null \
      || die "SIMBA_BASE_IMAGE=$SIMBA_BASE_IMAGE is neither here nor pullable"
    echo "$SIMBA_BASE_IMAGE"
  elif [ -n "$(image_id "$PULL_BASE")" ]; then
    echo "$PULL_BASE"
  elif "$DOCKER" pull -q "$PULL_BASE" >/dev/null 2>&1; then
    log "pulled $PULL_BASE"
    echo "$PULL_BASE"
  else
    log "$PULL_BASE cannot be pulled here: using $LOCAL_BASE (debootstrap)"
    build_local_base
    echo "$LOCAL_BASE"
  fi
}

# The hash of an image's inputs: the files of its build context and the base image id.
context_hash() {
  local dir=$1 base_id=$2
  { (cd "$dir" && find . -type f -print0 | sort -z | xargs -0 sha256sum); echo "$base_id"; } \
    | sha256sum | cut -c1-16
}

# Builds the images named (redis, mariadb, …; all of them when none is named).
cmd_build() {
  local services=("$@") s known
  [ ${#services[@]} -gt 0 ] || services=("${SERVICES[@]}")
  for s in "${services[@]}"; do
    known=
    for k in "${SERVICES[@]}"; do [ "$k" = "$s" ] && known=1; done
    [ -n "$known" ] || die "unknown image '$s': the images are ${SERVICES[*]}"
  done
  need_daemon
  local total base base_id
  total=$(now)
  base=$(choose_base)
  base_id=$(image_id "$base")
  for service in "${services[@]}"; do
    local image=simba/$service:$TAG hash start build_log
    hash=$(context_hash "docker/$service" "$base_id")
    if [ "$(image_hash "$image")" = "$hash" ]; then
      log "$image is up to date"
      continue
    fi
    start=$(now)
    log "building $image on $base"
    # The build's output is shown only when it fails.
    build_log=$(mktemp)
    if ! "$DOCKER" build --network host --build-arg "BASE=$base" --label "simba.hash=$hash" \
      -t "$image" "docker/$service" >"$build_log" 2>&1; then
      tail -n 30 "$build_log" >&2
      rm -f "$build_log"
      die "building $image failed (the end of its output is above)"
    fi
    rm -f "$build_log"
    log "$image built in $(($(now) - start)) s"
  done
  "$DOCKER" image prune -f --filter label=simba.hash >/dev/null 2>&1 || true
  log "images ready in $(($(now) - total)) s"
}

# Leftover test containers, one "id name image status" line each, and test networks (the
# ZooKeeper ensemble's and the etcd cluster's), one "network id name" line each.
leftovers() {
  "$DOCKER" ps -a --filter label=simba.test --format '{{.ID}} {{.Names}} {{.Image}} {{.Status}}'
  "$DOCKER" network ls --filter label=simba.test --format 'network {{.ID}} {{.Name}}'
}

cmd_clean() {
  daemon_answers || { log "no docker daemon, nothing to clean"; return 0; }
  local ids
  ids=$("$DOCKER" ps -aq --filter label=simba.test)
  if [ -n "$ids" ]; then
    # shellcheck disable=SC2086
    "$DOCKER" rm -f -v $ids >/dev/null
    log "removed $(wc -w <<<"$ids") leftover test container(s)"
  fi
  ids=$("$DOCKER" network ls -q --filter label=simba.test)
  if [ -n "$ids" ]; then
    # shellcheck disable=SC2086
    "$DOCKER" network rm $ids >/dev/null
    log "removed $(wc -w <<<"$ids") leftover test network(s)"
  fi
}

cmd_test() {
  if ! daemon_answers; then
    echo "containers: skipped, no docker daemon"
    return 0
  fi
  cmd_build
  cmd_clean
  local status=0 start
  start=$(now)
  export SIMBA_TEST_SERVERS=containers
  # A server given by URL would win over containers: these runs are about containers.
  unset SIMBA_TEST_REDIS_URL SIMBA_TEST_MYSQL_URL SIMBA_TEST_POSTGRES_URL SIMBA_TEST_ZOOKEEPER SIMBA_TEST_ETCD_URL \
    SIMBA_TEST_PGBOUNCER_URL SIMBA_TEST_PGBOUNCER_SESSION_URL SIMBA_TEST_PGBOUNCER_DIRECT_URL
  # One run over the whole workspace with the feature on: the same build as the test
  # command's (scripts/test.sh), so nothing is compiled twice; the filter picks the kit's
  # container tests (the ZooKeeper ensemble and the etcd cluster among them), simba-chaos's
  # zookeeper-ensemble and etcd-cluster rounds and cluster fault cases, and every backend's
  # conformance suite.
  local filter='binary(containers) | (package(simba-redis) & binary(conformance))'
  # (The suite on a JVM Simba table runs once, in the local-binary step.)
  filter+=' | (package(simba-jdbc) & (binary(conformance_mysql) | binary(conformance_postgres)) & !test(/^jvm_table::/))'
  filter+=' | (package(simba-zookeeper) & binary(conformance))'
  filter+=' | (package(simba-etcd) & binary(conformance))'
  log "cargo nextest run --workspace --features $CONTAINER_FEATURES -E '$filter' (servers: containers)"
  cargo nextest run --workspace --features "$CONTAINER_FEATURES" --profile "${SIMBA_NEXTEST_PROFILE:-default}" \
    -E "$filter" --no-tests fail || status=1
  local left
  left=$(leftovers)
  if [ -n "$left" ]; then
    log "test containers were left behind:"
    printf '%s\n' "$left" >&2
    cmd_clean
    status=1
  fi
  log "conformance through containers: $([ $status = 0 ] && echo passed || echo FAILED) in $(($(now) - start)) s"
  return $status
}

case "${1:-}" in
  build) shift; cmd_build "$@" ;;
  test) cmd_test ;;
  clean) cmd_clean ;;
  *)
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
