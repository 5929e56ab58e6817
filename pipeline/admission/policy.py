"""The admission policy: (picture, previous decision, config, now) → decision. Pure.

**State** follows the pool's *admission pressure* — the largest pressure among
``axes`` (all but cost by default) — with hysteresis: a state is entered at its
``enter`` threshold and left only below its lower ``leave`` threshold, and
only after ``dwell_s`` in it (escalation is immediate: overload does not wait).

**Shedding** is one continuous *shed level* L in [0, 4 − critical_floor]
over the classes in shedding order deferrable → sheddable → standard →
critical: class i admits ``clamp(1 − (L − i), 0, 1)``. So a class starts
shedding only once every class before it admits nothing, and critical is
never shed while a lower class is still admitted. L has two parts:

- a **feed-forward** level: the smallest L at which the offered work (every
  attempt per class, retries of shed work included, from the demand axis)
  fits ``feed_forward_utilisation`` × the pool's serving capacity — so a
  spike is met within one window, not after an integrator has wound up, and
  shed work that comes back is budgeted like new work instead of riding on
  top of the admitted rate. The capacity is the profile's requests/s, or
  what the pool completes per second while a standing queue shows it serves
  less (heavier requests than the profile was measured on), relaxed back
  while the fleet shows headroom (``serving_capacity``);
- a **proportional** part, ``proportional`` × (pressure − ``target_pressure``)
  while pressure is above target: immediate, and gone when pressure falls;
- a **trim** that integrates the admission pressure above
  ``target_pressure`` (at most ``max_step_up`` per tick) and gives back
  ``step_down`` per tick below ``recover_pressure`` — slowly, for what
  capacity figures miss (a KV cache that binds first, a slower replica).
  The pictures it reads average over ``fast_window_s``; a faster trim
  overshoots that lag and oscillates (measured in the fleet simulator).
  It integrates up only while the fleet is busy (``windup_utilisation``: the
  admitted rate, KV cache or compute at that share of its limit): pressure
  that admitted work is not causing — a lagging latency axis, a replica
  just lost — would otherwise wind the level up while the fleet sits idle.
  Nor while the leading axes read under ``recover_pressure`` and the queue
  is measured empty: a latency still over its limit then is the window
  remembering a shock that is over (docs/simulator.md, change 14).
  It also stands still while the level cannot follow it — where the level
  would go is past its bounded step (walking down after a spike, or held
  at the top) — unless the reversal deadband is what holds the level, where
  only the trim can carry a turn past it: a trim that unwound while the
  level walked down carried the level past what the pool takes, and the
  shed work waiting came back as a wave.

The level itself moves at most ``level_step_up`` / ``level_step_down`` per
tick, and turns back (shed less after shedding more, or the reverse) only by
more than ``reversal_deadband``: the proportional part passes a picture's
noise straight through, and a level that saws by a few hundredths every tick
admits, sheds and admits the same work again (docs/admission-signal.md,
flapping). Tasks already under way shed ``continuing_credit`` levels later;
a later step the router sends back to the replica holding its context (a
*warm* step) up to ``warm_credit`` levels later still, in proportion to what
the cache saves on the pool's binding resource (``cache_relief``).

A **stale** picture (no new event for ``stale_after_s``) keeps the last
decision for ``stale_hold_s`` (fail-static), then relaxes L toward zero in
the same bounded steps (fail-open) and drops the stale picture's predicted
wait (to 0: no early rejection) and retry-budget tightening at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Sequence

from ..events import PRIORITIES
from ..load.picture import pressure
from .signing import MAX_VALIDITY_S
from .tenant_shares import (CRITICAL_LINE, MAX_LISTED, SHED_ORDER, admitted_work_ratio, class_share, fit_level,
                            level_for_the_rest, shared_level, tenant_rates, wanted_levels)

STATES = ("ok", "pressured", "overloaded", "critical")
MAX_RETRY_AFTER_S = 300.0   # the longest retry-after sized from the queue's drain (a deferral's: defer_min_s if longer)


@dataclass(frozen=True)
class AdmissionConfig:
    enter: tuple[float, float, float] = (0.8, 1.0, 1.3)   # pressured, overloaded, critical
    leave: tuple[float, float, float] = (0.7, 0.9, 1.15)  # back below these, after the dwell
    dwell_s: float = 5.0
    target_pressure: float = 1.0
    recover_pressure: float = 0.9
    gain: float = 0.05            # trim increase per unit of pressure above target, per tick
    max_step_up: float = 0.05     # per tick
    step_down: float = 0.05       # per tick
    feed_forward: bool = True     # shed the offered excess at once (see the module docstring)
    feed_forward_utilisation: float = 0.85  # share of admitted capacity the feed-forward fills (headroom for bursts)
    windup_utilisation: float = 0.5  # the trim integrates up only while the fleet is at least this busy
    proportional: float = 1.0     # shed levels per unit of pressure above target, at once (no memory)
    level_step_up: float = 0.5    # the shed level moves at most this much per tick up ...
    level_step_down: float = 0.1  # ... and this much down: bounded steps, no cliffs either way
    reversal_deadband: float = 0.1  # the level turns back only by more than this (no sawing on noise)
    saturated_queue_pressure: float = 1.0  # a queue this deep (queue-axis pressure): the pool serves all it can ...
    capacity_recovery: float = 0.01  # ... so its completions/s are its capacity, which relaxes back by this share
    # of the profile's capacity per tick while the leading axes show headroom (serving_capacity)
    mix_shift_threshold: float = 1.25  # arrivals this much heavier than the fast window's (prompt + output
    mix_shift_sigmas: float = 3.0      # tokens a request), and by this many standard errors of its mean,
    # budget the profile's capacity ÷ that ratio; held once the leading axes confirm it, until the requests are
    # light again (mix_shift, decide)
    defer_min_s: float = 10.0     # shortest retry-after a deferral carries
    critical_floor: float = 0.25  # critical never admits less than this
    continuing_credit: float = 0.5
    # Affinity (the share lever): a warm step's prompt is mostly cached, so it costs the pool a fraction of
    # a cold one in prefill compute, and shedding it throws its task's earlier steps away. It is shed this
    # many levels after other continuing steps when the cache relieves the pool's binding resource fully
    # (cache_relief: the pool's cached prompt share, times how far compute rather than KV memory binds —
    # a cached context still holds its KV blocks)
    warm_credit: float = 1.0
    # fair shares between tenants (tenant_shares): a tenant offering more than its weighted share of the
    # pool's budget sheds its own lower classes first, so the others are not shed for its burst
    tenant_fairness: bool = True
    tenant_weights: tuple[tuple[str, float], ...] = ()   # (tenant, weight) pairs; the setting takes a mapping
    default_tenant_weight: float = 1.0
    fair_share_tolerance: float = 0.1    # a tenant is listed once this share over its fair share ...
    fair_share_sigmas: float = 3.0       # ... plus this many standard deviations of its window's count; kept
    # while over by half that (tenant_shares.wanted_levels: tenants alike must not be listed on noise)
    retry_budget: float = 0.1
    stale_after_s: float = 5.0
    stale_hold_s: float = 10.0
    validity_s: float = 6.0
    max_redirects: int = 3
    redirect_headroom_below: float = 0.8  # a sibling with pressure under this may take work
    # publish redirect_cache_loss_fraction with redirects (the source's cached share: what a move loses); off
    # while routers from before session 7, which refuse any signal with a member they do not know, remain
    redirect_cache_loss: bool = True
    # publish redirect_models with redirects (which models each target serves); off, likewise, while routers
    # from before session 7 remain: it rides on every signal that offers a move
    redirect_models: bool = True
    reason_threshold: float = 0.8         # axes at or over this pressure are named in reasons
    # Axes that drive admission; the others are still reported in every signal. Left out by default:
    # cost — shedding lowers successful tasks, so it cannot lower cost per successful task; errors — a
    # failure rate is the backend's (a replica dying fails what it held), shedding does not lower it, and
    # the picture cannot tell a retry that answers a failure from one that answers our own shedding, so
    # driving on it sheds critical work after every crash and then oscillates. Errors tighten the routers'
    # retry budget instead, and the cascade alert watches them.
    axes: tuple[str, ...] = ("demand", "queue", "kv_cache", "compute", "latency")
    # Axes the proportional part answers at once: the leading ones, read from what the fleet holds now.
    # Latency is an outcome — first tokens of work admitted seconds ago — so a proportional answer to it
    # sheds after the cause is gone and releases into the next burst (measured: prefill-bound pools saw
    # 40 s oscillations); it drives the state and the slow trim instead.
    proportional_axes: tuple[str, ...] = ("demand", "queue", "kv_cache", "compute")


def config_from(overrides: Mapping[str, Any]) -> AdmissionConfig:
    """AdmissionConfig with the ``admission_policy`` setting applied; unknown or bad knobs fail at start-up."""
    known = {f.name: f for f in fields(AdmissionConfig)}
    values = {}
    for name, value in overrides.items():
        if name not in known:
            raise ValueError(f"admission_policy: unknown knob {name!r}; known: {sorted(known)}")
        if name == "tenant_weights":
            value = _tenant_weights(value)
        values[name] = tuple(value) if isinstance(value, list) else value
    cfg = replace(AdmissionConfig(), **values)
    _check_numbers(cfg)
    switches = [f.name for f in fields(AdmissionConfig) if f.type == "bool"]
    wrong = [name for name in switches if not isinstance(getattr(cfg, name), bool)]
    if wrong:   # a string "false" would be truthy: a switch is true or false, nothing else
        raise ValueError(f"admission_policy: {', '.join(wrong)} must be true or false")
    if not (len(cfg.enter) == len(cfg.leave) == 3 and all(l < e for l, e in zip(cfg.leave, cfg.enter))
            and list(cfg.enter) == sorted(cfg.enter)):
        raise ValueError("admission_policy: need three rising enter thresholds, each above its leave threshold")
    if not 0 <= cfg.critical_floor <= 1 or cfg.max_step_up <= 0 or cfg.step_down <= 0:
        raise ValueError("admission_policy: critical_floor in [0, 1], steps positive")
    if cfg.saturated_queue_pressure <= 0 or cfg.capacity_recovery <= 0:
        raise ValueError("admission_policy: saturated_queue_pressure and capacity_recovery must be positive")
    if not (0 <= cfg.continuing_credit <= 4 and 0 <= cfg.warm_credit <= 4):
        raise ValueError("admission_policy: continuing_credit and warm_credit in [0, 4] (levels)")
    if not (0 < cfg.default_tenant_weight < 1e9 and 0 <= cfg.fair_share_tolerance < 1e9
            and 0 <= cfg.fair_share_sigmas < 1e9):   # NaN (TOML allows it) fails every comparison, so it fails here
        raise ValueError("admission_policy: default_tenant_weight in (0, 1e9), fair_share_tolerance and "
                         "fair_share_sigmas in [0, 1e9)")
    return cfg


# upper bounds the signal's schema and the routers hold a knob to: past them every signal is refused
# (critical_floor's range is checked with the steps in config_from)
KNOB_MAXIMA = {"validity_s": MAX_VALIDITY_S, "defer_min_s": 86_400.0, "retry_budget": 1.0, "max_redirects": 16,
               "windup_utilisation": 1.0, "feed_forward_utilisation": 1.0}


def _check_numbers(cfg: AdmissionConfig) -> None:
    """Every numeric knob a finite number, none negative, and within what the signal carries. NaN (TOML
    allows it) fails no ``<`` test: ``step_down = nan`` made the level NaN and a calm pool admitted nothing;
    ``validity_s = 120`` made every router refuse every signal (admission off)."""
    for f in fields(AdmissionConfig):
        value = getattr(cfg, f.name)
        if f.type not in ("float", "int", "tuple[float, float, float]"):
            continue
        for number in value if isinstance(value, tuple) else (value,):
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) \
                    or number < 0 or (f.type == "int" and not isinstance(number, int)):
                raise ValueError(f"admission_policy: {f.name} must be a finite, non-negative "
                                 f"{'integer' if f.type == 'int' else 'number'}, not {number!r}")
            if number > KNOB_MAXIMA.get(f.name, math.inf):
                raise ValueError(f"admission_policy: {f.name} = {number!r} is above its maximum "
                                 f"{KNOB_MAXIMA[f.name]} (what routers and the signal's schema accept)")
    if cfg.validity_s <= 0 or cfg.stale_after_s <= 0:
        raise ValueError("admission_policy: validity_s and stale_after_s must be positive")


def _tenant_weights(value: Any) -> tuple[tuple[str, float], ...]:
    """The ``tenant_weights`` knob: a mapping of tenant name to a positive, finite weight."""
    if not isinstance(value, Mapping):
        raise ValueError("admission_policy: tenant_weights must map tenant names to weights")
    out = []
    for tenant, weight in value.items():
        if (not isinstance(tenant, str) or not tenant or isinstance(weight, bool)
                or not isinstance(weight, (int, float)) or not 0 < weight < 1e9):
            raise ValueError(f"admission_policy: tenant_weights[{tenant!r}] must be a weight in (0, 1e9)")
        out.append((tenant, float(weight)))
    return tuple(sorted(out))


@dataclass(frozen=True)
class Decision:
    """What the policy carries from tick to tick (the previous signal, in effect)."""

    pool: str
    state: str = "ok"
    state_since_ms: int = 0
    shed_level: float = 0.0
    trim: float = 0.0       # the integrating part of the shed level
    seq: int = 0
    last_fresh_ms: int = 0  # wall time the picture last advanced
    watermark_ms: int = 0
    stale_since_ms: int | None = None
    direction: int = 0      # the level's last move: +1 shedding more, -1 less, 0 none yet
    held_since_ms: int = 0  # when the deadband started holding a turn (0: not holding)
    capacity_rps: float = 0.0  # requests/s the feed-forward budgeted (0: the profile's figure)
    capacity_measured: bool = False  # ... and whether that was below the profile's, from a standing queue
    capacity_limit_rps: float = 0.0  # the demand axis's limit (profile × fresh replicas) it was carried at
    tenant_levels: tuple[tuple[str, float], ...] = ()  # tenants above their fair share: their own shed level
    tenant_held: tuple[tuple[str, tuple[int, int]], ...] = ()  # the deadband's holds of tenant levels: since, side
    rest_level: float = 0.0  # the level every other tenant gets (at most shed_level: what fairness gives back)
    rest_direction: int = 0  # the rest's level's last move, as ``direction`` is the pool level's
    rest_held_since_ms: int = 0  # when the deadband started holding the rest's level (0: not holding)
    warm_relief: float = 0.0  # the cache_relief warm steps' fractions follow (moved only past RELIEF_DEADBAND)
    mix_reference: float = 0.0  # tokens a request when arrivals turned heavier (0: no turn under way; mix_shift)
    mix_confirmed: bool = False  # the leading axes confirmed this turn: its figure is kept as a measured one
    signal: dict = field(default_factory=dict, compare=False)


def class_fractions(level: float, floor: float) -> dict[str, float]:
    out = {}
    for i, name in enumerate(SHED_ORDER):
        out[name] = round(class_share(level, i), 6)
    out["critical"] = max(out["critical"], floor)
    return out


def _state_for(pressure: float, previous: str, since_ms: int, now_ms: int, cfg: AdmissionConfig) -> str:
    level = STATES.index(previous) if previous in STATES else 0
    target = 0
    for i, threshold in enumerate(cfg.enter, start=1):
        if pressure >= threshold:
            target = i
    if target > level:
        return STATES[target]
    if target < level and now_ms - since_ms >= cfg.dwell_s * 1000:
        down = level
        while down > 0 and pressure < cfg.leave[down - 1]:
            down -= 1
        return STATES[down]
    return STATES[level]


def _top_level(cfg: AdmissionConfig) -> float:
    """The highest shed level: every class shed but critical's floor."""
    return len(SHED_ORDER) - cfg.critical_floor


