"""Mergeable per-second aggregates: what stage 1 folds events into and stage 2 adds up.

Everything here is a sum, a latest-value or a sketch, so aggregates from any
number of partitions and ticks merge in any order to the same result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..contract import compile_schema, load_schema
from ..events import PRIORITIES, ReplicaSample, RequestEvent
from .checks import MAX_COUNT, amount, count, mapping
from .sketch import QuantileSketch

SAMPLE_FIELDS = load_schema("replica_sample")["properties"]
REQUEST_COUNTS = (
    "events",            # every event folded (for late accounting)
    "received",          # attempts that reached the router (arrivals, retries included)
    "first_attempts",    # attempt 1 of a request
    "retries",           # attempts > 1
    "admitted", "rejected", "deferred", "redirected", "first_tokens", "completed", "failed", "cancelled",
    "task_successes",    # completed with task_final: the task finished well
    "task_failures",     # a terminal, task_final attempt that did not complete
    "input_tokens", "output_tokens", "cached_input_tokens",   # from completed and failed attempts
    "ttft_slo_misses",   # completed attempts whose TTFT exceeded their SLO
    # first attempts per priority class, and every attempt (retries included) per class: the offered
    # work the policy's feed-forward sheds against
    "first_critical", "first_standard", "first_sheddable", "first_deferrable",
    "received_critical", "received_standard", "received_sheddable", "received_deferrable",
    "timeouts",          # attempts the client gave up on before a first token (censored TTFTs)
    "first_token_ttfts", # first_token events that carry a TTFT (the latency axis reads them when there are any)
)
# what a pool or tenant name may be (the contract's pattern): a partial or picture naming anything else is
# refused, or a name no signal may carry would reach the admission signal and make routers refuse it
IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*\Z")
MAX_TENANTS = 64            # tenants counted by name per pool-second; the rest together, as OTHER_TENANTS
OTHER_TENANTS = "(other)"   # not a valid tenant name (the schema's pattern), so it never collides with one
# per tenant: received, admitted, then received per class (a tenant's class mix: fair shares shed its own
# lower classes first), then its work: attempts finished (completed or failed) with a duration, and their
# time in service, duration less queue time, in whole milliseconds since partials carry integer counts (a
# tenant's work per request: fair shares that shed a heavy tenant admit lighter work in its place)
TENANT_CLASS_AT = {name: 2 + i for i, name in enumerate(PRIORITIES)}
TENANT_WORK_AT = 2 + len(PRIORITIES)
TENANT_COUNTS = TENANT_WORK_AT + 2
MAX_TENANT_NAME = 64        # request_event.v1's maxLength for tenant: a partial's longer names are not tenants
REPLICA_SUMS = ("prompt_tokens", "generation_tokens", "preemptions", "prefix_hits", "prefix_queries",
                "gpu_seconds")


class RequestAgg:
    """Counts and latency sketches of one pool's request events in one event-time second."""

    __slots__ = ("counts", "sketches", "tenants")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(REQUEST_COUNTS, 0)
        self.sketches: dict[str, QuantileSketch] = {}
        # tenant → [attempts received, attempts admitted, received per class in PRIORITIES' order, attempts
        # finished with a duration, their milliseconds in service]
        self.tenants: dict[str, list[int]] = {}

    def _tenant(self, name: str) -> list[int]:
        counts = self.tenants.get(name)
        if counts is None:
            if len(self.tenants) >= MAX_TENANTS:
                name = OTHER_TENANTS
                counts = self.tenants.get(name)
            if counts is None:
                counts = self.tenants[name] = [0] * TENANT_COUNTS
        return counts

    def _sketch(self, name: str) -> QuantileSketch:
        sketch = self.sketches.get(name)
        if sketch is None:
            sketch = self.sketches[name] = QuantileSketch()
        return sketch

    def fold(self, e: RequestEvent) -> None:
        c = self.counts
        c["events"] += 1
        phase = e.phase
        if phase == "received":
            c["received"] += 1
            c["received_" + e.priority] += 1
            if e.input_tokens is not None:   # the prompt's size, where the router counts it on arrival
                self._sketch("prompt").add(e.input_tokens)
            counts = self._tenant(e.tenant)
            counts[0] += 1
            counts[TENANT_CLASS_AT[e.priority]] += 1
            if e.attempt == 1:
                c["first_attempts"] += 1
                c["first_" + e.priority] += 1
            else:
                c["retries"] += 1
        elif phase == "first_token":
            c["first_tokens"] += 1
            if e.ttft_s is not None:
                c["first_token_ttfts"] += 1
                self._sketch("ttft_first").add(e.ttft_s)
        elif phase in ("admitted", "deferred", "redirected", "cancelled"):
            c[phase] += 1
            if phase == "admitted":
                self._tenant(e.tenant)[1] += 1
            elif phase == "deferred":
                # a deferred request asks again with the same attempt: its tenant offered it once (as the
                # demand axis's offered_rps nets deferrals out); never below zero across a second's edge
                counts = self._tenant(e.tenant)
                for i in (0, TENANT_CLASS_AT[e.priority]):
                    counts[i] = max(0, counts[i] - 1)
            elif phase == "cancelled":
                self._censored(e)
        elif phase == "rejected":
            c["rejected"] += 1
            if e.task_final:
                c["task_failures"] += 1
        elif phase in ("completed", "failed"):
            c[phase] += 1
            if phase == "failed":
                self._censored(e)
            c["input_tokens"] += e.input_tokens or 0
            c["output_tokens"] += e.output_tokens or 0
            # an attempt queued longer than it lasted contradicts itself: it says nothing of its tenant's work
            if e.duration_s is not None and (in_service := e.duration_s - (e.queue_s or 0.0)) >= 0:
                counts = self._tenant(e.tenant)
                counts[TENANT_WORK_AT] += 1
                counts[TENANT_WORK_AT + 1] += round(1000 * in_service)
            c["cached_input_tokens"] += e.cached_input_tokens or 0
            if e.queue_s is not None:
                self._sketch("queue").add(e.queue_s)
            if phase == "completed":
                if e.ttft_s is not None:
                    self._sketch("ttft").add(e.ttft_s)
                    if e.slo_ttft_s is not None and e.ttft_s > e.slo_ttft_s:
                        c["ttft_slo_misses"] += 1
                if e.tpot_s is not None:
                    self._sketch("tpot").add(e.tpot_s)
                if e.task_final:
                    c["task_successes"] += 1
            elif e.task_final:
                c["task_failures"] += 1

    def _censored(self, e: RequestEvent) -> None:
        """An attempt that ended without a first token after ``duration_s`` (a client timeout): its TTFT
        was at least that, so it counts in the TTFT sketches at its duration — without it, the attempts
        that time out, the worst ones, would never reach the latency axis."""
        if e.ttft_s is None and e.duration_s and (e.error_type or "").lower() in ("timeout", "timeouterror"):
            self.counts["timeouts"] += 1
            for name in ("ttft", "ttft_first"):
                self._sketch(name).add(e.duration_s)

    def merge(self, other: "RequestAgg") -> None:
        self.merge_counts(other)
        for name, sketch in other.sketches.items():
            self._sketch(name).merge(sketch)

    def merge_counts(self, other: "RequestAgg", tenants: bool = True) -> None:
        c = self.counts
        for name, value in other.counts.items():
            c[name] += value
        if not tenants:
            return
        for name, theirs in other.tenants.items():
            counts = self._tenant(name)
            for i, n in enumerate(theirs):
                counts[i] += n

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in self.counts.items() if v}
        for name, sketch in self.sketches.items():
            out["q_" + name] = sketch.to_dict()
        if self.tenants:
            # a key per kind of count, so that a worker from before one (which reads "tenants" as
            # [received, admitted] and ignores keys it does not know) keeps reading these partials while
            # workers are rolled one at a time, and a rolled-back one reads the stored ones
            out["tenants"] = {name: c[:2] for name, c in self.tenants.items()}
            classes = {name: c[2:TENANT_WORK_AT] for name, c in self.tenants.items() if any(c[2:TENANT_WORK_AT])}
            if classes:
                out["tenant_classes"] = classes
            work = {name: c[TENANT_WORK_AT:] for name, c in self.tenants.items() if any(c[TENANT_WORK_AT:])}
            if work:
                out["tenant_service"] = work
        return out

    def _read_tenants(self, value: Any, key: str, start: int, width: int) -> None:
        """Per-tenant counts from a partial (any worker can write the partials topic): tenant names (the
        contract's pattern, or OTHER_TENANTS) mapped to ``width`` non-negative integers, added from position
        ``start`` of the tenant's counts; at most MAX_TENANTS names; anything else refuses the partial."""
        if not isinstance(value, dict):
            raise ValueError(f"{key} is not an object")
        for name, pair in value.items():
            if (not isinstance(name, str) or len(name) > MAX_TENANT_NAME
                    or not (name == OTHER_TENANTS or IDENTIFIER.match(name)) or not isinstance(pair, list)
                    or len(pair) != width
                    or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 53 for n in pair)):
                raise ValueError(f"{key} holds something that is not {width} counts per tenant name")
            counts = self._tenant(name)
            for i, n in enumerate(pair, start=start):
                counts[i] += n

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RequestAgg":
        agg = cls()
        for key, value in mapping(data, "a second's requests").items():
            if key.startswith("q_"):
                agg.sketches[key[2:]] = QuantileSketch.from_dict(value)
            elif key == "tenants":
                agg._read_tenants(value, key, 0, 2)
            elif key == "tenant_classes":
                agg._read_tenants(value, key, 2, len(PRIORITIES))
            elif key == "tenant_service":
                agg._read_tenants(value, key, TENANT_WORK_AT, TENANT_COUNTS - TENANT_WORK_AT)
            elif key in agg.counts:
                agg.counts[key] = count(value, key)
        return agg


