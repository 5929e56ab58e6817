"""Which admission signals a router trusts: verified, schema-valid, and newer than the last one per pool."""

from __future__ import annotations

from typing import Mapping

from ..admission.signing import SignatureError, verify
from ..contract import Invalid
from ..events import validate


class SignalBook:
    """The newest trusted signal per pool, and why others were refused."""

    def __init__(self, keys: Mapping[str, bytes]) -> None:
        self.keys = dict(keys)
        self.signals: dict[str, dict] = {}
        self.refused: dict[str, int] = {}

    def _refuse(self, reason: str) -> bool:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return False

    def offer(self, message: bytes | None) -> bool:
        """Take a message from the admission topic; False (and counted) when it is not trusted."""
        if message is None:
            return self._refuse("tombstone")
        try:
            signal = verify(message, self.keys)
            validate("admission_signal", signal)
        except SignatureError as exc:
            return self._refuse(exc.reason)
        except Invalid:
            return self._refuse("invalid")
        current = self.signals.get(signal["pool"])
        if current is not None and signal["seq"] <= current["seq"]:
            return self._refuse("replayed")
        self.signals[signal["pool"]] = signal
        return True
