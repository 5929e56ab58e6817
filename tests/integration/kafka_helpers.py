"""Reading Kafka state from tests: consumer-group lag and whole topics."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, TopicPartition


async def group_lag(bootstrap: str, group: str, topics: list[str]) -> int:
    """Records in ``topics`` not yet committed by ``group`` (without joining the group)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        parts = [TopicPartition(t, p) for t in topics for p in (await consumer._client._wait_on_metadata(t) or
                                                                  consumer.partitions_for_topic(t) or ())]
        ends = await consumer.end_offsets(parts)
        lag = 0
        for tp in parts:
            committed = await consumer.committed(tp)
            lag += ends[tp] - (committed or 0)
        return lag
    finally:
        await consumer.stop()


async def read_all(bootstrap: str, topic: str) -> list:
    """Every record currently in ``topic``, from the beginning to the end offsets at call time."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                auto_offset_reset="earliest", max_partition_fetch_bytes=16 * 1024 * 1024,
                                fetch_max_bytes=64 * 1024 * 1024)
    await consumer.start()
    try:
        await consumer._client._wait_on_metadata(topic)
        parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        ends = await consumer.end_offsets(parts)
        records = []
        remaining = {tp for tp in parts if ends[tp] > 0}
        while remaining:
            batch = await consumer.getmany(timeout_ms=1000)
            for tp, msgs in batch.items():
                records.extend(msgs)
                if msgs and msgs[-1].offset + 1 >= ends[tp]:
                    remaining.discard(tp)
        return records
    finally:
        await consumer.stop()
