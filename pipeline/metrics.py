"""Every Prometheus metric Sluice exports: names, labels and help text in one place.

Labels are bounded: topic, table, reason, axis, class, state, and pool — pool
names come from data, so at most ``MAX_POOL_LABELS`` distinct ones are used
and the rest are reported as ``other``. Never task or request ids.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)
MAX_POOL_LABELS = 256
_pools_seen: set[str] = set()


def pool_label(pool: str) -> str:
    """The pool's own name while fewer than MAX_POOL_LABELS pools are labelled, else ``other``."""
    if pool in _pools_seen:
        return pool
    if len(_pools_seen) < MAX_POOL_LABELS:
        _pools_seen.add(pool)
        return pool
    return "other"


EVENTS_ACCEPTED = Counter("sluice_events_accepted_total", "Events that passed validation and landed, by source topic.",
                          ["topic"], registry=REGISTRY)
EVENTS_DEAD_LETTERED = Counter("sluice_events_dead_lettered_total",
                               "Events the landing path dead-lettered (landed in dead_letters), by source topic and reason.",
                               ["topic", "reason"], registry=REGISTRY)
INGEST_BATCH_SECONDS = Histogram("sluice_ingest_batch_seconds",
                                 "Time to decode, dead-letter and fold one control-path batch.",
                                 ["topic"],
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                                 registry=REGISTRY)
DEAD_LETTERS_UNLANDABLE = Counter("sluice_dead_letters_unlandable_total",
                                  "Dead-letter rows the store refused (they stay on the dead-letter topic).",
                                  registry=REGISTRY)
SINK_ROWS = Counter("sluice_sink_rows_total", "Rows landed in ClickHouse, by table.", ["table"], registry=REGISTRY)
ROLLUPS = Counter("sluice_sink_rollups_total",
                  "Rollups of landed request events into pool_minute, by outcome: ok; failed (the store kept "
                  "refusing one while it answered queries; it is tried again as it was); fenced (another owner "
                  "had rolled up some of its offsets: planned again).",
                  ["outcome"], registry=REGISTRY)
for _outcome in ("ok", "failed", "fenced"):   # each at 0 from the start: a refusal shows as a rate, not as a new series
    ROLLUPS.labels(_outcome)
EVENTS_DUPLICATE = Counter("sluice_events_duplicate_total",
                           "Events dropped before landing because the same event_id was seen recently "
                           "in the same partition (a producer retry).", ["topic"], registry=REGISTRY)
EVENTS_ALREADY_LANDED = Counter("sluice_events_already_landed_total",
                                "Records the landing path skipped after an assignment because the store "
                                "already held their offsets (a replay after a crash, a rebalance or an "
                                "offset reset).", ["topic"], registry=REGISTRY)
LANDING_LAG_SECONDS = Histogram("sluice_landing_lag_seconds",
                                "Event time of a block's oldest event to the block being queryable.", ["table"],
                                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60, 300),
                                registry=REGISTRY)
SINK_RETRIES = Counter("sluice_sink_retries_total", "Inserts retried because the store was unavailable.",
                       ["table"], registry=REGISTRY)
SINK_HELD = Gauge("sluice_sink_held", "1 while the sink holds a batch back because the store is unavailable.",
                  ["table"], registry=REGISTRY)
PRODUCER_WAIT = Gauge("sluice_worker_producer_wait_seconds",
                      "How long the worker's oldest wait on its Kafka producer still going on has lasted (0: none); "
                      "past producer_stall_s /healthz names it (the broker is slow or away).", registry=REGISTRY)
CUT_WAIT = Gauge("sluice_control_cut_wait_seconds",
                 "How long the control path's cut still going on has waited (0: none), for its lock, the group "
                 "commit or its partials' send; past producer_stall_s /healthz names it: its partitions' "
                 "events reach no picture until it ends.", registry=REGISTRY)
NEWEST_EVENT_TIME = Gauge("sluice_newest_event_time_seconds",
                          "Event time of the newest accepted event, by source topic (Unix seconds).",
                          ["topic"], registry=REGISTRY)


def count_dead_letters(topic: str, reasons: dict[str, int]) -> None:
    for reason, count in reasons.items():
        EVENTS_DEAD_LETTERED.labels(topic, reason).inc(count)


def exposition() -> bytes:
    return generate_latest(REGISTRY)

PARTIALS_PUBLISHED = Counter("sluice_partials_published_total", "Per-pool partials stage 1 published.",
                             registry=REGISTRY)