def admission_pressure(picture: Mapping[str, Any], cfg: AdmissionConfig, work: float = 1.0) -> float:
    """The largest pressure among the driving axes, with demand read at the *admitted* rate.

    The demand axis reports offered load (every arrival, retries included);
    shedding cannot lower that, so an integrating policy driven by it would
    shed ever more while the fleet sits idle. What admission controls is
    the admitted rate, so that is what it is judged on — × ``work``, how
    many times an admitted request's work is an offered one's while fair
    shares pick whose requests are admitted (``admitted_work_ratio``).
    """
    return max((_admitted_demand(picture, work) if name == "demand" else float(picture["axes"][name]["pressure"])
                for name in cfg.axes), default=0.0)


def _admitted_demand(picture: Mapping[str, Any], work: float) -> float:
    """The demand axis's pressure at the admitted rate × ``work`` (its offered pressure where none is read)."""
    demand = picture["axes"]["demand"]
    admitted = (demand.get("detail") or {}).get("admitted_rps")
    return pressure(admitted * work, demand["limit"]) if admitted is not None else float(demand["pressure"])


def busy(picture: Mapping[str, Any], work: float = 1.0) -> float:
    """How busy the fleet is with what was admitted: the admitted rate (× ``work``, as in
    ``admission_pressure``), KV cache or compute, whichever is nearest its limit."""
    return max(_admitted_demand(picture, work), replicas_busy(picture))


