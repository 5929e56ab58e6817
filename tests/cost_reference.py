"""An independent Python computation of the cost views (sql/002, sql/004), written from their documented
definitions, to check the SQL against."""

from __future__ import annotations

import math
from collections import defaultdict

TERMINAL = ("completed", "failed", "rejected", "cancelled")
MINUTE_MS, HOUR_MS = 60_000, 3_600_000


def fleet_cost(samples: list[dict], prices: dict[str, float], stale_after_s: float) -> dict[tuple, float]:
    """(pool, minute ms) → $: each sample pays gpu_count × price for the time since its replica's previous one."""
    by_replica = defaultdict(list)
    for s in samples:
        by_replica[s["replica_id"]].append(s)
    cost: dict[tuple, float] = defaultdict(float)
    for series in by_replica.values():
        series.sort(key=lambda s: s["event_time"])
        previous = None
        for s in series:
            seconds = 0.0 if previous is None else min((s["event_time"] - previous) / 1000, stale_after_s)
            previous = s["event_time"]
            minute = s["event_time"] // MINUTE_MS * MINUTE_MS
            cost[(s["pool"], minute)] += s["gpu_count"] * seconds * prices.get(s["hardware"], 0.0) / 3600
    return cost


def cached(e: dict) -> int:
    return min(e.get("cached_input_tokens") or 0, e.get("input_tokens") or 0)


def work(e: dict, cached_share: float) -> float:
    """Uncached prompt tokens, cached ones at ``cached_share`` of the price, output tokens."""
    return (max((e.get("input_tokens") or 0) - (e.get("cached_input_tokens") or 0), 0) + cached(e) * cached_share
            + (e.get("output_tokens") or 0))


def attempt_costs(requests: list[dict], fleet: dict[tuple, float],
                  cached_share: float) -> tuple[list[tuple[dict, float]], set]:
    attempts = [e for e in requests if e["phase"] in TERMINAL]
    total = defaultdict(float)
    for e in attempts:
        total[(e["pool"], e["event_time"] // MINUTE_MS * MINUTE_MS)] += work(e, cached_share)
    out = []
    for e in attempts:
        key = (e["pool"], e["event_time"] // MINUTE_MS * MINUTE_MS)
        out.append((e, fleet.get(key, 0.0) * work(e, cached_share) / total[key] if total[key] else 0.0))
    return out, {k for k, v in total.items() if v > 0}


def cache_savings(requests: list[dict], samples: list[dict], prices: dict[str, float], stale_after_s: float,
                  cached_share: float) -> dict[tuple, float]:
    """(pool, hour ms) → $ the cached prompt tokens would have added at each minute's cost per unit of work."""
    fleet = fleet_cost(samples, prices, stale_after_s)
    total, hits = defaultdict(float), defaultdict(float)
    for e in requests:
        if e["phase"] in TERMINAL:
            key = (e["pool"], e["event_time"] // MINUTE_MS * MINUTE_MS)
            total[key] += work(e, cached_share)
            hits[key] += cached(e)
    saved: dict[tuple, float] = defaultdict(float)
    for (pool, minute), w in total.items():
        if w > 0:
            saved[(pool, minute // HOUR_MS * HOUR_MS)] += fleet.get((pool, minute), 0.0) * hits[(pool, minute)] \
                * (1 - cached_share) / w
    return dict(saved)


def outcome(attempts: list[dict]) -> str:
    done = [e for e in attempts if e["phase"] == "completed"]
    if any(e.get("task_final") for e in done):
        missed = any(e.get("slo_ttft_s") is not None and e.get("ttft_s") is not None and not e["ttft_s"] <= e["slo_ttft_s"]
                     for e in done)
        return "late" if missed else "slo_success"
    gave_up = [e for e in attempts if e["phase"] != "completed" and e.get("task_final")]
    return max(gave_up, key=lambda e: e["event_time"])["phase"] if gave_up else "open"


def cost_per_successful_task(requests: list[dict], samples: list[dict], prices: dict[str, float],
                             stale_after_s: float, cached_share: float) -> dict[tuple, dict]:
    """(pool, tenant, hour ms) → the view's columns."""
    fleet = fleet_cost(samples, prices, stale_after_s)
    costed, busy = attempt_costs(requests, fleet, cached_share)
    rows: dict[tuple, dict] = defaultdict(lambda: {"fleet_cost_usd": 0.0, "waste_cost_usd": 0.0, "completed_tasks": 0,
                                                   "successful_tasks": 0, "successful_tasks_cost_usd": 0.0})
    tasks = defaultdict(list)
    for e, cost in costed:
        row = rows[(e["pool"], e["tenant"], e["event_time"] // HOUR_MS * HOUR_MS)]
        row["fleet_cost_usd"] += cost
        if e["phase"] != "completed":
            row["waste_cost_usd"] += cost
        tasks[e["task_id"]].append((e, cost))
    for items in tasks.values():
        attempts = [e for e, _ in items]
        last = max(attempts, key=lambda e: e["event_time"])
        result = outcome(attempts)
        row = rows[(last["pool"], attempts[0]["tenant"], last["event_time"] // HOUR_MS * HOUR_MS)]
        row["completed_tasks"] += result in ("slo_success", "late")
        if result == "slo_success":
            row["successful_tasks"] += 1
            row["successful_tasks_cost_usd"] += sum(c for _, c in items)
    for (pool, minute), cost in fleet.items():
        if (pool, minute) not in busy:
            rows[(pool, "(idle)", minute // HOUR_MS * HOUR_MS)]["fleet_cost_usd"] += cost
    for row in rows.values():
        s = row["successful_tasks"]
        row["cost_per_successful_task_usd"] = row["fleet_cost_usd"] / s if s else None
        row["attributed_cost_per_successful_task_usd"] = row["successful_tasks_cost_usd"] / s if s else None
        row["waste_share"] = row["waste_cost_usd"] / row["fleet_cost_usd"] if row["fleet_cost_usd"] > 0 else None
    return dict(rows)


BFLOAT16_ERROR = 2 ** -7  # an 8-bit mantissa, truncated


def quantile_bounds(values: list[float], q: float) -> tuple[float, float]:
    """Where quantileBFloat16 may put the q-quantile: the exact one (one rank of slack each side),
    rounded down by less than 2^-7."""
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    lo = ordered[max(0, math.floor(rank) - 1)]
    hi = ordered[min(len(ordered) - 1, math.ceil(rank) + 1)]
    return lo * (1 - BFLOAT16_ERROR) - 1e-12, hi + 1e-12
