"""Pool profiles: where a pool sits on the latency–cost–throughput triangle.

A profile sets the limits that turn each axis's raw value into a pressure
(value ÷ limit, 1.0 = at the limit). Profiles are configuration: the three
built-ins below can be overridden or extended with the ``profiles`` setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Mapping


@dataclass(frozen=True)
class Profile:
    name: str
    slo_ttft_s: float            # latency axis: p95 TTFT objective
    slo_tpot_s: float            # latency axis: p95 TPOT objective
    latency_limit: float         # latency pressure 1.0 at this multiple of the SLO
    capacity_rps_per_replica: float  # demand axis: admitted capacity per fresh, healthy replica
    queue_wait_fraction: float   # queue axis: predicted wait limit as a share of the TTFT SLO
    kv_limit: float              # kv_cache axis: usage limit (0–1)
    preemptions_per_s_limit: float  # kv_cache axis: preemptions/s per replica
    peak_tokens_per_s: float     # compute axis: measured peak prefill+decode tokens/s per replica
    compute_limit: float         # compute axis: share of the peak
    error_budget: float          # errors axis: failed share of finished attempts
    retry_budget: float          # errors axis: retries per request (attempts/request − 1)
    cost_budget_per_task: float  # cost axis: $ per successful task


BUILTIN = {
    "interactive": Profile("interactive", slo_ttft_s=1.0, slo_tpot_s=0.05, latency_limit=1.0,
                           capacity_rps_per_replica=8.0, queue_wait_fraction=0.2, kv_limit=0.8,
                           preemptions_per_s_limit=0.5, peak_tokens_per_s=40000.0, compute_limit=0.8,
                           error_budget=0.01, retry_budget=0.05, cost_budget_per_task=0.02),
    "balanced": Profile("balanced", slo_ttft_s=2.0, slo_tpot_s=0.1, latency_limit=1.0,
                        capacity_rps_per_replica=10.0, queue_wait_fraction=0.2, kv_limit=0.9,
                        preemptions_per_s_limit=1.0, peak_tokens_per_s=40000.0, compute_limit=0.9,
                        error_budget=0.02, retry_budget=0.1, cost_budget_per_task=0.01),
    "batch": Profile("batch", slo_ttft_s=30.0, slo_tpot_s=0.2, latency_limit=1.0,
                     capacity_rps_per_replica=14.0, queue_wait_fraction=0.8, kv_limit=0.97,
                     preemptions_per_s_limit=3.0, peak_tokens_per_s=40000.0, compute_limit=0.97,
                     error_budget=0.05, retry_budget=0.2, cost_budget_per_task=0.005),
}

FIELDS = {f.name for f in fields(Profile)} - {"name"}


def build_profiles(overrides: Mapping[str, Mapping[str, float]]) -> dict[str, Profile]:
    """Built-ins plus configured profiles; a configured profile starts from ``balanced`` (or its
    built-in namesake) and may set any limit. Unknown names or bad values fail at start-up."""
    profiles = dict(BUILTIN)
    for name, values in overrides.items():
        unknown = set(values) - FIELDS
        if unknown:
            raise ValueError(f"profile {name!r}: unknown limit(s) {sorted(unknown)}; known: {sorted(FIELDS)}")
        for key, value in values.items():
            # NaN fails no `<= 0` test: a kv_limit of NaN read an idle pool's KV axis at its cap
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"profile {name!r}: {key} must be a positive, finite number, got {value!r}")
        base = profiles.get(name, BUILTIN["balanced"])
        profiles[name] = replace(base, name=name, **{k: float(v) for k, v in values.items()})
    return profiles


def check_assignment(profiles: Mapping[str, Profile], pool_profiles: Mapping[str, str], default: str) -> None:
    missing = {p for p in [default, *pool_profiles.values()] if p not in profiles}
    if missing:
        raise ValueError(f"unknown profile(s) {sorted(missing)}; defined: {sorted(profiles)}")
