"""Per-pool partial aggregates: stage 1's output, one per (source, pool) per tick.

A partial's ``id`` names its source topic, partition and the offset range it
folds, so stage 2 can tell a redelivered or repeated partial from a new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from ..events import ReplicaSample, RequestEvent
from .aggregates import ReplicaAgg, ReplicaLatest, ReplicaTracker, RequestAgg


@dataclass
class Partial:
    id: str
    pool: str
    requests: dict[int, RequestAgg] = field(default_factory=dict)
    replicas: dict[str, ReplicaAgg] = field(default_factory=dict)
    newest_ms: int = 0
    models: set[str] = field(default_factory=set)

    def to_bytes(self) -> bytes:
        return orjson.dumps({
            "id": self.id, "pool": self.pool, "newest_ms": self.newest_ms, "models": sorted(self.models),
            "requests": {str(k): v.to_dict() for k, v in self.requests.items()},
            "replicas": {k: v.to_dict() for k, v in self.replicas.items()},
        })

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Partial":
        return cls(id=data["id"], pool=data["pool"], newest_ms=data["newest_ms"], models=set(data.get("models", ())),
                   requests={int(k): RequestAgg.from_dict(v) for k, v in data["requests"].items()},
                   replicas={k: ReplicaAgg.from_dict(v) for k, v in data["replicas"].items()})

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Partial":
        return cls.from_dict(orjson.loads(raw))


class PartialBuilder:
    """Stage 1's fold for one source partition: events in, partials out at each tick."""

    def __init__(self, source: str, replica_max_gap_s: float) -> None:
        self.source = source
        self.tracker = ReplicaTracker(replica_max_gap_s)
        self.pending: dict[str, Partial] = {}

    def _partial(self, pool: str) -> Partial:
        partial = self.pending.get(pool)
        if partial is None:
            partial = self.pending[pool] = Partial(id="", pool=pool)
        return partial

    def fold_request(self, e: RequestEvent) -> None:
        partial = self._partial(e.pool)
        second = e.event_time // 1000
        agg = partial.requests.get(second)
        if agg is None:
            agg = partial.requests[second] = RequestAgg()
        agg.fold(e)
        partial.models.add(e.model)
        if e.event_time > partial.newest_ms:
            partial.newest_ms = e.event_time

    def fold_sample(self, s: ReplicaSample) -> None:
        deltas = self.tracker.deltas(s)
        partial = self._partial(s.pool)
        replica = partial.replicas.get(s.replica_id)
        if replica is None:
            replica = partial.replicas[s.replica_id] = ReplicaAgg()
        replica.see(ReplicaLatest.of(s))
        if deltas:
            replica.add(s.event_time // 1000, deltas)
        if s.event_time > partial.newest_ms:
            partial.newest_ms = s.event_time

    def drain(self, cut: object) -> list[Partial]:
        """The partials folded since the last drain, identified by this source and ``cut``
        (the worker's offset range, the simulator's tick)."""
        out = list(self.pending.values())
        for partial in out:
            partial.id = f"{self.source}/{cut}"
        self.pending = {}
        return out
