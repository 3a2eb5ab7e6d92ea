#!/usr/bin/env bash
# Creates (once) the virtual environment of the in-memory peers of
# `trajflow bench peers` (Ray, ZeroMQ + msgpack) and prints its interpreter's
# path on the last line of stdout.
#
#   PY=$(bench/peers/python/setup.sh | tail -1)
#
# The venv is ${TRAJFLOW_CACHE:-$HOME/.cache/trajflow}/venv-peers-<hash>,
# built as scripts/venv.sh says (the hash follows requirements.txt and the
# interpreter's version; the wheels are shared with the project's other
# venv). The trajflow_peers package is not installed into it: callers put
# this folder on PYTHONPATH (test.sh, `trajflow bench peers`), so the venv
# always runs the checkout's code.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/venv.sh
. "$here/../../../scripts/venv.sh"
venv_ensure venv-peers "$here/requirements.txt" ray zmq msgpack psutil pytest
echo "$VENV/bin/python"
