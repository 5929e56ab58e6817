"""What a router asks about a request, and the four answers it can get."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


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


@dataclass(frozen=True)
class Defer:
    retry_after_s: float


Verdict = Union[Admit, Reject, Redirect, Defer]
ADMIT = Admit()
