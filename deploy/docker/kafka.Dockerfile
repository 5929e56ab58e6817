# Apache Kafka (KRaft) from the devstack's Maven jars on Debian bookworm.
# Built by deploy/docker/build_images.py, whose context holds libs/ (the jars
# `sluice kafka start` fetched into ~/.cache/sluice/kafka/<version>/libs) and
# the files beside this one. Users with network can use apache/kafka instead.
ARG BASE=debian:bookworm-slim
FROM ${BASE}
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
COPY kafka-entrypoint.sh kafka-log4j2.properties /opt/kafka/
COPY libs/ /opt/kafka/libs/
ENV KAFKA_LOG_DIRS=/var/lib/kafka/data
ENTRYPOINT ["/opt/kafka/kafka-entrypoint.sh"]
