"""Which admission signals a router trusts: verified, schema-valid, timely by the router's own clock, and
newer than the last one per pool."""

from __future__ import annotations

import json
import time
from typing import Callable, Mapping

from ..admission.signing import MAX_VALIDITY_S, SignatureError, verify
from ..contract import SCHEMA_DIR, Invalid
from ..events import validate

# The top-level fields this router knows. A verified signal's other fields are dropped before it is
# validated: a controller may add fields to admission_signal.v1 (new levers) without every deployed
# router refusing every signal, and this router keeps deciding by what it understands. Inside a known
# field the schema stays strict.
KNOWN_FIELDS = frozenset(json.loads((SCHEMA_DIR / "admission_signal.v1.json").read_text())["properties"])


class SignalBook:
    """The newest trusted signal per pool, and why others were refused.

    Time is judged by the router's clock, never the controller's alone: a signal issued more than
    ``max_skew_s`` in the future (a controller with a fast clock) is refused, or its ``seq`` would make
    every correct signal after it look replayed; so is one valid for longer than ``max_validity_s``, and
    one already expired on arrival (a slow clock), which would displace a valid signal.

    At most ``max_pools`` pools are kept (``RouterClient``: ten times the controllers' own bound of that name);
    a new pool beyond it evicts the one whose signal is oldest, a pool its controller stopped signalling.
    Tombstones carry no pool here, so without the bound every pool ever signalled would stay.
    """

    def __init__(self, keys: Mapping[str, bytes], clock: Callable[[], float] = time.time, max_skew_s: float = 30.0,
                 max_validity_s: float = MAX_VALIDITY_S, max_pools: int = 1000) -> None:
        self.keys = dict(keys)
        self.max_pools = max_pools
        self.clock = clock
        self.max_skew_ms = max_skew_s * 1000
        self.max_validity_ms = max_validity_s * 1000
        self.signals: dict[str, dict] = {}   # the pool whose newest signal is oldest first
        self.tenants: dict[str, dict[str, dict]] = {}   # per pool: the newest signal's tenant entries by name
        self.refused: dict[str, int] = {}

    def _refuse(self, reason: str) -> bool:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return False

    def current(self, pool: str, now_ms: float) -> dict | None:
        """The pool's newest trusted signal, judged by the router's clock now (epoch ms).

        One issued more than ``max_skew_s`` ahead of this clock (it stepped back since the signal was accepted)
        is taken as expiring now, so it is obeyed for the fail-static grace only: by its own times it would rule
        until the clock caught up, while every newer signal is refused as issued in the future. Its ``seq``
        stays: the controller's newer signals are accepted once their times agree with this clock."""
        signal = self.signals.get(pool)
        if signal is not None and signal["issued_at"] > now_ms + self.max_skew_ms:
            signal = self.signals[pool] = {**signal, "issued_at": int(now_ms), "valid_until": int(now_ms)}
        return signal

    def offer(self, message: bytes | None) -> bool:
        """Take a message from the admission topic; False (and counted) when it is not trusted."""
        if message is None:
            return self._refuse("tombstone")
        try:
            signal = verify(message, self.keys)
            signal = {name: value for name, value in signal.items() if name in KNOWN_FIELDS}
            validate("admission_signal", signal)
        except SignatureError as exc:
            return self._refuse(exc.reason)
        except Invalid:
            return self._refuse("invalid")
        now_ms = self.clock() * 1000
        current = self.current(signal["pool"], now_ms)   # first: a controller's signals notice a step back
        if signal["issued_at"] > now_ms + self.max_skew_ms:
            return self._refuse("issued_in_future")
        if signal["valid_until"] - signal["issued_at"] > self.max_validity_ms:
            return self._refuse("validity_too_long")
        if signal["valid_until"] < now_ms - self.max_skew_ms:
            return self._refuse("expired")
        pool = signal["pool"]
        # the seq must rise only while the held signal rules: one valid signal with an absurd seq (2^53 - 1)
        # pinned the pool, every later signal refused as replayed, for good. After it, a signal with a lower
        # seq is taken only if issued later, so a captured older one (valid longer, validity_s lowered since)
        # cannot roll the pool back
        if current is not None and signal["seq"] <= current["seq"] and (
                now_ms <= current["valid_until"] + self.max_skew_ms or signal["issued_at"] <= current["issued_at"]):
            return self._refuse("replayed")
        if current is not None:
            del self.signals[pool]   # inserted again below, last: the dict is ordered by the newest accepted
        elif len(self.signals) >= self.max_pools:
            oldest = next(iter(self.signals))
            del self.signals[oldest], self.tenants[oldest]
        self.signals[pool] = signal
        self.tenants[pool] = {entry["tenant"]: entry for entry in signal.get("tenant_admit_fraction", ())}
        return True
