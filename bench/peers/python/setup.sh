#!/usr/bin/env bash
# Creates (once) the virtual environment of the in-memory peers of
# `trajflow bench peers` (Ray, ZeroMQ + msgpack) and prints its interpreter's
# path on the last line of stdout.
#
#   PY=$(bench/peers/python/setup.sh | tail -1)
#
# The venv lives in ${TRAJFLOW_CACHE:-$HOME/.cache/trajflow}/venv-peers-<hash>,
# the hash being that of requirements.txt and of the base interpreter's
# version, so a fresh clone reuses it and a change of pins builds a new one.
# Wheels are kept in $TRAJFLOW_CACHE/wheels (shared with the other venvs of
# the project). The trajflow_peers package is not installed into it: callers
# put this folder on PYTHONPATH (test.sh, `trajflow bench peers`), so the
# venv always runs the checkout's code.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3}"
cache="${TRAJFLOW_CACHE:-$HOME/.cache/trajflow}"
pyver="$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
hash="$( { cat "$here/requirements.txt"; echo "python $pyver"; } | sha256sum | cut -c1-16)"
venv="$cache/venv-peers-$hash"
wheels="$cache/wheels"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$cache/pip}"
mkdir -p "$cache" "$wheels"

if [ ! -f "$venv/.complete" ]; then
  # A half-built venv (killed install) is rebuilt from scratch: the marker is
  # written only after every dependency imported.
  rm -rf "$venv.tmp"
  start=$(date +%s)
  "$python" -m venv "$venv.tmp"
  "$venv.tmp/bin/python" -m pip install --quiet --upgrade pip >&2
  "$venv.tmp/bin/python" -m pip download --quiet -d "$wheels" -r "$here/requirements.txt" >&2
  "$venv.tmp/bin/python" -m pip install --quiet --no-index --find-links "$wheels" -r "$here/requirements.txt" >&2
  rm -rf "$venv"
  mv "$venv.tmp" "$venv"
  # venv scripts carry the absolute path of their interpreter: rewrite them
  # for the final location.
  grep -rlI "$venv.tmp" "$venv/bin" | xargs -r sed -i "s#$venv.tmp#$venv#g"
  "$venv/bin/python" -c 'import ray, zmq, msgpack, psutil, pytest' >&2
  end=$(date +%s)
  echo "trajflow peers venv: installed in $((end - start)) s, $(du -sh "$venv" | cut -f1) at $venv" >&2
  touch "$venv/.complete"
fi

echo "$venv/bin/python"
