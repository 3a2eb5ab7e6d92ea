#!/usr/bin/env bash
# Device check of the CUDA backend (gpu/cuda), for a machine with an NVIDIA
# GPU, its driver and PyTorch, and no Go toolchain. Build the binary on any
# machine first (`make cuda-build` -> bin/cuda/gpu-cuda.test, which is both
# the test and the benchmark binary), bring the repository with it, then:
#
#   gpu/devicecheck.sh [TEST_BIN] [BENCH_BIN] [OUT_DIR]
#
# It runs, in order and with time limits that keep the whole script well
# under 8 minutes:
#   1. device, driver, toolkit and PyTorch facts;
#   2. the parity tests (GPU step vs CPU reference step, 1e-5 relative on
#      loss statistics and parameters, several random batches; and the
#      train backend, TestDeviceBackend: Update with two epochs on real
#      batches vs the CPU trainer's Update, Adam moments included, and an
#      untrainable batch leaving the device state unchanged) with the
#      embedded PTX, and again with PTX compiled here by nvcc when nvcc
#      exists (TRAJFLOW_CUDA_PTX points the binary at it);
#   3. the benchmarks: pinned host-to-device copy, the Arrow->pinned->device
#      staging path, device-to-device copy, and the log-prob/loss kernel,
#      which writes its tensors for
#   4. the same computation in PyTorch eager (gpu/devicecheck_torch.py).
# Results: OUT_DIR/results.md (a section for bench/RESULTS.md) plus the raw
# logs. Exit status 0 only when every step ran and every target was met.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
TEST_BIN="${1:-$root/bin/cuda/gpu-cuda.test}"
BENCH_BIN="${2:-$TEST_BIN}"
OUT_DIR="${3:-${OUT:-$root/out/devicecheck}}"
mkdir -p "$OUT_DIR/tensors"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
log="$OUT_DIR/devicecheck.log"
res="$OUT_DIR/results.md"
: >"$log"
say() { echo "$*" | tee -a "$log"; }
fail=0

for b in "$TEST_BIN" "$BENCH_BIN"; do
  [ -x "$b" ] || { say "missing binary $b (run make cuda-build)"; exit 2; }
done
# The tests run from gpu/cuda (their testdata), so the binaries' paths must
# not depend on the caller's directory.
abspath() { echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; }
TEST_BIN="$(abspath "$TEST_BIN")"; BENCH_BIN="$(abspath "$BENCH_BIN")"

# 1. Facts.
say "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader 2>&1 | tee -a "$log"
device="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
nvcc_v="$(command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -1 || echo none)"
torch_v="$(python3 -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null || echo none)"
say "nvcc: $nvcc_v"; say "torch: $torch_v"

# cuBLAS: the binary needs libcublas.so.12 (and the driver's libcuda.so.1).
# Look in the loader cache, CUDA installs and Python's nvidia-* wheels; if
# only cuBLAS 13 exists, expose it under the 12 soname (the v2 entry points
# the binary calls exist in both).
libdir="$OUT_DIR/lib"; mkdir -p "$libdir"
find_cublas() {
  { ldconfig -p 2>/dev/null | awk '/libcublas\.so\.[0-9]+ /{print $NF}'
    ls /usr/local/cuda*/lib64/libcublas.so.* /usr/lib/x86_64-linux-gnu/libcublas.so.* 2>/dev/null
    python3 - <<'PY' 2>/dev/null
import site, glob, os
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for p in glob.glob(os.path.join(d, "nvidia", "**", "libcublas.so.*"), recursive=True):
        print(p)
PY
  } | grep -E 'libcublas\.so\.[0-9]+$' | sort -u
}
cands="$(find_cublas)"
c12="$(echo "$cands" | grep 'libcublas\.so\.12$' | head -1)"
cublas_note=""
if [ -n "$c12" ]; then
  export LD_LIBRARY_PATH="$(dirname "$c12")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  cublas_note="libcublas.so.12 from $c12"
