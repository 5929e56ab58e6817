"""docker-compose.yml + deploy/compose/local.yml, brought up for real: three brokers, a control and a landing
worker and Prometheus in locally built containers (host networking, every port on 127.0.0.1); traffic in,
signed admission signals out, rows landed, both workers scraped; then `down -v`."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import orjson
import pytest
import yaml
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from pipeline.admission.signing import SignatureError, verify
from pipeline.query_client import QueryFailed, run_query
from pipeline.settings import load_settings
from pipeline.sim.specimens import replica_sample, request_event
from tests import containers
from tests.conftest import wait_for
from tests.containers import sluice_images  # noqa: F401  (the session fixture)
from tests.integration.prometheus_fixture import get, query

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not containers.engine_answers(),
                                 reason="no Docker engine answers `docker info` (deploy/prerequisites.sh starts one)")]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = ["kafka-1", "kafka-2", "kafka-3", "control", "landing", "prometheus"]
POOL = "compose-pool"
REQUESTS = 300


def compose_command() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    pytest.fail("neither docker-compose nor the docker compose plugin is installed: run deploy/prerequisites.sh "
                "(apt-get install -y docker-compose)")


def _worker_env() -> dict:
    return COMPOSE["x-worker-env"]



@pytest.fixture
def stack(tmp_path, sluice_images):
    """The compose project, up; yields its ports. Always `down -v`, with the logs printed on failure."""
    tags = sluice_images
    ports: dict[str, int] = {}
    used: set[int] = set()
    for name in ("kafka_1", "kafka_1_controller", "kafka_2", "kafka_2_controller", "kafka_3",
                 "kafka_3_controller", "control", "landing", "prometheus"):
        port = containers.free_port()
        while port in used:
            port = containers.free_port()
        used.add(port)
        ports[name] = port
    config = yaml.safe_load((ROOT / "deploy/compose/prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["scrape_configs"][0]["static_configs"] = [
        {"targets": [f"127.0.0.1:{ports['control']}", f"127.0.0.1:{ports['landing']}"]}]
    prometheus_yml = tmp_path / "prometheus.yml"
    prometheus_yml.write_text(yaml.safe_dump(config))
    env = {
        "SLUICE_KAFKA_IMAGE": tags["kafka"], "SLUICE_WORKER_IMAGE": tags["worker"],
        "SLUICE_PROMETHEUS_IMAGE": tags["prometheus"], "SLUICE_PROMETHEUS_CONFIG": str(prometheus_yml),
        "SLUICE_CONTROL_PORT": str(ports["control"]), "SLUICE_LANDING_PORT": str(ports["landing"]),
        "SLUICE_PROMETHEUS_PORT": str(ports["prometheus"]), "SLUICE_QUERY_TOKEN": uuid.uuid4().hex,
    }
    for n in (1, 2, 3):
        env[f"SLUICE_KAFKA_{n}_PORT"] = str(ports[f"kafka_{n}"])
        env[f"SLUICE_KAFKA_{n}_CONTROLLER_PORT"] = str(ports[f"kafka_{n}_controller"])
    project = f"sluicetest{uuid.uuid4().hex[:8]}"
    base = [*compose_command(), "-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "deploy/compose/local.yml"),
            "-p", project]
    run_env = {**os.environ, **env}

    def compose(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*base, *args], cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout)

    started = time.monotonic()
    ok = False
    try:
        up = compose("up", "-d", "--no-build", *SERVICES, timeout=600)
        assert up.returncode == 0, f"compose up failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
        print(f"\ncompose: `up -d` returned after {time.monotonic() - started:.0f}s")
        state = {"ports": ports, "bootstrap": ",".join(f"127.0.0.1:{ports[f'kafka_{n}']}" for n in (1, 2, 3)),
                 "compose": compose, "started": started, "failed": False, "query_token": env["SLUICE_QUERY_TOKEN"]}
        yield state
        ok = not state["failed"]
    finally:
        if not ok:
            logs = compose("logs", "--no-color", "--tail=40", timeout=120)
            print(f"\n--- compose logs ({project}) ---\n{logs.stdout[-20000:]}\n{logs.stderr[-2000:]}")
        down = compose("down", "-v", "--remove-orphans", "-t", "10", timeout=300)
        if down.returncode != 0:
            print(f"compose down failed:\n{down.stdout}\n{down.stderr}")
            leftovers = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"],
                                       capture_output=True, text=True).stdout.split()
            if leftovers:
                subprocess.run(["docker", "rm", "-f", "-v", *leftovers], capture_output=True)


async def _traffic(bootstrap: str, seconds: float) -> set[str]:
    """Replica samples (two replicas, every 0.25 s) and REQUESTS completed requests, stamped now."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    sent: set[str] = set()
    try:
        deadline = time.monotonic() + seconds
        step = 0
        while time.monotonic() < deadline or len(sent) < REQUESTS:
            now = int(time.time() * 1000)
            for replica in ("compose-r0", "compose-r1"):
                sample = replica_sample(event_time=now, replica_id=replica, pool=POOL, requests_waiting=0,
                                        kv_cache_usage=0.3, prompt_tokens_total=1000 * step,
                                        generation_tokens_total=500 * step)
                await producer.send("sluice.replicas.v1", orjson.dumps(sample), key=replica.encode())
            for _ in range(10):
                if len(sent) >= REQUESTS:
                    break
                task = f"compose-task-{uuid.uuid4().hex[:12]}"
                event = request_event(event_time=now, task_id=task, request_id=f"{task}-r1", pool=POOL,
                                      replica_id="compose-r0")
                await producer.send("sluice.requests.v1", orjson.dumps(event), key=task.encode())
                sent.add(event["event_id"])
            step += 1
            await asyncio.sleep(0.25)
        await producer.flush()
    finally:
        await producer.stop()
    return sent


