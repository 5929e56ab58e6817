"""tests/containers.py: the container Kafka cluster (three locally built brokers that take acks=all writes,
survive a SIGKILLed node and take it back into every ISR) and the container Prometheus."""

from __future__ import annotations

import asyncio
import http.server
import json
import shutil
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
import yaml
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from tests import containers
from tests.containers import sluice_images  # noqa: F401  (the session fixture)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not containers.engine_answers(),
                                 reason="no Docker engine answers `docker info` (deploy/prerequisites.sh starts one)")]


@pytest.fixture
def container_cluster(sluice_images):
    cluster = containers.ContainerKafkaCluster(brokers=3)
    started = time.monotonic()
    try:
        cluster.start()
        print(f"\ncontainer cluster: three brokers up in {time.monotonic() - started:.0f}s")
        yield cluster
    finally:
        cluster.stop()


async def _create(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 3, 3, topic_configs={"min.insync.replicas": "2"})])
    finally:
        await admin.close()


async def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True,
                                request_timeout_ms=15000, retry_backoff_ms=200)
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(topic, value, key=value[-1:])
    finally:
        await producer.stop()


async def _consume(bootstrap: str, topic: str, expected: int, timeout_s: float) -> list[bytes]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False, group_id=None)
    await consumer.start()
    seen: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(seen) < expected and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            seen += [m.value for records in batch.values() for m in records]
        return seen
    finally:
        await consumer.stop()


def test_three_brokers_take_acks_all_survive_a_kill_and_the_node_rejoins(container_cluster):
    cluster = container_cluster
    assert len(cluster.bootstrap.split(",")) == 3
    assert all(host.startswith("127.0.0.1:") for host in cluster.bootstrap.split(","))
    topic = f"containers-{uuid.uuid4().hex[:8]}"
    asyncio.run(_create(cluster.bootstrap, topic))
    cluster.wait_in_sync(60)

    before = [f"before-{i}".encode() for i in range(200)]
    asyncio.run(_produce(cluster.bootstrap, topic, before))

    victim = max(cluster.leader_counts().items(), key=lambda kv: kv[1])[0]
    killed_at = time.monotonic()
    cluster.kill(victim)
    during = [f"during-{i}".encode() for i in range(200)]
    asyncio.run(_produce(cluster.bootstrap, topic, during))  # acks=all with 2 of 3 in sync (min ISR 2)
    writes_after_kill = time.monotonic() - killed_at

    cluster.restart(victim)
    restarted_at = time.monotonic()
    cluster.wait_in_sync(120)
    rejoined = time.monotonic() - restarted_at
    assert cluster.leader_counts()[victim] >= 0

    seen = asyncio.run(_consume(cluster.bootstrap, topic, len(before) + len(during), 60))
    assert sorted(seen) == sorted(before + during)
    print(f"\ncontainer cluster: node {victim} killed; 200 acks=all writes took {writes_after_kill:.1f}s, "
          f"back in every ISR {rejoined:.1f}s after restart")


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = b"# TYPE sluice_container_probe gauge\nsluice_container_probe 1\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_container_prometheus_loads_the_repo_rules_and_scrapes_the_host(tmp_path, sluice_images):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rules = tmp_path / "rules"
    shutil.copytree(ROOT / "deploy/prometheus/rules", rules)
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(rules / "*.yml")]  # by host path, as tests/integration/prometheus_fixture.py does
    config["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{server.server_address[1]}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus = containers.ContainerPrometheus(tmp_path / "prometheus.yml", rules)
    try:
        def get(path):
            return json.loads(urllib.request.urlopen(prometheus.base_url + path, timeout=3).read())["data"]

        assert prometheus.base_url.startswith("http://127.0.0.1:")
        groups = get("/api/v1/rules")["groups"]
        assert {g["name"] for g in groups} >= {"sluice-recording"}
        deadline = time.monotonic() + 30
        while not get("/api/v1/query?query=sluice_container_probe")["result"]:
            assert time.monotonic() < deadline, "the probe was never scraped"
            time.sleep(0.5)
    finally:
        prometheus.stop()
        server.shutdown()
