"""A three-broker cluster loses the broker leading the most partitions (kill -9) under steady traffic.

Topics have three replicas and need two in sync (set on each topic, not inherited from the brokers);
producers send with acks=all and idempotence. While the broker is down and after it comes back: every
published request event is in the log once and lands in the store exactly once, the router keeps receiving
signed signals (the longest silence is bounded and printed), and the restarted broker rejoins the in-sync
set of every partition. While the broker is down the worker is restarted too (stopped, then a new process
started): a worker that starts with one of three brokers away joins its groups, resumes landing exactly once
from the store and signals every pool, and from then on the same bound holds.

The worker runs with ``dedup_recent_ids=0``: its paths would otherwise drop a repeated event id, and a
producer that wrote a retried batch twice would go unseen in the store. The raw requests topic is read
back besides, and no event id may be in it twice.

Times are counted from the moment the router has a signal of every pool (the cluster, worker and traffic
warmed up), not from the start of the traffic, and every "by now" is a bounded wait for the condition,
so a slow start on a loaded machine moves the drill instead of failing it.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import orjson
import pytest

from pipeline import topics
from pipeline.router.kafka_client import RouterClient
from pipeline.settings import load_settings
from pipeline.sim.producer import produce
from pipeline.sim.replay import Fleet, generate, load_trace
from pipeline.worker_process import WorkerProcess
from tests.conftest import free_port, run, wait_for
from tests.integration.cluster import three_brokers  # noqa: F401  (fixture)
from tests.integration.kafka_helpers import group_lag, landed_requests, read_all

pytestmark = pytest.mark.integration
POOLS = ("pool-a", "pool-b")
RATE = 40                          # generate()'s task rate (about 5 events/s each, ~210 events/s)
MAX_TRAFFIC_S = 300                # traffic runs until the drill is over (well before this)
KILL_AFTER_S = 10                  # after every pool's first signal
DOWN_S = 15                        # the node stays dead at least this long (longer when the worker's restart is)
AFTER_IN_SYNC_S = 5                # traffic goes on this long once every partition is in sync again
SESSION_TIMEOUT_S = 6.0
# The worst silence: the dead broker is fenced after broker.session.timeout.ms (6 s) and its partitions get new
# leaders; a consumer group whose coordinator it was finds the new one, at worst after the worker's session
# timeout (6 s); then the next tick and heartbeat republish (heartbeat_s 2 s), plus metadata refreshes.
GAP_BOUND_S = 6 + SESSION_TIMEOUT_S + 2 + 4
# A worker started while no other runs signals every pool once healthy: it joins both groups, recovers its
# table and folds the backlog of the seconds without a worker (about 210 events/s); seen in 0.4 s
RESTARTED_SIGNALS_S = 30
TOPIC_CONFIG = 1  # DescribeConfigs config_source: set on the topic itself (DYNAMIC_TOPIC_CONFIG)


async def replication_of(bootstrap: str, prefixes: tuple[str, ...]) -> dict[str, tuple[int, str, bool]]:
    """topic → (replicas of partition 0, min.insync.replicas, whether the topic itself sets it) for every
    topic whose name starts with a prefix. The source matters: the brokers' own default is 2 as well."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        replicas = {t["topic"]: len(t["partitions"][0]["replicas"]) for t in await admin.describe_topics()
                    if t["topic"].startswith(prefixes)}
        out = {}
        for name, count in replicas.items():
            response, = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name)])
            entry, = [c for c in response.resources[0][4] if c[0] == "min.insync.replicas"]
            # v0: (name, value, read_only, is_default, is_sensitive); v1+: (..., read_only, config_source, ...)
            own = entry[3] == TOPIC_CONFIG if response.API_VERSION >= 1 else not entry[3]
            out[name] = (count, entry[1], own)
        return out
    finally:
        await admin.close()


