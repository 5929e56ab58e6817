"""A broker that stops acknowledging, under a real worker: /healthz names the wait, and clears with the broker.

The worker's producer is idempotent, and aiokafka never expires an idempotent producer's batch: a broker
that stops answering holds the worker's tick (its signals), its cuts (partials) and its dead letters on one
await each, for as long as it stays away, and nothing said so. A wait older than ``producer_stall_s`` is now
named in /healthz's body; it does not fail the check, since a restart would meet the same broker (stall_watch).
A producer that is spent — which a restart does cure — fails the check, and then ends the worker.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.error
from datetime import datetime
import urllib.request
from dataclasses import replace

from pipeline.sim.producer import produce
from pipeline.sim.replay import generate, load_trace
from pipeline.topics import ensure_topics
from tests.conftest import run, wait_for
from tests.integration.cluster import DevstackCluster

STALL_S = 5.0
SPENT_EXIT_S = 3.0


def health(worker) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{worker.base_url}/healthz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def pools(worker) -> list:
    with urllib.request.urlopen(f"{worker.base_url}/pools", timeout=5) as response:
        return json.loads(response.read())["pools"]


def test_a_broker_that_stops_acknowledging_is_named_in_the_workers_health_until_it_answers_again(
        settings, worker_factory, tmp_path):
    """Stopped while traffic flows, malformed records among it, so the worker's cuts wait on it too (their
    group commit, their partials' send) and its folds on their dead letters, with cuts queued on the lock
    behind them: every wait is named, none fails the check or reads as the path wedged inside the worker — a
    stopped broker must not make every worker exit at once — and all clear with the broker."""
    cluster = DevstackCluster(tmp_path / "one-broker", brokers=1).start()
    worker = None
    flowing: list[float] = []
    stopped, producer = threading.Event(), None
    try:
        s = replace(settings, kafka_bootstrap_servers=cluster.bootstrap, producer_stall_s=STALL_S,
                    producer_spent_exit_s=SPENT_EXIT_S, role="control")
        run(ensure_topics(s, cluster.bootstrap))
        worker = worker_factory(s).start()
        events = list(generate(load_trace(), 100, 5, 1, int(time.time() * 1000)))
        run(produce(s, cluster.bootstrap, events, paced=False))
        wait_for(lambda: pools(worker), 60, message="the worker's first picture")
        assert health(worker)[0] == 200

        def until_stopped(items):
            for item in items:
                if stopped.is_set():
                    return
                yield item

        def traffic():   # paced, so the worker has folded events no cut has committed when the broker stops
            items = until_stopped(generate(load_trace(), 50, 120, 2, int(time.time() * 1000)))
            bad = [("malformed JSON", b'{"schema_version": 1, "event_id": ', f"bad-{n}".encode()) for n in range(300)]
            run(produce(s, cluster.bootstrap, items, paced=True, bad=bad, progress=flowing.append))

        producer = threading.Thread(target=traffic, daemon=True)
        producer.start()
        wait_for(lambda: flowing and flowing[-1] >= 2.0, 60, message="traffic to flow")
        pid = cluster.devstack.info().nodes[0].pid
        os.kill(pid, signal.SIGSTOP)   # the broker holds every request: nothing is acknowledged, nothing refused

        last: list[dict] = []

        def cut_waits_past_the_exit():   # the tick's signals wait, and a cut (on the broker or behind a fold that
            code, body = health(worker)  # waits on it): past the time any exit would be due
            last[:] = [body]
            assert code == 200 and body["ok"] and not body["control"]["wedged"], body
            assert "producer_spent" not in body, body   # a restart would not help
            due = STALL_S + SPENT_EXIT_S + 2
            longest_cut_wait = max(body["control"]["cut_stuck_s"].values(), default=0)
            return "signals" in body["producer_stuck_s"] and longest_cut_wait > due

        try:
            try:
                wait_for(cut_waits_past_the_exit, STALL_S + SPENT_EXIT_S + 60,
                         message="/healthz to name the tick's and a cut's wait")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; /healthz last said {last}") from None
            assert worker.proc.poll() is None, "the worker exited while its broker was stopped"
        finally:
            os.kill(pid, signal.SIGCONT)

        def recovered():
            code, body = health(worker)
            return code == 200 and body["producer_stuck_s"] == {} and body["control"]["cut_stuck_s"] == {}

        wait_for(recovered, 120, message="the waits to end with the broker, and the worker healthy")
    finally:
        stopped.set()
        if producer is not None:
            producer.join(90)   # its last deliveries, to the broker answering again
        if worker is not None:
            worker.stop()   # before its broker: a worker whose broker is gone takes its whole stop timeout
        cluster.stop()



def logged_at(line: str) -> float:
    """The wall time of a worker log line (``[2026-12-03 19:52:20,271] [pid] [LEVEL] ...``)."""
    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def faulty_worker(settings, worker_factory, trigger: str, how: str = ""):
    """A control worker with pools to signal, then the fault ``trigger`` names injected (``how``;
    tests/integration/faulty_worker.py); returns the worker and the wall time of the fault."""
    s = replace(settings, role="control", producer_spent_exit_s=SPENT_EXIT_S, producer_stall_s=STALL_S)
    run(ensure_topics(s, s.kafka_bootstrap_servers))
    worker = worker_factory(s)
    worker.command = [sys.executable, "-m", "tests.integration.faulty_worker"]
    worker.start()
    run(produce(s, s.kafka_bootstrap_servers, generate(load_trace(), 50, 3, 1, int(time.time() * 1000)),
                paced=False))
    wait_for(lambda: pools(worker), 60, message="the worker's first picture")   # its tick sends from now on
    ended = time.time()
    (s.state_dir / trigger).write_text(how)
    return worker, ended


def test_a_send_failing_on_a_spent_producer_ends_the_worker_at_once(settings, worker_factory):
    """The sender fails as aiokafka's own unexpected errors do: every send fails, and the first one the tick
    makes ends the worker with an error (the Faust task that sent, then the app), well inside the grace."""
    worker, ended = faulty_worker(settings, worker_factory, "end-the-sender", "error")
    assert worker.proc.wait(60) != 0
    log = worker.log_tail(400)
    assert "Unexpected error in sender routine" in log and "the Kafka producer is spent" not in log


def test_a_producer_spent_without_an_error_fails_health_then_ends_the_worker(settings, worker_factory):
    """A sender that ends without an error (cancelled) leaves every send waiting for ever, so no failure ends
    the worker: /healthz says so at once, and the worker exits with an error ``producer_spent_exit_s`` later —
    hard if its stop waits on the batches the sender will never deliver — for a supervisor that restarts
    what exits (compose's restart policy, systemd) and never reads /healthz."""
    worker, ended = faulty_worker(settings, worker_factory, "end-the-sender", "quietly")

    def spent():
        code, body = health(worker)
        return (code, body) if "producer_spent" in body else None

    code, body = wait_for(spent, SPENT_EXIT_S, interval_s=0.1, message="/healthz to say the producer is spent")
    assert code == 503 and body["producer_spent"] == "its sender task ended" and not body["ok"], body
    assert worker.proc.wait(2 * SPENT_EXIT_S + 60) != 0
    line, = [line for line in worker.log_tail(400).splitlines() if "the Kafka producer is spent" in line]
    assert logged_at(line) >= ended + SPENT_EXIT_S - 0.01   # after the grace, not before


def test_a_control_path_wedged_inside_the_worker_fails_health_then_ends_the_worker(settings, worker_factory):
    """A lock the control path's cuts queue behind, held by nothing that waits on the broker: the worker's
    events stop reaching the pictures while it still consumes. /healthz fails (control.wedged) once a cut has
    queued ``producer_stall_s``, and the worker exits ``producer_spent_exit_s`` later — hard, since its stop
    waits on the same lock — for a supervisor that restarts what exits."""
    worker, wedged_at = faulty_worker(settings, worker_factory, "wedge-the-control-path")

    def wedged():
        code, body = health(worker)
        return (code, body) if body.get("control", {}).get("wedged") else None

    code, body = wait_for(wedged, STALL_S + 30, interval_s=0.1, message="/healthz to say the control path is wedged")
    assert code == 503 and set(body["control"]["cut_stuck_s"]) == {"lock"} and not body["ok"], body
    assert body["producer_stuck_s"] == {} and "producer_spent" not in body, body
    assert worker.proc.wait(2 * SPENT_EXIT_S + 60) != 0
    log = worker.log_tail(400)
    line, = [line for line in log.splitlines() if "the control path is wedged" in line]
    assert logged_at(line) >= wedged_at + STALL_S + SPENT_EXIT_S - 0.01   # after the bound and the grace
    assert "exiting without it" in log   # its stop queued on the same lock
