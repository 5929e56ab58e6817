"""What Sluice must achieve in every scenario and seed, checked on ``compare`` rows. Pure.

The goals (docs/simulator.md): against no control, at least 2× the
SLO-goodput wherever no control misses its SLO, and at most half its cost
per SLO-successful task there; against the fixed threshold, at least its
SLO-goodput everywhere and 1.1× where its critical attainment is under 99%;
critical attainment of at least 99% everywhere. Where a tenant bursts (noisy-neighbour): the other
tenants' attainment within one point of their run without the burst, the bursting tenant absorbing at
least 90% of the refusals, and SLO-goodput no lower than Sluice without its fair shares.
"""

from __future__ import annotations

from typing import Iterable

ATTAINMENT = 0.99
FAIRNESS_POINTS = 0.01     # the other tenants' attainment may fall this much below their run without the burst
BURST_SHED_SHARE = 0.9     # the bursting tenant's least share of the refusals
UNFAIR = "sluice without fairness"   # the controller row the fairness goals compare with
NO_AFFINITY = "sluice without affinity"   # the row that shows what the warm steps' credit buys (no goal)
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
        fairness = _fairness(sluice, by.get(UNFAIR))
        failed += fairness.pop("failed")
        plain = by.get(NO_AFFINITY)
        if plain is not None:
            fairness["vs_no_affinity"] = round(sluice["slo_goodput"] / plain["slo_goodput"], 3) if plain[
                "slo_goodput"] else None
            fairness["cost_vs_no_affinity"] = (round(cost / plain["usd_per_1k_slo_tasks"], 3)
                                               if cost is not None and plain["usd_per_1k_slo_tasks"] else None)
        out.append({"scenario": scenario, "seed": seed, "clients": sluice.get("clients"), "vs_none": round(vs_none, 2), "vs_fixed": round(vs_fixed, 3),
                    "critical": sluice["attain_critical"], "fixed_critical": fixed["attain_critical"],
                    "cost_vs_none": round(cost_ratio, 3) if cost_ratio is not None else None,
                    "reversals_per_min": sluice.get("fraction_reversals_per_min"), **fairness,
                    "failed": "; ".join(failed)})
    return out


def _fairness(sluice: dict, unfair: dict | None) -> dict:
    """The noisy-neighbour goals, where a scenario has a bursting tenant: the other tenants' attainment
    within ``FAIRNESS_POINTS`` of their run without the burst, the bursting tenant absorbing at least
    ``BURST_SHED_SHARE`` of the refusals, pool SLO-goodput no lower than Sluice without fairness."""
    if "attain_others_no_burst" not in sluice or unfair is None:
        return {"others": None, "others_no_burst": None, "burst_shed_share": None, "vs_unfair": None, "failed": []}
    failed = []
    others, calm, share = sluice["attain_others"], sluice["attain_others_no_burst"], sluice["burst_shed_share"]
    if others < calm - FAIRNESS_POINTS:
        failed.append(f"other tenants {others:.4f} < {calm:.4f} without the burst - {FAIRNESS_POINTS}")
    if share is not None and share < BURST_SHED_SHARE:
        failed.append(f"bursting tenant took {share:.3f} of the shedding < {BURST_SHED_SHARE}")
    vs_unfair = sluice["slo_goodput"] / unfair["slo_goodput"] if unfair["slo_goodput"] else float("inf")
    if vs_unfair < 1.0:
        failed.append(f"goodput {vs_unfair:.3f}x sluice without fairness < 1")
    return {"others": others, "others_no_burst": calm, "burst_shed_share": share,
            "vs_unfair": round(vs_unfair, 3), "failed": failed}