@dataclass
class ReplicaLatest:
    """The newest sample of a replica: the gauges that are read as they are."""

    event_time: int
    hardware: str
    gpu_count: int
    requests_running: int
    requests_waiting: int
    kv_cache_usage: float
    healthy: bool

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ReplicaLatest":
        """The sample's fields, each held to its replica_sample.v1 schema (the contract's own checks)."""
        if set(data) != set(LATEST_CHECKS):
            raise ValueError(f"a replica's latest sample has fields {sorted(data)!r:.200}")
        return cls(**{name: check(data[name], name) for name, check in LATEST_CHECKS.items()})

    @classmethod
    def of(cls, s: ReplicaSample) -> "ReplicaLatest":
        return cls(s.event_time, s.hardware, s.gpu_count, s.requests_running, s.requests_waiting,
                   s.kv_cache_usage, s.healthy)


LATEST_CHECKS = {name: compile_schema(SAMPLE_FIELDS[name], name) for name in ReplicaLatest.__dataclass_fields__}


@dataclass
class ReplicaAgg:
    """One replica in one pool: its newest sample and per-second sums of counter deltas."""

    latest: ReplicaLatest | None = None
    seconds: dict[int, dict[str, float]] = field(default_factory=dict)

    def add(self, second: int, deltas: dict[str, float]) -> None:
        bucket = self.seconds.get(second)
        if bucket is None:
            self.seconds[second] = dict(deltas)
        else:
            for name, value in deltas.items():
                bucket[name] = bucket.get(name, 0.0) + value

    def see(self, latest: ReplicaLatest) -> None:
        if self.latest is None or latest.event_time >= self.latest.event_time:
            self.latest = latest

    def to_dict(self) -> dict[str, Any]:
        return {"latest": None if self.latest is None else self.latest.__dict__,
                "seconds": {str(k): v for k, v in self.seconds.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ReplicaAgg":
        """Raises on a replica stage 1 could not have written: the sample's fields as the contract bounds
        them, and per-second counter deltas as non-negative numbers."""
        latest = mapping(data, "a replica").get("latest")
        seconds = {}
        for key, deltas in mapping(data.get("seconds", {}), "a replica's seconds").items():
            seconds[int(key)] = {name: amount(v, name) for name, v in mapping(deltas, "a replica's deltas").items()}
        return cls(ReplicaLatest.from_dict(mapping(latest, "a replica's latest sample")) if latest else None,
                   seconds)


class ReplicaTracker:
    """Turns cumulative replica counters into deltas (stage 1 sees every sample of a replica,
    because samples are keyed by replica_id).

    A counter that decreases means the engine restarted: the new value is the
    delta since the restart, never a negative one. A sample older than the
    newest one seen is out of order: its gauges are kept if newer elsewhere,
    its counters are not differenced. A delta no engine could count in the gap
    (``MAX_COUNTER_RATE``) is a broken exporter, not work: counted as 0 (and in
    ``jumps``), or one replica's counter would refuse the whole partial at stage 2
    (past ``MAX_COUNT``) or read as the pool's compute.

    It remembers the newest sample of at most ``MAX_TRACKED`` replicas, the least
    recently sampled dropped first: replica ids that churn (pod names, forged
    ids) would otherwise grow it for the worker's lifetime. A replica dropped and
    heard from again starts over, as at its first sample.
    """

    MAX_COUNTER_RATE = 1e8   # per second and GPU, any counter: a thousand times what one GPU prefills, cached prompts included
    MAX_TRACKED = 20_000

    COUNTERS = (("prompt_tokens_total", "prompt_tokens"), ("generation_tokens_total", "generation_tokens"),
                ("preemptions_total", "preemptions"), ("prefix_cache_hits_total", "prefix_hits"),
                ("prefix_cache_queries_total", "prefix_queries"))

    def __init__(self, max_gap_s: float) -> None:
        self.max_gap_ms = max_gap_s * 1000
        self.last: dict[str, ReplicaSample] = {}   # least recently sampled first
        self.restarts = 0
        self.out_of_order = 0
        self.jumps = 0

    def deltas(self, s: ReplicaSample) -> dict[str, float] | None:
        """Counter deltas since this replica's previous sample, or None for its first (or a stale) one."""
        prev = self.last.get(s.replica_id)
        if prev is not None and s.event_time < prev.event_time:
            self.out_of_order += 1
            return None
        if prev is not None:
            del self.last[s.replica_id]   # re-inserted last: the dict's order is the sampling order
        elif len(self.last) >= self.MAX_TRACKED:
            del self.last[next(iter(self.last))]
        self.last[s.replica_id] = s
        if prev is None:
            return None
        out: dict[str, float] = {}
        restarted = False
        gap_ms = s.event_time - prev.event_time
        most = min(float(MAX_COUNT), self.MAX_COUNTER_RATE * max(s.gpu_count, 1) * max(gap_ms, 1000) / 1000)
        for counter, name in self.COUNTERS:
            now, before = getattr(s, counter), getattr(prev, counter)
            if now < before:
                restarted = True
            delta = now if now < before else now - before
            if delta > most:
                self.jumps += 1
                delta = 0.0
            out[name] = delta
        if restarted:
            self.restarts += 1
        out["gpu_seconds"] = min(gap_ms, self.max_gap_ms) / 1000 * s.gpu_count
        return out
