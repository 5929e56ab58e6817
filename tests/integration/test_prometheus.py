"""A real Prometheus (Debian's binary) scraping a worker through an overload: rules evaluate, alerts fire."""

import asyncio

import pytest

from tests.integration.prometheus_fixture import firing, overload, prometheus, query, scraped_worker  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration


def test_prometheus_evaluates_recording_rules_and_fires_the_shedding_alert(settings, worker_factory, prometheus):
    s, base = scraped_worker(settings, worker_factory, prometheus)

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
