"""What a partial read back from Kafka may hold (the partials topic and the changelog table are inputs too).

A value that is not what stage 1 could have written refuses the whole partial when it is parsed, before any
of it is merged: a string count raising half-way through a merge would leave a pool's state partly changed,
and an absurd number (negative, astronomically large, a bucket index whose value overflows) would steer the
pool's decisions or fail every later tick.
"""

from __future__ import annotations

import math
from typing import Any

MAX_COUNT = 1 << 53          # exact in a float: beyond it sums stop being counts
MAX_SKETCH_INDEX = 20_000    # at alpha 1%, values up to about 1e173 s: far past any latency, far from overflow


def count(value: Any, what: str) -> int:
    """A non-negative integer count (not a bool)."""
    if type(value) is not int or not 0 <= value < MAX_COUNT:
        raise ValueError(f"{what} is not a count: {value!r:.50}")
    return value


def amount(value: Any, what: str, most: float = float(MAX_COUNT)) -> float:
    """A finite number from 0 to ``most`` (not a bool)."""
    if type(value) not in (int, float) or not (0 <= value <= most) or not math.isfinite(value):
        raise ValueError(f"{what} is not a number from 0 to {most:g}: {value!r:.50}")
    return value


def mapping(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not an object")
    return value
