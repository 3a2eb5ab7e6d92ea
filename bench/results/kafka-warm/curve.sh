#!/usr/bin/env bash
# The warming curve of Apache Kafka's JVM: a fresh single-node broker
# (deploy/local/kafka.sh), then twelve `trajflow bench` runs back to back,
# the broker JVM's CPU counted. Run from the repository root after
# `make build`; writes run01.json … run12.json (RUNS=N for N runs) and
# curve.txt into $1, and deletes the broker and its data at the end.
set -euo pipefail
out=${1:?usage: curve.sh OUTDIR}
mkdir -p "$out"
deploy/local/kafka.sh clean >/dev/null; sync; sleep 5
deploy/local/kafka.sh up >/dev/null
trap 'deploy/local/kafka.sh clean >/dev/null' EXIT  # the runs' log can hold tens of GB
jvm=$(cat build/kafka/kafka.pid)
start=$(date +%s)
for i in $(seq -w 1 ${RUNS:-12}); do
  t=$(( $(date +%s) - start ))
  bin/trajflow bench --brokers 127.0.0.1:19092 --cpu-pids "$jvm" --duration 15s --baseline 15s --json > "$out/run$i.json"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); b=r['baseline']; print(sys.argv[2], sys.argv[3], round(r['pipeline_mb_per_cpu_s'],1), round(b['mb_per_cpu_s'],1), round(r['ratio_to_baseline_cpu'],2), round(r['ratio_to_baseline'],2), round(r['cpu_cores'],2), round(b['cpu_cores'],2))" "$out/run$i.json" "$i" "$t" >> "$out/curve.txt"
done
