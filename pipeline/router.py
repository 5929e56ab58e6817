"""The client library routers embed: follow admission signals, decide per request, emit events.

Usage (asyncio)::

    client = RouterClient(settings, bootstrap, keys={"k1": b"..."}, seed=7)
    await client.start()          # reads sluice.admission.v1 from the beginning: every pool at once
    verdict = client.decide(Request(pool="chat-70b", priority="standard", continuing=False,
                                    retry=False, slo_ttft_s=1.0))
    if isinstance(verdict, Admit): ...
    client.record(accepted=True)  # the backend took the request (feeds the fallback throttle)
    await client.stop()

Every signal is verified (HMAC over the documented bytes, a known key id,
a schema-valid body, a ``seq`` above the last one accepted for its pool);
refusals are counted by reason. Without a valid signal a router is
**fail-static** for ``fallback_static_s`` after the last one expired, then
throttles adaptively: reject with probability
``max(0, (requests − K·accepts) / (requests + 1))`` over a sliding window (K = 2).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Union

import orjson

from . import topics
from .admission.signing import SignatureError, verify
from .contract import Invalid
from .events import validate
from .settings import Settings
from .topic_reader import cancel, open_from_beginning, read_to_end

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    pool: str
    priority: str
    continuing: bool = False   # a later step of a task already under way
    retry: bool = False        # attempt > 1
    slo_ttft_s: float | None = None
    after_shed: bool = False   # this retry follows a rejection by admission, honouring its retry-after


@dataclass(frozen=True)
class Admit:
    pass


@dataclass(frozen=True)
class Reject:
    retry_after_s: float
    reason: str


@dataclass(frozen=True)
class Redirect:
    pool: str


@dataclass(frozen=True)
class Defer:
    retry_after_s: float


Verdict = Union[Admit, Reject, Redirect, Defer]
ADMIT = Admit()


class SlidingCounts:
    """Counts per second over the last ``window_s`` seconds (clock passed in)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.buckets: deque[list] = deque()  # [second, a, b]

    def add(self, now_s: float, a: int = 0, b: int = 0) -> None:
        second = int(now_s)
        if self.buckets and self.buckets[-1][0] == second:
            self.buckets[-1][1] += a
            self.buckets[-1][2] += b
        else:
            self.buckets.append([second, a, b])
        self._trim(now_s)

    def totals(self, now_s: float) -> tuple[int, int]:
        self._trim(now_s)
        return sum(x[1] for x in self.buckets), sum(x[2] for x in self.buckets)

    def _trim(self, now_s: float) -> None:
        while self.buckets and self.buckets[0][0] <= now_s - self.window_s:
            self.buckets.popleft()


class SignalBook:
    """The newest trusted signal per pool, and why others were refused."""

    def __init__(self, keys: Mapping[str, bytes]) -> None:
        self.keys = dict(keys)
        self.signals: dict[str, dict] = {}
        self.refused: dict[str, int] = {}

    def _refuse(self, reason: str) -> bool:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return False

    def offer(self, message: bytes | None) -> bool:
        """Take a message from the admission topic; False (and counted) when it is not trusted."""
        if message is None:
            return self._refuse("tombstone")
        try:
            signal = verify(message, self.keys)
            validate("admission_signal", signal)
        except SignatureError as exc:
            return self._refuse(exc.reason)
        except Invalid:
            return self._refuse("invalid")
        current = self.signals.get(signal["pool"])
        if current is not None and signal["seq"] <= current["seq"]:
            return self._refuse("replayed")
        self.signals[signal["pool"]] = signal
        return True


