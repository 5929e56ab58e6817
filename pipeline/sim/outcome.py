"""What a simulated run achieved: goodput, SLO-goodput, attainment per class, cost, waste, flapping.

A task counts toward **SLO-goodput** only if it completed and every step met
its TTFT objective; attainment of a class is its SLO-successful share of the
tasks that *arrived* in it (a shed task is a miss). Cost is what the fleet
paid (alive replicas × GPUs × price × time, idle included) divided by the
tasks that succeeded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..events import PRIORITIES

if TYPE_CHECKING:
    from .fleet import FleetSim, Stats


@dataclass(frozen=True)
class Outcome:
    duration_s: float
    arrivals: int
    outcomes: dict[str, int]
    completed: int
    slo_successes: int
    attainment: dict[str, float]
    ttft_p99_s: float | None
    waste_share: float
    gpu_seconds: float
    requests_per_s: float
    tokens_per_s: float
    cut_off: int = 0   # tasks the run's end decided (still open when the drain ended), among failed and deferred

    @property
    def goodput(self) -> float:
        return self.completed / self.duration_s

    @property
    def slo_goodput(self) -> float:
        return self.slo_successes / self.duration_s

    def cost_per_slo_success(self, usd_per_gpu_hour: float) -> float | None:
        cost = self.gpu_seconds * usd_per_gpu_hour / 3600
        return cost / self.slo_successes if self.slo_successes else None

    def row(self, scenario: str, controller: str, capacity_slo_goodput: float, usd_per_gpu_hour: float,
            state_changes: int) -> dict:
        cost = self.cost_per_slo_success(usd_per_gpu_hour)
        return {"scenario": scenario, "controller": controller,
                "slo_goodput": round(self.slo_goodput, 3), "goodput": round(self.goodput, 3),
                "capacity_share": round(self.slo_goodput / capacity_slo_goodput, 3) if capacity_slo_goodput else None,
                **{f"attain_{c}": round(self.attainment[c], 4) for c in PRIORITIES},
                "usd_per_1k_slo_tasks": round(cost * 1000, 4) if cost is not None else None,
                "waste_share": round(self.waste_share, 4),
                "ttft_p99_s": round(self.ttft_p99_s, 3) if self.ttft_p99_s is not None else None,
                "state_changes": state_changes, "arrivals": self.arrivals, **{
                    f"n_{k}": self.outcomes.get(k, 0) for k in ("completed", "failed", "rejected", "deferred")},
                "n_cut_off": self.cut_off}


def summarise(sim: "FleetSim", stats: "Stats", duration_s: float) -> Outcome:
    outcomes: dict[str, int] = {}
    arrived = {c: 0 for c in PRIORITIES}
    succeeded = {c: 0 for c in PRIORITIES}
    for task in stats.tasks:
        outcomes[task.outcome] = outcomes.get(task.outcome, 0) + 1
        arrived[task.priority] += 1
        if task.outcome == "completed" and task.slo_met:
            succeeded[task.priority] += 1
    ttfts = sorted(t for _, t in stats.ttfts)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None
    work = stats.useful_tokens + stats.wasted_tokens
    tokens = sum(r.prompt_tokens_total + r.generation_tokens_total for r in sim.replicas)
    return Outcome(duration_s=duration_s, arrivals=stats.arrivals, outcomes=outcomes,
                   completed=outcomes.get("completed", 0), slo_successes=sum(succeeded.values()),
                   attainment={c: succeeded[c] / arrived[c] if arrived[c] else 1.0 for c in PRIORITIES},
                   ttft_p99_s=p99, waste_share=stats.wasted_tokens / work if work else 0.0,
                   gpu_seconds=stats.gpu_seconds, requests_per_s=stats.admitted / duration_s,
                   tokens_per_s=stats.arrival_tokens_per_s or tokens / max(sim.now, 1e-9), cut_off=stats.cut_off)


def tenant_figures(stats: "Stats", burst_tenant: str) -> dict:
    """Who paid for a tenant's burst: the other tenants' SLO attainment (their SLO-successful share of the
    tasks they sent, every class) and the bursting tenant's share of the attempts admission rejected
    (deferrals are delay, not shedding: deferrable work still meets its SLO later)."""
    others = [t for t in stats.tasks if t.tenant != burst_tenant]
    met = sum(1 for t in others if t.outcome == "completed" and t.slo_met)
    rejected = sum(stats.rejected.values())
    return {"attain_others": round(met / len(others), 4) if others else 1.0,
            "burst_shed_share": round(stats.rejected.get(burst_tenant, 0) / rejected, 4) if rejected else None}


def timeline(sim: "FleetSim", until_s: float, window_s: int = 10) -> dict[str, list[tuple[float, float]]]:
    """Per-second series for the chart, as ``window_s`` moving averages: SLO-goodput (tasks/s, by the
    second they ended), admitted share of the router's decisions, mean KV usage of live replicas."""
    rows = sim.stats.timeline
    seconds = range(int(until_s))

    def moving(values: list[float]) -> list[tuple[float, float]]:
        out, total = [], 0.0
        for i, v in enumerate(values):
            total += v - (values[i - window_s] if i >= window_s else 0.0)
            out.append((float(i), total / min(i + 1, window_s)))
        return out

    def per_second(key: str) -> list[float]:
        return [rows.get(s, {}).get(key, 0.0) for s in seconds]

    decided, admitted = moving(per_second("decisions")), moving(per_second("admitted"))
    admit_share = [(t, a / d if d else 1.0) for (t, d), (_, a) in zip(decided, admitted)]
    kv = [(float(s), rows.get(s, {}).get("kv_usage", 0.0)) for s in seconds]
    return {"slo_goodput": moving(per_second("slo_successes")), "admit_fraction": admit_share, "kv_usage": kv}
