"""A broker that stops acknowledging, under a real worker: /healthz says so, and recovers with the broker.

The worker's producer is idempotent, and aiokafka never expires an idempotent producer's batch: a broker
that stops answering holds the worker's tick (its signals), its cuts (partials) and its dead letters on one
await each, for as long as it stays away. The worker answered healthy all along, while routers saw no new
signal. Faust's producer cannot be replaced in a running app, so a wait older than ``producer_stall_s``
fails /healthz (stall_watch), for the orchestrator to restart the worker.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from dataclasses import replace

from pipeline.sim.producer import produce
from pipeline.sim.replay import generate, load_trace
from pipeline.topics import ensure_topics
from tests.conftest import run, wait_for
from tests.integration.cluster import DevstackCluster

STALL_S = 5.0


def health(worker) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{worker.base_url}/healthz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def pools(worker) -> list:
    with urllib.request.urlopen(f"{worker.base_url}/pools", timeout=5) as response:
        return json.loads(response.read())["pools"]


def test_a_broker_that_stops_acknowledging_fails_the_workers_health_until_it_answers_again(settings, worker_factory,
                                                                                          tmp_path):
    cluster = DevstackCluster(tmp_path / "one-broker", brokers=1).start()
    worker = None
    try:
        s = replace(settings, kafka_bootstrap_servers=cluster.bootstrap, producer_stall_s=STALL_S, role="control")
        run(ensure_topics(s, cluster.bootstrap))
        worker = worker_factory(s).start()
        events = list(generate(load_trace(), 100, 5, 1, int(time.time() * 1000)))
        run(produce(s, cluster.bootstrap, events, paced=False))
        wait_for(lambda: pools(worker), 60, message="the worker's first picture")
        assert health(worker)[0] == 200
        pid = cluster.devstack.info().nodes[0].pid
        os.kill(pid, signal.SIGSTOP)   # the broker holds every request: nothing is acknowledged, nothing refused

        def failing():
            code, body = health(worker)
            return body if code == 503 else None

        try:
            body = wait_for(failing, STALL_S + 60, message="/healthz to fail on the wait for the frozen broker")
            # the tick republishes every pool's signal at the heartbeat, so its wait is among the stuck ones
            assert "signals" in body["producer_stuck_s"], body
            assert min(body["producer_stuck_s"].values()) > STALL_S, body
            assert not body["ok"], body
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: health(worker)[0] == 200, 120, message="/healthz to recover with the broker")
        assert health(worker)[1]["producer_stuck_s"] == {}
    finally:
        if worker is not None:
            worker.stop()   # before its broker: a worker whose broker is gone takes its whole stop timeout
        cluster.stop()
