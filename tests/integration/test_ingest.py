"""Stage 1 against the real broker: every input is landed or dead-lettered, with the right reason and bytes."""

import base64
from itertools import islice

import orjson
import pytest

from pipeline import topics
from pipeline.sim.producer import produce
from pipeline.sim.replay import generate, load_trace
from pipeline.sim.specimens import bad_inputs
from pipeline.sinks.store import open_store
from tests.conftest import run, wait_for
from tests.integration.kafka_helpers import group_lag, read_all

pytestmark = pytest.mark.integration

VALID, INVALID = 10_000, 1_000


def make_inputs(settings):
    valid = list(islice(generate(load_trace(), rate=60, seconds=600, seed=7, start_ms=1_700_000_000_000), VALID))
    assert len(valid) == VALID
    catalogue = bad_inputs(settings.max_event_bytes)
    bad = [catalogue[i % len(catalogue)] for i in range(INVALID)]
    expected_reason = {(value, key): reason for reason, value, key in catalogue}
    return valid, bad, expected_reason


def landed_ids(settings) -> list[str]:
    store = open_store(settings)
    try:
        rows = store.query("SELECT toString(event_id) AS id FROM request_events "
                           "UNION ALL SELECT toString(event_id) FROM replica_samples")
    finally:
        store.close()
    return [r["id"] for r in rows]


def check_dead_letters(settings, expected_reason) -> int:
    """Every dead letter has the reason its bytes deserve and carries them unchanged; returns distinct sources."""
    letters = run(read_all(settings.kafka_bootstrap_servers, topics.DEADLETTER.name(settings)))
    sources = set()
    for record in letters:
        letter = orjson.loads(record.value)
        value = base64.b64decode(letter["value_b64"])
        key = base64.b64decode(letter["key_b64"]) if letter["key_b64"] is not None else None
        assert letter["reason"] == expected_reason[(value, key)], letter["detail"]
        assert letter["source_topic"] == topics.REQUESTS.name(settings)
        assert record.key.decode() == f"{letter['source_topic']}/{letter['source_partition']}/{letter['source_offset']}"
        sources.add((letter["source_partition"], letter["source_offset"]))
    return len(sources)


def all_consumed(settings) -> bool:
    raw = [topics.REQUESTS.name(settings), topics.REPLICAS.name(settings)]
    return run(group_lag(settings.kafka_bootstrap_servers, topics.stage1_group(settings), raw)) == 0


def test_worker_accepts_every_valid_and_dead_letters_every_invalid(settings, worker_factory):
    valid, bad, expected_reason = make_inputs(settings)
    worker = worker_factory().start()
    produced = run(produce(settings, settings.kafka_bootstrap_servers, valid, paced=False, bad=bad))
    assert produced.total == VALID + INVALID

    counts = wait_for(lambda: (c := worker.counts()).accepted + c.dead_lettered >= produced.total and c,
                      120, message="the worker to account for every record")
    assert counts.accepted == VALID
    assert counts.dead_lettered == INVALID
    assert set(counts.reasons) == {reason for reason, _, _ in bad}
    wait_for(lambda: all_consumed(settings), 60, message="offsets committed")
    worker.stop()

    ids = landed_ids(settings)
    assert len(ids) == VALID and set(ids) == {e.event["event_id"] for e in valid}
    assert check_dead_letters(settings, expected_reason) == INVALID


def test_kill_9_midway_loses_nothing(settings, worker_factory):
    valid, bad, expected_reason = make_inputs(settings)
    first = worker_factory().start()
    produced = run(produce(settings, settings.kafka_bootstrap_servers, valid, paced=False, bad=bad))
    wait_for(lambda: first.counts().accepted >= VALID // 3, 120, interval_s=0.05,
             message="the first worker to be part-way through")
    first.kill()

    second = worker_factory().start()
    wait_for(lambda: all_consumed(settings), 180, message="the restarted worker to consume and commit everything")
    second.stop()

    ids = landed_ids(settings)
    distinct = set(ids)
    assert distinct == {e.event["event_id"] for e in valid}, "every valid event landed"
    assert check_dead_letters(settings, expected_reason) == INVALID, "every invalid event dead-lettered"
    duplicates = len(ids) - len(distinct)
    print(f"\nkill -9: {produced.total} produced, {len(distinct)} landed distinct, {duplicates} duplicate rows "
          f"(allowed at this stage), {INVALID} dead-lettered")
