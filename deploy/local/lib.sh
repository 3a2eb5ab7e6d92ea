# Shared by deploy/local/kafka.sh (one node) and deploy/local/cluster.sh
# (three nodes): fetching the broker jars, the JVM command line, storage
# formatting, the readiness probe and stopping a process. Sourced, not run.
#
# The caller sets LOG_NAME (the prefix of its messages) before sourcing.

LIB_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
LOCAL_HOST=127.0.0.1

log() { echo "${LOG_NAME:-kafka}: $*" >&2; }

# fetch_jars LIBS: the broker and a logging binding from Maven Central
# (deploy/local/pom.xml) into LIBS, once.
fetch_jars() {
  local libs="$1"
  if [ -f "$libs/.complete" ]; then return; fi
  command -v mvn >/dev/null || { log "mvn not found (apt-get install maven)"; exit 1; }
  log "fetching the Kafka broker from Maven Central into $libs"
  rm -rf "$libs"
  mvn -q -B -f "$LIB_ROOT/deploy/local/pom.xml" dependency:copy-dependencies \
    -Dstyle.color=never -DincludeScope=runtime -DoutputDirectory="$libs"
  ls "$libs"/kafka_2.13-*.jar >/dev/null
  touch "$libs/.complete"
}

need_java() {
  command -v java >/dev/null || { log "java not found (apt-get install openjdk-17-jre-headless)"; exit 1; }
}

# write_log4j FILE LOGFILE: broker logs at info into LOGFILE.
write_log4j() {
  cat > "$1" <<EOF
status = error
appender.file.type = File
appender.file.name = file
appender.file.fileName = $2
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = info
logger.org.name = org.apache.kafka
logger.org.level = info
EOF
}

# java_args HOME LIBS XMS XMX [JVM flags]: sets JAVA_ARGS for a JVM whose
# temporary files (zstd and snappy natives included) live under HOME/tmp
# and whose log4j configuration is HOME/log4j2.properties; the flags
# default to -XX:+UseG1GC.
java_args() {
  local extra=(-XX:+UseG1GC)
  if [ $# -gt 4 ]; then extra=("${@:5}"); fi
  JAVA_ARGS=(-Xms"$3" -Xmx"$4" "${extra[@]}" -Djava.awt.headless=true
    -Djava.io.tmpdir="$1/tmp" -DZstdTempFolder="$1/tmp"
    -Dorg.xerial.snappy.tempdir="$1/tmp"
    -Dlog4j2.configurationFile="$1/log4j2.properties"
    -cp "$2/*")
}

# run_java HOME ARGS...: java with JAVA_ARGS (set by java_args).
run_java() {
  mkdir -p "$1/tmp"
  shift
  java "${JAVA_ARGS[@]}" "$@"
}

# start_java HOME PIDFILE ARGS...: java with JAVA_ARGS in the background,
# its output in HOME/stdout.log, its pid in PIDFILE.
start_java() {
  local home="$1" pidfile="$2"
  shift 2
  mkdir -p "$home/tmp"
  nohup java "${JAVA_ARGS[@]}" "$@" >"$home/stdout.log" 2>&1 </dev/null &
  echo $! > "$pidfile"
}

# kafka_uuid HOME: a random cluster id.
kafka_uuid() { run_java "$1" kafka.tools.StorageTool random-uuid | tail -n1; }

# kafka_format HOME PROPS CLUSTER_ID [StorageTool flags]: formats the log
# dirs of PROPS.
kafka_format() {
  local home="$1" props="$2" id="$3"
  shift 3
  run_java "$home" kafka.tools.StorageTool format -t "$id" -c "$props" "$@" >/dev/null
}

# pid_alive PIDFILE: the process of PIDFILE exists.
pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# probe HOST PORT sends an ApiVersions v0 request and checks the answer
# (correlation id 1, error code 0): a broker answers only once it serves
# requests.
probe() {
  local out
  out="$( (exec 3<>"/dev/tcp/$1/$2" || exit 1
    printf '\x00\x00\x00\x0f\x00\x12\x00\x00\x00\x00\x00\x01\x00\x05probe' >&3
    timeout 2 head -c 10 <&3 | od -An -tx1 | tr -d ' \n') 2>/dev/null)" || return 1
  [ "${out:8:12}" = "000000010000" ]
}

# stop_pid PIDFILE WHAT: SIGTERM (controlled shutdown), SIGKILL after 30 s.
stop_pid() {
  local pidfile="$1" what="$2" pid
  if ! pid_alive "$pidfile"; then rm -f "$pidfile"; log "$what not running"; return; fi
  pid="$(cat "$pidfile")"
  kill -CONT "$pid" 2>/dev/null || true   # a paused process handles SIGTERM only once resumed
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 60); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; log "$what stopped"; return; }
    sleep 0.5
  done
  log "$what still running after 30s: SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$pidfile"
}