def replicas_busy(picture: Mapping[str, Any]) -> float:
    """How full the replicas are: KV cache or compute, whichever is nearest its limit."""
    axes = picture["axes"]
    return max(float(axes["kv_cache"]["pressure"]), float(axes["compute"]["pressure"]))


def serving_capacity(picture: Mapping[str, Any], previous_rps: float, leading: float, cfg: AdmissionConfig) -> float:
    """Requests/s the pool can serve now: the profile's figure, or less when a standing queue shows less.

    The profile's capacity holds for the request mix it was measured on; when
    requests get heavier (prompts four times longer, a KV cache that binds
    first) the same requests/s is several times the work. A queue at least
    ``saturated_queue_pressure`` deep beside busy replicas (KV cache or
    compute at ``windup_utilisation`` of their limits) means they serve all
    they can, so what completes per second is the capacity for this mix. A
    queue beside idle replicas is no measurement: one replica reporting an
    absurd ``requests_waiting``, or completions still low after a shedding
    episode when admission reopens, would drive the figure down to what the
    shedding lets complete. Without such a queue the figure relaxes back
    toward the profile's by ``capacity_recovery`` × the profile's figure a
    tick (a cold or slower fleet is not trusted at once with its full
    figure): a share of the profile, not of the figure, so recovery takes at
    most 1 / ``capacity_recovery`` ticks from anywhere (a relative step took
    minutes from a figure near zero). ``leading`` is the pressure of the
    leading axes (``proportional_axes``).
    """
    limit = float(picture["axes"]["demand"]["limit"])
    queue = picture["axes"]["queue"]
    drain = float((queue.get("detail") or {}).get("drain_rps") or 0.0)
    if (float(queue["pressure"]) >= cfg.saturated_queue_pressure and drain > 0
            and replicas_busy(picture) >= cfg.windup_utilisation):
        return min(limit, drain)
    if not previous_rps:
        return limit
    if leading >= cfg.recover_pressure:
        return min(limit, previous_rps)   # no headroom shown yet: hold
    return min(limit, previous_rps + cfg.capacity_recovery * limit)


