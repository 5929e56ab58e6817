"""``sluice collect vllm``: scrape an engine every interval and publish ReplicaSamples.

A failed or garbled scrape is logged and counted and the loop goes on; after
``unhealthy_after`` failures in a row the replica is published as unhealthy
(with its last good counters), so the picture stops counting its capacity.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiokafka.errors import KafkaConnectionError, KafkaError
from prometheus_client import Counter

from .. import topics
from ..bounded_producer import (DELIVERY_TIMEOUT_S, abandon, sender_stopped, spoils_producer, start_producer,
                               stop_producer)
from ..contract import compile_schema, load_schema
from ..events import SCHEMA_VERSION, ReplicaSample, decode
from ..kafka_clients import producer_options
from ..metrics import REGISTRY
from ..settings import Settings
from .engine_metrics import ScrapeError, parse_dcgm, parse_engine

# the replica_sample.v1 check of each field a scrape fills
SAMPLE_CHECKS = {name: compile_schema(spec, name) for name, spec in load_schema("replica_sample")["properties"].items()}

log = logging.getLogger(__name__)

SCRAPE_FAILURES = Counter("sluice_collector_scrape_failures_total", "Engine scrapes that failed or were garbled.",
                          ["replica"], registry=REGISTRY)
COLLECTOR_SAMPLES_LOST = Counter("sluice_collector_samples_lost_total",
                                 "Samples not acknowledged by Kafka in time, refused in a way every later one would "
                                 "be, or with no producer to send them: the producer is replaced and the next "
                                 "sample tries again.", registry=REGISTRY)


@dataclass
class Target:
    url: str
    pool: str
    replica: str
    hardware: str
    gpu_count: int = 1
    engine: str = "vllm"
    dcgm_url: str | None = None
    timeout_s: float = 2.0


@dataclass
class Collector:
    target: Target
    unhealthy_after: int = 3
    failures_in_a_row: int = 0
    last_good: dict[str, float] = field(default_factory=dict)
    failures: int = 0

    def _fetch(self, url: str) -> str:
        with urllib.request.urlopen(url, timeout=self.target.timeout_s) as response:
            return response.read(8 * 1024 * 1024).decode("utf-8", errors="replace")

    def collect(self, now_ms: int) -> dict[str, Any]:
        """One scrape → one ReplicaSample document (always valid, healthy or not)."""
        try:
            fields = _schema_checked(parse_engine(self._fetch(self.target.url), self.target.engine))
            if self.target.dcgm_url:
                try:
                    fields.update(_schema_checked(parse_dcgm(self._fetch(self.target.dcgm_url))))
                except (OSError, ValueError) as exc:
                    log.warning("DCGM scrape of %s failed: %s", self.target.dcgm_url, exc)
            self.failures_in_a_row = 0
            self.last_good = fields
        except (OSError, ScrapeError, ValueError, ArithmeticError) as exc:
            self.failures += 1
            self.failures_in_a_row += 1
            SCRAPE_FAILURES.labels(self.target.replica).inc()
            log.warning("scrape of %s failed (%d in a row): %s", self.target.url, self.failures_in_a_row, exc)
            fields = dict(self.last_good) or {"requests_running": 0, "requests_waiting": 0, "kv_cache_usage": 0.0,
                                              "preemptions_total": 0.0, "prompt_tokens_total": 0.0,
                                              "generation_tokens_total": 0.0, "prefix_cache_hits_total": 0.0,
                                              "prefix_cache_queries_total": 0.0}
        healthy = self.failures_in_a_row < self.unhealthy_after
        return {"schema_version": SCHEMA_VERSION, "event_id": str(uuid.uuid4()), "event_time": now_ms,
                "replica_id": self.target.replica, "pool": self.target.pool, "hardware": self.target.hardware,
                "gpu_count": self.target.gpu_count, "healthy": healthy, **fields}


def _schema_checked(fields: dict[str, Any]) -> dict[str, Any]:
    """Raises (Invalid, a ValueError) on a value the sample's schema refuses: it fails the scrape, where a
    sample built with it was dropped at publishing, silently, and the replica never read unhealthy."""
    for name, value in fields.items():
        SAMPLE_CHECKS[name](value, name)
    return fields


async def run(settings: Settings, bootstrap: str, collector: Collector, interval_s: float,
              iterations: int | None = None, delivery_timeout_s: float = DELIVERY_TIMEOUT_S) -> int:
    """Scrape and publish until cancelled (or ``iterations`` samples); returns samples published."""
    options = producer_options(settings)
    producer: Any = await start_producer(bootstrap, **options)   # no broker at start: fail loudly
    topic = topics.REPLICAS.name(settings)
    key = collector.target.replica.encode()
    published = 0
    try:
        while iterations is None or published < iterations:
            started = time.monotonic()
            document = await asyncio.to_thread(collector.collect, int(time.time() * 1000))
            value = orjson.dumps(document)
            checked = decode(ReplicaSample, value, key, settings.max_event_bytes)
            if isinstance(checked, ReplicaSample):
                producer, delivered = await _publish(producer, bootstrap, options, topic, value, key,
                                                     delivery_timeout_s)
                published += delivered
            else:
                log.error("collector built an invalid sample (%s: %s); not published", checked.reason, checked.detail)
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
    finally:
        if producer is not None:
            await stop_producer(producer)
    return published


async def _publish(producer: Any, bootstrap: str, options: dict, topic: str, value: bytes, key: bytes,
                   timeout_s: float) -> tuple[Any, bool]:
    """One sample, acknowledged within ``timeout_s``; (the producer to use next, delivered). A producer that
    does not acknowledge in time, whose sender has stopped, or that was refused in a way every later sample
    would be too, is replaced; with no broker to start a new one, the sample is skipped and the next one tries
    again. An idempotent producer never gives up on a record, so the collector used to wait on it for as long
    as the broker was away, and its replica went stale with nothing said why. Any other refusal (an ACL)
    still ends the collector, loudly."""
    try:
        if producer is None or sender_stopped(producer):
            if producer is not None:
                log.warning("collector: its Kafka producer's sender has stopped; starting another")
                await stop_producer(producer)
            producer = None
            producer = await start_producer(bootstrap, **options)
        record = await producer.send(topic, value, key=key)
        abandon([record])   # retrieved here when acknowledged in time; by the callback once given up on
        await asyncio.wait_for(asyncio.shield(record), timeout_s)
        return producer, True
    except (asyncio.TimeoutError, KafkaError) as exc:
        if isinstance(exc, KafkaError) and not isinstance(exc, KafkaConnectionError) and not spoils_producer(exc) \
                and not (producer is not None and sender_stopped(producer)):
            raise
        log.warning("collector: a sample was not published (%s: %.200s); the next one goes through a new "
                    "producer", type(exc).__name__, exc)
        COLLECTOR_SAMPLES_LOST.inc()
        if producer is not None:
            await stop_producer(producer)
        return None, False
