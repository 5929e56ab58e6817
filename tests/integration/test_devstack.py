"""The devstack: start → real round trip → stop; a second start reuses the cached jars; status tells dead from running."""

import asyncio
import os
import signal

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from pipeline.devstack.kafka import KafkaDevstack
from pipeline.settings import load_settings
from tests.conftest import wait_for

pytestmark = pytest.mark.integration


async def round_trip(bootstrap: str, topic: str) -> bytes:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"hello", key=b"k")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                group_id=f"{topic}-reader")
    await consumer.start()
    try:
        message = await asyncio.wait_for(consumer.getone(), 30)
        return message.value
    finally:
        await consumer.stop()


def test_start_round_trip_stop_restart_from_cache_and_detect_death(tmp_path):
    first = KafkaDevstack(load_settings(env={}, state_dir=str(tmp_path / "a")))
    info, _ = first.start()
    try:
        assert info.bootstrap.startswith("127.0.0.1:")
        assert first.status() == "running"
        assert asyncio.run(round_trip(info.bootstrap, "devstack-roundtrip")) == b"hello"
    finally:
        assert first.stop()
    assert first.status() == "stopped"
    assert not os.path.exists(f"/proc/{info.pid}/cmdline") or b"kafka.Kafka" not in open(
        f"/proc/{info.pid}/cmdline", "rb").read()

    jars = sorted(p.name for p in first.libs_dir.iterdir())
    second = KafkaDevstack(load_settings(env={}, state_dir=str(tmp_path / "b")))
    info2, downloaded = second.start()
    try:
        assert downloaded is False
        assert sorted(p.name for p in second.libs_dir.iterdir()) == jars
        os.killpg(info2.pid, signal.SIGKILL)
        wait_for(lambda: second.status() == "dead", 30, message="status to report the killed broker as dead")
    finally:
        second.stop()
    assert second.status() == "stopped"
