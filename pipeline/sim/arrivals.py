"""Arrival times and token sizes for the simulator, at a rate that can change over time.

Two sources, both seeded:

- **trace**: the Azure trace's own arrival pattern, time-scaled to the target
  rate, with its prompt and output sizes in order (looped when it runs out);
- **gamma**: a renewal process with gamma-distributed gaps, vLLM's
  ``burstiness`` convention (shape = burstiness, mean gap = 1 / rate; 1 is
  Poisson, below 1 is burstier), sizes drawn from the trace.

Both are generated at unit rate and warped through the cumulative intensity
of a piecewise-constant rate, so a spike keeps the source's burst structure.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator, Sequence

from .replay import TraceRow


@dataclass(frozen=True)
class RateSchedule:
    """Requests/s from each start time on: ``((0, 20), (60, 40), (180, 20))``."""

    segments: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.segments or self.segments[0][0] != 0 or any(r < 0 for _, r in self.segments):
            raise ValueError("rate schedule starts at 0 with non-negative rates")

    def invert(self, mass: float) -> float:
        """The time at which the expected number of arrivals reaches ``mass`` (inf if never)."""
        done = 0.0
        for i, (start, rate) in enumerate(self.segments):
            end = self.segments[i + 1][0] if i + 1 < len(self.segments) else float("inf")
            span_mass = rate * (end - start)
            if done + span_mass >= mass and rate > 0:
                return start + (mass - done) / rate
            done += span_mass
        return float("inf")


@dataclass(frozen=True)
class Arrival:
    at_s: float
    input_tokens: int
    output_tokens: int
    tenant: str | None = None   # whose task it is (None: drawn at random by the fleet)


def rotated(trace: Sequence[TraceRow], start: int) -> list[TraceRow]:
    """The trace from row ``start`` on, then its beginning: the same arrival pattern, another stretch of it
    first (streams of several tenants from one trace, whose bursts do not line up)."""
    start %= len(trace)
    span, base = trace[-1].offset_s, trace[start].offset_s
    return ([row._replace(offset_s=row.offset_s - base) for row in trace[start:]]
            + [row._replace(offset_s=row.offset_s + span - base) for row in trace[:start]])


def trace_arrivals(trace: Sequence[TraceRow], schedule: RateSchedule, duration_s: float) -> Iterator[Arrival]:
    span = trace[-1].offset_s or 1.0
    per_unit = len(trace) / span   # trace arrivals per trace second
    loop = 0
    while True:
        for row in trace:
            at = schedule.invert((row.offset_s + loop * span) * per_unit)
            if at >= duration_s:
                return
            yield Arrival(at, row.input_tokens, max(1, row.output_tokens))
        loop += 1


def gamma_arrivals(trace: Sequence[TraceRow], schedule: RateSchedule, duration_s: float, burstiness: float,
                   seed: int) -> Iterator[Arrival]:
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    rng = random.Random(seed)
    mass = 0.0
    while True:
        mass += rng.gammavariate(burstiness, 1.0 / burstiness)
        at = schedule.invert(mass)
        if at >= duration_s:
            return
        row = trace[rng.randrange(len(trace))]
        yield Arrival(at, row.input_tokens, max(1, row.output_tokens))
