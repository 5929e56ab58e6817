"""The control loop, pure: partials → pool pictures → admission decisions → signed signals.

One implementation for the worker's stage 2 and for the simulator, so what
the simulator measures is what the pipeline runs. No Faust, no Kafka, no
clock reads: the caller passes ``now_ms`` and publishes what comes back.

Each step: pools that merged nothing for ``pool_idle_ms`` (the caller's clock, so replays of old
traffic count as activity) are forgotten, with the ids of the partials they held so the caller can
drop those from its store too (state is
bounded: so is the number of pools, ``max_pools``); pools whose state changed get a new picture; every pool with a
picture gets a decision (also unchanged ones: a pool that stops advancing
must be seen going stale); a signal goes out when the decision changed in a
way routers act on, or when the heartbeat is due, so silence is never
mistaken for stability.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from .admission.policy import AdmissionConfig, Decision, changed, decide
from .admission.signing import sign
from .load.config import PictureConfigs
from .load.partial import Partial
from .load.picture import PoolState


@dataclass(frozen=True)
class Signal:
    """One signed admission signal due for publication, with what it was decided from."""

    pool: str
    value: bytes
    decision: Decision
    picture: dict


@dataclass
class Step:
    pictures: list[dict] = field(default_factory=list)   # new pictures, for sluice.load.v1
    signals: list[Signal] = field(default_factory=list)  # due signals, for sluice.admission.v1
    forgotten: list[str] = field(default_factory=list)   # pools idle past pool_idle_ms: tombstones for both
    released: list[tuple[str, str]] = field(default_factory=list)  # (pool, partial id) the forgotten pools held
    failed: list[tuple[str, str]] = field(default_factory=list)  # (pool, error): its picture or decision raised


def _random_id() -> str:
    return str(uuid.uuid4())


class ControlLoop:
    """Stage 2's state for the pools one controller owns."""

    def __init__(self, configs: PictureConfigs, policy: AdmissionConfig, key_id: str, secret: bytes,
                 heartbeat_ms: int, new_id: Callable[[], str] = _random_id, max_pools: int = 1000,
                 pool_idle_ms: int = 600_000) -> None:
        self.configs = configs
        self.policy = policy
        self.key_id, self.secret = key_id, secret
        self.heartbeat_ms = heartbeat_ms
        self.new_id = new_id
        self.states: dict[str, PoolState] = {}
        self.pictures: dict[str, dict] = {}          # newest picture per pool
        self.decisions: dict[str, Decision] = {}     # newest decision per pool
        self.published: dict[str, tuple[Decision, int]] = {}  # last published decision and when
        self.changed: set[str] = set()
        self.max_pools = max_pools          # state is bounded: invented pool names cannot grow it
        self.pool_idle_ms = pool_idle_ms    # a pool with no event for this long is forgotten
        self.refused_pools = 0              # partials of new pools refused at max_pools
        self.refused_replicas = 0           # replica entries refused at a pool's max_replicas
        self.unmergeable: set[str] = set()  # ids of partials the last rebuild left out: their merge raised
        self.active_ms: dict[str, int] = {}  # when (the caller's clock) each pool last merged a partial
        self.merged: set[str] = set()        # pools that merged a partial since the last step

    def merge(self, partial: Partial, now_ms: int | None = None) -> list[str] | None:
        """Fold a partial into its pool; the partial ids that left the window, or None for a duplicate
        or for a new pool beyond ``max_pools`` (counted in ``refused_pools``). ``now_ms``, the caller's clock,
        bounds how far it moves the pool's watermark (``PoolState.merge``)."""
        state = self.states.get(partial.pool)
        if state is None:
            if len(self.states) >= self.max_pools:
                self.refused_pools += 1
                return None
            state = self.states[partial.pool] = PoolState(partial.pool)
        refused = state.replicas_refused
        if not state.merge(partial, self.configs.for_pool(partial.pool), now_ms):
            return None
        self.refused_replicas += state.replicas_refused - refused
        self.changed.add(partial.pool)
        self.merged.add(partial.pool)
        return state.evicted

    def rebuild(self, partials: Iterable[Partial], now_ms: int, active_ms: Mapping[str, int] = {}) -> list[str]:
        """States from scratch (after a restart or rebalance), merging each pool's partials in time order.

        ``active_ms`` is when each pool last merged a partial (the caller's clock, kept with its partials):
        a pool idle past ``pool_idle_ms`` was forgotten, or is due to be, so it is not brought back; those
        pools are returned (their partials are the caller's to drop). A pool with no such time counts as
        active now."""
        partials = list(partials)
        idle = sorted({p.pool for p in partials if now_ms - active_ms.get(p.pool, now_ms) > self.pool_idle_ms})
        self.states, self.unmergeable = {}, set()
        for partial in sorted(partials, key=lambda p: p.newest_ms):
            if partial.pool not in idle:
                try:
                    self.merge(partial, now_ms)
                except Exception:  # one partial costs itself, never the rebuild (a crash loop on every owner)
                    self.unmergeable.add(partial.id)
        self.changed = set(self.states)
        self.merged = set()
        self.active_ms = {pool: active_ms.get(pool, now_ms) for pool in self.states}
        self.pictures = {p: v for p, v in self.pictures.items() if p in self.states}
        self.decisions = {p: v for p, v in self.decisions.items() if p in self.states}
        self.published = {p: v for p, v in self.published.items() if p in self.states}
        return idle

    def step(self, now_ms: int, fleet: Mapping[str, dict] = {}) -> Step:
        """New pictures for changed pools, then decisions for every pool; ``fleet`` adds other
        controllers' pictures as redirect candidates."""
        out = Step()
        for pool in self.merged:
            self.active_ms[pool] = now_ms
        self.merged.clear()
        for pool in [p for p in self.states if now_ms - self.active_ms.setdefault(p, now_ms) > self.pool_idle_ms]:
            out.released += [(pool, partial_id) for partial_id in self.states[pool].seen]
            for kept in (self.states, self.pictures, self.decisions, self.published, self.active_ms):
                kept.pop(pool, None)
            self.changed.discard(pool)
            out.forgotten.append(pool)
        failing = set()
        for pool in sorted(self.changed):
            try:
                picture = self.states[pool].snapshot(self.configs.for_pool(pool))
            except Exception as exc:  # one pool's state costs that pool's picture, never every pool's signals
                out.failed.append((pool, f"{type(exc).__name__}: {exc}"[:300]))
                self.pictures.pop(pool, None)   # no decision on an old picture, no redirect target either
                failing.add(pool)               # tried again next tick
                continue
            picture["published_at_ms"] = now_ms
            self.pictures[pool] = picture
            out.pictures.append(picture)
        self.changed = failing
        # this worker's own pools count by their own pictures only: one whose picture failed this tick must not
        # stay a redirect target through the copy of its last picture read back from the load topic
        everyone = {**{p: v for p, v in fleet.items() if p not in self.states}, **self.pictures}
        for pool, picture in self.pictures.items():
            models = set(picture.get("models", ()))
            siblings = [p for other, p in everyone.items() if other != pool and models & set(p.get("models", ()))]
            try:
                decision = decide(picture, self.decisions.get(pool, Decision(pool)), self.policy, now_ms, siblings)
            except Exception as exc:  # no signal for this pool: its routers' last one expires as documented
                out.failed.append((pool, f"{type(exc).__name__}: {exc}"[:300]))
                continue
            self.decisions[pool] = decision
            last = self.published.get(pool)
            if last is not None and not changed(last[0], decision) and now_ms - last[1] < self.heartbeat_ms:
                continue
            envelope = {"event_id": self.new_id(), "event_time": now_ms, **decision.signal}
            out.signals.append(Signal(pool, sign(envelope, self.key_id, self.secret), decision, picture))
            self.published[pool] = (decision, now_ms)
        return out
