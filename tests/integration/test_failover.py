"""A three-broker cluster loses the broker leading the most partitions (kill -9) under steady traffic.

Topics have three replicas and need two in sync; producers send with acks=all and idempotence. While the
broker is down and after it comes back: every published request event lands in the store exactly once,
the router keeps receiving signed signals (the longest silence is bounded and printed), and the restarted
broker rejoins the in-sync set of every partition.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path

import pytest

from pipeline import topics
from pipeline.router.kafka_client import RouterClient
from pipeline.settings import load_settings
from pipeline.sim.producer import produce
from pipeline.sim.replay import Fleet, generate, load_trace
from pipeline.sinks.store import open_store
from pipeline.worker_process import WorkerProcess
from tests.conftest import free_port, run, wait_for
from tests.integration.cluster import three_brokers  # noqa: F401  (fixture)
from tests.integration.kafka_helpers import group_lag

pytestmark = pytest.mark.integration
POOLS = ("pool-a", "pool-b")
RATE, SECONDS = 40, 40             # generate()'s task rate (about 5 events/s each, ~210 events/s), seconds
KILL_AT, RESTART_AT = 10, 25       # seconds into the traffic
SESSION_TIMEOUT_S = 6.0
# The worst silence: the dead broker is fenced after broker.session.timeout.ms (6 s) and its partitions get new
# leaders; a consumer group whose coordinator it was finds the new one, at worst after the worker's session
# timeout (6 s); then the next tick and heartbeat republish (heartbeat_s 2 s), plus metadata refreshes.
GAP_BOUND_S = 6 + SESSION_TIMEOUT_S + 2 + 4


async def replication_of(bootstrap: str, prefixes: tuple[str, ...]) -> dict[str, tuple[int, str]]:
    """topic → (replicas of partition 0, min.insync.replicas) for every topic whose name starts with a prefix."""
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
            configs = {c[0]: c[1] for c in response.resources[0][4]}
            out[name] = (count, configs["min.insync.replicas"])
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

    def longest_gap(self, since: float, until: float) -> dict[str, float]:
        gaps = {}
        for pool, times in list(self.client.arrivals.items()):
            inside = [since] + [t for t in times if since <= t <= until] + [until]
            gaps[pool] = max(b - a for a, b in zip(inside, inside[1:]))
        return gaps

    def received_after(self, moment: float) -> set[str]:
        return {pool for pool, times in list(self.client.arrivals.items()) if any(t > moment for t in times)}


def test_killing_the_busiest_broker_loses_and_duplicates_nothing_and_signals_go_on(three_brokers, tmp_path: Path):
    cluster = three_brokers
    namespace = "f" + uuid.uuid4().hex[:10]
    settings = load_settings(env={}, kafka_bootstrap_servers=cluster.bootstrap, topic_namespace=namespace,
                             app_id=f"sluice-{namespace}", state_dir=str(tmp_path / "state"), web_port=free_port(),
                             retention_days=0, max_event_age_s=0, dev_signing_key=True,
                             topic_replication_factor=3, topic_min_insync_replicas=2, topic_partitions=4,
                             tick_s=0.25, session_timeout_s=SESSION_TIMEOUT_S, allowed_lateness_s=120.0)
    run(topics.ensure_topics(settings, cluster.bootstrap))
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    router = RouterThread(settings)
    try:
        worker.start(timeout_s=120)
        replication = run(replication_of(cluster.bootstrap, (namespace, settings.app_id)))
        assert f"{settings.app_id}-pool_partials-changelog" in replication
        assert {name for name, rf in replication.items() if rf != (3, "2")} == set(), replication
        router.thread.start()
        events = list(generate(load_trace(), rate=RATE, seconds=SECONDS, seed=11,
                               start_ms=int(time.time() * 1000), fleet=Fleet(pools=POOLS)))
        requests = [e for e in events if e.kind == "request"]
        outcome: dict = {}

        def publish() -> None:
            try:
                outcome["counts"] = run(produce(settings, cluster.bootstrap, events, paced=True))
            except BaseException as exc:  # asserted below
                outcome["error"] = exc

        producer = threading.Thread(target=publish, daemon=True)
        began = time.monotonic()
        producer.start()
        wait_for(lambda: router.received_after(began) == set(POOLS), 60, interval_s=0.5,
                 message="signals of every pool before the kill")

        wait_for(lambda: time.monotonic() - began >= KILL_AT, KILL_AT + 30, interval_s=0.2)
        leads = cluster.leader_counts()
        victim = max((node for node in leads if node >= 0), key=lambda node: leads[node])
        cluster.kill(victim)
        killed_at = time.monotonic()

        wait_for(lambda: time.monotonic() - began >= RESTART_AT, RESTART_AT + 30, interval_s=0.2)
        assert router.received_after(killed_at + 1) == set(POOLS), "no signal reached the router after the kill"
        restarted_at = time.monotonic()
        cluster.restart(victim)   # returns once the node is registered again (a JVM start: seconds)
        cluster.wait_in_sync(180)  # the restarted node back in every partition's in-sync set
        in_sync_after = time.monotonic() - restarted_at

        producer.join(SECONDS + 90)
        assert not producer.is_alive(), "the producer did not finish"
        assert "error" not in outcome, f"publishing failed: {outcome.get('error')!r}"
        assert outcome["counts"].requests == len(requests)
        traffic_ended = time.monotonic()

        raw = [topics.REQUESTS.name(settings), topics.REPLICAS.name(settings)]
        wait_for(lambda: run(group_lag(cluster.bootstrap, topics.landing_group(settings), raw)) == 0, 180,
                 interval_s=1.0, message="the landing path to read everything")
        wait_for(lambda: router.received_after(traffic_ended) == set(POOLS), 30, interval_s=0.5,
                 message="signals after the traffic")
        router.stopping.set()
        router.thread.join(30)
        assert router.error is None, f"the router client failed: {router.error!r}"
        gaps = router.longest_gap(since=began + 5, until=traffic_ended)
    finally:
        router.stopping.set()
        worker.stop()

    store = open_store(settings)
    try:
        landed, = store.query("SELECT count() AS rows, uniqExact(event_id) AS ids FROM request_events")
    finally:
        store.close()
    print(f"\nfailover: {len(requests)} request events ({len(events)} events) over {SECONDS} s; node {victim} "
          f"(leading {leads[victim]} of {sum(leads.values())} partitions) killed at {killed_at - began:.1f} s, "
          f"restarted at {restarted_at - began:.1f} s, every partition in sync again {in_sync_after:.1f} s later; "
          f"landed {landed['rows']} rows, {landed['ids']} distinct "
          f"(lost {len(requests) - landed['ids']}, duplicated {landed['rows'] - landed['ids']}); "
          f"longest signal gap per pool {', '.join(f'{p} {g:.1f}s' for p, g in sorted(gaps.items()))} "
          f"(bound {GAP_BOUND_S:.0f} s)")
    assert landed == {"rows": len(requests), "ids": len(requests)}
    assert set(gaps) == set(POOLS)
    assert max(gaps.values()) < GAP_BOUND_S, f"longest silence per pool: {gaps}"
