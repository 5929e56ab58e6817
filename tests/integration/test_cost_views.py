"""The analyst views over events landed through the real pipeline, checked against an independent
Python computation: cost per successful task to the cent, quantiles within the state's error."""

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from pipeline.cost import price_table
from pipeline.sim.producer import produce
from pipeline.sim.replay import generate, load_trace
from pipeline.sinks.rollup import PENDING_SQL
from pipeline.worker_process import worker_env
from tests.conftest import run, wait_for
from tests.cost_reference import TERMINAL, cache_savings, cached, cost_per_successful_task, quantile_bounds
from tests.integration.test_query import sluice_query

pytestmark = pytest.mark.integration
START_MS = 1_700_002_400_000  # 22:53:20 UTC: ten minutes of traffic cross an hour boundary
CENT = 0.005


def sluice_report(settings, *args):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "report", *args], env=worker_env(settings),
                          capture_output=True, text=True, timeout=60)


def pending(settings) -> int:
    out = sluice_query(settings, PENDING_SQL, "--format", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)[0]["pending"]


def test_cost_and_latency_views_match_an_independent_computation(settings, worker_factory):
    events = list(generate(load_trace(), rate=8, seconds=600, seed=5, start_ms=START_MS))
    requests = [e.event for e in events if e.kind == "request"]
    samples = [e.event for e in events if e.kind == "replica"]
    worker = worker_factory().start()
    run(produce(settings, settings.kafka_bootstrap_servers, events, paced=False))
    wait_for(lambda: worker.counts().accepted >= len(events), 120, message="every event to land")
    wait_for(lambda: pending(worker.settings) == 0, 30,
             message="pool_minute to roll up every terminal attempt (sink_rollup_interval_s)")

    view = sluice_query(worker.settings, "SELECT pool, tenant, toUnixTimestamp(hour) * 1000 AS hour_ms, "
                        "fleet_cost_usd, waste_cost_usd, completed_tasks, successful_tasks, "
                        "successful_tasks_cost_usd, cost_per_successful_task_usd, "
                        "attributed_cost_per_successful_task_usd, waste_share "
                        "FROM cost_per_successful_task ORDER BY pool, tenant, hour", "--format", "json")
    assert view.returncode == 0, view.stderr
    report = sluice_report(worker.settings, "--format", "json")
    assert report.returncode == 0, report.stderr
    table = sluice_report(worker.settings)
    quantiles = sluice_query(worker.settings, "SELECT pool, quantilesBFloat16Merge(0.5, 0.95, 0.99)(ttft_state) AS "
                             "ttft, quantilesBFloat16Merge(0.5, 0.95, 0.99)(tpot_state) AS tpot FROM pool_minute "
                             "GROUP BY pool ORDER BY pool", "--format", "json")
    worker.stop()

    share = settings.cached_input_cost_share
    expected = cost_per_successful_task(requests, samples, price_table({}), settings.replica_stale_after_s, share)
    saved = cache_savings(requests, samples, price_table({}), settings.replica_stale_after_s, share)
    got = {(r["pool"], r["tenant"], r["hour_ms"]): r for r in json.loads(view.stdout)}
    assert set(got) == set(expected)
    assert len({k[2] for k in got}) == 2, "the traffic spans two hours"
    for key, want in expected.items():
        row = got[key]
        for column in ("completed_tasks", "successful_tasks"):
            assert row[column] == want[column], (key, column)
        for column in ("fleet_cost_usd", "waste_cost_usd", "successful_tasks_cost_usd",
                       "cost_per_successful_task_usd", "attributed_cost_per_successful_task_usd"):
            if want[column] is None:
                assert row[column] is None, (key, column)
            else:
                assert abs(row[column] - want[column]) < CENT, (key, column, row[column], want[column])
        if want["waste_share"] is not None:
            assert abs(row["waste_share"] - want["waste_share"]) < 1e-6, key

    fleet_total = sum(r["fleet_cost_usd"] for r in expected.values())
    assert fleet_total > 0 and any(r["waste_cost_usd"] > 0 for r in expected.values())

    by_pool = defaultdict(lambda: [0.0, 0])
    for (pool, _, _), r in expected.items():
        by_pool[pool][0] += r["fleet_cost_usd"]
        by_pool[pool][1] += r["successful_tasks"]
    reported = {r["pool"]: r for r in json.loads(report.stdout)}
    assert set(reported) == set(by_pool)
    for pool, (cost, successful) in by_pool.items():
        assert abs(reported[pool]["cost_per_successful_task_usd"] - cost / successful) < CENT
        assert reported[pool]["slo_successful_tasks"] == successful
        pool_saved = sum(v for (p, _), v in saved.items() if p == pool)
        assert pool_saved > 0, "the trace's prompts hit the prefix cache: the saving is positive"
        assert abs(reported[pool]["cache_saved_per_successful_task_usd"] - pool_saved / successful) < 1e-5
        billed = [e for e in requests if e["pool"] == pool and e["phase"] in TERMINAL]
        share_hit = sum(cached(e) for e in billed) / sum(e.get("input_tokens") or 0 for e in billed)
        assert abs(reported[pool]["cache_hit_share"] - share_hit) < 1e-4
    assert table.stdout.splitlines()[0].split()[:3] == ["pool", "requests", "success_rate"]

    for row in json.loads(quantiles.stdout):
        completed = [e for e in requests if e["pool"] == row["pool"] and e["phase"] == "completed"]
        for name in ("ttft", "tpot"):
            values = [e[f"{name}_s"] for e in completed]
            for q, value in zip((0.5, 0.95, 0.99), row[name]):
                lo, hi = quantile_bounds(values, q)
                assert lo <= value <= hi, (row["pool"], name, q, value, lo, hi)
    print("\n" + table.stdout)
