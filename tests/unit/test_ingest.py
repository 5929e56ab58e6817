"""The pure stage-1 step: rows, dead letters, offsets and the dedup token."""

import orjson

from pipeline.events import RequestEvent
from pipeline.ingest import Record, event_time_text, process_batch
from pipeline.sim.specimens import request_event


def test_batch_splits_into_rows_and_dead_letters_with_offset_ranges():
    good = request_event()
    records = [Record("raw", 0, 10, 1, b"task-1", orjson.dumps(good)),
               Record("raw", 0, 11, 1, b"task-1", b"{oops"),
               Record("raw", 1, 5, 1, None, orjson.dumps(good))]
    out = process_batch(RequestEvent, records, 1 << 20, now_ms=42)
    assert [orjson.loads(r)["event_id"] for r in out.rows] == [good["event_id"]]
    assert orjson.loads(out.rows[0])["event_time"] == event_time_text(good["event_time"])
    assert out.reasons == {"malformed_json": 1, "null_key": 1}
    assert [k for k, _ in out.dead_letters] == [b"raw/0/11", b"raw/1/5"]
    assert out.offsets == {("raw", 0): (10, 11), ("raw", 1): (5, 5)}
    assert out.dedup_token == "request_events:raw/0/10-11,raw/1/5-5"
    assert out.newest_event_ms == good["event_time"]


def test_event_time_text_is_exact_milliseconds():
    assert event_time_text(1_700_158_546_680) == "1700158546.680"
    assert event_time_text(1_700_158_546_005) == "1700158546.005"
