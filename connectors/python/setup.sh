#!/usr/bin/env bash
# Creates (once) the Python virtual environment of the trajflow Python package
# and prints its interpreter's path on the last line of stdout.
#
#   connectors/python/setup.sh          # -> .../venv-<hash>/bin/python
#   PY=$(connectors/python/setup.sh | tail -1)
#
# The venv is ${TRAJFLOW_CACHE:-$HOME/.cache/trajflow}/venv-<hash>, built as
# scripts/venv.sh says: the hash follows requirements.txt and the
# interpreter's version, so a fresh clone reuses it and a change of pins
# builds a new one; the dependencies are installed once (torch from PyPI is
# the CUDA build and brings ~4 GB of nvidia-* wheels), from wheels kept in
# $TRAJFLOW_CACHE/wheels. The trajflow package itself is reinstalled
# (--no-deps, a second or two) on every call so the venv always holds the
# checkout's code.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/venv.sh
. "$here/../../scripts/venv.sh"
venv_ensure venv "$here/requirements.txt" pyarrow numpy confluent_kafka torch pytest transformers safetensors gguf
"$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation --force-reinstall "$here" >&2
echo "$VENV/bin/python"
