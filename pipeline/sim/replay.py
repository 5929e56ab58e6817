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
from functools import lru_cache
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
    """Rows of ``TIMESTAMP,ContextTokens,GeneratedTokens`` as offsets from the first arrival (parsed once
    per file: every simulated run reads the trace)."""
    return list(_parsed_trace(path or default_trace_path()))


@lru_cache(maxsize=4)
def _parsed_trace(path: Path) -> tuple[TraceRow, ...]:
    rows: list[TraceRow] = []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        first = None
        for rec in reader:
            stamp = rec["TIMESTAMP"]
            when = datetime.strptime(stamp[:26], "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
            first = when if first is None else first
            rows.append(TraceRow(when - first, int(rec["ContextTokens"]), int(rec["GeneratedTokens"])))
    if not rows:
        raise ValueError(f"trace {path} has no rows")
    return tuple(rows)


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


def pick_priority(rng: random.Random) -> str:
    """A priority class drawn from ``PRIORITY_MIX``."""
    x = rng.random()
    for name, share in PRIORITY_MIX:
        if x < share:
            return name
        x -= share
    return PRIORITY_MIX[-1][0]


def generate(trace: list[TraceRow], rate: float, seconds: float, seed: int, start_ms: int,
             fleet: Fleet = Fleet()) -> Iterator[Emitted]:
    """Events in time order for ``seconds`` of traffic at ``rate`` requests/s.

    Streams: every event of a task happens at or after the task's arrival, so
    whatever is scheduled before the current arrival is final and is yielded;
    memory holds only the tasks in flight. Replica samples are derived from
    the request events as they are yielded (in-flight count, token counters).
    """
    if rate <= 0 or seconds <= 0:
        raise ValueError("rate and seconds must be positive")
    rng = random.Random(seed)
    ids = random.Random(seed + 1)
    span = trace[-1].offset_s or 1.0
    scale = (len(trace) / span) / rate
    heap: list[tuple[float, int, Emitted]] = []
    seq = 0
    replicas = {r: pool for pool in fleet.pools for r in fleet.replicas(pool)}
    in_flight = {r: 0 for r in replicas}
    totals = {r: [0, 0, 0, 0] for r in replicas}  # prompt, generation, prefix hits, prefix queries
    next_sample = 0.0

    def new_id() -> str:
        return str(uuid.UUID(int=ids.getrandbits(128), version=4))

    def schedule(at: float, key: str, event: dict) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (at, seq, Emitted(at, "request", key, event)))

    def samples_at(at: float) -> Iterator[Emitted]:
        for replica, pool in replicas.items():
            prompt, generation, hits, queries = totals[replica]
            running = in_flight[replica]
            yield Emitted(at, "replica", replica, {
                "schema_version": 1, "event_id": new_id(), "event_time": start_ms + int(at * 1000),
                "replica_id": replica, "pool": pool, "hardware": fleet.hardware, "gpu_count": fleet.gpu_count,
                "requests_running": min(running, 16), "requests_waiting": max(0, running - 16),
                "kv_cache_usage": round(min(1.0, running / 24), 4), "preemptions_total": 0,
                "prompt_tokens_total": prompt, "generation_tokens_total": generation,
                "prefix_cache_hits_total": hits, "prefix_cache_queries_total": queries, "healthy": True,
                "gpu_util": round(min(1.0, 0.2 + running / 20), 3)})

    def release(until: float) -> Iterator[Emitted]:
        """Yield everything scheduled before ``until``, with replica samples at their ticks."""
        nonlocal next_sample
        while heap and heap[0][0] < until:
            item = heapq.heappop(heap)[2]
            while next_sample <= item.at_s:
                yield from samples_at(next_sample)
                next_sample += fleet.sample_interval_s
            event = item.event
            replica = event.get("replica_id")
            if event["phase"] == "admitted":
                in_flight[replica] += 1
            elif event["phase"] in ("completed", "failed"):
                in_flight[replica] -= 1
                t = totals[replica]
                t[0] += event["input_tokens"]
                t[1] += event["output_tokens"]
                t[2] += event["cached_input_tokens"]
                t[3] += event["input_tokens"]
            yield Emitted(item.at_s, item.kind, item.key, {k: v for k, v in event.items() if v is not None})
        while next_sample < until and next_sample < seconds:
            yield from samples_at(next_sample)
            next_sample += fleet.sample_interval_s

    i, loop, task_no = 0, 0, 0
    while True:
        row = trace[i]
        at = (row.offset_s + loop * span) * scale
        if at >= seconds:
            break
        yield from release(at)
        i += 1
        if i == len(trace):
            i, loop = 0, loop + 1
        task_no += 1
        _schedule_task(fleet, rng, new_id, schedule, start_ms, at, row, f"task-{seed}-{task_no:07d}")
    yield from release(seconds)