PARTIALS_MERGED = Counter("sluice_partials_merged_total", "Partials stage 2 merged into pictures.",
                          registry=REGISTRY)
POOLS_REFUSED = Counter("sluice_pools_refused_total",
                        "Partials of new pools refused because the controller tracks max_pools already.",
                        registry=REGISTRY)
POOLS_FORGOTTEN = Counter("sluice_pools_forgotten_total", "Pools forgotten after pool_idle_s without an event.",
                          registry=REGISTRY)
PARTIALS_REFUSED = Counter("sluice_partials_refused_total",
                           "Partials stage 2 ignored because their events are ahead of its clock.", registry=REGISTRY)
PARTIALS_AHEAD = Counter("sluice_partials_ahead_of_clock_total",
                         "Partials stage 2 merged with times over a second ahead of its clock (their worker's "
                         "clock runs fast, within max_clock_skew_s): the pool's watermark is held at the clock.",
                         registry=REGISTRY)
PARTIALS_DUPLICATE = Counter("sluice_partials_duplicate_total",
                             "Redelivered partials stage 2 recognised by id and skipped.", registry=REGISTRY)
PARTIALS_REREAD = Counter("sluice_partials_reread_total",
                          "Partials a rebuild merged from the partials topic that the changelog table lacked: "
                          "a backlog not yet merged at the rebalance, or records the stream skipped.",
                          registry=REGISTRY)
REREAD_INCOMPLETE = Counter("sluice_rebuild_reread_incomplete_total",
                            "Rebuilds whose re-read of the partials topic failed or timed out (rebuilt from "
                            "the table and what was read).", registry=REGISTRY)
PICTURE_LAG = Histogram("sluice_picture_lag_seconds",
                        "Newest folded event time to picture publication (wall clock), by pool.",
                        buckets=(0.05, 0.1, 0.15, 0.2, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30), registry=REGISTRY)
POOL_PRESSURE = Gauge("sluice_pool_pressure", "Pool pressure: the largest axis pressure (1.0 = at the limit).",
                      ["pool"], registry=REGISTRY)
POOL_AXIS_PRESSURE = Gauge("sluice_pool_axis_pressure", "Axis value divided by its limit, by pool and axis.",
                           ["pool", "axis"], registry=REGISTRY)
POOL_AXIS_VALUE = Gauge("sluice_pool_axis_value", "Raw axis value in the axis's unit, by pool and axis.",
                        ["pool", "axis"], registry=REGISTRY)
POOL_PREFIX_HIT_RATE = Gauge("sluice_pool_prefix_cache_hit_rate",
                             "Prefix-cache tokens found / looked up over the fast window, from the replicas' "
                             "counters (NaN: nothing looked up).", ["pool"], registry=REGISTRY)
POOL_CACHED_INPUT_SHARE = Gauge("sluice_pool_cached_input_share",
                                "Cached input tokens / input tokens of the attempts that finished over the fast "
                                "window (NaN: none).", ["pool"], registry=REGISTRY)
POOL_LATE_EVENTS = Gauge("sluice_pool_late_events", "Events left out of the picture as too late, by pool.",
                         ["pool"], registry=REGISTRY)

DECISION_LATENCY = Histogram("sluice_decision_latency_seconds",
                             "Event time of a pool's newest input to its admission signal being published.",
                             ["pool"], buckets=(0.05, 0.1, 0.15, 0.2, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10), registry=REGISTRY)
ADMISSION_STATE = Gauge("sluice_admission_state", "1 for the pool's current admission state, 0 for the others.",
                        ["pool", "state"], registry=REGISTRY)
ADMIT_FRACTION = Gauge("sluice_admit_fraction", "Share of new work admitted, by pool and priority class.",
                       ["pool", "class"], registry=REGISTRY)
TENANTS_LISTED = Gauge("sluice_pool_tenants_over_share",
                       "Tenants the pool's signal lists as over their fair share, shed by their own fractions "
                       "(admission/tenant_shares; the names are in the signal, not in labels: tenant names come "
                       "from events).", ["pool"], registry=REGISTRY)
SERVING_CAPACITY = Gauge("sluice_pool_serving_capacity_rps",
                         "Requests/s the admission policy budgets for the pool: the profile's figure, or less while "
                         "a standing queue shows the replicas serve less (admission/policy.serving_capacity).",
                         ["pool"], registry=REGISTRY)
SIGNALS_PUBLISHED = Counter("sluice_admission_signals_published_total", "Signed admission signals published.",
                            ["pool"], registry=REGISTRY)