class Decider:
    """``decide(request)`` from the signal book, with a seedable RNG and an injectable clock."""

    def __init__(self, book: SignalBook, seed: int | None = None, fallback_static_s: float = 30.0,
                 throttle_k: float = 2.0, window_s: float = 120.0, clock=time.time) -> None:
        self.book = book
        self.rng = random.Random(seed)
        self.fallback_static_s = fallback_static_s
        self.k = throttle_k
        self.clock = clock
        self.outcomes = SlidingCounts(window_s)   # requests, backend accepts (for the fallback throttle)
        self.attempts = SlidingCounts(window_s)   # attempts, retries (for the local retry budget)

    def record(self, accepted: bool) -> None:
        """The backend's answer to a request this router sent (feeds adaptive throttling)."""
        self.outcomes.add(self.clock(), 1, 1 if accepted else 0)

    def decide(self, request: Request) -> Verdict:
        now = self.clock()
        signal = self.book.signals.get(request.pool)
        if signal is not None and now * 1000 > signal["valid_until"] + self.fallback_static_s * 1000:
            signal = None  # expired beyond the fail-static grace: fall back
        if signal is None:
            return self._throttle(now)
        # the retry budget is for the cascade (retries after timeouts and failures); a retry that answers
        # our own shedding is judged by the admit fraction like any request, or shed work could never return
        budgeted = request.retry and not request.after_shed
        self.attempts.add(now, 1, 1 if budgeted else 0)
        if budgeted:
            attempts, retries = self.attempts.totals(now)
            if retries > signal["retry_budget"] * attempts:
                return Reject(1.0, "retry_budget")
        slo = request.slo_ttft_s
        if slo is not None and signal["max_predicted_wait_s"] > slo:
            return self._elsewhere(signal, slo, "predicted_wait")
        fractions = signal["continuing_task_admit_fraction" if request.continuing else "admit_fraction"]
        if self.rng.random() < fractions[request.priority]:
            return ADMIT
        if request.priority in signal["defer"]["classes"]:
            return Defer(signal["defer"]["retry_after_s"])
        return self._elsewhere(signal, slo, "shed")

    def _elsewhere(self, signal: dict, slo: float | None, reason: str) -> Verdict:
        """Move the work if a sibling has headroom and its cold prefill still fits the SLO; else reject."""
        options = [r for r in signal["redirect"] if slo is None or r["cold_prefill_cost_s"] < slo]
        if options:
            cumulative, total = [], 0.0
            for option in options:
                total += option["weight"]
                cumulative.append(total)
            pick = bisect.bisect_right(cumulative, self.rng.random() * total)
            return Redirect(options[min(pick, len(options) - 1)]["pool"])
        return Reject(max(1.0, signal["defer"]["retry_after_s"]), reason)

    def _throttle(self, now: float) -> Verdict:
        requests, accepts = self.outcomes.totals(now)
        p_reject = max(0.0, (requests - self.k * accepts) / (requests + 1))
        if self.rng.random() < p_reject:
            return Reject(1.0, "client_throttle")
        return ADMIT


class RouterClient:
    """Follows sluice.admission.v1 and answers ``decide`` from memory (no I/O per request)."""

    def __init__(self, settings: Settings, bootstrap: str, keys: Mapping[str, bytes], seed: int | None = None,
                 fallback_static_s: float = 30.0) -> None:
        self.settings = settings
        self.bootstrap = bootstrap
        self.book = SignalBook(keys)
        self.decider = Decider(self.book, seed=seed, fallback_static_s=fallback_static_s)
        self._task: asyncio.Task | None = None
        self._consumer: Any = None

    def decide(self, request: Request) -> Verdict:
        return self.decider.decide(request)

    def record(self, accepted: bool) -> None:
        self.decider.record(accepted)

    async def start(self) -> None:
        """Read the compacted topic to its end (every pool's newest signal), then follow it."""
        consumer, ends = await open_from_beginning(self.bootstrap, topics.ADMISSION.name(self.settings))
        await read_to_end(consumer, ends, self._absorb)
        self._consumer = consumer
        self._task = asyncio.create_task(self._follow())

    def _absorb(self, batch: dict) -> None:
        for messages in batch.values():
            for message in messages:
                self.book.offer(message.value)

    async def _follow(self) -> None:
        while True:
            self._absorb(await self._consumer.getmany(timeout_ms=500))

    async def stop(self) -> None:
        await cancel(self._task)
        if self._consumer:
            await self._consumer.stop()


class EventEmitter:
    """Publishes RequestEvents for a router: ``emit`` never blocks; a full buffer drops and counts."""

    def __init__(self, settings: Settings, bootstrap: str, buffer: int = 10000, batch: int = 500) -> None:
        self.settings = settings
        self.bootstrap = bootstrap
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=buffer)
        self.batch = batch
        self.dropped = 0
        self.sent = 0
        self._task: asyncio.Task | None = None
        self._producer: Any = None

    def emit(self, event: dict) -> bool:
        try:
            self.queue.put_nowait(event)
            return True
        except asyncio.QueueFull:
            self.dropped += 1
            from .metrics import ROUTER_EVENTS_DROPPED

            ROUTER_EVENTS_DROPPED.inc()
            return False

    async def start(self) -> None:
        from aiokafka import AIOKafkaProducer

        self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=20, acks="all",
                                          enable_idempotence=True)
        await self._producer.start()
        self._task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        topic = topics.REQUESTS.name(self.settings)
        while True:
            events = [await self.queue.get()]
            while len(events) < self.batch and not self.queue.empty():
                events.append(self.queue.get_nowait())
            futures = [await self._producer.send(topic, orjson.dumps(e), key=e["task_id"].encode()) for e in events]
            await asyncio.gather(*futures)
            self.sent += len(events)
            for _ in events:
                self.queue.task_done()

    async def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Deliver what is buffered (up to ``drain_timeout_s``), then stop."""
        if self._task is not None:
            try:
                await asyncio.wait_for(self.queue.join(), drain_timeout_s)
            except asyncio.TimeoutError:
                log.warning("emitter stopped with %d events undelivered", self.queue.qsize())
        await cancel(self._task)
        if self._producer:
            await self._producer.stop()
