"""A pool's load picture: merged partials → the seven axes, each a raw value and a pressure.

Time is event time only. A pool's *watermark* is the newest event time
merged; windows are the whole seconds before the watermark's second
(``fast_window_s`` for demand, queue, kv, compute, latency and errors,
``cost_window_s`` for cost and goodput). When a partial arrives, a second
older than the watermark by more than ``allowed_lateness_s`` is closed: data
for it is counted as late and left out. Partials are deduplicated by id, so a redelivered one is not
counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .. import cost
from .aggregates import REPLICA_SUMS, ReplicaAgg, RequestAgg
from .partial import Partial
from ..events import PRIORITIES
from .profiles import Profile
from .sketch import QuantileSketch

PRESSURE_CAP = 10.0  # pressure when a limit is zero (no capacity left) or a cost is unbounded
AXES = ("demand", "queue", "kv_cache", "compute", "latency", "errors", "cost")
MAX_MODELS = 16  # models remembered per pool (for finding sibling pools), bounded against bad data


@dataclass(frozen=True)
class PictureConfig:
    profile: Profile
    prices: Mapping[str, float]
    fast_window_s: int
    cost_window_s: int
    allowed_lateness_s: float
    stale_after_s: float


def pressure(value: float | None, limit: float) -> float:
    if value is None or value <= 0:
        return 0.0
    if limit <= 0:
        return PRESSURE_CAP
    return min(PRESSURE_CAP, value / limit)


class PoolState:
    """Everything stage 2 keeps for one pool; serialisable for the changelog table."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.watermark_ms = 0
        self.requests: dict[int, RequestAgg] = {}
        self.replicas: dict[str, ReplicaAgg] = {}
        self.seen: dict[str, int] = {}  # partial id → its newest_ms, for deduplication
        self.late_events = 0
        self.partials_merged = 0
        self.duplicate_partials = 0
        self.evicted: list[str] = []  # partial ids that left the window in the last merge
        self.models: list[str] = []

    # -- merging -------------------------------------------------------------------------------------

    def merge(self, partial: Partial, config: PictureConfig) -> bool:
        """Fold a partial in; False (and nothing changes) when its id was merged before."""
        if partial.id in self.seen:
            self.duplicate_partials += 1
            return False
        self.seen[partial.id] = partial.newest_ms
        self.partials_merged += 1
        for model in partial.models:
            if model not in self.models and len(self.models) < MAX_MODELS:
                self.models.append(model)
        closed_before = self._closed_before(config)
        if partial.newest_ms > self.watermark_ms:
            self.watermark_ms = partial.newest_ms
        for second, agg in partial.requests.items():
            if second < closed_before:
                self.late_events += agg.counts["events"]
                continue
            mine = self.requests.get(second)
            if mine is None:
                self.requests[second] = agg
            else:
                mine.merge(agg)
        for replica_id, incoming in partial.replicas.items():
            mine = self.replicas.get(replica_id)
            if mine is None:
                mine = self.replicas[replica_id] = ReplicaAgg()
            if incoming.latest is not None:
                mine.see(incoming.latest)
            for second, deltas in incoming.seconds.items():
                if second < closed_before:
                    self.late_events += 1
                else:
                    mine.add(second, deltas)
        self._evict(config)
        return True

    def _closed_before(self, config: PictureConfig) -> int:
        """Seconds before this one are closed: late relative to what had been merged so far."""
        return int((self.watermark_ms - config.allowed_lateness_s * 1000) // 1000)

    def _evict(self, config: PictureConfig) -> None:
        keep_from = self.watermark_ms // 1000 - config.cost_window_s - int(config.allowed_lateness_s) - 1
        for second in [s for s in self.requests if s < keep_from]:
            del self.requests[second]
        for replica_id, agg in list(self.replicas.items()):
            for second in [s for s in agg.seconds if s < keep_from]:
                del agg.seconds[second]
            if agg.latest is not None and agg.latest.event_time < keep_from * 1000 and not agg.seconds:
                del self.replicas[replica_id]
        self.evicted = [p for p, newest in self.seen.items() if newest < keep_from * 1000]
        for pid in self.evicted:
            del self.seen[pid]

    # -- reading -------------------------------------------------------------------------------------

    def _window(self, seconds: int) -> range:
        end = self.watermark_ms // 1000
        return range(end - seconds, end)

    def _requests_in(self, seconds: int) -> RequestAgg:
        total = RequestAgg()
        for second in self._window(seconds):
            agg = self.requests.get(second)
            if agg is not None:
                total.merge(agg)
        return total

    def _replica_sums(self, replica: ReplicaAgg, seconds: int) -> dict[str, float]:
        sums = dict.fromkeys(REPLICA_SUMS, 0.0)
        for second in self._window(seconds):
            deltas = replica.seconds.get(second)
            if deltas:
                for name, value in deltas.items():
                    sums[name] += value
        return sums

    def snapshot(self, config: PictureConfig) -> dict[str, Any]:
        """The picture as published on sluice.load.v1 and served at /pools."""
        p = config.profile
        fast, slow = config.fast_window_s, config.cost_window_s
        req = self._requests_in(fast)
        req_slow = self._requests_in(slow)
        c = req.counts

        fresh, stale, unhealthy = [], [], []
        for replica_id, agg in sorted(self.replicas.items()):
            latest = agg.latest
            if latest is None or self.watermark_ms - latest.event_time > config.stale_after_s * 1000:
                stale.append(replica_id)
            elif not latest.healthy:
                unhealthy.append(replica_id)
            else:
                fresh.append(replica_id)
        n_fresh = len(fresh)
        sums = {r: self._replica_sums(a, fast) for r, a in self.replicas.items()}
        slow_sums = {r: self._replica_sums(a, slow) for r, a in self.replicas.items()}

        arrival_rps = c["received"] / fast
        capacity_rps = p.capacity_rps_per_replica * n_fresh
        demand = {"value": arrival_rps, "limit": capacity_rps, "unit": "req/s",
                  "detail": {"admitted_rps": c["admitted"] / fast,
                             # a deferred request asks again with the same attempt number: net it out
                             "first_attempts_rps": {k: max(0, c["first_" + k] - (c["deferred"] if k == "deferrable"
                                                                                 else 0)) / fast
                                                    for k in PRIORITIES},
                             "input_tokens_per_s": c["input_tokens"] / fast,
                             "output_tokens_per_s": c["output_tokens"] / fast}}

        waiting = sum(self.replicas[r].latest.requests_waiting for r in fresh + unhealthy)
        drain_rps = c["completed"] / fast
        predicted_wait = (waiting / drain_rps if drain_rps else (None if not waiting else float("inf")))
        queue_sketch = req.sketches.get("queue")
        queue_p95 = queue_sketch.quantile(0.95) if queue_sketch else None
        queue_value = max((v for v in (predicted_wait, queue_p95) if v is not None), default=None)
        queue = {"value": queue_value, "limit": p.queue_wait_fraction * p.slo_ttft_s, "unit": "s",
                 "detail": {"requests_waiting": waiting, "drain_rps": drain_rps, "predicted_wait_s": predicted_wait,
                            "queue_p95_s": queue_p95}}

        # a replica that just went quiet may still be serving: its cache counts as full; one silent for
        # twice the threshold is presumed gone, and only its capacity is missed (a dead replica would
        # otherwise hold the KV axis up until it is forgotten)
        gone_before = self.watermark_ms - 2 * config.stale_after_s * 1000
        quiet = [r for r in stale if self.replicas[r].latest is not None
                 and self.replicas[r].latest.event_time >= gone_before]
        usages = [self.replicas[r].latest.kv_cache_usage for r in fresh + unhealthy] + [1.0] * len(quiet)
        kv_usage = sum(usages) / len(usages) if usages else None
        preempt_rate = sum(sums[r]["preemptions"] for r in sums) / fast / max(n_fresh, 1)
        kv = {"value": kv_usage, "limit": p.kv_limit, "unit": "fraction",
              "detail": {"preemptions_per_s_per_replica": preempt_rate,
                         "preemption_pressure": pressure(preempt_rate, p.preemptions_per_s_limit)}}

        tokens_per_s = sum(sums[r]["prompt_tokens"] + sums[r]["generation_tokens"] for r in sums) / fast
        compute = {"value": tokens_per_s, "limit": p.compute_limit * p.peak_tokens_per_s * n_fresh,
                   "unit": "tokens/s",
                   "detail": {"prompt_tokens_per_s": sum(sums[r]["prompt_tokens"] for r in sums) / fast,
                              "generation_tokens_per_s": sum(sums[r]["generation_tokens"] for r in sums) / fast}}

        quantiles = {}
        for name in ("ttft", "tpot", "queue"):
            sketch = req.sketches.get(name) or QuantileSketch()
            quantiles[name] = {q: sketch.quantile(v) for q, v in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))}
        ttft_ratio = (quantiles["ttft"]["p95"] / p.slo_ttft_s) if quantiles["ttft"]["p95"] is not None else None
        tpot_ratio = (quantiles["tpot"]["p95"] / p.slo_tpot_s) if quantiles["tpot"]["p95"] is not None else None
        latency_value = max((v for v in (ttft_ratio, tpot_ratio) if v is not None), default=None)
        latency = {"value": latency_value, "limit": p.latency_limit, "unit": "× SLO",
                   "detail": {"ttft_p95_s": quantiles["ttft"]["p95"], "tpot_p95_s": quantiles["tpot"]["p95"],
                              "slo_ttft_s": p.slo_ttft_s, "slo_tpot_s": p.slo_tpot_s}}

        finished = c["completed"] + c["failed"]
        failure_rate = c["failed"] / finished if finished else None
        # retries that answer our own rejections are not the cascade: counting them would make shedding
        # raise the errors axis, which sheds more (a loop that never lets go)
        failure_retries = max(0, c["retries"] - c["rejected"])
        amplification = 1 + failure_retries / c["first_attempts"] if c["first_attempts"] else None
        error_pressure = max(pressure(failure_rate, p.error_budget),
                             pressure((amplification or 1.0) - 1.0, p.retry_budget))
        errors = {"value": failure_rate, "limit": p.error_budget, "unit": "fraction",
                  "detail": {"retry_amplification": amplification, "retry_budget": p.retry_budget}}

        fleet_cost, unpriced = 0.0, 0.0
        for replica_id, agg in self.replicas.items():
            gpu_s = slow_sums[replica_id]["gpu_seconds"]
            hardware = agg.latest.hardware if agg.latest else ""
            if hardware in config.prices:
                fleet_cost += cost.gpu_seconds_cost(gpu_s, config.prices[hardware])
            else:
                unpriced += gpu_s
        successes = req_slow.counts["task_successes"]
        per_task = cost.cost_per_successful_task(fleet_cost, successes)
        if per_task is not None:
            cost_value = per_task
        elif fleet_cost > 0 and req_slow.counts["received"]:
            cost_value = float("inf")  # paying for traffic that never succeeds
        else:
            cost_value = None  # an idle window: nothing to divide by, nothing to judge
        cost_axis = {"value": cost_value, "limit": p.cost_budget_per_task, "unit": "$/task",
                     "detail": {"fleet_cost": fleet_cost, "successful_tasks": successes,
                                "unpriced_gpu_seconds": unpriced, "window_s": slow}}

        axes = {"demand": demand, "queue": queue, "kv_cache": kv, "compute": compute, "latency": latency,
                "errors": errors, "cost": cost_axis}
        for name, axis in axes.items():
            axis["pressure"] = pressure(axis["value"], axis["limit"])
        axes["kv_cache"]["pressure"] = max(axes["kv_cache"]["pressure"], kv["detail"]["preemption_pressure"])
        axes["errors"]["pressure"] = error_pressure
        for axis in axes.values():
            axis["value"] = _finite(axis["value"])
            axis["pressure"] = round(axis["pressure"], 6)
            axis["detail"] = {k: _finite(v) for k, v in axis["detail"].items()}
        return {
            "pool": self.pool,
            "profile": p.name,
            "models": sorted(self.models),
            "watermark_ms": self.watermark_ms,
            "windows_s": {"fast": fast, "cost": slow},
            "pressure": max(a["pressure"] for a in axes.values()),
            "binding_axis": max(AXES, key=lambda a: axes[a]["pressure"]),
            "axes": axes,
            "replicas": {"total": len(self.replicas), "fresh": n_fresh, "stale": len(stale),
                         "unhealthy": len(unhealthy), "stale_ids": stale[:20]},
            "rates": {"arrival_rps": arrival_rps, "admitted_rps": c["admitted"] / fast,
                      "input_tokens_per_s": c["input_tokens"] / fast, "output_tokens_per_s": c["output_tokens"] / fast,
                      "goodput_tasks_per_s": req_slow.counts["task_successes"] / slow,
                      "completed_rps": drain_rps},
            "latency_s": {name: {k: _finite(v) for k, v in qs.items()} for name, qs in quantiles.items()},
            "late_events": self.late_events,
            "partials_merged": self.partials_merged,
            "duplicate_partials": self.duplicate_partials,
        }

    # -- persistence ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"pool": self.pool, "watermark_ms": self.watermark_ms, "late_events": self.late_events,
                "models": self.models,
                "partials_merged": self.partials_merged, "duplicate_partials": self.duplicate_partials,
                "seen": self.seen, "requests": {str(k): v.to_dict() for k, v in self.requests.items()},
                "replicas": {k: v.to_dict() for k, v in self.replicas.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PoolState":
        state = cls(data["pool"])
        state.watermark_ms = data["watermark_ms"]
        state.late_events = data["late_events"]
        state.partials_merged = data["partials_merged"]
        state.duplicate_partials = data["duplicate_partials"]
        state.models = list(data.get("models", []))
        state.seen = dict(data["seen"])
        state.requests = {int(k): RequestAgg.from_dict(v) for k, v in data["requests"].items()}
        state.replicas = {k: ReplicaAgg.from_dict(v) for k, v in data["replicas"].items()}
        return state


def _finite(value: Any) -> Any:
    """JSON has no infinity: an unbounded value is reported as None with the axis pressure at the cap."""
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return None
        return round(value, 6)
    return value
