"""The cost model (pure): prices, fleet cost, cost per successful task.

Fleet cost counts every replica-second a pool pays for — busy, idle, failed
or retried work alike — because that is what the bill counts. Cost per
successful task divides it by the tasks that finished well.
"""

from __future__ import annotations

from typing import Mapping

# Illustrative on-demand $ per GPU-hour; override or extend with the `gpu_prices` setting.
DEFAULT_GPU_PRICES: dict[str, float] = {
    "H100-80GB": 4.00,
    "H200-141GB": 5.00,
    "B200-192GB": 7.00,
    "A100-80GB": 2.50,
    "L40S-48GB": 1.20,
}


def price_table(overrides: Mapping[str, float]) -> dict[str, float]:
    """Built-in prices with the configured ones on top; fails on a price that is not a positive number."""
    table = dict(DEFAULT_GPU_PRICES)
    for hardware, price in overrides.items():
        if isinstance(price, bool) or not isinstance(price, (int, float)) or price < 0:
            raise ValueError(f"gpu_prices[{hardware!r}] must be a non-negative number, got {price!r}")
        table[hardware] = float(price)
    return table


def gpu_seconds_cost(gpu_seconds: float, price_per_gpu_hour: float) -> float:
    return gpu_seconds * price_per_gpu_hour / 3600.0


def cost_per_successful_task(fleet_cost: float, successful_tasks: int) -> float | None:
    """None when no task succeeded (the cost is then unbounded, not zero)."""
    return fleet_cost / successful_tasks if successful_tasks else None
