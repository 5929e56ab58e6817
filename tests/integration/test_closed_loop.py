"""Closed loop through the real broker: samples → worker → signed signals → a router client deciding."""

import asyncio
import math
import time
import uuid
from dataclasses import replace

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from pipeline import topics
from pipeline.admission.policy import SHED_ORDER, config_from
from pipeline.router import Admit, Request, RouterClient
from pipeline.topics import ensure_topics

pytestmark = pytest.mark.integration

KEYS = {"test": "closed-loop-test-secret-0123"}
POLICY = {"step_down": 0.15, "level_step_down": 0.15}


def sample(replica, now_ms, overloaded, preemptions):
    return {"schema_version": 1, "event_id": str(uuid.uuid4()), "event_time": now_ms, "replica_id": replica,
            "pool": "hot", "hardware": "H100-80GB", "gpu_count": 4, "requests_running": 16,
            "requests_waiting": 40 if overloaded else 0, "kv_cache_usage": 0.99 if overloaded else 0.3,
            "preemptions_total": preemptions, "prompt_tokens_total": 0, "generation_tokens_total": 0,
            "prefix_cache_hits_total": 0, "prefix_cache_queries_total": 0, "healthy": True}


@pytest.fixture
def loop_settings(settings):
    return replace(settings, tick_s=0.25, fast_window_s=2.0, heartbeat_s=1.0, ingest_batch_within_s=0.05,
                   signing_keys=KEYS, signing_key_id="test", admission_policy=POLICY)


def test_overload_sheds_in_order_within_2s_and_recovers(loop_settings, worker_factory):
    s = loop_settings
    asyncio.run(ensure_topics(s, s.kafka_bootstrap_servers))
    worker_factory(s).start()
    config = config_from(POLICY)

    async def scenario():
        router = RouterClient(s, s.kafka_bootstrap_servers, {k: v.encode() for k, v in KEYS.items()}, seed=1)
        await router.start()
        seen = []
        offer = router.book.offer
        router.book.offer = lambda m: (offer(m) and seen.append(orjson.loads(m))) or True
        producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap_servers)
        await producer.start()
        phase = {"overloaded": False}
        preemptions = {"hot-r0": 0, "hot-r1": 0}

        async def fleet():
            while True:
                now = int(time.time() * 1000)
                for replica in preemptions:
                    if phase["overloaded"]:
                        preemptions[replica] += 2
                    value = orjson.dumps(sample(replica, now, phase["overloaded"], preemptions[replica]))
                    await producer.send(topics.REPLICAS.name(s), value, key=replica.encode())
                await asyncio.sleep(0.25)

        def sheddable_fraction():
            signal = router.book.signals.get("hot")
            return None if signal is None else signal["admit_fraction"]["sheddable"]

        async def until(condition, timeout_s):
            deadline = time.monotonic() + timeout_s
            while not condition():
                assert time.monotonic() < deadline, "timed out"
                await asyncio.sleep(0.02)
            return time.monotonic()

        pump = asyncio.create_task(fleet())
        try:
            await until(lambda: sheddable_fraction() == 1.0, 30)            # calm: a signal, admitting all
            assert isinstance(router.decide(Request("hot", "sheddable")), Admit)
            phase["overloaded"] = True
            overloaded_at = time.monotonic()
            shed_at = await until(lambda: (sheddable_fraction() or 1.0) < 1.0, 10)
            verdicts = [router.decide(Request("hot", "sheddable")) for _ in range(200)]
            assert any(not isinstance(v, Admit) for v in verdicts)
            await asyncio.sleep(2.0)
            phase["overloaded"] = False
            calm_at = time.monotonic()
            levels = len(SHED_ORDER) - config.critical_floor
            bound = s.fast_window_s + math.ceil(levels / min(config.step_down, config.level_step_down)) * s.tick_s + 2.0
            recovered_at = await until(lambda: router.book.signals["hot"]["admit_fraction"]["deferrable"] == 1.0,
                                       bound + 10)
        finally:
            pump.cancel()
            await producer.stop()
            await router.stop()
        return shed_at - overloaded_at, recovered_at - calm_at, bound, seen

    shed_after, recovered_after, bound, seen = asyncio.run(scenario())
    print(f"\nclosed loop: shed {shed_after:.2f}s after the first overloaded sample, "
          f"recovered {recovered_after:.2f}s after load fell (bound {bound:.2f}s), {len(seen)} signals")
    assert shed_after <= 2.0
    assert recovered_after <= bound
    for signal in seen:
        fractions = signal["admit_fraction"]
        if fractions["critical"] < 1.0:
            assert all(fractions[c] == 0.0 for c in ("deferrable", "sheddable", "standard")), signal
    assert max(s["seq"] for s in seen) == seen[-1]["seq"]
