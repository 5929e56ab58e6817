"""The simulator against the real pipeline, in real time.

The simulated routers and GPU agents publish their RequestEvents and
ReplicaSamples to Kafka; a real worker builds the load picture and publishes
signed admission signals; the simulated routers follow those signals with
the real ``RouterClient`` (verify, then decide). Nothing is called
in-process: the only way the controller sees the fleet is Kafka, and the
only way the fleet hears the controller is Kafka.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Callable

import orjson

from .. import topics
from ..admission.keyring import active_key
from ..bounded_producer import abandon, delivered, stop_producer
from ..kafka_clients import client_options
from ..pools_view import absorb, format_table
from ..router import Request, RouterClient, Verdict
from ..settings import Settings
from ..topic_reader import open_from_beginning
from .controllers import NoControl
from .fleet import FleetSim
from .outcome import Outcome, summarise
from .producer import start_publisher
from .scenarios import Capacity, Fleet, Scenario, build_sim


class PipelineController(NoControl):
    """Verdicts from the real router client, which follows the signals the worker publishes."""

    name = "sluice (pipeline)"
    wants_events = False   # the fleet's events go to Kafka, not to an in-process picture

    def __init__(self, router: RouterClient) -> None:
        self.router = router
        self.states: list[str] = []
        self.lowest_admit: dict[str, float] = {}   # the least each class was admitted, over the run

    def verdict(self, request: Request, now_s: float) -> Verdict:
        return self.router.decide(request)

    def record(self, accepted: bool, now_s: float) -> None:
        self.router.record(accepted)

    @property
    def state_changes(self) -> int:
        return sum(a != b for a, b in zip(self.states, self.states[1:]))


async def run_live(settings: Settings, scenario: Scenario, fleet: Fleet, capacity: Capacity, bootstrap: str,
                   display: Callable[[float, FleetSim, dict], None] | None = None,
                   display_every_s: float = 1.0) -> tuple[FleetSim, Outcome]:
    """Run ``scenario`` in real time; ``display(now_s, sim, pictures)`` is called every ``display_every_s``."""
    key_id, secret = active_key(settings)
    router = RouterClient(settings, bootstrap, keys={key_id: secret}, seed=fleet.seed)
    controller = PipelineController(router)
    outbox: list[tuple[str, dict]] = []
    sim = build_sim(scenario, controller, fleet, capacity, emit=lambda kind, event: outbox.append((kind, event)),
                    start_ms=int(time.time() * 1000))
    producer = follower = None
    await router.start()   # a start that fails stops what it started (RouterClient.start)
    try:
        producer = await start_publisher(settings, bootstrap)
        follower, _ = await open_from_beginning(bootstrap, topics.LOAD.name(settings), **client_options(settings))
    except BaseException:   # what started is stopped: a run that cannot begin leaves nothing behind
        if producer is not None:
            await stop_producer(producer)
        await router.stop()
        raise
    pictures: dict[str, dict] = {}
    requests_topic, replicas_topic = topics.REQUESTS.name(settings), topics.REPLICAS.name(settings)
    started = time.monotonic()
    next_display = 0.0
    pending: list = []
    try:
        while True:
            now = time.monotonic() - started
            running = sim.run_until(now)
            batch, outbox[:] = list(outbox), []
            for kind, event in batch:
                topic, key = ((requests_topic, event["task_id"]) if kind == "request"
                              else (replicas_topic, event["replica_id"]))
                pending.append(await producer.send(topic, orjson.dumps(event), key=key.encode()))
            if len(pending) > 2000 or not running:
                await delivered(pending)
                pending = []
            signal = router.book.signals.get(sim.pool)
            if signal is not None:
                if not controller.states or controller.states[-1] != signal["state"]:
                    controller.states.append(signal["state"])
                for cls, fraction in signal["admit_fraction"].items():
                    controller.lowest_admit[cls] = min(fraction, controller.lowest_admit.get(cls, 1.0))
            if now >= next_display:
                absorb(pictures, await follower.getmany(timeout_ms=10))
                if display is not None:
                    display(now, sim, pictures)
                next_display = now + display_every_s
            if not running:
                break
            await asyncio.sleep(0.01)
    finally:
        abandon(pending)
        await stop_producer(producer)   # fails what is still undelivered after its bounded flush
        await follower.stop()
        await router.stop()
    return sim, summarise(sim, sim.stats, fleet.duration_s)


def console_display(duration_s: float, pool: str):
    """A progress bar, the routers' view of the signal and the live pools table (``sluice top``),
    redrawn in place on a terminal; on a log, a line every 15 s."""
    tty = sys.stdout.isatty()
    last_line = [-15.0]

    def show(now: float, sim: FleetSim, pictures: dict) -> None:
        router = getattr(sim.controller, "router", None)
        signal = (router.book.signals.get(pool) if router else None) or {}
        admit = signal.get("admit_fraction", {})
        bar = "#" * int(min(1.0, now / duration_s) * 40)
        alive = sum(r.alive for r in sim.replicas)
        status = (f"[{bar:<40}] {min(now, duration_s):4.0f}/{duration_s:.0f}s  replicas {alive}/{len(sim.replicas)}  "
                  f"signal {signal.get('state', '-'):<10} admit " +
                  " ".join(f"{c[:4]}={admit.get(c, 1.0):.2f}" for c in ("critical", "standard", "sheddable",
                                                                        "deferrable")))
        if tty:
            sys.stdout.write("\033[H\033[2J" + status + "\n\nsluice top\n" + format_table(pictures, True) + "\n")
            sys.stdout.flush()
        elif now - last_line[0] >= 15:
            last_line[0] = now
            picture = pictures.get(pool)
            axes = "" if picture is None else "  top: " + " ".join(
                f"{a}={picture['axes'][a]['pressure']:.2f}" for a in ("demand", "queue", "kv_cache", "compute"))
            print(status + axes, flush=True)

    return show