else
  c13="$(echo "$cands" | grep -E 'libcublas\.so\.1[3-9]$' | head -1)"
  if [ -n "$c13" ]; then
    ln -sf "$c13" "$libdir/libcublas.so.12"
    export LD_LIBRARY_PATH="$libdir:$(dirname "$c13")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    cublas_note="no cuBLAS 12 found; $c13 under the libcublas.so.12 name"
  else
    say "no libcublas found"; exit 2
  fi
fi
say "cublas: $cublas_note"

# 2. Parity.
say "== parity (embedded PTX)"
( cd "$root/gpu/cuda" && timeout 150 "$TEST_BIN" -test.run 'TestDevice' -test.v -test.count=1 ) >"$OUT_DIR/parity.log" 2>&1
parity_rc=$?
cat "$OUT_DIR/parity.log" >>"$log"
grep -E '^(--- |ok|FAIL|PASS)|params rel' "$OUT_DIR/parity.log" | tee -a /dev/stderr >/dev/null
[ $parity_rc = 0 ] || fail=1
parity_nvcc="not run (no nvcc)"
if command -v nvcc >/dev/null 2>&1; then
  say "== parity (PTX compiled here by nvcc)"
  if nvcc -ptx -arch=compute_90 -o "$OUT_DIR/trajflow.nvcc.ptx" "$root/gpu/cuda/kernels/trajflow.cu" >>"$log" 2>&1; then
    ( cd "$root/gpu/cuda" && TRAJFLOW_CUDA_PTX="$OUT_DIR/trajflow.nvcc.ptx" timeout 100 "$TEST_BIN" -test.run 'TestDeviceParity' -test.count=1 ) >"$OUT_DIR/parity-nvcc.log" 2>&1
    if [ $? = 0 ]; then parity_nvcc="PASS"; else parity_nvcc="FAIL"; fail=1; fi
  else
    parity_nvcc="nvcc failed"; fail=1
  fi
fi

# 3. Benchmarks.
say "== benchmarks"
( cd "$root/gpu/cuda" && TRAJFLOW_DUMP_DIR="$OUT_DIR/tensors" timeout 240 "$BENCH_BIN" -test.run '^$' \
    -test.bench 'H2DPinned|StagingH2D|StagingPackH2D|CopyD2D|LogprobLoss|DeviceStep' -test.benchtime 20x -test.count=1 ) >"$OUT_DIR/bench.log" 2>&1
bench_rc=$?
cat "$OUT_DIR/bench.log" | tee -a "$log"
[ $bench_rc = 0 ] || fail=1
metric() { # benchmark-name unit
  awk -v b="$1" -v u="$2" '$1 ~ "^Benchmark"b"(-[0-9]+)?$" { for (i = 2; i < NF; i++) if ($(i+1) == u) print $i }' "$OUT_DIR/bench.log" | tail -1
}
h2d="$(metric H2DPinned GB/s)"
staging_gbs="$(metric StagingH2D GB/s)"
pack_mbs="$(metric StagingPackH2D MB/s)"
d2d="$(metric CopyD2D GB/s)"
kern="$(metric LogprobLoss GB/s)"
kms="$(metric LogprobLoss kernel-ms)"
step_tps="$(metric DeviceStep tokens/s)"

# 4. PyTorch eager on the same tensors.
say "== pytorch eager"
torch_json="$(timeout 120 python3 "$root/gpu/devicecheck_torch.py" "$OUT_DIR/tensors" 2>>"$log")" || fail=1
say "$torch_json"
rm -f "$OUT_DIR/tensors/logits.f32"
tget() { python3 -c "import json,sys; d=json.loads(sys.argv[1]); print(d.get(sys.argv[2], ''))" "$torch_json" "$1" 2>/dev/null; }
tms="$(tget torch_loss_ms)"; tdiff="$(tget max_abs_logprob_diff)"; tloss="$(tget torch_loss)"; closs="$(tget cuda_loss)"

