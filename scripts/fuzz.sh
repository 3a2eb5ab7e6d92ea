#!/usr/bin/env bash
# Bounded fuzzing of every fuzz target in the module (make fuzz).
#
# FUZZTIME (default 10s) bounds each target; FUZZ_JOBS (default 1) targets
# run at once, each printing its output when it ends. A target that fails
# with only "context deadline exceeded" at the end of its -fuzztime and
# writes no failing input hit the Go 1.26 fuzz coordinator's shutdown race
# (golang/go#75804, fixed in Go 1.27), not a bug in the code under test: it
# is run once more. Any other failure, or the same one twice, fails.
#
# The first target of each package compiles its instrumented test binary
# (every dependency again, with coverage guidance): most of a cold run. A
# serial pre-build of those binaries (go test -c -o /dev/null -fuzz . DIR)
# was measured on 2 cores, FUZZTIME=5s FUZZ_JOBS=2: 584 -> 504 s with an
# empty build cache, 123 -> 162 s with a warm one (it links every binary
# once more), so it is not done.
set -euo pipefail
cd "$(dirname "$0")/.."
export GO=${GO:-go}
export FUZZTIME=${FUZZTIME:-10s}
FUZZ_JOBS=${FUZZ_JOBS:-1}

# fuzz_one DIR TARGET: fuzzes one target, retrying the coordinator's race once.
fuzz_one() {
  local dir="$1" target="$2" out attempt
  for attempt in 1 2; do
    if out=$("$GO" test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" -fuzzminimizetime 1s "$dir" 2>&1); then
      printf 'fuzz %s %s\n%s\n' "$dir" "$target" "$(tail -n 2 <<<"$out")"
      return 0
    fi
    printf 'fuzz %s %s\n%s\n' "$dir" "$target" "$out"
    if [[ $attempt == 1 ]] && grep -q 'context deadline exceeded' <<<"$out" && ! grep -q 'Failing input written' <<<"$out"; then
      echo "fuzz $dir $target: ended on the coordinator's deadline race with no failing input; running it again"
      continue
    fi
    echo "fuzz $dir $target: FAILED"
    return 1
  done
}
export -f fuzz_one

for dir in $(grep -rl --include='*_test.go' '^func Fuzz' . | xargs -n1 dirname | sort -u); do
  for target in $(grep -h '^func Fuzz' "$dir"/*_test.go | sed 's/func \(Fuzz[A-Za-z0-9_]*\).*/\1/'); do
    echo "$dir $target"
  done
done | xargs -P "$FUZZ_JOBS" -L 1 bash -c 'fuzz_one "$0" "$1"'
