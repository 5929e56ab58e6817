"""The router's event emitter against the real broker: batched, never blocking, drops counted."""

import asyncio

import orjson
import pytest

from pipeline import topics
from pipeline.router import EventEmitter
from pipeline.sim.specimens import request_event
from pipeline.topics import ensure_topics
from tests.integration.kafka_helpers import read_all

pytestmark = pytest.mark.integration


def test_emitter_publishes_and_counts_what_it_drops(settings):
    asyncio.run(ensure_topics(settings, settings.kafka_bootstrap_servers))
    events = [request_event(task_id=f"task-{i}", request_id=f"task-{i}-r1") for i in range(150)]

    async def scenario():
        emitter = EventEmitter(settings, settings.kafka_bootstrap_servers, buffer=100, batch=20)
        accepted = [emitter.emit(e) for e in events]   # before start: the buffer fills, then drops
        await emitter.start()
        await emitter.stop()
        return emitter, accepted

    emitter, accepted = asyncio.run(scenario())
    assert accepted == [True] * 100 + [False] * 50
    assert emitter.dropped == 50 and emitter.sent == 100
    records = asyncio.run(read_all(settings.kafka_bootstrap_servers, topics.REQUESTS.name(settings)))
    assert sorted(orjson.loads(r.value)["event_id"] for r in records) == sorted(e["event_id"] for e in events[:100])
    assert {r.key for r in records} == {e["task_id"].encode() for e in events[:100]}
