"""What the store already holds of a source partition: where stage 1 resumes after a restart.

The store, not the Kafka commit, is the record of what landed: a worker can
die after an insert and before its commit. Every landed row names its source
position and block, so the last block of a partition is found in its table or
in ``dead_letters`` (a block lands its dead letters first, then its rows).
"""

from __future__ import annotations

from .blocks import DEAD_LETTER_TABLE
from .store import Store


def _where(topic: str, partition: int) -> str:
    if "'" in topic or "\\" in topic:
        raise ValueError(f"unexpected topic name {topic!r}")
    return f"source_topic = '{topic}' AND source_partition = {int(partition)}"


def last_block(store: Store, table: str, topic: str, partition: int, since: int) -> tuple[int, int] | None:
    """The landed block with the highest start at or after offset ``since``, as (start, end)."""
    where = f"{_where(topic, partition)} AND block_start >= {int(since)}"
    rows = store.query(
        f"SELECT block_start, max(block_end) AS block_end FROM ("
        f"SELECT block_start, block_end FROM {table} WHERE {where} "
        f"UNION ALL SELECT block_start, block_end FROM {DEAD_LETTER_TABLE} WHERE {where}) "
        f"GROUP BY block_start ORDER BY block_start DESC LIMIT 1")
    return (int(rows[0]["block_start"]), int(rows[0]["block_end"])) if rows else None


def recent_ids(store: Store, table: str, topic: str, partition: int, before: int, limit: int) -> list[str]:
    """Event ids of the newest ``limit`` rows landed from blocks that start before ``before``, oldest first."""
    if limit <= 0:
        return []
    rows = store.query(
        f"SELECT toString(event_id) AS id FROM {table} WHERE {_where(topic, partition)} "
        f"AND block_start < {int(before)} ORDER BY source_offset DESC LIMIT {int(limit)}")
    return [r["id"] for r in reversed(rows)]
