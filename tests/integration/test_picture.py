"""The load picture through the real broker and workers, against an offline computation over the same events."""

import itertools
import math
import time

import pytest

from pipeline import topics
from pipeline.bench import counter_total
from pipeline.pools_view import PicturesCutShort, latest_pictures
from pipeline.sim.producer import produce
from pipeline.sim.replay import generate, load_trace
from tests.conftest import run, wait_for
from tests.integration.kafka_helpers import group_lag, pictures_if_read

pytestmark = pytest.mark.integration

FAST = 10
START_MS = 1_700_000_000_000


def five_minutes_of_trace():
    trace = load_trace()
    natural_rate = len(trace) / trace[-1].offset_s
    return list(generate(trace, rate=natural_rate, seconds=300, seed=5, start_ms=START_MS))


def offline(events, pool):
    """What the picture must say for ``pool``, computed directly from the events."""
    mine = [e.event for e in events if e.event["pool"] == pool]
    watermark = max(e["event_time"] for e in mine)
    end = watermark // 1000
    window = [e for e in mine if end - FAST <= e["event_time"] // 1000 < end and "phase" in e]
    finished = [e for e in window if e["phase"] in ("completed", "failed")]
    ttft = sorted([e["ttft_s"] for e in window if e["phase"] == "completed" and "ttft_s" in e]
                  # attempts that timed out before a first token count at their duration (censored)
                  + [e["duration_s"] for e in window if e["phase"] in ("failed", "cancelled")
                     and e.get("ttft_s") is None and e.get("duration_s")
                     and (e.get("error_type") or "").lower() in ("timeout", "timeouterror")])
    quantile = {q: ttft[math.floor(v * (len(ttft) - 1))] for q, v in (("p50", .5), ("p95", .95), ("p99", .99))}
    return {"watermark_ms": watermark,
            "arrival_rps": sum(e["phase"] == "received" for e in window) / FAST,
            "input_tokens_per_s": sum(e["input_tokens"] for e in finished) / FAST,
            "output_tokens_per_s": sum(e["output_tokens"] for e in finished) / FAST,
            "ttft": quantile}


def assert_matches(picture, expected):
    assert picture["watermark_ms"] == expected["watermark_ms"]
    for rate in ("arrival_rps", "input_tokens_per_s", "output_tokens_per_s"):
        assert picture["rates"][rate] == pytest.approx(expected[rate], rel=0.02), rate
    for q, value in expected["ttft"].items():
        assert picture["latency_s"]["ttft"][q] == pytest.approx(value, rel=0.02), q


def converged(settings, expected):
    """All pools' pictures published at the final watermark and unchanged over a second."""
    def read():
        return run(pictures_if_read(settings))

    seen = {}

    def done():
        first = read()
        seen["last"] = {p: (v["watermark_ms"], v["partials_merged"], v["late_events"]) for p, v in first.items()}
        if set(first) != set(expected) or any(first[p]["watermark_ms"] != expected[p]["watermark_ms"]
                                               for p in expected):
            return None
        time.sleep(2 * settings.tick_s + 0.5)
        second = read()
        same = set(second) == set(first) and all(
            second[p]["axes"] == first[p]["axes"] and second[p]["rates"] == first[p]["rates"] for p in first)
        return second if same else None

    try:
        return wait_for(done, 180, interval_s=0.5, message="pictures to converge")
    except AssertionError as exc:
        wanted = {p: e["watermark_ms"] for p, e in expected.items()}
        raise AssertionError(f"{exc}; expected watermarks {wanted}, last seen (watermark, partials, late) "
                             f"{seen.get('last')}") from None


def raw_committed(settings):
    raw = [topics.REQUESTS.name(settings), topics.REPLICAS.name(settings)]
    return run(group_lag(settings.kafka_bootstrap_servers, topics.control_group(settings), raw)) == 0


@pytest.fixture
def backfill(settings):
    """Replays run faster than real time, so partitions drift apart in event time: allow for it."""
    from dataclasses import replace

    return replace(settings, allowed_lateness_s=600, topic_partitions=8)


def test_replay_matches_offline_computation_and_survives_kill_9(backfill, worker_factory):
    events = five_minutes_of_trace()
    pools = sorted({e.event["pool"] for e in events})
    expected = {pool: offline(events, pool) for pool in pools}
    first = worker_factory(backfill).start()
    run(produce(backfill, backfill.kafka_bootstrap_servers, events, paced=False))
    pictures = converged(backfill, expected)
    for pool in pools:
        assert_matches(pictures[pool], expected[pool])
        assert pictures[pool]["late_events"] == 0
    with pytest.raises(PicturesCutShort):   # a read cut short says so: what it had may be older than the newest
        run(latest_pictures(backfill, backfill.kafka_bootstrap_servers, timeout_s=0))

    wait_for(lambda: raw_committed(backfill), 60, message="stage 1 to commit")
    killed_at_ms = int(time.time() * 1000)
    first.kill()
    second = worker_factory(backfill).start()
    restored = wait_for(lambda: (p := run(pictures_if_read(backfill))) and all(
        p[pool]["published_at_ms"] > killed_at_ms for pool in pools) and p, 120, interval_s=0.5,
        message="the restarted worker to republish every pool")
    for pool in pools:
        assert restored[pool]["axes"] == pictures[pool]["axes"], f"{pool} restored from the changelog"
        assert restored[pool]["rates"] == pictures[pool]["rates"]
    second.stop()


def test_two_workers_give_the_same_picture_as_offline(backfill, worker_factory, tmp_path):
    events = five_minutes_of_trace()
    pools = sorted({e.event["pool"] for e in events})
    expected = {pool: offline(events, pool) for pool in pools}
    workers = [worker_factory(backfill, state_dir=tmp_path / f"w{i}").start()
               for i in range(2)]  # one embedded store per process
    run(produce(backfill, backfill.kafka_bootstrap_servers, events, paced=False))
    pictures = converged(backfill, expected)
    for pool in pools:
        assert_matches(pictures[pool], expected[pool])
    assert all(w.counts().accepted > 0 for w in workers), "the group split stage 1 between both workers"



def test_partials_are_cut_and_merged_every_cut_interval_not_every_tick(settings, worker_factory):
    """A decision's newest input is about a cut interval old, whatever the tick: with a 60 s tick (which
    paces the policy's steps), stage 1 cuts and stage 2 merges partials before the tick comes round."""
    worker = worker_factory(settings, role="control", tick_s=60.0, cut_interval_s=0.1).start()
    events = list(itertools.islice(generate(load_trace(), rate=20, seconds=60, seed=5, start_ms=START_MS), 300))
    run(produce(settings, settings.kafka_bootstrap_servers, events, paced=False))

    def merged():
        text = worker.scrape()
        return counter_total(text, "sluice_partials_merged_total") > 0 and text

    text = wait_for(merged, 30, message="partials cut and merged before the first tick")
    assert counter_total(text, "sluice_partials_published_total") > 0


def test_partials_the_stage2_group_committed_past_are_merged_at_the_rebuild(settings, worker_factory):
    """Faust's stream can commit past partials it never handed to the agent (the scale-out test lost 292
    across a rebalance, and the 300 s goodput with them). Here the group's offsets are put past published
    partials before the worker starts: its rebuild re-reads them from the partials topic, each counted once."""
    from aiokafka import AIOKafkaProducer

    from pipeline.events import RequestEvent
    from pipeline.load.partial import PartialBuilder
    from pipeline.sim.specimens import request_event
    from tests.integration.kafka_helpers import rewind_group

    bootstrap = settings.kafka_bootstrap_servers
    now_ms = int(time.time() * 1000)
    partials = []
    for i in range(5):
        builder = PartialBuilder(f"raw/{i}", settings.replica_stale_after_s)
        builder.fold_request(RequestEvent(**request_event(task_id=f"t{i}", event_time=now_ms - (5 - i) * 1000)))
        partials += builder.drain(f"{i}-{i}")

    async def publish_then_skip():
        await topics.ensure_topics(settings, bootstrap)
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
        await producer.start()
        try:
            for partial in partials:
                await producer.send_and_wait(topics.PARTIALS.name(settings), partial.to_bytes(),
                                             key=partial.pool.encode())
        finally:
            await producer.stop()
        return await rewind_group(bootstrap, settings.app_id, [topics.PARTIALS.name(settings)],
                                  to=lambda tp, end: end)

    committed = run(publish_then_skip())
    assert sum(committed.values()) == len(partials)
    worker = worker_factory(settings, role="control").start()

    def picture():
        return run(pictures_if_read(settings)).get("llama-70b-a")

    seen = wait_for(picture, 60, message="a picture of the pool whose partials the group had skipped")
    assert seen["partials_merged"] == len(partials)
    assert seen["rates"]["completed_rps"] == pytest.approx(4 / FAST)  # the watermark's own second is open
    assert counter_total(worker.scrape(), "sluice_partials_reread_total") >= len(partials)  # once per rebuild
