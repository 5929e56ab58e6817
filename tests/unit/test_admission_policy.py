"""The admission policy: states, shedding order, step bounds, hysteresis, staleness, continuing tasks."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.admission.policy import SHED_ORDER, AdmissionConfig, Decision, changed, class_fractions, decide
from pipeline.admission.signing import sign, verify
from pipeline.events import validate
from pipeline.load.picture import AXES

CFG = AdmissionConfig()
TICK = 250


def picture(pool="p", watermark=1_000, waiting=0, drain=10.0, errors=0.0, **pressures):
    axes = {a: {"value": 0.0, "limit": 1.0, "pressure": pressures.get(a, 0.0), "detail": {}} for a in AXES}
    axes["queue"]["detail"] = {"predicted_wait_s": waiting / drain if drain else None, "requests_waiting": waiting,
                               "drain_rps": drain}
    axes["errors"]["pressure"] = errors or pressures.get("errors", 0.0)
    axes["demand"]["detail"] = {"input_tokens_per_s": 10_000.0}
    axes["compute"]["limit"] = 40_000.0
    return {"pool": pool, "watermark_ms": watermark, "pressure": max(a["pressure"] for a in axes.values()),
            "axes": axes, "rates": {"arrival_rps": 10.0},
            "replicas": {"total": 4, "fresh": 4, "stale": 0, "unhealthy": 0}}


def run(pressures, start=None, cfg=CFG, now=0):
    """Feed one picture per tick; returns the decisions."""
    decision = start or Decision("p")
    out = []
    for i, p in enumerate(pressures):
        now += TICK
        decision = decide(picture(watermark=now, **p), decision, cfg, now)
        out.append(decision)
    return out


@pytest.mark.parametrize("axis", CFG.axes)
@pytest.mark.parametrize("pressure,state", [(0.5, "ok"), (0.85, "pressured"), (1.1, "overloaded"), (1.5, "critical")])
def test_each_axis_drives_each_state(axis, pressure, state):
    (decision,) = run([{axis: pressure}])
    assert decision.state == state
    named = [r["axis"] for r in decision.signal["reasons"]]
    assert (axis in named) == (pressure >= CFG.reason_threshold)


def test_cost_is_reported_but_does_not_shed():
    """Shedding lowers successful tasks, so it cannot lower cost per successful task."""
    (decision,) = run([{"cost": 3.0}])
    assert decision.state == "ok" and decision.shed_level == 0.0
    assert decision.signal["axes"]["cost"] == 3.0
    assert [r["axis"] for r in decision.signal["reasons"]] == ["cost"]


def test_shedding_order_and_critical_last():
    decisions = run([{"kv_cache": 3.0}] * 80)
    for d in decisions:
        f = d.signal["admit_fraction"]
        for lower, higher in zip(SHED_ORDER, SHED_ORDER[1:]):
            assert f[higher] == 1.0 or f[lower] == 0.0, f"{higher} shed while {lower} admitted: {f}"
        assert f["critical"] >= CFG.critical_floor
    assert decisions[-1].signal["admit_fraction"]["standard"] == 0.0


def test_bounded_steps_no_cliffs_and_gradual_recovery():
    decisions = run([{"queue": 5.0}] * 40 + [{"queue": 0.2}] * 200)
    levels = [d.shed_level for d in decisions]
    ups = [b - a for a, b in zip(levels, levels[1:]) if b > a]
    downs = [a - b for a, b in zip(levels, levels[1:]) if b < a]
    assert max(ups) <= CFG.level_step_up + 1e-9 and max(downs) <= CFG.level_step_down + 1e-9
    assert levels[-1] == 0.0 and decisions[-1].signal["admit_fraction"]["deferrable"] == 1.0


def test_the_trim_integrates_only_while_the_level_follows_it():
    """Conditional integration (anti-windup): the trim does not move while the level cannot follow — held
    at the top by the proportional part, or coming down at ``level_step_down`` a tick. A trim that kept
    integrating stored up shedding for after the queue drained, or landed far below the level and carried
    it past what the pool takes when it got there (the wave of shed work after a spike)."""
    busy = {"kv_cache": 0.6}   # the fleet busy enough for the trim to integrate
    decisions = run([{"latency": 1.5, "queue": 0.3, **busy}] * 80 + [{"queue": 5.0, **busy}] * 40 + [busy] * 200)
    before, top = decisions[79], decisions[119]
    assert before.trim > 1.0                                   # the slow trim found an offset
    assert top.shed_level == 4 - CFG.critical_floor and top.trim <= before.trim + CFG.max_step_up
    walking = [d for d in decisions[120:] if d.shed_level > d.trim + CFG.level_step_down]
    assert len(walking) >= 10
    assert min(d.trim for d in walking) >= top.trim - CFG.step_down - 1e-9   # held (one step at the turn)
    assert decisions[-1].shed_level == 0.0


@pytest.mark.parametrize("knobs", [{}, {"level_step_down": 0.05}, {"reversal_deadband": 0.2, "dwell_s": 30.0}])
def test_a_turn_the_deadband_holds_is_carried_by_the_trim_not_waited_out(knobs):
    """Inside the reversal deadband it is the trim that carries a turn past it: a first version froze the trim
    there too, and a calm pool held its shed level for the whole dwell (found in review)."""
    cfg = replace(CFG, **knobs)
    busy = {"kv_cache": 0.6}
    decisions = run([{"latency": 1.5, "queue": 0.3, **busy}] * 40 + [busy] * 200, cfg=cfg)
    peak = decisions[39].shed_level
    assert peak > 0.5
    first_down = next(i for i, d in enumerate(decisions[40:]) if d.shed_level < peak - 1e-9)
    assert first_down <= 4 and sum(1 for d in decisions[40:] if d.held_since_ms) <= 4
    assert decisions[-1].shed_level == 0.0


def test_the_trim_does_not_wind_up_on_a_latency_the_fleet_no_longer_holds():
    """A latency over its limit with the leading axes under ``recover_pressure`` and nothing waiting is the
    window remembering a shock that is over: winding the trim up on it shed on a fleet going idle
    (prompt-heavy-loss, session 28). A queue, or a leading axis near its limit, makes the same latency
    current, and the trim integrates on it as before."""
    history = run([{"latency": 2.0, "kv_cache": 0.6}] * 40)
    assert all(d.trim == 0.0 and d.shed_level == 0.0 for d in history)
    assert history[-1].state == "critical"                    # still reported: the state follows every axis
    for current in ({"queue": 0.1}, {"kv_cache": CFG.recover_pressure}, {"compute": 0.95}):
        held = run([{"latency": 2.0, "kv_cache": 0.6, **current}] * 40)
        assert held[-1].trim > 0.5 and held[-1].shed_level > 0.5, current


def _trim_after(latency_picture, ticks=40):
    decision = Decision("p")
    for i in range(1, ticks + 1):
        decision = decide(latency_picture(i * TICK), decision, CFG, i * TICK)
    return decision


def test_a_queue_nobody_measures_is_not_one_measured_empty():
    """No replica sampled and no queue time reported (a router-only deployment): the queue is unknown, not
    empty, and the trim integrates on latency. Sampled replicas holding nothing and completing nothing
    (predicted wait 0 / 0, no value) are a queue measured empty: the gate holds the trim there."""
    def unmeasured(watermark):
        p = picture(watermark=watermark, latency=2.0, demand=0.6)
        p["axes"]["queue"]["value"] = None
        p["replicas"] = {"total": 0, "fresh": 0, "stale": 0, "unhealthy": 0}
        return p

    def drained(watermark):
        p = picture(watermark=watermark, latency=2.0, kv_cache=0.6, waiting=0, drain=0.0)
        p["axes"]["queue"]["value"] = None
        return p

    decision = _trim_after(unmeasured)
    assert decision.trim > 0.5 and decision.shed_level > 0.5
    decision = _trim_after(drained)
    assert decision.trim == 0.0 and decision.shed_level == 0.0


def test_escalation_is_immediate_deescalation_waits_for_dwell():
    decisions = run([{"latency": 1.4}] + [{"latency": 0.2}] * 30)
    assert decisions[0].state == "critical"
    dwell_ticks = int(CFG.dwell_s * 1000 / TICK)
    assert all(d.state == "critical" for d in decisions[1:dwell_ticks])
    assert decisions[-1].state == "ok"


def test_continuing_tasks_are_protected():
    for d in run([{"demand": 2.0}] * 60):
        new, continuing = d.signal["admit_fraction"], d.signal["continuing_task_admit_fraction"]
        assert all(continuing[c] >= new[c] for c in new)
    assert any(d.signal["continuing_task_admit_fraction"]["sheddable"] > d.signal["admit_fraction"]["sheddable"]
               for d in run([{"demand": 2.0}] * 60))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=-0.08, max_value=0.08), min_size=200, max_size=200),
       st.sampled_from([0.8, 1.0, 1.3]))
def test_noise_around_a_threshold_does_not_flap(noise, threshold):
    decisions = run([{"compute": threshold + n} for n in noise])
    states = [d.state for d in decisions]
    changes = sum(a != b for a, b in zip(states, states[1:]))
    seconds = len(states) * TICK / 1000
    assert changes <= 1 + seconds / CFG.dwell_s, f"{changes} state changes in {seconds:.0f}s"


def test_stale_picture_holds_then_relaxes():
    loaded = run([{"kv_cache": 3.0}] * 20)[-1]
    assert loaded.shed_level > 1
    now = 20 * TICK
    frozen = picture(watermark=now, kv_cache=3.0)  # the same picture, never advancing
    d, history = loaded, []
    for i in range(1, 200):
        d = decide(frozen, d, CFG, now + i * TICK)
        history.append(d)
    stale = [h for h in history if h.state == "stale"]
    assert stale, "goes stale"
    first_stale_ms = stale[0].signal["issued_at"]
    before = history[history.index(stale[0]) - 1]
    held = [h for h in stale if h.signal["issued_at"] - first_stale_ms <= CFG.stale_hold_s * 1000]
    assert all(h.shed_level == before.shed_level for h in held), "fail-static while holding"
    assert history[-1].shed_level < before.shed_level, "then relaxes toward admitting all"
    assert history[-1].signal["reasons"][0]["axis"] == "staleness"


def test_stale_is_fail_open_in_every_field_after_the_hold():
    """A frozen picture that predicted long waits and many errors must not keep rejecting on old news."""
    now = 20 * TICK
    loaded = run([{"kv_cache": 3.0}] * 20)[-1]
    frozen = picture(watermark=now, waiting=500, drain=1.0, errors=3.0, kv_cache=3.0)
    d = decide(frozen, loaded, CFG, now + TICK)
    assert d.signal["max_predicted_wait_s"] == 500.0 and d.signal["retry_budget"] < CFG.retry_budget
    for i in range(2, 400):
        d = decide(frozen, d, CFG, now + i * TICK)
    assert d.state == "stale"
    assert d.signal["max_predicted_wait_s"] == 0.0, "no early rejection from a stale queue"
    assert d.signal["retry_budget"] == CFG.retry_budget, "no tightening from stale errors"
    assert d.signal["redirect"] == [] and all(f == 1.0 for f in d.signal["admit_fraction"].values())


def test_retry_budget_tightens_as_errors_rise():
    calm = run([{"errors": 0.1}])[0].signal["retry_budget"]
    stormy = run([{"errors": 2.5}])[0].signal["retry_budget"]
    assert calm == pytest.approx(CFG.retry_budget) and stormy < calm / 2


def test_defer_and_early_rejection_figures():
    d = decide(picture(watermark=TICK, waiting=40, drain=8.0, queue=2.0), Decision("p"), CFG, TICK)
    assert d.signal["max_predicted_wait_s"] == pytest.approx(5.0)
    assert d.signal["defer"] == {"classes": ["deferrable"], "retry_after_s": CFG.defer_min_s}
    slow = decide(picture(watermark=TICK, waiting=400, drain=8.0, queue=2.0), Decision("p"), CFG, TICK)
    assert slow.signal["defer"]["retry_after_s"] == pytest.approx(50.0), "the queue's drain time when longer"


def test_redirects_go_to_siblings_with_headroom_weighted_by_it():
    hot = picture(watermark=TICK, demand=1.5)
    cool, warm, full = picture("a", demand=0.2), picture("b", demand=0.6), picture("c", demand=0.95)
    d = decide(hot, Decision("p"), CFG, TICK, siblings=[cool, warm, full])
    redirect = {r["pool"]: r for r in d.signal["redirect"]}
    assert set(redirect) == {"a", "b"}
    assert redirect["a"]["weight"] == pytest.approx(0.6 / 0.8) and redirect["b"]["weight"] == pytest.approx(0.2 / 0.8)
    assert redirect["a"]["cold_prefill_cost_s"] == pytest.approx((10_000 / 10) / (40_000 / 4))


@pytest.mark.parametrize("cache,loss", [
    ({"cached_input_share": 0.75, "prefix_hit_rate": 0.1}, 0.75),   # the requests' own figure first
    ({"cached_input_share": None, "prefix_hit_rate": 0.4}, 0.4),     # else the replicas' hit rate
    ({"cached_input_share": 1.0}, 1.0),                              # all of it, never more
    ({"cached_input_share": 1e300, "prefix_hit_rate": float("nan")}, None),  # no share: no loss is known
    ({"cached_input_share": None, "prefix_hit_rate": None}, None),
    (None, None),                                                    # a picture from an older worker
])
def test_a_moves_cache_loss_is_the_sources_measured_cached_share(cache, loss):
    hot = picture(watermark=TICK, demand=1.5) | ({"cache": cache} if cache is not None else {})
    cold_sibling = picture("a", demand=0.2) | {"cache": {"cached_input_share": 0.0, "prefix_hit_rate": 0.0}}
    signal = decide(hot, Decision("p"), CFG, TICK, siblings=[cold_sibling]).signal
    (entry,) = signal["redirect"]
    assert entry["cold_prefill_cost_s"] == pytest.approx(0.1), "the TTFT figure stays the whole prompt"
    assert signal.get("redirect_cache_loss_fraction") == loss
    envelope = {"event_id": "00000000-0000-4000-8000-000000000000", "event_time": TICK, **signal}
    validate("admission_signal", verify(sign(envelope, "k", b"secret"), {"k": b"secret"}))
    calm = decide(picture(watermark=TICK, demand=0.2) | {"cache": cache or {}}, Decision("p"), CFG, TICK,
                  siblings=[cold_sibling]).signal
    assert calm["redirect"] == [] and "redirect_cache_loss_fraction" not in calm, "no move offered, no loss"
    off = decide(hot, Decision("p"), replace(CFG, redirect_cache_loss=False), TICK, siblings=[cold_sibling]).signal
    assert off["redirect"] == signal["redirect"] and "redirect_cache_loss_fraction" not in off


@pytest.mark.parametrize("switch", ["redirect_cache_loss", "tenant_fairness", "feed_forward"])
def test_a_switch_that_is_not_true_or_false_fails_at_start_up(switch):
    from pipeline.admission.policy import config_from

    assert getattr(config_from({switch: False}), switch) is False
    with pytest.raises(ValueError, match=switch):
        config_from({switch: "false"})


def test_a_change_of_the_moves_cache_loss_alone_waits_for_the_heartbeat():
    """Informational: routers do not act on it, so it rides on the signals the routed members send."""
    hot = picture(watermark=TICK, demand=1.5) | {"cache": {"cached_input_share": 0.2}}
    first = decide(hot, Decision("p"), CFG, TICK, siblings=[picture("a", demand=0.2)])
    moved = replace(first, signal=dict(first.signal, redirect_cache_loss_fraction=0.9))
    assert first.signal["redirect_cache_loss_fraction"] == 0.2 and not changed(first, moved)


def test_seq_is_monotonic_across_a_controller_restart():
    before = run([{"demand": 0.1}] * 3)[-1]
    after_restart = decide(picture(watermark=10 * TICK), Decision("p"), CFG, 10 * TICK)
    assert after_restart.seq > before.seq


def test_class_fractions_floor():
    assert class_fractions(10, 0.25) == {"deferrable": 0.0, "sheddable": 0.0, "standard": 0.0, "critical": 0.25}
    assert class_fractions(0.5, 0.25)["deferrable"] == 0.5


def offered(critical=0.0, standard=0.0, sheddable=0.0, deferrable=0.0, limit=10.0, admitted=None):
    p = picture(watermark=TICK)
    total = critical + standard + sheddable + deferrable
    p["axes"]["demand"].update(limit=limit, pressure=total / limit)
    p["axes"]["demand"]["detail"] = {"admitted_rps": total if admitted is None else admitted,
                                     "input_tokens_per_s": 1000.0,
                                     "first_attempts_rps": {"critical": critical, "standard": standard,
                                                            "sheddable": sheddable, "deferrable": deferrable}}
    return p


def test_feed_forward_sheds_the_offered_excess_in_class_order():
    from pipeline.admission.policy import feed_forward_level

    budget = CFG.feed_forward_utilisation * 10.0
    assert feed_forward_level(offered(critical=1, standard=5), CFG) == 0.0
    # deferrable alone over budget by 2 of its 4: admit half of it
    assert feed_forward_level(offered(critical=1, standard=budget - 3, deferrable=4), CFG) == pytest.approx(0.5)
    # all of deferrable and sheddable, and a quarter of standard
    level = feed_forward_level(offered(critical=1, standard=4 * (budget - 1) / 3, sheddable=3, deferrable=3), CFG)
    assert level == pytest.approx(2.25)
    assert feed_forward_level(offered(critical=50), CFG) == 4 - CFG.critical_floor


def test_a_spike_is_met_within_bounded_steps_without_waiting_for_an_integrator():
    d, levels = Decision("p"), []
    for i in range(1, 12):
        d = decide({**offered(critical=2, standard=10, sheddable=5, deferrable=3, admitted=9.5),
                    "watermark_ms": i * TICK}, d, CFG, i * TICK)
        levels.append(d.shed_level)
    assert all(b - a <= CFG.level_step_up + 1e-9 for a, b in zip([0.0] + levels, levels))
    assert levels[-1] >= 2.0 and d.signal["admit_fraction"]["sheddable"] == 0.0
    assert d.signal["admit_fraction"]["critical"] == 1.0


def test_demand_is_judged_at_the_admitted_rate_so_shedding_can_relieve_it():
    from pipeline.admission.policy import admission_pressure

    flooded = offered(standard=30, admitted=8.0)   # offered 3× capacity, admitted 0.8×
    assert flooded["axes"]["demand"]["pressure"] == pytest.approx(3.0)
    assert admission_pressure(flooded, CFG) == pytest.approx(0.8)


def test_errors_are_reported_and_tighten_the_retry_budget_but_do_not_shed():
    (d,) = run([{"errors": 5.0}])
    assert d.shed_level == 0.0 and d.signal["axes"]["errors"] == 5.0
    assert d.signal["retry_budget"] < CFG.retry_budget


def test_a_move_of_the_predicted_wait_is_published_at_once_and_its_jitter_waits_for_the_heartbeat():
    """Routers refuse requests whose TTFT SLO is under the predicted wait: 1 s → 3 s refuses a 2 s SLO."""
    unsteady = ("seq", "issued_at", "valid_until", "max_predicted_wait_s")
    published = decide(picture(waiting=10, drain=10.0), Decision("p"), CFG, TICK)

    def then(waiting):
        decision = decide(picture(watermark=2 * TICK, waiting=waiting, drain=10.0), published, CFG, 2 * TICK)
        assert {k: v for k, v in decision.signal.items() if k not in unsteady} == {
            k: v for k, v in published.signal.items() if k not in unsteady}, "only the wait moves"
        return decision

    assert published.signal["max_predicted_wait_s"] == 1.0
    assert changed(published, then(30)) and changed(published, then(0))
    assert not changed(published, then(11)) and not changed(published, then(9)), "within 20 %: noise"
    quiet = decide(picture(waiting=0), Decision("p"), CFG, TICK)
    assert not changed(quiet, decide(picture(watermark=2 * TICK, waiting=5, drain=100.0), quiet, CFG, 2 * TICK))
    assert changed(quiet, decide(picture(watermark=2 * TICK, waiting=2, drain=10.0), quiet, CFG, 2 * TICK))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 0.05), st.floats(0.95, 1.6))
def test_admit_fractions_do_not_saw_under_noisy_steady_load(seed, noise, level):
    """Routers feel flapping as reversals of the fractions they act on: under picture noise up to ±5% of the
    pressure (consecutive pictures share most of their window) the fractions turn back at most once per
    dwell — a turn inside the deadband is held that long before it is taken as real."""
    import random

    from pipeline.admission.flapping import reversals

    rng = random.Random(seed)
    decisions = run([{"kv_cache": level + rng.uniform(-noise, noise), "demand": 0.9} for _ in range(480)])
    minutes = 480 * TICK / 60_000
    assert reversals(d.signal["admit_fraction"] for d in decisions) <= minutes * 60 / CFG.dwell_s


def test_a_real_turn_passes_the_deadband():
    decisions = run([{"kv_cache": 1.4}] * 40 + [{"kv_cache": 0.5}] * 40)
    levels = [d.shed_level for d in decisions]
    assert max(levels) > 0 and levels[-1] < max(levels) - 1, "relief after overload is not held as noise"


def test_reversals_count_direction_changes_of_each_class():
    from pipeline.admission.flapping import reversals

    series = [{"s": 1.0}, {"s": 0.5}, {"s": 0.505}, {"s": 0.8}, {"s": 0.2}, {"s": 0.2}]
    assert reversals(series) == 2


def test_a_small_steady_relief_is_not_held_forever_by_the_deadband():
    """The deadband judges where the level wants to go, not one bounded step: a step down is never larger
    than level_step_down, so judging steps would hold a level that wants to fall slowly for ever."""
    decisions = run([{"kv_cache": 1.15}] * 20 + [{"kv_cache": 0.3}] * 200)
    assert decisions[19].shed_level > 0 and decisions[-1].shed_level == 0


def test_a_turn_that_persists_past_the_dwell_is_made():
    """A target just across the level (inside the deadband) is held for the dwell, not for ever."""
    from pipeline.admission.policy import Decision

    start = Decision("p", shed_level=0.15, trim=0.05, direction=1, state="overloaded")
    decisions = run([{"kv_cache": 0.95}] * 80, start=start)
    assert decisions[0].shed_level == 0.15 and decisions[-1].shed_level < 0.15


def heavy(now, queue=0.0, drain=10.0, offered=20.0, limit=40.0, **pressures):
    """A picture whose offered requests/s fit the profile's limit, with a queue of the given pressure."""
    p = picture(watermark=now, waiting=int(queue * 10), drain=drain, queue=queue, **pressures)
    p["axes"]["demand"]["limit"] = limit
    share = offered / len(SHED_ORDER)
    p["axes"]["demand"]["detail"] |= {"offered_rps": {c: share for c in SHED_ORDER}, "admitted_rps": offered}
    return p


