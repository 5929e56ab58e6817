"""Who decides admission in a simulated run: nobody, a fixed threshold, or Sluice.

Sluice in-process is the real pure core — stage 1's partial fold and the
worker's stage-2 control loop (``pipeline.control_loop``: picture, policy,
publish on change or heartbeat, signing) — and the routers' real ``Decider``
verifying the signed signals, called each tick without Kafka. The same
simulator drives the real pipeline through ``pipeline.sim.live``.
"""

from __future__ import annotations

import random
import uuid
from typing import TYPE_CHECKING

from ..admission.policy import config_from
from ..control_loop import ControlLoop
from ..events import ReplicaSample, RequestEvent
from ..load.config import PictureConfigs
from ..load.partial import PartialBuilder
from ..router import ADMIT, Decider, Reject, Request, SignalBook, Verdict
from ..settings import Settings

if TYPE_CHECKING:
    from .fleet import FleetSim

SIM_KEY_ID, SIM_SECRET = "sim", b"simulator-signing-key-not-secret"


class NoControl:
    """Every request is admitted: what a fleet without admission control does."""

    name = "no control"
    wants_events = False
    state_changes = 0

    def verdict(self, request: Request, now_s: float) -> Verdict:
        return ADMIT

    def record(self, accepted: bool, now_s: float) -> None:
        pass

    def observe(self, kind: str, event: dict) -> None:
        pass

    def tick(self, fleet: "FleetSim", now_s: float) -> None:
        pass


class FixedThreshold(NoControl):
    """The Gateway API Inference Extension's default: sheddable work is rejected while any replica has
    more than ``queue`` requests waiting or KV usage above ``kv`` (read from the replicas each scrape);
    deferrable counts as sheddable there."""

    name = "fixed threshold"

    def __init__(self, queue: int = 5, kv: float = 0.8, scrape_s: float = 1.0) -> None:
        self.queue, self.kv, self.scrape_s = queue, kv, scrape_s
        self.saturated = False
        self.saturated_pools: set[str] = set()
        self._next_scrape = 0.0
        self.history: list[tuple[float, str, dict]] = []   # (time, state, admit fractions), as Sluice's

    def verdict(self, request: Request, now_s: float) -> Verdict:
        if request.pool in self.saturated_pools and request.priority in ("sheddable", "deferrable"):
            return Reject(1.0, "saturated")
        return ADMIT

    def tick(self, fleet: "FleetSim", now_s: float) -> None:
        if now_s < self._next_scrape:
            return
        self._next_scrape = now_s + self.scrape_s
        self.saturated_pools = {fleet.pool_of[r.id] for r in fleet.replicas
                                if r.alive and (r.waiting_count > self.queue or r.kv_usage() > self.kv)}
        saturated = fleet.pool in self.saturated_pools   # the scenario's pool: its flips are what is counted
        self.state_changes += saturated != self.saturated
        self.saturated = saturated
        shed = 0.0 if saturated else 1.0
        self.history.append((now_s, "saturated" if saturated else "ok",
                             {"critical": 1.0, "standard": 1.0, "sheddable": shed, "deferrable": shed}))


class SluiceInProcess(NoControl):
    """Stage 1's fold, the worker's ``ControlLoop`` and the router's ``Decider``, each tick, without Kafka."""

    name = "sluice"
    wants_events = True

    def __init__(self, settings: Settings, pool: str, start_ms: int, seed: int = 1) -> None:
        self.pool = pool
        self.start_ms = start_ms
        ids = random.Random(seed + 7)   # event ids from the seed: a run is reproducible
        self.loop = ControlLoop(PictureConfigs(settings), config_from(settings.admission_policy), SIM_KEY_ID,
                                SIM_SECRET, heartbeat_ms=int(settings.heartbeat_s * 1000),
                                new_id=lambda: str(uuid.UUID(int=ids.getrandbits(128), version=4)))
        self.builder = PartialBuilder("sim/0", settings.replica_stale_after_s)
        self.now_s = 0.0
        self.book = SignalBook({SIM_KEY_ID: SIM_SECRET}, clock=self.clock)
        self.decider = Decider(self.book, seed=seed, clock=self.clock)
        self._tick = 0
        self.state_changes = 0
        self.signals_published = 0
        self.history: list[tuple[float, str, dict]] = []   # (time, state, admit fractions)

    def clock(self) -> float:
        """Simulated wall time, seconds: routers and signals share it."""
        return self.start_ms / 1000 + self.now_s

    def verdict(self, request: Request, now_s: float) -> Verdict:
        self.now_s = now_s
        return self.decider.decide(request)

    def record(self, accepted: bool, now_s: float) -> None:
        self.now_s = now_s
        self.decider.record(accepted)

    def observe(self, kind: str, event: dict) -> None:
        if kind == "request":
            self.builder.fold_request(RequestEvent(**event))
        else:
            self.builder.fold_sample(ReplicaSample(**event))

    def tick(self, fleet: "FleetSim", now_s: float) -> None:
        self.now_s = now_s
        self._tick += 1
        for partial in self.builder.drain(self._tick):   # ids unique per tick: none is taken for a duplicate
            self.loop.merge(partial)
        state = self.loop.states.get(self.pool)
        if state is None or not state.watermark_ms:
            return
        previous = self.loop.decisions.get(self.pool)
        step = self.loop.step(self.start_ms + int(now_s * 1000))
        for signal in step.signals:
            self.book.offer(signal.value)
        self.signals_published += len(step.signals)
        decision = self.loop.decisions[self.pool]
        if previous is not None and previous.state != decision.state:
            self.state_changes += 1
        self.history.append((now_s, decision.state, decision.signal["admit_fraction"]))
