-- Exactly-once landing, the other landed tables, and the analyst views.
--
-- Every landed row names its source position (topic, partition, offset) and
-- the block it was inserted in (block_start..block_end, offsets of one source
-- partition). After a restart, landing skips the source offsets the store
-- holds (003, docs/storage.md); a re-sent insert repeats its
-- insert_deduplication_token. Every table an insert reaches,
-- materialized-view targets included, needs its own deduplication window.

ALTER TABLE request_events ADD COLUMN IF NOT EXISTS source_topic LowCardinality(String) DEFAULT '' AFTER slo_tpot_s;
ALTER TABLE request_events ADD COLUMN IF NOT EXISTS block_start UInt64 DEFAULT source_offset AFTER source_offset;
ALTER TABLE request_events ADD COLUMN IF NOT EXISTS block_end UInt64 DEFAULT source_offset AFTER block_start;
ALTER TABLE replica_samples ADD COLUMN IF NOT EXISTS source_topic LowCardinality(String) DEFAULT '' AFTER healthy;
ALTER TABLE replica_samples ADD COLUMN IF NOT EXISTS block_start UInt64 DEFAULT source_offset AFTER source_offset;
ALTER TABLE replica_samples ADD COLUMN IF NOT EXISTS block_end UInt64 DEFAULT source_offset AFTER block_start;

