"""One serving replica, vLLM-style: continuous batching over a KV cache of fixed size.

Pure and clock-free: ``start_step(now)`` plans an engine step and returns
when it ends; ``finish_step()`` applies it. Each step prefills the sequences
admitted into it and decodes one token for every running sequence, taking
``decode_base_s + decode_per_seq_s × batch + uncached prompt tokens ÷
prefill_tokens_per_s``. A sequence is admitted from the FCFS queue only if
its whole context fits the free KV cache; when decoding would overflow the
cache the most recently admitted sequences are **preempted**: their KV is
freed and they go back to the head of the queue, to be prefilled again —
prompt *and* the tokens generated so far (recompute, vLLM's default). That
recompute is the cascade's first turn: under KV pressure the replica spends
more of its time redoing work.

Token bookkeeping is O(1) per step: a running sequence's generated count is
``self.steps − seq.base``, so the KV in use is kept as sums, and completions
come off a heap keyed by the step they finish on.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Hardware:
    """A replica's performance envelope (one model on ``gpu_count`` GPUs)."""

    name: str = "L40S-48GB"
    gpu_count: int = 1
    prefill_tokens_per_s: float = 20000.0
    decode_base_s: float = 0.015
    decode_per_seq_s: float = 0.00035
    kv_capacity_tokens: int = 150_000
    max_batch: int = 128
    kv_watermark: float = 0.01   # admission keeps this share of the cache free (vLLM's watermark)
    # vLLM's --scheduling-policy priority: urgent sequences (rank 0, critical work) are taken from the
    # queue before the rest; default FCFS, as engines run out of the box
    priority_scheduling: bool = False
    # vLLM's max_num_batched_tokens with chunked prefill (on by default in vLLM V1): a step processes at most
    # this many tokens, decodes first, and a long prompt is prefilled over several steps; 0: no budget, every
    # prompt admitted into a step is prefilled in that step whatever its length
    max_batched_tokens: int = 0


@dataclass
class Sequence:
    """One attempt being served. ``owner`` is opaque to the replica (the simulator's attempt)."""

    owner: object
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    generated: int = 0        # tokens generated before the current admission (kept across preemption)
    base: int = 0             # replica step counter at admission, minus ``generated``
    first_token: bool = False
    preempted: int = 0
    recomputed_tokens: int = 0
    active: bool = True       # False once finished or aborted: lazy removal from heap and queue
    running: bool = False
    planned: bool = False     # admitted into the step in progress
    rank: int = 1             # 0: urgent (critical work), served first under priority scheduling
    prefill_left: int = 0     # prompt tokens still to prefill (chunked prefill)
    chunk: int = 0            # of which the step in progress prefills
    reserved: int = 0         # KV tokens held while its prefill is under way (chunked prefill)

    def context(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass
class StepResult:
    first_tokens: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)


