#!/usr/bin/env bash
# Bounded fuzzing of every fuzz target in the module (make fuzz).
#
# FUZZTIME (default 10s) bounds each target. A target that fails with only
# "context deadline exceeded" at the end of its -fuzztime and writes no
# failing input hit the Go 1.26 fuzz coordinator's shutdown race
# (golang/go#75804, fixed in Go 1.27), not a bug in the code under test: it
# is run once more. Any other failure, or the same one twice, fails.
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
FUZZTIME=${FUZZTIME:-10s}

for dir in $(grep -rl --include='*_test.go' '^func Fuzz' . | xargs -n1 dirname | sort -u); do
  for target in $(grep -h '^func Fuzz' "$dir"/*_test.go | sed 's/func \(Fuzz[A-Za-z0-9_]*\).*/\1/'); do
    for attempt in 1 2; do
      echo "fuzz $dir $target"
      if out=$("$GO" test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" -fuzzminimizetime 1s "$dir" 2>&1); then
        tail -n 2 <<<"$out"
        break
      fi
      echo "$out"
      if [[ $attempt == 1 ]] && grep -q 'context deadline exceeded' <<<"$out" && ! grep -q 'Failing input written' <<<"$out"; then
        echo "fuzz $dir $target: ended on the coordinator's deadline race with no failing input; running it again"
        continue
      fi
      exit 1
    done
  done
done
