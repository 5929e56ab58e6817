"""pool_minute rolled up from landed request events, exactly once (embedded chdb, the same SQL as a server)."""

import asyncio
import shutil

import orjson
import pytest

from pipeline import metrics
from pipeline.events import RequestEvent
from pipeline.ingest import Record
from pipeline.settings import load_settings
from pipeline.sim.specimens import request_event
from pipeline.sinks import rollup
from pipeline.sinks.block_sink import BlockSink
from pipeline.sinks.blocks import process_block
from pipeline.sinks.clickhouse import ClickHouseSink
from pipeline.sinks.migrations import SQL_DIR, migrate
from pipeline.sinks.store import ClickHouseStore, StoreUnavailable

DAY_MS = 86_400_000
JAN_31 = 1_769_817_600_000   # 2026-01-31 00:00 UTC: the events run into February, so a rollup writes two parts
NOW_MS = JAN_31 + 10 * DAY_MS   # the landing clock: no event ahead of it
PHASES = ("completed", "completed", "failed", "rejected", "cancelled", "first_token")
MINUTE = ("SELECT pool, priority, minute, sum(requests) AS requests, sum(completed) AS completed, "
          "sum(failed) AS failed, sum(rejected) AS rejected, sum(cancelled) AS cancelled, sum(retries) AS retries, "
          "sum(ttft_slo_met) AS ttft_met, sum(input_tokens) AS input_tokens, sum(output_tokens) AS output_tokens, "
          "quantilesBFloat16Merge(0.5, 0.99)(ttft_state) AS ttft "
          "FROM pool_minute GROUP BY pool, priority, minute ORDER BY pool, priority, minute")
DIRECT = ("SELECT pool, priority, toStartOfMinute(event_time) AS minute, count() AS requests, "
          "countIf(phase = 'completed') AS completed, countIf(phase = 'failed') AS failed, "
          "countIf(phase = 'rejected') AS rejected, countIf(phase = 'cancelled') AS cancelled, "
          "countIf(attempt > 1) AS retries, "
          "countIf(phase = 'completed' AND (slo_ttft_s IS NULL OR ttft_s <= slo_ttft_s)) AS ttft_met, "
          "sum(toUInt64(ifNull(input_tokens, 0))) AS input_tokens, sum(toUInt64(ifNull(output_tokens, 0))) "
          "AS output_tokens, quantilesBFloat16If(0.5, 0.99)(ifNull(ttft_s, 0), phase = 'completed' AND ttft_s "
          "IS NOT NULL) AS ttft FROM request_events FINAL WHERE phase IN ('completed', 'failed', 'rejected', "
          "'cancelled') GROUP BY pool, priority, minute ORDER BY pool, priority, minute")


@pytest.fixture
def store(tmp_path):
    store = ClickHouseStore.embedded(tmp_path / "chdb")
    migrate(store)
    yield store
    store.close()


