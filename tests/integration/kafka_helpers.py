"""Reading Kafka state from tests: consumer-group lag and whole topics."""

from __future__ import annotations

from typing import Callable

from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.pools_view import PicturesCutShort, latest_pictures
from pipeline.settings import Settings
from pipeline.topic_reader import open_from_beginning, read_to_end


async def pictures_if_read(settings: Settings, timeout_s: float = 10.0) -> dict[str, dict]:
    """Every pool's newest picture, or none when the read was cut short: a polling test's "not yet", where an
    older picture would pass for the newest."""
    try:
        return await latest_pictures(settings, settings.kafka_bootstrap_servers, timeout_s)
    except PicturesCutShort:
        return {}


async def group_lag(bootstrap: str, group: str, topics: list[str]) -> int:
    """Records in ``topics`` not yet committed by ``group`` (without joining the group)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        parts = [TopicPartition(t, p) for t in topics for p in sorted(await consumer._client._wait_on_metadata(t))]
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
    consumer, ends = await open_from_beginning(bootstrap, topic, max_partition_fetch_bytes=16 * 1024 * 1024,
                                               fetch_max_bytes=64 * 1024 * 1024)
    records: list = []
    try:
        await read_to_end(consumer, ends, lambda batch: [records.extend(m) for m in batch.values()])
        return records
    finally:
        await consumer.stop()


async def rewind_group(bootstrap: str, group: str, topics: list[str],
                       to: Callable[[TopicPartition, int], int] = lambda tp, end: 0) -> dict[TopicPartition, int]:
    """Commit ``to(partition, end offset)`` (default 0) for every partition of ``topics`` in ``group``
    (which must have no live members); returns what was committed."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        parts = [TopicPartition(t, p) for t in topics for p in sorted(await consumer._client._wait_on_metadata(t))]
        ends = await consumer.end_offsets(parts)
        offsets = {tp: to(tp, ends[tp]) for tp in parts}
        consumer.assign(parts)
        await consumer.commit(offsets)
        return offsets
    finally:
        await consumer.stop()


async def delete_before(bootstrap: str, offsets: dict[TopicPartition, int]) -> None:
    """Delete the records before ``offsets`` (what retention does to the oldest segments)."""
    from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_records({tp: RecordsToDelete(before_offset=o) for tp, o in offsets.items() if o > 0})
    finally:
        await admin.close()


async def topic_names(bootstrap: str) -> set[str]:
    """Every topic the broker knows."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def replace_topic_config(bootstrap: str, topic: str, config: dict[str, str]) -> None:
    """Set ``topic``'s config to ``config`` (AlterConfigs: every key not given goes back to the broker's
    default, so pass the whole config, e.g. ``spec.config(settings)`` plus the change)."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for response in await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, config)]):
            for code, message, *_ in response.resources:
                assert code == 0, f"cannot alter {topic}'s config: error {code} {message}"
    finally:
        await admin.close()


def landed_requests(settings) -> dict:
    """``{"rows", "ids"}`` of the store's request_events: equal counts mean nothing landed twice."""
    from pipeline.sinks.store import open_store

    store = open_store(settings)
    try:
        counts, = store.query("SELECT count() AS rows, uniqExact(event_id) AS ids FROM request_events")
    finally:
        store.close()
    return counts
