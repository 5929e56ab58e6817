"""Who the load is: offered and admitted attempts per tenant over the picture's fast window.

The first reading fair shares between tenants need (issue 16): a noisy neighbour shows as the tenant whose
offered rate leads while its admitted share falls. Bounded twice: stage 1 counts at most MAX_TENANTS names
per pool-second (the rest as ``(other)``), and the picture lists the MAX_PICTURE_TENANTS largest by offered
load with the rest added into one ``(other)`` row.
"""

from __future__ import annotations

from typing import Any

from ..events import PRIORITIES
from .aggregates import OTHER_TENANTS, TENANT_CLASS_AT, TENANT_WORK_AT, RequestAgg
from .axes import finite

MAX_PICTURE_TENANTS = 16


def tenant_load(requests: RequestAgg, fast_s: float) -> list[dict[str, Any]]:
    """The largest tenants by offered attempts/s, then ``(other)`` for everyone else (if anyone)."""
    named = sorted(((n, c) for n, c in requests.tenants.items() if n != OTHER_TENANTS),
                   key=lambda item: (-item[1][0], item[0]))
    rest = [c for _, c in named[MAX_PICTURE_TENANTS:]]
    if OTHER_TENANTS in requests.tenants:
        rest.append(requests.tenants[OTHER_TENANTS])
    rows = [(name, counts) for name, counts in named[:MAX_PICTURE_TENANTS]]
    if rest:
        rows.append((OTHER_TENANTS, [sum(column) for column in zip(*rest)]))
    return [_row(name, counts, fast_s) for name, counts in rows]


def _row(name: str, counts: list[int], fast_s: float) -> dict[str, Any]:
    row = {"tenant": name, "offered_rps": finite(counts[0] / fast_s), "admitted_rps": finite(counts[1] / fast_s)}
    by_class = {c: counts[TENANT_CLASS_AT[c]] for c in PRIORITIES}
    if any(by_class.values()):   # partials from workers before the per-class counts carry none
        row["offered_rps_by_class"] = {c: finite(n / fast_s) for c, n in by_class.items()}
    finished, service_ms = counts[TENANT_WORK_AT:TENANT_WORK_AT + 2]
    if finished:   # a tenant's work per request: the seconds its finished attempts spent in service
        row["finished_rps"] = finite(finished / fast_s)
        row["service_s_per_s"] = finite(service_ms / 1000 / fast_s)
    return row
