"""Publish generated events to Kafka, paced in real time or as fast as the broker takes them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import orjson

from .. import topics
from ..bounded_producer import abandon, delivered, start_producer, stop_producer
from ..kafka_clients import producer_options
from ..settings import Settings
from .replay import Emitted


@dataclass
class Produced:
    requests: int = 0
    replicas: int = 0
    bad: int = 0
    bad_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.requests + self.replicas + self.bad


async def start_publisher(settings: Settings, bootstrap: str):
    """A started producer for the raw topics, within ``bounded_producer``'s start bound: a broker that does not
    answer fails the run in 30 s instead of holding it for ever."""
    return await start_producer(bootstrap, linger_ms=20, max_batch_size=262144,
                                max_request_size=topics.raw_topic_max_bytes(settings) + 65536,
                                **producer_options(settings))


async def produce(settings: Settings, bootstrap: str, emitted: Iterable[Emitted], paced: bool,
                  bad: Iterable[tuple[str, bytes | None, bytes | None]] = (),
                  progress: Callable[[float], None] | None = None, stamp: bool = False) -> Produced:
    """Send every event (and the given bad records, spread through the stream) and wait for delivery.

    A batch the broker does not acknowledge within ``bounded_producer.DELIVERY_TIMEOUT_S`` fails the run
    (``NotDelivered``): an idempotent producer never gives up on a batch, so the wait is bounded here.

    ``bad`` is (expected reason, value, key) for the raw requests topic. With ``stamp`` each event's
    ``event_time`` is the moment it is sent, as live routers do: a producer that falls behind its
    schedule then sends fewer events per second, not old ones, so lag measured downstream is the
    pipeline's own.
    """
    requests_topic = topics.REQUESTS.name(settings)
    replicas_topic = topics.REPLICAS.name(settings)
    counts = Produced()
    bad = list(bad)
    producer = await start_publisher(settings, bootstrap)
    pending = []
    try:
        start = time.monotonic()
        for n, item in enumerate(emitted):
            if paced:
                ahead = start + item.at_s - time.monotonic()
                if ahead > 0.005:
                    await asyncio.sleep(ahead)
                if progress:
                    progress(item.at_s)
            topic = requests_topic if item.kind == "request" else replicas_topic
            event = {**item.event, "event_time": int(time.time() * 1000)} if stamp else item.event
            pending.append(await producer.send(topic, orjson.dumps(event), key=item.key.encode()))
            if item.kind == "request":
                counts.requests += 1
            else:
                counts.replicas += 1
            if bad and n % 7 == 3:
                reason, value, key = bad.pop()
                pending.append(await producer.send(requests_topic, value, key=key))
                counts.bad += 1
                counts.bad_reasons[reason] = counts.bad_reasons.get(reason, 0) + 1
            if len(pending) >= 5000:
                await delivered(pending)
                pending.clear()
        for reason, value, key in bad:
            pending.append(await producer.send(requests_topic, value, key=key))
            counts.bad += 1
            counts.bad_reasons[reason] = counts.bad_reasons.get(reason, 0) + 1
        await delivered(pending)
    finally:
        abandon(pending)
        await stop_producer(producer)
    return counts
