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
from ..sinks.clickhouse import ClickHouseSink
from ..sinks.migrations import prepare_store
from ..sinks.store import Store, StoreUnavailable, open_store
from .consumer import BatchLoop, commit
from .stall_watch import send_all

log = logging.getLogger(__name__)
CLOSING_ROLLUP_S = 5.0   # the longest shutdown waits for the last rollup


class LandingConsumer(BatchLoop):
    lag_gauge = metrics.LANDING_CONSUMER_LAG

    def __init__(self, settings: Settings, dead_letter_topic: Any) -> None:
        super().__init__(settings)
        self.dead_letter_topic = dead_letter_topic
        self.store: Store | None = None
        self.sink: BlockSink | None = None
        self._inflight: list[asyncio.Task] = []   # one landing per fetched batch, oldest first
        self.store_ok = False
        self.owned: set[tuple[str, int]] = set()  # assigned partitions whose start the store confirmed
        self._ready_lock = asyncio.Lock()

    async def ready(self) -> None:
        """Open and migrate the store once, before the first batch lands."""
        async with self._ready_lock:
            if self.sink is not None:
                return
            store = await asyncio.to_thread(open_store, self.settings)
            try:
                await asyncio.to_thread(prepare_store, store, self.settings)
                rollup_store = await asyncio.to_thread(store.second_writer)
            except BaseException:   # the next try opens the store afresh: this one is not left open
                await asyncio.to_thread(store.close)
                raise
            self.store = store
            self.sink = BlockSink(self.settings, store, self._send_dead_letter,
                                  rollup_sink=ClickHouseSink(rollup_store))
            self.store_ok = True

    async def close(self) -> None:
        """At shutdown: stop holding on the store (nothing more lands), roll what landed up into
        ``pool_minute`` (a store that is down or slow is not waited for: the next owner rolls it up),
        then close the store."""
        if self.sink is not None:
            self.sink.stop_holding()
            rolling = asyncio.ensure_future(self.sink.roll_up(force=True))
            rolling.add_done_callback(lambda task: task.cancelled() or task.exception())   # no unread error
            try:   # shielded: a rollup cut short here would leave its store call running in its thread
                await asyncio.wait_for(asyncio.shield(rolling), CLOSING_ROLLUP_S)
            except (asyncio.TimeoutError, StoreUnavailable) as exc:
                log.warning("pool_minute not rolled up at shutdown (%s); the partitions' next owner will",
                            type(exc).__name__)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    async def _send_dead_letter(self, key: bytes, value: bytes) -> None:
        await send_all("dead letters", [(self.dead_letter_topic, key, value)])

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

    def group(self) -> str:
        return topics.landing_group(self.settings)

    def classes(self) -> dict[str, type]:
        s = self.settings
        return {topics.REQUESTS.name(s): RequestEvent, topics.REPLICAS.name(s): ReplicaSample,
                topics.ADMISSION.name(s): AdmissionSignal}

    async def _settle(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` landings are in flight, then commit what the others landed."""
        from aiokafka import TopicPartition

        offsets: dict[tuple[str, int], int] = {}
        while len(self._inflight) > keep or (self._inflight and self._inflight[0].done()):
            offsets.update(await self._inflight.pop(0))
        if offsets and self.consumer is not None:
            await commit(self.consumer, {TopicPartition(t, p): o for (t, p), o in offsets.items()})

    async def on_fetched(self, by_topic: dict[str, list[Record]]) -> None:
        classes = self.classes()
        for topic, records in by_topic.items():
            # a batch fetched before its partition was revoked must not open a block the next owner lands too
            records = [r for r in records if (r.topic, r.partition) in self.owned
                       and not (r.value is None and classes[topic] is AdmissionSignal)]  # tombstone: compaction
            if not records:
                continue
            self.sink.add(classes[topic], records, int(time.time() * 1000))
        await self._settle(keep=self.settings.ingest_landing_depth - 1)
        self._inflight.append(self.sink.flush())

    async def on_idle(self) -> None:
        self._inflight.append(self.sink.flush())
        await self._settle()

    async def on_revoked(self, revoked: list[tuple[str, int]]) -> None:
        self.owned.difference_update(revoked)
        self._inflight.append(self.sink.flush(revoked))
        await self._settle()
        for where in revoked:
            self.sink.forget(*where)
        # a rollup started beside a landing after the revocation's own may cover the revoked partitions: it
        # ends before the next owner can start, as the revocation's does
        await self.sink.rolled_up()

    async def on_assigned(self, tp: Any) -> None:
        """Paused until resumed: nothing may be handled from a position the store has not confirmed."""
        committed = await self.consumer.committed(tp) or 0
        await self.sink.resume(self.classes()[tp.topic], tp.topic, tp.partition, committed)
        self.consumer.seek(tp, committed)
        self.owned.add((tp.topic, tp.partition))

    async def on_stop(self) -> None:
        for task in self._inflight:
            task.cancel()
        self._inflight.clear()