def _schedule_task(fleet: Fleet, rng: random.Random, new_id, schedule, start_ms: int, at: float,
                   row: TraceRow, task_id: str) -> None:
    """All events of one task: its steps, each with attempts that may fail and retry."""
    pool = fleet.pools[rng.randrange(len(fleet.pools))]
    priority, tenant = pick_priority(rng), TENANTS[rng.randrange(len(TENANTS))]
    steps = rng.choice((1, 1, 1, 2, 2, 3, 4))
    step_at = at

    def ms(s: float) -> int:
        return start_ms + int(s * 1000)

    for step in range(steps):
        request_id = f"{task_id}-s{step}"
        for attempt in range(1, fleet.max_attempts + 1):
            replica = fleet.replicas(pool)[rng.randrange(fleet.replicas_per_pool)]
            fails = rng.random() < fleet.failure_rate
            final = (step == steps - 1 and not fails) or (fails and attempt == fleet.max_attempts)
            base = {"schema_version": 1, "task_id": task_id, "request_id": request_id, "attempt": attempt,
                    "tenant": tenant, "priority": priority, "pool": pool, "model": f"model-{pool}"}
            queue = rng.expovariate(20.0)
            ttft = queue + row.input_tokens / fleet.prefill_tokens_per_s
            tpot = fleet.decode_s_per_token * rng.uniform(0.8, 1.3)
            out_tokens = 0 if fails else row.output_tokens
            duration = ttft + out_tokens * tpot + (5.0 if fails else 0.0)
            cached = row.input_tokens // 2 if step else 0
            schedule(step_at, task_id, base | {"event_id": new_id(), "event_time": ms(step_at), "phase": "received",
                                               "input_tokens": row.input_tokens})
            schedule(step_at + queue, task_id, base | {"event_id": new_id(), "event_time": ms(step_at + queue),
                                                       "phase": "admitted", "replica_id": replica})
            if not fails:
                schedule(step_at + ttft, task_id, base | {
                    "event_id": new_id(), "event_time": ms(step_at + ttft), "phase": "first_token",
                    "replica_id": replica, "ttft_s": round(ttft, 6)})
            end = step_at + duration
            schedule(end, task_id, base | {
                "event_id": new_id(), "event_time": ms(end), "phase": "failed" if fails else "completed",
                "replica_id": replica, "task_final": final, "input_tokens": row.input_tokens,
                "cached_input_tokens": cached, "output_tokens": out_tokens, "queue_s": round(queue, 6),
                "ttft_s": None if fails else round(ttft, 6), "tpot_s": None if fails else round(tpot, 6),
                "duration_s": round(duration, 6), "error_type": "timeout" if fails else None,
                "slo_ttft_s": fleet.slo_ttft_s, "slo_tpot_s": fleet.slo_tpot_s})
            step_at = end + (rng.uniform(0.2, 1.0) * attempt if fails else rng.uniform(0.5, 3.0))
            if not fails:
                break
