#!/usr/bin/env bash
# Runs every fuzz target (or those named) for RUNS executions each (default 10 million),
# or for MAX_TIME seconds each if that comes first (libFuzzer's -max_total_time; default:
# no time limit), new inputs going to a scratch corpus (the committed corpus/ stays the
# seeds), and prints one line per target: executions, time, and whether it crashed. The
# targets are built optimized *with* debug assertions and overflow checks (`-O -a`), so
# that an arithmetic overflow on hostile input is a crash, as in a debug build. Needs a
# nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`).
#
#   fuzz/run.sh                               # every target, 10M executions each
#   RUNS=1000000 fuzz/run.sh redact           # one target, 1M executions
#   MAX_TIME=600 fuzz/run.sh sql_row          # 10M executions or 10 minutes, first wins
set -euo pipefail
cd "$(dirname "$0")"
runs=${RUNS:-10000000}
limits=(-runs="$runs")
if [ -n "${MAX_TIME:-}" ]; then
  case $MAX_TIME in
    *[!0-9]* | 0) echo "MAX_TIME must be a whole number of seconds > 0, got '$MAX_TIME'" >&2; exit 2 ;;
  esac
  limits+=(-max_total_time="$MAX_TIME")
fi
scratch=${SCRATCH:-$(mktemp -d)}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo +nightly fuzz list)
status=0
for t in "${targets[@]}"; do
  mkdir -p "$scratch/$t"
  start=$(date +%s)
  log="$scratch/$t.log"
  if cargo +nightly fuzz run -O -a "$t" "$scratch/$t" "corpus/$t" -- "${limits[@]}" >"$log" 2>&1; then
    result=ok
  else
    result="CRASH (see $log and artifacts/$t)"
    status=1
  fi
  execs=$(grep -o 'Done [0-9]* runs' "$log" | grep -o '[0-9]*' || echo "?")
  printf '%-14s %10s runs  %5ss  %s\n' "$t" "$execs" "$(( $(date +%s) - start ))" "$result"
done
exit $status
