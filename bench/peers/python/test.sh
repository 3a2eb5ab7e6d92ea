#!/usr/bin/env bash
# Runs the peers' tests in their cached virtual environment (setup.sh).
# pytest's exit status 5 ("no tests collected") is a failure.
#
#   bench/peers/python/test.sh [PYTEST ARGS...]
#
# The tests build the Go binary (go build ./cmd/trajflow) to export a corpus
# unless TRAJFLOW_BIN names one.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="$("$here/setup.sh" | tail -1)"
cd "$here"
set +e
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "$py" -m pytest -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "bench/peers/python/test.sh: pytest collected no tests (exit 5): failing" >&2
  exit 1
fi
exit "$rc"
