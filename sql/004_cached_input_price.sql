-- Cached prompt tokens are charged a share of an uncached one's cost
-- (the `cached_input_cost_share` setting, mirrored into sluice_config; 0 when
-- the row is missing, which is how 002 priced them). An attempt's share of
-- its pool-minute's fleet cost is in proportion to its work: uncached prompt
-- tokens, cached ones × that share, output tokens.

-- Each terminal attempt's tokens and work, defined once for the views below.
CREATE OR REPLACE VIEW attempt_work AS
SELECT
    task_id, request_id, attempt, task_final, tenant, priority, pool, phase, event_time,
    toStartOfMinute(event_time) AS minute, ttft_s, slo_ttft_s,
    toFloat64(ifNull(input_tokens, 0)) AS input,
    least(toFloat64(ifNull(cached_input_tokens, 0)), input) AS cached,
    toFloat64(ifNull(output_tokens, 0)) AS output,
    (SELECT any(value) FROM sluice_config FINAL WHERE name = 'cached_input_cost_share') AS cached_share,
    input - cached + cached * cached_share + output AS work
FROM request_events
WHERE phase IN ('completed', 'failed', 'rejected', 'cancelled');

CREATE OR REPLACE VIEW attempt_cost AS
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
FROM attempt_work AS a
LEFT JOIN (SELECT pool, minute, sum(work) AS work FROM attempt_work GROUP BY pool, minute) AS w
    ON w.pool = a.pool AND w.minute = a.minute
LEFT JOIN fleet_cost_minute AS f ON f.pool = a.pool AND f.minute = a.minute;

-- What the prefix caches saved, by pool and hour: each minute, the cost the
-- cached prompt tokens would have added had they been prefilled (their
-- discount × the minute's fleet cost per unit of work), and the cached share.
CREATE OR REPLACE VIEW cache_savings AS
SELECT
    w.pool AS pool,
    toStartOfHour(w.minute) AS hour,
    sum(w.input_tokens) AS input_tokens,
    sum(w.cached_tokens) AS cached_input_tokens,
    sum(if(w.work > 0, ifNull(f.fleet_cost_usd, 0) * w.cached_tokens * (1 - w.share) / w.work, 0)) AS saved_usd
FROM
(
    SELECT pool, minute, sum(input) AS input_tokens, sum(cached) AS cached_tokens, any(cached_share) AS share,
           sum(work) AS work
    FROM attempt_work
    GROUP BY pool, minute
) AS w
LEFT JOIN fleet_cost_minute AS f ON f.pool = w.pool AND f.minute = w.minute
GROUP BY pool, hour;
