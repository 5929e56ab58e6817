"""A real Prometheus (Debian's binary) for integration tests, and the overload traffic that gives it something
to say. Shared by test_prometheus.py (rules and alerts) and test_dashboard.py (every dashboard query).

Test modules import the ``prometheus`` fixture by name (``from tests.integration.prometheus_fixture import
prometheus``), which makes pytest register it there.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import urllib.error
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
from pipeline.settings import Settings
from pipeline.sim.specimens import request_event
from tests import containers
from tests.conftest import free_port, wait_for
from tests.integration.test_closed_loop import KEYS, sample

ROOT = Path(__file__).resolve().parents[2]


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("prometheus is missing: apt-get install -y --no-install-recommends prometheus")
    return path


@pytest.fixture
def prometheus(tmp_path):
    """Start Prometheus for a worker at ``target``; yields a function that starts it and returns its API base.

    In a container (testcontainers, host network) when a Docker engine answers, else Debian's binary.

    deploy/prometheus/prometheus.yml and rules/*.yml as written, except: the target (a local worker), 1 s
    scrape and evaluation intervals, and every ``for:`` compressed to 5 s so a test sees ``firing`` in seconds.
    """
    stoppers = []

    def start(target: str) -> str:
        rules = tmp_path / "rules"
        rules.mkdir()
        for path in (ROOT / "deploy/prometheus/rules").glob("*.yml"):
            (rules / path.name).write_text(re.sub(r"(\n\s+for: )\S+", r"\g<1>5s", path.read_text()))
        config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(rules / "*.yml")]
        config["scrape_configs"][0]["static_configs"] = [{"targets": [target]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        if containers.engine_answers():
            server = containers.ContainerPrometheus(tmp_path / "prometheus.yml", rules)
            stoppers.append(server.stop)
            return server.base_url
        port = free_port()
        log = open(tmp_path / "prometheus.log", "wb")
        proc = subprocess.Popen(
            [prometheus_binary(), f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT)
        stoppers.append(lambda: (proc.terminate(), proc.wait(30)))
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: get(f"{base}/-/ready") is not None, 60, message="Prometheus to be ready")
        return base

    yield start
    for stop in stoppers:
        stop()


def scraped_worker(settings: Settings, worker_factory, prometheus) -> tuple[Settings, str]:
    """A worker with quick ticks and test keys, its topics made, and a Prometheus scraping it: (settings, API base)."""
    s = replace(settings, tick_s=0.25, fast_window_s=2.0, heartbeat_s=1.0, ingest_batch_within_s=0.05,
                signing_keys=KEYS, signing_key_id="test")
    asyncio.run(topics.ensure_topics(s, s.kafka_bootstrap_servers))
    worker = worker_factory(s).start()
    return s, prometheus(f"127.0.0.1:{worker.settings.web_port}")


def get(url: str):
    try:
        return urllib.request.urlopen(url, timeout=2).read()
    except OSError:
        return None


def query(base: str, expr: str) -> list:
    body = get(f"{base}/api/v1/query?query={urllib.parse.quote(expr)}")
    return json.loads(body)["data"]["result"] if body else []


def query_status(base: str, expr: str) -> dict:
    """The API's whole answer to an instant query, errors included (``status``, ``errorType``, ``error``)."""
    url = f"{base}/api/v1/query?query={urllib.parse.quote(expr)}"
    try:
        return json.loads(urllib.request.urlopen(url, timeout=5).read())
    except urllib.error.HTTPError as exc:   # 400/422: a bad expression, with the reason in the body
        return json.loads(exc.read())
    except OSError as exc:
        return {"status": "error", "errorType": "unreachable", "error": str(exc)}


def firing(base: str, name: str) -> list:
    body = get(f"{base}/api/v1/alerts")
    alerts = json.loads(body)["data"]["alerts"] if body else []
    return [a for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"]


async def overload(s: Settings, seconds: float, pool: str = "hot",
                   bad: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """Pool ``pool`` overloaded for ``seconds``: two replicas with a full KV cache and rising preemptions,
    20 completed tasks/s of which half miss their 1 s TTFT SLO; each of ``bad`` (key, raw value) is sent once a
    second to the requests topic, to be dead-lettered."""
    producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap_servers)
    await producer.start()
    preemptions, n = 0, 0
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            now = int(time.time() * 1000)
            preemptions += 2
            for replica in (f"{pool}-r0", f"{pool}-r1"):
                value = dict(sample(replica, now, True, preemptions), pool=pool)
                await producer.send(topics.REPLICAS.name(s), orjson.dumps(value), key=replica.encode())
            for _ in range(5):
                n += 1
                event = request_event(task_id=f"t-{n}", request_id=f"t-{n}-r1", pool=pool, event_time=now,
                                      event_id=str(uuid.uuid4()), ttft_s=3.0 if n % 2 else 0.2, slo_ttft_s=1.0)
                await producer.send(topics.REQUESTS.name(s), orjson.dumps(event), key=event["task_id"].encode())
            if n % 20 == 0:
                for key, value in bad:
                    await producer.send(topics.REQUESTS.name(s), value, key=key)
            await asyncio.sleep(0.25)
    finally:
        await producer.stop()
