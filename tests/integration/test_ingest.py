"""Stage 1 against the real broker: every input is landed exactly once or dead-lettered, with the right
reason and bytes — also across a kill -9 and re-sent events."""

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
from tests.integration.kafka_helpers import delete_before, group_lag, read_all, rewind_group

pytestmark = pytest.mark.integration

VALID, RESENT, INVALID = 10_000, 300, 1_000
TERMINAL = ("completed", "failed", "rejected", "cancelled")


def make_inputs(settings):
    """Valid events, some of them sent twice (a producer retry: same key, same bytes), and invalid ones."""
    valid = list(islice(generate(load_trace(), rate=60, seconds=600, seed=7, start_ms=1_700_000_000_000), VALID))
    assert len(valid) == VALID
    stream = list(valid)
    for i in range(RESENT):
        stream.insert(31 * i + 40, valid[31 * i + 1])
    catalogue = bad_inputs(settings.max_event_bytes)
    bad = [catalogue[i % len(catalogue)] for i in range(INVALID)]
    expected_reason = {(value, key): reason for reason, value, key in catalogue}
    return valid, stream, bad, expected_reason


def landed(settings) -> dict:
    """Row counts as stored (no FINAL: exactly once means no duplicate rows to collapse)."""
    store = open_store(settings)
    try:
        ids = [r["id"] for r in store.query("SELECT toString(event_id) AS id FROM request_events "
                                            "UNION ALL SELECT toString(event_id) FROM replica_samples")]
        minute, = store.query("SELECT sum(requests) AS requests, sum(completed) AS completed FROM pool_minute")
        letters, = store.query("SELECT count() AS rows, uniqExact(source_offset, source_partition) AS distinct "
                               "FROM dead_letters")
    finally:
        store.close()
    return {"ids": ids, "minute": minute, "letters": letters}


def check_exactly_once(settings, valid) -> dict:
    got = landed(settings)
    ids = got["ids"]
    assert len(ids) == len(set(ids)) == VALID, f"{len(ids)} rows, {len(set(ids))} distinct, {VALID} sent"
    assert set(ids) == {e.event["event_id"] for e in valid}
    terminal = [e.event for e in valid if e.kind == "request" and e.event["phase"] in TERMINAL]
    assert got["minute"] == {"requests": len(terminal),
                             "completed": sum(e["phase"] == "completed" for e in terminal)}, "per-minute view"
    assert got["letters"] == {"rows": INVALID, "distinct": INVALID}, "dead_letters table"
    return got


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
    """Both paths have committed everything: landing (rows) and control (dead letters, partials)."""
    raw = [topics.REQUESTS.name(settings), topics.REPLICAS.name(settings)]
    return all(run(group_lag(settings.kafka_bootstrap_servers, group, raw)) == 0
               for group in (topics.landing_group(settings), topics.control_group(settings)))


def test_worker_lands_every_valid_once_and_dead_letters_every_invalid(settings, worker_factory):
    valid, stream, bad, expected_reason = make_inputs(settings)
    worker = worker_factory().start()
    produced = run(produce(settings, settings.kafka_bootstrap_servers, stream, paced=False, bad=bad))
    assert produced.total == VALID + RESENT + INVALID

    counts = wait_for(lambda: (c := worker.counts()).accepted + c.duplicates + c.dead_lettered >= produced.total
                      and c, 120, message="the worker to account for every record")
    assert (counts.accepted, counts.duplicates, counts.dead_lettered) == (VALID, RESENT, INVALID)
    assert set(counts.reasons) == {reason for reason, _, _ in bad}
    wait_for(lambda: all_consumed(settings), 60, message="offsets committed")
    worker.stop()

    check_exactly_once(settings, valid)
    assert check_dead_letters(settings, expected_reason) == INVALID


def landed_and_committed_once(settings, worker_factory):
    """Every input produced, landed and committed by a worker that then stops: (valid events, raw topics)."""
    valid, stream, bad, _ = make_inputs(settings)
    run(topics.ensure_topics(settings, settings.kafka_bootstrap_servers))
    run(produce(settings, settings.kafka_bootstrap_servers, stream, paced=False, bad=bad))
    first = worker_factory().start()
    wait_for(lambda: all_consumed(settings), 120, message="everything landed and committed")
    first.stop()
    return valid, [topics.REQUESTS.name(settings), topics.REPLICAS.name(settings)]


def test_a_batch_redelivered_after_a_crash_before_commit_lands_nothing_twice(settings, worker_factory):
    """Landed but not committed: the group's offsets are put back to 0, as if no commit had happened."""
    valid, raw = landed_and_committed_once(settings, worker_factory)
    run(rewind_group(settings.kafka_bootstrap_servers, topics.landing_group(settings), raw))
    assert not all_consumed(settings)

    second = worker_factory().start()
    wait_for(lambda: all_consumed(settings), 120, message="the redelivered records to be committed again")
    counts = second.counts()
    second.stop()
    check_exactly_once(settings, valid)
    print(f"\nrewound to 0: the restarted worker re-read {counts.accepted + counts.duplicates + counts.dead_lettered}"
          f" of {VALID + RESENT + INVALID} records and landed none twice")


def test_a_replay_from_inside_a_landed_block_or_after_retention_lands_nothing_twice(settings, worker_factory):
    """The committed offset is put a few records before each partition's end — inside a landed block —
    and on half the partitions the log start moves past it too (retention), so the replay starts where no
    block boundary or deduplication token can recognise it: only the store's own offsets can."""
    valid, raw = landed_and_committed_once(settings, worker_factory)
    inside = run(rewind_group(settings.kafka_bootstrap_servers, topics.landing_group(settings), raw,
                              to=lambda tp, end: max(0, end - 7 - tp.partition)))
    run(delete_before(settings.kafka_bootstrap_servers, {tp: o for tp, o in inside.items() if tp.partition % 2}))
    run(rewind_group(settings.kafka_bootstrap_servers, topics.landing_group(settings), raw,
                     to=lambda tp, end: 0 if tp.partition % 2 else inside[tp]))
    assert not all_consumed(settings)

    second = worker_factory().start()
    wait_for(lambda: all_consumed(settings), 120, message="the redelivered records to be committed again")
    skipped = second.counts().already_landed
    second.stop()
    check_exactly_once(settings, valid)
    assert skipped > 0, "the replayed records were skipped as landed, not dropped by luck"


def test_kill_9_midway_lands_exactly_once(settings, worker_factory):
    valid, stream, bad, expected_reason = make_inputs(settings)
    first = worker_factory().start()
    produced = run(produce(settings, settings.kafka_bootstrap_servers, stream, paced=False, bad=bad))
    wait_for(lambda: first.counts().accepted >= VALID // 3, 120, interval_s=0.05,
             message="the first worker to be part-way through")
    first.kill()

    second = worker_factory().start()
    wait_for(lambda: all_consumed(settings), 180, message="the restarted worker to consume and commit everything")
    second.stop()

    got = check_exactly_once(settings, valid)
    assert check_dead_letters(settings, expected_reason) == INVALID
    print(f"\nkill -9: {produced.total} produced ({RESENT} re-sent), {len(got['ids'])} rows landed "
          f"= {VALID} distinct, {INVALID} dead letters landed once")
