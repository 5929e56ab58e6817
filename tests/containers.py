"""Kafka and Prometheus in locally built containers (testcontainers), for tests that want real processes
to kill.

``ContainerKafkaCluster`` has the interface of ``tests/integration/cluster.py``'s ``DevstackCluster``:
``start()``, ``bootstrap`` (comma-separated 127.0.0.1 ports), ``kill(node_id)`` (SIGKILL the container),
``restart(node_id)`` (same ports and data), ``wait_in_sync(timeout_s)`` (every partition led and its ISR
full), ``leader_counts()`` and ``stop()``. ``ContainerPrometheus(config_path, rules_dir)`` runs Debian's
Prometheus with ``base_url`` and ``stop()``.

Every container uses the host's network, so all traffic stays on 127.0.0.1 (Kafka listens on 127.0.0.1
ports picked here). Images come from ``deploy/docker/build_images.py``, built once when missing (the
first run on a machine takes a few minutes: debootstrap, then Debian packages). Nothing needs a registry;
Ryuk (testcontainers' reaper image) is disabled, so ``stop()`` removes what ``start()`` made.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import importlib.util
import os
import socket
import time
import urllib.request
import uuid
from pathlib import Path

from tests import prewarm

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

ROOT = Path(__file__).resolve().parents[1]
LABEL = "org.sluice.test"


def _builder():
    spec = importlib.util.spec_from_file_location("sluice_build_images", ROOT / "deploy/docker/build_images.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_images = _builder()


def engine_answers() -> bool:
    """True when a Docker engine answers ``docker info``."""
    return build_images.engine_answers()


@functools.lru_cache(maxsize=None)
def image(name: str) -> str:
    """The tag of Sluice's ``name`` image (kafka, worker, prometheus), built once per session when missing.

    ``SLUICE_<NAME>_IMAGE`` (e.g. ``SLUICE_WORKER_IMAGE=sluice/worker:0.1.0``) uses that image as it is
    instead: quicker while iterating, but it may not hold the working tree's code."""
    pinned = os.environ.get(build_images.ENV_NAMES[name], "")
    if pinned:
        return pinned
    prewarm.wait("images")
    return build_images.ensure(name)[name]


def images(*names: str) -> dict[str, str]:
    """name → tag for each of ``names`` (default: kafka, worker, prometheus), each built once when missing."""
    started = time.monotonic()
    tags = {name: image(name) for name in (names or ("kafka", "worker", "prometheus"))}
    elapsed = time.monotonic() - started
    if elapsed > 5:
        print(f"\ncontainers: images ready in {elapsed:.0f}s: {', '.join(tags.values())}")
    return tags


try:
    import pytest

    @pytest.fixture(scope="session")
    def sluice_images() -> dict[str, str]:
        """Every Sluice image, built once per test session when missing (import this fixture by name)."""
        return images()
except ImportError:  # used outside pytest
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
        return True
    except OSError:
        return False


def _logs(container, lines: int = 40) -> str:
    try:
        out, err = container.get_logs()
        text = (out or b"").decode(errors="replace") + (err or b"").decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])
    except Exception as exc:  # the container may be gone
        return f"(no logs: {exc})"


