"""Landing blocks and their rows, pure: records of one source partition → what lands in each table.

Exactly-once landing rests on facts kept here:

- a **block** is a run of records of *one* source partition (consecutive
  fetches of it gather into one block before landing); its rows carry
  ``block_start``/``block_end`` and its inserts a token made of the topic,
  partition and offset range, so the same block always yields the same
  insert (``insert_deduplication_token`` drops a re-sent one);
- after a restart, ``PartitionCursor`` skips every redelivered record whose
  offset the store already holds (``positions.landed_ranges``), whatever the
  boundaries of the blocks it landed in, so exactly-once does not depend on
  the committed offset, on Kafka's retention or on the deduplication window.

Table names and the row format (``event_time`` as ten-digit ``seconds.millis``
text, the source position on every row) live here, beside the sink.
"""

from __future__ import annotations

import zlib
from array import array
from dataclasses import dataclass, field
from typing import Any, Mapping

import orjson

from ..events import AdmissionSignal, Rejected, ReplicaSample, RequestEvent, as_dict, dead_letter
from ..ingest import Record, RecentIds, TimeBounds, decode_records

TABLE_OF: dict[type, str] = {RequestEvent: "request_events", ReplicaSample: "replica_samples",
                             AdmissionSignal: "admission_signals"}
DEAD_LETTER_TABLE = "dead_letters"
STORE_REJECTED = "store_rejected"   # the reason of a row the store refused after it decoded


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
    holes: bool = False       # records in its range were skipped as landed already (after a restart)
    sealed: bool = False      # the replayed last block: lands alone, on exactly its old boundaries
    offsets: array = field(default_factory=lambda: array("q"), repr=False)  # of the records it lands
    opened_at: float = 0.0    # monotonic time it started accumulating (set by the sink)
    source_bytes: int = 0     # of the records it holds: what bounds its memory (oversize values are kept whole)
    # a replayed block's: dead letters its first landing did not write (under their own token), and the
    # first times of the rows the store refused then (their dead letters keep them, and their day partition)
    redecided_rows: list[bytes] = field(default_factory=list)
    refused_ms: dict[int, int] = field(default_factory=dict)
    rows_held: bool = False   # a replayed block whose rows the store holds: nothing of it is redecided

    def token(self, table: str) -> str:
        """Deterministic for the block, so a re-sent insert is dropped by the store. A block with holes
        names its records too: it must not share a token with an earlier insert of the same range that
        held other records (a crash between that insert's parts: the store would drop this one)."""
        token = f"{table}:{self.topic}/{self.partition}/{self.start}-{self.end}"
        return f"{token}~{zlib.crc32(self.offsets.tobytes()):08x}" if self.holes else token

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
        self.holes = self.holes or later.holes
        self.offsets.extend(later.offsets)
        self.rows += later.rows
        self.sources += later.sources
        self.dead_letter_rows += later.dead_letter_rows
        self.redecided_rows += later.redecided_rows
        for reason, n in later.reasons.items():
            self.reasons[reason] = self.reasons.get(reason, 0) + n
        self.duplicates += later.duplicates
        self.source_bytes += later.source_bytes
        if later.newest_event_ms > self.newest_event_ms:
            self.newest_event_ms = later.newest_event_ms
        if later.oldest_event_ms and (not self.oldest_event_ms or later.oldest_event_ms < self.oldest_event_ms):
            self.oldest_event_ms = later.oldest_event_ms

    def landed_rows(self) -> list[bytes]:
        return with_block(self.rows, self.start, self.end)

    def landed_dead_letters(self) -> list[bytes]:
        return with_block(self.dead_letter_rows, self.start, self.end)

    def landed_redecided(self) -> list[bytes]:
        return with_block(self.redecided_rows, self.start, self.end)


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
    key, letter = dead_letter(Rejected(STORE_REJECTED, detail[:1024]), rec.value, rec.key, rec.topic,
                              rec.partition, rec.offset, rec.timestamp_ms, out.refused_ms.get(rec.offset, now_ms))
    return key, letter, with_block([dead_letter_row(letter, rec)], out.start, out.end)[0]


def process_block(cls: type, records: list[Record], max_bytes: int, now_ms: int,
                  seen: RecentIds | None = None, bounds: TimeBounds = TimeBounds(),
                  verdicts: Mapping[int, tuple[str, int]] | None = None) -> BlockOutcome:
    """Decode one block (records of one partition, in offset order) into rows (``verdicts``: a replayed
    block's dead letters as it first landed, ``decode_records``)."""
    first = records[0]
    decoded = decode_records(cls, records, max_bytes, now_ms, seen, bounds, verdicts)
    redecided = set(decoded.redecided)
    letters = [dead_letter_row(letter, rec) for rec, _, letter in decoded.dead_letters]
    return BlockOutcome(
        TABLE_OF[cls], first.topic, first.partition, first.offset, records[-1].offset,
        rows=[row(event, rec) for event, rec in zip(decoded.events, decoded.sources)],
        sources=decoded.sources,
        dead_letter_rows=[r for i, r in enumerate(letters) if i not in redecided],
        redecided_rows=[r for i, r in enumerate(letters) if i in redecided],
        reasons=decoded.reasons, duplicates=decoded.duplicates, newest_event_ms=decoded.newest_event_ms,
        oldest_event_ms=decoded.oldest_event_ms, offsets=array("q", [r.offset for r in records]),
        source_bytes=sum(len(r.value or b"") + len(r.key or b"") for r in records))


