"""The ClickHouse sink: lands a batch durably before stage 1 moves on.

Stage 1 calls ``land`` inside its agent and only then takes the next batch,
so Kafka offsets are committed only after the rows are durable. While the
store is unavailable ``land`` holds the batch and retries with capped
backoff: consumption pauses, memory stays at one batch, nothing is dropped.
"""

from __future__ import annotations

import asyncio
import logging

from .. import metrics
from .store import Store, StoreUnavailable

log = logging.getLogger(__name__)


class ClickHouseSink:
    def __init__(self, store: Store, retry_initial_s: float = 0.1, retry_max_s: float = 5.0) -> None:
        self.store = store
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.held = False

    async def land(self, table: str, rows: list[bytes], dedup_token: str) -> None:
        if not rows:
            return
        payload = b"\n".join(rows)
        delay = self.retry_initial_s
        while True:
            try:
                await asyncio.to_thread(self.store.insert, table, payload, dedup_token)
                break
            except StoreUnavailable as exc:
                if not self.held:
                    log.warning("store unavailable, holding %d rows for %s: %s", len(rows), table, exc)
                self.held = True
                metrics.SINK_HELD.labels(table).set(1)
                metrics.SINK_RETRIES.labels(table).inc()
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
        if self.held:
            log.warning("store available again, landed the held batch for %s", table)
            self.held = False
        metrics.SINK_HELD.labels(table).set(0)
        metrics.SINK_ROWS.labels(table).inc(len(rows))
