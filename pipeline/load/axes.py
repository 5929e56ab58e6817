"""The seven axes: one small function each, from a pool's readings to an ``Axis``.

Every axis is a raw value in its own unit, the profile's limit for it, and a
pressure = value ÷ limit (1.0 = at the limit on every axis). ``AXIS_FUNCTIONS``
is the one registry: the picture computes exactly the axes listed there, in
that order, so adding an axis means adding its function there (and to the
``load_picture`` schema, which a test checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .. import cost
from ..events import PRIORITIES, ReplicaSample
from .aggregates import RequestAgg
from .profiles import Profile
from .sketch import QuantileSketch

PRESSURE_CAP = 10.0  # pressure when a limit is zero (no capacity left) or a cost is unbounded
QUANTILES = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
# the newest arrivals' prompts, compared with the fast window's: two whole seconds, about a hundred arrivals at a
# pool's usual rate, and a change of mix seen a second or two after it starts (the replicas' counters show it
# only once the heavier work is being served, and a standing queue measures it some seconds later)
RECENT_PROMPTS_S = 2
# each prompt counts at most four times the p90 of the fast window's earlier seconds: absurd sizes cannot make
# the pool look much heavier (k of n arrivals raise their mean by at most k/n of that, and only a tenth of them
# moves a p90), while a real change of mix, whose new prompts are rarely ten times the old mean, reads whole
PROMPT_CLIP_QUANTILE = 0.9
PROMPT_CLIP_FACTOR = 4.0
PROMPT_FIELDS = ("prompt_tokens_window_mean", "prompt_tokens_window_sd", "prompt_tokens_window_count",
                 "prompt_tokens_recent_mean", "prompt_tokens_recent_count", "prompt_clip_tokens")
LATENCIES = ("ttft", "tpot", "queue")


def pressure(value: float | None, limit: float) -> float:
    if value is None or value <= 0:
        return 0.0
    if limit <= 0:
        return PRESSURE_CAP
    return min(PRESSURE_CAP, value / limit)


def finite(value: Any) -> Any:
    """JSON has no infinity: an unbounded value is reported as None with the axis pressure at the cap."""
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return None
        return round(value, 6)
    return value


@dataclass(frozen=True)
class Axis:
    """One axis of a pool's picture. ``value`` may be infinite or None here; the wire form has no infinity.

    ``pressure`` is kept at the published precision (6 places), so the pool's
    pressure and binding axis are the same whether read here or on the wire.
    """

    value: float | None
    limit: float
    unit: str
    detail: Mapping[str, Any]
    pressure: float

    @classmethod
    def of(cls, value: float | None, limit: float, unit: str, detail: Mapping[str, Any],
           at_least: float = 0.0) -> "Axis":
        """value ÷ limit, raised to ``at_least`` for axes a second signal can also push up."""
        return cls(value, limit, unit, detail, round(max(pressure(value, limit), at_least), 6))

    def to_dict(self) -> dict[str, Any]:
        return {"value": finite(self.value), "limit": self.limit, "unit": self.unit,
                "detail": {k: finite(v) for k, v in self.detail.items()}, "pressure": self.pressure}


@dataclass(frozen=True)
class Replicas:
    """A pool's replica ids (sorted), classed by their newest sample as of the watermark."""

    fresh: tuple[str, ...]      # sampled recently and healthy: the pool's capacity
    unhealthy: tuple[str, ...]  # sampled recently, reporting unhealthy: no capacity, but still queueing work
    stale: tuple[str, ...]      # no sample for stale_after_s
    quiet: tuple[str, ...]      # stale for under twice that: may still be serving, so its KV cache counts as full
    outliers: tuple[str, ...] = ()  # read far above every sibling: counted at a cap (replica_outliers)

    def to_dict(self) -> dict[str, Any]:
        return {"total": len(self.fresh) + len(self.stale) + len(self.unhealthy), "fresh": len(self.fresh),
                "stale": len(self.stale), "unhealthy": len(self.unhealthy), "stale_ids": list(self.stale[:20]),
                "outlier_ids": list(self.outliers[:20])}


@dataclass(frozen=True)
class Readings:
    """Everything the axes are computed from: one pool's windows added up at its watermark."""

    profile: Profile
    prices: Mapping[str, float]               # $ per GPU-hour by hardware
    fast_s: int                               # the fast window, s
    cost_s: int                               # the cost window, s
    requests: RequestAgg                      # request events over the fast window
    cost_requests: RequestAgg                 # request events over the cost window
    replicas: Replicas
    samples: Mapping[str, ReplicaSample]      # each replica's newest sample, where it has one
    waiting: Mapping[str, float]              # per fresh or unhealthy replica: its engine queue, outlier capped
    sums: Mapping[str, Mapping[str, float]]       # per replica: counter deltas over the fast window, outlier capped
    cost_sums: Mapping[str, Mapping[str, float]]  # per replica: counter deltas over the cost window
    recent_prompts: QuantileSketch | None = None   # prompt sizes of the last RECENT_PROMPTS_S seconds' arrivals
    earlier_prompts: QuantileSketch | None = None  # ... and of the fast window's seconds before them


