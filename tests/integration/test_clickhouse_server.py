"""The server backend through clickhouse-connect: runs whenever CLICKHOUSE_URL is set, says so when not.

Use a database of its own, e.g. CLICKHOUSE_URL=http://127.0.0.1:8123/sluice_test.
"""

import os
import uuid

import orjson
import pytest

from pipeline.events import RequestEvent
from pipeline.ingest import Record
from pipeline.sinks.blocks import process_block
from pipeline.settings import load_settings
from pipeline.sim.specimens import request_event
from pipeline.sinks.migrations import prepare_store
from pipeline.sinks.store import ClickHouseStore, StoreQueryError, StoreUnavailable, open_store

URL = os.environ.get("CLICKHOUSE_URL", "")


def test_a_closed_port_is_an_outage_with_a_clear_error_and_no_password_in_it():
    settings = load_settings(env={}, clickhouse_url="http://127.0.0.1:9/sluice", clickhouse_password="s3cret-pw")
    with pytest.raises(StoreUnavailable) as refused:
        open_store(settings)
    assert "cannot reach ClickHouse server" in str(refused.value) and "s3cret-pw" not in str(refused.value)


@pytest.mark.skipif(not URL, reason="CLICKHOUSE_URL is not set: the ClickHouse server backend test did not run "
                                    "(the same SQL ran on embedded chdb)")
def test_server_backend_runs_the_same_sql_and_lands_exactly_once():
    settings = load_settings(env=dict(os.environ), retention_days=0)
    store = open_store(settings)
    assert isinstance(store, ClickHouseStore) and store.backend == "server"
    try:
        prepare_store(store, settings)
        assert prepare_store(store, settings) == [], "migrations apply once"
        topic = f"server-test-{uuid.uuid4().hex[:8]}"
        events = [request_event(task_id=f"task-{i}", request_id=f"task-{i}-r1", phase="completed") for i in range(5)]
        out = process_block(RequestEvent, [Record(topic, 0, i, None, e["task_id"].encode(), orjson.dumps(e))
                                           for i, e in enumerate(events)], 1 << 20, 0)
        for _ in range(2):
            store.insert(out.table, b"\n".join(out.landed_rows()), out.token(out.table))
        n, = store.query(f"SELECT count() AS n FROM request_events WHERE source_topic = '{topic}'")
        assert n == {"n": 5}
        with pytest.raises(StoreQueryError):
            store.read_only("INSERT INTO gpu_prices (hardware, usd_per_gpu_hour) VALUES ('x', 1)")
        store.read_only("SELECT * FROM cost_per_successful_task LIMIT 1")
    finally:
        store.close()