def carried_capacity(picture: Mapping[str, Any], previous: Decision) -> float:
    """The previous tick's measured serving capacity (0: none), per replica: scaled by the replicas heard from
    since it was measured (the demand axis's limit is the profile's figure × the fresh replicas).

    A standing queue measures what the replicas alive *then* serve; held as requests/s, a figure measured
    while three of ten replicas were lost kept the whole fleet at seven replicas' budget after they came
    back, for as long as the leading axes read busy (replica-loss: sheddable work shed for a minute at
    half the KV cache). Replicas lost later scale it down the same way.
    """
    if not previous.capacity_measured or not previous.capacity_rps:
        return 0.0
    then = previous.capacity_limit_rps
    return previous.capacity_rps * _demand_limit(picture) / then if then > 0 else previous.capacity_rps


def _demand_limit(picture: Mapping[str, Any]) -> float:
    limit = float(picture["axes"]["demand"]["limit"])
    return limit if math.isfinite(limit) and limit > 0 else 0.0


MIN_RECENT_PROMPTS = 10   # fewer newest arrivals than this with a prompt size say nothing about the mix
MAX_MIX_SHIFT = 4.0       # a larger turn is left to the queue's measurement: what a burst of claims can cost


def mix_shift(picture: Mapping[str, Any], cfg: AdmissionConfig) -> float:
    """How many times heavier the newest arrivals are than the fast window's (1.0 when not clearly so).

    The profile's requests/s holds for the request mix it was measured on; when
    prompts turn four times longer the same requests/s is about twice the
    work, and the replicas' counters show it only as the heavier work is
    served, a standing queue measures it seconds later (long-context in the
    simulator: every late critical first token of most seeds was sent in
    those seconds). Routers that count a prompt on arrival (``input_tokens``
    on ``received``) show it at once. A request's work is its prompt plus the
    window's mean output per finished attempt (unknown on arrival). Judged
    against the window's noise (``mix_shift_sigmas`` standard errors), each
    prompt clipped by the picture at four times the p90 of the window's
    earlier seconds, which a burst cannot raise.
    """
    return _instant_shift(_prompts(picture), cfg)


def _instant_shift(read: tuple[float, ...] | None, cfg: AdmissionConfig) -> float:
    if read is None:
        return 1.0
    n, recent, mean, sd, out = read
    if n < MIN_RECENT_PROMPTS or recent <= mean + cfg.mix_shift_sigmas * sd / math.sqrt(n):
        return 1.0
    return _shift((recent + out) / (mean + out), cfg)


def _window_shift(read: tuple[float, ...] | None, reference: float, cfg: AdmissionConfig) -> float:
    """The fast window's tokens a request against ``reference``, the window's when the turn began."""
    return _shift((read[2] + read[4]) / reference, cfg) if read is not None and reference > 0 else 1.0


def _shift(ratio: float, cfg: AdmissionConfig) -> float:
    ratio = min(ratio, MAX_MIX_SHIFT)
    return ratio if ratio >= cfg.mix_shift_threshold else 1.0


def _prompts(picture: Mapping[str, Any]) -> tuple[float, float, float, float, float] | None:
    """(newest count, newest mean, window mean, window sd, mean output a finished request) from the demand
    axis, or None where they are missing or not finite."""
    detail = picture["axes"]["demand"].get("detail") or {}
    try:
        n, recent, mean, sd = (float(detail[f"prompt_tokens_{k}"])
                               for k in ("recent_count", "recent_mean", "window_mean", "window_sd"))
        finished = float(picture["rates"]["completed_rps"] or 0.0)
        out = float(detail.get("output_tokens_per_s") or 0.0) / finished if finished > 0 else 0.0
    except (KeyError, TypeError, ValueError):
        return None
    if not all(map(math.isfinite, (n, recent, mean, sd, out))) or mean + out <= 0 or min(n, mean, sd, out) < 0:
        return None
    return n, recent, mean, sd, out


def offered_by_class(picture: Mapping[str, Any]) -> dict[str, float]:
    """Attempts/s offered per class (retries of shed work included), from the demand axis."""
    detail = picture["axes"]["demand"].get("detail") or {}
    offered = detail.get("offered_rps") or detail.get("first_attempts_rps") or {}  # older pictures: first attempts
    return {name: float(offered.get(name, 0.0)) for name in SHED_ORDER}


def feed_forward_level(picture: Mapping[str, Any], cfg: AdmissionConfig, capacity_rps: float | None = None) -> float:
    """The smallest shed level at which the offered attempts fit the admitted capacity."""
    limit = float(picture["axes"]["demand"]["limit"]) if capacity_rps is None else capacity_rps
    offered = offered_by_class(picture)
    return fit_level([offered[name] for name in SHED_ORDER], cfg.feed_forward_utilisation * limit,
                     _top_level(cfg))


def hold_began(since: int | None, now_ms: int) -> int:
    """When a deadband hold began: ``since``, or now for a new hold — and for one the clock has stepped back
    past, so a worker clock set back an hour holds a level for ``dwell_s``, not an hour and ``dwell_s``."""
    return now_ms if since is None or since > now_ms else since


