"""Fair shares between tenants: which tenants offer more than their weighted share of the pool, and how far
their own lower classes must be shed to bring them back to it. Pure.

Shedding by priority class alone makes every tenant of a class pay for one tenant's burst. The pool's
shed level decides *how much* is admitted (its feed-forward, trim and proportional parts, unchanged);
fairness decides *whose*: what that level admits is split by **weighted max-min fairness** over the tenants'
offered rates — a tenant offering less than its weighted share keeps everything it offers, what it leaves is
split among the rest by weight. A tenant the pool's level would admit more than its share of gets a
**tenant shed level** on the same scale (deferrable, then sheddable, then standard), just high enough for
its own work to fit its share, and what that sheds beyond the pool's level is given back to everyone else
by a lower level for the rest. So a tenant within its share is not shed for another's burst while the pool
has capacity for its work, and with every tenant alike nothing changes. A tenant level never sheds critical
work below the pool's level (it stops at ``CRITICAL_LINE``): critical work over the pool's capacity is
shed by the pool's level, in the order the signal contract promises, not by whose it is.

The ``(other)`` row (every tenant beyond the picture's largest) is no tenant a router can match: it counts
toward the shares but is shed only by the pool's level.
"""

from __future__ import annotations

import math
from typing import Any, Collection, Mapping, Sequence

from ..load.aggregates import IDENTIFIER

SHED_ORDER = ("deferrable", "sheddable", "standard", "critical")
CRITICAL_LINE = float(len(SHED_ORDER) - 1)   # the level at which critical's new work starts being shed
MAX_LISTED = 16          # tenants a signal lists (admission_signal.v1's maxItems)


def fit_level(rates: Sequence[float], budget: float, top: float) -> float:
    """The smallest shed level at which ``rates`` (per class, in SHED_ORDER) fit ``budget``, at most ``top``."""
    if sum(rates) <= budget:
        return 0.0
    for i, rate in enumerate(rates):
        rest = sum(rates[i + 1:])
        if rest <= budget:
            return min(top, i + 1.0 - (budget - rest) / rate)
    return top


def fair_shares(offered: Mapping[str, float], weights: Mapping[str, float], default_weight: float,
                budget: float) -> dict[str, float]:
    """Weighted max-min fair shares of ``budget``: whoever asks for less than its share gets what it asks,
    the rest split what remains by weight."""
    shares: dict[str, float] = {}
    pending = {t: o for t, o in offered.items() if o > 0}
    left = max(0.0, budget)
    while pending:
        unit = left / sum(weights.get(t, default_weight) for t in pending)
        within = {t: o for t, o in pending.items() if o <= unit * weights.get(t, default_weight)}
        if not within:
            shares.update({t: unit * weights.get(t, default_weight) for t in pending})
            break
        for tenant, asked in within.items():
            shares[tenant] = asked
            left -= asked
            del pending[tenant]
    return shares


def tenant_rates(tenants: Sequence[Mapping[str, Any]], pool_offered: Mapping[str, float]) -> dict[str, list[float]]:
    """Each tenant row's offered attempts/s per class (SHED_ORDER), scaled per class so that the rows never
    add up to more than the pool offers: the rows come from partials any worker can write, and phantom
    rows beyond the pool's own counts would shrink every real tenant's share. A row without per-class
    counts (partials from older workers) takes the pool's class mix."""
    total = sum(pool_offered.values())
    out = {}
    for row in tenants:
        by_class = row.get("offered_rps_by_class")
        if by_class:
            out[row["tenant"]] = [float(by_class[c]) for c in SHED_ORDER]
        else:
            share = float(row["offered_rps"]) / total if total else 0.0
            out[row["tenant"]] = [float(pool_offered.get(c, 0.0)) * share for c in SHED_ORDER]
    for i, name in enumerate(SHED_ORDER):
        claimed = sum(rates[i] for rates in out.values())
        if claimed > pool_offered.get(name, 0.0):
            scale = pool_offered.get(name, 0.0) / claimed
            for rates in out.values():
                rates[i] *= scale
    return out


def class_share(level: float, i: int) -> float:
    """What a shed level admits of class ``i`` of SHED_ORDER (critical floor aside): a class starts shedding
    once every class before it admits nothing."""
    return min(1.0, max(0.0, 1.0 - (level - i)))


def admitted_at(rates: Sequence[float], level: float) -> float:
    """Attempts/s a shed level admits of ``rates`` (per class, SHED_ORDER), critical floor aside."""
    return sum(rate * class_share(level, i) for i, rate in enumerate(rates))