def test_a_standing_queue_sets_the_capacity_the_feed_forward_budgets():
    """Requests four times heavier than the profile's: 20 req/s fit its 40, but the replicas complete 10 with
    a standing queue — the feed-forward budgets those 10 at once instead of waiting for a trim to wind up."""
    calm = decide(heavy(TICK, queue=0.2), Decision("p"), CFG, TICK)
    assert calm.capacity_rps == 40.0 and calm.shed_level == 0.0
    queued = decide(heavy(2 * TICK, queue=1.2, drain=10.0, kv_cache=0.8), calm, CFG, 2 * TICK)
    assert queued.capacity_rps == 10.0
    # 0.85 × 10 of 20 offered: the two lowest classes go, and the feed-forward says so in one tick
    assert queued.shed_level == pytest.approx(CFG.level_step_up)
    later = queued
    for i in range(3, 12):
        later = decide(heavy(i * TICK, queue=1.2, drain=10.0, kv_cache=0.8), later, CFG, i * TICK)
    fractions = later.signal["admit_fraction"]
    assert fractions["deferrable"] == fractions["sheddable"] == 0.0 and fractions["critical"] == 1.0


def test_a_measured_capacity_is_held_without_headroom_and_relaxes_back_with_it():
    d = decide(heavy(TICK, queue=1.5, drain=10.0, kv_cache=0.8), Decision("p"), CFG, TICK)
    assert d.capacity_rps == 10.0
    held = decide(heavy(2 * TICK, queue=0.1, kv_cache=0.95), d, CFG, 2 * TICK)   # the queue is gone, the cache is not
    assert held.capacity_rps == 10.0
    capacities = []
    for i in range(3, 200):
        held = decide(heavy(i * TICK, queue=0.1, kv_cache=0.5), held, CFG, i * TICK)
        capacities.append(held.capacity_rps)
    steps = [b - a for a, b in zip(capacities, capacities[1:]) if b > a]
    assert max(steps) <= CFG.capacity_recovery * 40.0 + 1e-6   # a share of the profile's figure a tick
    assert capacities[-1] == 40.0 and max(capacities) == 40.0   # back to the profile's figure, never above it


