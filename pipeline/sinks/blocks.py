"""Landing blocks and their rows, pure: records of one source partition → what lands in each table.

Exactly-once landing rests on facts kept here:

- a **block** is a run of records of *one* source partition (consecutive
  fetches of it gather into one block before landing); its rows carry
  ``block_start``/``block_end`` and its inserts a token made of the topic,
  partition and offset range, so the same block always yields the same
  insert (``insert_deduplication_token`` drops a re-sent one);
- after a restart, a partition resumes at the last block the store holds and
  ``PartitionCursor`` cuts the redelivered records on exactly that block's
  boundaries, however Kafka batches them this time.

Table names and the row format (``event_time`` as ten-digit ``seconds.millis``
text, the source position on every row) live here, beside the sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from ..events import AdmissionSignal, Rejected, ReplicaSample, RequestEvent, as_dict, dead_letter
from ..ingest import Record, RecentIds, TimeBounds, decode_records

TABLE_OF: dict[type, str] = {RequestEvent: "request_events", ReplicaSample: "replica_samples",
                             AdmissionSignal: "admission_signals"}
DEAD_LETTER_TABLE = "dead_letters"


@dataclass
class BlockOutcome:
    """One landing block: the rows for its table and for the dead-letter table, with their sources."""

    table: str
    topic: str
    partition: int
    start: int
    end: int
    rows: list[bytes] = field(default_factory=list)
    sources: list[Record] = field(default_factory=list)  # the record each row came from
    dead_letter_rows: list[bytes] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    newest_event_ms: int = 0
    oldest_event_ms: int = 0
    sealed: bool = False      # a replayed block: lands alone, on exactly its old boundaries
    opened_at: float = 0.0    # monotonic time it started accumulating (set by the sink)

    def token(self, table: str) -> str:
        """Deterministic for the block, so a re-sent insert is dropped by the store."""
        return f"{table}:{self.topic}/{self.partition}/{self.start}-{self.end}"

    @property
    def next_offset(self) -> int:
        return self.end + 1

    @property
    def size(self) -> int:
        return len(self.rows) + len(self.dead_letter_rows)

    def follows(self, other: "BlockOutcome") -> bool:
        return not self.sealed and not other.sealed and self.start > other.end and self.table == other.table

    def absorb(self, later: "BlockOutcome") -> None:
        """Grow this block by the next one of the same partition (the sink lands thousands of rows at once)."""
        self.end = later.end
        self.rows += later.rows
        self.sources += later.sources
        self.dead_letter_rows += later.dead_letter_rows
        for reason, n in later.reasons.items():
            self.reasons[reason] = self.reasons.get(reason, 0) + n
        self.duplicates += later.duplicates
        if later.newest_event_ms > self.newest_event_ms:
            self.newest_event_ms = later.newest_event_ms
        if later.oldest_event_ms and (not self.oldest_event_ms or later.oldest_event_ms < self.oldest_event_ms):
            self.oldest_event_ms = later.oldest_event_ms

    def landed_rows(self) -> list[bytes]:
        return with_block(self.rows, self.start, self.end)

    def landed_dead_letters(self) -> list[bytes]:
        return with_block(self.dead_letter_rows, self.start, self.end)


def event_time_text(ms: int) -> str:
    """Epoch ms as the exact ``seconds.millis`` text ClickHouse parses into DateTime64(3).

    Ten integer digits: a shorter number such as ``5.000`` is read as a date
    (day.month) and the whole insert fails.
    """
    return f"{ms // 1000:010d}.{ms % 1000:03d}"


def _position(doc: dict[str, Any], rec: Record) -> bytes:
    doc["source_topic"] = rec.topic
    doc["source_partition"] = rec.partition
    doc["source_offset"] = rec.offset
    return orjson.dumps(doc)


def with_block(rows: list[bytes], start: int, end: int) -> list[bytes]:
    """Rows as landed: each names the block it landed in (known only once the block is complete)."""
    suffix = f',"block_start":{start},"block_end":{end}}}'.encode()
    return [r[:-1] + suffix for r in rows]


def row(event: Any, rec: Record) -> bytes:
    if isinstance(event, AdmissionSignal):
        doc = event.row()
        doc["issued_at"] = event_time_text(doc["issued_at"])
        doc["valid_until"] = event_time_text(doc["valid_until"])
    else:
        doc = as_dict(event)
    doc["event_time"] = event_time_text(event.event_time)
    return _position(doc, rec)


def dead_letter_row(letter: bytes, rec: Record) -> bytes:
    doc = orjson.loads(letter)
    del doc["schema_version"]
    doc["event_time"] = event_time_text(doc["event_time"])
    if doc["source_timestamp"] is not None:
        doc["source_timestamp"] = event_time_text(doc["source_timestamp"])
    return _position(doc, rec)


def refused_by_store(out: BlockOutcome, index: int, detail: str, now_ms: int) -> tuple[bytes, bytes, bytes]:
    """Row ``index`` of a block, which the store refused, as (dead-letter key, value, table row)."""
    rec = out.sources[index]
    key, letter = dead_letter(Rejected("store_rejected", detail[:1024]), rec.value, rec.key, rec.topic,
                              rec.partition, rec.offset, rec.timestamp_ms, now_ms)
    return key, letter, with_block([dead_letter_row(letter, rec)], out.start, out.end)[0]


def process_block(cls: type, records: list[Record], max_bytes: int, now_ms: int,
                  seen: RecentIds | None = None, sealed: bool = False, bounds: TimeBounds = TimeBounds()) -> BlockOutcome:
    """Decode one block (records of one partition, in offset order) into rows."""
    first = records[0]
    decoded = decode_records(cls, records, max_bytes, now_ms, seen, bounds)
    return BlockOutcome(
        TABLE_OF[cls], first.topic, first.partition, first.offset, records[-1].offset,
        rows=[row(event, rec) for event, rec in zip(decoded.events, decoded.sources)],
        sources=decoded.sources,
        dead_letter_rows=[dead_letter_row(letter, rec) for rec, _, letter in decoded.dead_letters],
        reasons=decoded.reasons, duplicates=decoded.duplicates, newest_event_ms=decoded.newest_event_ms,
        oldest_event_ms=decoded.oldest_event_ms, sealed=sealed)


class PartitionCursor:
    """Cuts one partition's records into landing blocks.

    Normally whatever arrived is one block. After a restart it first replays
    ``replay`` — the block the store saw last, which may have landed in one
    table and not the other — on exactly its old boundaries, holding records
    until the block is complete, so its inserts repeat their old tokens.
    """

    def __init__(self, replay: tuple[int, int] | None = None) -> None:
        self.replay = replay
        self.held: list[Record] = []

    def cut(self, records: list[Record]) -> list[tuple[list[Record], bool]]:
        """Blocks of records, each with whether it is the replayed (sealed) one."""
        pending = self.held + records
        self.held = []
        if not pending:
            return []
        blocks = []
        if self.replay is not None:
            _, end = self.replay
            inside = [r for r in pending if r.offset <= end]
            if pending[-1].offset < end:
                self.held = inside
                return []
            self.replay = None
            if inside:
                blocks.append((inside, True))
            pending = pending[len(inside):]
        if pending:
            blocks.append((pending, False))
        return blocks
