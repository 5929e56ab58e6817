"""``pool_minute`` rolled up from landed request events, exactly once, by the landing worker.

A materialized view would do this on every insert, and ClickHouse plans the
view's query each time: about a quarter of the landing path's time at
5,000-row blocks (docs/performance.md). The landing worker instead rolls up,
about once a second (``sink_rollup_interval_s``), every source offset its
partitions have landed since their last rollup, in one ``INSERT … SELECT``.

Exactly once rests on two inserts in order. First the rollup's *ranges* go
to ``pool_minute_rollups`` (per source partition: first and last offset, and
the rollup's token); then ``pool_minute`` gets the aggregate, under that
token. A partition's next owner reads its last rollup and runs it again
before its own: the token drops it if it had landed, and lands it if a crash
came between the two inserts. Every offset of a range is landed before the
range is written, so a rollup run again reads the same rows (a row landed
twice by offset counts once), and its parts, one per month the rows touch,
come out in the same order under the same tokens.
"""

from __future__ import annotations

import hashlib

import orjson

from ..events import RequestEvent
from .blocks import TABLE_OF
from .positions import partition_filter
from .store import INSERT_SETTINGS, Store, StoreUnavailable, insert_error

ROLLUPS_TABLE = "pool_minute_rollups"
SOURCE_TABLE = TABLE_OF[RequestEvent]
TERMINAL_PHASES = ("completed", "failed", "rejected", "cancelled")
Range = tuple[str, int, int, int]   # source topic, partition, first and last offset (inclusive)

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


# terminal attempts landed and not yet in pool_minute (0 once the rollups have caught up; a read-only query)
PENDING_SQL = (f"SELECT toInt64((SELECT uniqExact(source_topic, source_partition, source_offset) FROM {SOURCE_TABLE} "
               f"WHERE phase IN {TERMINAL_PHASES})) - toInt64((SELECT sum(requests) FROM pool_minute)) AS pending")


def token(ranges: list[Range]) -> str:
    """The rollup's deduplication token: the same ranges, the same token."""
    digest = hashlib.sha256(orjson.dumps(sorted(ranges))).hexdigest()[:32]
    return f"pool_minute:{digest}"


def rollup_sql(ranges: list[Range], dedup_token: str) -> str:
    """One ``INSERT … SELECT`` of the ranges' terminal attempts into ``pool_minute``, each source offset once,
    its groups in a fixed order (so the parts of a rollup run again come out as they did)."""
    where = " OR ".join(f"({partition_filter(topic, partition)} AND source_offset BETWEEN {int(first)} AND {int(last)})"
                        for topic, partition, first, last in ranges)
    phases = ", ".join(f"'{phase}'" for phase in TERMINAL_PHASES)
    # no cap on the months one rollup touches: landing bounds event times, and a rollup refused for its
    # spread would be refused again every time, leaving pool_minute behind for good
    settings = ", ".join(f"{name} = {value}" for name, value in {**INSERT_SETTINGS,
                                                                  "max_partitions_per_insert_block": 0}.items())
    return (f"INSERT INTO pool_minute SELECT {AGGREGATES}\n"
            f"FROM (SELECT {COLUMNS} FROM {SOURCE_TABLE} WHERE phase IN ({phases}) AND ({where}) "
            f"LIMIT 1 BY source_topic, source_partition, source_offset)\n"
            f"GROUP BY pool, priority, minute ORDER BY minute, pool, priority\n"
            f"SETTINGS insert_deduplication_token = '{dedup_token}', {settings}")


def roll_up(store: Store, ranges: list[Range]) -> str | None:
    """Record the ranges, then roll them up; the rollup's token (None: nothing to roll up)."""
    ranges = [r for r in ranges if r[3] >= r[2]]
    if not ranges:
        return None
    dedup_token = token(ranges)
    store.insert(ROLLUPS_TABLE, b"\n".join(orjson.dumps(
        {"source_topic": topic, "source_partition": partition, "first_offset": first, "last_offset": last,
         "rollup": dedup_token}) for topic, partition, first, last in ranges), f"{ROLLUPS_TABLE}:{dedup_token}")
    _insert(store, rollup_sql(ranges, dedup_token))
    return dedup_token


def last_rollup(store: Store, topic: str, partition: int) -> tuple[int, str | None]:
    """The partition's last rolled-up offset (-1: none yet) and the token of the rollup that reached it."""
    rows = store.query(f"SELECT max(last_offset) AS last, argMax(rollup, last_offset) AS rollup, count() AS n "
                       f"FROM {ROLLUPS_TABLE} WHERE {partition_filter(topic, partition)}")
    if not rows or not rows[0]["n"]:
        return -1, None
    return int(rows[0]["last"]), rows[0]["rollup"]


def run_again(store: Store, dedup_token: str) -> None:
    """Run a recorded rollup again under its token: a no-op if it landed, the rollup if a crash came first."""
    if "'" in dedup_token or "\\" in dedup_token:
        raise ValueError(f"unexpected rollup token {dedup_token!r}")
    rows = store.query(f"SELECT DISTINCT source_topic, source_partition, first_offset, last_offset "
                       f"FROM {ROLLUPS_TABLE} WHERE rollup = '{dedup_token}'")
    ranges = [(r["source_topic"], int(r["source_partition"]), int(r["first_offset"]), int(r["last_offset"]))
              for r in rows if int(r["last_offset"]) >= int(r["first_offset"])]
    if ranges:
        _insert(store, rollup_sql(ranges, dedup_token))


def _insert(store: Store, sql: str) -> None:
    """An ``INSERT … SELECT``, its errors classified as an insert's: an outage is held, anything else is
    unclassified (``ClickHouseSink.call`` turns it into ``StoreRejected`` if it persists)."""
    try:
        store.command(sql)
    except StoreUnavailable as exc:
        raise insert_error(exc) from exc


def resume(store: Store, topic: str, partition: int) -> int:
    """For a partition's new owner: its last rollup run again (see the module's docstring), and the last offset
    rolled up."""
    last, dedup_token = last_rollup(store, topic, partition)
    if dedup_token is not None:
        run_again(store, dedup_token)
    return last