ratio() { python3 -c "import sys; a,b=sys.argv[1],sys.argv[2]; print('%.2f' % (float(a)/float(b)) if a and b else 'n/a')" "$1" "$2" 2>/dev/null || echo n/a; }
pack_gbs="$(python3 -c "import sys; print('%.1f' % (float(sys.argv[1])/1000))" "$pack_mbs" 2>/dev/null || echo "")"
r_stage="$(ratio "$staging_gbs" "$h2d")"
r_pcie="$(ratio "$h2d" 55)"
r_kern="$(ratio "$kern" "$d2d")"
r_torch="$(ratio "$tms" "$kms")"
check() { python3 -c "import sys; print('met' if sys.argv[1] not in ('','n/a') and float(sys.argv[1]) >= float(sys.argv[2]) else 'NOT met')" "$1" "$2" 2>/dev/null || echo "NOT met"; }
t_stage="$(check "$r_stage" 0.8)"; t_kern="$(check "$r_kern" 0.6)"; t_torch="$(check "$r_torch" 1.0)"
parity_s="$([ $parity_rc = 0 ] && echo PASS || echo FAIL)"
# The train backend's result, on its own row (it is part of the parity run).
if grep -q -- '--- PASS: TestDeviceBackend' "$OUT_DIR/parity.log"; then backend_s=PASS
elif grep -q -- '--- FAIL: TestDeviceBackend' "$OUT_DIR/parity.log"; then backend_s=FAIL
else backend_s="not run"; fail=1; fi
for t in "$t_stage" "$t_kern" "$t_torch"; do [ "$t" = met ] || fail=1; done

cat >"$res" <<MD
## CUDA backend device check — $(date -u +%Y-%m-%dT%H:%MZ)

Device: ${device:-unknown}; nvcc: ${nvcc_v}; PyTorch: ${torch_v}; cuBLAS: ${cublas_note}.
Binary: $(basename "$TEST_BIN") (built with \`make cuda-build\`); script: gpu/devicecheck.sh.

| check | result | target |
| --- | --- | --- |
| parity, embedded PTX (GPU step vs CPU step, loss stats + params, 1e-5 rel) | ${parity_s} | pass |
| parity, PTX compiled on this machine by nvcc | ${parity_nvcc} | pass |
| train backend (gpu.Backend Update vs CPU Update, 2 epochs x 4 real batches; Adam moments 1e-4 rel; untrainable batch leaves the state unchanged) | ${backend_s} | pass |
| pinned H2D copy | ${h2d:-n/a} GB/s (${r_pcie} of a 55 GB/s PCIe Gen5 x16 ceiling) | — |
| staged-batch copies (double-buffered slots, slot events) | ${staging_gbs:-n/a} GB/s = ${r_stage} of pinned copy | >= 0.80: ${t_stage} |
| Arrow -> pinned packing + copy, end to end (host-bound, one goroutine) | ${pack_gbs:-n/a} GB/s | — |
| device-to-device copy (read + write) | ${d2d:-n/a} GB/s | — |
| log-prob/loss kernel (logits read once) | ${kern:-n/a} GB/s = ${r_kern} of device copy; ${kms:-n/a} ms | >= 0.60: ${t_kern} |
| PyTorch eager log_softmax + gather + loss, same tensors | ${tms:-n/a} ms; kernel speedup ${r_torch}x | > 1: ${t_torch} |
| full device step, window MLP V=32000 H=512, ~12k-token batches | ${step_tps:-n/a} tokens/s | — |
| max abs log-prob difference, kernel vs PyTorch | ${tdiff:-n/a} | — |
| loss, kernel vs PyTorch | ${closs:-n/a} vs ${tloss:-n/a} | — |

Raw logs: parity.log, bench.log, devicecheck.log.
MD
cat "$res"
exit $fail
