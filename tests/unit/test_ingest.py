"""The pure steps of both paths: decoding, dead letters, duplicates, landing blocks, rows and replay cuts."""

import orjson
import pytest
from hypothesis import given, strategies as st

from pipeline.events import AdmissionSignal, RequestEvent
from pipeline.ingest import RecentIdGenerations, RecentIds, Record, TimeBounds, by_partition, decode_records
from pipeline.load.partial import PartialBuilder
from pipeline.sinks.blocks import PartitionCursor, event_time_text, process_block
from pipeline.sim.specimens import request_event


def test_block_splits_into_rows_and_dead_letters_carrying_position_and_token():
    good = request_event()
    records = [Record("raw", 3, 10, 1, b"task-1", orjson.dumps(good)),
               Record("raw", 3, 11, 1_700_000_000_123, b"task-1", b"{oops"),
               Record("raw", 3, 12, 1, None, orjson.dumps(good))]
    out = process_block(RequestEvent, records, 1 << 20, now_ms=42)
    assert b"block_start" not in out.rows[0], "known only when the block is complete"
    row, = [orjson.loads(r) for r in out.landed_rows()]
    assert row["event_id"] == good["event_id"] and row["event_time"] == event_time_text(good["event_time"])
    assert (row["source_topic"], row["source_partition"], row["source_offset"]) == ("raw", 3, 10)
    assert (row["block_start"], row["block_end"]) == (10, 12)
    assert out.reasons == {"malformed_json": 1, "null_key": 1}
    decoded = decode_records(RequestEvent, records, 1 << 20, now_ms=42)
    assert [key for _, key, _ in decoded.dead_letters] == [b"raw/3/11", b"raw/3/12"]
    letters = [orjson.loads(r) for r in out.landed_dead_letters()]
    assert [(d["source_offset"], d["block_start"], d["block_end"]) for d in letters] == [(11, 10, 12), (12, 10, 12)]
    assert letters[0]["source_timestamp"] == "1700000000.123" and "schema_version" not in letters[0]
    assert out.token("request_events") == "request_events:raw/3/10-12"
    assert out.token("dead_letters") == "dead_letters:raw/3/10-12"
    assert out.next_offset == 13 and out.newest_event_ms == out.oldest_event_ms == good["event_time"]


def test_a_recently_seen_event_id_is_dropped_as_a_duplicate():
    event = request_event()
    seen = RecentIds(10)
    first = process_block(RequestEvent, [Record("raw", 0, 0, 1, b"task-1", orjson.dumps(event))], 1 << 20, 0, seen)
    again = process_block(RequestEvent, [Record("raw", 0, 1, 1, b"task-1", orjson.dumps(event)),
                                         Record("raw", 0, 2, 1, b"task-1", orjson.dumps(event))], 1 << 20, 0, seen)
    assert len(first.rows) == 1 and again.rows == [] and again.duplicates == 2


def test_recent_ids_forget_the_oldest_beyond_capacity():
    ids = RecentIds(2, ["a", "b"])
    ids.add("c")
    assert "a" not in ids and "b" in ids and "c" in ids and len(ids) == 2


@given(st.lists(st.lists(st.integers(0, 40), max_size=12), max_size=30), st.integers(1, 8))
def test_the_control_paths_id_generations_remember_the_last_capacity_and_never_past_twice(batches, capacity):
    """Against a brute-force history: an id among the last ``capacity`` first sightings is always a repeat,
    one not in the last 2 × capacity + the largest batch never is; in between either. Batches with and without
    repeats take the two ways through ``first_times``."""
    window, firsts, biggest = RecentIdGenerations(capacity), [], 0
    for batch in batches:
        ids = [f"id-{i}" for i in batch]
        biggest = max(biggest, len(ids))
        fresh = window.first_times(ids)
        fresh = [True] * len(ids) if fresh is None else fresh
        for event_id, new in zip(ids, fresh):
            if event_id in firsts[-capacity:]:
                assert not new, (event_id, firsts[-capacity:])
            elif event_id not in firsts[-(2 * capacity + biggest):]:
                assert new, event_id
            if new:
                firsts.append(event_id)
        assert len(window) <= 2 * capacity + biggest