ROUTER_HOOK_SECONDS = Histogram("sluice_router_hook_seconds",
                                "Time a gateway hook (LiteLLM) adds to a call before it is sent: verdict and "
                                "event hand-off.", buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3),
                                registry=REGISTRY)
ROUTER_HOOK_ERRORS = Counter("sluice_router_hook_errors_total",
                             "Errors inside a gateway hook; the call went on without Sluice's verdict.",
                             registry=REGISTRY)
ROUTER_EVENTS_DROPPED = Counter("sluice_router_events_dropped_total",
                                "RequestEvents a router's emitter dropped: its buffer was full, or the event could "
                                "not be encoded, or the broker refused it or did not acknowledge it in time.",
                                registry=REGISTRY)
ROUTER_EMITTER_RESTARTS = Counter("sluice_router_emitter_producer_restarts_total",
                                  "Kafka producers a router's emitter replaced: its sender had stopped, it left "
                                  "events unacknowledged past the emitter's delivery timeout, or the broker refused "
                                  "it in a way every later batch would be (an out-of-order sequence).",
                                  registry=REGISTRY)

ROUTER_FOLLOW_ERRORS = Counter("sluice_router_follow_errors_total",
                               "Errors a router met following the admission topic (it backs off and reads "
                               "the topic again from the beginning).", registry=REGISTRY)

CONTROL_EVENTS = Counter("sluice_control_events_total",
                         "Raw events the control path handled, by topic and outcome (folded, dead_lettered, duplicate).",
                         ["topic", "outcome"], registry=REGISTRY)
POOL_STEP_FAILURES = Counter("sluice_pool_step_failures_total",
                             "Ticks at which one pool's picture or decision raised: that pool got no signal, "
                             "the others went on (the worker's log names the pool and the error).", registry=REGISTRY)
CONTROL_EVENTS_AHEAD = Counter("sluice_control_events_ahead_of_clock_total",
                               "Events the control path folded as of its own clock because their event_time was "
                               "ahead of it (a fast clock at their source), by topic.", ["topic"], registry=REGISTRY)
LANDING_CONSUMER_LAG = Gauge("sluice_landing_consumer_lag_records",
                             "Records the landing path has yet to read, by topic.", ["topic"], registry=REGISTRY)
CONSUMER_LAG = Gauge("sluice_consumer_lag_records", "Records the control path has yet to read, by raw topic.", ["topic"],
                     registry=REGISTRY)
SINK_BATCH_SECONDS = Histogram("sluice_sink_batch_seconds", "Time to land one batch in ClickHouse, retries included.",
                               ["table"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                               registry=REGISTRY)
REQUESTS_COMPLETED = Counter("sluice_requests_completed_total", "Completed request attempts, by pool.", ["pool"],
                             registry=REGISTRY)
TTFT_SLO_MISSES = Counter("sluice_ttft_slo_misses_total",
                          "Completed attempts whose time to first token exceeded their SLO, by pool.", ["pool"],
                          registry=REGISTRY)
POOL_COST_PER_TASK = Gauge("sluice_pool_cost_per_successful_task_dollars",
                           "Fleet cost (every replica-second) divided by successful tasks over the cost window.",
                           ["pool"], registry=REGISTRY)
POOL_GOODPUT = Gauge("sluice_pool_goodput_tasks_per_second", "Successful tasks per second over the cost window.",
                     ["pool"], registry=REGISTRY)
POOL_RETRY_AMPLIFICATION = Gauge("sluice_pool_retry_amplification",
                                 "Attempts per request over the fast window (1.0 = no retries).", ["pool"],
                                 registry=REGISTRY)
POOL_PREEMPTIONS = Gauge("sluice_pool_preemptions_per_second_per_replica",
                         "KV-cache preemptions per second per fresh replica, fast window.", ["pool"], registry=REGISTRY)
POOL_STALE_REPLICAS = Gauge("sluice_pool_stale_replicas", "Replicas with no sample for replica_stale_after_s.",
                            ["pool"], registry=REGISTRY)

_faust_metrics = None


def attach_faust_sensors(app) -> None:
    """Faust's own sensors (messages, streams, tables, commits) into this registry, once per process."""
    global _faust_metrics
    from faust.sensors.prometheus import FaustMetrics, PrometheusMonitor

    if _faust_metrics is None:
        _faust_metrics = FaustMetrics.create(REGISTRY, "sluice_faust")
    app.monitor = PrometheusMonitor(metrics=_faust_metrics)
