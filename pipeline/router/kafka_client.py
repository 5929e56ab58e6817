"""The router library's Kafka side: follow the admission topic, publish RequestEvents.

aiokafka (through ``topic_reader``) is imported inside the methods that talk to the broker, so
importing ``pipeline.router`` costs no Kafka import until a client is started.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Mapping

import orjson

from .. import topics
from ..bounded_producer import (DELIVERY_TIMEOUT_S, START_TIMEOUT_S, abandon, sender_stopped, spoils_producer,
                               start_producer, stop_producer)
from ..kafka_clients import client_options, producer_options
from ..settings import Settings
from .decider import Decider
from .signal_book import SignalBook
from .verdicts import Request, Verdict

log = logging.getLogger(__name__)


CONTROLLERS_ROOM_FOR = 10   # the signal book has room for this many controllers at their max_pools
FOLLOW_RETRY_MAX_S = 30.0   # the longest back-off before a router reads the admission topic again


async def _stop_quietly(consumer: Any) -> None:
    """Stop a consumer that failed: it may fail to stop too, and it is dropped either way."""
    try:
        await consumer.stop()
    except Exception:
        pass


class RouterClient:
    """Follows sluice.admission.v1 and answers ``decide`` from memory (no I/O per request)."""

    def __init__(self, settings: Settings, bootstrap: str, keys: Mapping[str, bytes], seed: int | None = None,
                 fallback_static_s: float = 30.0) -> None:
        self.settings = settings
        self.bootstrap = bootstrap
        # max_pools bounds each controller; a fleet's controllers share the pools out, so room for ten of them
        self.book = SignalBook(keys, max_pools=CONTROLLERS_ROOM_FOR * settings.max_pools)
        self.decider = Decider(self.book, seed=seed, fallback_static_s=fallback_static_s, clock=self.book.clock)
        self._task: asyncio.Task | None = None
        self._consumer: Any = None

    def decide(self, request: Request) -> Verdict:
        return self.decider.decide(request)

    def record(self, accepted: bool) -> None:
        self.decider.record(accepted)

    async def start(self) -> None:
        """Read the compacted topic to its end (every pool's newest signal), then follow it."""
        await self._open()
        self._task = asyncio.create_task(self._follow())

    async def _open(self) -> None:
        from ..topic_reader import open_from_beginning, read_to_end

        consumer, ends = await open_from_beginning(self.bootstrap, topics.ADMISSION.name(self.settings),
                                                   **client_options(self.settings))
        try:
            await read_to_end(consumer, ends, self._absorb)
        except BaseException:
            await _stop_quietly(consumer)   # the original error (a cancellation above all) is the one that goes on
            raise
        self._consumer = consumer

    def _absorb(self, batch: dict) -> None:
        for messages in batch.values():
            for message in messages:
                self.book.offer(message.value)

    async def _follow(self) -> None:
        """Offer each new signal to the book. An error the consumer raises (an authorizer refusing during an
        ACL reload, a corrupt batch) is logged and counted, and the topic is read again from the beginning
        after a back-off (1 s, doubling to 30 s): one such error ended this task, and the router decided on
        its last signals, then on its own throttle, until the process restarted. Re-reading is safe: the book
        refuses what it has seen (replayed) or what has expired."""
        from ..metrics import ROUTER_FOLLOW_ERRORS

        delay = 1.0
        while True:
            try:
                if self._consumer is None:
                    await self._open()
                self._absorb(await self._consumer.getmany(timeout_ms=500))
                delay = 1.0
            except Exception as exc:
                if asyncio.current_task().cancelling():   # stop() while reconnecting: an error in the way out
                    raise
                ROUTER_FOLLOW_ERRORS.inc()
                log.warning("router: following %s failed (%s: %.200s); reading it again in %.0f s",
                            topics.ADMISSION.name(self.settings), type(exc).__name__, exc, delay)
                consumer, self._consumer = self._consumer, None
                if consumer is not None:
                    await _stop_quietly(consumer)
                await asyncio.sleep(delay)   # back-off before reconnecting, not a synchronisation
                delay = min(FOLLOW_RETRY_MAX_S, delay * 2)

    async def stop(self) -> None:
        from ..topic_reader import cancel

        await cancel(self._task)
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await consumer.stop()


class EventEmitter:
    """Publishes RequestEvents for a router: ``emit`` never blocks; a full buffer drops and counts, and so
    does an event that cannot be encoded, that the broker refuses or that is not acknowledged within
    ``delivery_timeout_s`` (the pump goes on). A producer whose sender stopped, that left a batch
    unacknowledged that long, or that was refused in a way every later batch would be (``spoils_producer``)
    is replaced: without that, one stalled producer stopped every later event."""

    def __init__(self, settings: Settings, bootstrap: str, buffer: int = 10000, batch: int = 500,
                 start_timeout_s: float = START_TIMEOUT_S, delivery_timeout_s: float = DELIVERY_TIMEOUT_S) -> None:
        self.settings = settings
        self.bootstrap = bootstrap
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=buffer)
        self.batch = batch
        self.start_timeout_s = start_timeout_s
        # an idempotent aiokafka producer never expires a batch: it retries until the batch is delivered, so
        # without this bound a broker that stays unreachable, or a sender that died, held the pump for ever
        self.delivery_timeout_s = delivery_timeout_s
        self.dropped = 0
        self.sent = 0
        self.producers_replaced = 0
        self._task: asyncio.Task | None = None
        self._producer: Any = None

    def emit(self, event: dict) -> bool:
        try:
            self.queue.put_nowait(event)
            return True
        except asyncio.QueueFull:
            self._drop(1)
            return False

    def _drop(self, count: int) -> None:
        from ..metrics import ROUTER_EVENTS_DROPPED

        self.dropped += count
        ROUTER_EVENTS_DROPPED.inc(count)

    async def start(self) -> None:
        self._producer = await self._new_producer()
        self._task = asyncio.create_task(self._pump())

    async def _new_producer(self) -> Any:
        return await start_producer(self.bootstrap, self.start_timeout_s, linger_ms=20,
                                    **producer_options(self.settings))

    async def _replace_producer(self, why: str) -> None:
        """Stop the producer (within bounds) and start another; counted once the new one has started."""
        from ..metrics import ROUTER_EMITTER_RESTARTS

        log.warning("emitter: %s; replacing its Kafka producer", why)
        old, self._producer = self._producer, None
        if old is not None:
            await stop_producer(old, self.start_timeout_s)
        self._producer = await self._new_producer()
        self.producers_replaced += 1
        ROUTER_EMITTER_RESTARTS.inc()

    async def _pump(self) -> None:
        while True:
            events = [await self.queue.get()]
            while len(events) < self.batch and not self.queue.empty():
                events.append(self.queue.get_nowait())
            try:
                await self._send(events)
            except Exception as exc:  # no producer could be had (the broker is down): this batch, counted
                log.warning("emitter lost %d events: %s: %.200s", len(events), type(exc).__name__, exc)
                self._drop(len(events))
            finally:
                for _ in events:
                    self.queue.task_done()

    async def _send(self, events: list[dict]) -> None:
        """Each event is encoded on its own, so one the router built wrong (no task id) is the only one lost;
        ``sent`` and ``dropped`` count each event's own outcome, never the whole batch's. Raises (with nothing
        counted) only when no working producer could be had."""
        if self._producer is None or sender_stopped(self._producer):
            await self._replace_producer("its producer's sender has stopped" if self._producer else
                                         "it has no producer (the last one could not be replaced)")
        records = []
        for event in events:
            try:
                records.append((orjson.dumps(event), event["task_id"].encode()))
            except Exception as exc:  # no task id, a value JSON cannot hold: this event only, the pump goes on
                log.warning("emitter dropped an event it cannot encode: %r", exc)
                self._drop(1)
        topic = topics.REQUESTS.name(self.settings)
        futures = []
        for value, key in records:
            try:
                futures.append(await self._producer.send(topic, value, key=key))
            except Exception as exc:  # the broker refused or timed out: the rest of the batch would wait as long
                log.warning("emitter lost %d events: %s", len(records) - len(futures), exc)
                self._drop(len(records) - len(futures))
                break
        if not futures:
            return
        done, pending = await asyncio.wait(futures, timeout=self.delivery_timeout_s)
        errors = [f.exception() for f in done if f.exception() is not None]
        if errors:
            log.warning("emitter lost %d events: %s", len(errors), errors[0])
        self._drop(len(errors) + len(pending))
        self.sent += len(done) - len(errors)
        if pending:
            abandon(pending)
            why = (f"{len(pending)} events were not acknowledged within {self.delivery_timeout_s:g} s (counted as "
                   "dropped; the old producer may still deliver them as it stops)")
        elif any(spoils_producer(e) for e in errors):
            spoiled = next(e for e in errors if spoils_producer(e))
            why = f"its producer was refused in a way every later batch would be too ({spoiled!r})"
        elif sender_stopped(self._producer):
            why = "its producer's sender has stopped"
        else:
            return
        try:
            await self._replace_producer(why)
        except Exception as exc:  # the next batch tries again
            log.warning("emitter: no new producer yet (%s: %.200s)", type(exc).__name__, exc)

    async def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Deliver what is buffered (up to ``drain_timeout_s``), then stop."""
        from ..topic_reader import cancel

        if self._task is not None:
            try:
                await asyncio.wait_for(self.queue.join(), drain_timeout_s)
            except asyncio.TimeoutError:
                log.warning("emitter stopped with %d events undelivered", self.queue.qsize())
        await cancel(self._task)
        producer, self._producer = self._producer, None
        if producer is not None:
            await stop_producer(producer, self.start_timeout_s)