def test_duplicates_within_a_batch_and_against_the_window_are_dropped_in_order():
    events = [request_event(task_id=f"t{i}", request_id=f"t{i}-r1", event_time=1_000 + i) for i in range(4)]
    again = [events[1], events[3]]

    def records(docs, start):
        return [Record("raw", 0, start + i, 1, d["task_id"].encode(), orjson.dumps(d)) for i, d in enumerate(docs)]

    for window in (RecentIds(10), RecentIdGenerations(10)):
        first = decode_records(RequestEvent, records(events + again, 0), 1 << 20, 0, window)
        assert [s.offset for s in first.sources] == [0, 1, 2, 3] and first.duplicates == 2
        assert (first.oldest_event_ms, first.newest_event_ms) == (1_000, 1_003)
        later = decode_records(RequestEvent, records(again + [request_event(event_time=5)], 6), 1 << 20, 0, window)
        assert [s.offset for s in later.sources] == [8] and later.duplicates == 2
        assert later.oldest_event_ms == later.newest_event_ms == 5


@given(st.lists(st.integers(0, 3), max_size=40))
def test_records_by_partition_keep_each_partitions_order_however_the_runs_interleave(partitions):
    records = [Record("raw", p, i, None, b"k", b"v") for i, p in enumerate(partitions)]
    grouped = by_partition(records)
    assert sorted(grouped) == sorted(set(partitions))
    for p, recs in grouped.items():
        assert recs == [r for r in records if r.partition == p]


def test_a_fast_path_that_raises_costs_its_record_a_dead_letter_not_the_batch(monkeypatch):
    import base64

    import pipeline.events as events

    good, bad = request_event(task_id="t-good"), request_event(task_id="t-bad")
    real = events.ACCEPT[RequestEvent]

    def broken(value, key):
        if key == b"t-bad":
            raise AttributeError("a bug in the generated code")
        return real(value, key)

    monkeypatch.setitem(events.ACCEPT, RequestEvent, broken)
    records = [Record("raw", 0, i, 1, d["task_id"].encode(), orjson.dumps(d)) for i, d in enumerate((bad, good))]
    decoded = decode_records(RequestEvent, records, 1 << 20, 0)
    assert [e.task_id for e in decoded.events] == ["t-good"] and decoded.reasons == {"malformed_json": 1}
    (rec, _, letter), = decoded.dead_letters
    assert rec.offset == 0 and orjson.loads(letter)["value_b64"] == base64.b64encode(rec.value).decode()


def test_admission_signals_land_as_rows():
    from pipeline.admission.signing import sign
    from tests.unit.test_signing import example_signal

    doc = example_signal()
    out = process_block(AdmissionSignal, [Record("adm", 0, 7, 1, doc["pool"].encode(), sign(doc, "k1", b"s" * 32))],
                        1 << 20, 0)
    row, = [orjson.loads(r) for r in out.rows]
    assert out.table == "admission_signals" and row["pool"] == doc["pool"] and row["key_id"] == "k1"
    assert row["admit_critical"] == doc["admit_fraction"]["critical"]
    assert row["valid_until"] == event_time_text(doc["valid_until"]) and orjson.loads(row["signal"])["seq"] == doc["seq"]


def recs(offsets):
    return [Record("t", 0, o, None, b"k", b"v") for o in offsets]


def offsets_of(kept):
    return [r.offset for r in kept]


def test_cursor_without_landed_offsets_keeps_what_arrived():
    assert offsets_of(PartitionCursor().unlanded(recs([5, 6, 7]))) == [5, 6, 7]


def test_cursor_drops_offsets_the_store_holds_whatever_the_block_boundaries():
    cursor = PartitionCursor([(10, 12), (14, 14)])
    assert offsets_of(cursor.unlanded(recs([11, 12]))) == []
    assert offsets_of(cursor.unlanded(recs([13, 14, 15]))) == [13, 15]
    assert offsets_of(cursor.unlanded(recs([16, 17]))) == [16, 17]
    assert cursor.skipped == 3 and cursor.landed == []


def test_a_block_of_only_landed_records_still_moves_the_commit():
    from pipeline.sinks.blocks import cut_blocks

    (out,) = cut_blocks(RequestEvent, recs([5, 6, 7]), PartitionCursor([(0, 9)]), 1 << 20, 0)
    assert (out.start, out.end, out.next_offset, out.rows, out.dead_letter_rows) == (5, 7, 8, [], [])


def test_the_last_block_is_replayed_whole_on_its_old_boundaries_and_the_rest_skipped():
    """A crash can cut the last block's insert between its table and the per-minute view: only the same
    insert again (same boundaries, same token) repairs the view."""
    cursor = PartitionCursor([(3, 9)], replay=(10, 14))
    assert cursor.cut(recs([5, 6, 7, 8, 9, 10, 11])) == [(recs([5, 6, 7, 8, 9]), False)]
    runs = cursor.cut(recs([12, 13, 14, 15]))
    assert [([r.offset for r in run], sealed) for run, sealed in runs] == [([10, 11, 12, 13, 14], True), ([15], False)]
    assert cursor.replay is None


