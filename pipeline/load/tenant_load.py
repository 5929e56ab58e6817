"""Who the load is: offered and admitted attempts per tenant over the picture's fast window.

The first reading fair shares between tenants need (issue 16): a noisy neighbour shows as the tenant whose
offered rate leads while its admitted share falls. Bounded twice: stage 1 counts at most MAX_TENANTS names
per pool-second (the rest as ``(other)``), and the picture lists the MAX_PICTURE_TENANTS largest by offered
load with the rest added into one ``(other)`` row.
"""

from __future__ import annotations

from typing import Any

from .aggregates import OTHER_TENANTS, RequestAgg
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
        rows.append((OTHER_TENANTS, [sum(c[0] for c in rest), sum(c[1] for c in rest)]))
    return [{"tenant": name, "offered_rps": finite(received / fast_s), "admitted_rps": finite(admitted / fast_s)}
            for name, (received, admitted) in rows]
