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
# shellcheck source=scripts/venv.sh
. "$here/../../../scripts/venv.sh"
py="$("$here/setup.sh" | tail -1)"
run_pytest "$py" "$here" "$@"
