"""A real Prometheus (Debian's binary) scraping a worker through an overload: rules evaluate, alerts fire."""

import asyncio
from dataclasses import replace

import pytest

from pipeline.topics import ensure_topics
from tests.integration.prometheus_fixture import firing, overload, prometheus, query  # noqa: F401 (fixture)
from tests.integration.test_closed_loop import KEYS

pytestmark = pytest.mark.integration


def test_prometheus_evaluates_recording_rules_and_fires_the_shedding_alert(settings, worker_factory, prometheus):
    s = replace(settings, tick_s=0.25, fast_window_s=2.0, heartbeat_s=1.0, ingest_batch_within_s=0.05,
                signing_keys=KEYS, signing_key_id="test")
    asyncio.run(ensure_topics(s, s.kafka_bootstrap_servers))
    worker = worker_factory(s).start()
    base = prometheus(f"127.0.0.1:{worker.settings.web_port}")

    async def scenario():
        pump = asyncio.create_task(overload(s, 90))
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 80
            recorded = shedding = None
            while loop.time() < deadline and not (recorded and shedding):
                recorded = recorded or [r for r in query(base, "sluice:ttft_slo_miss_ratio:rate5m")
                                        if r["metric"].get("pool") == "hot"]
                shedding = shedding or firing(base, "SluiceStandardShedding")
                await asyncio.sleep(0.5)
            return recorded, shedding
        finally:
            pump.cancel()

    recorded, shedding = asyncio.run(scenario())
    faust_series = query(base, 'count({__name__=~"sluice_faust_.+"})')
    assert faust_series and float(faust_series[0]["value"][1]) > 0, "Faust's own sensors are exported"
    assert recorded, "the TTFT miss-ratio recording rule evaluated for the pool"
    assert 0.3 < float(recorded[0]["value"][1]) < 0.7, recorded
    assert shedding and shedding[0]["labels"]["pool"] == "hot"
    assert shedding[0]["annotations"]["runbook_url"] == "docs/runbook.md#standard-shedding"
