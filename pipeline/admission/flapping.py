"""Flapping as routers feel it: reversals of the admit fractions they act on. Pure.

A state label can change without routers noticing (the fractions move in
bounded steps) and the fractions can saw up and down under a steady label;
what costs clients is the second — work admitted, then shed, then admitted
again. A reversal is a move of a class's admit fraction against its previous
move, both larger than ``epsilon``.
"""

from __future__ import annotations

from typing import Iterable, Mapping

EPSILON = 0.01


def reversals(series: Iterable[Mapping[str, float]], epsilon: float = EPSILON) -> int:
    """Direction changes of each class's admit fraction over ``series`` (one mapping per decision), summed."""
    last: dict[str, float] = {}
    direction: dict[str, int] = {}
    count = 0
    for fractions in series:
        for cls, value in fractions.items():
            before = last.get(cls)
            if before is None:
                last[cls] = value
                continue
            move = value - before
            if abs(move) <= epsilon:
                continue
            sign = 1 if move > 0 else -1
            if direction.get(cls, sign) != sign:
                count += 1
            direction[cls] = sign
            last[cls] = value
    return count


def reversals_per_minute(series: Iterable[Mapping[str, float]], duration_s: float, epsilon: float = EPSILON) -> float:
    return reversals(series, epsilon) / (duration_s / 60) if duration_s > 0 else 0.0
