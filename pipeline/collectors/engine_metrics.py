"""Engine exposition text → ReplicaSample fields (pure).

Names are matched by engine; each field takes the first name present, so
both current and older vLLM releases work. Samples of one name with
different labels (engines, GPUs) are summed, but for the KV cache's usage,
a fraction per engine, which is averaged (two data-parallel engines each 40%
full summed to 0.8: a pool at its KV limit with half its cache free); DCGM
utilisation is averaged and converted from percent to a fraction. A value
that is not a finite, non-negative number fails the scrape.
"""

from __future__ import annotations

import math
from typing import Iterable

from prometheus_client.parser import text_string_to_metric_families

# field → candidate sample names, newest first
ENGINE_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "requests_running": ("vllm:num_requests_running",),
        "requests_waiting": ("vllm:num_requests_waiting",),
        "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "preemptions_total": ("vllm:num_preemptions_total",),
        "prompt_tokens_total": ("vllm:prompt_tokens_total",),
        "generation_tokens_total": ("vllm:generation_tokens_total",),
        "prefix_cache_hits_total": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        "prefix_cache_queries_total": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    },
    "sglang": {
        "requests_running": ("sglang:num_running_reqs",),
        "requests_waiting": ("sglang:num_queue_reqs",),
        "kv_cache_usage": ("sglang:token_usage",),
        "preemptions_total": ("sglang:num_retracted_reqs_total",),
        "prompt_tokens_total": ("sglang:prompt_tokens_total",),
        "generation_tokens_total": ("sglang:generation_tokens_total",),
        "prefix_cache_hits_total": ("sglang:cached_tokens_total",),
        "prefix_cache_queries_total": ("sglang:prompt_tokens_total",),
    },
}
REQUIRED = ("requests_running", "requests_waiting", "kv_cache_usage")
AVERAGED = ("kv_cache_usage",)   # a fraction per engine: the replica's is their mean
DCGM = {"gpu_util": ("DCGM_FI_DEV_GPU_UTIL", "mean_percent"), "fb_used_mib": ("DCGM_FI_DEV_FB_USED", "sum"),
        "power_w": ("DCGM_FI_DEV_POWER_USAGE", "sum")}


class ScrapeError(ValueError):
    """The endpoint's text is not exposition format, or lacks the engine's core gauges."""


def _samples(text: str) -> dict[str, list[float]]:
    try:
        out: dict[str, list[float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out.setdefault(sample.name, []).append(float(sample.value))
        return out
    except Exception as exc:  # the parser raises several types on garbage
        raise ScrapeError(f"not Prometheus exposition text: {type(exc).__name__}: {str(exc)[:200]}") from None


def _first(samples: dict[str, list[float]], names: Iterable[str], mean: bool = False) -> float | None:
    for name in names:
        if name in samples:
            values = samples[name]
            return sum(values) / len(values) if mean else sum(values)
    return None


def _checked(fields: dict[str, float]) -> dict[str, float]:
    bad = {name: value for name, value in fields.items() if not (math.isfinite(value) and value >= 0)}
    if bad:
        raise ScrapeError(f"values that are not finite non-negative numbers: {bad!r:.200}")
    return fields


def parse_engine(text: str, engine: str) -> dict[str, float]:
    """ReplicaSample fields from an engine's /metrics text; raises ScrapeError on garbage."""
    samples = _samples(text)
    names = ENGINE_NAMES[engine]
    fields: dict[str, float] = {}
    for field, candidates in names.items():
        value = _first(samples, candidates, mean=field in AVERAGED)
        if value is None:
            if field in REQUIRED:
                raise ScrapeError(f"{engine} metric {candidates[0]} is missing")
            value = 0.0
        fields[field] = value
    _checked(fields)
    fields["requests_running"] = int(fields["requests_running"])
    fields["requests_waiting"] = int(fields["requests_waiting"])
    fields["kv_cache_usage"] = min(1.0, max(0.0, fields["kv_cache_usage"]))
    return fields


def parse_dcgm(text: str) -> dict[str, float]:
    samples = _samples(text)
    out: dict[str, float] = {}
    for field, (name, how) in DCGM.items():
        values = samples.get(name)
        if values:
            out[field] = sum(values) / len(values) / 100 if how == "mean_percent" else sum(values)
    _checked(out)   # before the clamp, which made NaN or +Inf utilisation read 1.0
    return {field: min(1.0, value) if DCGM[field][1] == "mean_percent" else value for field, value in out.items()}
