"""Every query of the Grafana dashboard, against a real Prometheus scraping a real worker through an overload.

Grafana cannot run here, so the dashboard's PromQL is run the way Grafana would: variables substituted
(``$pool`` as a user picking the overloaded pool, ``$__rate_interval`` as Grafana computes it for a 1 s
scrape), each expression must evaluate without error and return at least one series before a deadline
(rates need two scrapes, alerts their ``for:``).
"""

import asyncio
import json
import urllib.parse

import orjson
import pytest

from pipeline.sim.specimens import request_event
from tests.integration.prometheus_fixture import get, overload, prometheus, query_status, scraped_worker  # noqa: F401 (fixture)
from tests.unit.test_dashboard import DASHBOARD, queries

pytestmark = pytest.mark.integration

# dead-lettered every second, so the dead-letter panels have reasons to show
BAD = tuple((b"task-1", value) for value in (b"{not json", orjson.dumps(request_event(ttft_s="slow")),
                                             orjson.dumps(dict(request_event(), colour="red"))))


def test_every_dashboard_query_evaluates_and_returns_series(settings, worker_factory, prometheus):
    s, base = scraped_worker(settings, worker_factory, prometheus)
    # Grafana's $__rate_interval: max($__interval + scrape interval, 4 × scrape interval); 10 s for a short range
    pending = dict(queries(pool="hot", rate_interval="10s", interval="1s", range_="5m"))
    answers: dict[str, dict] = {}

    async def scenario():
        pump = asyncio.create_task(overload(s, 150, bad=BAD))
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 120
            while pending and loop.time() < deadline:
                for where, expr in list(pending.items()):
                    answer = await asyncio.to_thread(query_status, base, expr)
                    answers[where] = answer
                    assert answer["status"] == "success", f"{where}: {expr} → {answer}"
                    if answer["data"]["result"]:
                        del pending[where]
                await asyncio.sleep(1.0)
        finally:
            pump.cancel()

    asyncio.run(scenario())
    assert not pending, "no series before the deadline for:\n" + "\n".join(
        f"{where}: {expr} → {answers.get(where)}" for where, expr in pending.items())

    pool = next(v for v in DASHBOARD["templating"]["list"] if v["name"] == "pool")
    metric = pool["definition"].split("(")[1].split(",")[0]
    body = get(f"{base}/api/v1/label/pool/values?match[]={urllib.parse.quote(metric)}")
    assert "hot" in json.loads(body)["data"], "the pool variable lists the pool"
    alerts = [r["metric"] for r in query_status(base, expr_of(queries(pool="hot", rate_interval="10s"),
                                                                  "Alerts firing / A"))["data"]["result"]]
    assert any(a["alertname"] == "SluiceStandardShedding" and a.get("pool") == "hot" for a in alerts), alerts
    dead = query_status(base, expr_of(queries(pool="hot", rate_interval="30s"), "Dead letters by reason / A"))
    reasons = {r["metric"]["reason"] for r in dead["data"]["result"]}
    assert {"malformed_json", "wrong_type", "unknown_field"} <= reasons, reasons


def expr_of(pairs: list[tuple[str, str]], where: str) -> str:
    """The query of panel / refId ``where``."""
    return dict(pairs)[where]
