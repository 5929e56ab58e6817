"""Shared fixtures: one real broker per session, and per-test topics, groups, ports and stores.

The broker is ``KAFKA_BOOTSTRAP_SERVERS`` when set, else a devstack broker in
a temporary state directory (jars from the usual cache), stopped at the end
of the session so no JVM outlives the tests.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from dataclasses import replace

import hypothesis
import pytest

from pipeline.devstack.kafka import KafkaDevstack
from pipeline.settings import Settings, load_settings
from pipeline.worker_process import WorkerProcess
from tests import prewarm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# hypothesis's per-example deadline off: the unit tier shares the cores with the (niced) prewarm, and speed is
# `sluice bench`'s to measure
hypothesis.settings.register_profile("sluice", deadline=None)
hypothesis.settings.load_profile("sluice")


def _relative(item) -> str:
    return os.path.relpath(str(item.path), ROOT)


def pytest_collection_modifyitems(session, config, items):
    """The tests that wait on a prewarm: the scenario checks last before the integration tier (the comparison has
    longest to finish), the tests that use the images first in it (no timed test then shares the cores with
    their build)."""
    def order(item) -> int:
        path = _relative(item)
        if path.startswith("tests/integration/"):
            return 2 if path in prewarm.IMAGE_USERS else 3
        return 1 if path in prewarm.WAITERS else 0

    items.sort(key=order)   # stable: the tiers' own order within each group


def pytest_collection_finish(session):
    """The session's tests are known: start their slow preparation beside the unit tier (tests/prewarm.py)."""
    if not session.config.option.collectonly:
        prewarm.start_for({_relative(item) for item in session.items})


def pytest_sessionfinish(session):
    prewarm.stop_all()


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
    """Settings for one test: its own topics, consumer group, store and HTTP port.

    Retention and the event-age bound are off: the trace replays at fixed past dates, which a TTL would
    drop on insert and the age bound would dead-letter.
    """
    return load_settings(env={}, kafka_bootstrap_servers=kafka_bootstrap, topic_namespace=namespace,
                         app_id=f"sluice-{namespace}", state_dir=str(tmp_path / "state"),
                         web_port=free_port(), retention_days=0, max_event_age_s=0,
                         dev_signing_key=True)


@pytest.fixture
def worker_factory(settings, tmp_path):
    started: list[WorkerProcess] = []

    def make(base: Settings | None = None, **overrides) -> WorkerProcess:
        """A worker with ``base`` settings (default: the test's), ``overrides`` and its own port."""
        overrides.setdefault("web_port", free_port())
        worker = WorkerProcess(replace(base or settings, **overrides), tmp_path / f"worker-{len(started)}.log")
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