class PartitionCursor:
    """Cuts one partition's records into blocks after a restart; normally what arrived is one block.

    ``replay`` (start, end) is the last block the store holds after the
    committed offset: its records are held until the block is complete and
    re-sent on exactly its old boundaries, unfiltered, so its inserts repeat
    their tokens (a crash may have cut it between its tables), and
    with its dead letters as it first landed (``replay_verdicts``, source
    offset → the reason and time of its dead letter in the store). The
    other records whose offsets the store holds (``landed``, from
    ``positions.landed_ranges``) are dropped, whatever their block boundaries.
    """

    def __init__(self, landed: list[tuple[int, int]] | None = None, replay: tuple[int, int] | None = None,
                 landed_by_others: list[tuple[int, int]] | None = None,
                 replay_verdicts: Mapping[int, tuple[str, int]] | None = None,
                 replay_refused_ms: Mapping[int, int] | None = None, replay_rows_held: bool = False) -> None:
        self.landed = list(landed or ())
        self.replay = replay
        self.replay_verdicts = dict(replay_verdicts) if replay_verdicts is not None else None   # None: unknown
        self.replay_refused_ms = dict(replay_refused_ms or {})
        self.replay_rows_held = replay_rows_held
        # what other blocks landed inside the replayed one's range (a block cut after an earlier restart):
        # the replay repeats exactly what it held the first time
        self.landed_by_others = list(landed_by_others or ())
        self.held: list[Record] = []
        self.skipped = 0  # records dropped as landed already

    def cut(self, records: list[Record]) -> list[tuple[list[Record], bool]]:
        """The records as runs in offset order, each with whether it is the replayed block (complete,
        unfiltered); the other runs still hold every record (``unlanded`` filters them)."""
        if self.replay is None or not records:
            return [(records, False)] if records else []
        start, end = self.replay
        before = [r for r in records if r.offset < start]
        inside = [r for r in records if start <= r.offset <= end]
        after = [r for r in records if r.offset > end]
        runs = [(before, False)] if before else []
        if not self.held and inside and inside[0].offset > start or not self.held and not inside and after:
            self.replay = None   # its start is gone (retention, or a commit inside it): skipping covers it
            return runs + [(inside + after, False)]
        self.held += inside
        if (self.held and self.held[-1].offset >= end) or after:
            runs.append((self.held, True))
            self.held, self.replay = [], None
            if after:
                runs.append((after, False))
        return runs

    def unlanded(self, records: list[Record], ranges: list[tuple[int, int]] | None = None) -> list[Record]:
        """``records`` without those whose offsets the store holds (``ranges``, by default ``landed``)."""
        ranges = self.landed if ranges is None else ranges
        if not ranges or not records:
            return records
        while ranges and ranges[0][1] < records[0].offset:
            ranges.pop(0)
        kept: list[Record] = []
        i = 0
        for rec in records:
            while i < len(ranges) and ranges[i][1] < rec.offset:
                i += 1
            if not (i < len(ranges) and ranges[i][0] <= rec.offset):
                kept.append(rec)
        self.skipped += len(records) - len(kept)
        return kept


def cut_blocks(cls: type, records: list[Record], cursor: PartitionCursor, max_bytes: int, now_ms: int,
               seen: RecentIds | None = None, bounds: TimeBounds = TimeBounds()) -> list[BlockOutcome]:
    """One fetched run of a partition's records as blocks: the replayed block on its old boundaries when it
    completes, the others without the records the store holds. Each of those spans every offset of its
    run, so landing it moves the partition's commit past the skipped records too — also when none is left."""
    out = []
    replay = cursor.replay
    for run, sealed in cursor.cut(records):
        if sealed:   # it repeats exactly what it held the first time
            kept = cursor.unlanded(run, cursor.landed_by_others)
            block = process_block(cls, kept, max_bytes, now_ms, seen, bounds, cursor.replay_verdicts) if kept \
                else BlockOutcome(TABLE_OF[cls], run[0].topic, run[0].partition, replay[0], replay[1])
            block.start, block.end, block.sealed, block.holes = replay[0], replay[1], True, len(kept) < len(run)
            block.refused_ms, block.rows_held = cursor.replay_refused_ms, cursor.replay_rows_held
            out.append(block)
            continue
        kept = cursor.unlanded(run)
        first, last = run[0], run[-1]
        if kept:
            block = process_block(cls, kept, max_bytes, now_ms, seen, bounds=bounds)
        else:
            block = BlockOutcome(TABLE_OF[cls], first.topic, first.partition, first.offset, last.offset)
        block.start, block.end, block.holes = first.offset, last.offset, len(kept) < len(run)
        out.append(block)
    return out
