"""The first step of both paths, pure: a batch of records → typed events, dead letters and duplicates.

No Faust, no Kafka, no clock reads (``now_ms`` is passed in). The control
path folds the events into the picture; the landing path turns the same
records into rows (``sinks/blocks.py``). ``RecentIds`` drops an ``event_id``
seen recently in the same partition (a producer retry), so a re-sent event
is neither folded nor landed twice.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import groupby
from operator import attrgetter
from typing import Iterable, Mapping, NamedTuple

from .events import ACCEPT, Event, Rejected, dead_letter, decode


class Record(NamedTuple):
    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    value: bytes | None


def by_partition(records: Iterable[Record]) -> dict[int, list[Record]]:
    """One topic's records per partition, each partition's in their order. A fetch gives each partition's
    records as one run, so the runs are joined (``groupby``, in C), not each record appended."""
    out: dict[int, list[Record]] = {}
    for partition, run in groupby(records, PARTITION):
        out.setdefault(partition, []).extend(run)
    return out


PARTITION = attrgetter("partition")


class RecentIds:
    """The last ``capacity`` event ids of one partition, oldest forgotten first."""

    def __init__(self, capacity: int, ids: Iterable[str] = ()) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()
        for event_id in ids:
            self.add(event_id)

    def __contains__(self, event_id: str) -> bool:
        return event_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, event_id: str) -> None:
        self.first_times([event_id])

    def first_times(self, event_ids: list[str]) -> list[bool] | None:
        """Per id, in order, whether it is not among the recent ones (it is from then on); None when none is."""
        fresh = []
        ids = self._ids
        for event_id in event_ids:
            if event_id in ids:
                fresh.append(False)
                continue
            fresh.append(True)
            ids[event_id] = None
            if len(ids) > self.capacity:
                ids.popitem(last=False)
        return None if all(fresh) else fresh


class RecentIdGenerations:
    """The event ids of one partition in two generations: at least the last ``capacity``, none before the
    last 2 × ``capacity`` (plus a batch). A batch with no repeat, the usual one, is checked and added by
    set operations in C; the exact window (``RecentIds``, an ordered dict per id) cost the control worker
    10-15% of its events/s (docs/performance.md, session 41). For the control path, which replays nothing
    from these ids (a partition's next owner starts with none); the landing path replays its window from
    the store, and keeps the exact one."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._current: set[str] = set()
        self._previous: set[str] = set()

    def __contains__(self, event_id: str) -> bool:
        return event_id in self._current or event_id in self._previous

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)

    def first_times(self, event_ids: list[str]) -> list[bool] | None:
        """As ``RecentIds.first_times``."""
        if (self._current.isdisjoint(event_ids) and self._previous.isdisjoint(event_ids)
                and len(set(event_ids)) == len(event_ids)):
            self._current.update(event_ids)
            self._turn()
            return None
        fresh = []
        for event_id in event_ids:
            new = event_id not in self
            fresh.append(new)
            if new:
                self._current.add(event_id)
                self._turn()
        return fresh

    def _turn(self) -> None:
        if len(self._current) >= self.capacity:
            self._previous, self._current = self._current, set()


@dataclass
class Decoded:
    """One partition's run of records, decoded: accepted events (with their records) and the rest."""

    events: list[Event] = field(default_factory=list)
    sources: list[Record] = field(default_factory=list)   # the record each event came from
    dead_letters: list[tuple[Record, bytes, bytes]] = field(default_factory=list)  # record, key, letter
    redecided: list[int] = field(default_factory=list)   # indexes into dead_letters (decode_records' verdicts)
    reasons: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    newest_event_ms: int = 0
    oldest_event_ms: int = 0


