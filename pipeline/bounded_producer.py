"""An idempotent aiokafka producer within bounds: started, awaited and stopped with timeouts, and seen when it
can no longer deliver.

aiokafka never expires an idempotent producer's batch (it retries until the batch is delivered), retries its
producer id at start for ever and flushes for ever at stop. A batch the broker refuses with an out-of-order
sequence costs its partition's sequence numbers, so every later batch there is refused the same way; a
sender task that ended leaves what was queued for it undelivered. A process that publishes from a loop —
the router's emitter, the collector, the OpenTelemetry bridge — stopped silently, or refused everything, on
any of these. With these helpers it bounds each wait, counts what may be lost and replaces the producer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0      # a start (its producer id included), and a stop's flush
DELIVERY_TIMEOUT_S = 60.0   # a record not acknowledged by then: its producer is not delivering
CANCEL_ROUNDS = 50          # a cancelled sender awaits its requests in flight: cancelled again, up to this often


def sender_task(producer: Any) -> asyncio.Future | None:
    return getattr(getattr(producer, "_sender", None), "sender_task", None)


def sender_stopped(producer: Any) -> bool:
    """Whether the producer's background sender has ended: nothing queued for it is delivered any more."""
    task = sender_task(producer)
    return task is not None and task.done()


def spoils_producer(exc: BaseException | None) -> bool:
    """A refusal that every later batch of the producer would meet too: it needs a new producer (a new id)."""
    from aiokafka.errors import InvalidProducerEpoch, InvalidProducerIdMapping, OutOfOrderSequenceNumber, ProducerFenced

    return isinstance(exc, (OutOfOrderSequenceNumber, ProducerFenced, InvalidProducerEpoch, InvalidProducerIdMapping))


def abandon(futures: Any) -> None:
    """Record futures given up on: their outcome (most often the failure ``stop_producer`` gives them) is
    retrieved when it comes, so asyncio does not log each as an exception never retrieved."""
    for future in futures:
        future.add_done_callback(lambda f: f.cancelled() or f.exception())


class NotDelivered(Exception):
    """Records the broker did not acknowledge in time (a one-shot publisher fails with it, loudly)."""


async def delivered(futures: list, timeout_s: float | None = None) -> None:
    """Wait for every send's acknowledgement, ``timeout_s`` at most. A refusal is raised as soon as one comes
    (the first in the order sent, of those refused by then); records still unacknowledged at the bound, with
    none refused, raise ``NotDelivered``. Nothing is cancelled: the producer's stop fails what is left."""
    if not futures:
        return
    timeout_s = DELIVERY_TIMEOUT_S if timeout_s is None else timeout_s
    _, waiting = await asyncio.wait(futures, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
    abandon(futures)
    refused = next((f for f in futures if f.done() and not f.cancelled() and f.exception() is not None), None)
    if refused is not None:
        refused.result()
    if waiting:
        raise NotDelivered(f"{len(waiting)} of {len(futures)} records not acknowledged by the broker within "
                           f"{timeout_s:.0f} s")


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


async def stop_producer(producer: Any, timeout_s: float | None = None) -> None:
    """Stop, flushing for ``timeout_s`` at most; then close whatever is left, failing what was not delivered,
    so no task of the producer stays behind retrying for as long as the process lives. Cancelled meanwhile
    (a shutdown), the closing still happens, in the background."""
    timeout_s = START_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        await asyncio.wait_for(producer.stop(), timeout_s)
        return
    except asyncio.CancelledError:
        asyncio.get_running_loop().create_task(_close(producer))
        raise
    except Exception as exc:
        log.warning("a Kafka producer did not stop within %.1f s (%s: %.200s); closing it, its undelivered "
                    "records failed", timeout_s, type(exc).__name__, exc)
    await _close(producer)


async def _close(producer: Any) -> None:
    from aiokafka.errors import KafkaConnectionError

    task = sender_task(producer)
    for _ in range(CANCEL_ROUNDS):   # a second cancel reaches the request the cancelled sender awaits
        if task is None or task.done():
            break
        task.cancel()
        await asyncio.wait([task], timeout=0.1)
    accumulator = getattr(producer, "_message_accumulator", None)
    if accumulator is not None:
        accumulator.fail_all(KafkaConnectionError("the producer was closed with this record undelivered"))
    try:
        await asyncio.wait_for(producer.client.close(), 5.0)
    except Exception:
        pass
