"""One replica cannot speak for its pool: the highest reading counts at most a multiple of the next highest.

A pool's queue, token rate and preemptions are sums over its replicas. Summed as reported, one replica whose
numbers are wrong (a bug, a broken exporter, a compromised host) sheds the whole pool for as long as it reports
them, while its siblings sit idle. Real overload is the pool's, not one replica's: routers spread the work, so
the busiest replicas' queues and rates rise together (least-loaded routing keeps them close; affinity skews
them, which the factor leaves room for). A replica far above every sibling is lying or overloaded alone, and
shedding the pool is the wrong answer to both; the second is the routers' to route around. Only the highest
reading is capped, at ``SIBLING_FACTOR`` × the next highest, so replicas that are new or idle (a scale-up, a
quiet hour) never pull the busy ones down; and never below a floor, what alone takes the axis to
``SOLO_SHARE`` of the pool's limit, since a queue on one replica at a time is ordinary under moderate load
(in the simulator's prompt-heavy spike, without the floor, the cap bit on a fifth of the ticks, nearly all
with every sibling's queue at 0). The price: two replicas lying together are not caught. With one replica
there is no sibling to compare with, and its reading stands. Pools are taken as homogeneous, as
their profile is (one capacity and one peak per replica).
"""

from __future__ import annotations

from typing import Iterable, Mapping

SIBLING_FACTOR = 4.0   # the highest reading counts at most this many times the next highest ...
SOLO_SHARE = 0.5       # ... or, if more, what alone takes its axis to this share of the pool's limit


def top_capped(values: Mapping[str, float], floor: float = 0.0,
               factor: float = SIBLING_FACTOR) -> tuple[dict[str, float], str | None]:
    """``values`` with the highest capped at ``factor`` × the next highest, or ``floor`` if more; and the
    replica capped, if one was."""
    out = dict(values)
    if len(out) < 2:
        return out, None
    top = max(out, key=lambda replica: (out[replica], replica))
    cap = max(floor, factor * max(value for replica, value in out.items() if replica != top))
    if out[top] <= cap:
        return out, None
    out[top] = cap
    return out, top


def capped_sums(sums: Mapping[str, Mapping[str, float]], groups: Iterable[tuple[tuple[str, ...], float]]
                ) -> tuple[dict[str, Mapping[str, float]], set[str]]:
    """Per-replica counter sums with, for each group of counters read together (its names, its floor), the
    replica whose group total is highest scaled down to ``top_capped``'s cap; and the replicas scaled. Every
    replica with sums is compared, stale ones too: the axes add up all of them (a replica that jumped once and
    went quiet would otherwise count in full for the rest of the window)."""
    out = dict(sums)
    scaled: set[str] = set()
    for names, floor in groups:
        totals = {replica: sum(out[replica].get(name, 0.0) for name in names) for replica in out}
        capped, top = top_capped(totals, floor)
        if top is not None:
            scale = capped[top] / totals[top]
            out[top] = {**out[top], **{name: out[top].get(name, 0.0) * scale for name in names}}
            scaled.add(top)
    return out, scaled
