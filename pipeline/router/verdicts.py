"""What a router asks about a request, and the four answers it can get."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..events import PRIORITIES


@dataclass(frozen=True)
class Request:
    pool: str
    priority: str
    continuing: bool = False   # a later step of a task already under way
    retry: bool = False        # attempt > 1
    slo_ttft_s: float | None = None
    after_shed: bool = False   # this retry follows a rejection by admission, honouring its retry-after
    tenant: str | None = None  # whose work it is: a tenant over its fair share is shed by its own fractions
    warm: bool = False         # a continuing step sent back to the replica that holds its context (affinity)
    model: str | None = None   # the model asked for: moved only to a pool the signal lists with it

    def __post_init__(self) -> None:
        """A misspelled class fails on every call: read from a signal, it raised a KeyError only for a pool
        that had one, and a pool without one admitted it, so a caller's typo surfaced only under load."""
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority {self.priority!r} is not one of {', '.join(PRIORITIES)}")


@dataclass(frozen=True)
class Admit:
    pass


@dataclass(frozen=True)
class Reject:
    retry_after_s: float
    reason: str


@dataclass(frozen=True)
class Redirect:
    pool: str
    reason: str = "shed"   # why the work leaves its pool: the rejection's reason if the move cannot be made


@dataclass(frozen=True)
class Defer:
    retry_after_s: float


Verdict = Union[Admit, Reject, Redirect, Defer]
ADMIT = Admit()