class Replica:
    def __init__(self, replica_id: str, hardware: Hardware) -> None:
        self.id = replica_id
        self.hw = hardware
        self.alive = True
        self.waiting: deque[Sequence] = deque()
        self.urgent: deque[Sequence] = deque()   # rank-0 sequences, under priority scheduling
        self.waiting_count = 0
        self.running: dict[int, Sequence] = {}   # insertion order = admission order
        self.steps = 0
        self._prompt_sum = 0   # Σ context at admission over running sequences
        self._base_sum = 0     # Σ base over running sequences
        self._finish: list[tuple[int, int, Sequence]] = []
        self._admissions = 0
        self._planned: list[Sequence] = []
        self._taken: list[Sequence] = []        # taken in from the queue by the step in progress
        self.prefilling: list[Sequence] = []    # admitted, prefill under way over several steps (chunked)
        self._reserved = 0                      # KV tokens they hold
        self._too_long: list[Sequence] = []
        self.busy = False
        # cumulative counters, as an engine's /metrics would show them
        self.preemptions_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefix_hits_total = 0
        self.prefix_queries_total = 0

    # -- observation ---------------------------------------------------------------------------------

    def kv_used(self) -> int:
        return self._prompt_sum + len(self.running) * self.steps - self._base_sum + self._reserved

    def kv_usage(self) -> float:
        return min(1.0, self.kv_used() / self.hw.kv_capacity_tokens)

    def load(self) -> float:
        """What a load-aware router minimises: queue first, then KV in use."""
        return self.waiting_count + len(self.running) / self.hw.max_batch + self.kv_usage()

    # -- requests ------------------------------------------------------------------------------------

    def _queue_of(self, seq: Sequence) -> deque:
        return self.urgent if self.hw.priority_scheduling and seq.rank == 0 else self.waiting

    def enqueue(self, seq: Sequence) -> None:
        self._queue_of(seq).append(seq)
        self.waiting_count += 1

    def abort(self, seq: Sequence) -> None:
        """The client gave up: free what the sequence holds (lazy removal from queue or heap)."""
        if not seq.active:
            return
        seq.active = False
        if seq.running:
            self._release(seq)
        elif seq.reserved:
            self._unreserve(seq)
        elif not seq.planned:
            self.waiting_count -= 1

    def fail_all(self) -> list[Sequence]:
        """The replica died: every sequence it holds is lost."""
        for seq in self.running.values():
            seq.generated = self.steps - seq.base
        lost = [s for s in self.running.values()] + [s for s in (*self.urgent, *self.waiting) if s.active]
        lost += [s for s in self._planned if s.active] + [s for s in self.prefilling if s.active and not s.planned]
        for seq in lost:
            seq.active = False
            seq.running = False
            seq.planned = False
        self.running.clear()
        self.waiting.clear()
        self.urgent.clear()
        self.waiting_count = 0
        self._finish.clear()
        self._planned = []
        self._taken = []
        self.prefilling = []
        self._reserved = 0
        self._too_long = []
        self._prompt_sum = self._base_sum = 0
        self.alive = False
        self.busy = False
        return lost

    def _unreserve(self, seq: Sequence) -> None:
        self._reserved -= seq.reserved
        seq.reserved = 0
        if seq in self.prefilling:
            self.prefilling.remove(seq)

    def _release(self, seq: Sequence) -> None:
        seq.running = False
        del self.running[id(seq)]
        self._prompt_sum -= seq.prompt_tokens
        self._base_sum -= seq.base

    # -- engine steps --------------------------------------------------------------------------------

    def planned(self) -> list[Sequence]:
        """The sequences the step in progress takes in from the queue."""
        return self._taken

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.prefilling) or self.waiting_count > 0

    def start_step(self) -> float:
        """Admit what fits, and return the step's duration.

        With ``max_batched_tokens`` the step's tokens are budgeted: one per running sequence first, then the
        prefills under way, then new sequences from the queue, the last one taken in possibly only in part.
        """
        cap = self.hw.kv_capacity_tokens
        free = cap * (1 - self.hw.kv_watermark) - self.kv_used() - len(self.running)
        chunked = self.hw.max_batched_tokens > 0
        budget = self.hw.max_batched_tokens - len(self.running) if chunked else float("inf")
        prefill = 0
        planned: list[Sequence] = []
        for seq in self.prefilling:
            if prefill >= budget:
                break
            seq.chunk = int(min(seq.prefill_left, budget - prefill))
            prefill += seq.chunk
            if seq.chunk == seq.prefill_left:
                seq.planned = True
                planned.append(seq)
        taken: list[Sequence] = []
        while ((self.urgent or self.waiting) and prefill < budget
               and len(self.running) + len(self.prefilling) + len(taken) < self.hw.max_batch):
            queue = self.urgent if self.urgent else self.waiting
            head = queue[0]
            if not head.active:
                queue.popleft()
                continue
            need = head.context() + 1
            if need > free:
                if need > cap * (1 - self.hw.kv_watermark):
                    head.active = False
                    queue.popleft()
                    self.waiting_count -= 1
                    self._too_long.append(head)
                    continue
                break
            queue.popleft()
            self.waiting_count -= 1
            free -= need
            if head.preempted:
                head.recomputed_tokens += head.context()
                work = head.context()
            else:
                work = max(0, head.prompt_tokens - head.cached_tokens)
                self.prefix_queries_total += head.prompt_tokens
                self.prefix_hits_total += head.cached_tokens
            taken.append(head)
            head.prefill_left, head.chunk = work, int(min(work, budget - prefill))
            prefill += head.chunk
            if head.chunk == work:
                head.planned = True
                planned.append(head)
            else:   # the rest of its prompt in the next steps; its KV is held meanwhile
                head.reserved = need
                self._reserved += need
                self.prefilling.append(head)
        self._planned = planned
        self._taken = taken
        self.prompt_tokens_total += prefill
        batch = len(self.running) + len(planned)
        duration = self.hw.decode_base_s + self.hw.decode_per_seq_s * batch + prefill / self.hw.prefill_tokens_per_s
        self.busy = True
        return duration

    def finish_step(self) -> StepResult:
        """Admitted sequences join the batch; every running one gets a token; overflow is preempted."""
        out = StepResult(failed=self._too_long)
        self._too_long = []
        for seq in self.prefilling:
            seq.prefill_left -= seq.chunk
            seq.chunk = 0
        for seq in self._planned:
            seq.planned = False
            if seq.reserved:
                self._unreserve(seq)
            if not seq.active:
                continue  # aborted while its step ran
            seq.running = True
            seq.base = self.steps - seq.generated
            self.running[id(seq)] = seq
            self._prompt_sum += seq.prompt_tokens
            self._base_sum += seq.base
            self._admissions += 1  # ties break by admission order, never by memory address
            heapq.heappush(self._finish, (seq.base + seq.output_tokens, self._admissions, seq))
        self._planned = []
        self._taken = []
        self.steps += 1
        self.generation_tokens_total += len(self.running)
        for seq in self.running.values():
            if not seq.first_token:
                seq.first_token = True
                out.first_tokens.append(seq)
        while self._finish and self._finish[0][0] <= self.steps:
            _, _, seq = heapq.heappop(self._finish)
            if seq.running and seq.base + seq.output_tokens <= self.steps:
                seq.generated = seq.output_tokens
                seq.active = False
                self._release(seq)
                out.finished.append(seq)
        while self.kv_used() > self.hw.kv_capacity_tokens and self.running:
            victim = next(reversed(self.running.values()))
            victim.generated = self.steps - victim.base
            self._release(victim)
            victim.preempted += 1
            self.preemptions_total += 1
            self._queue_of(victim).appendleft(victim)
            self.waiting_count += 1
            out.preempted.append(victim)
        self.busy = False
        return out
