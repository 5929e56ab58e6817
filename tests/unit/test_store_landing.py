"""Landing guarantees that live in the store itself (embedded chdb, the same SQL as a server)."""

import orjson
import pytest

from pipeline.events import RequestEvent
from pipeline.ingest import Record
from pipeline.sinks.blocks import PartitionCursor, cut_blocks, process_block, with_block
from pipeline.sinks import positions, rollup
from pipeline.sinks.migrations import apply_retention, migrate, sync_reference
from pipeline.sinks.store import ClickHouseStore
from pipeline.sim.specimens import request_event


@pytest.fixture
def store(tmp_path):
    store = ClickHouseStore.embedded(tmp_path / "chdb")
    migrate(store)
    yield store
    store.close()


def block(start, n, partition=0, topic="raw", **fields):
    events = [request_event(task_id=f"task-{start + i}", request_id=f"task-{start + i}-r1", **fields) for i in range(n)]
    records = [Record(topic, partition, start + i, None, e["task_id"].encode(), orjson.dumps(e))
               for i, e in enumerate(events)]
    return process_block(RequestEvent, records, 1 << 20, 0)


def land(store, out):
    """As the sink does: the block's dead letters, then its rows, each with the block's token."""
    for table, rows in (("dead_letters", out.landed_dead_letters()), (out.table, out.landed_rows())):
        if rows:
            store.insert(table, b"\n".join(rows), out.token(table))


def roll_up_all(store):
    """As the landing worker does about once a second: each partition's landed offsets since its last rollup."""
    for r in store.query("SELECT source_topic AS t, source_partition AS p, max(source_offset) AS last "
                         "FROM request_events GROUP BY t, p"):
        done = rollup.last_rollups(store, [(r["t"], r["p"])]).get((r["t"], r["p"]))
        ranges = [(r["t"], r["p"], done.last_offset + 1 if done else 0, r["last"])]
        if ranges[0][3] >= ranges[0][2]:
            rollup.roll_up(store, ranges, rollup.token(ranges))


def counts(store):
    roll_up_all(store)
    rows, = store.query("SELECT count() AS n FROM request_events")
    minute, = store.query("SELECT sum(requests) AS n FROM pool_minute")
    return rows["n"], minute["n"]


def test_a_resent_block_is_dropped_by_the_table_and_counted_once_per_minute(store):
    first = block(0, 5, phase="completed")
    land(store, first)
    land(store, first)
    assert counts(store) == (5, 5)


def test_inserts_skip_the_merge_on_insert_and_the_rollup_counts_a_source_offset_once(store):
    """The on-insert merge only drops repeats within one block, which the sink has already dropped;
    it is skipped for speed (store.INSERT_SETTINGS): a repeat that got past the sink waits for a merge
    (or FINAL) in the table. The rollup into pool_minute takes each source offset once (a view, fed the
    block before any merge, counted it twice)."""
    twice = block(0, 1, phase="completed")
    store.insert("request_events", b"\n".join(twice.landed_rows() * 2), "twice")
    raw, = store.query("SELECT count() AS n FROM request_events")
    exact, = store.query("SELECT count() AS n FROM request_events FINAL")
    assert (raw["n"], exact["n"]) == (2, 1)
    assert counts(store)[1] == 1


def test_landed_offsets_and_recent_ids_are_found_per_topic_and_partition(store):
    a, b, other = block(0, 3), block(5, 4), block(0, 2, partition=1)
    for out in (a, b, other):
        land(store, out)
    assert positions.landed_ranges(store, "request_events", "raw", 0, since=0) == [(0, 2), (5, 8)]
    assert positions.landed_ranges(store, "request_events", "raw", 0, since=6) == [(6, 8)]
    assert positions.landed_ranges(store, "request_events", "raw", 0, since=9) == []
    assert positions.landed_ranges(store, "request_events", "other-topic", 0, since=0) == []
    ids = positions.recent_ids(store, "request_events", "raw", 0, limit=5)
    assert ids == [orjson.loads(r)["event_id"] for r in a.rows[2:] + b.rows]


def test_dead_letters_count_as_landed_offsets(store):
    bad = process_block(RequestEvent, [Record("raw", 0, 9, None, b"k", b"{nope")], 1 << 20, 0)
    land(store, bad)
    land(store, block(10, 2))
    assert positions.landed_ranges(store, "request_events", "raw", 0, since=0) == [(9, 11)]


