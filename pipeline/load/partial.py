"""Per-pool partial aggregates: stage 1's output, one per (source, pool) per cut.

A partial's ``id`` names its source topic, partition and the offset range it
folds, so stage 2 can tell a redelivered or repeated partial from a new one.
One that would not fit a Kafka message goes out in parts (``split``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from ..events import ReplicaSample, RequestEvent
from .aggregates import IDENTIFIER, ReplicaAgg, ReplicaLatest, ReplicaTracker, RequestAgg
from .checks import count
from .model_share import MAX_MODEL_NAME, count_model, read_counts


@dataclass
class Partial:
    id: str
    pool: str
    requests: dict[int, RequestAgg] = field(default_factory=dict)
    replicas: dict[str, ReplicaAgg] = field(default_factory=dict)
    newest_ms: int = 0
    model_events: dict[str, int] = field(default_factory=dict)   # events per model (model_share.py)
    model_total: int = 0   # request events folded: more than ``model_events`` adds up to once names are dropped

    def to_bytes(self) -> bytes:
        # "models" too: a worker from before the counts reads that list (and ignores the counts)
        return orjson.dumps({
            "id": self.id, "pool": self.pool, "newest_ms": self.newest_ms, "models": sorted(self.model_events),
            "model_events": self.model_events, "model_total": self.model_total,
            "requests": {str(k): v.to_dict() for k, v in self.requests.items()},
            "replicas": {k: v.to_dict() for k, v in self.replicas.items()},
        })

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Partial":
        """Raises on a partial whose identity is not what stage 2 keys, orders and releases it by, or whose
        content stage 1 could not have written (pipeline/load/checks.py): refused whole, before any merge."""
        if not (isinstance(data["id"], str) and isinstance(data["pool"], str) and type(data["newest_ms"]) is int):
            raise ValueError("a partial's id and pool must be strings and its newest_ms an integer")
        models = data.get("models", [])
        if not isinstance(models, list) or \
                not all(type(m) is str and len(m) <= MAX_MODEL_NAME and IDENTIFIER.match(m) for m in models):
            raise ValueError("a partial's models must be model names as the contract allows them")
        # a worker from before the counts wrote the list alone: one event for each model it names
        model_events = read_counts(data["model_events"]) if "model_events" in data else dict.fromkeys(models, 1)
        model_total = sum(model_events.values())
        if "model_total" in data:
            model_total = count(data["model_total"], "model_total")
            if model_total < sum(model_events.values()):
                raise ValueError("a partial's model_total is less than its model counts add up to")
        partial = cls(id=data["id"], pool=data["pool"], newest_ms=data["newest_ms"], model_events=model_events,
                      model_total=model_total,
                      requests={int(k): RequestAgg.from_dict(v) for k, v in data["requests"].items()},
                      replicas={k: ReplicaAgg.from_dict(v) for k, v in data["replicas"].items()})
        newest_s = partial.newest_ms // 1000  # a second past it would never leave the window, nor count
        if any(second > newest_s for second in partial.requests) or \
                any(second > newest_s for replica in partial.replicas.values() for second in replica.seconds):
            raise ValueError("a partial holds a second after its newest_ms")
        return partial

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Partial":
        return cls.from_dict(orjson.loads(raw))


class PartialBuilder:
    """Stage 1's fold for one source partition: events in, partials out at each cut."""

    def __init__(self, source: str, replica_max_gap_s: float) -> None:
        self.source = source
        self.tracker = ReplicaTracker(replica_max_gap_s)
        self.pending: dict[str, Partial] = {}

    def _partial(self, pool: str) -> Partial:
        partial = self.pending.get(pool)
        if partial is None:
            partial = self.pending[pool] = Partial(id="", pool=pool)
        return partial

    def fold_request(self, e: RequestEvent, not_after_ms: int | None = None) -> bool:
        """``not_after_ms``: the worker's clock. An event stamped later (a fast clock at its source, within
        max_clock_skew_s) is taken as happening then, and True says it was. A pool's watermark is the newest
        time folded: one source ahead by more than ``allowed_lateness_s`` would make every other source's
        events late and its replicas stale, and the pool would read idle. The event is changed in place (the
        control path's own copy)."""
        ahead = not_after_ms is not None and e.event_time > not_after_ms
        if ahead:
            e.event_time = not_after_ms
        partial = self._partial(e.pool)
        second = e.event_time // 1000
        agg = partial.requests.get(second)
        if agg is None:
            agg = partial.requests[second] = RequestAgg()
        agg.fold(e)
        partial.model_total += 1
        counts = partial.model_events
        n = counts.get(e.model)
        if n is None:
            count_model(counts, e.model)
        else:   # the usual case, kept out of a call on the hot path
            counts[e.model] = n + 1
        if e.event_time > partial.newest_ms:
            partial.newest_ms = e.event_time
        return ahead

    def fold_sample(self, s: ReplicaSample, not_after_ms: int | None = None) -> bool:
        """``not_after_ms`` as for ``fold_request``: a sample stamped later is placed there, its counters still
        differenced on the replica's own times (so a fast replica's GPU-seconds are not lost)."""
        deltas = self.tracker.deltas(s)
        partial = self._partial(s.pool)
        replica = partial.replicas.get(s.replica_id)
        if replica is None:
            replica = partial.replicas[s.replica_id] = ReplicaAgg()
        latest = ReplicaLatest.of(s)
        ahead = not_after_ms is not None and latest.event_time > not_after_ms
        if ahead:
            latest.event_time = not_after_ms
        replica.see(latest)
        if deltas:
            replica.add(latest.event_time // 1000, deltas)
        if latest.event_time > partial.newest_ms:
            partial.newest_ms = latest.event_time
        return ahead

    def drain(self, cut: object, max_bytes: int | None = None) -> list[Partial]:
        """The partials folded since the last drain, identified by this source and ``cut``
        (the worker's offset range, the simulator's tick), split to ``max_bytes`` when given."""
        out = []
        for partial in self.pending.values():
            partial.id = f"{self.source}/{cut}"
            out += [partial] if max_bytes is None else split(partial, max_bytes)
        self.pending = {}
        return out


PART_SEP = "#"


def split(partial: Partial, max_bytes: int) -> list[Partial]:
    """``partial`` as parts that each serialize to at most ``max_bytes`` (a Kafka message's limit), which
    stage 2 merges in order to the same picture as the whole (only ``partials_merged`` counts the parts).

    A part holds whole event-seconds, in ascending order, and its ``newest_ms`` is capped at its last
    second, so an earlier part never makes a later one's seconds late. Every part carries every replica's
    newest sample: no part adds a replica without one, or re-adds one out of the pool's order (the picture
    sums replicas in that order). The parts follow from the content alone, so the same content gives the
    same parts under the same ids, the first under the partial's own. A single second (or the replicas'
    samples alone) over ``max_bytes`` still goes out over it.
    """
    if len(partial.to_bytes()) <= max_bytes:
        return [partial]
    sizes: dict[int, int] = {}
    for second, agg in partial.requests.items():
        sizes[second] = sizes.get(second, 0) + _entry_bytes(second, agg.to_dict())
    for replica in partial.replicas.values():
        for second, deltas in replica.seconds.items():
            sizes[second] = sizes.get(second, 0) + _entry_bytes(second, deltas)
    frame = len(_part(partial, f"{partial.id}{PART_SEP}{1 << 32}", [], partial.newest_ms, True).to_bytes())
    groups: list[list[int]] = [[]]
    used = frame
    for second in sorted(sizes):
        if groups[-1] and used + sizes[second] > max_bytes:
            groups.append([])
            used = frame
        groups[-1].append(second)
        used += sizes[second]
    last = len(groups) - 1
    return [_part(partial, partial.id if k == 0 else f"{partial.id}{PART_SEP}{k}", seconds,
                  partial.newest_ms if k == last else min(partial.newest_ms, seconds[-1] * 1000 + 999), k == last)
            for k, seconds in enumerate(groups)]


def _entry_bytes(second: int, value: dict[str, Any]) -> int:
    """What ``"second":value,`` adds to a serialized partial."""
    return len(str(second)) + 4 + len(orjson.dumps(value))


def _part(partial: Partial, part_id: str, seconds: list[int], newest_ms: int, with_models: bool) -> Partial:
    """The part of ``partial`` holding ``seconds`` (sorted), with every replica's newest sample; the model
    counts go ``with_models`` (the last part) only, or a split partial would count its events once per part;
    the last, as it stays in stage 2's window longest."""
    first, last = (seconds[0], seconds[-1]) if seconds else (0, -1)
    requests = {s: partial.requests[s] for s in seconds if s in partial.requests}
    replicas = {rid: ReplicaAgg(agg.latest, {s: agg.seconds[s] for s in sorted(agg.seconds) if first <= s <= last})
                for rid, agg in partial.replicas.items()}
    if not with_models:
        return Partial(part_id, partial.pool, requests, replicas, newest_ms)
    return Partial(part_id, partial.pool, requests, replicas, newest_ms, partial.model_events, partial.model_total)