def test_a_replay_whose_start_is_gone_falls_back_to_skipping():
    cursor = PartitionCursor([(3, 14)], replay=(10, 14))
    assert [([r.offset for r in run], sealed) for run, sealed in cursor.cut(recs([12, 13, 14, 15]))] == [
        ([12, 13, 14, 15], False)]
    assert cursor.replay is None


@given(st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=10),
       st.lists(st.tuples(st.integers(0, 60), st.integers(0, 5)), max_size=6))
def test_cursor_keeps_exactly_the_offsets_not_landed_however_kafka_batches_them(sizes, spans):
    covered = sorted({o for first, length in spans for o in range(first, first + length + 1)})
    runs = []
    for o in covered:
        if runs and runs[-1][1] == o - 1:
            runs[-1] = (runs[-1][0], o)
        else:
            runs.append((o, o))
    offsets, cursor, kept, i = list(range(0, 70)), PartitionCursor(runs), [], 0
    while i < len(offsets):
        for size in sizes:
            kept += offsets_of(cursor.unlanded(recs(offsets[i:i + size])))
            i += size
    assert kept == [o for o in offsets if o not in set(covered)]
    assert cursor.skipped == len([o for o in covered if o < 70])


def test_a_block_with_holes_names_its_records_in_its_token():
    from pipeline.sinks.blocks import BlockOutcome
    from array import array

    whole = BlockOutcome("t", "raw", 0, 10, 20, offsets=array("q", range(10, 21)))
    holed = BlockOutcome("t", "raw", 0, 10, 20, holes=True, offsets=array("q", [10, 20]))
    assert whole.token("t") == "t:raw/0/10-20" and holed.token("t").startswith("t:raw/0/10-20~")
    assert holed.token("t") != BlockOutcome("t", "raw", 0, 10, 20, holes=True, offsets=array("q", [10, 15, 20])).token("t")


def test_event_time_text_is_exact_milliseconds():
    assert event_time_text(1_700_158_546_680) == "1700158546.680"
    assert event_time_text(1_700_158_546_005) == "1700158546.005"
    assert event_time_text(5_123) == "0000000005.123" and event_time_text(0) == "0000000000.000"


def test_an_event_id_resent_in_upper_case_is_the_same_event():
    event = request_event()
    shouted = dict(event, event_id=event["event_id"].upper())
    records = [Record("raw", 0, i, 1, b"task-1", orjson.dumps(e)) for i, e in enumerate((event, shouted))]
    decoded = decode_records(RequestEvent, records, 1 << 20, 0, RecentIds(10))
    assert [e.event_id for e in decoded.events] == [event["event_id"].lower()] and decoded.duplicates == 1


@pytest.mark.parametrize("ahead_s", [3600, 365 * 86400, 75 * 365 * 86400])
def test_an_event_ahead_of_the_workers_clock_is_dead_lettered(ahead_s):
    now = 1_700_000_000_000  # 75 years on is still inside the schema's range (before 2100)
    bounds = TimeBounds(max_ahead_ms=60_000, max_age_ms=7 * 86_400_000)
    events = [request_event(event_time=now + ahead_s * 1000), request_event(event_time=now - 8 * 86_400_000),
              request_event(event_time=now + 30_000), request_event(event_time=now - 86_400_000)]
    records = [Record("raw", 0, i, 1, b"task-1", orjson.dumps(e)) for i, e in enumerate(events)]
    decoded = decode_records(RequestEvent, records, 1 << 20, now, bounds=bounds)
    assert [e.event_time for e in decoded.events] == [now + 30_000, now - 86_400_000]
    assert decoded.reasons == {"event_time_ahead": 1, "event_time_too_old": 1}


def test_events_ahead_of_the_workers_clock_but_within_the_skew_are_folded_as_of_now():
    """A source whose clock runs 45 s fast (inside max_clock_skew_s) must not carry a pool's watermark past
    the allowed lateness of every other source: the control path takes its events as happening now."""
    now = 1_700_000_000_000
    events = [request_event(event_time=now + 45_000), request_event(event_time=now - 250),
              request_event(event_time=now)]
    records = [Record("raw", 0, i, 1, b"task-1", orjson.dumps(e)) for i, e in enumerate(events)]
    decoded = decode_records(RequestEvent, records, 1 << 20, now, bounds=TimeBounds(max_ahead_ms=60_000))
    assert decoded.newest_event_ms == now + 45_000, "the metric still shows the source's own clock"
    builder = PartialBuilder("raw/0", 15)
    assert [builder.fold_request(e, not_after_ms=now) for e in decoded.events] == [True, False, False]
    assert [e.event_time for e in decoded.events] == [now, now - 250, now]
    (partial,) = builder.drain(1)
    assert partial.newest_ms == now and max(partial.requests) == now // 1000
