"""What both paths' batch consumers share: how they are built, what a fetch becomes, lag and commits.

Both paths read raw events with aiokafka's ``getmany`` rather than a Faust
stream: each sees every raw event, and per-message stream machinery cost
more than all of stage 1's own work (docs/performance notes in
docs/load-picture.md). Each path is its own consumer group, so each commits
on its own schedule and one never waits for the other.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import topics
from ..ingest import Record
from ..kafka_clients import client_options
from ..settings import Settings

log = logging.getLogger(__name__)


def batch_consumer(settings: Settings, bootstrap: str, group: str) -> Any:
    from aiokafka import AIOKafkaConsumer

    return AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False, auto_offset_reset="earliest",
        max_partition_fetch_bytes=topics.raw_topic_max_bytes(settings),
        fetch_max_bytes=max(52428800, topics.raw_topic_max_bytes(settings)),
        max_poll_records=settings.ingest_batch_max, session_timeout_ms=int(settings.session_timeout_s * 1000),
        heartbeat_interval_ms=int(settings.heartbeat_interval_s * 1000), **client_options(settings))


class BatchLoop:
    """One path's consumer loop: fetch a batch, hand it over, track lag; pause newly assigned partitions
    until the path has decided where they start. Subclasses supply the hooks."""

    lag_gauge: Any = None

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.consumer: Any = None
        self.ended = False   # the loop ended: no consumer, and none until consume() runs again
        self._lag: dict[Any, int] = {}

    def group(self) -> str:
        raise NotImplementedError

    def classes(self) -> dict[str, type]:
        raise NotImplementedError

    async def on_assigned(self, tp: Any) -> None:
        """Seek ``tp`` where this path resumes it."""

    async def on_revoked(self, revoked: list[tuple[str, int]]) -> None:
        """Finish what was taken from partitions that are moving to another worker."""

    async def on_fetched(self, by_topic: dict[str, list[Record]]) -> None:
        raise NotImplementedError

    async def on_idle(self) -> None:
        """Nothing arrived within ``ingest_batch_within_s``."""

    async def on_stop(self) -> None:
        """The loop ends (shutdown or a crash): drop what is in flight."""

    async def consume(self, bootstrap: str) -> None:
        from aiokafka import ConsumerRebalanceListener

        s = self.settings
        classes = self.classes()
        loop = self

        class Rebalance(ConsumerRebalanceListener):
            async def on_partitions_revoked(self, revoked: Any) -> None:
                await loop.on_revoked([(tp.topic, tp.partition) for tp in revoked])
                for tp in revoked:
                    loop._lag.pop(tp, None)

            async def on_partitions_assigned(self, assigned: Any) -> None:
                consumer.pause(*assigned)  # nothing is handled from a position not yet confirmed
                for tp in assigned:
                    await loop.on_assigned(tp)
                consumer.resume(*assigned)

        consumer = batch_consumer(s, bootstrap, self.group())
        consumer.subscribe(list(classes), listener=Rebalance())
        self.consumer = consumer  # before start: the first assignment can come while it starts
        self.ended = False
        try:
            await consumer.start()
            while True:
                fetched = await consumer.getmany(timeout_ms=int(s.ingest_batch_within_s * 1000),
                                                 max_records=s.ingest_batch_max)
                if not fetched:
                    await self.on_idle()
                    continue
                await self.on_fetched(records_by_topic(fetched))
                update_lag(consumer, fetched, self._lag, self.lag_gauge, classes)
        finally:
            self.ended, self.consumer = True, None
            await self.on_stop()
            await consumer.stop()


def records_by_topic(fetched: dict) -> dict[str, list[Record]]:
    by_topic: dict[str, list[Record]] = {}
    for tp, messages in fetched.items():
        by_topic.setdefault(tp.topic, []).extend(
            Record(m.topic, m.partition, m.offset, m.timestamp, m.key, m.value) for m in messages)
    return by_topic


def update_lag(consumer: Any, fetched: dict, lag: dict, gauge: Any, topic_names: Any) -> None:
    """Records behind each partition's high-water mark after this fetch, summed per topic."""
    for tp, messages in fetched.items():
        highwater = consumer.highwater(tp)
        if highwater is not None:
            lag[tp] = max(0, highwater - messages[-1].offset - 1)
    for topic in topic_names:
        gauge.labels(topic).set(sum(v for tp, v in lag.items() if tp.topic == topic))


async def commit(consumer: Any, offsets: dict) -> bool:
    """Commit ``{TopicPartition: offset or OffsetAndMetadata}``; False when a rebalance moved them."""
    from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

    try:
        await consumer.commit(offsets)
        return True
    except (CommitFailedError, IllegalStateError) as exc:
        log.warning("commit after rebalance failed (%s): the new owner resumes from the last commit", exc)
    except KafkaError as exc:
        log.warning("commit failed (%s): retried with the next one", exc)
    return False


async def committed_with_metadata(consumer: Any, tp: Any) -> tuple[int | None, str]:
    """The group's committed offset for ``tp`` and the metadata committed with it.

    aiokafka's public ``committed()`` drops the metadata; the control path
    keeps its write-ahead cut there, so this asks the group coordinator.
    """
    offsets = await consumer._coordinator.fetch_committed_offsets([tp])
    found = offsets.get(tp)
    if found is None or found.offset < 0:
        return None, ""
    return found.offset, found.metadata or ""
