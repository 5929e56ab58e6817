"""Turn the Azure LLM trace into the event streams routers and GPU agents would publish.

Pure and seeded: the same arguments give the same events. Arrivals come from
the trace, time-scaled to a target request rate; each arrival becomes one
request of a task (tasks have one to four steps), attempts fail and retry,
tenants and priorities are mixed, and every replica of the configured fleet
publishes a sample each ``sample_interval_s`` with its cumulative counters.
The latency model here is deliberately simple (a fixed-speed fleet); the
fleet simulator (``pipeline.sim``) is where load changes latency.
"""

from __future__ import annotations

import csv
import heapq
import random
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Iterator, NamedTuple

PRIORITY_MIX = (("critical", 0.10), ("standard", 0.50), ("sheddable", 0.25), ("deferrable", 0.15))
TENANTS = ("acme", "globex", "initech", "umbrella", "hooli")
DEFAULT_TRACE = "azure_llm_2023_conv.csv"


class TraceRow(NamedTuple):
    offset_s: float
    input_tokens: int
    output_tokens: int


def default_trace_path() -> Path:
    return Path(str(resources.files("pipeline.sim") / "traces" / DEFAULT_TRACE))


def load_trace(path: Path | None = None) -> list[TraceRow]:
    """Rows of ``TIMESTAMP,ContextTokens,GeneratedTokens`` as offsets from the first arrival."""
    rows: list[TraceRow] = []
    with open(path or default_trace_path(), newline="") as fh:
        reader = csv.DictReader(fh)
        first = None
        for rec in reader:
            stamp = rec["TIMESTAMP"]
            when = datetime.strptime(stamp[:26], "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
            first = when if first is None else first
            rows.append(TraceRow(when - first, int(rec["ContextTokens"]), int(rec["GeneratedTokens"])))
    if not rows:
        raise ValueError(f"trace {path} has no rows")
    return rows


@dataclass(frozen=True)
class Fleet:
    pools: tuple[str, ...] = ("llama-70b-a", "llama-8b-a")
    replicas_per_pool: int = 4
    hardware: str = "H100-80GB"
    gpu_count: int = 4
    prefill_tokens_per_s: float = 20000.0
    decode_s_per_token: float = 0.03
    failure_rate: float = 0.03
    max_attempts: int = 3
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.1
    sample_interval_s: float = 1.0

    def replicas(self, pool: str) -> list[str]:
        return [f"{pool}-r{i:02d}" for i in range(self.replicas_per_pool)]


class Emitted(NamedTuple):
    at_s: float
    kind: str  # "request" or "replica"
    key: str
    event: dict


def _pick_priority(rng: random.Random) -> str:
    x = rng.random()
    for name, share in PRIORITY_MIX:
        if x < share:
            return name
        x -= share
    return PRIORITY_MIX[-1][0]


def generate(trace: list[TraceRow], rate: float, seconds: float, seed: int, start_ms: int,
             fleet: Fleet = Fleet()) -> Iterator[Emitted]:
    """Events in time order for ``seconds`` of traffic at ``rate`` requests/s."""
    if rate <= 0 or seconds <= 0:
        raise ValueError("rate and seconds must be positive")
    rng = random.Random(seed)
    ids = random.Random(seed + 1)
    span = trace[-1].offset_s or 1.0
    scale = (len(trace) / span) / rate
    out: list[tuple[float, int, Emitted]] = []
    seq = 0

    def emit(at: float, kind: str, key: str, event: dict) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(out, (at, seq, Emitted(at, kind, key, event)))

    def new_id() -> str:
        return str(uuid.UUID(int=ids.getrandbits(128), version=4))

    counters = {r: [0.0, 0.0, 0.0, 0.0, 0.0] for p in fleet.pools for r in fleet.replicas(p)}
    busy_until: dict[str, list[float]] = {r: [] for r in counters}
    i, loop, task_no = 0, 0, 0
    while True:
        row = trace[i]
        at = (row.offset_s + loop * span) * scale
        if at >= seconds:
            break
        i += 1
        if i == len(trace):
            i, loop = 0, loop + 1
        task_no += 1
        task_id = f"task-{seed}-{task_no:07d}"
        pool = fleet.pools[rng.randrange(len(fleet.pools))]
        priority, tenant = _pick_priority(rng), TENANTS[rng.randrange(len(TENANTS))]
        steps = rng.choice((1, 1, 1, 2, 2, 3, 4))
        step_at = at
        for step in range(steps):
            request_id = f"{task_id}-s{step}"
            for attempt in range(1, fleet.max_attempts + 1):
                replica = fleet.replicas(pool)[rng.randrange(fleet.replicas_per_pool)]
                fails = rng.random() < fleet.failure_rate
                last_step = step == steps - 1
                final = (last_step and not fails) or (fails and attempt == fleet.max_attempts)
                base = {"schema_version": 1, "task_id": task_id, "request_id": request_id, "attempt": attempt,
                        "tenant": tenant, "priority": priority, "pool": pool, "model": f"model-{pool}"}
                queue = rng.expovariate(20.0)
                ttft = queue + row.input_tokens / fleet.prefill_tokens_per_s
                tpot = fleet.decode_s_per_token * rng.uniform(0.8, 1.3)
                out_tokens = 0 if fails else row.output_tokens
                duration = ttft + out_tokens * tpot + (5.0 if fails else 0.0)
                ms = lambda s: start_ms + int(s * 1000)  # noqa: E731
                emit(step_at, "request", task_id, base | {"event_id": new_id(), "event_time": ms(step_at),
                                                          "phase": "received"})
                emit(step_at + queue, "request", task_id, base | {"event_id": new_id(),
                     "event_time": ms(step_at + queue), "phase": "admitted", "replica_id": replica})
                if not fails:
                    emit(step_at + ttft, "request", task_id, base | {"event_id": new_id(),
                         "event_time": ms(step_at + ttft), "phase": "first_token", "replica_id": replica,
                         "ttft_s": round(ttft, 6)})
                end = step_at + duration
                emit(end, "request", task_id, base | {
                    "event_id": new_id(), "event_time": ms(end), "phase": "failed" if fails else "completed",
                    "replica_id": replica, "task_final": final, "input_tokens": row.input_tokens,
                    "cached_input_tokens": row.input_tokens // 2 if step else 0, "output_tokens": out_tokens,
                    "queue_s": round(queue, 6), "ttft_s": None if fails else round(ttft, 6),
                    "tpot_s": None if fails else round(tpot, 6), "duration_s": round(duration, 6),
                    "error_type": "timeout" if fails else None, "slo_ttft_s": fleet.slo_ttft_s,
                    "slo_tpot_s": fleet.slo_tpot_s})
                c = counters[replica]
                c[1] += row.input_tokens
                c[2] += out_tokens
                c[3] += row.input_tokens // 2 if step else 0
                c[4] += row.input_tokens
                busy_until[replica].append(end)
                step_at = end + (rng.uniform(0.2, 1.0) * attempt if fails else rng.uniform(0.5, 3.0))
                if not fails:
                    break
    replica_events = _replica_samples(fleet, counters, busy_until, seconds, start_ms, rng, new_id)
    for e in replica_events:
        emit(*e)
    while out:
        item = heapq.heappop(out)[2]
        if item.at_s < seconds:
            yield Emitted(item.at_s, item.kind, item.key, {k: v for k, v in item.event.items() if v is not None})


def _replica_samples(fleet: Fleet, counters: dict, busy_until: dict, seconds: float, start_ms: int,
                     rng: random.Random, new_id) -> list[tuple]:
    """Samples with counters growing linearly to their totals: enough realism for ingest and replay."""
    events = []
    ticks = int(seconds / fleet.sample_interval_s)
    for pool in fleet.pools:
        for replica in fleet.replicas(pool):
            totals = counters[replica]
            ends = sorted(busy_until[replica])
            for t in range(ticks + 1):
                at = t * fleet.sample_interval_s
                share = at / seconds
                running = sum(1 for e in ends if at <= e <= at + 5.0)
                events.append((at, "replica", replica, {
                    "schema_version": 1, "event_id": new_id(), "event_time": start_ms + int(at * 1000),
                    "replica_id": replica, "pool": pool, "hardware": fleet.hardware, "gpu_count": fleet.gpu_count,
                    "requests_running": running, "requests_waiting": max(0, running - 16),
                    "kv_cache_usage": round(min(1.0, running / 24), 4), "preemptions_total": 0,
                    "prompt_tokens_total": round(totals[1] * share), "generation_tokens_total": round(totals[2] * share),
                    "prefix_cache_hits_total": round(totals[3] * share),
                    "prefix_cache_queries_total": round(totals[4] * share), "healthy": True,
                    "gpu_util": round(min(1.0, 0.2 + running / 20), 3)}))
    return events