def replay(store, records, since, batch):
    """A new owner after a crash: skip what the store holds from ``since`` on, land the rest in batches."""
    last = positions.last_block(store, "request_events", "raw", 0, since)
    others = positions.landed_ranges(store, "request_events", "raw", 0, last[0], last[0]) if last else []
    cursor = PartitionCursor(positions.landed_ranges(store, "request_events", "raw", 0, since), last, others)
    records = [r for r in records if r.offset >= since]
    for i in range(0, len(records), batch):
        for out in cut_blocks(RequestEvent, records[i:i + batch], cursor, 1 << 20, 0):
            land(store, out)


@pytest.mark.parametrize("since,batch", [(0, 7), (0, 10), (4, 3), (9, 100), (12, 1)])
def test_a_replay_from_any_offset_in_any_batches_lands_each_event_once(store, since, batch):
    """Exactly once without the block boundaries or the deduplication window: a committed offset inside
    a block, before it (retention moved the log start) or after it, and batches unlike the first run's."""
    for table in ("request_events", "pool_minute"):  # the store remembers one token: no help from it
        store.command(f"ALTER TABLE {table} MODIFY SETTING non_replicated_deduplication_window = 1")
    events = [request_event(task_id=f"t-{i}", request_id=f"t-{i}-r1", phase="completed") for i in range(30)]
    records = [Record("raw", 0, i, None, e["task_id"].encode(), orjson.dumps(e)) for i, e in enumerate(events)]
    land(store, process_block(RequestEvent, records[0:10], 1 << 20, 0))
    land(store, process_block(RequestEvent, records[10:20], 1 << 20, 0))
    replay(store, records[since:], since, batch)
    assert counts(store) == (30, 30)


def test_retention_follows_the_setting_and_is_idempotent(store):
    assert "request_events" in apply_retention(store, 7)
    assert apply_retention(store, 7) == []
    ttl, = store.query("SELECT create_table_query AS q FROM system.tables WHERE name = 'request_events'")
    assert "toIntervalDay(7)" in ttl["q"]
    assert set(apply_retention(store, 0)) >= {"request_events", "pool_minute"}
    assert apply_retention(store, 0) == []


def test_reference_data_mirrors_the_settings(store):
    sync_reference(store, {"H100-80GB": 4.0}, {"replica_stale_after_s": 15})
    sync_reference(store, {"H100-80GB": 3.5}, {"replica_stale_after_s": 20})
    assert store.query("SELECT hardware, usd_per_gpu_hour FROM gpu_prices FINAL") == [
        {"hardware": "H100-80GB", "usd_per_gpu_hour": 3.5}]
    assert store.query("SELECT value FROM sluice_config FINAL WHERE name = 'replica_stale_after_s'") == [{"value": 20}]


def test_rows_the_store_cannot_hold_are_refused_as_data_not_as_an_outage(store):
    from pipeline.sinks.store import StoreRejected

    with pytest.raises(StoreRejected):
        store.insert("request_events", b'{"event_id": "not-a-uuid", "event_time": "0000000001.000"}', "t1")


def test_every_example_query_in_the_storage_docs_runs_read_only(store):
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs" / "storage.md"
    examples = re.findall(r"```sql\n(.*?)```", docs.read_text(), flags=re.S)
    assert len(examples) >= 5
    for sql in examples:
        store.read_only(sql)  # through the sandbox: every documented query is allowed


@pytest.mark.parametrize("timestamp", [-1, 2**62, 10**13, -(2**63)])
def test_a_dead_letter_lands_whatever_the_records_timestamp(store, timestamp):
    """A malformed record with a hostile Kafka timestamp once crash-looped the worker: its row was refused."""
    out = process_block(RequestEvent, [Record("raw", 0, 7, timestamp, b"k", b"{oops")], 1 << 20, 0)
    land(store, out)
    row, = store.query("SELECT reason, source_timestamp FROM dead_letters")
    assert row == {"reason": "malformed_json", "source_timestamp": None}


