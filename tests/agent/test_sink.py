"""The ClickHouse sink holds a batch while the store is unavailable and lands it once when it returns."""

import asyncio

from pipeline import metrics
from pipeline.sinks.clickhouse import ClickHouseSink
from pipeline.sinks.store import StoreUnavailable


class FlakyStore:
    backend = "chdb"

    def __init__(self, failures: int):
        self.failures = failures
        self.inserted: list[tuple[str, bytes, str]] = []

    def insert(self, table, rows, dedup_token=None):
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("connection refused")
        self.inserted.append((table, rows, dedup_token))


def test_unavailable_store_holds_then_lands_once():
    store = FlakyStore(failures=4)
    sink = ClickHouseSink(store, retry_initial_s=0.001, retry_max_s=0.004)
    retries_before = metrics.SINK_RETRIES.labels("t")._value.get()
    observed = []

    async def scenario():
        landing = asyncio.ensure_future(sink.land("t", [b'{"a":1}', b'{"a":2}'], "tok"))
        while not landing.done():
            observed.append(sink.held)
            await asyncio.sleep(0.001)
        await landing

    asyncio.run(scenario())
    assert store.inserted == [("t", b'{"a":1}\n{"a":2}', "tok")], "landed once, whole, with its token"
    assert True in observed and sink.held is False
    assert metrics.SINK_RETRIES.labels("t")._value.get() - retries_before == 4
