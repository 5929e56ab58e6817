"""The share lever's reading: how much of a pool's prompt work its caches already hold.

Two views of the same thing, both over the picture's fast window: the
replicas' prefix-cache counters (tokens looked up and found, as vLLM and
SGLang count them) and the routers' ``cached_input_tokens`` on finished
attempts (what the engine reported as cache reads). Work a cache holds is
the cheapest capacity a fleet has; work moved off the replicas that hold it
is prefilled again.
"""

from __future__ import annotations

from typing import Any

from .axes import Readings, finite

MAX_REPLICA_RATES = 32   # replicas listed with their own hit rate, lowest first: a picture stays a few kB


def cache_share(r: Readings) -> dict[str, Any]:
    """``prefix_hit_rate`` (pool), ``cached_input_share`` (requests) and the lowest per-replica hit rates.

    None where nothing was looked up or billed. A replica reporting more hits than lookups (a broken or
    hostile agent) counts as hitting every lookup, never more: a rate stays in [0, 1]."""
    hits = queries = 0.0
    rates: dict[str, float] = {}
    for replica_id in r.replicas.fresh + r.replicas.unhealthy:
        sums = r.sums.get(replica_id) or {}
        looked_up = float(sums.get("prefix_queries", 0.0))
        if looked_up <= 0:
            continue
        found = min(max(float(sums.get("prefix_hits", 0.0)), 0.0), looked_up)
        hits, queries = hits + found, queries + looked_up
        rates[replica_id] = found / looked_up
    counts = r.requests.counts
    lowest = sorted(rates.items(), key=lambda kv: (kv[1], kv[0]))[:MAX_REPLICA_RATES]
    billed = counts["input_tokens"]
    return {"prefix_hit_rate": finite(hits / queries) if queries else None,
            "cached_input_share": finite(min(1.0, counts["cached_input_tokens"] / billed)) if billed else None,
            "replica_hit_rates": [{"replica_id": replica_id, "hit_rate": finite(rate)} for replica_id, rate in lowest]}

