"""``pool_minute`` rolled up from landed request events, exactly once, by the landing worker.

A materialized view would do this on every insert, and ClickHouse plans the
view's query each time: about a quarter of the landing path's time at
5,000-row blocks (docs/performance.md). The landing worker instead rolls up,
about once a second (``sink_rollup_interval_s``), every source offset its
partitions have landed since their last rollup, in one ``INSERT … SELECT``.

Exactly once rests on three inserts in order, each idempotent under the
rollup's token: the rollup's *ranges* go to ``pool_minute_rollups`` (per
source partition: first and last offset, the token, not landed), then
``pool_minute`` gets the aggregate under that token, then the ranges are
marked landed. A rollup whose outcome is unknown (refused, cancelled, cut by
a crash) is run again as it was, never widened, until it lands: by the same
worker, or by a partition's next owner, which finds it recorded and not
landed. A landed rollup is never run again, so the deduplication window only
has to outlast the retries, not an idle partition. Every offset of a range
is landed before the range is recorded, so a rollup run again reads the same
rows (an offset landed twice counts once), and its parts, one per month its
rows touch, come out in the same order under the same tokens.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import orjson

from ..events import RequestEvent
from .blocks import TABLE_OF
from .positions import partition_filter
from .store import INSERT_SETTINGS, Store, StoreUnavailable

ROLLUPS_TABLE = "pool_minute_rollups"
SOURCE_TABLE = TABLE_OF[RequestEvent]
TERMINAL_PHASES = ("completed", "failed", "rejected", "cancelled")
MAX_OFFSETS = 1_000_000   # the most source offsets one rollup takes, over all its partitions: a backlog rolls up in steps
Where = tuple[str, int]             # source topic, partition
Range = tuple[str, int, int, int]   # source topic, partition, first and last offset (inclusive)
T = TypeVar("T")

# What pool_minute holds per pool, priority class and minute (docs/storage.md): terminal attempts, their
# SLO and token counts, and mergeable latency states.
AGGREGATES = """
    pool,
    priority,
    toStartOfMinute(event_time) AS minute,
    count() AS requests,
    countIf(phase = 'completed') AS completed,
    countIf(phase = 'failed') AS failed,
    countIf(phase = 'rejected') AS rejected,
    countIf(phase = 'cancelled') AS cancelled,
    countIf(attempt > 1) AS retries,
    countIf(phase = 'completed' AND (slo_ttft_s IS NULL OR ttft_s <= slo_ttft_s)) AS ttft_slo_met,
    countIf(phase = 'completed' AND (slo_tpot_s IS NULL OR tpot_s <= slo_tpot_s)) AS tpot_slo_met,
    sum(toUInt64(ifNull(input_tokens, 0))) AS input_tokens,
    sum(toUInt64(ifNull(cached_input_tokens, 0))) AS cached_input_tokens,
    sum(toUInt64(ifNull(output_tokens, 0))) AS output_tokens,
    quantileBFloat16StateIf(0.5)(ifNull(ttft_s, 0), phase = 'completed' AND ttft_s IS NOT NULL) AS ttft_state,
    quantileBFloat16StateIf(0.5)(ifNull(tpot_s, 0), phase = 'completed' AND tpot_s IS NOT NULL) AS tpot_state,
    quantileBFloat16StateIf(0.5)(ifNull(duration_s, 0), phase = 'completed' AND duration_s IS NOT NULL)
        AS duration_state"""
COLUMNS = ("pool, priority, event_time, phase, attempt, slo_ttft_s, ttft_s, slo_tpot_s, tpot_s, input_tokens, "
           "cached_input_tokens, output_tokens, duration_s, source_topic, source_partition, source_offset")

# terminal attempts landed and not yet in pool_minute (0 once the rollups have caught up; below 0 where a
# materialized view counted a twice-landed offset twice, before migration 005; a read-only query)
PENDING_SQL = (f"SELECT toInt64((SELECT uniqExact(source_topic, source_partition, source_offset) FROM {SOURCE_TABLE} "
               f"WHERE phase IN {TERMINAL_PHASES})) - toInt64((SELECT sum(requests) FROM pool_minute)) AS pending")


def unclassified(fn: Callable[..., T]) -> Callable[..., T]:
    """The rollup's store calls raise every error as unclassified (``StoreUnavailable(known_outage=False)``):
    held while the store does not answer, refused by ``ClickHouseSink.call`` if it persists while the store
    answers — a rollup too large for the server's limits, or a schema it does not know, must not hold
    landing forever."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except StoreUnavailable as exc:
            if not exc.known_outage:
                raise
            raise StoreUnavailable(str(exc), known_outage=False) from exc
    return call


@dataclass(frozen=True)
class Last:
    """A partition's last recorded rollup."""

    last_offset: int   # -1: none yet
    token: str | None
    landed: bool
    token_landed: bool = False   # the rollup asked about (``last_rollups``'s ``dedup_token``) is marked landed here


def token(ranges: list[Range]) -> str:
    """The rollup's deduplication token: the same ranges, the same token."""
    digest = hashlib.sha256(orjson.dumps(sorted(ranges))).hexdigest()[:32]
    return f"pool_minute:{digest}"


class Fenced(Exception):
    """Another owner rolled up some of a rollup's offsets first: it must not land, and is planned again."""


def plan(rolled: dict[Where, int], landed_through: dict[Where, int], max_offsets: int = MAX_OFFSETS) -> list[Range]:
    """The next rollup's ranges: each partition's offsets after its last rollup, up to where everything is in the
    store, at most ``max_offsets`` of them in all. Pure."""
    ranges = []
    for (topic, partition), last in sorted(landed_through.items()):
        first = rolled.get((topic, partition), last) + 1
        take = min(last - first + 1, max_offsets - sum(r[3] - r[2] + 1 for r in ranges))
        if take > 0:
            ranges.append((topic, partition, first, first + take - 1))
    return ranges


