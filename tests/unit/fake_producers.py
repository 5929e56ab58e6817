"""Stand-ins for aiokafka producers: one that delivers at once, one that never delivers (as aiokafka's does once
its sender has ended, or while its broker is away: an idempotent producer never expires a batch)."""

from __future__ import annotations

import asyncio
import types


class StalledProducer:
    """A producer that queues records and never delivers them (aiokafka's, once its sender ended);
    ``sender_done`` says whether that sender is seen to have ended."""

    def __init__(self, sender_done: bool) -> None:
        task = asyncio.get_running_loop().create_future()
        if sender_done:
            task.set_result(None)
        self._sender = types.SimpleNamespace(sender_task=task)
        self.client = types.SimpleNamespace(close=self.stop_nothing)
        self.queued: list = []
        self.stopped = False

    async def send(self, topic, value, key):
        self.queued.append(key)
        return asyncio.get_running_loop().create_future()   # never resolves

    async def stop(self):
        await asyncio.Event().wait()   # flushing what it never sends: never returns

    async def stop_nothing(self):
        self.stopped = True


class DeliveringProducer:
    def __init__(self) -> None:
        self.delivered: list = []

    async def send(self, topic, value, key):
        self.delivered.append(key)
        outcome = asyncio.get_running_loop().create_future()
        outcome.set_result(None)
        return outcome

    async def stop(self):
        pass


class RefusingProducer(DeliveringProducer):
    """A producer whose every record the broker refuses with ``error``."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error
        self.stopped = False

    async def send(self, topic, value, key):
        self.delivered.append(key)
        outcome = asyncio.get_running_loop().create_future()
        outcome.set_exception(self.error)
        return outcome

    async def stop(self):
        self.stopped = True
