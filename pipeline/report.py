"""``sluice report``: per pool, what the fleet delivered and what a successful task cost.

One read-only statement over the per-minute aggregates and the cost view, so
it goes through the same path as ``sluice query`` (the worker's endpoint for
the embedded store, or the server).
"""

from __future__ import annotations

from typing import Any

from .query_client import run_query
from .settings import Settings

LEVELS = (0.5, 0.95, 0.99)


def report_sql(since_hours: float | None = None) -> str:
    """Latency and SLO figures from ``pool_minute``, cost from ``cost_per_successful_task``, the prefix caches'
    share of prompt tokens and their saving from ``cache_savings``, joined by pool."""
    minute_filter = f"WHERE minute >= now() - toIntervalSecond({int(since_hours * 3600)})" if since_hours else ""
    hour_filter = (f"WHERE hour >= toStartOfHour(now() - toIntervalSecond({int(since_hours * 3600)}))"
                   if since_hours else "")
    levels = ", ".join(str(q) for q in LEVELS)
    return f"""
SELECT
    l.pool AS pool,
    l.requests AS requests,
    round(l.completed / l.requests, 4) AS success_rate,
    round(l.ttft[1], 3) AS ttft_p50_s, round(l.ttft[2], 3) AS ttft_p95_s, round(l.ttft[3], 3) AS ttft_p99_s,
    round(l.tpot[1], 4) AS tpot_p50_s, round(l.tpot[2], 4) AS tpot_p95_s, round(l.tpot[3], 4) AS tpot_p99_s,
    round(if(l.completed > 0, l.ttft_met / l.completed, NULL), 4) AS ttft_slo_attainment,
    c.completed_tasks AS completed_tasks,
    c.successful_tasks AS slo_successful_tasks,
    round(c.fleet_cost_usd, 2) AS fleet_cost_usd,
    round(if(c.successful_tasks > 0, c.fleet_cost_usd / c.successful_tasks, NULL), 4) AS cost_per_successful_task_usd,
    round(if(c.fleet_cost_usd > 0, c.waste_cost_usd / c.fleet_cost_usd, NULL), 4) AS waste_share,
    round(if(s.input_tokens > 0, s.cached_input_tokens / s.input_tokens, NULL), 4) AS cache_hit_share,
    round(if(c.successful_tasks > 0, s.saved_usd / c.successful_tasks, NULL), 6) AS cache_saved_per_successful_task_usd
FROM
(
    SELECT pool, sum(requests) AS requests, sum(completed) AS completed, sum(ttft_slo_met) AS ttft_met,
           quantilesBFloat16Merge({levels})(ttft_state) AS ttft, quantilesBFloat16Merge({levels})(tpot_state) AS tpot
    FROM pool_minute {minute_filter}
    GROUP BY pool
) AS l
LEFT JOIN
(
    SELECT pool, sum(fleet_cost_usd) AS fleet_cost_usd, sum(waste_cost_usd) AS waste_cost_usd,
           sum(completed_tasks) AS completed_tasks, sum(successful_tasks) AS successful_tasks
    FROM cost_per_successful_task {hour_filter}
    GROUP BY pool
) AS c ON c.pool = l.pool
LEFT JOIN
(
    SELECT pool, sum(input_tokens) AS input_tokens, sum(cached_input_tokens) AS cached_input_tokens,
           sum(saved_usd) AS saved_usd
    FROM cache_savings {hour_filter}
    GROUP BY pool
) AS s ON s.pool = l.pool
ORDER BY pool"""


def pool_report(settings: Settings, since_hours: float | None = None, url: str | None = None) -> list[dict[str, Any]]:
    rows, _ = run_query(settings, report_sql(since_hours), url)
    return rows
