#!/usr/bin/env bash
# A replicated local Apache Kafka: three KRaft nodes on 127.0.0.1, each a
# combined broker and controller (three voters), from the same Maven jars as
# the single node (deploy/local/kafka.sh), for fault tests that kill, stop or
# pause one broker.
#
#   deploy/local/cluster.sh up        fetch, format (first time), start every node, wait until all are ready
#   deploy/local/cluster.sh down      stop every node (data is kept; `up` starts them again)
#   deploy/local/cluster.sh status    one line per node; exit 0 when all run and answer
#   deploy/local/cluster.sh env       print TRAJFLOW_KAFKA_CLUSTER (the bootstrap list) and the home dir
#   deploy/local/cluster.sh clean     stop and delete every node's data (jars stay)
#
# Fault controls on node N (1..3):
#   kill N      SIGKILL          start N    start it again with its data (waits until it answers)
#   stop N      SIGTERM (controlled shutdown, waits for the exit)
#   pause N     SIGSTOP          resume N   SIGCONT
#   leader TOPIC PARTITION   the node id leading the partition (-1: none)
#   describe TOPIC           leader, replicas and ISR of every partition
#   controller               the node id of the active controller
#
# Ports (127.0.0.1): node N serves PLAINTEXT on $KAFKA_CLUSTER_PORT+N
# (default 19201-19203) and its controller on $KAFKA_CLUSTER_CONTROLLER_PORT+N
# (default 19301-19303). Each node lives in $KAFKA_CLUSTER_HOME/nodeN
# (default build/kafka-cluster, ignored by git): server.properties, data/,
# server.log, stdout.log, kafka.pid. The jars are $KAFKA_LIBS (default
# build/kafka/libs, shared with kafka.sh). Heap per node: $KAFKA_CLUSTER_HEAP
# (default 128m:384m, min:max); JVM flags $KAFKA_CLUSTER_JVM_FLAGS (default
# -XX:+UseSerialGC -XX:TieredStopAtLevel=1: three JVMs on a small machine
# start in a third of the time and with less memory than with G1 and C2,
# at a throughput fault tests do not need). The questions (leader,
# controller, readiness) are asked by deploy/local/kafkactl, built with go
# on first use.
#
# Failover: brokers heartbeat every 1 s and are fenced 5 s after their last
# heartbeat (broker.heartbeat.interval.ms, broker.session.timeout.ms;
# defaults 2 s and 9 s); controllers hold an election after 2 s without the
# leader (controller.quorum.fetch.timeout.ms) plus up to 1 s
# (controller.quorum.election.timeout.ms). A SIGKILLed partition leader is
# replaced within the session timeout, plus the election when it was also
# the active controller. deploy/local/README.md has the measurements.
set -euo pipefail

LOG_NAME=cluster.sh
# shellcheck source=deploy/local/lib.sh
. "$(dirname "$0")/lib.sh"

ROOT="$LIB_ROOT"
CHOME="${KAFKA_CLUSTER_HOME:-$ROOT/build/kafka-cluster}"
LIBS="${KAFKA_LIBS:-$ROOT/build/kafka/libs}"
PORT_BASE="${KAFKA_CLUSTER_PORT:-19200}"
CTRL_BASE="${KAFKA_CLUSTER_CONTROLLER_PORT:-19300}"
HEAP="${KAFKA_CLUSTER_HEAP:-128m:384m}"
JVM_FLAGS="${KAFKA_CLUSTER_JVM_FLAGS:--XX:+UseSerialGC -XX:TieredStopAtLevel=1}"
HOST=$LOCAL_HOST
NODES=(1 2 3)
CTL="$CHOME/bin/kafkactl"

node_dir() { echo "$CHOME/node$1"; }
port() { echo $((PORT_BASE + $1)); }
ctrl_port() { echo $((CTRL_BASE + $1)); }
pidfile() { echo "$(node_dir "$1")/kafka.pid"; }
running() { pid_alive "$(pidfile "$1")"; }

bootstrap() {
  local out="" n
  for n in "${NODES[@]}"; do out="$out${out:+,}$HOST:$(port "$n")"; done
  echo "$out"
}

voters() {
  local out="" n
  for n in "${NODES[@]}"; do out="$out${out:+,}$n@$HOST:$(ctrl_port "$n")"; done
  echo "$out"
}

check_node() {
  case "${1:-}" in
    1|2|3) ;;
    *) echo "$0: node must be 1, 2 or 3, got '${1:-}'" >&2; exit 2 ;;
  esac
}

