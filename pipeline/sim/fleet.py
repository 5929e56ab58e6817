"""The fleet simulator: a discrete-event model of one model pool under a controller.

Seeded and deterministic. Tasks arrive (``arrivals``), each is one to four
steps (an agent's requests); every step's attempt goes through the
controller's router verdict (admit, reject, defer), then to a replica picked
by load (continuing steps stay on their warm replica); replicas batch
continuously and preempt under KV pressure (``replica``). Clients give up on
a first token that takes longer than their timeout and retry with
exponential backoff and jitter up to ``max_attempts``; a replica can fail
(its work is lost) and come back cold.

The simulator emits the RequestEvents and ReplicaSamples a real router and
GPU agent would — as dicts in the contract's shape — to ``emit``; the
controller sees the fleet only through them (and through its own signals),
exactly like the real pipeline.
"""

from __future__ import annotations

import heapq
import random
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from ..router import ADMIT, Defer, Redirect, Reject, Request, Verdict
from .arrivals import Arrival
from .replay import TENANTS, pick_priority
from .replica import Hardware, Replica, Sequence

STEP_WEIGHTS = (1, 1, 1, 2, 2, 3, 4)   # steps per task, drawn uniformly from this list
MAX_CONTEXT = 16_384


@dataclass(frozen=True)
class ClientPolicy:
    """How clients behave: timeouts, retries, SLOs, think time between steps."""

    ttft_timeout_s: float = 10.0           # interactive clients give up on a first token this late
    deferrable_timeout_s: float = 180.0
    max_attempts: int = 3
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 20.0
    think_time_s: float = 1.0
    # Shed work (a rejection by admission): None — retried like a failure, after the larger of its
    # retry-after and the backoff, within ``max_attempts``; a number — the client honours the
    # retry-after exactly (times 1 ± ``retry_after_jitter``) and retries shed work up to that many
    # times, besides its attempts for failures (what well-behaved SDKs do with a 429)
    shed_retries: int | None = None
    retry_after_jitter: float = 0.0
    # with ``shed_retries`` None: retry shed work on the client's own backoff whatever the retry-after says
    # (many HTTP clients never read it)
    ignore_retry_after: bool = False
    slo_ttft_s: tuple[tuple[str, float], ...] = (("critical", 2.0), ("standard", 2.0), ("sheddable", 2.0),
                                                  ("deferrable", 120.0))

    def slo(self, priority: str) -> float:
        return dict(self.slo_ttft_s)[priority]

    def timeout(self, priority: str) -> float:
        return self.deferrable_timeout_s if priority == "deferrable" else self.ttft_timeout_s


@dataclass(frozen=True)
class FleetEvent:
    """Replicas lost (``count`` of them) at ``at_s``, back cold at ``back_s`` (None: never)."""

    at_s: float
    count: int
    back_s: float | None = None


@dataclass(frozen=True)
class Sibling:
    """A second pool serving the same model, with its own replicas and traffic: where a *move* (redirect)
    sends work, at the cost of a cold prefix cache."""

    pool: str
    replicas: int
    arrivals: Iterable[Arrival] = ()


class Controller(Protocol):
    name: str

    def verdict(self, request: Request, now_s: float) -> Verdict: ...

    def record(self, accepted: bool, now_s: float) -> None: ...

    def observe(self, kind: str, event: dict) -> None: ...

    def tick(self, fleet: "FleetSim", now_s: float) -> None: ...


@dataclass
class Task:
    id: str
    priority: str
    tenant: str
    arrived_s: float
    steps: list[tuple[int, int]]           # (new input tokens, output tokens) per step
    step: int = 0
    attempt: int = 0                       # attempts of the current step
    context: int = 0                       # prompt of the current step
    replica: Replica | None = None         # where the previous step ran (warm prefix cache)
    outcome: str | None = None             # completed | failed | rejected | deferred
    ended_s: float | None = None
    slo_met: bool = True                   # every completed step met its TTFT objective
    waiting_verdict: bool = False          # deferred, waiting to ask again
    last_shed: bool = False                # the previous attempt was rejected by admission
    shed: int = 0                          # attempts of the current step rejected by admission
    pool: str = ""                         # the pool the task was sent to