class SignalTimes(RouterClient):
    """The router library's client, noting when each pool's signal arrived (monotonic seconds)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.arrivals: dict[str, list[float]] = {}

    def _absorb(self, batch: dict) -> None:
        now = time.monotonic()
        for messages in batch.values():
            for message in messages:
                if message.key:
                    self.arrivals.setdefault(message.key.decode(), []).append(now)
        super()._absorb(batch)


class RouterThread:
    """Runs a ``SignalTimes`` client on its own event loop for the length of the test."""

    def __init__(self, settings) -> None:
        from pipeline.admission.keyring import keyring

        self.client = SignalTimes(settings, settings.kafka_bootstrap_servers, keyring(settings))
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def follow() -> None:
            await self.client.start()
            try:
                while not self.stopping.is_set():
                    await asyncio.sleep(0.2)
            finally:
                await self.client.stop()

        try:
            asyncio.run(follow())
        except BaseException as exc:  # reported by the test
            self.error = exc

    def first_of_every_pool(self) -> float | None:
        """When the last pool got its first signal (None: not every pool yet)."""
        arrivals = dict(self.client.arrivals)
        if set(arrivals) != set(POOLS):
            return None
        return max(times[0] for times in arrivals.values())

    def longest_gap(self, until: float, since: float = 0.0) -> dict[str, float]:
        """pool → the longest time without a signal, from the pool's first signal after ``since`` to ``until``."""
        gaps = {}
        for pool, times in list(self.client.arrivals.items()):
            inside = [t for t in times if since < t <= until] + [until]
            gaps[pool] = max(b - a for a, b in zip(inside, inside[1:]))
        return gaps

    def received_after(self, moment: float) -> set[str]:
        return {pool for pool, times in list(self.client.arrivals.items()) if any(t > moment for t in times)}


class Traffic:
    """Paced events from a thread until ``stop()``: the drill decides how long the traffic lasts."""

    def __init__(self, settings, bootstrap: str) -> None:
        self.settings, self.bootstrap = settings, bootstrap
        self.stopping = threading.Event()
        self.outcome: dict = {}
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _events(self):
        for event in generate(load_trace(), rate=RATE, seconds=MAX_TRAFFIC_S, seed=11,
                              start_ms=int(time.time() * 1000), fleet=Fleet(pools=POOLS)):
            if self.stopping.is_set():
                return
            yield event

    def _run(self) -> None:
        try:
            self.outcome["counts"] = run(produce(self.settings, self.bootstrap, self._events(), paced=True))
        except BaseException as exc:  # asserted by the test
            self.outcome["error"] = exc

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout_s)


def request_ids_in_log(bootstrap: str, topic: str) -> Counter:
    """event_id → how many times it is in the raw requests topic."""
    return Counter(orjson.loads(record.value)["event_id"] for record in run(read_all(bootstrap, topic)))