def test_a_measured_capacity_is_per_replica_it_follows_replicas_that_come_back_or_go():
    """Measured with 7 replicas heard from (limit 28), the figure is what those 7 serve: when the other 3 are
    back (limit 40) the fleet is not held at 7 replicas' budget while it stays busy; losing replicas scales it
    down the same way."""
    d = decide(heavy(TICK, queue=1.5, drain=7.0, kv_cache=0.8, limit=28.0), Decision("p"), CFG, TICK)
    assert d.capacity_rps == 7.0 and d.capacity_measured and d.capacity_limit_rps == 28.0
    back = decide(heavy(2 * TICK, queue=0.1, kv_cache=0.95), d, CFG, 2 * TICK)   # busy: held, per replica
    assert back.capacity_rps == pytest.approx(10.0) and back.capacity_limit_rps == 40.0
    lost = decide(heavy(3 * TICK, queue=0.1, kv_cache=0.95, limit=20.0), back, CFG, 3 * TICK)
    assert lost.capacity_rps == pytest.approx(5.0) and lost.capacity_measured


def test_a_queue_beside_idle_replicas_is_no_measurement():
    """One replica reporting an absurd ``requests_waiting`` while the fleet idles (KV and compute low), or a
    queue forming as admission reopens after shedding while completions are still few: not the pool's
    capacity."""
    for kv_cache, compute in ((0.1, 0.2), (0.45, 0.3)):
        d = decide(heavy(TICK, queue=10**6, drain=0.4, kv_cache=kv_cache, compute=compute), Decision("p"), CFG, TICK)
        assert d.capacity_rps == 40.0 and not d.capacity_measured
    busy = decide(heavy(TICK, queue=10**6, drain=0.4, compute=0.6), Decision("p"), CFG, TICK)
    assert busy.capacity_rps == 0.4 and busy.capacity_measured