def quantiles(requests: RequestAgg) -> dict[str, dict[str, float | None]]:
    """p50/p95/p99 of TTFT, TPOT and queue time, s (None where nothing was measured)."""
    out = {}
    for name in LATENCIES:
        sketch = requests.sketches.get(name) or QuantileSketch()
        out[name] = {label: sketch.quantile(q) for label, q in QUANTILES}
    return out


def demand_axis(r: Readings) -> Axis:
    """Arrivals (retries included) against the capacity of the fresh replicas."""
    c, fast = r.requests.counts, r.fast_s
    return Axis.of(c["received"] / fast, r.profile.capacity_rps_per_replica * len(r.replicas.fresh), "req/s", {
        "admitted_rps": c["admitted"] / fast,
        # a deferred request asks again with the same attempt number: net it out
        "first_attempts_rps": {k: max(0, c["first_" + k] - (c["deferred"] if k == "deferrable" else 0)) / fast
                               for k in PRIORITIES},
        # every attempt, retries of shed work included: what the admitted rate is made of
        "offered_rps": {k: max(0, c["received_" + k] - (c["deferred"] if k == "deferrable" else 0)) / fast
                        for k in PRIORITIES},
        "input_tokens_per_s": c["input_tokens"] / fast,
        "output_tokens_per_s": c["output_tokens"] / fast,
        **arriving_prompts(r)})


def arriving_prompts(r: Readings) -> dict[str, float | None]:
    """Prompt sizes of the arrivals that carry one (``input_tokens`` on ``received``): over the fast window and its
    newest RECENT_PROMPTS_S seconds, each prompt clipped at ``prompt_clip_tokens``, which comes from the window's
    earlier seconds alone (a burst in the newest cannot raise its own clip); None unless both carry some. Flat
    numbers, as every detail field a worker before them reads from the load topic is."""
    window, earlier, recent = r.requests.sketches.get("prompt"), r.earlier_prompts, r.recent_prompts
    if not (window and window.count and earlier and earlier.count and recent and recent.count):
        return dict.fromkeys(PROMPT_FIELDS)
    clip = PROMPT_CLIP_FACTOR * (earlier.quantile(PROMPT_CLIP_QUANTILE) or 0.0)
    count, mean, sd = window.clipped_moments(clip)
    recent_count, recent_mean, _ = recent.clipped_moments(clip)
    return dict(zip(PROMPT_FIELDS, (round(mean, 3), round(sd, 3), count, round(recent_mean, 3), recent_count,
                                    round(clip, 3))))


def queue_axis(r: Readings) -> Axis:
    """Predicted wait: what the engines hold now ÷ how fast the pool completes. The p95 of the queue time
    completed requests report is the fallback when no replica is sampled: it lags the real queue by the
    requests' duration (10–15 s under load), which is too late to act on."""
    p = r.profile
    sampled = r.replicas.fresh + r.replicas.unhealthy
    waiting = int(sum(r.waiting.values()))
    drain_rps = r.requests.counts["completed"] / r.fast_s
    predicted_wait = (waiting / drain_rps if drain_rps else (None if not waiting else float("inf")))
    sketch = r.requests.sketches.get("queue")
    queue_p95 = sketch.quantile(0.95) if sketch else None
    value = predicted_wait if sampled else queue_p95
    return Axis.of(value, p.queue_wait_fraction * p.slo_ttft_s, "s", {
        "requests_waiting": waiting, "drain_rps": drain_rps, "predicted_wait_s": predicted_wait,
        "queue_p95_s": queue_p95})


def kv_cache_axis(r: Readings) -> Axis:
    """Mean KV usage (quiet replicas count as full); preemptions per replica can raise the pressure too."""
    p = r.profile
    usages = [r.samples[i].kv_cache_usage for i in r.replicas.fresh + r.replicas.unhealthy]
    usages += [1.0] * len(r.replicas.quiet)
    usage = sum(usages) / len(usages) if usages else None
    preempt_rate = sum(r.sums[i]["preemptions"] for i in r.sums) / r.fast_s / max(len(r.replicas.fresh), 1)
    preemption_pressure = pressure(preempt_rate, p.preemptions_per_s_limit)
    return Axis.of(usage, p.kv_limit, "fraction", {
        "preemptions_per_s_per_replica": preempt_rate, "preemption_pressure": preemption_pressure},
        at_least=preemption_pressure)


