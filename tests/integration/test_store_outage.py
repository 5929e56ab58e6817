"""The store made really unavailable for minutes under 10k events/s: the landing path holds with bounded
memory while the control path keeps deciding on time, and everything lands exactly once afterwards."""

import asyncio
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace

import orjson
import pytest
from aiokafka import AIOKafkaConsumer

from pipeline import topics
from pipeline.admission.policy import config_from
from pipeline.bench import EVENTS_PER_REQUEST, bucket_quantile, histogram_buckets
from pipeline.sim.producer import produce
from pipeline.sim.replay import generate, load_trace
from pipeline.sinks.store import open_store
from tests.conftest import run, wait_for
from tests.integration.kafka_helpers import group_lag
from tests.integration.test_cost_views import pending
from tests.integration.test_worst_values import metric

pytestmark = pytest.mark.integration
RATE = 10_000               # events/s, paced in real time (event time = wall time)
BASELINE_S, OUTAGE_S = 30, int(os.environ.get("SLUICE_TEST_OUTAGE_S", "120"))
# picture lag and decision latency p99 (event time stamped when sent) during the outage: no worse than the
# same traffic with the store up, measured in the same run (the producer saturates the 2 cores too), and
# well inside the signal's validity
LAG_BOUND_S = 3.0
DECISION_LATENCY = "sluice_decision_latency_seconds"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


def health(worker) -> dict:
    try:
        with urllib.request.urlopen(f"{worker.base_url}/healthz", timeout=5) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def table_dir(settings, table: str) -> str:
    """The table's data directory in the embedded store (Atomic layout: its UUID is in its metadata file).
    Analysts' SQL cannot read system.tables, and the store is locked to the worker, so read the files."""
    metadata = (settings.chdb_dir / "metadata" / "default" / f"{table}.sql").read_text()
    uuid = re.search(r"UUID '([0-9a-f-]{36})'", metadata).group(1)
    return str(settings.chdb_dir / "store" / uuid[:3] / uuid)


def set_immutable(path: str, on: bool) -> None:
    """chattr +i: not even root can create a part in the table's directory."""
    subprocess.run(["chattr", "+i" if on else "-i", path], check=True, capture_output=True)


