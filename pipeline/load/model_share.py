"""Which models a pool serves: the evidence that makes two pools siblings, and so redirect targets.

Routers name each request's model, so a pool's models come from its events. A
redirect moves work to a pool that shares a model, so one absurd or mistaken
event (a model name another pool serves) must not make a pool a target for
work it cannot serve, and names a router invents must not crowd out the model
a pool really serves. So models are counted, not collected: stage 1 counts
events per model in each partial (at most ``MAX_MODELS`` names, by the
Misra–Gries rule, so a name with more than 1/17 of a partial's events is never
dropped, whatever the other names are); stage 2 keeps the counts decayed by
the pool's own events (by e every ``MODEL_MEMORY_EVENTS``), so an idle pool
keeps its models and a pool moved to another model forgets the old one; and
a picture lists the models with at least ``MODEL_MIN_SHARE`` of the decayed
total (of every event folded, so names dropped in stage 1 do not raise the
others' shares).

The decay follows the order partials merge in, which differs between sources
live and is event time in a rebuild: the two can read a share differently by
as much as it moved over the last few ``MODEL_MEMORY_EVENTS`` events, so a
model near the threshold can be listed in one and not the other. Decaying by
event time instead would merge in any order, but an idle pool's evidence
would fade with the clock, and a few events after an idle hour would outweigh
it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from .aggregates import IDENTIFIER
from .checks import count

MAX_MODELS = 16                 # model names counted per partial and per pool, listed per picture
MAX_MODEL_NAME = 128            # request_event.v1's maxLength for model
MODEL_MEMORY_EVENTS = 10_000    # a pool's model counts fall by e for every this many of its events
MODEL_MIN_SHARE = 0.05          # listed (a sibling's evidence) from this share of the pool's recent events


def count_model(counts: dict[str, int], model: str) -> None:
    """One event naming ``model``, into at most MAX_MODELS counts (the stage 1 fold's hot path)."""
    n = counts.get(model)
    if n is not None:
        counts[model] = n + 1
    elif len(counts) < MAX_MODELS:
        counts[model] = 1
    else:   # Misra–Gries: the newcomer and every counted name lose one event
        for name in [name for name, n in counts.items() if n == 1]:
            del counts[name]
        for name in counts:
            counts[name] -= 1


def trim(counts: dict[str, Any], limit: int = MAX_MODELS) -> None:
    """At most ``limit`` names: every count less the (limit+1)-th largest, those left at zero dropped (the
    merge of Misra–Gries summaries, so the guarantee holds across partials)."""
    if len(counts) <= limit:
        return
    cut = sorted(counts.values(), reverse=True)[limit]
    for name in list(counts):
        counts[name] -= cut
        if counts[name] <= 0:
            del counts[name]


def read_counts(value: Any) -> dict[str, int]:
    """A partial's model counts, held to what stage 1 could have written; raises on anything else."""
    if not isinstance(value, dict) or len(value) > MAX_MODELS:
        raise ValueError(f"a partial's model_events must map at most {MAX_MODELS} model names to counts")
    for name, n in value.items():
        if not (isinstance(name, str) and len(name) <= MAX_MODEL_NAME and IDENTIFIER.match(name)):
            raise ValueError("a partial's models must be model names as the contract allows them")
        count(n, "model_events")
    return dict(value)


class ModelShares:
    """A pool's model counts, decayed by its own events; ``listed`` is what its picture names."""

    __slots__ = ("counts", "total")

    def __init__(self, counts: Mapping[str, float] | None = None, total: float = 0.0) -> None:
        self.counts: dict[str, float] = dict(counts or {})
        self.total = total

    def add(self, counts: Mapping[str, int], n: int) -> None:
        """A partial's counts and ``n``, the events it folded (its counts add up to less once Misra–Gries
        dropped names: the shares are of every event, so a flood of names cannot raise the others')."""
        if not n:
            return
        keep = math.exp(-n / MODEL_MEMORY_EVENTS)
        for name in self.counts:
            self.counts[name] *= keep
        self.total = self.total * keep + n
        for name, k in counts.items():
            self.counts[name] = self.counts.get(name, 0.0) + k
        trim(self.counts)

    def listed(self) -> tuple[str, ...]:
        """Models with at least MODEL_MIN_SHARE of the decayed events, sorted (the counts only ever read low,
        so a name is listed on evidence, never on the rounding of others)."""
        floor = MODEL_MIN_SHARE * self.total
        return tuple(sorted(name for name, n in self.counts.items() if n > 0 and n >= floor))

    def to_dict(self) -> dict[str, Any]:
        return {"model_events": dict(self.counts), "model_total": self.total}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelShares":
        """From a stored state; one from before the counts (a ``models`` list) gives each model one event."""
        if "model_events" in data:
            return cls(data["model_events"], data.get("model_total", 0.0))
        models = list(data.get("models", []))
        return cls({name: 1.0 for name in models}, float(len(models)))
