"""A real Prometheus (Debian's binary) scraping a worker through an overload: rules evaluate, alerts fire."""

import asyncio
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
import yaml
from aiokafka import AIOKafkaProducer

from pipeline import topics
from pipeline.sim.specimens import request_event
from pipeline.topics import ensure_topics
from tests.conftest import free_port, wait_for
from tests.integration.test_closed_loop import KEYS, sample

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("prometheus is missing: apt-get install -y --no-install-recommends prometheus")
    return path


@pytest.fixture
def prometheus(tmp_path):
    """Start Prometheus for a worker at ``target``; yields a function that starts it and returns its API base."""
    procs = []

    def start(target: str) -> str:
        rules = tmp_path / "rules"
        rules.mkdir()
        for path in (ROOT / "deploy/prometheus/rules").glob("*.yml"):
            # the rules as written, with `for:` compressed so a test sees `firing` in seconds
            (rules / path.name).write_text(re.sub(r"(\n\s+for: )\S+", r"\g<1>5s", path.read_text()))
        config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(rules / "*.yml")]
        config["scrape_configs"][0]["static_configs"] = [{"targets": [target]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        log = open(tmp_path / "prometheus.log", "wb")
        procs.append(subprocess.Popen(
            [prometheus_binary(), f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT))
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get(f"{base}/-/ready") is not None, 60, message="Prometheus to be ready")
        return base

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(30)


def _get(url: str):
    try:
        return urllib.request.urlopen(url, timeout=2).read()
    except OSError:
        return None


def query(base: str, expr: str) -> list:
    body = _get(f"{base}/api/v1/query?query={urllib.parse.quote(expr)}")
    return json.loads(body)["data"]["result"] if body else []


def firing(base: str, name: str) -> list:
    body = _get(f"{base}/api/v1/alerts")
    alerts = json.loads(body)["data"]["alerts"] if body else []
    return [a for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"]


def test_prometheus_evaluates_recording_rules_and_fires_the_shedding_alert(settings, worker_factory, prometheus):
    s = replace(settings, tick_s=0.25, fast_window_s=2.0, heartbeat_s=1.0, ingest_batch_within_s=0.05,
                signing_keys=KEYS, signing_key_id="test")
    asyncio.run(ensure_topics(s, s.kafka_bootstrap_servers))
    worker = worker_factory(s).start()
    base = prometheus(f"127.0.0.1:{worker.settings.web_port}")

    async def overload(seconds: float) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap_servers)
        await producer.start()
        preemptions, n = 0, 0
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                now = int(time.time() * 1000)
                preemptions += 2
                for replica in ("hot-r0", "hot-r1"):
                    value = orjson.dumps(sample(replica, now, True, preemptions))
                    await producer.send(topics.REPLICAS.name(s), value, key=replica.encode())
                for _ in range(5):
                    n += 1
                    event = request_event(task_id=f"t-{n}", request_id=f"t-{n}-r1", pool="hot", event_time=now,
                                          event_id=str(uuid.uuid4()), ttft_s=3.0 if n % 2 else 0.2,
                                          slo_ttft_s=1.0)
                    await producer.send(topics.REQUESTS.name(s), orjson.dumps(event), key=event["task_id"].encode())
                await asyncio.sleep(0.25)
        finally:
            await producer.stop()

    async def scenario():
        pump = asyncio.create_task(overload(90))
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