# build_ctl rebuilds kafkactl when its source is newer than the binary.
build_ctl() {
  local src="$ROOT/deploy/local/kafkactl/main.go"
  if [ ! -x "$CTL" ] || [ "$src" -nt "$CTL" ]; then
    command -v go >/dev/null || { log "go not found (needed for deploy/local/kafkactl)"; exit 1; }
    mkdir -p "$CHOME/bin"
    (cd "$ROOT" && go build -o "$CTL" ./deploy/local/kafkactl)
  fi
}

kafkactl() { build_ctl; "$CTL" "$@"; }

# state N: the process state letter of node N (T: stopped, Z: exited).
state() { awk '{print $3}' "/proc/$(cat "$(pidfile "$1")")/stat" 2>/dev/null || echo '?'; }

# live_bootstrap lists the nodes that run and are not paused, so that a
# question never waits on a paused node.
live_bootstrap() {
  local out="" n
  for n in "${NODES[@]}"; do
    if running "$n" && [ "$(state "$n")" != T ]; then out="$out${out:+,}$HOST:$(port "$n")"; fi
  done
  echo "${out:-$(bootstrap)}"
}

write_config() {
  local n="$1" dir
  dir="$(node_dir "$n")"
  mkdir -p "$dir/data"
  cat > "$dir/server.properties" <<EOF
process.roles=broker,controller
node.id=$n
controller.quorum.voters=$(voters)
listeners=PLAINTEXT://$HOST:$(port "$n"),CONTROLLER://$HOST:$(ctrl_port "$n")
advertised.listeners=PLAINTEXT://$HOST:$(port "$n")
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$dir/data
num.partitions=1
default.replication.factor=3
min.insync.replicas=2
offsets.topic.replication.factor=3
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
unclean.leader.election.enable=false
broker.heartbeat.interval.ms=1000
broker.session.timeout.ms=5000
controller.quorum.fetch.timeout.ms=2000
controller.quorum.election.timeout.ms=1000
message.max.bytes=67108864
replica.fetch.max.bytes=67108864
socket.request.max.bytes=209715200
log.segment.bytes=67108864
EOF
  write_log4j "$dir/log4j2.properties" "$dir/server.log"
}

# shellcheck disable=SC2086 # JVM_FLAGS is a list of flags
set_java_args() { java_args "$(node_dir "$1")" "$LIBS" "${HEAP%%:*}" "${HEAP##*:}" $JVM_FLAGS; }

# cluster_id is generated once; every node is formatted with it.
cluster_id() {
  if [ ! -f "$CHOME/cluster.id" ]; then
    mkdir -p "$CHOME"
    set_java_args 1
    kafka_uuid "$(node_dir 1)" > "$CHOME/cluster.id"
  fi
  cat "$CHOME/cluster.id"
}

format_node() {
  local n="$1" dir
  dir="$(node_dir "$n")"
  if [ -f "$dir/data/meta.properties" ]; then return; fi
  set_java_args "$n"
  log "formatting node $n ($dir/data)"
  kafka_format "$dir" "$dir/server.properties" "$(cluster_id)"
}

prepare() {
  need_java
  fetch_jars "$LIBS"
  local n pids=()
  for n in "${NODES[@]}"; do write_config "$n"; done
  cluster_id >/dev/null
  for n in "${NODES[@]}"; do format_node "$n" & pids+=($!); done
  for n in "${pids[@]}"; do wait "$n"; done
}

launch() {
  local n="$1"
  if running "$n"; then return; fi
  set_java_args "$n"
  log "starting node $n on $HOST:$(port "$n") (controller $HOST:$(ctrl_port "$n"))"
  start_java "$(node_dir "$n")" "$(pidfile "$n")" kafka.Kafka "$(node_dir "$n")/server.properties"
}

# wait_nodes SECONDS N...: until every listed node answers ApiVersions and
# a metadata request listing every node of the cluster as a live broker.
wait_nodes() {
  local limit="$1" n addrs deadline
  shift
  addrs=()
  for n in "$@"; do addrs+=("$HOST:$(port "$n")"); done
  deadline=$((SECONDS + limit))
  while [ "$SECONDS" -lt "$deadline" ]; do
    local ok=1
    for n in "$@"; do
      if ! running "$n"; then
        log "node $n exited; see $(node_dir "$n")/server.log and stdout.log"
        tail -n 20 "$(node_dir "$n")/stdout.log" >&2 || true
        return 1
      fi
      probe "$HOST" "$(port "$n")" || { ok=0; break; }
    done
    if [ "$ok" = 1 ] && kafkactl ready "${#NODES[@]}" "${addrs[@]}" 2>/dev/null; then return 0; fi
    sleep 0.25
  done
  log "nodes $* not ready after ${limit}s:"
  kafkactl ready "${#NODES[@]}" "${addrs[@]}" >&2 || true
  return 1
}

