"""How long each of the worker's waits on its Kafka producer has lasted.

The worker's producer is idempotent, and aiokafka never expires an idempotent producer's batch: a broker that
stops acknowledging, or a sender task that ended, holds every await on a send for ever. Faust's producer
cannot be replaced under a running app, so the waits are watched instead: one older than
``producer_stall_s`` fails /healthz, and the orchestrator restarts the worker with a fresh producer — where
before the worker answered healthy while its ticks, partials or dead letters waited, and routers saw no new
signal.
"""

from __future__ import annotations

import itertools
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from .. import metrics


class StallWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._waiting: dict[int, tuple[str, float]] = {}
        self._ids = itertools.count()

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Around one await on the producer: ``what`` names it in /healthz."""
        key = next(self._ids)
        self._waiting[key] = (what, self.clock())
        try:
            yield
        finally:
            del self._waiting[key]

    def longest(self) -> float:
        """Seconds the oldest wait still going on has lasted (0 when none is)."""
        now = self.clock()
        return max((now - since for _, since in self._waiting.values()), default=0.0)

    def stuck(self, bound_s: float) -> dict[str, float]:
        """The waits older than ``bound_s``: the oldest of each kind, seconds."""
        now = self.clock()
        out: dict[str, float] = {}
        for what, since in self._waiting.values():
            age = round(now - since, 3)
            if age > bound_s:
                out[what] = max(age, out.get(what, 0.0))
        return out


PRODUCER_WAITS = StallWatch()   # the worker's one producer, so one watch for every path that sends through it
metrics.PRODUCER_WAIT.set_function(PRODUCER_WAITS.longest)
