"""The demo a new user runs first: Kafka, a worker, a minute of the trace, and an account of every event."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import replace

from .devstack.kafka import KafkaDevstack, bootstrap_servers
from .pools_view import format_table, latest_pictures
from .settings import Settings
from .worker_process import WorkerProcess


def _step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def run_demo(settings: Settings, seconds: float, rate: float) -> int:
    from .sim.producer import produce
    from .sim.replay import generate, load_trace
    from .sim.specimens import bad_inputs
    from .sinks.store import open_store

    started_kafka = False
    if not settings.kafka_bootstrap_servers:
        _step("Kafka (Apache Kafka, KRaft, fetched from Maven Central on first use)")
        t = time.monotonic()
        devstack = KafkaDevstack(settings)
        started_kafka = devstack.status() != "running"
        info, downloaded = devstack.start()
        print(f"broker {info.version} at {info.bootstrap}, {'downloaded' if downloaded else 'cached'} jars, "
              f"{time.monotonic() - t:.1f}s")
    bootstrap = bootstrap_servers(settings)

    _step("worker (stage-1 ingest, dead letters, landing in ClickHouse)")
    demo_settings = replace(settings, topic_namespace=settings.topic_namespace or "demo",
                            app_id=f"{settings.app_id}-demo", kafka_bootstrap_servers=bootstrap)
    worker = WorkerProcess(demo_settings, settings.state_dir / "demo-worker.log")
    try:
        try:
            worker.start()
        except RuntimeError as exc:
            print(f"sluice demo: {exc}")
            return 1
        print(f"worker pid {worker.pid} healthy at {worker.base_url}/healthz, metrics at {worker.base_url}/metrics")

        _step(f"replaying {seconds:.0f}s of the Azure LLM trace at {rate:g} requests/s, with invalid records mixed in")
        trace = load_trace()
        events = generate(trace, rate, seconds, seed=int(time.time()), start_ms=int(time.time() * 1000))
        catalogue = bad_inputs(settings.max_event_bytes)

        shown = [-1]

        def progress(at: float) -> None:
            step = int(min(1.0, at / seconds) * 40)
            if step != shown[0]:
                shown[0] = step
                print(f"\r[{'#' * step:<40}] {at:5.1f}/{seconds:.0f}s", end="", flush=True)

        produced = asyncio.run(produce(demo_settings, bootstrap, events, paced=True,
                                       bad=catalogue * 2, progress=progress))
        print(f"\rproduced {produced.requests} request events, {produced.replicas} replica samples, "
              f"{produced.bad} invalid records" + " " * 20)

        _step("waiting until every record is accounted for")
        deadline = time.monotonic() + 120
        counts = worker.counts()
        while counts.accepted + counts.dead_lettered < produced.total and time.monotonic() < deadline:
            time.sleep(0.5)
            counts = worker.counts()

        _step("the load picture (`sluice pools`): seven axes per pool, pressure = value ÷ limit")
        time.sleep(2 * demo_settings.tick_s)
        pictures = asyncio.run(latest_pictures(demo_settings, bootstrap))
        print(format_table(pictures, use_colour=sys.stdout.isatty()))
    finally:
        worker.stop()

    store = open_store(demo_settings)
    try:
        landed = {row["t"]: row["n"] for row in store.query(
            "SELECT 'request_events' AS t, count() AS n FROM request_events FINAL "
            "UNION ALL SELECT 'replica_samples', count() FROM replica_samples FINAL")}
    finally:
        store.close()

    _step("result")
    accounted = counts.accepted + counts.dead_lettered
    print(f"{'produced':<28}{produced.total:>10}")
    print(f"{'accepted (landed)':<28}{counts.accepted:>10}")
    print(f"{'dead-lettered':<28}{counts.dead_lettered:>10}")
    for reason, n in sorted(counts.reasons.items()):
        print(f"  {reason:<26}{n:>10}")
    print(f"{'unaccounted':<28}{produced.total - accounted:>10}")
    print(f"rows in the store (all runs): {landed}")
    if started_kafka:
        print("\nKafka is still running for you to explore: `sluice kafka status`, `sluice kafka stop`.")
    return 0 if accounted == produced.total else 1