CREATE TABLE IF NOT EXISTS dead_letters
(
    event_id         UUID,
    event_time       DateTime64(3, 'UTC'),
    reason           LowCardinality(String),
    detail           String,
    source_topic     LowCardinality(String),
    source_partition UInt16,
    source_offset    UInt64,
    source_timestamp Nullable(DateTime64(3, 'UTC')),
    key_b64          Nullable(String),
    value_b64        String,
    value_size       UInt32,
    block_start      UInt64,
    block_end        UInt64,
    landed_at        DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(event_time)
ORDER BY (source_topic, source_partition, source_offset)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS admission_signals
(
    event_id            UUID,
    event_time          DateTime64(3, 'UTC'),
    pool                LowCardinality(String),
    seq                 UInt64,
    state               LowCardinality(String),
    pressure            Float64,
    issued_at           DateTime64(3, 'UTC'),
    valid_until         DateTime64(3, 'UTC'),
    admit_critical      Float32,
    admit_standard      Float32,
    admit_sheddable     Float32,
    admit_deferrable    Float32,
    key_id              LowCardinality(String),
    signal              String,
    source_topic        LowCardinality(String),
    source_partition    UInt16,
    source_offset       UInt64,
    block_start         UInt64,
    block_end           UInt64,
    landed_at           DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(event_time)
ORDER BY (pool, seq, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

-- Reference data mirrored from the settings at every worker start and
-- `sluice db migrate` (gpu_prices, replica_stale_after_s), so views price and
-- bound sample gaps exactly as the load picture does.
CREATE TABLE IF NOT EXISTS gpu_prices
(
    hardware         LowCardinality(String),
    usd_per_gpu_hour Float64,
    updated_at       DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(updated_at)
ORDER BY hardware;

CREATE TABLE IF NOT EXISTS sluice_config
(
    name       String,
    value      Float64,
    updated_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(updated_at)
ORDER BY name;

-- Per pool, priority class and minute: terminal attempts (one per attempt).
-- Latency quantile states are quantileBFloat16: a mergeable histogram of the
-- values with their mantissa cut to 8 bits, so a quantile read from them is
-- the exact one rounded down by less than 0.8% — inside the 1% the load
-- picture's sketch allows. Read them with quantilesBFloat16Merge(0.5, 0.95, 0.99).
-- (ClickHouse's quantileDD was measured at up to 2.5% off at its 1% setting.)
CREATE TABLE IF NOT EXISTS pool_minute
(
    pool                LowCardinality(String),
    priority            LowCardinality(String),
    minute              DateTime('UTC'),
    requests            SimpleAggregateFunction(sum, UInt64),
    completed           SimpleAggregateFunction(sum, UInt64),
    failed              SimpleAggregateFunction(sum, UInt64),
    rejected            SimpleAggregateFunction(sum, UInt64),
    cancelled           SimpleAggregateFunction(sum, UInt64),
    retries             SimpleAggregateFunction(sum, UInt64),
    ttft_slo_met        SimpleAggregateFunction(sum, UInt64),
    tpot_slo_met        SimpleAggregateFunction(sum, UInt64),
    input_tokens        SimpleAggregateFunction(sum, UInt64),
    cached_input_tokens SimpleAggregateFunction(sum, UInt64),
    output_tokens       SimpleAggregateFunction(sum, UInt64),
    ttft_state          AggregateFunction(quantileBFloat16(0.5), Float64),
    tpot_state          AggregateFunction(quantileBFloat16(0.5), Float64),
    duration_state      AggregateFunction(quantileBFloat16(0.5), Float64)
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(minute)
ORDER BY (pool, priority, minute)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE MATERIALIZED VIEW IF NOT EXISTS pool_minute_mv TO pool_minute AS
SELECT
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
    quantileBFloat16StateIf(0.5)(ifNull(duration_s, 0), phase = 'completed' AND duration_s IS NOT NULL) AS duration_state
FROM request_events
WHERE phase IN ('completed', 'failed', 'rejected', 'cancelled')
GROUP BY pool, priority, minute;

-- Fleet cost: each replica sample pays for the time since the replica's
-- previous sample (capped at replica_stale_after_s: a silent replica is not
-- billed past the point the picture forgets it), gpu_count × $/GPU-hour.
-- Busy, idle and failing replicas all count: that is what the bill counts.
CREATE VIEW IF NOT EXISTS fleet_cost_minute AS
SELECT
    pool,
    minute,
    uniqExact(replica_id) AS replicas,
    sum(gpu_count * seconds) AS gpu_seconds,
    sum(gpu_count * seconds * usd_per_gpu_hour / 3600) AS fleet_cost_usd
FROM
(
    SELECT
        s.pool AS pool,
        s.replica_id AS replica_id,
        toStartOfMinute(s.event_time) AS minute,
        s.gpu_count AS gpu_count,
        least(dateDiff('millisecond', lagInFrame(s.event_time, 1, s.event_time)
                  OVER (PARTITION BY s.replica_id ORDER BY s.event_time
                        ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW), s.event_time) / 1000,
              (SELECT any(value) FROM sluice_config FINAL WHERE name = 'replica_stale_after_s')) AS seconds,
        p.usd_per_gpu_hour AS usd_per_gpu_hour
    FROM replica_samples AS s
    LEFT JOIN (SELECT hardware, usd_per_gpu_hour FROM gpu_prices FINAL) AS p ON p.hardware = s.hardware
)
GROUP BY pool, minute;

-- Each terminal attempt with its share of its pool-minute's fleet cost, in
-- proportion to the tokens it made the pool process (uncached prompt tokens
-- plus output tokens). Minutes with no such work stay unattributed (idle).
CREATE VIEW IF NOT EXISTS attempt_cost AS
SELECT
    a.task_id AS task_id,
    a.request_id AS request_id,
    a.attempt AS attempt,
    a.task_final AS task_final,
    a.tenant AS tenant,
    a.priority AS priority,
    a.pool AS pool,
    a.phase AS phase,
    a.event_time AS event_time,
    a.minute AS minute,
    a.ttft_s AS ttft_s,
    a.slo_ttft_s AS slo_ttft_s,
    a.work AS work,
    if(w.work > 0, f.fleet_cost_usd * a.work / w.work, 0) AS cost_usd
FROM
(
    SELECT
        task_id, request_id, attempt, task_final, tenant, priority, pool, phase, event_time,
        toStartOfMinute(event_time) AS minute, ttft_s, slo_ttft_s,
        toUInt64(greatest(toInt64(ifNull(input_tokens, 0)) - toInt64(ifNull(cached_input_tokens, 0)), 0)
                 + ifNull(output_tokens, 0)) AS work
    FROM request_events
    WHERE phase IN ('completed', 'failed', 'rejected', 'cancelled')
) AS a
LEFT JOIN
(
    SELECT pool, toStartOfMinute(event_time) AS minute,
           sum(toUInt64(greatest(toInt64(ifNull(input_tokens, 0)) - toInt64(ifNull(cached_input_tokens, 0)), 0)
                        + ifNull(output_tokens, 0))) AS work
    FROM request_events
    WHERE phase IN ('completed', 'failed', 'rejected', 'cancelled')
    GROUP BY pool, minute
) AS w ON w.pool = a.pool AND w.minute = a.minute
LEFT JOIN fleet_cost_minute AS f ON f.pool = a.pool AND f.minute = a.minute;

-- One row per task: every attempt's cost and how the task ended.
-- slo_success: a completed final step, and every completed step met its TTFT
-- objective; late: completed but some step missed it; failed / rejected /
-- cancelled: the router gave up (task_final on a non-completed attempt);
-- open: neither yet.
CREATE VIEW IF NOT EXISTS task_outcomes AS
SELECT
    task_id,
    argMax(attempt_pool, event_time) AS pool,
    any(attempt_tenant) AS tenant,
    any(attempt_priority) AS priority,
    min(event_time) AS first_event_time,
    max(event_time) AS last_event_time,
    count() AS attempts,
    countIf(phase = 'completed') AS completed_steps,
    sum(attempt_cost_usd) AS cost_usd,
    sumIf(attempt_cost_usd, phase != 'completed') AS wasted_usd,
    multiIf(
        countIf(phase = 'completed' AND task_final = true) > 0
            AND countIf(phase = 'completed' AND slo_ttft_s IS NOT NULL AND NOT (ttft_s <= slo_ttft_s)) = 0,
        'slo_success',
        countIf(phase = 'completed' AND task_final = true) > 0, 'late',
        countIf(phase != 'completed' AND task_final = true) > 0,
        argMaxIf(phase, event_time, phase != 'completed' AND task_final = true),
        'open') AS outcome
FROM
(
    SELECT task_id, pool AS attempt_pool, tenant AS attempt_tenant, priority AS attempt_priority,
           cost_usd AS attempt_cost_usd, phase, event_time, task_final, ttft_s, slo_ttft_s
    FROM attempt_cost
)
GROUP BY task_id;

-- What a successful task costs, by pool, tenant and hour.
-- fleet_cost_usd: the fleet cost attributed to this tenant's attempts (idle
-- minutes appear under tenant '(idle)', so rows of a pool add up to its fleet
-- cost); waste: cost of attempts that did not complete (failed, retried,
-- cancelled or shed after work), as a share of fleet_cost_usd. A task counts
-- in the hour it ended.
CREATE VIEW IF NOT EXISTS cost_per_successful_task AS
SELECT
    pool,
    tenant,
    hour,
    sum(cost) AS fleet_cost_usd,
    sum(waste) AS waste_cost_usd,
    sum(completed) AS completed_tasks,
    sum(successful) AS successful_tasks,
    sum(successful_cost) AS successful_tasks_cost_usd,
    if(successful_tasks > 0, fleet_cost_usd / successful_tasks, NULL) AS cost_per_successful_task_usd,
    if(successful_tasks > 0, successful_tasks_cost_usd / successful_tasks, NULL) AS attributed_cost_per_successful_task_usd,
    if(completed_tasks > 0, fleet_cost_usd / completed_tasks, NULL) AS cost_per_completed_task_usd,
    if(fleet_cost_usd > 0, waste_cost_usd / fleet_cost_usd, NULL) AS waste_share
FROM
(
    SELECT pool, tenant, toStartOfHour(event_time) AS hour, cost_usd AS cost,
           if(phase != 'completed', cost_usd, 0) AS waste,
           toUInt64(0) AS completed, toUInt64(0) AS successful, toFloat64(0) AS successful_cost
    FROM attempt_cost
    UNION ALL
    SELECT pool, tenant, toStartOfHour(last_event_time), toFloat64(0), toFloat64(0),
           toUInt64(outcome IN ('slo_success', 'late')), toUInt64(outcome = 'slo_success'),
           if(outcome = 'slo_success', cost_usd, 0)
    FROM task_outcomes
    UNION ALL
    SELECT f.pool, '(idle)', toStartOfHour(f.minute), f.fleet_cost_usd, toFloat64(0),
           toUInt64(0), toUInt64(0), toFloat64(0)
    FROM fleet_cost_minute AS f
    LEFT ANTI JOIN
    (
        SELECT DISTINCT pool, minute FROM attempt_cost WHERE work > 0
    ) AS busy ON busy.pool = f.pool AND busy.minute = f.minute
)
GROUP BY pool, tenant, hour;
