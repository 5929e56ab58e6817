"""An idempotent aiokafka producer within bounds: started, awaited and stopped with timeouts, and seen when it
can no longer send.

aiokafka never expires an idempotent producer's batch (it retries until the batch is delivered), retries its
producer id at start for ever, flushes for ever at stop, and keeps queueing records after its background
sender has ended (an out-of-order sequence, an unexpected error), whose futures then never resolve. A
process that publishes from a loop — the router's emitter, the collector, the OpenTelemetry bridge — stopped
silently on any of these. With these helpers it bounds each wait, counts what was lost and replaces the
producer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0      # a start (its producer id included) or a stop (its flush included)
DELIVERY_TIMEOUT_S = 60.0   # a record not acknowledged by then: its producer is not delivering


def sender_task(producer: Any) -> asyncio.Future | None:
    return getattr(getattr(producer, "_sender", None), "sender_task", None)


def sender_stopped(producer: Any) -> bool:
    """Whether the producer's background sender has ended: records sent to it now are never delivered."""
    task = sender_task(producer)
    return task is not None and task.done()


async def start_producer(bootstrap: str, timeout_s: float = START_TIMEOUT_S, **options: Any) -> Any:
    """A started ``AIOKafkaProducer``, or an error within ``timeout_s`` (what it opened is closed)."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **options)
    try:
        await asyncio.wait_for(producer.start(), timeout_s)
    except BaseException:
        await stop_producer(producer, timeout_s)
        raise
    return producer


async def stop_producer(producer: Any, timeout_s: float = START_TIMEOUT_S) -> None:
    """Stop within ``timeout_s``. A producer that cannot deliver never finishes flushing: its sender is then
    cancelled and its connections closed, or it would go on retrying for as long as the process lives."""
    try:
        await asyncio.wait_for(producer.stop(), timeout_s)
    except Exception as exc:
        log.warning("a Kafka producer did not stop cleanly (%s: %.200s); closing it", type(exc).__name__, exc)
        task = sender_task(producer)
        if task is not None:
            task.cancel()
        try:
            await asyncio.wait_for(producer.client.close(), timeout_s)
        except Exception:
            pass