class ContainerKafkaCluster:
    """``brokers`` combined KRaft nodes (broker + controller), RF 3 defaults and min ISR 2 (for 3 nodes)."""

    def __init__(self, brokers: int = 3, heap_mb: int = 384, extra_env: dict[str, str] | None = None,
                 secure: bool = False) -> None:
        if secure:
            raise NotImplementedError("ContainerKafkaCluster is plaintext only; use the devstack cluster for --secure")
        self.brokers = brokers
        self.heap_mb = heap_mb
        self.extra_env = dict(extra_env or {})
        self.cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        self.ports: dict[int, int] = {}
        self.controller_ports: dict[int, int] = {}
        self.containers: dict = {}
        self.bootstrap = ""

    def _env(self, node: int) -> dict[str, str]:
        rf = min(3, self.brokers)
        min_isr = max(1, min(2, self.brokers - 1))
        voters = ",".join(f"{n}@127.0.0.1:{p}" for n, p in self.controller_ports.items())
        env = {
            "CLUSTER_ID": self.cluster_id,
            "KAFKA_HEAP_MB": str(self.heap_mb),
            "KAFKA_NODE_ID": str(node),
            "KAFKA_PROCESS_ROLES": "broker,controller",
            "KAFKA_LISTENERS": f"PLAINTEXT://127.0.0.1:{self.ports[node]},CONTROLLER://127.0.0.1:{self.controller_ports[node]}",
            "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://127.0.0.1:{self.ports[node]}",
            "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "KAFKA_INTER_BROKER_LISTENER_NAME": "PLAINTEXT",
            "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
            "KAFKA_CONTROLLER_QUORUM_VOTERS": voters,
            "KAFKA_DEFAULT_REPLICATION_FACTOR": str(rf),
            "KAFKA_MIN_INSYNC_REPLICAS": str(min_isr),
            "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": str(rf),
            "KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS": "8",
            "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": str(rf),
            "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": str(min_isr),
            "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": str(rf),
            "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": str(min_isr),
            "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
            "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "true",
            "KAFKA_LOG_SEGMENT_BYTES": "67108864",
            "KAFKA_LOG_CLEANER_DEDUPE_BUFFER_SIZE": "33554432",
        }
        env.update(self.extra_env)
        return env

    def start(self, timeout_s: float = 180.0) -> "ContainerKafkaCluster":
        from testcontainers.core.container import DockerContainer

        tag = image("kafka")
        used: set[int] = set()
        for node in range(1, self.brokers + 1):
            for table in (self.ports, self.controller_ports):
                port = free_port()
                while port in used:
                    port = free_port()
                used.add(port)
                table[node] = port
        self.bootstrap = ",".join(f"127.0.0.1:{p}" for p in self.ports.values())
        try:
            for node in self.ports:
                container = DockerContainer(tag).with_kwargs(
                    network_mode="host",
                    labels={LABEL: "kafka"}).with_name(f"sluice-kafka-{self.cluster_id[:8].lower()}-{node}")
                for key, value in self._env(node).items():
                    container.with_env(key, value)
                container.start()
                self.containers[node] = container
            self._wait_brokers(set(self.ports), timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _container(self, node_id: int):
        return self.containers[node_id].get_wrapped_container()

    def _logs_of_all(self) -> str:
        return "\n".join(f"--- node {n} ---\n{_logs(c)}" for n, c in self.containers.items())

    def _wait_brokers(self, nodes: set[int], timeout_s: float) -> None:
        """Until each node in ``nodes`` answers on its own listener with metadata listing all of them (as the
        devstack waits): asking any node was not enough, since a broker is listed once registered, before its
        listener accepts, and an admin request sent to it then failed (CI, session 24)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node in nodes:
                c = self._container(node)
                c.reload()
                if c.status == "exited":
                    raise RuntimeError(f"kafka node {node} exited:\n{_logs(self.containers[node])}")
            if all(nodes <= asyncio.run(self._live_brokers(only=n)) for n in nodes):
                return
            time.sleep(0.5)
        raise TimeoutError(f"brokers {sorted(nodes)} did not join within {timeout_s:.0f}s\n{self._logs_of_all()}")

    async def _live_brokers(self, only: int | None = None) -> set[int]:
        """The brokers the cluster's metadata lists, asked of any node whose port is open, or of node ``only``
        on its own listener."""
        from aiokafka import AIOKafkaClient

        live = [f"127.0.0.1:{p}" for n, p in self.ports.items() if (only is None or n == only) and _port_open(p)]
        if not live:
            return set()
        client = AIOKafkaClient(bootstrap_servers=",".join(live), request_timeout_ms=3000)
        try:
            await asyncio.wait_for(client.bootstrap(), 5)
            return {b.nodeId for b in client.cluster.brokers()}
        except Exception:
            return set()
        finally:
            await client.close()

    def kill(self, node_id: int) -> None:
        """SIGKILL the node's container (no clean shutdown); its data stays for ``restart``."""
        self._container(node_id).kill(signal="SIGKILL")
        deadline = time.monotonic() + 30
        while _port_open(self.ports[node_id]) and time.monotonic() < deadline:
            time.sleep(0.1)

    def restart(self, node_id: int, timeout_s: float = 120.0) -> None:
        """Start the node again with its ports and data; returns once the cluster lists it as a broker."""
        container = self._container(node_id)
        container.reload()
        if container.status == "running":
            container.restart(timeout=30)
        else:
            container.start()
        self._wait_brokers({node_id}, timeout_s)

    async def _describe(self) -> list[dict]:
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=5000)
        await admin.start()
        try:
            return await admin.describe_topics()
        finally:
            await admin.close()

    def _out_of_sync(self) -> list[str]:
        try:
            described = asyncio.run(self._describe())
        except Exception as exc:
            return [f"describe failed: {exc!r}"]
        lagging = []
        for topic in described:
            if topic.get("error_code"):
                lagging.append(f"{topic['topic']}: error {topic['error_code']}")
            for p in topic["partitions"]:
                if p["leader"] < 0 or set(p["isr"]) != set(p["replicas"]):
                    lagging.append(f"{topic['topic']}/{p['partition']} leader={p['leader']} "
                                   f"isr={sorted(p['isr'])} replicas={sorted(p['replicas'])}")
        return lagging

    def wait_in_sync(self, timeout_s: float) -> None:
        """Until every partition of every topic has a leader and its full replica set in sync."""
        deadline = time.monotonic() + timeout_s
        lagging = self._out_of_sync()
        while lagging:
            if time.monotonic() > deadline:
                raise TimeoutError(f"partitions not in sync after {timeout_s:.0f}s: {lagging[:10]}")
            time.sleep(0.5)
            lagging = self._out_of_sync()

    def leader_counts(self) -> dict[int, int]:
        """node id → partitions it leads."""
        counts = {node: 0 for node in self.ports}
        for topic in asyncio.run(self._describe()):
            for p in topic["partitions"]:
                if p["leader"] in counts:
                    counts[p["leader"]] += 1
        return counts

    def logs(self, node_id: int, lines: int = 200) -> str:
        return _logs(self.containers[node_id], lines)

    def stop(self) -> None:
        """Remove every container this cluster started (and its data)."""
        for node, container in list(self.containers.items()):
            try:
                container.get_wrapped_container().remove(force=True, v=True)
            except Exception:
                pass
            self.containers.pop(node, None)

    def __enter__(self) -> "ContainerKafkaCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ContainerPrometheus:
    """Debian's Prometheus in a container on the host network, listening on a free 127.0.0.1 port.

    ``config_path`` is mounted as ``/etc/prometheus/prometheus.yml``; ``rules_dir`` both as
    ``/etc/prometheus/rules`` (for ``rule_files: [rules/*.yml]``) and at its own absolute path (for a config
    that names rule files by host path). Scrape targets on 127.0.0.1 reach the host's processes.
    """

    def __init__(self, config_path: str | Path, rules_dir: str | Path, timeout_s: float = 90.0) -> None:
        from testcontainers.core.container import DockerContainer

        config_path, rules_dir = Path(config_path).resolve(), Path(rules_dir).resolve()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.container = (DockerContainer(image("prometheus"))
                          .with_kwargs(network_mode="host", labels={LABEL: "prometheus"})
                          .with_volume_mapping(str(config_path), "/etc/prometheus/prometheus.yml", "ro")
                          .with_volume_mapping(str(rules_dir), "/etc/prometheus/rules", "ro")
                          .with_command(["--config.file=/etc/prometheus/prometheus.yml",
                                         "--storage.tsdb.path=/prometheus",
                                         f"--web.listen-address=127.0.0.1:{self.port}"]))
        if str(rules_dir) != "/etc/prometheus/rules":
            self.container.with_volume_mapping(str(rules_dir), str(rules_dir), "ro")
        self.container.start()
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            wrapped = self.container.get_wrapped_container()
            wrapped.reload()
            if wrapped.status == "exited" or time.monotonic() > deadline:
                logs = _logs(self.container)
                self.stop()
                raise RuntimeError(f"Prometheus did not become ready:\n{logs}")
            time.sleep(0.3)

    def _ready(self) -> bool:
        try:
            return urllib.request.urlopen(f"{self.base_url}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def logs(self, lines: int = 200) -> str:
        return _logs(self.container, lines)

    def stop(self) -> None:
        try:
            self.container.get_wrapped_container().remove(force=True, v=True)
        except Exception:
            pass
