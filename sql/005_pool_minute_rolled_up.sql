-- pool_minute is rolled up by the landing worker about once a second
-- (pipeline/sinks/rollup.py, `sink_rollup_interval_s`), no longer by a
-- materialized view: ClickHouse planned the view's query on every insert,
-- about a quarter of the landing path's time (docs/performance.md).
--
-- Each rollup records its ranges here (per source partition: first and last
-- offset, inclusive, and its deduplication token) before it inserts into
-- pool_minute under that token, and marks them landed after; a rollup found
-- recorded and not landed is run again as it was, which the token drops if
-- it had landed. Only a partition's newest row is kept (version: 2 × its
-- last offset, + 1 once landed).
CREATE TABLE IF NOT EXISTS pool_minute_rollups
(
    source_topic     LowCardinality(String),
    source_partition UInt16,
    first_offset     UInt64,
    last_offset      UInt64,
    rollup           String,
    landed           UInt8,
    version          UInt64,
    rolled_at        DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(version)
ORDER BY (source_topic, source_partition)
SETTINGS non_replicated_deduplication_window = 10000;

DROP VIEW IF EXISTS pool_minute_mv;

-- What the view rolled up is where each partition's rollups start: an empty,
-- landed range after its newest landed offset. (Stop landing workers of an older
-- version before this runs: a row they land between the view's drop and
-- this statement would be in no rollup.)
INSERT INTO pool_minute_rollups (source_topic, source_partition, first_offset, last_offset, rollup, landed, version)
SELECT source_topic, source_partition, max(source_offset) + 1, max(source_offset), 'migration-005', 1,
       2 * max(source_offset) + 1
FROM request_events
GROUP BY source_topic, source_partition;
