"""The Faust application: thin glue between Kafka and the pure cores.

``faust -A pipeline.agents worker`` and ``sluice worker`` both run it. Stage 1
takes batches with ``noack_take`` and acks them only after their dead letters
are delivered and their rows are durable, so committed offsets never run ahead
of what has landed: an input is landed or dead-lettered, or it is read again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import faust
from aiohttp import web as aio_web

from . import metrics, topics
from .devstack.kafka import bootstrap_servers
from .events import Event, ReplicaSample, RequestEvent
from .ingest import Record, process_batch
from .settings import Settings, load_settings
from .sinks.clickhouse import ClickHouseSink
from .sinks.migrations import migrate
from .sinks.store import Store, open_store

log = logging.getLogger(__name__)


class Stage1:
    """Per-batch work of the ingest agents; collaborators are injected so agent tests can swap them."""

    def __init__(self, settings: Settings, app: faust.App, dead_letter_topic: Any) -> None:
        self.settings = settings
        self.app = app
        self.dead_letter_topic = dead_letter_topic
        self.store: Store | None = None
        self.sink: ClickHouseSink | None = None
        self._ready_lock = asyncio.Lock()

    async def ready(self) -> None:
        """Open and migrate the store once, before the first batch lands."""
        async with self._ready_lock:
            if self.sink is not None:
                return
            await topics.ensure_topics(self.settings, bootstrap_servers(self.settings))
            self.store = await asyncio.to_thread(open_store, self.settings)
            applied = await asyncio.to_thread(migrate, self.store)
            if applied:
                log.info("applied migrations %s", ", ".join(applied))
            self.sink = ClickHouseSink(self.store)

    async def handle(self, cls: type[Event], stream: Any, batch: list[Any]) -> None:
        started = time.perf_counter()
        if self.sink is None:
            await self.ready()
        records = [Record(e.message.topic, e.message.partition, e.message.offset,
                          int(e.message.timestamp * 1000) if e.message.timestamp else None,
                          e.message.key, e.message.value) for e in batch]
        outcome = process_batch(cls, records, self.settings.max_event_bytes, int(time.time() * 1000))
        pending = [await self.dead_letter_topic.send(key=key, value=value) for key, value in outcome.dead_letters]
        if pending:
            await asyncio.gather(*pending)
        await self.sink.land(outcome.table, outcome.rows, outcome.dedup_token)
        for event in batch:
            await stream.ack(event)
        topic = records[0].topic
        metrics.EVENTS_ACCEPTED.labels(topic).inc(len(outcome.rows))
        for reason, count in outcome.reasons.items():
            metrics.EVENTS_DEAD_LETTERED.labels(topic, reason).inc(count)
        if outcome.newest_event_ms:
            metrics.NEWEST_EVENT_TIME.labels(topic).set(outcome.newest_event_ms / 1000)
        metrics.INGEST_BATCH_SECONDS.labels(topic).observe(time.perf_counter() - started)


def raw_topic(app: faust.App, settings: Settings, spec: topics.TopicSpec) -> Any:
    partitions, config = topics.topic_configs(settings)[spec.name(settings)]
    return app.topic(spec.name(settings), key_type=bytes, value_type=bytes, key_serializer="raw",
                     value_serializer="raw", partitions=partitions, config=config,
                     replicas=settings.topic_replication_factor)


def create_app(settings: Settings) -> faust.App:
    datadir = settings.state_dir / "faust" / settings.app_id
    datadir.parent.mkdir(parents=True, exist_ok=True)
    app = faust.App(
        settings.app_id,
        broker=f"kafka://{bootstrap_servers(settings)}",
        key_serializer="raw",
        value_serializer="raw",
        store="memory://",
        datadir=str(datadir),
        web_host=settings.web_host,
        web_port=settings.web_port,
        web_in_thread=False,
        topic_partitions=settings.topic_partitions,
        topic_replication_factor=settings.topic_replication_factor,
        consumer_max_fetch_size=topics.raw_topic_max_bytes(settings),
        producer_max_request_size=topics.dead_letter_max_bytes(settings) + 65536,
        broker_commit_interval=1.0,
        stream_buffer_maxsize=max(4096, settings.ingest_batch_max * 2),
        consumer_auto_offset_reset="earliest",
        loghandlers=[],
    )
    dead_letters = app.topic(topics.DEADLETTER.name(settings), key_type=bytes, value_type=bytes,
                             key_serializer="raw", value_serializer="raw")
    stage1 = Stage1(settings, app, dead_letters)
    app.stage1 = stage1

    def ingest_agent(spec: topics.TopicSpec, cls: type[Event], name: str) -> None:
        async def ingest(stream: Any) -> None:
            async for batch in stream.noack_take(settings.ingest_batch_max, within=settings.ingest_batch_within_s):
                await stage1.handle(cls, stream, batch)

        ingest.__name__ = ingest.__qualname__ = name
        app.agent(raw_topic(app, settings, spec), name=f"{settings.app_id}.{name}")(ingest)

    ingest_agent(topics.REQUESTS, RequestEvent, "ingest_requests")
    ingest_agent(topics.REPLICAS, ReplicaSample, "ingest_replicas")

    @app.page("/healthz")
    async def healthz(web: Any, request: Any) -> Any:
        consuming = bool(app.consumer.assignment()) if app.consumer else False
        ok = consuming and stage1.sink is not None and not stage1.sink.held
        body = {"ok": ok, "consuming": consuming, "store": stage1.store.backend if stage1.store else None,
                "sink_held": bool(stage1.sink and stage1.sink.held)}
        return web.json(body, status=200 if ok else 503)

    @app.page("/metrics")
    async def prometheus(web: Any, request: Any) -> Any:
        return aio_web.Response(body=metrics.exposition(), content_type="text/plain", charset="utf-8")

    @app.task
    async def open_store_early() -> None:
        await stage1.ready()

    return app


_default_app: faust.App | None = None


def __getattr__(name: str) -> Any:
    """``pipeline.agents.app`` (what ``faust -A pipeline.agents`` loads), built on first use
    so that importing this module needs no broker."""
    global _default_app
    if name != "app":
        raise AttributeError(name)
    if _default_app is None:
        _default_app = create_app(load_settings())
    return _default_app