def wanted_levels(by_tenant: Mapping[str, Sequence[float]], pool_offered: Mapping[str, float], pool_level: float,
                  weights: Mapping[str, float], default_weight: float, tolerance: float, sigmas: float,
                  window_s: float, listed: Collection[str] = ()) -> dict[str, float]:
    """Tenant shed levels that bring each tenant that the pool's level would admit more than its fair
    share of back to that share. The budget shared is what the pool's level admits: fairness decides whose
    work is admitted, the pool's level how much.

    What the pool's level would admit of a tenant over a ``window_s`` window is a count, with the count's
    noise: with every tenant alike, some tenant is always a little over its share. So a tenant is listed
    only when over its share by more than ``tolerance`` plus ``sigmas`` standard deviations of that count
    (1/√n of it), and stays listed while over by half that (hysteresis), so tenants alike are not listed
    and dropped with the noise."""
    if pool_level <= 0:
        return {}
    budget = admitted_at([pool_offered[c] for c in SHED_ORDER], pool_level)
    floor = shared_level(pool_level)
    asked = {name: admitted_at(rates, floor) for name, rates in by_tenant.items()}
    shares = fair_shares(asked, weights, default_weight, budget)
    out = {}
    for name, rates in by_tenant.items():
        admitted = admitted_at(rates, pool_level)
        margin = tolerance + sigmas / math.sqrt(max(1.0, admitted * window_s))   # the count compared is this one
        if name in listed:
            margin /= 2
        # a name the signal's schema refuses would make routers refuse every signal of the pool: such names
        # are refused with their partials already; never listed, whatever reaches here
        if not IDENTIFIER.match(name) or admitted <= shares.get(name, 0.0) * (1 + margin):
            continue
        out[name] = max(pool_level, fit_level(rates, shares[name], max(CRITICAL_LINE, pool_level)))
    return out


def shared_level(pool_level: float) -> float:
    """The part of the pool's level every tenant shares: deferral. Deferrable work is delayed within its own
    long SLO, not lost, so the pool defers everyone's alike and fairness only decides whose work is
    *rejected* (rejecting a bursting tenant's standard work to admit others' deferrable work at once would
    lose tasks and gain none)."""
    return min(pool_level, 1.0)


def level_for_the_rest(by_tenant: Mapping[str, Sequence[float]], pool_offered: Mapping[str, float], pool_level: float,
                       levels: Mapping[str, float], top: float) -> float:
    """The shed level for every tenant not listed: what the listed tenants' own levels shed beyond the
    pool's level is given back to the rest (never a level above the pool's)."""
    listed = [name for name in by_tenant if levels.get(name, 0.0) > pool_level]
    if not listed:
        return pool_level
    floor = shared_level(pool_level)
    pool_rates = [pool_offered[c] for c in SHED_ORDER]
    budget = admitted_at(pool_rates, pool_level)
    rest = list(pool_rates)
    for name in listed:
        rates = by_tenant[name]
        budget -= admitted_at(rates, levels[name])
        rest = [r - t for r, t in zip(rest, rates)]
    return min(pool_level, max(floor, fit_level([max(0.0, r) for r in rest], max(0.0, budget), top)))


MIN_TENANT_FINISHED = 10   # fewer finished attempts in the window than this say nothing about a tenant's work
MAX_WORK_RATIO = 2.0       # how far the tenants' work per request may move the requests/s ceiling, either way


def admitted_work_ratio(rows: Sequence[Mapping[str, Any]], window_s: float) -> float:
    """How many times the work of a request admitted is that of one offered (1.0 where unknown), from each
    tenant's work per request: the seconds its finished attempts spent in service over the window.

    Fair shares change *whose* requests are admitted, and the demand axis's ceiling counts requests. A
    tenant's requests differ from another's, so shedding a heavy tenant and admitting lighter work in its
    place at the same requests/s left the fleet under-filled (the KV cache at 0.54–0.67 of its limit against
    0.63–0.81 without fairness). The ceiling stands for how many requests the fleet can hold at once (its
    batch slots and KV cache), and requests held = requests/s × the time each is held; so work is time in
    service (duration less queue time, prefill and decode). Counted in tokens instead (session 43), the
    noisy neighbour's requests read 2% heavier than the others' where they spent 38% longer in service
    (9.4 s against 6.8 s: longer outputs), and the fleet stayed under-filled. Time in service grows with the
    batch for every tenant alike, which the ratio cancels. A tenant with fewer than ``MIN_TENANT_FINISHED``
    finished attempts in the window counts at the pool's mean; the ratio is bounded by ``MAX_WORK_RATIO``
    either way (the rows come from partials).
    """
    read = [(float(row["offered_rps"]), float(row["admitted_rps"]), float(row.get("finished_rps", 0.0)),
             float(row.get("service_s_per_s", 0.0))) for row in rows]
    finished, service = sum(r[2] for r in read), sum(r[3] for r in read)
    if not (finished * window_s >= MIN_TENANT_FINISHED and service > 0):   # NaN fails both
        return 1.0
    mean = service / finished
    # (offered, admitted, seconds in service a request) per row
    rates = [(o, a, s / done if done * window_s >= MIN_TENANT_FINISHED else mean) for o, a, done, s in read]
    offered, admitted = sum(r[0] for r in rates), sum(r[1] for r in rates)
    # (admitted work ÷ admitted) ÷ (offered work ÷ offered), as one quotient: either mean alone can underflow
    over = sum(a * w for _, a, w in rates) * offered
    under = sum(o * w for o, _, w in rates) * admitted
    ratio = over / under if under > 0 else math.nan
    return min(max(ratio, 1.0 / MAX_WORK_RATIO), MAX_WORK_RATIO) if math.isfinite(ratio) and ratio > 0 else 1.0