def compute_axis(r: Readings) -> Axis:
    """Prompt + generation tokens/s from the replicas' counters against their measured peak."""
    p, sums, fast = r.profile, r.sums, r.fast_s
    tokens_per_s = sum(sums[i]["prompt_tokens"] + sums[i]["generation_tokens"] for i in sums) / fast
    return Axis.of(tokens_per_s, p.compute_limit * p.peak_tokens_per_s * len(r.replicas.fresh), "tokens/s", {
        "prompt_tokens_per_s": sum(sums[i]["prompt_tokens"] for i in sums) / fast,
        "generation_tokens_per_s": sum(sums[i]["generation_tokens"] for i in sums) / fast})


FIRST_TOKEN_COVERAGE = 0.5   # first-token TTFTs per completion over the cost window, at least, to read them


def latency_axis(r: Readings) -> Axis:
    """The worse of p95 TTFT and p95 TPOT, each as a multiple of its SLO.

    TTFT comes from first-token events where the routers send them (a first token is news a whole
    generation earlier than its completion), else from completions; attempts that timed out before a
    first token count at their duration (censored) in both. First tokens are read only where the routers
    send them for at least half the completions over the cost window (``FIRST_TOKEN_COVERAGE``): in a fleet
    where some routers send them and most do not, one slow first token among hundreds of fast completions
    was the whole p95 and shed the pool. Over the cost window, not the fast one: while a queue stalls, first
    tokens stop and completions go on, and that is when the first tokens' TTFT is the news (judged over the
    fast window, the simulator's long-context critical attainment moved by up to 1.1 points either way)."""
    p = r.profile
    q = quantiles(r.requests)
    first = r.requests.sketches.get("ttft_first")
    c = r.cost_requests.counts
    from_first = first is not None and r.requests.counts["first_token_ttfts"] > 0 and \
        c["first_token_ttfts"] >= FIRST_TOKEN_COVERAGE * c["completed"]
    ttft_p95 = first.quantile(0.95) if from_first else q["ttft"]["p95"]
    tpot_p95 = q["tpot"]["p95"]
    ttft_ratio = ttft_p95 / p.slo_ttft_s if ttft_p95 is not None else None
    tpot_ratio = tpot_p95 / p.slo_tpot_s if tpot_p95 is not None else None
    value = max((v for v in (ttft_ratio, tpot_ratio) if v is not None), default=None)
    return Axis.of(value, p.latency_limit, "× SLO", {
        "ttft_p95_s": ttft_p95, "tpot_p95_s": tpot_p95, "slo_ttft_s": p.slo_ttft_s, "slo_tpot_s": p.slo_tpot_s})


def errors_axis(r: Readings) -> Axis:
    """Failed share of finished attempts; retry amplification past its budget raises the pressure too."""
    p, c = r.profile, r.requests.counts
    finished = c["completed"] + c["failed"]
    failure_rate = c["failed"] / finished if finished else None
    # retries that answer our own rejections are not the cascade: counting them would make shedding
    # raise the errors axis, which sheds more (a loop that never lets go)
    failure_retries = max(0, c["retries"] - c["rejected"])
    amplification = 1 + failure_retries / c["first_attempts"] if c["first_attempts"] else None
    return Axis.of(failure_rate, p.error_budget, "fraction", {
        "retry_amplification": amplification, "retry_budget": p.retry_budget},
        at_least=pressure((amplification or 1.0) - 1.0, p.retry_budget))


def cost_axis(r: Readings) -> Axis:
    """Fleet cost (every replica-second, idle included) ÷ successful tasks over the cost window."""
    fleet_cost, unpriced = 0.0, 0.0
    for replica_id, sums in r.cost_sums.items():
        gpu_s = sums["gpu_seconds"]
        sample = r.samples.get(replica_id)
        hardware = sample.hardware if sample is not None else ""
        if hardware in r.prices:
            fleet_cost += cost.gpu_seconds_cost(gpu_s, r.prices[hardware])
        else:
            unpriced += gpu_s
    successes = r.cost_requests.counts["task_successes"]
    per_task = cost.cost_per_successful_task(fleet_cost, successes)
    if per_task is not None:
        value = per_task
    elif fleet_cost > 0 and r.cost_requests.counts["received"]:
        value = float("inf")  # paying for traffic that never succeeds
    else:
        value = None  # an idle window: nothing to divide by, nothing to judge
    return Axis.of(value, r.profile.cost_budget_per_task, "$/task", {
        "fleet_cost": fleet_cost, "successful_tasks": successes, "unpriced_gpu_seconds": unpriced,
        "window_s": r.cost_s})


AXIS_FUNCTIONS: Mapping[str, Callable[[Readings], Axis]] = {
    "demand": demand_axis,
    "queue": queue_axis,
    "kv_cache": kv_cache_axis,
    "compute": compute_axis,
    "latency": latency_axis,
    "errors": errors_axis,
    "cost": cost_axis,
}
AXES = tuple(AXIS_FUNCTIONS)
