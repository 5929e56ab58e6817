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


class PickyStore:
    """Answers queries; refuses inserts holding a poison row with ``error``."""

    backend = "chdb"

    def __init__(self, error):
        self.error, self.inserted = error, []

    def query(self, sql):
        return [{"ok": 1}]

    def insert(self, table, rows, dedup_token=None):
        if b"poison" in rows:
            raise self.error
        self.inserted.append((table, rows))


def test_an_unclassified_error_while_the_store_answers_blames_the_rows_not_the_store():
    from pipeline.sinks.store import StoreRejected

    store = PickyStore(StoreUnavailable("Code: 9999. DB::Exception: something new", known_outage=False))
    sink = ClickHouseSink(store, retry_initial_s=0.001, retry_max_s=0.001, suspect_after=3)

    async def scenario():
        await sink.land("t", [b'{"a":1}'], "ok")
        try:
            await sink.land("t", [b'{"a":"poison"}'], "bad")
        except StoreRejected as exc:
            return str(exc)

    assert "unclassified" in asyncio.run(scenario()) and store.inserted == [("t", b'{"a":1}')]


def test_a_known_outage_holds_even_while_the_store_answers_queries():
    store = PickyStore(StoreUnavailable("Code: 1001. filesystem error: Operation not permitted"))
    sink = ClickHouseSink(store, retry_initial_s=0.001, retry_max_s=0.001, suspect_after=3)

    async def scenario():
        landing = asyncio.ensure_future(sink.land("t", [b'{"a":"poison"}'], "bad"))
        await asyncio.sleep(0.2)
        held = not landing.done() and sink.held
        landing.cancel()
        return held

    assert asyncio.run(scenario()), "held, never dropped"


def test_every_insert_error_met_is_classified():
    from pipeline.sinks.store import StoreRejected, insert_error

    cases = {
        "Code: 27. DB::Exception: Cannot parse input: expected '\"' (CANNOT_PARSE_INPUT_ASSERTION_FAILED)": "data",
        "Code: 252. DB::Exception: Too many partitions for single INSERT block (more than 100). (TOO_MANY_PARTS)":
            "data",
        "Code: 252. DB::Exception: Too many parts (300). Merges are processing significantly slower than inserts":
            "outage",
        "Code: 1001. DB::Exception: filesystem error: in create_directories: Operation not permitted": "outage",
        "Code: 241. DB::Exception: Memory limit (total) exceeded (MEMORY_LIMIT_EXCEEDED)": "outage",
        "Code: 243. DB::Exception: Cannot reserve 1.00 MiB, not enough space. (NOT_ENOUGH_SPACE)": "outage",
        "HTTPDriverException: Error HTTPConnectionPool(host='localhost', port=8123): Connection refused": "outage",
        "Code: 9999. DB::Exception: a code nobody has met": "unclassified",
    }
    for message, expected in cases.items():
        error = insert_error(RuntimeError(message))
        got = ("data" if isinstance(error, StoreRejected) else "outage" if error.known_outage else "unclassified")
        assert got == expected, message


def test_a_batch_of_a_revoked_partition_opens_no_block_for_the_next_owner():
    """A fetch can return records of a partition revoked meanwhile; landing them would race the new owner,
    which lands the same offsets from the store's position."""
    import orjson

    from pipeline import topics
    from pipeline.ingest import Record
    from pipeline.settings import load_settings
    from pipeline.sim.specimens import request_event
    from pipeline.sinks.block_sink import BlockSink
    from pipeline.worker.landing import LandingConsumer
    from tests.agent.test_agents import MemorySink, MemoryTopic

    settings = load_settings(env={}, dev_signing_key=True, max_event_age_s=0, sink_block_age_s=60)
    landing = LandingConsumer(settings, MemoryTopic())
    landing.sink = BlockSink(settings, None, landing._send_dead_letter, sink=MemorySink())
    topic = topics.REQUESTS.name(settings)
    landing.owned = {(topic, 0), (topic, 1)}

    def batch(partition):
        events = [request_event(task_id=f"p{partition}-{i}") for i in range(3)]
        return [Record(topic, partition, i, None, e["task_id"].encode(), orjson.dumps(e)) for i, e in enumerate(events)]

    async def scenario():
        await landing.on_revoked([(topic, 1)])
        await landing.on_fetched({topic: batch(0) + batch(1)})

    asyncio.run(scenario())
    assert set(landing.sink.open_blocks) == {(topic, 0)}


def test_a_stopping_worker_gives_up_instead_of_holding_on_a_closed_store():
    """Holding during shutdown kept a rebalance callback, and so the worker's stop, waiting until SIGKILL."""
    sink = ClickHouseSink(FlakyStore(failures=10**9), retry_initial_s=0.01)
    sink.closing = True

    async def attempt():
        try:
            await asyncio.wait_for(sink.call("resume", sink.store.insert, "t", b"", None), 2)
        except StoreUnavailable:
            return "gave up"

    assert asyncio.run(attempt()) == "gave up"