def test_a_capacity_driven_to_nothing_recovers_within_one_over_the_recovery_share_ticks():
    """Whatever drove the figure near zero (a replica lying about its counters as well as its queue), once
    it stops the pool must be trusted again within 1 / capacity_recovery ticks, however low it went (a
    relative step would take ~230 ticks from 1%)."""
    d = decide(heavy(TICK, queue=10**6, drain=0.4, compute=0.9), Decision("p"), CFG, TICK)
    assert d.capacity_rps == 0.4
    ticks = 0
    while d.capacity_rps < 40.0:
        ticks += 1
        d = decide(heavy((ticks + 1) * TICK, queue=0.0, kv_cache=0.1), d, CFG, (ticks + 1) * TICK)
        assert ticks <= 1 / CFG.capacity_recovery, f"still at {d.capacity_rps:.1f} req/s after {ticks} ticks"


def test_a_drain_above_the_profile_does_not_raise_the_capacity():
    d = decide(heavy(TICK, queue=2.0, drain=80.0, kv_cache=0.8), Decision("p"), CFG, TICK)
    assert d.capacity_rps == 40.0


def arriving(p, recent, window=1000.0, sd=300.0, n=100, output_per_s=2000.0, completed_rps=10.0):
    """``p`` with the newest arrivals' prompts (mean ``recent`` over ``n``) against the fast window's; 200 output
    tokens a finished request."""
    p["axes"]["demand"]["detail"] |= {
        "prompt_tokens_window_mean": window, "prompt_tokens_window_sd": sd, "prompt_tokens_window_count": 5 * n,
        "prompt_tokens_recent_mean": recent, "prompt_tokens_recent_count": n, "prompt_clip_tokens": 6 * window,
        "output_tokens_per_s": output_per_s}
    p["rates"]["completed_rps"] = completed_rps
    return p