@dataclass(frozen=True)
class TimeBounds:
    """How far an event's time may be from the worker's clock: ahead (skew; None: any), behind (age; 0: any).
    The workers bound both from settings; the defaults bound nothing, for pure callers replaying old data."""

    max_ahead_ms: int | None = None
    max_age_ms: int = 0

    @classmethod
    def of(cls, settings) -> "TimeBounds":
        return cls(int(settings.max_clock_skew_s * 1000), int(settings.max_event_age_s * 1000))

    TIME_REASONS = ("event_time_ahead", "event_time_too_old")

    def window(self, now_ms: int) -> tuple[float, float]:
        """The event times ``check`` passes at ``now_ms``, as (lowest, highest), both included."""
        return (now_ms - self.max_age_ms if self.max_age_ms else -math.inf,
                now_ms + self.max_ahead_ms if self.max_ahead_ms is not None else math.inf)

    def check(self, event_time: int, now_ms: int) -> Rejected | None:
        if self.max_ahead_ms is not None and event_time > now_ms + self.max_ahead_ms:
            return Rejected("event_time_ahead", f"event_time {event_time} is {(event_time - now_ms) / 1000:.0f} s "
                                                f"ahead of the worker's clock (max_clock_skew_s)")
        if self.max_age_ms and event_time < now_ms - self.max_age_ms:
            return Rejected("event_time_too_old", f"event_time {event_time} is {(now_ms - event_time) / 1000:.0f} s "
                                                  f"old (max_event_age_s)")
        return None


def decode_records(cls: type, records: list[Record], max_bytes: int, now_ms: int,
                   seen: RecentIds | RecentIdGenerations | None = None, bounds: TimeBounds = TimeBounds(),
                   verdicts: Mapping[int, tuple[str, int]] | None = None) -> Decoded:
    """Every record ends as an event, a dead letter or a counted duplicate.

    ``verdicts`` (source offset → its dead letter's reason and time), for a block landed before and replayed:
    the time bounds are the clock's, so a replay after a crash between the block's dead letters and its rows
    would judge again with a later clock — an event dead-lettered as ahead then landing as a row too, or one
    landed as valid then dead-lettered as too old into an insert the store drops as a repeat (in neither).
    With them, a record is dead-lettered exactly when its first landing said so, for the reason it gave then,
    and its dead letter keeps its first time (the store's day partition, where the repeat is dropped); one
    the first landing took that now decodes as rejected (its limits changed with the restart) goes to
    ``redecided``, which lands under a token of its own, as the block's own dead-letter insert is a repeat."""
    out = Decoded()
    # the usual record takes one generated call (``events.ACCEPT``) and no other; anything it is not certain
    # of, a time out of bounds or a replay's verdicts take ``_judged``, which names the reason
    accept = ACCEPT.get(cls) if verdicts is None else None
    lowest, highest = bounds.window(now_ms)
    for rec in records:
        value = rec.value
        try:
            result = (accept(value, rec.key) if accept is not None and value is not None and rec.key is not None
                      and len(value) <= max_bytes else None)
        except Exception:   # a fast-path bug sends its record down the full path (a dead letter), not the batch
            result = None
        if result is None or not lowest <= result.event_time <= highest:
            result = _judged(cls, rec, max_bytes, now_ms, bounds, verdicts)
        if isinstance(result, tuple):
            rejected, letter_ms, fresh = result
            key, letter = dead_letter(rejected, rec.value, rec.key, rec.topic, rec.partition, rec.offset,
                                      rec.timestamp_ms, letter_ms)
            if verdicts is not None and fresh:
                out.redecided.append(len(out.dead_letters))
            out.dead_letters.append((rec, key, letter))
            out.reasons[rejected.reason] = out.reasons.get(rejected.reason, 0) + 1
            continue
        out.events.append(result)
        out.sources.append(rec)
    fresh = seen.first_times([e.event_id for e in out.events]) if seen is not None and out.events else None
    if fresh is not None:
        out.duplicates = len(fresh) - sum(fresh)
        out.events = [e for e, new in zip(out.events, fresh) if new]
        out.sources = [r for r, new in zip(out.sources, fresh) if new]
    if out.events:
        times = [e.event_time for e in out.events]
        out.newest_event_ms, out.oldest_event_ms = max(times), min(times)
    return out


def _judged(cls: type, rec: Record, max_bytes: int, now_ms: int, bounds: TimeBounds,
            verdicts: Mapping[int, tuple[str, int]] | None) -> Event | tuple[Rejected, int, bool]:
    """One record the fast path was not certain of: its event, or its rejection, the dead letter's time and
    whether it is judged now (not a replayed verdict)."""
    verdict = verdicts.get(rec.offset) if verdicts is not None else None
    if verdict is not None:
        return (Rejected(verdict[0], "dead-lettered when this block first landed (a replay keeps that)"),
                verdict[1], False)
    result = decode(cls, rec.value, rec.key, max_bytes)
    if verdicts is None and not isinstance(result, Rejected):
        result = bounds.check(result.event_time, now_ms) or result
    return (result, now_ms, True) if isinstance(result, Rejected) else result