up() {
  prepare
  build_ctl
  local n
  for n in "${NODES[@]}"; do launch "$n"; done
  wait_nodes 120 "${NODES[@]}"
  log "ready: $(bootstrap)"
}

down() {
  local n pids=()
  for n in "${NODES[@]}"; do
    stop_pid "$(pidfile "$n")" "node $n" &
    pids+=($!)
  done
  for n in "${pids[@]}"; do wait "$n"; done
}

status() {
  local n rc=0 pid
  for n in "${NODES[@]}"; do
    if ! running "$n"; then echo "node $n: not running"; rc=1; continue; fi
    pid="$(cat "$(pidfile "$n")")"
    if [ "$(state "$n")" = T ]; then echo "node $n: paused (pid $pid) on $HOST:$(port "$n")"; rc=1; continue; fi
    if probe "$HOST" "$(port "$n")"; then
      echo "node $n: running (pid $pid) on $HOST:$(port "$n")"
    else
      echo "node $n: running (pid $pid) but not answering on $HOST:$(port "$n")"; rc=1
    fi
  done
  return "$rc"
}

signal_node() {
  local sig="$1" n="$2"
  running "$n" || { log "node $n is not running"; exit 1; }
  kill -"$sig" "$(cat "$(pidfile "$n")")"
}

kill_node() {
  local n="$1" pid
  running "$n" || { log "node $n is not running"; exit 1; }
  pid="$(cat "$(pidfile "$n")")"
  kill -KILL "$pid"
  for _ in $(seq 1 200); do
    kill -0 "$pid" 2>/dev/null && [ "$(state "$n")" != Z ] || break
    sleep 0.05
  done
  rm -f "$(pidfile "$n")"
  log "node $n killed (pid $pid)"
}

start_node() {
  local n="$1"
  if running "$n"; then log "node $n already running"; return; fi
  need_java
  fetch_jars "$LIBS"
  write_config "$n"
  format_node "$n"
  launch "$n"
  # The node answers once it has caught up with the metadata log; its
  # partitions rejoin their ISRs in the background.
  local deadline=$((SECONDS + 90))
  while [ "$SECONDS" -lt "$deadline" ]; do
    if probe "$HOST" "$(port "$n")"; then log "node $n answering"; return; fi
    running "$n" || { log "node $n exited; see $(node_dir "$n")/server.log"; exit 1; }
    sleep 0.25
  done
  log "node $n not answering after 90s"
  exit 1
}

cmd="${1:-}"
case "$cmd" in
  up) up ;;
  down) down ;;
  status) status ;;
  env) echo "TRAJFLOW_KAFKA_CLUSTER=$(bootstrap)"; echo "TRAJFLOW_KAFKA_CLUSTER_HOME=$CHOME" ;;
  clean) down; rm -rf "$CHOME" ;;
  kill) check_node "${2:-}"; kill_node "$2" ;;
  start) check_node "${2:-}"; start_node "$2" ;;
  stop) check_node "${2:-}"; stop_pid "$(pidfile "$2")" "node $2" ;;
  pause) check_node "${2:-}"; signal_node STOP "$2"; log "node $2 paused" ;;
  resume) check_node "${2:-}"; signal_node CONT "$2"; log "node $2 resumed" ;;
  leader) [ $# -eq 3 ] || { echo "usage: $0 leader TOPIC PARTITION" >&2; exit 2; }; kafkactl leader "$(live_bootstrap)" "$2" "$3" ;;
  describe) [ $# -eq 2 ] || { echo "usage: $0 describe TOPIC" >&2; exit 2; }; kafkactl describe "$(live_bootstrap)" "$2" ;;
  controller) kafkactl controller "$(live_bootstrap)" ;;
  *) echo "usage: $0 up|down|status|env|clean|kill N|start N|stop N|pause N|resume N|leader TOPIC PARTITION|describe TOPIC|controller" >&2; exit 2 ;;
esac