def rollup_sql(ranges: list[Range], dedup_token: str) -> str:
    """One ``INSERT … SELECT`` of the ranges' terminal attempts into ``pool_minute``, each source offset once,
    its groups in a fixed order (so the parts of a rollup run again come out as they did)."""
    _check(dedup_token)
    where = " OR ".join(f"({partition_filter(topic, partition)} AND source_offset BETWEEN {int(first)} AND {int(last)})"
                        for topic, partition, first, last in ranges)
    phases = ", ".join(f"'{phase}'" for phase in TERMINAL_PHASES)
    # no cap on the months one rollup touches: landing bounds event times, and a rollup refused for its
    # spread would be refused again every time, leaving pool_minute behind for good
    settings = {**INSERT_SETTINGS, "insert_deduplication_token": f"'{dedup_token}'",
                "max_partitions_per_insert_block": 0}
    return (f"INSERT INTO pool_minute SETTINGS {', '.join(f'{k} = {v}' for k, v in settings.items())}\n"
            f"SELECT {AGGREGATES}\n"
            f"FROM (SELECT {COLUMNS} FROM {SOURCE_TABLE} WHERE phase IN ({phases}) AND ({where}) "
            f"LIMIT 1 BY source_topic, source_partition, source_offset)\n"
            f"GROUP BY pool, priority, minute ORDER BY minute, pool, priority")


def _records(ranges: list[Range], dedup_token: str, landed: bool) -> bytes:
    return b"\n".join(orjson.dumps(
        {"source_topic": topic, "source_partition": partition, "first_offset": first, "last_offset": last,
         "rollup": dedup_token, "landed": int(landed), "version": 2 * last + int(landed)})
        for topic, partition, first, last in ranges)


@unclassified
def roll_up(store: Store, ranges: list[Range], dedup_token: str) -> None:
    """Record the ranges, roll them up, mark them landed; each step is dropped if it was done before, so a
    rollup whose outcome is unknown is run again by calling this again with the same arguments. First the
    partitions' records are read: a rollup already landed (by a partition's next owner, while this worker
    was held) stops here, and one whose offsets another owner has recorded a rollup over raises ``Fenced``
    (found recorded, two owners planned it at once: it is marked done, never to run, and logged)."""
    stored = last_rollups(store, sorted({(r[0], r[1]) for r in ranges}), dedup_token)
    if any(last.token_landed for last in stored.values()):
        return
    for topic, partition, first, _ in ranges:
        last = stored.get((topic, partition))
        if last is not None and last.token != dedup_token and last.last_offset >= first:
            if recorded(store, dedup_token):
                store.insert(ROLLUPS_TABLE, _records(ranges, dedup_token, True), f"{ROLLUPS_TABLE}:{dedup_token}:landed")
            raise Fenced(f"{topic}/{partition} is rolled up to {last.last_offset} by {last.token}")
    store.insert(ROLLUPS_TABLE, _records(ranges, dedup_token, False), f"{ROLLUPS_TABLE}:{dedup_token}")
    store.command(rollup_sql(ranges, dedup_token))
    store.insert(ROLLUPS_TABLE, _records(ranges, dedup_token, True), f"{ROLLUPS_TABLE}:{dedup_token}:landed")


@unclassified
def first_landed(store: Store, topic: str, partition: int) -> int | None:
    """The partition's first source offset in the event table (None: none): where a partition with no
    rollup recorded starts, not at offset 0 of a topic that held records before this store."""
    row, = store.query(f"SELECT min(source_offset) AS first, count() AS n FROM {SOURCE_TABLE} "
                       f"WHERE {partition_filter(topic, partition)}")
    return int(row["first"]) if row["n"] else None


@unclassified
def last_rollups(store: Store, wheres: list[Where], dedup_token: str = "") -> dict[Where, Last]:
    """Each partition's last recorded rollup (partitions with none are left out), and whether the rollup
    ``dedup_token`` is marked landed for it — one query, as a rollup reads both before it runs."""
    if not wheres:
        return {}
    _check(dedup_token)
    where = " OR ".join(f"({partition_filter(topic, partition)})" for topic, partition in wheres)
    rows = store.query(f"SELECT source_topic, source_partition, max(last_offset) AS last_offset, "
                       f"argMax((rollup, landed), version) AS newest, "
                       f"countIf(rollup = '{dedup_token}' AND landed = 1) > 0 AS token_landed "
                       f"FROM {ROLLUPS_TABLE} WHERE {where} GROUP BY source_topic, source_partition")
    return {(r["source_topic"], int(r["source_partition"])): Last(int(r["last_offset"]), r["newest"][0],
                                                                  bool(r["newest"][1]), bool(r["token_landed"]))
            for r in rows}


@unclassified
def recorded(store: Store, dedup_token: str) -> list[Range]:
    """A recorded rollup's ranges, to run it again."""
    _check(dedup_token)
    rows = store.query(f"SELECT DISTINCT source_topic, source_partition, first_offset, last_offset "
                       f"FROM {ROLLUPS_TABLE} WHERE rollup = '{dedup_token}' ORDER BY source_topic, source_partition")
    return [(r["source_topic"], int(r["source_partition"]), int(r["first_offset"]), int(r["last_offset"]))
            for r in rows]


def _check(dedup_token: str) -> None:
    if "'" in dedup_token or "\\" in dedup_token:
        raise ValueError(f"unexpected rollup token {dedup_token!r}")
