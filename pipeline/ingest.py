"""Stage 1's pure step: a batch of Kafka records → rows to land and dead letters.

No Faust, no Kafka, no clock reads (``now_ms`` is passed in), so it is tested
directly and the agent stays a thin loop around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

import orjson

from .events import Event, Rejected, ReplicaSample, RequestEvent, as_dict, dead_letter, decode

TABLE_OF = {RequestEvent: "request_events", ReplicaSample: "replica_samples"}


class Record(NamedTuple):
    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    value: bytes | None


@dataclass
class BatchOutcome:
    table: str
    rows: list[bytes] = field(default_factory=list)
    events: list[tuple[int, Event]] = field(default_factory=list)  # (source partition, event)
    dead_letters: list[tuple[bytes, bytes]] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    offsets: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    newest_event_ms: int = 0

    @property
    def dedup_token(self) -> str:
        """Deterministic for the same offset ranges, so a redelivered batch is dropped by the store."""
        ranges = ",".join(f"{t}/{p}/{lo}-{hi}" for (t, p), (lo, hi) in sorted(self.offsets.items()))
        return f"{self.table}:{ranges}"


def event_time_text(ms: int) -> str:
    """Epoch ms as the exact ``seconds.millis`` text ClickHouse parses into DateTime64(3)."""
    return f"{ms // 1000}.{ms % 1000:03d}"


def row(event: Event, partition: int, offset: int) -> bytes:
    doc = as_dict(event)
    doc["event_time"] = event_time_text(event.event_time)
    doc["source_partition"] = partition
    doc["source_offset"] = offset
    return orjson.dumps(doc)


def process_batch(cls: type[Event], records: Iterable[Record], max_bytes: int, now_ms: int) -> BatchOutcome:
    out = BatchOutcome(TABLE_OF[cls])
    for rec in records:
        where = (rec.topic, rec.partition)
        lo, hi = out.offsets.get(where, (rec.offset, rec.offset))
        out.offsets[where] = (min(lo, rec.offset), max(hi, rec.offset))
        result = decode(cls, rec.value, rec.key, max_bytes)
        if isinstance(result, Rejected):
            out.dead_letters.append(dead_letter(result, rec.value, rec.key, rec.topic, rec.partition,
                                                rec.offset, rec.timestamp_ms, now_ms))
            out.reasons[result.reason] = out.reasons.get(result.reason, 0) + 1
        else:
            out.rows.append(row(result, rec.partition, rec.offset))
            out.events.append((rec.partition, result))
            if result.event_time > out.newest_event_ms:
                out.newest_event_ms = result.event_time
    return out