def test_a_block_spread_over_more_days_than_one_insert_may_touch_lands_in_two_halves(store):
    """101 valid events over 101 days: ClickHouse refuses the block (code 252, too many partitions for one
    INSERT block); that once held landing forever, then took 101 inserts (row by row). Now the block is
    halved and every row lands in two inserts."""
    import asyncio

    from pipeline.settings import load_settings
    from pipeline.sinks.block_sink import BlockSink

    day = 86_400_000
    events = [request_event(task_id=f"t{i}", request_id=f"t{i}-r1", event_time=1_700_000_000_000 + i * day)
              for i in range(101)]
    records = [Record("raw", 0, i, None, e["task_id"].encode(), orjson.dumps(e)) for i, e in enumerate(events)]
    letters = []

    async def send(key, value):
        letters.append(value)

    sink = BlockSink(load_settings(env={}, sink_block_age_s=0, max_event_age_s=0), store, send)
    inserts = []
    insert = store.insert

    def counted(table, rows, dedup_token=None):
        inserts.append((table, rows.count(b"\n") + 1))
        insert(table, rows, dedup_token)

    store.insert = counted

    async def scenario():
        sink.add(RequestEvent, records, now_ms=1_700_000_000_000 + 101 * day)
        return await sink.flush()

    assert asyncio.run(scenario()) == {("raw", 0): 101}
    assert counts(store) == (101, 101) and letters == []
    assert [n for table, n in inserts if table == "request_events"] == [101, 50, 51]


@pytest.mark.parametrize("later_s", [0, 120, 3 * 86400])
def test_a_block_cut_between_its_dead_letters_and_its_rows_replays_with_its_first_verdicts(store, later_s):
    """The time bounds read the clock: a block whose dead letters landed before a crash, and whose rows did
    not, was judged again with the restart's clock — an event dead-lettered as ahead then also landed as a
    row, and one valid at first but too old by the restart dead-lettered into an insert the store dropped as
    a repeat, so it was neither. The replay now takes its verdicts from the dead letters in the store: each
    record is exactly one row or one dead letter, as it first landed, however much later the restart is."""
    from pipeline.ingest import TimeBounds

    day = 86_400_000
    now = 1_700_000_000_000
    bounds = TimeBounds(max_ahead_ms=60_000, max_age_ms=7 * day)
    times = [now + 90_000, now - 7 * day + 60_000, now, now + 30_000, now - 7 * day - 1]   # ahead, nearly too old, ...
    events = [request_event(task_id=f"t-{i}", request_id=f"t-{i}-r1", phase="completed", event_time=t)
              for i, t in enumerate(times)]
    records = [Record("raw", 0, i, None, e["task_id"].encode(), orjson.dumps(e)) for i, e in enumerate(events)]
    first = process_block(RequestEvent, records, 1 << 20, now, bounds=bounds)
    assert sorted(first.reasons.items()) == [("event_time_ahead", 1), ("event_time_too_old", 1)]
    store.insert("dead_letters", b"\n".join(first.landed_dead_letters()), first.token("dead_letters"))
    # the crash: no rows, no commit; a new owner resumes from offset 0, a while later
    last = positions.last_block(store, "request_events", "raw", 0, 0)
    verdicts, refused, held = positions.replay_verdicts(store, "request_events", "raw", 0, last)
    assert not held and last == (0, 4) and verdicts == {0: ("event_time_ahead", now), 4: ("event_time_too_old", now)}
    assert refused == {}
    cursor = PartitionCursor(positions.landed_ranges(store, "request_events", "raw", 0, 0), last, [], verdicts)
    (again,) = cut_blocks(RequestEvent, records, cursor, 1 << 20, now + later_s * 1000, bounds=bounds)
    assert again.token("request_events") == first.token("request_events")
    land(store, again)
    rows = {r["task_id"] for r in store.query("SELECT task_id FROM request_events")}
    letters = [r["source_offset"] for r in store.query("SELECT source_offset FROM dead_letters")]
    assert rows == {"t-1", "t-2", "t-3"} and sorted(letters) == [0, 4]
    # without the verdicts (as before), a restart three days on lands the early event as a row beside its
    # dead letter, and loses the one that was nearly too old
    if later_s == 3 * 86400:
        blind = PartitionCursor([], last, [])
        (judged,) = cut_blocks(RequestEvent, records, blind, 1 << 20, now + later_s * 1000, bounds=bounds)
        assert [r.offset for r in judged.sources] == [0, 2, 3]


