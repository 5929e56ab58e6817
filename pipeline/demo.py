"""The demo a new user runs first: a replica-loss incident, through the real pipeline.

Kafka, a worker with the embedded ClickHouse store, and the fleet simulator
in real time: 30% of the replicas die while the pool runs at 0.9 of its SLO
capacity. The simulated routers obey the signed signals the worker
publishes. Then the same scenario runs in-process without control, with the
fixed-threshold baseline and with Sluice's pure core; the demo prints the
comparison, writes a chart, and prints ``sluice report`` from ClickHouse.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import replace

from .devstack.kafka import KafkaDevstack, bootstrap_servers
from .query_client import render
from .settings import Settings
from .worker_process import WorkerProcess

COLUMNS = ("controller", "slo_goodput", "capacity_share", "attain_critical", "attain_standard", "attain_sheddable",
           "usd_per_1k_slo_tasks", "waste_share", "ttft_p99_s", "state_changes", "n_completed", "n_rejected")


def _step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def run_demo(settings: Settings, seconds: float = 180.0) -> int:
    from .cost import price_table
    from .query_client import run_query
    from .report import pool_report
    from .sinks.rollup import PENDING_SQL
    from .sim.chart import ChartsUnavailable
    from .sim.live import console_display, run_live
    from .sim.scenarios import (POOL, SCENARIOS, Fleet, draw, reference_capacity, run_controllers, slo_capacity,
                                sluice_settings)

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

    fleet = Fleet(duration_s=seconds, drain_s=90.0)
    lose_at, back_at = round(seconds / 3), round(seconds * 5 / 6)
    scenario = replace(SCENARIOS["replica-loss"], lose_at_s=lose_at, back_at_s=back_at,
                       description=f"0.9× capacity; 30% of replicas lost at {lose_at} s, back cold at {back_at} s")
    _step("measuring the simulated pool's SLO capacity (what a load test would find)")
    capacity = slo_capacity(fleet, fleet.replicas)
    print(f"{fleet.replicas} × {fleet.hardware.name}: {capacity.tasks_per_s:.1f} tasks/s keep 99% of every class "
          f"within its TTFT SLO; the pool's profile gets {capacity.requests_per_s_per_replica:.2f} requests/s and "
          f"{capacity.peak_tokens_per_s_per_replica:.0f} peak tokens/s per replica")

    namespace = settings.topic_namespace or f"demo{int(time.time())}"
    # a local demonstration: the development signing key unless keys are configured
    demo_settings = replace(sluice_settings(capacity, settings), topic_namespace=namespace,
                            app_id=f"{settings.app_id}-{namespace}", kafka_bootstrap_servers=bootstrap,
                            dev_signing_key=not settings.signing_keys)
    if not settings.clickhouse_url:
        # the embedded store of this run alone (the last run's is replaced): a report over every earlier
        # demo's rows would mix their controllers' outcomes into this one's
        store = settings.state_dir / "demo" / "store"
        shutil.rmtree(store, ignore_errors=True)
        demo_settings = replace(demo_settings, chdb_path=str(store))
    _step("worker (ingest, load picture, admission signals, landing in the embedded ClickHouse)")
    worker = WorkerProcess(demo_settings, settings.state_dir / "demo-worker.log")
    try:
        try:
            worker.start()
        except RuntimeError as exc:
            print(f"sluice demo: {exc}")
            return 1
        print(f"worker pid {worker.pid} healthy at {worker.base_url}/healthz, metrics at {worker.base_url}/metrics")

        _step(f"replica-loss through the real pipeline, in real time ({seconds:.0f} s + drain): "
              f"{scenario.description}")
        display = console_display(seconds, POOL)
        live_sim, live = asyncio.run(run_live(demo_settings, scenario, fleet, capacity, bootstrap, display))

        _step("the same scenario in-process: no control, the fixed threshold, Sluice's pure core")
        runs = run_controllers(scenario, fleet, capacity, demo_settings)
        runs["sluice (pipeline)"] = (live_sim, live)
        reference = reference_capacity(scenario, fleet)
        price = price_table(demo_settings.gpu_prices).get(fleet.hardware.name, 0.0)
        rows = [outcome.row("replica-loss", label, reference.slo_goodput, price,
                            getattr(sim.controller, "state_changes", 0)) for label, (sim, outcome) in runs.items()]
        print(render([{k: r[k] for k in COLUMNS} for r in rows], "table"))
        print(f"capacity_share = SLO-goodput ÷ the SLO capacity of the replicas left "
              f"({reference.slo_goodput:.1f} SLO-successful tasks/s)")
        chart = settings.state_dir / "demo" / "replica-loss.png"
        chart.parent.mkdir(parents=True, exist_ok=True)
        try:
            draw(chart, "replica-loss: sluice vs baselines", {label: sim for label, (sim, _) in runs.items()},
                 seconds, scenario, fleet.replicas)
            print(f"chart: {chart}")
        except ChartsUnavailable as exc:
            print(f"chart: skipped, {exc}")

        _step("`sluice report`, from ClickHouse")
        expected = live_sim.stats.published
        deadline = time.monotonic() + 60
        while worker.counts().accepted < expected and time.monotonic() < deadline:
            time.sleep(0.5)
        while time.monotonic() < deadline and \
                run_query(demo_settings, PENDING_SQL, f"{worker.base_url}/query")[0][0]["pending"] > 0:
            time.sleep(0.5)   # pool_minute trails landing by up to sink_rollup_interval_s
        counts = worker.counts()
        print(f"{expected} events published by the simulator, {counts.accepted} landed, "
              f"{counts.dead_lettered} dead-lettered")
        print(render(pool_report(demo_settings, url=f"{worker.base_url}/query"), "table"))
    finally:
        worker.stop()
    if started_kafka:
        print("\nKafka is still running for you to explore: `sluice kafka status`, `sluice kafka stop`.")
    signalled = bool(live_sim.controller.states)
    if not signalled:
        print(f"sluice demo: the routers never received an admission signal for {POOL}; "
              f"see {settings.state_dir / 'demo-worker.log'}")
    return 0 if counts.accepted >= expected and signalled else 1
