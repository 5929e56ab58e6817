"""Every Kafka topic Sluice reads or writes, declared once.

The names are the contract of ``ARCHITECTURE.md``; ``topic_namespace`` only
prefixes them so that tests and tenants can share a broker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from .kafka_clients import client_options
from .settings import Settings

log = logging.getLogger(__name__)

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


@dataclass(frozen=True)
class TopicSpec:
    base: str
    key: str
    compacted: bool = False
    retention_ms: int = DAY_MS
    raw: bool = False
    dead_letter: bool = False
    max_bytes: int = 0  # max.message.bytes, when declared here (raw and dead-letter topics derive theirs)
    broker_time: bool = False  # records stamped with the broker's clock (LogAppendTime), not the producer's
    compaction_lag: str = "topic_compaction_lag_s"  # the setting that bounds a compacted topic's open segment

    def name(self, settings: Settings) -> str:
        ns = settings.topic_namespace
        return f"{ns}.{self.base}" if ns else self.base

    def partitions(self, settings: Settings) -> int:
        return settings.topic_partitions if self.raw else max(1, settings.topic_partitions // 2)

    def config(self, settings: Settings) -> dict[str, str]:
        cfg = {"cleanup.policy": "compact" if self.compacted else "delete"}
        if self.compacted:
            cfg |= compaction_config(getattr(settings, self.compaction_lag))
        else:
            cfg["retention.ms"] = str(self.retention_ms)
        if self.raw:
            cfg["max.message.bytes"] = str(raw_topic_max_bytes(settings))
        if self.dead_letter:
            cfg["max.message.bytes"] = str(dead_letter_max_bytes(settings))
        if self.max_bytes:
            cfg["max.message.bytes"] = str(self.max_bytes)
        if self.broker_time:
            cfg["message.timestamp.type"] = "LogAppendTime"
        return cfg | replication_config(settings)


def replication_config(settings: Settings) -> dict[str, str]:
    """``min.insync.replicas`` of every topic Sluice creates (its own and Faust's): with acks=all, a write
    is acknowledged only once that many replicas have it, so losing one broker loses no acknowledged record.

    Always set, at most the replication factor: a topic without it inherits the broker's default, and on
    brokers before Kafka 3.7 (which do not cap the effective min ISR at the replica count) a replication
    factor below that default — one replica on brokers that want two in sync — refuses every acks=all
    write with NOT_ENOUGH_REPLICAS. Set on the topic, what applies is what the topic's config says."""
    return {"min.insync.replicas": str(min_insync_replicas(settings))}


def compaction_config(lag_s: float) -> dict[str, str]:
    """Bounds on a compacted topic's superseded records. Kafka compacts closed segments only, and the open one
    rolls at 1 GiB or 7 days by default, so a reader from the beginning (a router starting, ``sluice pools``,
    stage 2's changelog rebuild) would read every picture, signal or partial written since the last roll.
    ``max.compaction.lag.ms`` makes each record eligible for compaction after the lag (and rolls the open
    segment then, on Kafka 2.3+); ``segment.ms`` rolls it on brokers that ignore the first."""
    lag_ms = str(int(lag_s * 1000))
    return {"max.compaction.lag.ms": lag_ms, "segment.ms": lag_ms}


def changelog_config(settings: Settings) -> dict[str, str]:
    """Config of stage 2's changelog (Faust creates it). Every partial that leaves the table leaves a
    tombstone, kept ``delete.retention.ms`` after compaction (a day by default), and a rebuild reads them all:
    an hour bounds them. That is also how long a read from the start may take and still see every tombstone;
    a rebuild's takes seconds."""
    return compaction_config(settings.topic_compaction_lag_s) | {"delete.retention.ms": str(HOUR_MS)} \
        | replication_config(settings)


def min_insync_replicas(settings: Settings) -> int:
    return min(settings.topic_min_insync_replicas, settings.topic_replication_factor)


def raw_topic_max_bytes(settings: Settings) -> int:
    """Raw topics accept values a little over ``max_event_bytes`` so that an
    oversize event reaches the validator and is dead-lettered with its bytes
    instead of being refused at the producer, where nobody would see it."""
    return settings.max_event_bytes * 4


def dead_letter_max_bytes(settings: Settings) -> int:
    """A dead letter carries the original value base64-encoded (4/3) plus an envelope."""
    return raw_topic_max_bytes(settings) * 2


def partial_budget_bytes() -> int:
    """The most one serialized partial may take: the partials topic's limit less 64 KiB for the record's
    framing and key. A partial is also a value of stage 2's changelog, whose limit is the broker's default
    (1,048,588 bytes), as is the partials topic's if it was created before its limit was declared."""
    return PARTIALS.max_bytes - 65536


REQUESTS = TopicSpec("sluice.requests.v1", key="task_id", raw=True)
REPLICAS = TopicSpec("sluice.replicas.v1", key="replica_id", raw=True)
# broker time: a rebuild's re-read starts by record time, so a producing worker's wrong clock cannot hide records
PARTIALS = TopicSpec("sluice.partials.v1", key="pool", retention_ms=HOUR_MS, max_bytes=1 << 20, broker_time=True)
LOAD = TopicSpec("sluice.load.v1", key="pool", compacted=True)
ADMISSION = TopicSpec("sluice.admission.v1", key="pool", compacted=True, compaction_lag="admission_compaction_lag_s")
DEADLETTER = TopicSpec("sluice.deadletter.v1", key="source topic/partition/offset",
                       retention_ms=30 * DAY_MS, dead_letter=True)

ALL = (REQUESTS, REPLICAS, PARTIALS, LOAD, ADMISSION, DEADLETTER)


def topic_configs(settings: Settings) -> dict[str, tuple[int, dict[str, str]]]:
    """name → (partitions, config) for every topic, as created at start-up."""
    configs = {spec.name(settings): (spec.partitions(settings), spec.config(settings)) for spec in ALL}
    if settings.otel_topic and settings.otel_topic not in configs:
        configs[settings.otel_topic] = (settings.topic_partitions, otel_topic_config(settings))
    return configs


def otel_topic(settings: Settings) -> str:
    """The OTLP/JSON spans topic ``sluice otel-bridge`` reads: ``otel_topic`` as written (the Collector's
    ``traces::topic`` names it, so no namespace prefix); empty when the bridge is off. Created like a raw
    topic when missing (an existing one is left as it is), so an oversize export is refused at the Collector."""
    return settings.otel_topic


def otel_topic_config(settings: Settings) -> dict[str, str]:
    return {"cleanup.policy": "delete", "retention.ms": str(DAY_MS),
            "max.message.bytes": str(raw_topic_max_bytes(settings))} | replication_config(settings)


def otel_group(settings: Settings) -> str:
    """Consumer group of the OpenTelemetry bridge: ``otel_group``, else ``<app_id>-otel``."""
    return settings.otel_group or f"{settings.app_id}-otel"


TOPIC_ALREADY_EXISTS = 36


async def ensure_topics(settings: Settings, bootstrap: str) -> list[str]:
    """Create every missing topic with its declared partitions and config; returns those created.

    Idempotent: an existing topic is left as it is (its partitions are not
    changed behind an operator's back).
    """
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=30000, **client_options(settings))
    await admin.start()
    deadline = time.monotonic() + TOPICS_READY_TIMEOUT_S
    try:
        existing = set(await _retried(admin.list_topics, deadline))
        configs = topic_configs(settings)
        wanted = [NewTopic(name, partitions, settings.topic_replication_factor, topic_configs=config)
                  for name, (partitions, config) in configs.items() if name not in existing]
        if wanted:
            response = await _retried(lambda: admin.create_topics(wanted), deadline)
            for name, code, message in getattr(response, "topic_errors", ()) or ():
                if code not in (0, TOPIC_ALREADY_EXISTS):
                    raise RuntimeError(f"cannot create topic {name}: error {code} {message}")
        await wait_until_led(admin, list(configs), TOPICS_READY_TIMEOUT_S)
        await _warn_of_drift(admin, drift_checked(settings, existing), deadline)
        return [t.name for t in wanted]
    finally:
        await admin.close()


