"""What a router does with no trusted signal to obey: throttle on what the backends accept."""

from __future__ import annotations

from .sliding_counts import SlidingCounts


class AdaptiveThrottle:
    """Rejects with probability ``max(0, (requests − k·accepts) / (requests + 1))`` over ``window_s``.

    Only the backends' own answers feed it, so a router keeps protecting them while the controller
    is silent, and admits everything again once they accept at least one request in ``k``.
    """

    def __init__(self, k: float, window_s: float) -> None:
        self.k = k
        self.outcomes = SlidingCounts(window_s)   # requests, backend accepts

    def record(self, now_s: float, accepted: bool) -> None:
        self.outcomes.add(now_s, 1, 1 if accepted else 0)

    def reject_probability(self, now_s: float) -> float:
        requests, accepts = self.outcomes.totals(now_s)
        return max(0.0, (requests - self.k * accepts) / (requests + 1))