def deadband_hold(turn: float, direction: int, since_ms: int, now_ms: int, cfg: AdmissionConfig) -> int | None:
    """When the deadband began holding ``turn`` (a level's wanted move against its last move, ``direction``,
    by at most ``reversal_deadband``), while the hold is under ``dwell_s``; None: the level moves. A turn
    that persists past the dwell is real, not noise (else a target just across a level would hold it for ever)."""
    if turn * direction >= 0 or abs(turn) > cfg.reversal_deadband:
        return None
    since = hold_began(since_ms or None, now_ms)
    return since if now_ms - since < cfg.dwell_s * 1000 else None


def tenant_levels(wanted: Mapping[str, float], previous: Mapping[str, float], level: float,
                  cfg: AdmissionConfig, now_ms: int, held: Mapping[str, tuple[int, int]] | None = None,
                  hold_above: bool = True) -> tuple[dict[str, float], dict[str, tuple[int, int]]]:
    """Each listed tenant's shed level this tick: toward what its fair share needs (``wanted``), in the pool
    level's bounded steps and deadband (a share that moves with every picture's noise would saw the
    tenant's fractions), at most MAX_LISTED; and the deadband's holds (``held``: tenant → since when, and
    on which side of the level its target has stayed).

    As for the pool's level, the deadband holds a move for at most ``dwell_s``: a target that stays on one
    side of the level that long is real, not noise, and a level held just short of what the share needs
    makes the rest pay for the gap for as long as it lasts (noisy-neighbour with clients that ignore
    Retry-After, seed 2: the bursting tenant held at 2.86 while its share needed 2.92-2.95 for 70 s, the
    others' sheddable work shed whole). A target that crosses the level, or meets it, starts the clock
    again; so does a tenant held at the pool's level before it is listed (kept while it is wanted).

    Without ``hold_above`` the deadband holds a level only below what its share needs, not above it: for
    when the rest already admit all they offer. Held too high while nobody else can take in what it
    sheds, the pool runs under the budget its level set (noisy-neighbour seed 5: 61.3 of a 62.3
    attempts/s budget while the deadband held)."""
    out, holding, held = {}, {}, held or {}
    for tenant in set(wanted) | set(previous):
        # a tenant's level is never below the pool's: it moves from there, not from zero
        before, target = max(previous.get(tenant, 0.0), level), wanted.get(tenant, 0.0)
        gap = target - before
        if before and gap and abs(gap) <= cfg.reversal_deadband and target > 0 and (hold_above or gap > 0):
            side = 1 if gap > 0 else -1
            since, was = held.get(tenant, (now_ms, side))
            since = hold_began(since if was == side else None, now_ms)
            if now_ms - since < cfg.dwell_s * 1000:
                target = before
                holding[tenant] = (since, side)
        moved = min(max(target, before - cfg.level_step_down), before + cfg.level_step_up)
        if moved > level:   # at or below the pool's level, a tenant needs no level of its own
            out[tenant] = round(moved, 6)
    kept = dict(sorted(out.items(), key=lambda item: (-item[1], item[0]))[:MAX_LISTED])
    return kept, {tenant: hold for tenant, hold in holding.items() if tenant in kept or tenant in wanted}


def next_rest_level(target: float, previous: Decision, level: float, tenants: Mapping[str, float], cfg: AdmissionConfig,
                    now_ms: int) -> tuple[float, int]:
    """The level every unlisted tenant gets this tick, and when the deadband began holding it (0: not
    holding). It moves in the pool level's bounded steps (a tenant listed or dropped must not swing
    everyone else's fractions from one tick to the next) and never above the pool's level.

    While a tenant is listed the rest's target moves with every tenant's rate as well as with the levels,
    so it turned back on noise the levels are held against (up to 46 turns in two minutes under ±5% a tick
    without this hold). So while the pool's level and the tenants' stand still, a turn back up (shedding
    the rest more again) by at most ``reversal_deadband`` is held for at most ``dwell_s``, as the pool's
    level is. A turn down is never held: the rest would pay for the hold, shed for another's burst while
    the budget has room for their work (held both ways, noisy-neighbour with clients that ignore
    Retry-After, seed 3: the bursting tenant took 0.899 of the refusals, against 0.950 without the hold).
    Nor is a turn that follows one of those levels' moves (they were held against noise already, and what
    a tenant's move sheds belongs to the rest at once). With nobody listed the rest's level moves to the pool's."""
    before, held = previous.rest_level, 0
    turn = target - before
    # as stored (rounded), so a level that stood still reads as still
    still = round(level, 6) == previous.shed_level and tenants == dict(previous.tenant_levels)
    since = deadband_hold(turn, previous.rest_direction, previous.rest_held_since_ms, now_ms, cfg)
    if tenants and still and turn > 0 and since is not None:
        target, held = before, since
    return min(level, max(target, before - cfg.level_step_down), before + cfg.level_step_up), held


def _redirects(picture: Mapping[str, Any], siblings: Sequence[Mapping[str, Any]], cfg: AdmissionConfig) -> list[dict]:
    """Siblings with headroom, weighted by it; ``cold_prefill_cost_s`` is a moved request's whole prefill there
    (routers compare it with the TTFT SLO)."""
    candidates = []
    for sib in siblings:
        headroom = cfg.redirect_headroom_below - admission_pressure(sib, cfg)
        if sib["pool"] != picture["pool"] and headroom > 0 and sib["replicas"]["fresh"] > 0:
            candidates.append((headroom, sib))
    candidates.sort(key=lambda c: -c[0])
    candidates = candidates[: cfg.max_redirects]
    total = sum(h for h, _ in candidates)
    out = []
    demand = picture["axes"]["demand"]["detail"]
    arrivals = picture["rates"]["arrival_rps"] or 0.0
    mean_input = (demand["input_tokens_per_s"] or 0.0) / arrivals if arrivals else 0.0
    for headroom, sib in candidates:
        compute = sib["axes"]["compute"]
        per_replica_peak = (compute["limit"] or 0.0) / max(sib["replicas"]["fresh"], 1)
        cold_prefill = mean_input / per_replica_peak if per_replica_peak else 0.0
        out.append({"pool": sib["pool"], "weight": round(headroom / total, 6),
                    "cold_prefill_cost_s": round(min(cold_prefill, 3600.0), 6)})
    return out


