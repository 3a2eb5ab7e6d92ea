#!/usr/bin/env bash
# Creates a Python virtual environment for the analyst example and installs
# examples/analyst/requirements.txt into it.
#
#   examples/analyst/setup.sh            # venv in .venv/ at the repository root
#   VENV=/some/dir examples/analyst/setup.sh
#
# Then: .venv/bin/python examples/analyst/analyze.py SNAPSHOT_DIR
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${VENV:-$root/.venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet -r "$root/examples/analyst/requirements.txt"
"$venv/bin/python" -c 'import pyarrow, duckdb; print("pyarrow", pyarrow.__version__, "duckdb", duckdb.__version__)'
