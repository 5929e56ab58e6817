"""Reading a whole topic without a consumer group: compacted topics, dead letters, benchmarks."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from aiokafka import AIOKafkaConsumer, TopicPartition


def groupless(bootstrap: str, **options: Any) -> AIOKafkaConsumer:
    """A consumer outside any group (nothing committed), for assigning partitions by hand."""
    return AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                            **options)


async def open_from_beginning(bootstrap: str, topic: str, **options: Any) -> tuple[AIOKafkaConsumer, dict]:
    """A started consumer assigned every partition of ``topic`` at offset 0, and the end offsets now."""
    consumer = groupless(bootstrap, **options)
    await consumer.start()
    try:
        partitions = await consumer._client._wait_on_metadata(topic) or consumer.partitions_for_topic(topic) or ()
        parts = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        return consumer, await consumer.end_offsets(parts)
    except BaseException:
        await consumer.stop()
        raise


async def read_since(bootstrap: str, topic: str, partitions: set[int], since_ms: int, timeout_s: float,
                     keep: Callable[[Any], Any], into: list, **options: Any) -> bool:
    """``keep(record)`` of every record of ``partitions`` with a timestamp from ``since_ms`` up to the end
    offsets now, appended to ``into`` unless None; False if ``timeout_s`` ran out first (then ``into``
    holds what was read, from the oldest)."""
    if not partitions:
        return True
    consumer = groupless(bootstrap, **options)
    wanted: dict[TopicPartition, int] = {}

    def take(batch: dict) -> None:
        for tp, records in batch.items():
            for record in records:
                if record.offset < wanted[tp] and record.value is not None:
                    kept = keep(record)
                    if kept is not None:
                        into.append(kept)

    try:
        async with asyncio.timeout(timeout_s):
            await consumer.start()
            parts = [TopicPartition(topic, p) for p in sorted(partitions)]
            starts = await consumer.offsets_for_times({tp: since_ms for tp in parts})
            ends = await consumer.end_offsets(parts)
            wanted.update({tp: ends[tp] for tp in parts if starts.get(tp) is not None})  # None: none so recent
            consumer.assign(list(wanted))
            for tp in wanted:
                consumer.seek(tp, starts[tp].offset)
            await read_to_end(consumer, wanted, take)
        return True
    except TimeoutError:
        return False
    finally:
        await consumer.stop()


async def read_to_end(consumer: AIOKafkaConsumer, ends: dict, on_batch: Callable[[dict], None],
                      timeout_s: float | None = None) -> bool:
    """Feed ``on_batch`` until every partition reaches its end offset; False if ``timeout_s`` ran out."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while True:
        positions = [await consumer.position(tp) for tp in ends]
        if all(pos >= end for pos, end in zip(positions, ends.values())):
            return True
        if deadline is not None and loop.time() > deadline:
            return False
        on_batch(await consumer.getmany(timeout_ms=200))


async def cancel(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has stopped."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