def test_arrivals_turning_heavier_budget_the_profiles_capacity_before_any_queue_shows_it():
    """Prompts four times the window's: the same requests/s is (4000 + 200) ÷ (1000 + 200) = 3.5 times the work.
    The feed-forward budgets the profile's 40 req/s ÷ 3.5 at once, with no queue yet; the figure is kept, and
    held as a measured one, once the leading axes confirm the fleet is busy (KV cache at 0.95), and not
    compounded as the window takes in the new mix."""
    plain = decide(heavy(TICK, queue=0.2), Decision("p"), CFG, TICK)
    assert plain.capacity_rps == 40.0 and plain.shed_level == 0.0
    d = decide(arriving(heavy(TICK, queue=0.2), recent=4000.0), Decision("p"), CFG, TICK)
    assert d.shed_level == pytest.approx(CFG.level_step_up)   # 20 offered against 0.85 × 11.4: at once
    assert {"axis": "demand", "value": 3.5, "threshold": CFG.mix_shift_threshold,
            "note": "arrivals 3.50× heavier than before: 11.4 req/s budgeted"} in d.signal["reasons"]
    envelope = {"event_id": "00000000-0000-4000-8000-000000000000", "event_time": TICK, **d.signal}
    validate("admission_signal", verify(sign(envelope, "k", b"secret"), {"k": b"secret"}))
    assert d.capacity_rps == 40.0 and not d.capacity_measured   # the fleet does not confirm it yet
    d = decide(arriving(heavy(2 * TICK, queue=0.2, kv_cache=0.95), recent=4000.0), d, CFG, 2 * TICK)
    assert d.capacity_rps == pytest.approx(40 / 3.5, rel=1e-4) and d.capacity_measured
    absorbed = arriving(heavy(3 * TICK, queue=0.2, kv_cache=0.95), recent=4000.0, window=2500.0)
    held = decide(absorbed, d, CFG, 3 * TICK)
    assert held.capacity_rps == pytest.approx(40 / 3.5, rel=1e-4)
    # a standing queue's measurement is not divided again: the smaller of the two
    queued = decide(arriving(heavy(TICK, queue=1.2, drain=10.0, kv_cache=0.8), recent=4000.0), Decision("p"), CFG, TICK)
    assert queued.capacity_rps == 10.0