def test_killing_the_busiest_broker_loses_and_duplicates_nothing_and_signals_go_on(three_brokers, tmp_path: Path):
    cluster = three_brokers
    namespace = "f" + uuid.uuid4().hex[:10]
    settings = load_settings(env={}, kafka_bootstrap_servers=cluster.bootstrap, topic_namespace=namespace,
                             app_id=f"sluice-{namespace}", state_dir=str(tmp_path / "state"), web_port=free_port(),
                             retention_days=0, max_event_age_s=0, dev_signing_key=True,
                             topic_replication_factor=3, topic_min_insync_replicas=2, topic_partitions=4,
                             tick_s=0.25, session_timeout_s=SESSION_TIMEOUT_S, allowed_lateness_s=120.0,
                             dedup_recent_ids=0)  # a doubled record must reach the store, not be dropped
    run(topics.ensure_topics(settings, cluster.bootstrap))
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    router = RouterThread(settings)
    traffic = Traffic(settings, cluster.bootstrap)
    try:
        worker.start(timeout_s=120)
        replication = run(replication_of(cluster.bootstrap, (namespace, settings.app_id)))
        leader_topic = f"{settings.app_id}-__assignor-__leader"  # Faust declares it without a config hook
        assert topics.changelog_topic(settings) in replication and leader_topic in replication
        assert replication.pop(leader_topic) == (3, "2", False)  # the brokers' default: what the check tells apart
        assert {name for name, rf in replication.items() if rf != (3, "2", True)} == set(), replication
        router.thread.start()
        began = time.monotonic()
        traffic.start()
        ready = wait_for(router.first_of_every_pool, 90, interval_s=0.2,
                         message="a signal of every pool before the kill")

        wait_for(lambda: time.monotonic() >= ready + KILL_AFTER_S, KILL_AFTER_S + 5, interval_s=0.1)
        assert traffic.thread.is_alive(), f"the traffic stopped before the kill: {traffic.outcome}"
        leads = cluster.leader_counts()
        victim = max((node for node in leads if node >= 0), key=lambda node: leads[node])
        cluster.kill(victim)
        killed_at = time.monotonic()
        wait_for(lambda: router.received_after(killed_at) == set(POOLS), GAP_BOUND_S, interval_s=0.2,
                 message="a signal of every pool after the kill")
        signals_after_kill = time.monotonic() - killed_at

        # a worker (re)started while the broker is down: no signal is expected while no worker runs
        stopped_at = time.monotonic()
        worker.stop()
        worker = WorkerProcess(settings, tmp_path / "worker-restarted.log")
        worker.start(timeout_s=120)
        started_at = time.monotonic()
        wait_for(lambda: router.received_after(started_at) == set(POOLS), RESTARTED_SIGNALS_S, interval_s=0.2,
                 message="a signal of every pool from the worker started with a broker down")
        signals_after_restart = time.monotonic() - started_at

        wait_for(lambda: time.monotonic() >= killed_at + DOWN_S, DOWN_S + 5, interval_s=0.1)
        restarted_at = time.monotonic()
        cluster.restart(victim)   # returns once the node is registered again (a JVM start: seconds)
        cluster.wait_in_sync(180)  # the restarted node back in every partition's in-sync set
        in_sync_after = time.monotonic() - restarted_at
        wait_for(lambda: time.monotonic() >= restarted_at + in_sync_after + AFTER_IN_SYNC_S, AFTER_IN_SYNC_S + 5,
                 interval_s=0.1)

        traffic.stop(90)
        assert not traffic.thread.is_alive(), "the producer did not finish"
        assert "error" not in traffic.outcome, f"publishing failed: {traffic.outcome.get('error')!r}"
        published = traffic.outcome["counts"].requests
        traffic_ended = time.monotonic()

        raw = [topics.REQUESTS.name(settings), topics.REPLICAS.name(settings)]
        wait_for(lambda: run(group_lag(cluster.bootstrap, topics.landing_group(settings), raw)) == 0, 180,
                 interval_s=1.0, message="the landing path to read everything")
        wait_for(lambda: router.received_after(traffic_ended) == set(POOLS), 30, interval_s=0.5,
                 message="signals after the traffic")
        router.stopping.set()
        router.thread.join(30)
        assert router.error is None, f"the router client failed: {router.error!r}"
        # the longest silence with a worker running: up to its stop, and from the restarted one's first signal
        gaps = router.longest_gap(until=stopped_at)
        gaps_restarted = router.longest_gap(until=traffic_ended, since=started_at)
    finally:
        traffic.stop(30)
        router.stopping.set()
        worker.stop()

    in_log = request_ids_in_log(cluster.bootstrap, topics.REQUESTS.name(settings))
    doubled_in_log = {event_id: n for event_id, n in in_log.items() if n > 1}
    landed = landed_requests(settings)
    print(f"\nfailover: {published} request events published over {traffic_ended - began:.0f} s (every pool "
          f"signalled {ready - began:.1f} s in); node {victim} (leading {leads[victim]} of {sum(leads.values())} "
          f"partitions) killed {killed_at - ready:.1f} s after that, signals of every pool again "
          f"{signals_after_kill:.1f} s after the kill; the worker restarted in {started_at - stopped_at:.1f} s, every "
          f"pool signalled {signals_after_restart:.1f} s after its start; the node restarted "
          f"{restarted_at - killed_at:.1f} s after the kill, "
          f"every partition in sync again {in_sync_after:.1f} s later; in the requests topic {sum(in_log.values())} "
          f"records, {len(in_log)} distinct ids ({len(doubled_in_log)} doubled); landed {landed['rows']} rows, "
          f"{landed['ids']} distinct (lost {published - landed['ids']}, duplicated {landed['rows'] - landed['ids']}); "
          f"longest signal gap per pool {', '.join(f'{p} {g:.1f}s' for p, g in sorted(gaps.items()))}, after the "
          f"worker's restart {', '.join(f'{p} {g:.1f}s' for p, g in sorted(gaps_restarted.items()))} "
          f"(bound {GAP_BOUND_S:.0f} s)")
    assert doubled_in_log == {}, f"{len(doubled_in_log)} event ids written twice to the log"
    assert sum(in_log.values()) == len(in_log) == published
    assert landed == {"rows": published, "ids": published}
    assert set(gaps) == set(gaps_restarted) == set(POOLS)
    assert max(gaps.values()) < GAP_BOUND_S, f"longest silence per pool: {gaps}"
    assert max(gaps_restarted.values()) < GAP_BOUND_S, f"longest silence per pool after the restart: {gaps_restarted}"