PARTIALS_TABLE = "pool_partials"   # stage 2's Faust table of merged partials


def changelog_topic(settings: Settings) -> str:
    """Stage 2's changelog, which Faust names after the app and the table."""
    return f"{settings.app_id}-{PARTIALS_TABLE}-changelog"


def drift_checked(settings: Settings, existing: set[str]) -> dict[str, dict[str, str]]:
    """name → declared config of the topics whose drift from it is worth a warning: Sluice's own that exist,
    and stage 2's changelog. Not the OTLP spans topic: the Collector names it, and one it created with the
    broker's defaults is the operator's choice, not an older release's."""
    own = {spec.name(settings): spec.config(settings) for spec in ALL}
    return ({name: config for name, config in own.items() if name in existing}
            | {changelog_topic(settings): changelog_config(settings)})


def config_drift(declared: dict[str, str], actual: dict[str, str]) -> dict[str, tuple[str | None, str]]:
    """key → (what the topic has, what Sluice declares) for every declared key the topic does not match."""
    return {key: (actual.get(key), value) for key, value in declared.items() if actual.get(key) != value}


async def _warn_of_drift(admin: Any, declared: dict[str, dict[str, str]], deadline: float) -> None:
    """Log the existing topics whose config differs from what Sluice declares now. Their config is left as
    it is, like their partitions (an operator may have chosen it), but a topic created by an older release
    lacks what later ones declare (``topic_compaction_lag_s``), and nothing else would say so. A topic that
    does not exist (the changelog before the first worker) or cannot be described is skipped."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    try:
        responses = await _retried(lambda: admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name) for name in declared]), deadline)
    except Exception as exc:  # a warning's input: never a reason not to start
        log.info("could not compare topic configs with the declared ones: %s: %.200s", type(exc).__name__, exc)
        return
    for response in responses:
        for code, _message, _type, name, entries in response.resources:
            if code or name not in declared:
                continue
            drift = config_drift(declared[name], {entry[0]: entry[1] for entry in entries})
            if drift:
                log.warning("topic %s has another config than Sluice declares (left as it is; `kafka-configs.sh "
                            "--alter --entity-type topics --entity-name %s --add-config` sets it): %s", name, name,
                            ", ".join(f"{k}={have} (declared {want})" for k, (have, want) in sorted(drift.items())))


TOPICS_READY_TIMEOUT_S = 60.0


async def _retried(request: Any, deadline: float) -> Any:
    """An admin request, asked again on a retriable error until ``deadline``. aiokafka's admin client sends
    each request to one broker picked at random: with a broker down (or one just started, listed in the
    metadata before its listener accepts), a start-up failed on that pick alone (CI, session 24)."""
    from aiokafka.errors import KafkaError

    while True:
        try:
            return await request()
        except KafkaError as exc:
            if not exc.retriable or time.monotonic() >= deadline:
                raise
            log.warning("topic admin request failed (%s: %.200s); asking again", type(exc).__name__, exc)
            await asyncio.sleep(0.5)


async def wait_until_led(admin: Any, names: list[str], timeout_s: float) -> None:
    """Return once every partition of every topic in ``names`` has a leader in the cluster's metadata.

    A created topic reaches the brokers' metadata a moment after CreateTopics answers. A Faust worker
    that joins its group in that moment is assigned nothing for the topic ("not found in cluster
    metadata") and stays that way: stage 2 would never see a partial and no signal would be published.
    Raises ``RuntimeError`` naming the topics still without leaders when ``timeout_s`` runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = leaderless(await _retried(lambda: admin.describe_topics(names), deadline))
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"topics without a leader after {timeout_s:.0f} s: {', '.join(missing)}")
        await asyncio.sleep(0.1)


def leaderless(described: list[dict[str, Any]]) -> list[str]:
    """The topics of a DescribeTopics answer that are unknown or have a partition without a leader."""
    return sorted(t["topic"] for t in described
                  if t["error_code"] or not t["partitions"] or any(p["leader"] < 0 for p in t["partitions"]))


def control_group(settings: Settings) -> str:
    """Consumer group of the control path's stage 1 (raw topics); stage 2 is Faust's own group, ``app_id``."""
    return f"{settings.app_id}-control"


def landing_group(settings: Settings) -> str:
    """Consumer group of the landing path (raw topics and admission signals → ClickHouse)."""
    return f"{settings.app_id}-landing"