@dataclass
class Attempt:
    task: Task
    number: int
    request_id: str
    sent_s: float
    replica: Replica
    pool: str = ""                         # where it runs (a redirect moves it to a sibling pool)
    seq: Sequence | None = None
    first_token_s: float | None = None
    scheduled_s: float | None = None       # when the replica first took it into a batch (queue_s)
    done: bool = False


@dataclass
class Stats:
    """What the outcome report is computed from."""

    arrivals: int = 0
    tasks: list[Task] = field(default_factory=list)
    ttfts: list[tuple[str, float]] = field(default_factory=list)        # (priority, ttft) of completed attempts
    useful_tokens: int = 0           # work of attempts that completed
    wasted_tokens: int = 0           # work of attempts that did not, and recompute after preemption
    gpu_seconds: float = 0.0         # alive replicas × gpus × time
    decisions: int = 0
    admitted: int = 0
    published: int = 0               # events handed to ``emit``
    arrival_tokens_per_s: float = 0.0  # tokens/s the replicas processed while tasks arrived (after warm-up)
    timeline: dict[int, dict[str, float]] = field(default_factory=dict)  # per second
    rejected: dict[str, int] = field(default_factory=dict)  # attempts admission rejected (not deferred), per tenant
    cut_off: int = 0                 # tasks still open when the drain ended: the run's end decided their outcome


