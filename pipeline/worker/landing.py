"""The landing path: raw events and admission signals → ClickHouse, exactly once, at its own pace.

Consumer group ``<app_id>-landing`` reads the raw topics and the admission
topic, hands each batch to the ``BlockSink`` and commits a partition's offset
only once its blocks are durable. While the store is slow or down it holds:
up to ``ingest_landing_depth`` batches land while the next is decoded, then
it stops fetching — and the control path, in its own group, does not notice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .. import metrics, topics
from ..events import AdmissionSignal, Event, ReplicaSample, RequestEvent
from ..ingest import Record
from ..settings import Settings
from ..sinks.block_sink import BlockSink
from ..sinks.migrations import prepare_store
from ..sinks.store import Store, StoreUnavailable, open_store
from .consumer import batch_consumer, commit, records_by_topic, update_lag

log = logging.getLogger(__name__)


class LandingConsumer:
    def __init__(self, settings: Settings, dead_letter_topic: Any) -> None:
        self.settings = settings
        self.dead_letter_topic = dead_letter_topic
        self.store: Store | None = None
        self.sink: BlockSink | None = None
        self.consumer: Any = None
        self.store_ok = False
        self._ready_lock = asyncio.Lock()

    async def ready(self) -> None:
        """Open and migrate the store once, before the first batch lands."""
        async with self._ready_lock:
            if self.sink is not None:
                return
            self.store = await asyncio.to_thread(open_store, self.settings)
            await asyncio.to_thread(prepare_store, self.store, self.settings)
            self.sink = BlockSink(self.settings, self.store, self._send_dead_letter)
            self.store_ok = True

    async def _send_dead_letter(self, key: bytes, value: bytes) -> None:
        await (await self.dead_letter_topic.send(key=key, value=value))

    async def check_store(self) -> bool:
        """A cheap query, so /healthz notices an unreachable store even while no batch is landing."""
        if self.store is None:
            return False
        try:
            await asyncio.to_thread(self.store.query, "SELECT 1 AS ok")
            self.store_ok = True
        except StoreUnavailable as exc:
            if self.store_ok:
                log.warning("store unreachable: %s", exc)
            self.store_ok = False
        return self.store_ok

    @property
    def held(self) -> bool:
        return bool(self.sink and self.sink.held)

    async def handle(self, cls: type[Event], records: list[Record]) -> asyncio.Task:
        """Add one fetched batch of one topic to the sink; the task lands what is due."""
        if self.sink is None:
            await self.ready()
        self.sink.add(cls, records, int(time.time() * 1000))
        return self.sink.flush()

    async def consume(self, bootstrap: str) -> None:
        from aiokafka import ConsumerRebalanceListener, TopicPartition

        s = self.settings
        await self.ready()
        classes = {topics.REQUESTS.name(s): RequestEvent, topics.REPLICAS.name(s): ReplicaSample,
                   topics.ADMISSION.name(s): AdmissionSignal}
        inflight: list[asyncio.Task] = []   # one landing per fetched batch, oldest first
        lag: dict[Any, int] = {}
        landing = self

        async def settle(keep: int = 0) -> None:
            """Wait until at most ``keep`` landings are in flight, then commit what the others landed."""
            offsets: dict[tuple[str, int], int] = {}
            while len(inflight) > keep or (inflight and inflight[0].done()):
                offsets.update(await inflight.pop(0))
            if offsets:
                await commit(consumer, {TopicPartition(t, p): o for (t, p), o in offsets.items()})

        class Rebalance(ConsumerRebalanceListener):
            async def on_partitions_revoked(self, revoked: Any) -> None:
                inflight.append(landing.sink.flush([(tp.topic, tp.partition) for tp in revoked]))
                await settle()
                for tp in revoked:
                    landing.sink.forget(tp.topic, tp.partition)
                    lag.pop(tp, None)

            async def on_partitions_assigned(self, assigned: Any) -> None:
                # paused until resumed: nothing may be handled from a position the store has not confirmed
                consumer.pause(*assigned)
                for tp in assigned:
                    committed = await consumer.committed(tp) or 0
                    start = await landing.sink.resume(classes[tp.topic], tp.topic, tp.partition, committed)
                    consumer.seek(tp, start)
                consumer.resume(*assigned)

        consumer = batch_consumer(s, bootstrap, topics.landing_group(s))
        consumer.subscribe(list(classes), listener=Rebalance())
        await consumer.start()
        self.consumer = consumer
        try:
            while True:
                fetched = await consumer.getmany(timeout_ms=int(s.ingest_batch_within_s * 1000),
                                                 max_records=s.ingest_batch_max)
                if not fetched:
                    inflight.append(self.sink.flush())
                    await settle()
                    continue
                for topic, records in records_by_topic(fetched).items():
                    self.sink.add(classes[topic], records, int(time.time() * 1000))
                update_lag(consumer, fetched, lag, metrics.LANDING_CONSUMER_LAG, classes)
                await settle(keep=s.ingest_landing_depth - 1)
                inflight.append(self.sink.flush())
        finally:
            self.consumer = None
            for task in inflight:
                task.cancel()
            await consumer.stop()