def records(first, n, partition=0, topic="raw"):
    """Request events of two pools, four classes and several phases, an hour apart from Jan 31 on."""
    out = []
    for i in range(first, first + n):
        event = request_event(task_id=f"t-{i}", request_id=f"t-{i}-r1", phase=PHASES[i % len(PHASES)],
                              pool=("pool-a", "pool-b")[i % 2], attempt=1 + i % 3, ttft_s=0.05 * (i % 40),
                              event_time=JAN_31 + i * 3_600_000 // 4)
        out.append(Record(topic, partition, i, None, event["task_id"].encode(), orjson.dumps(event)))
    return out


def land(store, recs):
    block = process_block(RequestEvent, recs, 1 << 20, 0)
    store.insert("request_events", b"\n".join(block.landed_rows()), block.token("request_events"))


def test_a_rollup_holds_what_its_rows_add_up_to_across_months_and_counts_once_however_often_it_runs(store):
    recs = records(0, 240)   # 60 hours from Jan 31: two months
    land(store, recs[:100])
    land(store, recs[100:])
    first = rollup.roll_up(store, [("raw", 0, 0, 149)])
    assert rollup.roll_up(store, [("raw", 0, 0, 149)]) == first   # run again: the token drops it
    rollup.roll_up(store, [("raw", 0, 150, 239)])
    rollup.roll_up(store, [("raw", 0, 240, 239)])   # an empty range is no rollup
    got = store.query(MINUTE)
    assert got == store.query(DIRECT)
    assert {row["minute"][:7] for row in got} == {"2026-01", "2026-02"}
    assert rollup.last_rollup(store, "raw", 0)[0] == 239


def test_a_rollup_cut_by_a_crash_is_finished_by_the_partitions_next_owner_and_only_once(store, monkeypatch):
    land(store, records(0, 120))
    land(store, records(0, 30, partition=1))
    command = store.command

    def crash(sql):
        if sql.startswith("INSERT INTO pool_minute"):
            raise SystemExit("the worker died between the rollup's record and its insert")
        command(sql)

    monkeypatch.setattr(store, "command", crash)
    with pytest.raises(SystemExit):
        rollup.roll_up(store, [("raw", 0, 0, 119), ("raw", 1, 0, 29)])
    monkeypatch.setattr(store, "command", command)
    assert store.query("SELECT count() AS n FROM pool_minute") == [{"n": 0}]
    # partition 1's new owner runs the cut rollup again, then partition 0's: it lands once, whole
    assert rollup.resume(store, "raw", 1) == 29
    assert rollup.resume(store, "raw", 0) == 119
    assert store.query(MINUTE) == store.query(DIRECT)


def test_each_source_offset_counts_once_though_landed_twice(store):
    """A block landed again under other boundaries (no token to drop it) leaves two rows of an offset until
    a merge; the rollup takes each offset once."""
    recs = records(0, 60)
    land(store, recs[:40])
    land(store, recs[20:])
    rollup.roll_up(store, [("raw", 0, 0, 59)])
    assert store.query(MINUTE) == store.query(DIRECT)


def test_a_store_migrated_from_the_view_keeps_its_counts_and_rolls_up_what_lands_after(tmp_path):
    older = tmp_path / "sql-004"
    older.mkdir()
    for path in SQL_DIR.glob("00[1-4]_*.sql"):
        shutil.copy(path, older)
    old = ClickHouseStore.embedded(tmp_path / "old")
    try:
        migrate(old, older)
        land(old, records(0, 90))      # counted by pool_minute_mv as it lands
        land(old, records(0, 12, partition=3))
        by_view = old.query(MINUTE)
        assert by_view == old.query(DIRECT)
        assert migrate(old) == ["005_pool_minute_rolled_up"]
        assert old.query("SELECT name FROM system.tables WHERE name = 'pool_minute_mv'") == []
        assert old.query(MINUTE) == by_view
        assert rollup.resume(old, "raw", 0) == 89 and rollup.resume(old, "raw", 3) == 11
        assert rollup.resume(old, "raw", 7) == -1   # a partition with nothing landed starts at offset 0
        land(old, records(90, 60))
        rollup.roll_up(old, [("raw", 0, 90, 149)])
        assert old.query(MINUTE) == old.query(DIRECT)
    finally:
        old.close()


def sink_for(store, **settings):
    async def send(key, value):
        pass

    return BlockSink(load_settings(env={}, sink_block_age_s=0, max_event_age_s=0, **settings), store, send,
                     ClickHouseSink(store, retry_initial_s=0.001, retry_max_s=0.01))


def test_the_landing_sink_rolls_up_what_it_lands_and_its_next_owner_goes_on_from_there(store):
    async def scenario():
        sink = sink_for(store, sink_rollup_interval_s=0)
        await sink.resume(RequestEvent, "raw", 0, 0)
        sink.add(RequestEvent, records(0, 50), NOW_MS)
        assert await sink.flush() == {("raw", 0): 50}
        assert store.query(MINUTE) == store.query(DIRECT)
        assert sum(row["requests"] for row in store.query(MINUTE)) == 42   # 50 minus the first-token events
        # the next owner, after a crash before the commit: it replays offsets 40-79 and lands 50-79
        sink = sink_for(store, sink_rollup_interval_s=60)
        await sink.resume(RequestEvent, "raw", 0, 40)
        sink.add(RequestEvent, records(40, 40), NOW_MS)
        await sink.flush()
        assert rollup.last_rollup(store, "raw", 0)[0] == 49, "not due for a minute"
        await sink.flush([("raw", 0)])   # a revocation: handed over rolled up
        assert rollup.last_rollup(store, "raw", 0)[0] == 79
        assert store.query(MINUTE) == store.query(DIRECT)

    asyncio.run(scenario())


def test_a_rollup_the_store_keeps_refusing_does_not_stop_landing_and_is_taken_up_again(store, monkeypatch):
    command = store.command
    refusing = {"on": True}

    def refuse(sql):
        if refusing["on"] and sql.startswith("INSERT INTO pool_minute"):
            raise StoreUnavailable("Code: 47. DB::Exception: Unknown identifier (simulated)", known_outage=False)
        command(sql)

    monkeypatch.setattr(store, "command", refuse)
    failed = metrics.ROLLUPS.labels("failed")._value.get()

    async def scenario():
        sink = sink_for(store, sink_rollup_interval_s=0)
        sink.add(RequestEvent, records(0, 30), NOW_MS)
        assert await sink.flush() == {("raw", 0): 30}
        assert metrics.ROLLUPS.labels("failed")._value.get() == failed + 1
        assert rollup.last_rollup(store, "raw", 0)[0] == 29   # recorded, not inserted: the next one runs it
        refusing["on"] = False
        sink.add(RequestEvent, records(30, 30), NOW_MS)
        assert await sink.flush() == {("raw", 0): 60}

    asyncio.run(scenario())
    assert store.query("SELECT count() AS n FROM request_events") == [{"n": 60}]
    assert store.query(MINUTE) == store.query(DIRECT)
    assert sum(row["requests"] for row in store.query(MINUTE)) == 50
