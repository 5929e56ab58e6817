"""The per-request decision: from memory, no I/O, so a router can call it on every request."""

from __future__ import annotations

import bisect
import random
import time

from .signal_book import SignalBook
from .sliding_counts import SlidingCounts
from .throttle import AdaptiveThrottle
from .verdicts import ADMIT, Defer, Redirect, Reject, Request, Verdict

RETRY_AFTER_SPREAD = 1.5   # a refusal's retry-after is drawn up to this many times the signal's


class Decider:
    """``decide(request)`` from the signal book, with a seedable RNG and an injectable clock."""

    def __init__(self, book: SignalBook, seed: int | None = None, fallback_static_s: float = 30.0,
                 throttle_k: float = 2.0, window_s: float = 120.0, clock=time.time, min_retries: int = 10,
                 burst_s: int = 2, min_burst_retries: int = 3) -> None:
        self.book = book
        # retries every pool may make per window whatever its budget: per pool, a quiet pool (a request a
        # minute) would refuse its first retry after a failure (1 retry > 10% of 3 attempts); Finagle's retry
        # budgets keep a floor for the same reason
        self.min_retries = min_retries
        # the budget holds over any ``burst_s`` seconds too, with a floor of its own: a replica that dies
        # fails everything it held at once, and a budget over minutes let all of it retry within a second
        # into the survivors, before any picture showed the loss (FCFS queues then held critical first
        # tokens behind those cold prompts); the rest is refused with the signal's retry-after and comes
        # back judged by the admit fraction of a picture that has seen the loss
        self.burst_s = burst_s
        self.min_burst_retries = min_burst_retries
        self.rng = random.Random(seed)
        self.fallback_static_ms = fallback_static_s * 1000   # in the unit of valid_until: no sum per call
        self.clock = clock
        self.throttle = AdaptiveThrottle(throttle_k, window_s)
        self.window_s = window_s
        # attempts and retries per pool, each judged by its own pool's budget: shared, one pool's retry storm
        # spent a quiet pool's budget and a busy healthy pool's attempts hid a failing pool's retries
        self.attempts: dict[str, SlidingCounts] = {}   # the pool counted longest ago first

    def record(self, accepted: bool) -> None:
        """The backend's answer to a request this router sent (feeds adaptive throttling)."""
        self.throttle.record(self.clock(), accepted)

    def decide(self, request: Request) -> Verdict:
        now = self.clock()
        now_ms = now * 1000
        signal = self.book.signals.get(request.pool)
        if signal is not None and signal["issued_at"] > now_ms + self.book.max_skew_ms:   # rare: see current()
            signal = self.book.current(request.pool, now_ms)
        if signal is not None and now_ms > signal["valid_until"] + self.fallback_static_ms:
            signal = None  # expired beyond the fail-static grace: fall back
        if signal is None:
            return self._throttle(now)
        # the retry budget is for the cascade (retries after timeouts and failures); a retry that answers
        # our own shedding is judged by the admit fraction like any request, or shed work could never return
        budgeted = request.retry and not request.after_shed
        counts = self.attempts.get(request.pool) or self._new_counts(request.pool)
        counts.add(now, 1, 1 if budgeted else 0)
        # a critical retry counts against the budget (it tightens the others') but is judged, like every
        # critical request, only by critical's admit fraction: the protection the docs promise
        if budgeted and request.priority != "critical":
            attempts, retries = counts.totals(now)
            if retries > signal["retry_budget"] * attempts + self.min_retries:
                return self._reject(signal, "retry_budget")
            attempts, retries = counts.recent(now, self.burst_s)
            if retries > signal["retry_budget"] * attempts + self.min_burst_retries:
                return self._reject(signal, "retry_budget")
        slo = request.slo_ttft_s
        # early rejection spares work that would miss its SLO, but never critical work: critical is shed
        # only through its admit fraction, after every other class, down to the policy's floor
        if slo is not None and request.priority != "critical" and signal["max_predicted_wait_s"] > slo:
            return self._elsewhere(signal, slo, "predicted_wait", request, now_ms)
        kind = "continuing_task_admit_fraction" if request.continuing else "admit_fraction"
        # a warm step (its context cached on the replica it goes back to) has fractions of its own when the
        # cache makes it cheaper; without them it is a continuing step like any other
        own = "warm_task_admit_fraction" if request.continuing and request.warm else kind
        fraction = signal.get(own, signal[kind])[request.priority]
        if request.tenant is not None:
            # a tenant over its fair share is shed by its own fractions (never more leniently than the pool)
            entry = self.book.tenants.get(request.pool, {}).get(request.tenant)
            if entry is not None:
                fraction = min(fraction, entry[kind][request.priority])
        if self.rng.random() < fraction:
            return ADMIT
        if request.priority in signal["defer"]["classes"]:
            return Defer(self._spread(signal["defer"]["retry_after_s"], low=1.0))
        return self._elsewhere(signal, slo, "shed", request, now_ms)

    def _new_counts(self, pool: str) -> SlidingCounts:
        """A pool's first counts, for as many pools as the signal book keeps: the one counted longest ago is
        forgotten first (its counts start over, as after the window)."""
        if len(self.attempts) >= self.book.max_pools:
            del self.attempts[next(iter(self.attempts))]
        counts = self.attempts[pool] = SlidingCounts(self.window_s)
        return counts

    def _spread(self, retry_after_s: float, low: float = 0.5) -> float:
        """Each refusal's retry-after drawn from ``low``–1.5× the signal's: clients that honour it to the
        second would otherwise bring all work shed in one tick back in one wave, which the policy sheds
        again — a loop with the retry-after as its period. A deferral is never earlier than the signal
        says (its floor is the policy's ``defer_min_s``); nothing is later than a day."""
        return min(86400.0, max(1.0, retry_after_s * self.rng.uniform(low, RETRY_AFTER_SPREAD)))

    def _elsewhere(self, signal: dict, slo: float | None, reason: str, request: Request, now_ms: float) -> Verdict:
        """Move the work if a sibling has headroom, serves the request's model (when the request and the
        signal name models) and its cold prefill still fits the SLO; else reject.

        Never to the request's own pool, and into another only as that pool's own current signal admits the
        request's class there (its admit fraction, drawn like its own requests'): the source's signal is older
        news about the target than the target's, and two pools both relaxing after an overload (or one
        holding a stale signal fail-static) offered each other, so moved work went round between them, or was
        admitted by a move into a pool that was shedding it. Requiring the target to admit the class in full
        instead cost two-pools 0.5% of SLO-goodput on every seed (a sibling briefly trimming a class)."""
        admits = {r["pool"]: self._admits(r["pool"], request, now_ms) for r in signal["redirect"]
                  if (slo is None or r["cold_prefill_cost_s"] < slo) and r["pool"] != request.pool}
        options = [r for r in signal["redirect"] if admits.get(r["pool"], 0.0) > 0.0]
        if request.model is not None and options and "redirect_models" in signal:
            serving = {e["pool"] for e in signal["redirect_models"] if request.model in e["models"]}
            options = [r for r in options if r["pool"] in serving]
        if options:
            cumulative, total = [], 0.0
            for option in options:
                total += option["weight"]
                cumulative.append(total)
            pick = bisect.bisect_right(cumulative, self.rng.random() * total)
            target = options[min(pick, len(options) - 1)]["pool"]
            if admits[target] >= 1.0 or self.rng.random() < admits[target]:
                return Redirect(target, reason)
        return self._reject(signal, reason)

    def _admits(self, pool: str, request: Request, now_ms: float) -> float:
        """The share of the request's class (continuing or not) that ``pool``'s own signal admits, as this
        router obeys it (through the fail-static grace); 1 when it holds none it still obeys."""
        target = self.book.current(pool, now_ms)
        if target is None or now_ms > target["valid_until"] + self.fallback_static_ms:
            return 1.0
        kind = "continuing_task_admit_fraction" if request.continuing else "admit_fraction"
        return target[kind][request.priority]

    def _reject(self, signal: dict, reason: str) -> Reject:
        return Reject(self._spread(signal["defer"]["retry_after_s"]), reason)

    def reject(self, pool: str, reason: str) -> Reject:
        """A rejection of a request for ``pool``, its retry-after spread like the decider's own: for a caller
        that cannot make the move a Redirect asks for (the LiteLLM hook, when the caller's key may not call
        the sibling). 1 s when the pool has no current signal."""
        signal = self.book.current(pool, self.clock() * 1000)
        return self._reject(signal, reason) if signal is not None else Reject(1.0, reason)

    def _throttle(self, now: float) -> Verdict:
        p_reject = self.throttle.reject_probability(now)
        if self.rng.random() < p_reject:
            return Reject(1.0, "client_throttle")
        return ADMIT
