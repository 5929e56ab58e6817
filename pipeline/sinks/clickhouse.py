"""The ClickHouse sink: lands a block durably before stage 1 commits it.

While the store is unavailable every call holds and retries with capped
backoff: stage 1 stops taking batches (at most one fetched batch and one
landing batch in memory), nothing is dropped, and it drains the backlog
when the store answers again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, TypeVar

from .. import metrics
from .store import Store, StoreRejected, StoreUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClickHouseSink:
    def __init__(self, store: Store, retry_initial_s: float = 0.1, retry_max_s: float = 5.0,
                 suspect_after: int = 5) -> None:
        self.store = store
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.suspect_after = suspect_after
        self.held = False
        self.closing = False  # the worker is stopping: give up instead of holding

    async def _answers(self) -> bool:
        try:
            await asyncio.to_thread(self.store.query, "SELECT 1 AS ok")
            return True
        except StoreUnavailable:
            return False

    async def call(self, label: str, fn: Callable[..., T], *args: Any, rows_at_fault: bool = False) -> T:
        """Run a store call in a thread, holding and retrying while the store is unavailable.

        With ``rows_at_fault`` (inserts): an error that is not a known outage, met ``suspect_after``
        times in a row while the store answers a query, is the rows' fault — ``StoreRejected``, so the
        caller splits the block and dead-letters the row it isolates instead of holding forever.
        """
        delay = self.retry_initial_s
        unclassified = 0
        while True:
            try:
                result = await asyncio.to_thread(fn, *args)
                break
            except StoreUnavailable as exc:
                if self.closing:  # a hold would keep a rebalance callback, and so the shutdown, waiting forever
                    raise
                unclassified = 0 if exc.known_outage else unclassified + 1
                if rows_at_fault and unclassified >= self.suspect_after and await self._answers():
                    log.warning("store keeps refusing %s with an unclassified error while it answers queries; "
                                "treating the rows as the cause: %s", label, exc)
                    raise StoreRejected(f"unclassified store error, {unclassified} times: {exc}"[:1024]) from None
                if not self.held:
                    log.warning("store unavailable, holding %s: %s", label, exc)
                self.held = True
                metrics.SINK_HELD.labels(label).set(1)
                metrics.SINK_RETRIES.labels(label).inc()
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
        if self.held:
            log.warning("store available again (%s)", label)
            self.held = False
        metrics.SINK_HELD.labels(label).set(0)
        return result

    async def land(self, table: str, rows: list[bytes], dedup_token: str) -> None:
        if not rows:
            return
        await self.call(table, self.store.insert, table, b"\n".join(rows), dedup_token, rows_at_fault=True)
        metrics.SINK_ROWS.labels(table).inc(len(rows))