async def _signed_signals(bootstrap: str, keys: dict[str, bytes], timeout_s: float) -> list[dict]:
    """Admission signals for POOL that verify under the compose keys (read from the topic's start)."""
    consumer = AIOKafkaConsumer("sluice.admission.v1", bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False, group_id=None)
    await consumer.start()
    found: list[dict] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(found) < 2 and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=1000)
            for records in batch.values():
                for record in records:
                    if record.value is None or record.key != POOL.encode():
                        continue
                    try:
                        found.append(verify(record.value, keys))
                    except SignatureError as exc:
                        raise AssertionError(f"a signal for {POOL} does not verify: {exc}") from None
        return found
    finally:
        await consumer.stop()


def test_compose_stack_signals_lands_and_is_scraped(stack):
    try:
        _check_stack(stack)
    except BaseException:
        stack["failed"] = True
        raise


def _check_stack(stack):
    ports, bootstrap = stack["ports"], stack["bootstrap"]
    env = _worker_env()

    def healthy(port: int) -> bool:
        return get(f"http://127.0.0.1:{port}/healthz") is not None

    wait_for(lambda: healthy(ports["control"]) and healthy(ports["landing"]), 300, interval_s=1.0,
             message="both workers' /healthz")
    ready_at = time.monotonic()
    print(f"compose: both workers healthy {ready_at - stack['started']:.0f}s after `up`")

    sent = asyncio.run(_traffic(bootstrap, 8.0))

    keys = {k: v.encode() for k, v in json.loads(env["SLUICE_SIGNING_KEYS"]).items()}
    signals = asyncio.run(_signed_signals(bootstrap, keys, 60))
    assert signals, f"no signed admission signal for {POOL} within 60s"
    assert all(s["pool"] == POOL and s["key_id"] == env["SLUICE_SIGNING_KEY_ID"] for s in signals)

    settings = load_settings(env={}, query_token=stack["query_token"])
    url = f"http://127.0.0.1:{ports['landing']}/query"
    ids = ", ".join(f"'{i}'" for i in sorted(sent))

    last = {"answer": None}

    def landed() -> bool:
        try:
            rows, _ = run_query(settings, f"SELECT count(DISTINCT event_id) AS n FROM request_events "
                                          f"WHERE pool = '{POOL}' AND event_id IN ({ids})", url)
        except QueryFailed as exc:
            last["answer"] = f"query failed: {exc}"
            return False
        last["answer"] = rows
        return rows[0]["n"] == len(sent)

    try:
        wait_for(landed, 120, interval_s=1.0, message=f"{len(sent)} request rows in the landing worker's store")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last answer: {last['answer']}") from None

    prometheus = f"http://127.0.0.1:{ports['prometheus']}"
    wait_for(lambda: get(f"{prometheus}/-/ready"), 60, interval_s=1.0, message="Prometheus ready")
    instances = {f"127.0.0.1:{ports['control']}", f"127.0.0.1:{ports['landing']}"}

    seen = {}

    def scraped() -> bool:
        seen["up"] = {r["metric"]["instance"]: r["value"][1] for r in query(prometheus, 'up{job="sluice"}')}
        # a metric of each path: the control worker's picture of the pool, the landing worker's rows
        seen["control"] = {r["metric"]["instance"] for r in query(prometheus, f'sluice_pool_pressure{{pool="{POOL}"}}')}
        seen["landing"] = {r["metric"]["instance"]
                           for r in query(prometheus, 'sluice_sink_rows_total{table="request_events"} > 0')}
        return (seen["up"] == {i: "1" for i in instances}
                and seen["control"] == {f"127.0.0.1:{ports['control']}"}
                and seen["landing"] == {f"127.0.0.1:{ports['landing']}"})

    try:
        wait_for(scraped, 60, interval_s=1.0,
                 message="Prometheus to scrape both workers (up == 1) and a sluice_* metric of each")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen: {seen}") from None
    print(f"compose: {len(signals)} signed signals, {len(sent)} rows landed, both workers scraped; "
          f"{time.monotonic() - stack['started']:.0f}s after `up`")
