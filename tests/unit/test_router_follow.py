"""A router keeps following the admission topic through errors its consumer raises."""

import asyncio
import time
from types import SimpleNamespace

from aiokafka.errors import TopicAuthorizationFailedError

from pipeline.admission.signing import sign
from pipeline.router import RouterClient
from pipeline.settings import load_settings
from tests.unit.test_router import KEYS
from tests.unit.test_signing import example_signal


class FlakyConsumer:
    """Refuses its first fetch (an authorizer reloading its ACLs), then serves a signal a fetch."""

    def __init__(self, opened: list) -> None:
        self.fetches = 0
        self.stopped = False
        opened.append(self)

    async def getmany(self, timeout_ms=0):
        await asyncio.sleep(0.01)   # a fetch waits for records: the follow loop yields to the event loop here
        self.fetches += 1
        if self.fetches == 1 and len(opened_consumers) == 1:
            raise TopicAuthorizationFailedError("sluice.admission.v1")
        now = int(time.time() * 1000)
        body = example_signal() | {"pool": "p", "seq": now, "issued_at": now, "valid_until": now + 6000}
        return {"tp": [SimpleNamespace(value=sign(body, "k1", KEYS["k1"]))]}

    async def stop(self):
        self.stopped = True


opened_consumers: list = []


def test_one_consumer_error_does_not_stop_a_router_following_signals(monkeypatch):
    """It ended the follow task for good: the router decided on its last signals, then fell back to its own
    throttle until the process restarted."""
    from pipeline import metrics

    opened_consumers.clear()
    client = RouterClient(load_settings(env={}), "127.0.0.1:1", KEYS)

    async def open_consumer():
        client._consumer = FlakyConsumer(opened_consumers)

    monkeypatch.setattr(client, "_open", open_consumer)
    errors = metrics.ROUTER_FOLLOW_ERRORS._value.get()

    async def scenario():
        await client.start()
        deadline = time.monotonic() + 10
        while "p" not in client.book.signals:
            assert time.monotonic() < deadline and not client._task.done(), "the router stopped following"
            await asyncio.sleep(0.05)   # polling the book, with a deadline
        await client.stop()

    asyncio.run(scenario())
    assert len(opened_consumers) == 2 and opened_consumers[0].stopped, "the failed consumer is closed, a new one read"
    assert metrics.ROUTER_FOLLOW_ERRORS._value.get() == errors + 1


def test_stop_during_a_reconnect_stops_the_router_even_when_the_broken_consumer_fails_to_stop(monkeypatch):
    """A cancellation met inside the reconnect, where the old consumer's stop() raised, turned into that error:
    the follow loop caught it and went on opening consumers, and stop() never returned. Found in review."""
    import pipeline.topic_reader as topic_reader

    opened: list = []

    class Broken:
        def __init__(self):
            opened.append(self)

        async def getmany(self, timeout_ms=0):
            await asyncio.sleep(0.01)   # a fetch waits for records
            raise RuntimeError("fetch refused")

        async def stop(self):
            raise RuntimeError("connection already broken")

    async def open_from_beginning(*args, **kwargs):
        return Broken(), {}

    reread = asyncio.Event()

    async def read_to_end(consumer, ends, absorb):
        if len(opened) > 1:   # the re-read, slow (a large topic): stop() comes while it is under way
            reread.set()
            await asyncio.Event().wait()

    monkeypatch.setattr(topic_reader, "open_from_beginning", open_from_beginning)
    monkeypatch.setattr(topic_reader, "read_to_end", read_to_end)
    client = RouterClient(load_settings(env={}), "127.0.0.1:1", KEYS)

    async def scenario():
        await client.start()
        await asyncio.wait_for(reread.wait(), 10)
        await asyncio.wait_for(client.stop(), 5)
        return client._task.done()

    assert asyncio.run(scenario())
    assert len(opened) == 2
