"""A mergeable quantile sketch with bounded relative error (DDSketch-style log buckets).

A positive value x falls in bucket ``ceil(log_gamma(x))`` with
``gamma = (1 + alpha) / (1 - alpha)``; the bucket's representative value is
within ``alpha`` (relative) of every value in it, so any quantile read from
the sketch is within ``alpha`` of the true sample quantile. Two sketches merge
by adding bucket counts, which is what lets stage 1 fold per partition and
stage 2 combine partitions. Memory is bounded by the value range, not by the
number of values (1 ms to 1 h at 1% is about 750 buckets).
"""

from __future__ import annotations

import math
from typing import Iterable

from .checks import MAX_SKETCH_INDEX, amount, count, mapping

DEFAULT_ALPHA = 0.01
MIN_VALUE = 1e-6  # values at or below this count as zero (latencies are never that small)


class QuantileSketch:
    __slots__ = ("alpha", "gamma", "_log_gamma", "buckets", "zeros", "count", "total")

    def __init__(self, alpha: float = DEFAULT_ALPHA) -> None:
        if not 0 < alpha < 1:
            raise ValueError("alpha must be in (0, 1)")
        self.alpha = alpha
        self.gamma = (1 + alpha) / (1 - alpha)
        self._log_gamma = math.log(self.gamma)
        self.buckets: dict[int, int] = {}
        self.zeros = 0
        self.count = 0
        self.total = 0.0

    def add(self, value: float, count: int = 1) -> None:
        if value < 0 or value != value:
            raise ValueError(f"sketch values must be non-negative numbers, got {value!r}")
        self.count += count
        self.total += value * count
        if value <= MIN_VALUE:
            self.zeros += count
            return
        index = math.ceil(math.log(value) / self._log_gamma)
        self.buckets[index] = self.buckets.get(index, 0) + count

    def extend(self, values: Iterable[float]) -> None:
        for value in values:
            self.add(value)

    def merge(self, other: "QuantileSketch") -> None:
        if other.alpha != self.alpha:
            raise ValueError("cannot merge sketches with different alpha")
        for index, n in other.buckets.items():
            self.buckets[index] = self.buckets.get(index, 0) + n
        self.zeros += other.zeros
        self.count += other.count
        self.total += other.total

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 ≤ q ≤ 1) by lower rank, or None for an empty sketch."""
        if not 0 <= q <= 1:
            raise ValueError("q must be in [0, 1]")
        if self.count == 0:
            return None
        rank = q * (self.count - 1)
        seen = self.zeros
        if rank < seen:
            return 0.0
        for index in sorted(self.buckets):
            seen += self.buckets[index]
            if rank < seen:
                return 2 * self.gamma ** index / (self.gamma + 1)
        return 2 * self.gamma ** max(self.buckets) / (self.gamma + 1)

    def clipped_moments(self, limit: float) -> tuple[int, float, float]:
        """(count, mean, standard deviation) of the values, each taken as at most ``limit`` (to the buckets'
        precision): a few absurd values then move the mean by at most ``limit`` ÷ count each."""
        if self.count == 0:
            return 0, 0.0, 0.0
        values = [(min(2 * self.gamma ** index / (self.gamma + 1), limit), n) for index, n in self.buckets.items()]
        mean = sum(v * n for v, n in values) / self.count
        spread = sum(n * (v - mean) ** 2 for v, n in values) + self.zeros * mean ** 2
        return self.count, mean, math.sqrt(spread / self.count)

    def to_dict(self) -> dict:
        return {"a": self.alpha, "z": self.zeros, "n": self.count, "s": self.total,
                "b": {str(k): v for k, v in self.buckets.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "QuantileSketch":
        """Raises on a sketch stage 1 could not have written (pipeline/load/checks.py)."""
        alpha = mapping(data, "a sketch")["a"]
        if alpha != DEFAULT_ALPHA:   # every sketch stage 1 writes has it; another cannot merge with the pool's
            raise ValueError(f"a sketch's alpha is not {DEFAULT_ALPHA}: {alpha!r:.50}")
        sketch = cls(DEFAULT_ALPHA)
        sketch.zeros, sketch.count = count(data["z"], "a sketch's zeros"), count(data["n"], "a sketch's count")
        sketch.total = amount(data["s"], "a sketch's total", math.inf)
        buckets = sketch.buckets = {int(k): n for k, n in mapping(data["b"], "a sketch's buckets").items()}
        if buckets and (max(buckets) > MAX_SKETCH_INDEX or min(buckets) < -MAX_SKETCH_INDEX):
            raise ValueError("a sketch's bucket index is out of range")
        if buckets and (set(map(type, buckets.values())) != {int} or min(buckets.values()) < 0):
            raise ValueError("a sketch's bucket is not a count")  # and none is above the checked total count
        if sketch.zeros + sum(buckets.values()) != sketch.count:
            raise ValueError("a sketch's count is not its zeros plus its buckets")
        return sketch

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QuantileSketch) and self.to_dict() == other.to_dict()