def test_after_a_confirmed_turn_the_window_is_judged_against_the_mix_before_it():
    """Ten seconds after prompts turned four times longer the fast window holds only the new mix, so the newest
    arrivals are no heavier than it: the budget stays the profile's ÷ 3.5 (the window against the mix before
    the turn) though the leading axes show headroom, and relaxes back only once the mix is light again."""
    d = Decision("p")
    for i in range(1, 3):
        d = decide(arriving(heavy(i * TICK, queue=0.2, kv_cache=0.95), recent=4000.0), d, CFG, i * TICK)
    assert d.capacity_rps == pytest.approx(40 / 3.5, rel=1e-4) and d.mix_reference == 1200.0
    for i in range(3, 60):
        d = decide(arriving(heavy(i * TICK, queue=0.2, kv_cache=0.5), recent=4000.0, window=4000.0), d, CFG, i * TICK)
        assert d.capacity_rps == pytest.approx(40 / 3.5, rel=1e-4), f"relaxed at tick {i}"
    for i in range(60, 200):
        d = decide(arriving(heavy(i * TICK, queue=0.2, kv_cache=0.5), recent=1000.0), d, CFG, i * TICK)
    assert d.capacity_rps == 40.0 and d.mix_reference == 0.0


def test_a_capacity_still_recovering_from_a_queue_does_not_confirm_a_turn():
    """A standing queue measured 10 req/s; the figure is relaxing back with the fleet idle when the newest
    arrivals look heavier: the budget is cut while they do, but the figure is not held at the cut."""
    d = decide(heavy(TICK, queue=1.5, drain=10.0, kv_cache=0.8), Decision("p"), CFG, TICK)
    for i in range(2, 40):
        d = decide(heavy(i * TICK, queue=0.1, kv_cache=0.3), d, CFG, i * TICK)
    relaxing = d.capacity_rps
    assert d.capacity_measured and 10.0 < relaxing < 40.0
    for i in range(40, 44):
        d = decide(arriving(heavy(i * TICK, queue=0.1, kv_cache=0.3), recent=4000.0), d, CFG, i * TICK)
        assert not d.mix_confirmed and d.capacity_rps > relaxing   # still relaxing, not held at 40 ÷ 3.5
    d = decide(arriving(heavy(44 * TICK, queue=0.1, kv_cache=0.3), recent=1000.0), d, CFG, 44 * TICK)
    assert d.mix_reference == 0.0