@pytest.mark.parametrize("rows_landed", [False, True])
@pytest.mark.parametrize("first_max,restart_max", [(600, 1 << 20), (1 << 20, 600)])
def test_a_replay_keeps_every_verdict_when_the_limits_changed_with_the_restart(store, first_max, restart_max,
                                                                              rows_landed):
    """Not only the time bounds: a record dead-lettered as oversize at first and valid with the restart's
    limit landed as a row beside its dead letter; one taken at first and oversize now was dead-lettered into
    the block's repeated insert, which the store dropped (in neither). Found in review."""
    events = [request_event(task_id=f"t-{i}", request_id=f"t-{i}-r1", phase="completed") for i in range(3)]
    records = [Record("raw", 0, i, None, e["task_id"].encode(), orjson.dumps(e) + (b" " * 500 if i == 1 else b""))
               for i, e in enumerate(events)] + [Record("raw", 0, 3, None, b"k", b"{nope")]
    first = process_block(RequestEvent, records, first_max, 0)
    store.insert("dead_letters", b"\n".join(first.landed_dead_letters()), first.token("dead_letters"))
    if rows_landed:   # the crash after the rows too, before the commit (the common one)
        store.insert("request_events", b"\n".join(first.landed_rows()), first.token("request_events"))
    last = positions.last_block(store, "request_events", "raw", 0, 0)
    verdicts, refused, held = positions.replay_verdicts(store, "request_events", "raw", 0, last)
    assert held == rows_landed
    cursor = PartitionCursor(positions.landed_ranges(store, "request_events", "raw", 0, 0), last, [], verdicts,
                             refused, held)
    (again,) = cut_blocks(RequestEvent, records, cursor, restart_max, 0)
    land(store, again)
    if again.redecided_rows and not again.rows_held:   # as the sink lands them: under a token of their own
        store.insert("dead_letters", b"\n".join(again.landed_redecided()), again.token("dead_letters") + "#redecided")
    rows = {r["source_offset"] for r in store.query("SELECT source_offset FROM request_events")}
    letters = [r["source_offset"] for r in store.query("SELECT source_offset FROM dead_letters")]
    assert sorted(rows) == ([0, 1, 2] if rows_landed and first_max > restart_max else [0, 2]), \
        "offset 1: a row if its first landing took it and its rows landed, else a dead letter"
    assert sorted(rows | set(letters)) == [0, 1, 2, 3] and not rows & set(letters) and len(letters) == len(set(letters))


def test_a_row_the_store_refused_keeps_its_dead_letters_first_time_when_replayed_a_day_later(store, monkeypatch):
    """The landing path dead-letters a row the store refuses (``store_rejected``) with the clock's time; a
    replay a day later wrote that dead letter again, into the next day's partition, where neither the
    token nor a merge drops it. Found in review."""
    import asyncio
    import time as real_time
    import types

    from pipeline.settings import load_settings
    from pipeline.sinks import block_sink
    from pipeline.sinks.block_sink import BlockSink
    from pipeline.sinks.store import StoreRejected

    inserted = store.insert

    def insert(table, rows, token=None):
        if table == "request_events" and b'"task_id":"t-2"' in rows:
            raise StoreRejected("Cannot parse input: a poisoned row (simulated)")
        return inserted(table, rows, token)

    monkeypatch.setattr(store, "insert", insert)
    first = float(int(real_time.time()) // 86400 * 86400 - 3600)   # 23:00 UTC yesterday
    clock = {"now": first}
    monkeypatch.setattr(block_sink, "time", types.SimpleNamespace(
        time=lambda: clock["now"], monotonic=real_time.monotonic, perf_counter=real_time.perf_counter))
    events = [request_event(task_id=f"t-{i}", request_id=f"t-{i}-r1", phase="completed",
                            event_time=int(first * 1000)) for i in range(5)]
    records = [Record("raw", 0, i, None, e["task_id"].encode(), orjson.dumps(e)) for i, e in enumerate(events)]
    settings = load_settings(env={}, sink_block_age_s=0, max_event_age_s=0)

    async def send(key, value):
        pass

    async def land_from_zero(later_s):   # a new owner each time, resuming from offset 0 (no commit landed)
        clock["now"] = first + later_s
        sink = BlockSink(settings, store, send)
        await sink.resume(RequestEvent, "raw", 0, 0)
        sink.add(RequestEvent, records, int(clock["now"] * 1000))
        return await sink.flush()

    asyncio.run(land_from_zero(0))
    asyncio.run(land_from_zero(86_400))
    letters = store.query("SELECT source_offset, reason, _partition_id AS day FROM dead_letters")
    assert [(r["source_offset"], r["reason"]) for r in letters] == [(2, "store_rejected")], letters
    rows, = store.query("SELECT count() AS n FROM request_events")
    assert rows["n"] == 4