def decide(picture: Mapping[str, Any], previous: Decision, cfg: AdmissionConfig, now_ms: int,
           siblings: Sequence[Mapping[str, Any]] = ()) -> Decision:
    """The next decision for ``picture``'s pool. ``now_ms`` is passed in: no clock reads here."""
    advanced = picture["watermark_ms"] > previous.watermark_ms
    last_fresh = now_ms if advanced or previous.last_fresh_ms == 0 else previous.last_fresh_ms
    stale = now_ms - last_fresh > cfg.stale_after_s * 1000
    listed_before = cfg.tenant_fairness and any(lvl > previous.rest_level for _, lvl in previous.tenant_levels)
    work = admitted_work_ratio(picture.get("tenants") or (), _fast_window_s(picture)) if listed_before else 1.0
    pressure = admission_pressure(picture, cfg, work)
    reasons = [{"axis": name, "value": round(axis["pressure"], 6), "threshold": 1.0,
                "note": f"{name} at {axis['pressure']:.2f} of its limit"}
               for name, axis in picture["axes"].items() if axis["pressure"] >= cfg.reason_threshold]

    held_since = 0
    capacity, measured = previous.capacity_rps, previous.capacity_measured
    reference, confirmed = previous.mix_reference, previous.mix_confirmed
    if stale:
        stale_since = previous.stale_since_ms if previous.stale_since_ms is not None else now_ms
        level = previous.shed_level
        if now_ms - stale_since > cfg.stale_hold_s * 1000:
            level = max(0.0, level - cfg.step_down)
        trim = level
        # held with the level (fail-static), then let go in the same steps (fail-open); no deadband hold
        # runs on while nothing is measured (as the pool level's: held_since is 0 here)
        tenants = (dict(previous.tenant_levels) if now_ms - stale_since <= cfg.stale_hold_s * 1000
                   else tenant_levels({}, dict(previous.tenant_levels), level, cfg, now_ms)[0])
        tenant_held = {}
        state, since = ("stale", previous.state_since_ms if previous.state == "stale" else now_ms)
        reasons = [{"axis": "staleness", "value": round((now_ms - last_fresh) / 1000, 3),
                    "threshold": cfg.stale_after_s, "note": "no new events for the pool: holding, then relaxing"}]
    else:
        stale_since = None
        if work != 1.0:
            reasons.append({"axis": "demand", "value": round(work, 6), "threshold": 1.0,
                            "note": f"tenants listed: a request admitted is {work:.2f}× the work of one offered"})
        prior = "ok" if previous.state == "stale" else previous.state
        state = _state_for(pressure, prior, previous.state_since_ms, now_ms, cfg)
        since = previous.state_since_ms if state == previous.state else now_ms
        top = _top_level(cfg)
        leading = admission_pressure(picture, replace(cfg, axes=cfg.proportional_axes), work)
        # only a measured figure carries over: the profile's figure of a pool whose replicas are still
        # being heard from (two of ten sampled at a worker's start) is not a measurement to climb back from
        capacity = serving_capacity(picture, carried_capacity(picture, previous), leading, cfg)
        # heavier arrivals budget the profile's figure ÷ the shift at once; it is kept (held, then let go as a
        # measured figure is) only once the leading axes confirm the fleet is busy, so an unconfirmed shift
        # costs the ticks it lasts, never the minute a held figure takes to relax. Through a turn the window is
        # also judged against the mix before it: once the window has taken in the heavier requests, the
        # figure does not relax back while they go on
        limit, read = float(picture["axes"]["demand"]["limit"]), _prompts(picture)
        instant = _instant_shift(read, cfg)
        reference = reference or (read[2] + read[4] if instant > 1.0 else 0.0)
        shift = max(instant, _window_shift(read, reference, cfg)) if reference else instant
        budget = min(capacity, limit / shift)
        if budget < capacity:
            reasons.append({"axis": "demand", "value": round(shift, 6), "threshold": cfg.mix_shift_threshold,
                            "note": f"arrivals {shift:.2f}× heavier than before: {budget:.1f} req/s budgeted"})
            confirmed = confirmed or leading >= cfg.recover_pressure
            if confirmed:
                capacity = budget
        measured = capacity < limit
        if shift == 1.0 or (instant == 1.0 and not confirmed):
            # the mix is light again, or the fleet never confirmed the turn: the next one starts afresh
            reference, confirmed = 0.0, False
        forward = feed_forward_level(picture, cfg, budget) if cfg.feed_forward else 0.0
        now_term = cfg.proportional * max(0.0, leading - cfg.target_pressure)
        # a latency still over its limit while the leading axes are under recover_pressure and nothing
        # waits is the window remembering a shock that is over: the trim does not wind up on it. Sampled
        # replicas holding nothing and completing nothing (0 / 0) are a queue measured empty (so is a lone
        # replica's queue the outlier cap reads as 0 while nothing completes: one replica does not shed its
        # pool alone); a queue nobody measures (no replica sampled, no queue time reported) is not known to
        # be empty. The cost: a latency made of slow generation (TPOT) with no queue and cool leading axes
        # holds the trim where it is rather than winding it up
        queue, sampled = picture["axes"]["queue"], picture["replicas"]
        queue_known = queue["value"] is not None or sampled["fresh"] + sampled["unhealthy"] > 0
        current = leading >= cfg.recover_pressure or not queue_known or float(queue["pressure"]) > 0
        trim = _integrated_trim(previous, pressure, busy(picture, work), forward + now_term, current, cfg)
        trim = min(max(trim, -forward), top - forward)   # no wind-up past either end
        desired = min(max(forward + trim + now_term, 0.0), top)
        turn = desired - previous.shed_level
        # turning back by less than the deadband is noise: held, for at most the dwell
        hold = deadband_hold(turn, previous.direction, previous.held_since_ms, now_ms, cfg)
        if hold is not None and 0 < desired < top:
            desired, held_since = previous.shed_level, hold
        level = min(max(desired, previous.shed_level - cfg.level_step_down), previous.shed_level + cfg.level_step_up)
    direction = previous.direction
    if level != previous.shed_level:
        direction = 1 if level > previous.shed_level else -1
    offered = offered_by_class(picture)
    by_tenant = tenant_rates(picture.get("tenants") or (), offered)
    if not stale:
        wanted = wanted_levels(by_tenant, offered, level, dict(cfg.tenant_weights), cfg.default_tenant_weight,
                               cfg.fair_share_tolerance, cfg.fair_share_sigmas, _fast_window_s(picture),
                               listed=dict(previous.tenant_levels)) if cfg.tenant_fairness else {}
        tenants, tenant_held = tenant_levels(wanted, dict(previous.tenant_levels), level, cfg, now_ms,
                                              dict(previous.tenant_held))
    rest = level_for_the_rest(by_tenant, offered, level, tenants, _top_level(cfg))
    if not stale and tenants and rest <= shared_level(level):
        # the rest admit all they offer, so what a listed level held above its share sheds goes to nobody
        tenants, tenant_held = tenant_levels(wanted, dict(previous.tenant_levels), level, cfg, now_ms,
                                              dict(previous.tenant_held), hold_above=False)
        rest = level_for_the_rest(by_tenant, offered, level, tenants, _top_level(cfg))
    rest, rest_held = next_rest_level(rest, previous, level, {} if stale else tenants, cfg, now_ms)
    rest_direction = previous.rest_direction
    if round(rest, 6) != previous.rest_level:   # as stored, as ``still`` reads the levels
        rest_direction = 1 if rest > previous.rest_level else -1
    admit, continuing = _fractions(rest, cfg)
    relief, reading = previous.warm_relief, cache_relief(picture)
    if not stale and reading is not None and abs(reading - relief) > RELIEF_DEADBAND:
        relief = round(min(max(reading, relief - RELIEF_STEP), relief + RELIEF_STEP), 3)
    warm = _warm_fractions(rest, relief, continuing, cfg)
    # a listed tenant's tasks under way are shed continuing_credit levels after its new ones, as everyone's
    # are after the pool's level: giving them the rest's fractions instead let a tenant whose work is mostly
    # later steps of long tasks keep more than its share (and more than without fairness)
    listed = [{"tenant": tenant, **dict(zip(("admit_fraction", "continuing_task_admit_fraction"),
                                            _fractions(tenant_level, cfg)))}
              for tenant, tenant_level in sorted(tenants.items()) if tenant_level > rest]

    queue = picture["axes"]["queue"]["detail"]
    predicted_wait = queue.get("predicted_wait_s")
    if predicted_wait is None:
        predicted_wait = 0.0 if not queue.get("requests_waiting") else 86400.0
    errors_pressure = picture["axes"]["errors"]["pressure"]
    retry_budget = cfg.retry_budget * min(1.0, max(0.1, 1.0 - (errors_pressure - 0.5) / 1.5))
    if stale:
        # fail-static, then fail-open in every field: what a stale picture says about waits and errors
        # is held while the level is held, then dropped, so no field keeps rejecting on old news
        held = now_ms - stale_since <= cfg.stale_hold_s * 1000 and previous.signal
        predicted_wait = previous.signal["max_predicted_wait_s"] if held else 0.0
        retry_budget = previous.signal["retry_budget"] if held else cfg.retry_budget
    drain = queue.get("drain_rps") or 0.0
    retry_after = min(MAX_RETRY_AFTER_S, max(1.0, (queue.get("requests_waiting") or 0) / drain if drain else 30.0))
    defer_after = max(cfg.defer_min_s, retry_after)
    deferred = [c for c in ("deferrable",) if min([admit[c]] + [e["admit_fraction"][c] for e in listed]) < 1.0]

    seq = max(previous.seq + 1, now_ms)  # monotonic per pool, across controller restarts too
    signal = {
        "schema_version": 1,
        "pool": picture["pool"],
        "seq": seq,
        "issued_at": now_ms,
        "valid_until": now_ms + int(cfg.validity_s * 1000),
        "state": state,
        "pressure": round(min(pressure, 1e6), 6),
        "axes": {name: round(axis["pressure"], 6) for name, axis in picture["axes"].items()},
        "admit_fraction": admit,
        "continuing_task_admit_fraction": continuing,
        "max_predicted_wait_s": round(min(predicted_wait, 86400.0), 6),
        "retry_budget": round(retry_budget, 6),
        "redirect": _redirects(picture, siblings, cfg) if level > 0 and not stale else [],
        "defer": {"classes": deferred, "retry_after_s": round(defer_after, 3)},
        "reasons": reasons[:32],
    }
    if warm != continuing:   # absent when no warm step would be admitted more than other continuing ones
        signal["warm_task_admit_fraction"] = warm
    share = cached_share(picture)
    if cfg.redirect_cache_loss and signal["redirect"] and share is not None:
        # what part of a move's cold prefill the source's caches would have served; absent when unmeasured
        # (no loss is known, which is not none). Informational, so not in ROUTED_MEMBERS: it rides on the
        # signals the routed members or the heartbeat send
        signal["redirect_cache_loss_fraction"] = round(share, 2)
    if cfg.redirect_models and signal["redirect"]:   # which models each move can take
        models = set(picture.get("models", ()))
        shared = {sib["pool"]: sorted(models & set(sib.get("models", ()))) for sib in siblings}
        signal["redirect_models"] = [{"pool": r["pool"], "models": shared.get(r["pool"], [])}
                                     for r in signal["redirect"]]
    if listed:   # absent when empty: routers that predate it see the signal they know
        signal["tenant_admit_fraction"] = listed
    return Decision(pool=picture["pool"], state=state, state_since_ms=since, shed_level=round(level, 6),
                    trim=round(trim, 6), seq=seq, last_fresh_ms=last_fresh, watermark_ms=max(
                        previous.watermark_ms, picture["watermark_ms"]),
                    stale_since_ms=stale_since, direction=direction, held_since_ms=held_since,
                    capacity_rps=round(capacity, 6), capacity_measured=measured,
                    capacity_limit_rps=_demand_limit(picture),
                    mix_reference=round(reference, 3),
                    mix_confirmed=confirmed,
                    tenant_levels=tuple(tenants.items()), tenant_held=tuple(sorted(tenant_held.items())),
                    rest_level=round(rest, 6), rest_direction=rest_direction, rest_held_since_ms=rest_held,
                    warm_relief=relief,
                    signal=signal)


