"""Shared fixtures: one real broker per session, and per-test topics, groups, ports and stores.

The broker is ``KAFKA_BOOTSTRAP_SERVERS`` when set, else a devstack broker in
a temporary state directory (jars from the usual cache), stopped at the end
of the session so no JVM outlives the tests.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pipeline.devstack.kafka import KafkaDevstack
from pipeline.settings import Settings, load_settings
from pipeline.worker_probe import wait_healthy

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory) -> str:
    configured = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or os.environ.get("SLUICE_KAFKA_BOOTSTRAP_SERVERS")
    if configured:
        yield configured
        return
    settings = load_settings(state_dir=str(tmp_path_factory.mktemp("kafka-state")))
    devstack = KafkaDevstack(settings)
    info, _ = devstack.start()
    try:
        yield info.bootstrap
    finally:
        devstack.stop()


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def settings(kafka_bootstrap, namespace, tmp_path) -> Settings:
    """Settings for one test: its own topics, consumer group, store and HTTP port."""
    return load_settings(env={}, kafka_bootstrap_servers=kafka_bootstrap, topic_namespace=namespace,
                         app_id=f"sluice-{namespace}", state_dir=str(tmp_path / "state"),
                         web_port=free_port())


def settings_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    for name, value in settings.redacted().items():
        if value != "***":
            env[f"SLUICE_{name.upper()}"] = str(value)
    return env


class WorkerProcess:
    """A real ``sluice worker`` subprocess for integration tests."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.settings = settings
        self.log_path = log_path
        self.base_url = f"http://{settings.web_host}:{settings.web_port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 90) -> "WorkerProcess":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "worker"], cwd=ROOT,
                                     env=settings_env(self.settings), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if not wait_healthy(self.base_url, timeout_s, self.proc):
            self.kill()
            raise AssertionError(f"worker not healthy in {timeout_s}s:\n{self.log_tail()}")
        return self

    def kill(self) -> None:
        """kill -9: no shutdown hooks, no final commit."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout_s: float = 60) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@pytest.fixture
def worker_factory(settings, tmp_path):
    started: list[WorkerProcess] = []

    def make(**overrides) -> WorkerProcess:
        from dataclasses import replace

        worker = WorkerProcess(replace(settings, **overrides), tmp_path / f"worker-{len(started)}.log")
        started.append(worker)
        return worker

    yield make
    for worker in started:
        worker.stop()


def wait_for(condition, timeout_s: float, interval_s: float = 0.2, message: str = "condition"):
    """Poll ``condition`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {message}")
        time.sleep(interval_s)


def run(coro):
    return asyncio.run(coro)
