# Sourced by the project's Python setup and test scripts (connectors/python/,
# bench/peers/python/); defines venv_ensure and run_pytest.
#
#   venv_ensure PREFIX REQUIREMENTS MODULE...
#
# makes sure ${TRAJFLOW_CACHE:-$HOME/.cache/trajflow}/PREFIX-<hash> is a
# complete virtual environment with the pins of REQUIREMENTS installed, and
# sets VENV to its path. The hash is that of REQUIREMENTS and of the base
# interpreter's version ($PYTHON, default python3), so a fresh clone reuses
# the venv and a change of pins builds a new one. Wheels are kept in
# $TRAJFLOW_CACHE/wheels, shared by every venv of the project (pip download
# skips the files already there: a new venv after a change of pins downloads
# only what changed, where pip's HTTP cache would not help, the registry's
# responses being uncacheable). A venv counts as complete once every MODULE
# imports in it; a half-built one (an install killed midway) is rebuilt from
# scratch. Progress goes to stderr.
venv_ensure() {
  local prefix=$1 requirements=$2
  shift 2
  local python="${PYTHON:-python3}"
  local cache="${TRAJFLOW_CACHE:-$HOME/.cache/trajflow}"
  local pyver hash wheels start
  pyver="$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
  hash="$( { cat "$requirements"; echo "python $pyver"; } | sha256sum | cut -c1-16)"
  VENV="$cache/$prefix-$hash"
  wheels="$cache/wheels"
  export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$cache/pip}"
  mkdir -p "$cache" "$wheels"
  if [ -f "$VENV/.complete" ]; then
    return 0
  fi
  rm -rf "$VENV.tmp"
  start=$(date +%s)
  "$python" -m venv "$VENV.tmp"
  "$VENV.tmp/bin/python" -m pip install --quiet --upgrade pip >&2
  "$VENV.tmp/bin/python" -m pip download --quiet -d "$wheels" -r "$requirements" >&2
  "$VENV.tmp/bin/python" -m pip install --quiet --no-index --find-links "$wheels" -r "$requirements" >&2
  rm -rf "$VENV"
  mv "$VENV.tmp" "$VENV"
  # venv scripts carry the absolute path of their interpreter: rewrite them
  # for the final location.
  grep -rlI "$VENV.tmp" "$VENV/bin" | xargs -r sed -i "s#$VENV.tmp#$VENV#g"
  local modules
  modules="$(printf '%s, ' "$@")"
  "$VENV/bin/python" -c "import ${modules%, }" >&2
  echo "trajflow venv $prefix: installed in $(($(date +%s) - start)) s, $(du -sh "$VENV" | cut -f1) at $VENV" >&2
  touch "$VENV/.complete"
}

# run_pytest PYTHON DIR [PYTEST ARGS...] runs pytest with PYTHON in DIR, DIR
# on PYTHONPATH (so the checkout's code is what runs), and returns its exit
# status, except that status 5 ("no tests collected") is a failure (1): a
# selection that matches nothing must not pass.
run_pytest() {
  local py=$1 dir=$2 rc=0
  shift 2
  (cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "$py" -m pytest -p no:cacheprovider "$@") || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "$dir: pytest collected no tests (exit 5): failing" >&2
    return 1
  fi
  return "$rc"
}
