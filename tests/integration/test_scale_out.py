"""Three control workers and one landing worker under steady traffic: kill -9 a control worker and the
landing worker mid-stream. Pictures and signals go on, every event counts once in the picture, and
landing stays exactly once."""

import asyncio
import threading
import time
from dataclasses import replace

import pytest

from pipeline import topics
from pipeline.events import ReplicaSample, RequestEvent
from pipeline.load.config import PictureConfigs
from pipeline.load.partial import PartialBuilder
from pipeline.load.picture import PoolState
from pipeline.sim.producer import produce
from pipeline.sim.replay import Fleet, generate, load_trace
from pipeline.topic_reader import open_from_beginning
from tests.conftest import run, wait_for
from tests.integration.kafka_helpers import group_lag, landed_requests, pictures_if_read

pytestmark = pytest.mark.integration
POOLS = ("pool-a", "pool-b", "pool-c", "pool-d")
RATE, SECONDS = 1500, 50            # events/s of steady traffic, and for how long
KILL_CONTROL_AT, KILL_LANDING_AT = 15, 25
GAP_BOUND_S = 30.0                  # session timeout (6 s here) + rebalance + changelog recovery + a tick
REQUEST_RATES = ("arrival_rps", "admitted_rps", "completed_rps", "input_tokens_per_s", "output_tokens_per_s",
                 "goodput_tasks_per_s")


class SignalWatch:
    """Reads sluice.admission.v1 in a thread: when each pool's signals arrived."""

    def __init__(self, settings):
        self.settings = settings
        self.arrivals: dict[str, list[float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._follow()), daemon=True)

    async def _follow(self):
        consumer, _ = await open_from_beginning(self.settings.kafka_bootstrap_servers,
                                                topics.ADMISSION.name(self.settings))
        try:
            while not self.stop.is_set():
                for messages in (await consumer.getmany(timeout_ms=200)).values():
                    for message in messages:
                        self.arrivals.setdefault(message.key.decode(), []).append(time.monotonic())
        finally:
            await consumer.stop()

    def longest_gap(self, since: float, until: float) -> dict[str, float]:
        gaps = {}
        for pool, times in self.arrivals.items():
            inside = [since] + [t for t in times if since <= t <= until] + [until]
            gaps[pool] = max(b - a for a, b in zip(inside, inside[1:]))
        return gaps


def offline_picture(settings, events, pool):
    """The same picture computed from every produced event at once, with no Kafka in between."""
    builder = PartialBuilder("offline", settings.replica_stale_after_s)
    for item in events:
        if item.event["pool"] != pool:
            continue
        if item.kind == "request":
            builder.fold_request(RequestEvent(**item.event))
        else:
            builder.fold_sample(ReplicaSample(**item.event))
    state = PoolState(pool)
    config = PictureConfigs(settings).for_pool(pool)
    for partial in builder.drain("all"):
        state.merge(partial, config)
    return state.snapshot(config)


def test_control_workers_scale_out_and_a_killed_one_costs_a_bounded_gap_and_no_double_counting(
        settings, worker_factory):
    base = replace(settings, topic_partitions=6, tick_s=0.25, allowed_lateness_s=120.0, session_timeout_s=6.0)
    run(topics.ensure_topics(base, base.kafka_bootstrap_servers))
    controls = [worker_factory(base, role="control").start() for _ in range(3)]
    landing = worker_factory(base, role="landing").start()
    watch = SignalWatch(base)
    watch.thread.start()

    start_ms = int(time.time() * 1000)
    events = list(generate(load_trace(), rate=RATE / 6, seconds=SECONDS, seed=5, start_ms=start_ms,
                           fleet=Fleet(pools=POOLS)))
    producer = threading.Thread(target=lambda: run(produce(base, base.kafka_bootstrap_servers, events, paced=True)))
    began = time.monotonic()
    producer.start()

    wait_for(lambda: time.monotonic() - began >= KILL_CONTROL_AT, KILL_CONTROL_AT + 5, interval_s=0.5)
    controls[0].kill()
    killed_at = time.monotonic()
    wait_for(lambda: time.monotonic() - began >= KILL_LANDING_AT, KILL_LANDING_AT + 5, interval_s=0.5)
    landing.kill()
    landing = worker_factory(base, role="landing").start()
    producer.join(SECONDS + 60)
    traffic_ended = time.monotonic()

    raw = [topics.REQUESTS.name(base), topics.REPLICAS.name(base)]
    wait_for(lambda: run(group_lag(base.kafka_bootstrap_servers, topics.control_group(base), raw)) == 0, 120,
             message="the surviving control workers to read everything")
    newest = {pool: max(e.event["event_time"] for e in events if e.event["pool"] == pool) for pool in POOLS}

    def caught_up():
        pictures = run(pictures_if_read(base))
        return all(pictures.get(p, {}).get("watermark_ms") == newest[p] for p in POOLS) and pictures

    wait_for(caught_up, 60, interval_s=1.0, message="every pool's picture to reach its newest event")
    offline = {pool: {k: offline_picture(base, events, pool)["rates"][k] for k in REQUEST_RATES} for pool in POOLS}

    online = {}

    def agrees():
        """Equal to the offline computation once the last partials are merged (a cut is committed before
        it is published, so lag 0 can come a tick before the picture): double counting never converges."""
        pictures = run(pictures_if_read(base))
        if not all(pool in pictures for pool in POOLS):
            return False
        online.update({pool: {k: pictures[pool]["rates"][k] for k in REQUEST_RATES} for pool in POOLS})
        return online == offline and pictures

    try:
        pictures = wait_for(agrees, 30, interval_s=1.0, message="pictures to agree with the offline computation")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: online {online}, offline {offline}") from None
    watch.stop.set()
    watch.thread.join(10)

    gaps = watch.longest_gap(since=began + 5, until=traffic_ended)
    assert set(gaps) == set(POOLS)
    assert max(gaps.values()) <= GAP_BOUND_S, f"longest silence per pool: {gaps}"
    assert all(pictures[pool]["late_events"] == 0 for pool in POOLS)

    wait_for(lambda: run(group_lag(base.kafka_bootstrap_servers, topics.landing_group(base), raw)) == 0, 180,
             message="the restarted landing worker to catch up")
    landing.stop()
    requests = [e for e in events if e.kind == "request"]
    landed = landed_requests(base)
    assert landed == {"rows": len(requests), "ids": len(requests)}
    print(f"\nscale-out: {len(events)} events at {RATE}/s over 3 control workers; worker 0 killed at "
          f"{killed_at - began:.0f} s; longest signal gap per pool {', '.join(f'{p} {g:.1f}s' for p, g in gaps.items())}; "
          f"request rates equal to the offline computation for every pool; landing killed and restarted: "
          f"{landed['rows']} rows, {landed['ids']} distinct")
