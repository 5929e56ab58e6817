"""How long each of the worker's waits on its Kafka producer has lasted, and whether the producer is spent.

The worker's producer is idempotent, and aiokafka never expires an idempotent producer's batch: a broker that
stops acknowledging, or refuses with a retriable error (fewer in-sync replicas than ``min.insync.replicas``),
holds every await on a send for as long as that lasts — the tick's signals, the cuts' partials, the dead
letters. Each wait is timed: one older than ``producer_stall_s`` is named in /healthz's body and in
``sluice_worker_producer_wait_seconds``, but does not fail the check, since a restart would meet the same
broker (and cost a rebalance and a recovery on every worker at once). What a restart does cure — a producer
whose sender task has ended, or that a refusal spoiled for every later batch (an out-of-order sequence;
``bounded_producer``) — fails /healthz, for the orchestrator to restart the worker with a new producer: Faust's
producer cannot be replaced in a running app — and ends the worker, for a supervisor that restarts on exit
(compose, systemd) and never reads /healthz. A send that fails on a spent producer already ends it (the
exception ends the Faust task that sent, and Faust the app); ``RestartExit`` is for a producer spent where no
send fails (a sender that ended without an error leaves every send waiting, for ever), and for a control path
wedged inside the worker (``ControlConsumer.wedged``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

from .. import metrics
from ..bounded_producer import sender_stopped, spoils_producer


class StallWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._waiting: dict[int, tuple[str, float]] = {}
        self._ids = itertools.count()
        self.spoiled: str | None = None   # the first refusal that spoiled the producer, if one did

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Around one await on the producer: ``what`` names it in /healthz; a refusal that spoils the producer
        is remembered (``spoiled``) and raised on."""
        key = next(self._ids)
        self._waiting[key] = (what, self.clock())
        try:
            yield
        except Exception as exc:
            if spoils_producer(exc):
                self.spoiled = f"{what}: {type(exc).__name__}"
            raise
        finally:
            del self._waiting[key]

    def longest(self) -> float:
        """Seconds the oldest wait still going on has lasted (0 when none is)."""
        now = self.clock()
        return max((now - since for _, since in self._waiting.values()), default=0.0)

    def kinds(self) -> set[str]:
        """What is being waited on now, whatever its age."""
        return {what for what, _ in self._waiting.values()}

    def stuck(self, bound_s: float) -> dict[str, float]:
        """The waits older than ``bound_s``: the oldest of each kind, seconds."""
        now = self.clock()
        out: dict[str, float] = {}
        for what, since in self._waiting.values():
            age = round(now - since, 3)
            if age > bound_s:
                out[what] = max(age, out.get(what, 0.0))
        return out


def aiokafka_producer(app: Any) -> Any:
    """The aiokafka producer inside a Faust app's (None before Faust has made it): what ``spent`` inspects."""
    return getattr(app.producer, "_producer", None)


def spent(producer: Any, waits: StallWatch) -> str | None:
    """Why ``producer`` will deliver nothing more (None: it still can)."""
    return "its sender task ended" if sender_stopped(producer) else waits.spoiled


class RestartExit:
    """When a worker in a state only a restart cures (its producer spent, its control path wedged) should end:
    ``grace_s`` after that was first seen, which leaves /healthz the time to say why. Due once: the stop that
    follows is under way."""

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s, self.clock = grace_s, clock
        self.since: float | None = None
        self.fired = False

    def due(self, reason: str | None) -> bool:
        if reason is None:
            self.since = None
            return False
        if self.fired:
            return False
        if self.since is None:
            self.since = self.clock()
        self.fired = self.clock() - self.since >= self.grace_s
        return self.fired


class ProducerSpent(Exception):
    """The worker ends with this: its producer can deliver nothing more, and only a new process has a new one."""


class ControlWedged(Exception):
    """The worker ends with this: its control path's cut waits on a lock whose holder waits on nothing at the
    broker (ControlConsumer.wedged), so its partitions' events no longer reach the pictures."""


PRODUCER_WAITS = StallWatch()   # the worker's one producer, so one watch for every path that sends through it
metrics.PRODUCER_WAIT.set_function(PRODUCER_WAITS.longest)


async def send_all(what: str, messages: Iterable[tuple[Any, bytes, bytes | None]]) -> int:
    """Send each (Faust topic, key, value) and wait until the broker has acknowledged them all, the wait
    watched as ``what``; returns how many were sent."""
    with PRODUCER_WAITS.waiting(what):
        sent = [await topic.send(key=key, value=value) for topic, key, value in messages]
        if sent:
            await asyncio.gather(*sent)
    return len(sent)
