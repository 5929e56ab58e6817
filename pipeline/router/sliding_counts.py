"""A pair of counters over a sliding time window, for the retry budget and the fallback throttle."""

from __future__ import annotations

from collections import deque


class SlidingCounts:
    """Counts per second over the last ``window_s`` seconds (clock passed in).

    A clock that steps back a little counts into the newest second; one that steps back by the window or
    more starts the window again: its seconds would otherwise not expire until the clock caught up (an
    hour's step kept an hour of old counts in the retry budget)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.buckets: deque[list] = deque()  # [second, a, b]

    def add(self, now_s: float, a: int = 0, b: int = 0) -> None:
        second = int(now_s)
        buckets = self.buckets
        if buckets and buckets[-1][0] == second:
            last = buckets[-1]
            last[1] += a
            last[2] += b
        elif buckets and buckets[-1][0] > second:  # the clock stepped back
            last = buckets[-1]
            if last[0] - second >= self.window_s:  # past the window: start again
                buckets.clear()
                buckets.append([second, a, b])
            else:                                  # a little: counted in the newest second
                last[1] += a
                last[2] += b
        else:   # expired buckets go when a new one comes (at most one a second): the router's hot path
            buckets.append([second, a, b])
            self._trim(now_s)

    def totals(self, now_s: float) -> tuple[int, int]:
        self._trim(now_s)
        return sum(x[1] for x in self.buckets), sum(x[2] for x in self.buckets)

    def recent(self, now_s: float, seconds: int) -> tuple[int, int]:
        """Counts of the newest ``seconds`` whole seconds up to ``now_s`` (this one included): the bound on
        a burst inside the window, read from the same buckets."""
        since = int(now_s) - seconds
        a = b = 0
        for bucket in reversed(self.buckets):
            if bucket[0] <= since:
                break
            a += bucket[1]
            b += bucket[2]
        return a, b

    def _trim(self, now_s: float) -> None:
        buckets = self.buckets
        if buckets and buckets[-1][0] - now_s >= self.window_s:  # stepped back: those seconds never expire
            buckets.clear()
        while buckets and buckets[0][0] <= now_s - self.window_s:
            buckets.popleft()