def test_a_shift_the_fleet_does_not_confirm_costs_only_the_ticks_it_lasts():
    """Claims of heavier prompts beside a fleet with headroom (a router's bug, or a burst of absurd sizes that
    got past the clip): the budget is cut while they last, capped at MAX_MIX_SHIFT, and whole the tick after."""
    from pipeline.admission.policy import MAX_MIX_SHIFT

    d = Decision("p")
    for i in range(1, 4):
        d = decide(arriving(heavy(i * TICK, queue=0.2, offered=30.0), recent=1e7, sd=1.0), d, CFG, i * TICK)
        assert d.capacity_rps == 40.0 and not d.capacity_measured
    claimed = d.shed_level
    assert 0 < claimed <= feed_forward_cap(40.0 / MAX_MIX_SHIFT)
    d = decide(arriving(heavy(4 * TICK, queue=0.2, offered=30.0), recent=1000.0), d, CFG, 4 * TICK)
    assert d.capacity_rps == 40.0
    later = [d := decide(heavy(i * TICK, queue=0.2, offered=30.0), d, CFG, i * TICK) for i in range(5, 40)]
    assert later[-1].shed_level == 0.0   # let go in the level's own steps, not a held capacity's minute


def feed_forward_cap(budget: float) -> float:
    """The feed-forward level of ``heavy``'s 30 offered req/s (equal per class) against ``budget``."""
    from pipeline.admission.policy import feed_forward_level

    return feed_forward_level(heavy(TICK, offered=30.0), CFG, budget)