@pytest.fixture
def can_lock_dirs(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        set_immutable(str(probe), True)
        set_immutable(str(probe), False)
    except (OSError, subprocess.CalledProcessError) as exc:
        message = f"chattr +i does not work here ({exc}); the outage test needs it"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


class Watch:
    """Reads the admission and load topics in a thread while traffic flows."""

    def __init__(self, settings):
        self.settings = settings
        self.signals: list[tuple[float, dict]] = []   # (arrival, signal)
        self.picture_lags: list[tuple[float, float]] = []  # (arrival, published_at - watermark)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._follow()), daemon=True)

    async def _follow(self):
        bootstrap = self.settings.kafka_bootstrap_servers
        consumer = AIOKafkaConsumer(topics.ADMISSION.name(self.settings), topics.LOAD.name(self.settings),
                                    bootstrap_servers=bootstrap, auto_offset_reset="latest", enable_auto_commit=False)
        await consumer.start()
        try:
            while not self.stop.is_set():
                for tp, messages in (await consumer.getmany(timeout_ms=200)).items():
                    now = time.monotonic()
                    for message in messages:
                        doc = orjson.loads(message.value)
                        if tp.topic == topics.ADMISSION.name(self.settings):
                            self.signals.append((now, doc))
                        else:
                            self.picture_lags.append((now, (doc["published_at_ms"] - doc["watermark_ms"]) / 1000))
        finally:
            await consumer.stop()


class Counted:
    """The trace as it is produced, counting request events and terminal ones (the list would not fit)."""

    def __init__(self, stream):
        self.stream, self.requests, self.terminal, self.rate = stream, 0, 0, 0.0

    def __iter__(self):
        for item in self.stream:
            if item.kind == "request":
                self.requests += 1
                self.terminal += item.event["phase"] in ("completed", "failed", "rejected", "cancelled")
            yield item


def p99(values):
    return sorted(values)[int(0.99 * (len(values) - 1))] if values else None


def test_store_outage_costs_analysts_fresh_rows_never_the_fleet_its_admission_control(
        settings, worker_factory, can_lock_dirs):
    base = replace(settings, tick_s=0.25)
    worker = worker_factory(base).start()

    def traffic(seconds, seed):
        stream = Counted(generate(load_trace(), rate=RATE / EVENTS_PER_REQUEST, seconds=seconds, seed=seed,
                                  start_ms=int(time.time() * 1000)))
        began = time.monotonic()
        produced = run(produce(base, base.kafka_bootstrap_servers, stream, paced=True, stamp=True))
        stream.rate = produced.total / (time.monotonic() - began)
        return stream

    def measured(seconds, seed):
        """Traffic for ``seconds``; the decision-latency histogram's growth over it and the worker's RSS."""
        out = {"began": time.monotonic()}
        producer = threading.Thread(target=lambda: out.setdefault("stream", traffic(seconds, seed)))
        before = histogram_buckets(worker.scrape(), DECISION_LATENCY)
        producer.start()
        out["rss"] = []
        while producer.is_alive():
            out["rss"].append((time.monotonic() - out["began"], rss_mib(worker.pid)))
            producer.join(5)
        out["ended"] = time.monotonic()
        after = histogram_buckets(worker.scrape(), DECISION_LATENCY)
        out["decision_p99"] = bucket_quantile({le: n - before.get(le, 0.0) for le, n in after.items()}, 0.99)
        return out

    validity_s = config_from(base.admission_policy).validity_s
    raw = [topics.REQUESTS.name(base), topics.REPLICAS.name(base)]
    watch = Watch(base)
    watch.thread.start()
    baseline = measured(BASELINE_S, seed=11)   # the same traffic with the store up: what the machine gives
    wait_for(lambda: worker.counts().accepted >= baseline["stream"].requests, 120, message="the baseline to land")

    locked = table_dir(base, "request_events")
    set_immutable(locked, True)
    try:
        outage = measured(OUTAGE_S, seed=12)
        health_during = health(worker)
        landing_lag = run(group_lag(base.kafka_bootstrap_servers, topics.landing_group(base), raw))
    finally:
        set_immutable(locked, False)
        watch.stop.set()
    watch.thread.join(10)

    def picture_p99(phase):
        return p99([lag for t, lag in watch.picture_lags if phase["began"] + 5 <= t <= phase["ended"]])

    # the producer shares the two cores with the broker and the worker: what it reaches with the store up, in
    # the same run, is the machine's figure (6,771 events/s on a slower CI machine, session 19); half the
    # target is still the load this test is about
    achieved, reachable = outage["stream"].rate, min(RATE, baseline["stream"].rate)
    assert achieved >= max(0.75 * reachable, 0.5 * RATE), \
        f"the producer reached {achieved:.0f} events/s ({baseline['stream'].rate:.0f} with the store up)"
    assert health_during["landing"]["sink_held"] and health_during["ok"], "held, and the control path healthy"
    assert landing_lag > achieved * OUTAGE_S * 0.5, f"landing held back: {landing_lag} records behind"
    began, ended = outage["began"] + 5, outage["ended"]
    signals = [(t, s) for t, s in watch.signals if began <= t <= ended]
    assert signals and all(s["state"] != "stale" for _, s in signals), "routers never see a stale signal"
    for pool in {s["pool"] for _, s in signals}:
        times = [began] + [t for t, s in signals if s["pool"] == pool] + [ended]
        gap = max(b - a for a, b in zip(times, times[1:]))
        assert gap < validity_s, f"{pool}: {gap:.1f} s without a signal (valid for {validity_s} s)"
    lags = {"picture": (picture_p99(baseline), picture_p99(outage)),
            "decision": (baseline["decision_p99"], outage["decision_p99"])}
    for name, (up, down) in lags.items():
        # p99s of a few hundred samples on a shared 2-core host move by up to a second between runs with the
        # store up (measured 0.49–1.79 s for decisions): the bound is that much, and LAG_BOUND_S absolute
        assert down <= max(1.5 * up, up + 1.0) and down <= LAG_BOUND_S, f"{name} lag p99 store up/down: {lags}"
    rss = outage["rss"]
    settled = [mib for t, mib in rss if t >= OUTAGE_S / 3]
    assert max(settled) - settled[0] < 100, f"worker memory bounded while held: {rss}"

    wait_for(lambda: run(group_lag(base.kafka_bootstrap_servers, topics.landing_group(base), raw)) == 0, 300,
             interval_s=2.0, message="the backlog to land once the store is back")
    assert health(worker)["landing"]["sink_held"] is False
    worker.stop()
    store = open_store(base)
    try:
        n, = store.query("SELECT count() AS rows, uniqExact(event_id) AS ids FROM request_events")
        m, = store.query("SELECT sum(requests) AS requests FROM pool_minute")
    finally:
        store.close()
    requests = baseline["stream"].requests + outage["stream"].requests
    assert n == {"rows": requests, "ids": requests}
    assert m == {"requests": baseline["stream"].terminal + outage["stream"].terminal}
    print(f"\nstore outage: {OUTAGE_S} s at {achieved:.0f} events/s (target {RATE}) with request_events locked: "
          f"landing {landing_lag} records behind, {len(signals)} signals, none stale; p99 lag store up → down: "
          f"picture {lags['picture'][0]:.3f} → {lags['picture'][1]:.3f} s, decision {lags['decision'][0]:.3f} → "
          f"{lags['decision'][1]:.3f} s; worker RSS {min(m for _, m in rss):.0f}-{max(m for _, m in rss):.0f} MiB; "
          f"after unlock all {requests} request events landed once")


def test_a_refused_rollup_holds_neither_landing_nor_its_commits_and_catches_up_exactly_once(
        settings, worker_factory, can_lock_dirs):
    """pool_minute's directory made immutable under the real worker: the rollup is refused (counted, backed
    off), while request events go on landing and their offsets committing; unlocked, pool_minute catches up
    and counts every terminal attempt once."""
    base = replace(settings, sink_rollup_interval_s=0.25)   # its backoff tops out at 16 s, not 64
    worker = worker_factory(base).start()
    now_ms = int(time.time() * 1000)
    before, during = (list(generate(load_trace(), rate=20, seconds=60, seed=seed, start_ms=now_ms - ago_ms))
                      for seed, ago_ms in ((21, 180_000), (22, 90_000)))
    raw = [topics.REQUESTS.name(base), topics.REPLICAS.name(base)]

    def landing_lag():
        return run(group_lag(base.kafka_bootstrap_servers, topics.landing_group(base), raw))

    run(produce(base, base.kafka_bootstrap_servers, before, paced=False))
    wait_for(lambda: worker.counts().accepted >= len(before) and pending(worker.settings) == 0, 120,
             message="the first events to land and roll up")
    failed = metric(worker, "sluice_sink_rollups_total", outcome="failed")
    held = []   # landing's hold, every time it is looked at while pool_minute refuses

    def watched(condition):
        def check():
            held.append(health(worker)["landing"]["sink_held"])
            return condition()
        return check

    locked = table_dir(base, "pool_minute")
    set_immutable(locked, True)
    try:
        run(produce(base, base.kafka_bootstrap_servers, during, paced=False))
        wait_for(watched(lambda: worker.counts().accepted >= len(before) + len(during) and landing_lag() == 0), 120,
                 interval_s=0.5, message="landing and its commits to go on while pool_minute refuses")
        wait_for(watched(lambda: metric(worker, "sluice_sink_rollups_total", outcome="failed") > failed), 60,
                 interval_s=0.5, message="the refused rollup to be counted")
        behind = pending(worker.settings)
        assert behind > 0, "pool_minute cannot have taken what landed while locked"
        # the rollup's retries hold its own client, never landing's (they held landing, about 3 s a try, when
        # the rollup ran inside each landing)
        assert held and not any(held), f"landing held while only the rollup was refused ({sum(held)} of {len(held)})"
    finally:
        set_immutable(locked, False)
    wait_for(lambda: pending(worker.settings) == 0, 90, interval_s=1.0,
             message="pool_minute to catch up once the store takes it again")
    worker.stop()
    terminal = sum(e.event["phase"] in ("completed", "failed", "rejected", "cancelled")
                   for e in before + during if e.kind == "request")
    store = open_store(base)
    try:
        m, = store.query("SELECT sum(requests) AS requests FROM pool_minute")
    finally:
        store.close()
    assert m == {"requests": terminal}
    print(f"\nrollup refused: {len(during)} events landed and committed meanwhile, {behind} terminal attempts "
          f"behind in pool_minute; after unlock all {terminal} counted once")


def test_chattr_is_available_in_ci():
    assert shutil.which("chattr"), "e2fsprogs provides chattr"
