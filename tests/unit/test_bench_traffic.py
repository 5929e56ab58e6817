"""The benchmark's traffic must be what it claims to measure: valid events, not dead letters."""

import time

import orjson

from pipeline.bench import _request_events
from pipeline.events import RequestEvent, decode
from pipeline.ingest import TimeBounds
from pipeline.settings import load_settings


def test_bench_events_are_all_within_the_workers_time_bounds():
    """Traffic generated forward from now ran ahead of the workers' clock after a minute: most of a bench
    run was dead-lettered as event_time_ahead, so the control figure measured dead-lettering."""
    events = _request_events(20_000)
    bounds = TimeBounds.of(load_settings(env={}))
    now_ms = int(time.time() * 1000)
    for e in events:
        event = decode(RequestEvent, orjson.dumps(e.event), e.key.encode(), 1 << 20)
        assert isinstance(event, RequestEvent), event
        assert bounds.check(event.event_time, now_ms) is None
        assert event.event_time <= now_ms   # a backlog, however many events a run asks for