def _integrated_trim(previous: Decision, pressure: float, busy_share: float, untrimmed: float, current: bool,
                     cfg: AdmissionConfig) -> float:
    """The trim after this tick's integration (module docstring). ``untrimmed`` is the feed-forward plus the
    proportional part; with the trim it is where the level would go; ``current`` says the pressure is the
    fleet's now (a leading axis near its limit, or a queue), not only a window's memory. Frozen inside the
    deadband too, a steady turn waited out the whole dwell (found in review)."""
    trim = previous.trim
    reach = untrimmed + trim - previous.shed_level   # how far the level would go with the trim unchanged
    turning = reach * previous.direction < 0 and abs(reach) <= cfg.reversal_deadband   # the deadband holds it
    if pressure > cfg.target_pressure and busy_share >= cfg.windup_utilisation and current:
        if reach < cfg.level_step_up or turning:
            trim += min(cfg.max_step_up, cfg.gain * (pressure - cfg.target_pressure))
    elif pressure < cfg.recover_pressure or busy_share < cfg.windup_utilisation:
        if reach > -cfg.level_step_down or turning:
            trim -= cfg.step_down
    return trim


def _fast_window_s(picture: Mapping[str, Any]) -> float:
    """The window the picture's rates are counted over (the settings' default when it says none usable)."""
    windows = picture.get("windows_s")
    fast = windows.get("fast") if isinstance(windows, dict) else None
    return float(fast) if type(fast) in (int, float) and 0 < fast <= 86400 else 10.0


