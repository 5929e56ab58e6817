"""What Sluice must achieve in every scenario and seed, checked on ``compare`` rows. Pure.

The goals (docs/simulator.md): against no control, at least 2× the
SLO-goodput wherever no control misses its SLO, and at most half its cost
per SLO-successful task there; against the fixed threshold, at least its
SLO-goodput everywhere and 1.1× where its critical attainment is under 99%;
critical attainment of at least 99% everywhere.
"""

from __future__ import annotations

from typing import Iterable

ATTAINMENT = 0.99
CLASSES = ("critical", "standard", "sheddable", "deferrable")


def _misses_slo(row: dict) -> bool:
    return min(row[f"attain_{c}"] for c in CLASSES) < ATTAINMENT


def check(rows: Iterable[dict]) -> list[dict]:
    """One line per (scenario, seed): the ratios and every goal that failed (empty: all met)."""
    runs: dict[tuple[str, int], dict[str, dict]] = {}
    for row in rows:
        runs.setdefault((row["scenario"], row.get("seed", 1)), {})[row["controller"]] = row
    out = []
    for (scenario, seed), by in sorted(runs.items()):
        none, fixed, sluice = by["no control"], by["fixed threshold"], by["sluice"]
        vs_none = sluice["slo_goodput"] / none["slo_goodput"] if none["slo_goodput"] else float("inf")
        vs_fixed = sluice["slo_goodput"] / fixed["slo_goodput"] if fixed["slo_goodput"] else float("inf")
        cost_none, cost = none["usd_per_1k_slo_tasks"], sluice["usd_per_1k_slo_tasks"]
        cost_ratio = cost / cost_none if cost is not None and cost_none else None
        failed = []
        if _misses_slo(none):
            if vs_none < 2.0:
                failed.append(f"goodput {vs_none:.2f}x no control < 2")
            if cost_ratio is None or cost_ratio > 0.5:
                failed.append(f"cost {cost_ratio}x no control > 0.5")
        need = 1.1 if fixed["attain_critical"] < ATTAINMENT else 1.0
        if vs_fixed < need - 1e-9:
            failed.append(f"goodput {vs_fixed:.3f}x fixed < {need}")
        if sluice["attain_critical"] < ATTAINMENT:
            failed.append(f"critical {sluice['attain_critical']:.4f} < {ATTAINMENT}")
        out.append({"scenario": scenario, "seed": seed, "vs_none": round(vs_none, 2), "vs_fixed": round(vs_fixed, 3),
                    "critical": sluice["attain_critical"], "fixed_critical": fixed["attain_critical"],
                    "cost_vs_none": round(cost_ratio, 3) if cost_ratio is not None else None,
                    "reversals_per_min": sluice.get("fraction_reversals_per_min"),
                    "failed": "; ".join(failed)})
    return out
