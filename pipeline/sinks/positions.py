"""What the store already holds of a source partition: what landing skips after a restart.

The store, not the Kafka commit, is the record of what landed: a worker can
die after an insert and before its commit, a committed offset can be older
than the log (retention) or lost, and an insert's deduplication token is
only remembered for the last blocks of a table. So a newly assigned
partition asks the store which of its source offsets are in the event table
or in ``dead_letters`` (every record becomes exactly one of those rows, or
none when it was a re-sent duplicate) and skips those records, whatever the
boundaries the blocks had — except the last block landed after the committed
offset, which is re-sent whole on its old boundaries with its old token: a
crash can cut a block between its dead letters and its rows, and the same
inserts again land what is missing and drop what is not.
"""

from __future__ import annotations

from .blocks import DEAD_LETTER_TABLE, STORE_REJECTED
from .store import Store

Ranges = list[tuple[int, int]]  # inclusive offset ranges, ascending and disjoint


def partition_filter(topic: str, partition: int) -> str:
    if "'" in topic or "\\" in topic:
        raise ValueError(f"unexpected topic name {topic!r}")
    return f"source_topic = '{topic}' AND source_partition = {int(partition)}"


def landed_ranges(store: Store, table: str, topic: str, partition: int, since: int,
                  except_block: int | None = None) -> Ranges:
    """Source offsets at or after ``since`` that the store holds (in ``table`` or as dead letters),
    as runs of consecutive offsets: normally one run, from the last commit to the newest landed row.
    Rows of the block starting at ``except_block`` (the one replayed whole) are left out."""
    where = f"{partition_filter(topic, partition)} AND source_offset >= {int(since)}"
    if except_block is not None:
        where += f" AND block_start != {int(except_block)}"
    rows = store.query(
        "SELECT min(o) AS first, max(o) AS last FROM ("
        "SELECT o, toInt64(o) - toInt64(row_number() OVER (ORDER BY o)) AS run FROM ("
        f"SELECT DISTINCT source_offset AS o FROM (SELECT source_offset FROM {table} WHERE {where} "
        f"UNION ALL SELECT source_offset FROM {DEAD_LETTER_TABLE} WHERE {where}))) "
        "GROUP BY run ORDER BY first")
    return [(int(r["first"]), int(r["last"])) for r in rows]


def last_block(store: Store, table: str, topic: str, partition: int, since: int) -> tuple[int, int] | None:
    """The landed block with the highest start at or after offset ``since``, as (start, end): the one a
    crash may have cut between its tables."""
    where = f"{partition_filter(topic, partition)} AND block_start >= {int(since)}"
    rows = store.query(
        f"SELECT block_start, max(block_end) AS block_end FROM ("
        f"SELECT block_start, block_end FROM {table} WHERE {where} "
        f"UNION ALL SELECT block_start, block_end FROM {DEAD_LETTER_TABLE} WHERE {where}) "
        f"GROUP BY block_start ORDER BY block_start DESC LIMIT 1")
    return (int(rows[0]["block_start"]), int(rows[0]["block_end"])) if rows else None


def replay_verdicts(store: Store, table: str, topic: str, partition: int,
                    block: tuple[int, int]) -> tuple[dict[int, tuple[str, int]], dict[int, int], bool]:
    """The dead letters of the landed ``block`` (start, end) the replay repeats: source offset → (reason, epoch
    ms) of each record it dead-lettered as it decoded, source offset → epoch ms of each row the store
    refused then (those decode as rows again, and are refused again), and whether ``table`` holds its rows
    (then every record of it is a row or a dead letter already)."""
    start, end = int(block[0]), int(block[1])
    where = f"{partition_filter(topic, partition)} AND source_offset BETWEEN {start} AND {end} AND block_start = {start}"
    held, = store.query(f"SELECT count() > 0 AS held FROM {table} WHERE {where}")
    rows = store.query(
        "SELECT source_offset, any(reason) AS first_reason, toUnixTimestamp64Milli(min(event_time)) AS first_ms "
        f"FROM {DEAD_LETTER_TABLE} WHERE {where} GROUP BY source_offset, reason = '{STORE_REJECTED}'")
    verdicts, refused = {}, {}
    for r in rows:
        if r["first_reason"] == STORE_REJECTED:
            refused[int(r["source_offset"])] = int(r["first_ms"])
        else:
            verdicts[int(r["source_offset"])] = (r["first_reason"], int(r["first_ms"]))
    return verdicts, refused, bool(held["held"])


def recent_ids(store: Store, table: str, topic: str, partition: int, limit: int,
               before: int | None = None) -> list[str]:
    """Event ids of the partition's newest ``limit`` landed rows (from offsets before ``before``), oldest
    first."""
    if limit <= 0:
        return []
    bound = f" AND source_offset < {int(before)}" if before is not None else ""
    rows = store.query(
        f"SELECT toString(event_id) AS id FROM {table} WHERE {partition_filter(topic, partition)}{bound} "
        f"ORDER BY source_offset DESC LIMIT {int(limit)}")
    return [r["id"] for r in reversed(rows)]