def _fractions(level: float, cfg: AdmissionConfig) -> tuple[dict[str, float], dict[str, float]]:
    """Admit fractions for new work and for tasks under way (``continuing_credit`` levels later)."""
    admit = class_fractions(level, cfg.critical_floor)
    return admit, _credited(level, cfg.continuing_credit, admit, cfg)


def _credited(level: float, credit: float, floor: Mapping[str, float], cfg: AdmissionConfig) -> dict[str, float]:
    """Fractions ``credit`` levels after ``level``, never below ``floor``'s."""
    credited = class_fractions(max(0.0, level - credit), cfg.critical_floor)
    return {c: max(credited[c], floor[c]) for c in PRIORITIES}


def cached_share(picture: Mapping[str, Any]) -> float | None:
    """The share of the pool's prompt tokens its caches served: the requests' own figure, else the replicas'
    prefix hit rate; None when neither was measured as a share."""
    cache = picture.get("cache")
    if not isinstance(cache, Mapping):   # a picture from before the cache readings (or a broken one)
        return None
    for name in ("cached_input_share", "prefix_hit_rate"):
        share = cache.get(name)
        if type(share) in (int, float) and 0 <= share <= 1:
            return float(share)
    return None


def cache_relief(picture: Mapping[str, Any]) -> float | None:
    """How much of a warm step's cost the pool's caches take away, in [0, 1] (None: not measured in this
    picture's window): the share of prompt tokens the engines served from cache (``cached_share``), times
    how far compute binds rather than KV memory — a cached context saves its prefill, not the KV blocks it
    holds, so where KV binds first (long contexts) a warm step is hardly cheaper than a cold one."""
    share = cached_share(picture)
    if share is None:
        return None
    axes = picture["axes"]
    compute, kv = axes["compute"]["pressure"], axes["kv_cache"]["pressure"]
    binding = 1.0 if compute >= kv else (compute / kv if kv > 0 else 0.0)
    return round(share * binding, 3)


# The relief moves with every picture's token counts; warm fractions that followed each wobble would change
# every tick (a signal per tick and admit-fraction reversals). It is taken up only when it moved this much,
# in steps of at most RELIEF_STEP a tick (warm fractions move no faster than the level's steps down), and
# held while a window measured no share at all (a quiet window, a picture from an older worker).
RELIEF_DEADBAND = 0.1
RELIEF_STEP = 0.1


def _warm_fractions(level: float, relief: float, continuing: Mapping[str, float],
                    cfg: AdmissionConfig) -> dict[str, float]:
    """Fractions for warm steps: ``warm_credit`` × ``relief`` levels after other continuing steps, no further
    than critical's line (the level at which critical's new work starts being shed)."""
    extra = min(cfg.warm_credit * relief, max(0.0, CRITICAL_LINE - level))
    return _credited(level, cfg.continuing_credit + extra, continuing, cfg)


# A router refuses a request whose TTFT SLO is shorter than the predicted wait, so a move of the wait can
# change what it admits. The estimate (engine backlog ÷ completions/s) moves with every sample of the
# engines' queues; publishing each wobble would send a signal every tick under load. Moves within 20 % of
# the published wait, or within 0.1 s (finer than TTFT SLOs are set), wait for the heartbeat.
WAIT_CHANGE_FRACTION = 0.2
WAIT_CHANGE_S = 0.1

# What routers act on, exactly as published (optional members compare absent with absent).
ROUTED_MEMBERS = ("state", "admit_fraction", "continuing_task_admit_fraction", "warm_task_admit_fraction",
                  "tenant_admit_fraction", "redirect", "redirect_models", "defer")


def changed(a: Decision, b: Decision) -> bool:
    """Whether routers must hear about ``b`` now rather than at the next heartbeat."""
    if not a.signal:
        return True
    if any(a.signal.get(k) != b.signal.get(k) for k in ROUTED_MEMBERS):
        return True
    if abs(a.signal["retry_budget"] - b.signal["retry_budget"]) > 0.01:
        return True
    wait, new_wait = a.signal["max_predicted_wait_s"], b.signal["max_predicted_wait_s"]
    return abs(new_wait - wait) > max(WAIT_CHANGE_S, WAIT_CHANGE_FRACTION * wait)
