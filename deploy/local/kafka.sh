#!/usr/bin/env bash
# Local Apache Kafka for the integration suite: a single combined
# broker/controller (KRaft) on 127.0.0.1, fetched from Maven Central.
#
#   deploy/local/kafka.sh up       fetch (first time), format (first time), start, wait until ready
#   deploy/local/kafka.sh down     stop (data is kept; `up` starts it again)
#   deploy/local/kafka.sh status   exit 0 when running and answering
#   deploy/local/kafka.sh clean    stop and delete data, keys and credentials (jars stay cached)
#   deploy/local/kafka.sh env      print the variables the integration tests read
#
# Listeners (all on 127.0.0.1):
#   PLAINTEXT  $KAFKA_PORT            (default 19092)
#   SASL_SSL   $KAFKA_SASL_PORT       (default 19093): TLS with a generated PKCS12 keystore,
#              SASL PLAIN, SCRAM-SHA-256 and SCRAM-SHA-512 for user "trajflow"
#   CONTROLLER $KAFKA_CONTROLLER_PORT (default 19094)
#
# Everything lives under $KAFKA_HOME (default build/kafka, ignored by git):
# libs/ (jars), data/ (log dir), tls/ (keystore and ca.pem), client/ (the
# generated password, mode 0600), server.properties, server.log, kafka.pid.
# Needs java (17+) and mvn. The three-node cluster is deploy/local/cluster.sh;
# both share deploy/local/lib.sh.
set -euo pipefail

LOG_NAME=kafka.sh
# shellcheck source=deploy/local/lib.sh
. "$(dirname "$0")/lib.sh"

ROOT="$LIB_ROOT"
HOME_DIR="${KAFKA_HOME:-$ROOT/build/kafka}"
PORT="${KAFKA_PORT:-19092}"
SASL_PORT="${KAFKA_SASL_PORT:-19093}"
CTRL_PORT="${KAFKA_CONTROLLER_PORT:-19094}"
HOST=$LOCAL_HOST
LIBS="$HOME_DIR/libs"
DATA="$HOME_DIR/data"
TLS="$HOME_DIR/tls"
CLIENT="$HOME_DIR/client"
PIDFILE="$HOME_DIR/kafka.pid"
PROPS="$HOME_DIR/server.properties"
LOG="$HOME_DIR/server.log"
USER_NAME=trajflow

rand() { head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c 24; }

# secrets generates the TLS keystore and the SASL password once.
secrets() {
  mkdir -p "$TLS" "$CLIENT"
  chmod 700 "$CLIENT" "$TLS"
  if [ ! -f "$CLIENT/password" ]; then
    rand > "$CLIENT/password"
    chmod 600 "$CLIENT/password"
    rm -rf "$DATA"   # SCRAM credentials live in the metadata log: reformat
  fi
  if [ ! -f "$TLS/server.p12" ]; then
    rand > "$TLS/store.pass"
    chmod 600 "$TLS/store.pass"
    keytool -genkeypair -alias broker -keyalg EC -groupname secp256r1 -validity 3650 \
      -dname "CN=localhost" -ext "SAN=DNS:localhost,IP:127.0.0.1" \
      -storetype PKCS12 -keystore "$TLS/server.p12" \
      -storepass "$(cat "$TLS/store.pass")" -keypass "$(cat "$TLS/store.pass")" >/dev/null 2>&1
    keytool -exportcert -rfc -alias broker -keystore "$TLS/server.p12" -storetype PKCS12 \
      -storepass "$(cat "$TLS/store.pass")" > "$TLS/ca.pem" 2>/dev/null
  fi
}

write_config() {
  local pw store
  pw="$(cat "$CLIENT/password")"
  store="$(cat "$TLS/store.pass")"
  umask 077
  cat > "$PROPS" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$CTRL_PORT
listeners=PLAINTEXT://$HOST:$PORT,SASL_SSL://$HOST:$SASL_PORT,CONTROLLER://$HOST:$CTRL_PORT
advertised.listeners=PLAINTEXT://$HOST:$PORT,SASL_SSL://$HOST:$SASL_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT
log.dirs=$DATA
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
message.max.bytes=67108864
replica.fetch.max.bytes=67108864
socket.request.max.bytes=209715200
log.segment.bytes=67108864
# a deleted topic's files go after a second, not a minute: a bench run writes
# gigabytes and deletes its topics when it ends
file.delete.delay.ms=1000
ssl.keystore.type=PKCS12
ssl.keystore.location=$TLS/server.p12
ssl.keystore.password=$store
ssl.key.password=$store
ssl.client.auth=none
listener.name.sasl_ssl.sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_$USER_NAME="$pw";
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
EOF
  write_log4j "$HOME_DIR/log4j2.properties" "$LOG"
}

java_args "$HOME_DIR" "$LIBS" 256m 512m

format() {
  if [ -f "$DATA/meta.properties" ]; then return; fi
  local pw id
  pw="$(cat "$CLIENT/password")"
  mkdir -p "$DATA"
  id="$(kafka_uuid "$HOME_DIR")"
  log "formatting $DATA (cluster $id)"
  kafka_format "$HOME_DIR" "$PROPS" "$id" \
    -S "SCRAM-SHA-256=[name=$USER_NAME,password=$pw]" \
    -S "SCRAM-SHA-512=[name=$USER_NAME,password=$pw]"
}

running() { pid_alive "$PIDFILE"; }

up() {
  if running && probe "$HOST" "$PORT"; then log "already running (pid $(cat "$PIDFILE"))"; return; fi
  need_java
  mkdir -p "$HOME_DIR"
  fetch_jars "$LIBS"
  secrets
  write_config
  format
  if ! running; then
    log "starting broker on $HOST:$PORT (SASL_SSL $HOST:$SASL_PORT)"
    start_java "$HOME_DIR" "$PIDFILE" kafka.Kafka "$PROPS"
  fi
  for _ in $(seq 1 120); do
    if probe "$HOST" "$PORT"; then log "ready"; return; fi
    if ! running; then log "broker exited; see $LOG and $HOME_DIR/stdout.log"; tail -n 30 "$HOME_DIR/stdout.log" >&2 || true; exit 1; fi
    sleep 0.5
  done
  log "not ready after 60s; see $LOG"
  exit 1
}

down() { stop_pid "$PIDFILE" broker; }

env_vars() {
  echo "TRAJFLOW_KAFKA=$HOST:$PORT"
  echo "TRAJFLOW_KAFKA_SASL=$HOST:$SASL_PORT"
  echo "TRAJFLOW_KAFKA_HOME=$HOME_DIR"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) if running && probe "$HOST" "$PORT"; then echo "running (pid $(cat "$PIDFILE")) on $HOST:$PORT"; else echo "not running"; exit 1; fi ;;
  clean) down; rm -rf "$DATA" "$TLS" "$CLIENT" "$HOME_DIR/tmp" "$PROPS" "$LOG" ;;
  env) env_vars ;;
  *) echo "usage: $0 up|down|status|clean|env" >&2; exit 2 ;;
esac
