"""A minority of replicas cannot speak for its pool: readings far above the rest count at most a multiple of them.

A pool's queue, token rate and preemptions are sums over its replicas. Summed as reported, one replica whose
numbers are wrong (a bug, a broken exporter, a compromised host) sheds the whole pool for as long as it reports
them, while its siblings sit idle; so do two or three (one bad exporter rolled out to a few hosts, a host
running several replicas). Real overload is the pool's, not a few replicas': routers spread the work, so the
busiest replicas' queues and rates rise together (least-loaded routing keeps them close; affinity skews them,
which the factor leaves room for). Replicas far above the rest are lying or overloaded alone, and shedding the
pool is the wrong answer to both; the second is the routers' to route around.

The highest ``k`` readings, for the largest ``k`` below half the pool whose lowest is more than
``SIBLING_FACTOR`` × the next reading (and, for two or more, above the floor below on its own: queues of a few
requests on a few replicas beside idle ones are ordinary, and a group cap first built without this bit on
them), each count at most that multiple of it; so replicas that are new or idle
(a scale-up, a quiet hour) never pull the busy ones down, and a majority is always read as it reports. Never
below a floor the group shares: together, what takes the axis to ``SOLO_SHARE`` of the pool's limit, since
a queue on one replica or a few at a time is ordinary under moderate load (in the simulator's prompt-heavy
spike, without the floor, a one-replica cap bit on a fifth of the ticks, nearly all with every other queue
at 0). The price: half the pool lying together is not caught, and a real overload confined to a minority of
replicas (affinity routing pinning work to them) counts at most the floor on these three axes; latency and
KV cache still read it. With one replica there is no sibling to compare with, and its reading stands. Pools
are taken as homogeneous, as their profile is (one capacity and one peak per replica).
"""

from __future__ import annotations

from typing import Iterable, Mapping

SIBLING_FACTOR = 4.0   # a reading counts at most this many times the highest reading outside its group ...
SOLO_SHARE = 0.5       # ... or, if more, the level at which the group together takes its axis to this share of the limit


def top_capped(values: Mapping[str, float], floor: float = 0.0,
               factor: float = SIBLING_FACTOR) -> tuple[dict[str, float], tuple[str, ...]]:
    """``values`` with the outlying group capped: the top ``k`` (fewer than half, at least one of two or more),
    for the largest ``k`` whose lowest is above ``factor`` × the next (and, for ``k`` > 1, above ``floor``),
    each at most ``factor`` × that next or, if more, the level at which the group together keeps ``floor``;
    and the replicas lowered, sorted."""
    out = dict(values)
    order = sorted(out, key=lambda replica: (out[replica], replica), reverse=True)
    for k in range(max(1, (len(order) - 1) // 2) if len(order) > 1 else 0, 0, -1):
        nearest, lowest = out[order[k]], out[order[k - 1]]
        if lowest <= factor * nearest or (k > 1 and lowest <= floor):
            continue   # no step; or a group whose members are each within the floor (queues on a few replicas)
        cap = max(factor * nearest, _floor_level([out[replica] for replica in order[:k]], floor))
        lowered = tuple(sorted(replica for replica in order[:k] if out[replica] > cap))
        for replica in lowered:
            out[replica] = cap
        return out, lowered
    return out, ()


def _floor_level(group: list[float], floor: float) -> float:
    """The level ``c`` at which the readings ``group`` (highest first) capped at ``c`` add up to ``floor``;
    the highest reading if they add up to no more than that."""
    if sum(group) <= floor:
        return group[0]
    below = sum(group)
    for j, reading in enumerate(group, start=1):   # the top j at the level, the rest as they are
        below -= reading
        level = (floor - below) / j
        if j == len(group) or level >= group[j]:
            return level
    return group[-1]


def capped_sums(sums: Mapping[str, Mapping[str, float]], groups: Iterable[tuple[tuple[str, ...], float]]
                ) -> tuple[dict[str, Mapping[str, float]], set[str]]:
    """Per-replica counter sums with, for each group of counters read together (its names, its floor), the
    replicas whose group totals outlie the rest scaled down to ``top_capped``'s cap; and the replicas scaled. Every
    replica with sums is compared, stale ones too: the axes add up all of them (a replica that jumped once and
    went quiet would otherwise count in full for the rest of the window)."""
    out = dict(sums)
    scaled: set[str] = set()
    for names, floor in groups:
        totals = {replica: sum(out[replica].get(name, 0.0) for name in names) for replica in out}
        capped, lowered = top_capped(totals, floor)
        for replica in lowered:
            scale = capped[replica] / totals[replica]
            out[replica] = {**out[replica], **{name: out[replica].get(name, 0.0) * scale for name in names}}
            scaled.add(replica)
    return out, scaled
