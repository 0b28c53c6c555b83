#!/usr/bin/env bash
# Runs every fuzz target (or those named) for RUNS executions each (default 10 million),
# new inputs going to a scratch corpus (the committed corpus/ stays the seeds), and prints
# one line per target: executions, time, and whether it crashed. Needs a nightly toolchain
# and cargo-fuzz (`cargo install cargo-fuzz`).
#
#   fuzz/run.sh                      # every target, 10M executions each
#   RUNS=1000000 fuzz/run.sh redact  # one target, 1M executions
set -euo pipefail
cd "$(dirname "$0")"
runs=${RUNS:-10000000}
scratch=${SCRATCH:-$(mktemp -d)}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo +nightly fuzz list)
status=0
for t in "${targets[@]}"; do
  mkdir -p "$scratch/$t"
  start=$(date +%s)
  log="$scratch/$t.log"
  if cargo +nightly fuzz run -O "$t" "$scratch/$t" "corpus/$t" -- -runs="$runs" >"$log" 2>&1; then
    result=ok
  else
    result="CRASH (see $log and artifacts/$t)"
    status=1
  fi
  execs=$(grep -o 'Done [0-9]* runs' "$log" | grep -o '[0-9]*' || echo "?")
  printf '%-14s %10s runs  %5ss  %s\n' "$t" "$execs" "$(( $(date +%s) - start ))" "$result"
done
exit $status