class FleetSim:
    def __init__(self, pool: str, replicas: int, hardware: Hardware, arrivals: Iterable[Arrival],
                 controller: Controller, client: ClientPolicy = ClientPolicy(), seed: int = 1,
                 start_ms: int = 1_750_000_000_000, duration_s: float = 300.0, drain_s: float = 120.0,
                 fleet_events: tuple[FleetEvent, ...] = (), long_context_from_s: float | None = None,
                 long_context_factor: float = 4.0, sample_interval_s: float = 1.0, tick_s: float = 0.5,
                 emit: Callable[[str, dict], None] | None = None, siblings: tuple[Sibling, ...] = ()) -> None:
        self.pool = pool
        self.model = f"model-{pool}"   # siblings serve the same model
        self.hw = hardware
        self.controller = controller
        self.client = client
        self.rng = random.Random(seed)
        self._ids = random.Random(seed + 1)
        # what each task is (steps, sizes, class, tenant) comes from its own stream, drawn in arrival order:
        # every controller compared under a seed then serves the same tasks, and what differs between two
        # runs is what the controllers did with them (draws from ``rng`` follow the controller's decisions)
        self._shapes = random.Random(seed + 2)
        self.start_ms = start_ms
        self.duration_s = duration_s
        self.end_s = duration_s + drain_s
        self.replicas = [Replica(f"{pool}-r{i:02d}", hardware) for i in range(replicas)]
        self.pool_of = {r.id: pool for r in self.replicas}
        for sibling in siblings:
            extra = [Replica(f"{sibling.pool}-r{i:02d}", hardware) for i in range(sibling.replicas)]
            self.replicas += extra
            self.pool_of.update({r.id: sibling.pool for r in extra})
        self.sample_interval_s = sample_interval_s
        self.tick_s = tick_s
        self.long_context_from_s = long_context_from_s
        self.long_context_factor = long_context_factor
        self.emit_to = emit
        self.now = 0.0
        self.stats = Stats()
        self._open = 0
        self._listening = emit is not None or getattr(controller, "wants_events", False)
        self._heap: list = []
        self._n = 0
        self._epoch = {r.id: 0 for r in self.replicas}
        self._streams = {pool: iter(arrivals), **{sib.pool: iter(sib.arrivals) for sib in siblings}}
        self._task_no = 0
        for stream in list(self._streams):
            self._next_arrival(stream)
        for event in fleet_events:
            self._at(event.at_s, self._lose_replicas, event)
        self._at(0.0, self._sample_tick)
        self._at(tick_s, self._controller_tick)
        self._warm_s = min(10.0, duration_s / 10)
        self._at(self._warm_s, self._token_mark)
        self._at(duration_s, self._token_mark)
        self._tokens_at_warm = 0

    # -- the event loop ------------------------------------------------------------------------------

    def _at(self, t: float, fn: Callable, *args) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, fn, args))

    def run_until(self, t: float) -> bool:
        """Process every event up to ``t``; False once the run is over."""
        while self._heap and self._heap[0][0] <= t:
            at, _, fn, args = heapq.heappop(self._heap)
            if at > self.end_s:
                self._heap.clear()
                break
            self.now = at
            fn(*args)
            if self._finished():
                self._close()
                return False
        self.now = max(self.now, min(t, self.end_s))
        if not self._heap or self.now >= self.end_s:
            self._close()
            return False
        return True

    def run(self) -> Stats:
        self.run_until(float("inf"))
        return self.stats

    def _finished(self) -> bool:
        return self.now >= self.duration_s and not self._streams and self._open == 0

    def _close(self) -> None:
        """Whatever is still open when the run stops: deferred work is deferred, the rest failed."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for task in self.stats.tasks:
            if task.outcome is None:
                self.stats.cut_off += 1
                self._end(task, "deferred" if task.waiting_verdict else "failed")

    def event_time_ms(self, t: float | None = None) -> int:
        return self.start_ms + int(round((self.now if t is None else t) * 1000))

    def _uuid(self) -> str:
        return str(uuid.UUID(int=self._ids.getrandbits(128), version=4))

    # -- arrivals and tasks --------------------------------------------------------------------------

    def _next_arrival(self, stream: str) -> None:
        arrival = next(self._streams[stream], None)
        if arrival is None or arrival.at_s >= self.duration_s:
            del self._streams[stream]
            return
        self._at(arrival.at_s, self._arrive, arrival, stream)

    def _arrive(self, arrival: Arrival, pool: str) -> None:
        self._task_no += 1
        steps = []
        shapes = self._shapes
        n = shapes.choice(STEP_WEIGHTS)
        factor = self.long_context_factor if (self.long_context_from_s is not None
                                              and self.now >= self.long_context_from_s) else 1.0
        first_input = int(arrival.input_tokens * factor)
        steps.append((first_input, arrival.output_tokens))
        for _ in range(n - 1):
            steps.append((shapes.randint(20, 400), max(1, int(arrival.output_tokens * shapes.uniform(0.3, 1.2)))))
        priority, tenant = pick_priority(shapes), TENANTS[shapes.randrange(len(TENANTS))]
        tenant = arrival.tenant or tenant
        task = Task(f"task-{self._task_no:07d}", priority, tenant, self.now, steps,
                    context=min(MAX_CONTEXT, first_input), pool=pool)
        self.stats.tasks.append(task)
        self.stats.arrivals += 1
        self._open += 1
        self._second("arrivals", 1)
        self._start_attempt(task)
        self._next_arrival(pool)

    def _start_attempt(self, task: Task) -> None:
        if task.outcome is not None:
            return
        task.waiting_verdict = False
        retry = task.attempt > 0
        request = Request(task.pool, task.priority, continuing=task.step > 0, retry=retry,
                          slo_ttft_s=self.client.slo(task.priority), after_shed=retry and task.last_shed,
                          tenant=task.tenant, warm=self._has_warm_replica(task))
        verdict = self.controller.verdict(request, self.now)
        self.stats.decisions += 1
        if isinstance(verdict, Reject):
            self.stats.rejected[task.tenant] = self.stats.rejected.get(task.tenant, 0) + 1
        self._second("decisions", 1)
        request_id = f"{task.id}-s{task.step}"
        base = self._base_event(task, request_id, task.attempt + 1, task.pool)
        # routers count the prompt on arrival (the conversation so far, cached or not), as gateways do to route
        self._emit(base | {"phase": "received", "input_tokens": task.context})
        if isinstance(verdict, Defer):
            task.waiting_verdict = True
            self._emit(base | {"phase": "deferred"})
            self._at(self.now + verdict.retry_after_s, self._start_attempt, task)
            return
        task.attempt += 1
        pool = task.pool
        if isinstance(verdict, Redirect) and verdict.pool in self._pools():
            # move: the router sends the attempt to the sibling pool, which serves it with a cold cache
            self._emit(base | {"phase": "redirected"})
            pool = verdict.pool
            base = self._base_event(task, request_id, task.attempt, pool)
            self._emit(base | {"phase": "received", "input_tokens": task.context})
            verdict = ADMIT
        task.last_shed = isinstance(verdict, (Reject, Redirect))
        if task.last_shed:
            task.shed += 1
            retry_after = getattr(verdict, "retry_after_s", 1.0)
            client = self.client
            if client.shed_retries is None:
                final = task.attempt >= client.max_attempts
                backoff = self._backoff(task.attempt)
                delay = backoff if client.ignore_retry_after else max(retry_after, backoff)
            else:
                final = task.shed > client.shed_retries or task.attempt >= 100
                delay = retry_after * (1 + client.retry_after_jitter * self.rng.uniform(-1, 1))
            self._emit(base | self._terminal("rejected", final, task, error="rejected"))
            if final:
                self._end(task, "rejected")
            else:
                self._at(self.now + delay, self._start_attempt, task)
            return
        replica = self._choose_replica(task, pool)
        if replica is None:
            final = self._failures_spent(task)
            self._emit(base | self._terminal("failed", final, task, error="no_replica"))
            self._after_failure(task, final)
            return
        self.stats.admitted += 1
        self._second("admitted", 1)
        cached = min(task.context, self._warm(task, replica))
        attempt = Attempt(task, task.attempt, request_id, self.now, replica, pool)
        attempt.seq = Sequence(attempt, task.context, cached, task.steps[task.step][1],
                               rank=0 if task.priority == "critical" else 1)
        self._emit(base | {"phase": "admitted", "replica_id": replica.id})
        replica.enqueue(attempt.seq)
        self.controller.record(True, self.now)
        self._kick(replica)
        self._at(self.now + self.client.timeout(task.priority), self._timeout, attempt)

    def _failures_spent(self, task: Task) -> bool:
        """The client gives up after ``max_attempts`` tries that were not shed (or all tries, when shed
        work counts as a failure), and never past the contract's 100 attempts."""
        tries = task.attempt if self.client.shed_retries is None else task.attempt - task.shed
        return tries >= self.client.max_attempts or task.attempt >= 100

    def _has_warm_replica(self, task: Task) -> bool:
        """What a router with session affinity knows: this later step goes back to the replica that ran the
        previous one, which is alive and holds its context."""
        r = task.replica
        return task.step > 0 and r is not None and r.alive and self.pool_of[r.id] == task.pool

    def _warm(self, task: Task, replica: Replica) -> int:
        """Prefix-cache hit: the previous step's context, if it ran on this replica."""
        if task.step == 0 or task.replica is not replica:
            return 0
        new_input = task.steps[task.step][0]
        return max(0, task.context - new_input)

    def _pools(self) -> set[str]:
        return set(self.pool_of.values())

    def _choose_replica(self, task: Task, pool: str) -> Replica | None:
        alive = [r for r in self.replicas if r.alive and self.pool_of[r.id] == pool]
        if not alive:
            return None
        if task.replica is not None and task.replica.alive and task.step > 0 and self.pool_of[task.replica.id] == pool:
            return task.replica
        return min(alive, key=lambda r: (r.load(), r.id))

    def _backoff(self, attempt: int) -> float:
        base = min(self.client.backoff_cap_s, self.client.backoff_base_s * 2 ** (attempt - 1))
        return base * self.rng.uniform(0.5, 1.5)

    def _after_failure(self, task: Task, final: bool) -> None:
        if final:
            self._end(task, "failed")
        else:
            self._at(self.now + self._backoff(task.attempt), self._start_attempt, task)

    def _end(self, task: Task, outcome: str) -> None:
        self._open -= 1
        task.outcome = outcome
        task.ended_s = self.now
        if outcome == "completed" and task.slo_met:
            self._second("slo_successes", 1)

    # -- attempts on replicas ------------------------------------------------------------------------

    def _kick(self, replica: Replica) -> None:
        if replica.alive and not replica.busy and replica.has_work():
            duration = replica.start_step()
            for seq in replica.planned():
                if seq.owner.scheduled_s is None:
                    seq.owner.scheduled_s = self.now
            self._at(self.now + duration, self._step_done, replica, self._epoch[replica.id])

    def _step_done(self, replica: Replica, epoch: int) -> None:
        if epoch != self._epoch[replica.id] or not replica.alive:
            return
        result = replica.finish_step()
        for seq in result.first_tokens:
            attempt: Attempt = seq.owner
            attempt.first_token_s = self.now
            ttft = round(self.now - attempt.sent_s, 6)
            self._emit(self._base_event(attempt.task, attempt.request_id, attempt.number, attempt.pool)
                       | {"phase": "first_token", "replica_id": replica.id, "ttft_s": ttft})
        for seq in result.finished:
            self._complete(seq.owner)
        for seq in result.failed:
            attempt = seq.owner
            self._fail_attempt(attempt, "context_length_exceeded", final=True)
        self._kick(replica)

    def _work(self, attempt: Attempt) -> int:
        """Tokens the replica processed for an attempt: its prefill (if it got that far), output, recompute."""
        seq = attempt.seq
        prompt_work = max(0, seq.prompt_tokens - seq.cached_tokens) if seq.first_token else 0
        return prompt_work + seq.generated + seq.recomputed_tokens

    def _complete(self, attempt: Attempt) -> None:
        if attempt.done:
            return
        attempt.done = True
        task, seq = attempt.task, attempt.seq
        ttft = attempt.first_token_s - attempt.sent_s
        duration = self.now - attempt.sent_s
        tpot = (self.now - attempt.first_token_s) / max(1, seq.output_tokens - 1)
        slo = self.client.slo(task.priority)
        task.slo_met = task.slo_met and ttft <= slo
        self.stats.ttfts.append((task.priority, ttft))
        self.stats.useful_tokens += max(0, seq.prompt_tokens - seq.cached_tokens) + seq.output_tokens
        self.stats.wasted_tokens += seq.recomputed_tokens
        last_step = task.step == len(task.steps) - 1
        self._emit(self._base_event(task, attempt.request_id, attempt.number, attempt.pool) | self._terminal(
            "completed", last_step, task, replica=attempt.replica.id, input_tokens=seq.prompt_tokens,
            cached=seq.cached_tokens, output=seq.output_tokens, ttft=ttft, tpot=tpot, duration=duration,
            queue=self._queued(attempt)))
        task.replica = attempt.replica
        if last_step:
            self._end(task, "completed")
            return
        task.step += 1
        task.attempt = 0
        task.shed = 0
        new_input, _ = task.steps[task.step]
        task.context = min(MAX_CONTEXT, task.context + seq.output_tokens + new_input)
        self._at(self.now + self.client.think_time_s * self.rng.uniform(0.5, 1.5), self._start_attempt, task)

    def _timeout(self, attempt: Attempt) -> None:
        if attempt.done or attempt.first_token_s is not None:
            return
        attempt.replica.abort(attempt.seq)
        self._fail_attempt(attempt, "timeout", final=self._failures_spent(attempt.task), phase="cancelled")

    def _fail_attempt(self, attempt: Attempt, error: str, final: bool, phase: str = "failed") -> None:
        if attempt.done:
            return
        attempt.done = True
        task, seq = attempt.task, attempt.seq
        self.stats.wasted_tokens += self._work(attempt)
        self._emit(self._base_event(task, attempt.request_id, attempt.number, attempt.pool) | self._terminal(
            phase, final, task, error=error, replica=attempt.replica.id, input_tokens=seq.prompt_tokens,
            cached=seq.cached_tokens, output=seq.generated, duration=self.now - attempt.sent_s,
            queue=self._queued(attempt)))
        self._after_failure(task, final)

    def _queued(self, attempt: Attempt) -> float:
        """Time in the replica's queue before its first batch (the whole attempt if it never got one),
        as engines report it (vLLM's request queue time)."""
        return (attempt.scheduled_s if attempt.scheduled_s is not None else self.now) - attempt.sent_s

    # -- fleet events --------------------------------------------------------------------------------

    def _lose_replicas(self, event: FleetEvent) -> None:
        alive = [r for r in self.replicas if r.alive and self.pool_of[r.id] == self.pool]
        for replica in alive[-event.count:] if event.count else []:
            self._epoch[replica.id] += 1
            for seq in replica.fail_all():
                attempt = seq.owner
                self._fail_attempt(attempt, "replica_failure", final=self._failures_spent(attempt.task))
            if event.back_s is not None:
                self._at(event.back_s, self._recover, replica)

    def _recover(self, replica: Replica) -> None:
        fresh = Replica(replica.id, self.hw)
        self.replicas[self.replicas.index(replica)] = fresh
        self._epoch[fresh.id] += 1

    # -- ticks ---------------------------------------------------------------------------------------

    def _sample_tick(self) -> None:
        alive = [r for r in self.replicas if r.alive]
        if self.now < self.duration_s:  # the bill of the scenario's window (the drain is bookkeeping)
            self.stats.gpu_seconds += len(alive) * self.hw.gpu_count * self.sample_interval_s
        if alive:
            self._second("kv_usage", sum(r.kv_usage() for r in alive) / len(alive))
            self._second("replicas", len(alive))
        for r in alive if self._listening else ():
            self._emit({"schema_version": 1, "event_id": self._uuid(), "event_time": self.event_time_ms(),
                        "replica_id": r.id, "pool": self.pool_of[r.id], "hardware": self.hw.name,
                        "gpu_count": self.hw.gpu_count, "requests_running": len(r.running),
                        "requests_waiting": r.waiting_count, "kv_cache_usage": round(r.kv_usage(), 4),
                        "preemptions_total": r.preemptions_total, "prompt_tokens_total": r.prompt_tokens_total,
                        "generation_tokens_total": r.generation_tokens_total,
                        "prefix_cache_hits_total": r.prefix_hits_total,
                        "prefix_cache_queries_total": r.prefix_queries_total, "healthy": True}, kind="replica")
        if self.now + self.sample_interval_s <= self.end_s:
            self._at(self.now + self.sample_interval_s, self._sample_tick)

    def _tokens(self) -> int:
        return sum(r.prompt_tokens_total + r.generation_tokens_total for r in self.replicas)

    def _token_mark(self) -> None:
        """Tokens processed over the arrival window, warm-up left out: a pool's peak rate, measured where
        it is loaded (the drain after the last arrival would average it down)."""
        if self.now < self.duration_s:
            self._tokens_at_warm = self._tokens()
        else:
            self.stats.arrival_tokens_per_s = (self._tokens() - self._tokens_at_warm) / (self.duration_s - self._warm_s)

    def _controller_tick(self) -> None:
        self.controller.tick(self, self.now)
        if self.now + self.tick_s <= self.end_s:
            self._at(self.now + self.tick_s, self._controller_tick)

    # -- events and per-second figures ---------------------------------------------------------------

    def _second(self, key: str, value: float) -> None:
        row = self.stats.timeline.setdefault(int(self.now), {})
        row[key] = row.get(key, 0.0) + value if key not in ("kv_usage", "replicas") else value

    def _base_event(self, task: Task, request_id: str, attempt: int, pool: str) -> dict:
        return {"schema_version": 1, "event_id": "", "event_time": 0, "task_id": task.id,
                "request_id": request_id, "attempt": attempt, "tenant": task.tenant, "priority": task.priority,
                "pool": pool, "model": self.model}

    def _terminal(self, phase: str, final: bool, task: Task, error: str | None = None, replica: str | None = None,
                  input_tokens: int = 0, cached: int = 0, output: int = 0, ttft: float | None = None,
                  tpot: float | None = None, duration: float = 0.0, queue: float | None = None) -> dict:
        event = {"phase": phase, "task_final": final, "input_tokens": input_tokens, "cached_input_tokens": cached,
                 "output_tokens": output, "duration_s": round(duration, 6),
                 "slo_ttft_s": self.client.slo(task.priority),
                 "slo_tpot_s": 0.2}
        if replica is not None:
            event["replica_id"] = replica
        if error is not None:
            event["error_type"] = error
        if ttft is not None:
            event["ttft_s"] = round(ttft, 6)
            event["tpot_s"] = round(tpot, 6)
        if queue is not None:
            event["queue_s"] = round(max(0.0, queue), 6)
        return event

    def _emit(self, event: dict, kind: str = "request") -> None:
        if not self._listening:
            return
        if kind == "request":
            event["event_id"] = self._uuid()
            event["event_time"] = self.event_time_ms()
        self.controller.observe(kind, event)
        if self.emit_to is not None:
            self.stats.published += 1
            self.emit_to(kind, event)
