#!/bin/bash
# Writes a KRaft server.properties from the environment and starts the node.
# Every KAFKA_<NAME> variable becomes <name> with `_` → `.` (`__` → `_`,
# `___` → `-`), as in the apache/kafka image, so one compose environment fits
# both images. Storage is formatted on first start (CLUSTER_ID, or a fixed
# default shared by every node of a cluster).
set -euo pipefail
props=/opt/kafka/server.properties
: > "$props"
while IFS='=' read -r name value; do
  case "$name" in
    KAFKA_HEAP_MB|KAFKA_JVM_OPTS|KAFKA_OPTS) continue ;;
    KAFKA_*) ;;
    *) continue ;;
  esac
  key=${name#KAFKA_}
  key=${key,,}
  key=${key//___/-}
  key=${key//__/@}
  key=${key//_/.}
  key=${key//@/_}
  printf '%s=%s\n' "$key" "$value" >> "$props"
done < <(env)
grep -q '^process.roles=' "$props" || echo 'process.roles=broker,controller' >> "$props"
grep -q '^controller.listener.names=' "$props" || echo 'controller.listener.names=CONTROLLER' >> "$props"
grep -q '^group.initial.rebalance.delay.ms=' "$props" || echo 'group.initial.rebalance.delay.ms=0' >> "$props"
log_dirs=$(sed -n 's/^log.dirs=//p' "$props")
mkdir -p "${log_dirs//,/ }"

java=(java "-Xmx${KAFKA_HEAP_MB:-512}m" -Xms128m -XX:+ExitOnOutOfMemoryError ${KAFKA_JVM_OPTS:-}
      -Dlog4j2.configurationFile=/opt/kafka/kafka-log4j2.properties -cp '/opt/kafka/libs/*')
first=${log_dirs%%,*}
if [ ! -f "$first/meta.properties" ]; then
  "${java[@]}" kafka.tools.StorageTool format -t "${CLUSTER_ID:-5L6g3nShT-eMCtK--X86sw}" -c "$props" --ignore-formatted
fi
exec "${java[@]}" kafka.Kafka "$props"