@pytest.mark.parametrize("recent,sd,n,fields", [
    (1200.0, 300.0, 100, {}),            # clearly heavier, but 1.17 times the work: under the threshold
    (1600.0, 3000.0, 100, {}),           # 1.5 times, within three standard errors of the window's (900)
    (4000.0, 300.0, 5, {}),              # too few newest arrivals to say anything
    (4000.0, 300.0, 100, {"prompt_tokens_recent_mean": None}),   # no router sends prompt sizes
    (4000.0, 300.0, 100, {"prompt_tokens_window_sd": "x"}),
    (4000.0, 300.0, 100, {"prompt_tokens_recent_count": float("inf")}),
])
def test_a_mix_within_the_noise_or_the_threshold_or_unread_leaves_the_capacity_alone(recent, sd, n, fields):
    p = arriving(heavy(TICK, queue=0.2), recent=recent, sd=sd, n=n)
    p["axes"]["demand"]["detail"] |= fields
    d = decide(p, Decision("p"), CFG, TICK)
    assert d.capacity_rps == 40.0 and d.shed_level == 0.0


@pytest.mark.parametrize("knob", ["saturated_queue_pressure", "capacity_recovery"])
def test_capacity_knobs_must_be_positive(knob):
    from pipeline.admission.policy import config_from

    with pytest.raises(ValueError, match=knob):
        config_from({knob: 0})


@pytest.mark.parametrize("knob,value,message", [
    ("validity_s", 120, "validity_s = 120 is above its maximum 60"),
    ("defer_min_s", 1e6, "defer_min_s"),
    ("retry_budget", 2, "retry_budget"),
    ("max_redirects", 17, "max_redirects"),
    ("max_redirects", 1.5, "max_redirects must be a finite, non-negative integer"),
    ("step_down", float("nan"), "step_down must be a finite"),
    ("gain", float("inf"), "gain must be a finite"),
    ("level_step_up", -1, "level_step_up"),
    ("enter", [0.8, 1.0, float("nan")], "enter must be a finite"),
])
def test_knobs_that_would_switch_admission_off_fail_at_start_up(knob, value, message):
    """Found by review (session 22): ``validity_s = 120`` passed, and every router refused every signal as
    valid too long (admission off); ``step_down = nan`` made a calm pool's level NaN, admitting nothing."""
    from pipeline.admission.policy import config_from
    from pipeline.settings import SettingsError, load_settings
    from pipeline.worker.pictures import control_loop

    with pytest.raises(ValueError, match=message):
        config_from({knob: value})
    with pytest.raises(SettingsError, match=knob):
        control_loop(load_settings(env={}, dev_signing_key=True, admission_policy={knob: value}))


def test_a_profile_limit_that_is_not_finite_fails_at_start_up():
    from pipeline.load.profiles import build_profiles
    from pipeline.settings import load_settings
    from pipeline.worker.pictures import control_loop

    for value in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kv_limit must be a positive, finite number"):
            build_profiles({"x": {"kv_limit": value}})
        with pytest.raises(ValueError, match="kv_limit"):
            control_loop(load_settings(env={}, dev_signing_key=True, profiles={"x": {"kv_limit": value}}))


def test_the_profiles_figure_of_a_pool_still_being_heard_from_is_not_a_measurement():
    """At a worker's start the first picture may have sampled two replicas of ten: the demand axis's limit is
    a fifth of the pool's. That figure was never measured, so the next picture's full limit applies at once
    (it used to be carried over and climbed back from at the recovery rate: ~40 s of a budget too small)."""
    first = decide(heavy(TICK, limit=8.0), Decision("p"), CFG, TICK)
    assert first.capacity_rps == 8.0 and not first.capacity_measured
    assert decide(heavy(2 * TICK, limit=40.0), first, CFG, 2 * TICK).capacity_rps == 40.0


def test_a_measured_figure_carries_over_when_replicas_join():
    """Carried per replica (twice the replicas: twice the figure), then relaxed toward the profile's with headroom,
    not reset to it."""
    measured = decide(heavy(TICK, queue=1.5, drain=10.0, kv_cache=0.8), Decision("p"), CFG, TICK)
    assert measured.capacity_measured
    grown = decide(heavy(2 * TICK, queue=0.1, kv_cache=0.5, limit=80.0), measured, CFG, 2 * TICK)
    assert grown.capacity_rps == pytest.approx(20.0 + CFG.capacity_recovery * 80.0) and grown.capacity_measured


def test_a_deadband_hold_never_outlasts_the_dwell_of_the_clock_as_it_reads_now():
    """The pool level's hold and each tenant level's begin where ``hold_began`` says: a clock stepped back
    past a hold's start starts it again, rather than holding until the clock is back there."""
    from pipeline.admission.policy import hold_began

    assert hold_began(None, 5_000) == 5_000
    assert hold_began(3_000, 5_000) == 3_000
    assert hold_began(3_600_000, 5_000) == 5_000
