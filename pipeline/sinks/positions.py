"""What the store already holds of a source partition: what landing skips after a restart.

The store, not the Kafka commit, is the record of what landed: a worker can
die after an insert and before its commit, a committed offset can be older
than the log (retention) or lost, and an insert's deduplication token is
only remembered for the last blocks of a table. So a newly assigned
partition asks the store which of its source offsets are in the event table
or in ``dead_letters`` (every record becomes exactly one of those rows, or
none when it was a re-sent duplicate) and skips those records, whatever the
boundaries the blocks had.
"""

from __future__ import annotations

from .blocks import DEAD_LETTER_TABLE
from .store import Store

Ranges = list[tuple[int, int]]  # inclusive offset ranges, ascending and disjoint


def _where(topic: str, partition: int) -> str:
    if "'" in topic or "\\" in topic:
        raise ValueError(f"unexpected topic name {topic!r}")
    return f"source_topic = '{topic}' AND source_partition = {int(partition)}"


def landed_ranges(store: Store, table: str, topic: str, partition: int, since: int) -> Ranges:
    """Source offsets at or after ``since`` that the store holds (in ``table`` or as dead letters),
    as runs of consecutive offsets: normally one run, from the last commit to the newest landed row."""
    where = f"{_where(topic, partition)} AND source_offset >= {int(since)}"
    rows = store.query(
        "SELECT min(o) AS first, max(o) AS last FROM ("
        "SELECT o, toInt64(o) - toInt64(row_number() OVER (ORDER BY o)) AS run FROM ("
        f"SELECT DISTINCT source_offset AS o FROM (SELECT source_offset FROM {table} WHERE {where} "
        f"UNION ALL SELECT source_offset FROM {DEAD_LETTER_TABLE} WHERE {where}))) "
        "GROUP BY run ORDER BY first")
    return [(int(r["first"]), int(r["last"])) for r in rows]


def recent_ids(store: Store, table: str, topic: str, partition: int, limit: int) -> list[str]:
    """Event ids of the partition's newest ``limit`` landed rows, oldest first."""
    if limit <= 0:
        return []
    rows = store.query(
        f"SELECT toString(event_id) AS id FROM {table} WHERE {_where(topic, partition)} "
        f"ORDER BY source_offset DESC LIMIT {int(limit)}")
    return [r["id"] for r in reversed(rows)]
