"""``sluice otel-bridge``: the OTLP/JSON spans topic → RequestEvents on the requests topic, and dead letters.

A thin shell around the pure ``spans.map_request``: an aiokafka consumer of ``otel_topic`` in its own group
(``otel_group``, default ``<app_id>-otel``) and an idempotent producer. For each fetched batch, every record is
mapped; its events go to the requests topic keyed by ``task_id``, and a record with any rejection goes to the
dead-letter topic once, with its original key and bytes, in the workers' format (``events.dead_letter``: keyed
and identified by the source position). Offsets are committed only after every produce of the batch is
acknowledged: a crash or a failed produce redelivers, never loses. A redelivered span maps to the same
``event_id`` (uuid5 of trace id, span id and phase), which the workers drop as a duplicate, and a redelivered
record yields the same dead letter.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from .. import topics
from ..bounded_producer import (DELIVERY_TIMEOUT_S, abandon, sender_stopped, spoils_producer, start_producer,
                               stop_producer)
from ..events import Rejected, dead_letter
from ..kafka_clients import producer_options
from ..settings import Settings, SettingsError
from .spans import MappingConfig, Mapped, map_request

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 1 << 20      # a dead letter's key_b64 holds at most 1 MiB of original key
RETRY_BACKOFF_S = (0.5, 1, 2, 5, 10)
SUMMARY_EVERY_S = 60.0


@dataclass
class Totals:
    """What the bridge has done since it started (counted once the batch is acknowledged)."""

    records: int = 0
    spans: int = 0
    events: int = 0
    dead_letters: int = 0
    rejections: int = 0  # spans, or envelopes around them, that could not be mapped
    skipped: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    produce_failures: int = 0

    def add(self, mapped: Mapped) -> None:
        self.records += 1
        self.spans += mapped.spans
        self.events += len(mapped.events)
        self.rejections += mapped.rejected
        for cause, n in mapped.skipped.items():
            self.skipped[cause] = self.skipped.get(cause, 0) + n
        rejection = mapped.rejection()
        if rejection is not None:
            self.dead_letters += 1
            self.reasons[rejection.reason] = self.reasons.get(rejection.reason, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {"records": self.records, "spans": self.spans, "events": self.events,
                "dead_letters": self.dead_letters, "rejections": self.rejections,
                "skipped": dict(self.skipped), "reasons": dict(self.reasons),
                "produce_failures": self.produce_failures}


class OtelBridge:
    def __init__(self, settings: Settings, bootstrap: str) -> None:
        if not settings.otel_topic:
            raise SettingsError("otel_topic is empty: set it to the Collector's spans topic (e.g. otlp_spans)")
        own = {spec.name(settings) for spec in topics.ALL}
        if settings.otel_topic in own:
            raise SettingsError(f"otel_topic={settings.otel_topic} is one of Sluice's own topics")
        try:
            self.config = MappingConfig.of(settings)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        self.settings = settings
        self.bootstrap = bootstrap
        self.source = topics.otel_topic(settings)
        self.requests_topic = topics.REQUESTS.name(settings)
        self.dead_letter_topic = topics.DEADLETTER.name(settings)
        self.max_letter_bytes = topics.dead_letter_max_bytes(settings) - 65536
        self.totals = Totals()
        self.delivery_timeout_s = DELIVERY_TIMEOUT_S
        self._producer: Any = None

    async def run(self) -> None:
        """Bridge until cancelled."""
        from ..worker.consumer import batch_consumer

        s = self.settings
        consumer = batch_consumer(s, self.bootstrap, topics.otel_group(s))
        consumer.subscribe([self.source])
        self._producer = await self._new_producer()   # no broker at start: fail loudly
        try:
            await consumer.start()
            log.info("otel bridge: %s (group %s) → %s, dead letters → %s", self.source, topics.otel_group(s),
                     self.requests_topic, self.dead_letter_topic)
            failures = 0
            next_summary = time.monotonic() + SUMMARY_EVERY_S
            while True:
                fetched = await consumer.getmany(timeout_ms=int(s.ingest_batch_within_s * 1000),
                                                 max_records=s.ingest_batch_max)
                if fetched:
                    if await self._bridge(consumer, fetched):
                        failures = 0
                    else:
                        failures += 1
                        await asyncio.sleep(RETRY_BACKOFF_S[min(failures, len(RETRY_BACKOFF_S)) - 1])
                if time.monotonic() > next_summary:
                    next_summary = time.monotonic() + SUMMARY_EVERY_S
                    log.info("otel bridge totals: %s", orjson.dumps(self.totals.as_dict()).decode())
        finally:
            try:
                await consumer.stop()
            finally:
                if self._producer is not None:
                    await stop_producer(self._producer)

    async def _new_producer(self) -> Any:
        s = self.settings
        return await start_producer(self.bootstrap, linger_ms=5, max_request_size=topics.dead_letter_max_bytes(s),
                                    **producer_options(s))

    async def _replace_producer(self, why: str | None) -> None:
        """A new producer for one that stopped delivering (``why``), or for none; None while none can start."""
        if why:
            log.warning("otel bridge: %s; replacing its Kafka producer", why)
        old, self._producer = self._producer, None
        if old is not None:
            await stop_producer(old)
        self._producer = await self._new_producer()

    async def _bridge(self, consumer: Any, fetched: dict) -> bool:
        """Map, produce, wait for every acknowledgement, commit; False (rewound for a retry) if a produce failed.

        An idempotent producer never gives up on a record: one not acknowledged within ``delivery_timeout_s``
        fails the batch like a refusal, and the producer is replaced (as is one whose sender has stopped), or
        the bridge waited for as long as the broker was away, or for ever on a dead sender. A record the old
        producer still delivers comes again in the retry: landing keeps one per event id."""
        from aiokafka.errors import IllegalStateError, KafkaError, KafkaTimeoutError

        from ..worker.consumer import commit

        now_ms = int(time.time() * 1000)
        batch = Totals()
        try:
            if self._producer is None or sender_stopped(self._producer):
                await self._replace_producer("its Kafka producer's sender stopped" if self._producer else None)
            producer = self._producer
            pending = []
            for messages in fetched.values():
                for m in messages:
                    mapped = map_request(m.value, now_ms, self.config)
                    for event in mapped.events:
                        pending.append(await producer.send(self.requests_topic, orjson.dumps(event),
                                                           key=event["task_id"].encode()))
                    rejection = mapped.rejection()
                    if rejection is not None:
                        key, letter = self._dead_letter(rejection, m, now_ms)
                        pending.append(await producer.send(self.dead_letter_topic, letter, key=key))
                    batch.add(mapped)
                    await asyncio.sleep(0)  # mapping is CPU work: let the consumer's heartbeat run between records
            done, unacknowledged = await asyncio.wait(pending, timeout=self.delivery_timeout_s) if pending else ((), ())
            if unacknowledged:
                abandon(unacknowledged)
                await self._replace_producer(f"{len(unacknowledged)} records not acknowledged within "
                                             f"{self.delivery_timeout_s:g} s")
                raise KafkaTimeoutError(f"{len(unacknowledged)} records not acknowledged in time")
            failed = [f.exception() for f in done if f.exception() is not None]
            if failed:
                if any(spoils_producer(e) for e in failed) or sender_stopped(producer):
                    await self._replace_producer(f"its producer was refused in a way every later batch would be "
                                                 f"too, or its sender stopped ({failed[0]!r})")
                raise failed[0]
        except (KafkaError, asyncio.TimeoutError) as exc:   # the latter: no new producer could start in time
            self.totals.produce_failures += 1
            log.error("otel bridge: produce failed (%s: %s); the batch is retried from its first record",
                      type(exc).__name__, exc)
            for tp, messages in fetched.items():
                try:
                    consumer.seek(tp, messages[0].offset)
                except (IllegalStateError, KafkaError, AssertionError):
                    pass  # revoked meanwhile: its new owner resumes from the last commit
            return False
        await commit(consumer, {tp: messages[-1].offset + 1 for tp, messages in fetched.items()})
        self._merge(batch)
        return True

    def _dead_letter(self, rejection: Rejected, m: Any, now_ms: int) -> tuple[bytes, bytes]:
        """The workers' dead letter for a record. A value too large for the dead-letter topic (only possible when
        the spans topic allows more than Sluice declares for it) is cut to its first ``max_record_bytes``, a key
        to its first MiB, and the detail says so."""
        value, key, cut = m.value, m.key, []
        if key is not None and len(key) > MAX_KEY_BYTES:
            cut.append(f"key cut to its first {MAX_KEY_BYTES} of {len(key)} bytes")
            key = key[:MAX_KEY_BYTES]
        if value is not None and len(value) > self.config.max_record_bytes and \
                (len(value) + 2) // 3 * 4 > self.max_letter_bytes - 2 * MAX_KEY_BYTES:
            cut.append(f"value cut to its first {self.config.max_record_bytes} of {len(value)} bytes")
            value = value[:self.config.max_record_bytes]
        if cut:
            note = f" [{'; '.join(cut)}]"
            rejection = Rejected(rejection.reason, rejection.detail[:1024 - len(note)] + note)
        return dead_letter(rejection, value, key, m.topic, m.partition, m.offset, m.timestamp, now_ms)

    def _merge(self, batch: Totals) -> None:
        t = self.totals
        t.records += batch.records
        t.spans += batch.spans
        t.events += batch.events
        t.dead_letters += batch.dead_letters
        t.rejections += batch.rejections
        for mine, theirs in ((t.skipped, batch.skipped), (t.reasons, batch.reasons)):
            for name, n in theirs.items():
                mine[name] = mine.get(name, 0) + n

    async def serve(self) -> None:
        """``run`` until SIGINT or SIGTERM, then stop cleanly (what is not committed is redelivered)."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(self.run())
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        log.info("otel bridge stopped: %s", orjson.dumps(self.totals.as_dict()).decode())
