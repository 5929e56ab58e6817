"""A throwaway multi-broker Kafka cluster for failure tests, with a small interface.

``three_brokers`` gives ``ContainerKafkaCluster`` (tests/containers.py: the project's Kafka image through
testcontainers, host network) when a Docker engine answers, else ``DevstackCluster``: the devstack's KRaft
nodes (JVMs on 127.0.0.1) in a temporary state directory. Both offer the same members:
``bootstrap``, ``kill(node_id)`` (SIGKILL, no clean shutdown), ``restart(node_id)`` (same ports and
data), ``wait_in_sync(timeout_s)`` (every partition led and fully in sync) and ``stop()``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.devstack.kafka import KafkaDevstack
from pipeline.settings import load_settings
from tests import containers


class DevstackCluster:
    def __init__(self, state_dir: Path, brokers: int = 3, secure: bool = False) -> None:
        self.devstack = KafkaDevstack(load_settings(env={}, state_dir=str(state_dir)), brokers=brokers,
                                      secure=secure)
        self.bootstrap = ""

    def start(self) -> "DevstackCluster":
        info, _ = self.devstack.start()
        self.bootstrap = info.bootstrap
        return self

    def kill(self, node_id: int) -> None:
        self.devstack.kill(node_id)

    def restart(self, node_id: int) -> None:
        self.devstack.restart(node_id)

    def wait_in_sync(self, timeout_s: float) -> None:
        self.devstack.wait_in_sync(timeout_s)

    def leader_counts(self) -> dict[int, int]:
        """node id → partitions it leads (to pick the node whose loss hurts most)."""
        return self.devstack.leader_counts()

    def stop(self) -> None:
        self.devstack.stop()


@pytest.fixture
def three_brokers(tmp_path):
    if containers.engine_answers():
        cluster = containers.ContainerKafkaCluster(brokers=3)
    else:
        cluster = DevstackCluster(tmp_path / "cluster-state", brokers=3)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
