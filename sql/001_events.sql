-- Raw events as they were accepted by stage 1, one row per event.
-- Duplicated deliveries are dropped twice over: a re-sent batch by its
-- insert_deduplication_token (the deduplication window), a re-sent event by
-- ReplacingMergeTree on its sorting key, which ends in event_id (read with FINAL
-- for exact counts before background merges).

CREATE TABLE IF NOT EXISTS request_events
(
    event_id            UUID,
    event_time          DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
    task_id             String,
    request_id          String,
    attempt             UInt16,
    task_final          Nullable(Bool),
    tenant              LowCardinality(String),
    priority            LowCardinality(String),
    pool                LowCardinality(String),
    model               LowCardinality(String),
    phase               LowCardinality(String),
    replica_id          LowCardinality(Nullable(String)),
    input_tokens        Nullable(UInt32),
    cached_input_tokens Nullable(UInt32),
    output_tokens       Nullable(UInt32),
    queue_s             Nullable(Float64),
    ttft_s              Nullable(Float64),
    tpot_s              Nullable(Float64),
    duration_s          Nullable(Float64),
    error_type          LowCardinality(Nullable(String)),
    slo_ttft_s          Nullable(Float64),
    slo_tpot_s          Nullable(Float64),
    source_partition    UInt16,
    source_offset       UInt64,
    landed_at           DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(event_time)
ORDER BY (pool, phase, toStartOfHour(event_time), event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS replica_samples
(
    event_id                   UUID,
    event_time                 DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
    replica_id                 LowCardinality(String),
    pool                       LowCardinality(String),
    hardware                   LowCardinality(String),
    gpu_count                  UInt8,
    requests_running           UInt32 CODEC(T64, ZSTD(1)),
    requests_waiting           UInt32 CODEC(T64, ZSTD(1)),
    kv_cache_usage             Float32 CODEC(Gorilla, ZSTD(1)),
    preemptions_total          Float64 CODEC(Gorilla, ZSTD(1)),
    prompt_tokens_total        Float64 CODEC(Gorilla, ZSTD(1)),
    generation_tokens_total    Float64 CODEC(Gorilla, ZSTD(1)),
    prefix_cache_hits_total    Float64 CODEC(Gorilla, ZSTD(1)),
    prefix_cache_queries_total Float64 CODEC(Gorilla, ZSTD(1)),
    gpu_util                   Nullable(Float32),
    fb_used_mib                Nullable(Float32),
    power_w                    Nullable(Float32),
    healthy                    Bool,
    source_partition           UInt16,
    source_offset              UInt64,
    landed_at                  DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(event_time)
ORDER BY (pool, replica_id, event_time, event_id)
SETTINGS non_replicated_deduplication_window = 10000;
