#!/usr/bin/env bash
# Creates (once) the Python virtual environment of the trajflow Python package
# and prints its interpreter's path on the last line of stdout.
#
#   connectors/python/setup.sh          # -> .../venv-<hash>/bin/python
#   PY=$(connectors/python/setup.sh | tail -1)
#
# The venv lives in ${TRAJFLOW_CACHE:-$HOME/.cache/trajflow}/venv-<hash>, the
# hash being that of requirements.txt (and of the base interpreter's version),
# so a fresh clone reuses it and a change of pins builds a new one. The
# dependencies are installed once (torch from PyPI is the CUDA build and brings
# ~4 GB of nvidia-* wheels). The wheels themselves are kept in
# $TRAJFLOW_CACHE/wheels (pip download skips files already there), so a new
# venv after a change of pins downloads only what changed: pip's HTTP cache
# does not help here, the registry's responses are not cacheable.
# The trajflow package itself is reinstalled (--no-deps, a second or two) on
# every call so the venv always holds the checkout's code.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3}"
cache="${TRAJFLOW_CACHE:-$HOME/.cache/trajflow}"
pyver="$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
hash="$( { cat "$here/requirements.txt"; echo "python $pyver"; } | sha256sum | cut -c1-16)"
venv="$cache/venv-$hash"
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
  "$venv/bin/python" -c 'import pyarrow, numpy, confluent_kafka, torch, pytest, transformers, safetensors, gguf' >&2
  end=$(date +%s)
  size="$(du -sh "$venv" | cut -f1)"
  echo "trajflow python venv: installed in $((end - start)) s, $size at $venv" >&2
  touch "$venv/.complete"
fi

"$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation --force-reinstall "$here" >&2
echo "$venv/bin/python"
