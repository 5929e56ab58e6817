"""Fair shares between tenants: the shares, the policy's tenant levels, the signal's list and the router."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.admission.policy import (SHED_ORDER, AdmissionConfig, Decision, config_from, decide, next_rest_level,
                                       tenant_levels)
from pipeline.admission.signing import sign
from pipeline.admission.tenant_shares import (MAX_LISTED, MAX_WORK_RATIO, MIN_TENANT_FINISHED, admitted_at,
                                              admitted_work_ratio, fair_shares)
from pipeline.load.aggregates import OTHER_TENANTS
from pipeline.router import ADMIT, Decider, Request, SignalBook
from tests.unit.test_admission_policy import TICK, picture

CFG = AdmissionConfig()
MIX = {"critical": 0.1, "standard": 0.5, "sheddable": 0.25, "deferrable": 0.15}
KEYS = {"k1": b"k" * 32}


def loaded(now, tenants: dict[str, float], limit=40.0, **pressures):
    """A pool whose tenants offer these attempts/s, each in the same class mix, against ``limit`` req/s."""
    p = picture(watermark=now, **pressures)
    total = sum(tenants.values())
    p["axes"]["demand"]["limit"] = limit
    p["axes"]["demand"]["detail"] |= {"offered_rps": {c: total * MIX[c] for c in SHED_ORDER},
                                      "admitted_rps": min(total, 0.95 * limit)}   # between recovery and target: no trim
    p["tenants"] = [{"tenant": t, "offered_rps": rate, "admitted_rps": rate,
                     "offered_rps_by_class": {c: rate * MIX[c] for c in SHED_ORDER}} for t, rate in tenants.items()]
    return p


def steady(tenants, cfg=CFG, ticks=40, start=None, **kw):
    decision = start or Decision("p")
    now = decision.watermark_ms
    for _ in range(ticks):
        now += TICK
        decision = decide(loaded(now, tenants, **kw), decision, cfg, now)
    return decision


def listed(decision) -> dict[str, dict]:
    return {e["tenant"]: e for e in decision.signal.get("tenant_admit_fraction", ())}


def admitted(decision, tenant, rates):
    entry = listed(decision).get(tenant)
    fractions = entry["admit_fraction"] if entry else decision.signal["admit_fraction"]
    return sum(rates[tenant] * MIX[c] * fractions[c] for c in SHED_ORDER)


def test_shares_are_weighted_max_min_fair():
    assert fair_shares({"a": 30, "b": 4, "c": 4}, {}, 1.0, 20) == pytest.approx({"a": 12, "b": 4, "c": 4})
    assert fair_shares({"a": 30, "b": 30}, {"a": 3.0}, 1.0, 20) == pytest.approx({"a": 15, "b": 5})
    assert fair_shares({"a": 3, "b": 4}, {}, 1.0, 20) == {"a": 3, "b": 4}


@given(st.dictionaries(st.sampled_from("abcdefgh"), st.floats(0, 1000), min_size=1),
       st.dictionaries(st.sampled_from("abcdefgh"), st.floats(0.1, 10)), st.floats(0, 3000))
def test_no_tenant_gets_more_than_it_asks_and_one_below_its_ask_has_the_most_per_weight(asked, weights, budget):
    shares = fair_shares(asked, weights, 1.0, budget)
    assert sum(shares.values()) == pytest.approx(min(budget, sum(asked.values())), rel=1e-9, abs=1e-6)
    for tenant, share in shares.items():
        assert share <= asked[tenant] + 1e-9
        if share < asked[tenant] - 1e-6:   # held back: nobody gets more per unit of weight
            mine = share / weights.get(tenant, 1.0)
            assert all(s / weights.get(t, 1.0) <= mine + 1e-6 for t, s in shares.items())


def test_a_bursting_tenant_is_shed_alone_while_the_pool_has_capacity_for_the_others():
    """Four tenants at 7 req/s each fit a 40 req/s pool; one bursts to 35: it alone is listed, its own lower
    classes go first (critical untouched), and the others are not rejected at all (their deferrable work
    is deferred with everyone's: delay, not loss)."""
    rates = {"noisy": 35.0, "b": 7.0, "c": 7.0, "d": 7.0}
    fair = steady(rates)
    unfair = steady(rates, cfg=config_from({"tenant_fairness": False}))
    assert set(listed(fair)) == {"noisy"}
    noisy = listed(fair)["noisy"]["admit_fraction"]
    assert noisy["critical"] == 1.0 and noisy["deferrable"] == 0.0 and noisy["standard"] < 1.0
    rest = fair.signal["admit_fraction"]
    assert rest["critical"] == rest["standard"] == rest["sheddable"] == 1.0
    # the same work is admitted in all, as without fairness: fairness decides whose, not how much
    total_fair = sum(admitted(fair, t, rates) for t in rates)
    total_unfair = sum(admitted(unfair, t, rates) for t in rates)
    assert total_fair == pytest.approx(total_unfair, rel=0.02)
    assert admitted(fair, "b", rates) > admitted(unfair, "b", rates)


def test_with_every_tenant_alike_fairness_changes_nothing():
    rates = {t: 20.0 for t in "abcd"}
    fair, unfair = steady(rates), steady(rates, cfg=config_from({"tenant_fairness": False}))
    assert fair.shed_level > 1 and "tenant_admit_fraction" not in fair.signal
    assert fair.signal["admit_fraction"] == unfair.signal["admit_fraction"]


def test_a_weighted_tenant_is_listed_later_than_an_unweighted_one():
    rates = {"big": 30.0, "heavy": 30.0, "c": 5.0}
    decision = steady(rates, cfg=config_from({"tenant_weights": {"heavy": 3}}))
    assert set(listed(decision)) == {"big"}
    assert admitted(decision, "heavy", rates) > 2 * admitted(decision, "big", rates)


def test_the_other_row_is_never_listed_and_the_list_is_bounded():
    rates = {f"t{i:02d}": 1.0 for i in range(20)} | {OTHER_TENANTS: 200.0}
    assert OTHER_TENANTS not in listed(steady(rates))
    many = {f"t{i:02d}": 10.0 + 3 * i for i in range(24)}
    crowded = steady(many, cfg=config_from({"fair_share_tolerance": 0.0}), limit=400.0)
    assert 0 < crowded.shed_level < 3 and 0 < len(listed(crowded)) <= MAX_LISTED


def test_a_stale_picture_holds_the_tenant_list_then_lets_it_go():
    decision = steady({"noisy": 35.0, "b": 7.0, "c": 7.0, "d": 7.0})
    assert listed(decision)
    frozen = loaded(decision.watermark_ms, {"noisy": 35.0, "b": 7.0, "c": 7.0, "d": 7.0})
    now = decision.watermark_ms
    held = decide(frozen, decision, CFG, now + int((CFG.stale_after_s + 1) * 1000))
    assert held.state == "stale"
    assert {t: e["admit_fraction"] for t, e in listed(held).items()} == {
        t: e["admit_fraction"] for t, e in listed(decision).items()}
    later = held
    for i in range(200):
        later = decide(frozen, later, CFG, now + int((CFG.stale_after_s + CFG.stale_hold_s + 1) * 1000) + i * TICK)
    assert not listed(later) and later.shed_level == 0.0


@pytest.mark.parametrize("weights", [[1, 2], {"a": 0}, {"a": -1}, {"a": float("inf")}, {"a": True}, {"": 1}])
def test_bad_tenant_weights_fail_at_start_up(weights):
    with pytest.raises(ValueError, match="tenant_weights"):
        config_from({"tenant_weights": weights})


def book_with(signal: dict, now_ms: int) -> SignalBook:
    book = SignalBook(KEYS, clock=lambda: now_ms / 1000)
    body = {"event_id": "0b6f3a52-9a38-4f0e-8d6e-3f0c1f1a2b3c", "event_time": now_ms, **signal}
    assert book.offer(sign(body, "k1", KEYS["k1"])), book.refused
    return book


def test_the_router_sheds_a_listed_tenant_by_its_own_fractions_and_no_one_else():
    decision = steady({"noisy": 35.0, "b": 7.0, "c": 7.0, "d": 7.0})
    now = decision.signal["issued_at"]
    decider = Decider(book_with(decision.signal, now), seed=3, clock=lambda: now / 1000)
    asks = 2000

    def admitted_share(tenant, priority):
        return sum(decider.decide(Request("p", priority, tenant=tenant)) == ADMIT for _ in range(asks)) / asks

    noisy = listed(decision)["noisy"]["admit_fraction"]
    assert admitted_share("noisy", "standard") == pytest.approx(noisy["standard"], abs=0.04)
    assert admitted_share("noisy", "sheddable") == 0.0
    assert admitted_share("b", "sheddable") == 1.0 and admitted_share(None, "sheddable") == 1.0
    assert admitted_share("noisy", "critical") == 1.0


def test_a_router_from_before_the_tenant_list_follows_a_signal_that_carries_one(monkeypatch):
    """Expand before contract, tested: a router built before ``tenant_admit_fraction`` existed (it knows the
    fields below) keeps accepting the new signals and follows the pool's fractions, ignoring the list."""
    import pipeline.router.signal_book as signal_book

    before = frozenset({"schema_version", "event_id", "event_time", "pool", "seq", "issued_at", "valid_until",
                        "state", "pressure", "axes", "admit_fraction", "continuing_task_admit_fraction",
                        "max_predicted_wait_s", "retry_budget", "redirect", "defer", "reasons", "key_id",
                        "signature"})
    assert before < signal_book.KNOWN_FIELDS
    monkeypatch.setattr(signal_book, "KNOWN_FIELDS", before)
    decision = steady({"noisy": 35.0, "b": 7.0, "c": 7.0, "d": 7.0})
    assert listed(decision)
    now = decision.signal["issued_at"]
    book = book_with(decision.signal, now)
    assert "tenant_admit_fraction" not in book.signals["p"] and book.tenants["p"] == {}
    decider = Decider(book, seed=3, clock=lambda: now / 1000)
    assert all(decider.decide(Request("p", "sheddable", tenant="noisy")) == ADMIT for _ in range(200))


def test_phantom_tenant_rows_beyond_the_pools_own_counts_do_not_shrink_the_real_tenants_shares():
    """Rows come from partials any worker can write: a row claiming 200 req/s the pool's own counts do not
    have is scaled down with the rest to what the pool offers, so the real tenants keep their shares."""
    rates = {"noisy": 35.0, "b": 7.0, "c": 7.0, "d": 7.0}
    decision, forged = Decision("p"), Decision("p")
    for i in range(1, 41):
        now = i * TICK
        decision = decide(loaded(now, rates), decision, CFG, now)
        p = loaded(now, rates)
        p["tenants"].append({"tenant": "ghost", "offered_rps": 200.0, "admitted_rps": 0.0,
                             "offered_rps_by_class": {c: 200.0 * MIX[c] for c in SHED_ORDER}})
        forged = decide(p, forged, CFG, now)
    assert forged.shed_level == decision.shed_level
    assert admitted(forged, "b", rates) >= 0.7 * admitted(decision, "b", rates)


def test_a_listed_tenants_tasks_under_way_are_shed_after_its_new_ones_not_at_the_rests_fractions():
    decision = steady({"noisy": 35.0, "b": 7.0, "c": 7.0, "d": 7.0})
    entry = listed(decision)["noisy"]
    for c in SHED_ORDER:
        assert entry["admit_fraction"][c] <= entry["continuing_task_admit_fraction"][c]
        assert entry["continuing_task_admit_fraction"][c] <= decision.signal["continuing_task_admit_fraction"][c]
    assert entry["continuing_task_admit_fraction"] != decision.signal["continuing_task_admit_fraction"]


@pytest.mark.parametrize("knob", ["fair_share_tolerance", "fair_share_sigmas", "default_tenant_weight"])
def test_a_nan_fairness_knob_fails_at_start_up(knob):
    with pytest.raises(ValueError):
        config_from({knob: float("nan")})


def test_a_tenant_level_is_not_held_above_its_share_while_nobody_else_can_take_in_what_it_sheds():
    """The deadband holds a tenant's level against noise, but not above what its share needs while the rest
    admit everything they offer: what the held level sheds then goes to nobody, and the pool runs under the
    budget its own level set. The burst easing a little (a move smaller than the deadband) must give the
    tenant back what the budget has room for — in the pool level's bounded steps."""
    rates = {"noisy": 35.0, "b": 7.0, "c": 7.0, "d": 7.0}
    fair = steady(rates)
    assert set(listed(fair)) == {"noisy"}
    eased = {**rates, "noisy": 34.0}
    before = dict(fair.tenant_levels)["noisy"]
    for _ in range(4):
        previous = dict(fair.tenant_levels)["noisy"]
        fair = steady(eased, start=fair, ticks=1)
        assert previous - dict(fair.tenant_levels)["noisy"] <= CFG.level_step_down + 1e-9
    assert dict(fair.tenant_levels)["noisy"] < before
    assert fair.signal["admit_fraction"]["sheddable"] == 1.0   # the rest admit all they offer
    budget = admitted_at([sum(eased.values()) * MIX[c] for c in SHED_ORDER], fair.shed_level)
    assert sum(admitted(fair, t, eased) for t in eased) == pytest.approx(budget, rel=0.005)


def test_while_the_rest_can_take_in_more_a_tenant_level_is_held_by_the_deadband():
    """Where the rest are shed too (their level above its floor), a tenant level held a little high costs no
    budget — the rest's level gives it to them — so the deadband holds it against noise as before."""
    rates = {"noisy": 30.0, "b": 20.0, "c": 20.0, "d": 20.0}
    fair = steady(rates)
    assert set(listed(fair)) == {"noisy"} and fair.rest_level > 2.0   # the rest shed some standard work
    before = dict(fair.tenant_levels)["noisy"]
    fair = steady({**rates, "noisy": 29.0}, start=fair, ticks=4)
    assert dict(fair.tenant_levels)["noisy"] == before


def test_a_tenant_level_held_short_of_its_share_moves_there_after_the_dwell():
    """The deadband holds a tenant's level for at most ``dwell_s``, as it does the pool's: a level held just
    short of what the share needs makes the rest pay for the gap for as long as it lasts (noisy-neighbour
    with clients that ignore Retry-After, seed 2: 70 s, the others' sheddable work shed whole)."""
    rates = {"noisy": 30.0, "b": 20.0, "c": 20.0, "d": 20.0}
    fair = steady(rates, ticks=int(3 * CFG.dwell_s * 1000 / TICK))   # settled: longer than any hold
    before = dict(fair.tenant_levels)["noisy"]
    louder = {**rates, "noisy": 32.0}
    held = steady(louder, start=fair, ticks=1)
    assert dict(held.tenant_levels)["noisy"] == before, "a move within the deadband is held at first"
    later = steady(louder, start=held, ticks=int(CFG.dwell_s * 1000 / TICK))
    assert dict(later.tenant_levels)["noisy"] > before
    assert later.rest_level < held.rest_level, "what the tenant sheds beyond its old level goes to the rest"


def test_a_tenant_target_that_wobbles_across_its_level_is_held_past_the_dwell():
    """Noise moves the target to either side of the level: each crossing starts the clock again, so the
    level holds for as long as the target only wobbles."""
    rates = {"noisy": 30.0, "b": 20.0, "c": 20.0, "d": 20.0}
    fair = steady(rates, ticks=int(3 * CFG.dwell_s * 1000 / TICK))
    before = dict(fair.tenant_levels)["noisy"]
    for i in range(int(3 * CFG.dwell_s * 1000 / TICK)):
        fair = steady({**rates, "noisy": 30.5 if i % 8 < 4 else 29.5}, start=fair, ticks=1)
        assert dict(fair.tenant_levels)["noisy"] == before


def test_a_tenant_held_at_the_pool_level_is_listed_once_the_dwell_is_over():
    """A tenant whose share needs a level just above the pool's is held there first; the hold is kept while
    the tenant is wanted, though it is not listed yet, so it ends."""
    listed_at = None
    levels, held = {}, {}
    for tick in range(40):
        now = tick * TICK
        levels, held = tenant_levels({"x": 1.05}, levels, 1.0, CFG, now, held)
        if "x" in levels and listed_at is None:
            listed_at = now
    assert listed_at is not None and CFG.dwell_s * 1000 <= listed_at <= CFG.dwell_s * 1000 + TICK
    assert levels == {"x": 1.05}


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 0.05))
def test_fractions_do_not_saw_with_a_tenant_listed_under_noisy_steady_load(seed, noise):
    """Routers feel flapping as reversals of the fractions they act on. With one tenant listed and every
    tenant's rate wobbling independently by up to ±5% each tick (harsher than a window's rates, which share
    most of their window from one picture to the next), the listed tenant's fractions turn back at most once
    per dwell (at most 14 times in two minutes over 400 runs at ±5%): a wobble across its level restarts the
    hold's clock. The rest's fractions turn with those levels' moves and, their turns back up held by a
    deadband of their own, about once per dwell on the rates' noise: 27 turns in two minutes at worst over
    seeds 0-1,999 (46 without their hold, 15.9 against 21.7 on average), bounded here at 1.5 per dwell
    (the tests below fail without the hold)."""
    import random

    from pipeline.admission.flapping import reversals

    rng = random.Random(seed)
    rates = {"noisy": 30.0, "b": 20.0, "c": 20.0, "d": 20.0}
    decision = steady(rates)
    now = decision.watermark_ms
    tenant, rest = [], []
    for _ in range(480):
        now += TICK
        decision = decide(loaded(now, {t: r * (1 + rng.uniform(-noise, noise)) for t, r in rates.items()}),
                          decision, CFG, now)
        assert set(listed(decision)) == {"noisy"}
        tenant.append(listed(decision)["noisy"]["admit_fraction"])
        rest.append(decision.signal["admit_fraction"])
    dwells = 480 * TICK / 1000 / CFG.dwell_s
    assert reversals(tenant) <= dwells
    assert reversals(rest) <= 1.5 * dwells


def test_the_rests_fractions_hold_against_noise_while_the_levels_stand_still():
    """With one tenant listed and the others' rates sawing ±8% a tick for a dwell, the pool's level and the
    tenant's are held by their deadbands, and so is the rest's: it sheds less at once, then holds there
    (one reversal; 17 without its hold)."""
    from pipeline.admission.flapping import reversals

    rates = {"noisy": 30.0, "b": 20.0, "c": 20.0, "d": 20.0}
    decision = steady(rates, ticks=int(3 * CFG.dwell_s * 1000 / TICK))
    now, rest, levels = decision.watermark_ms, [], set()
    for tick in range(int(CFG.dwell_s * 1000 / TICK) - 1):
        now += TICK
        wobble = 1.08 if tick % 2 else 0.92
        decision = decide(loaded(now, {t: r * (1 if t == "noisy" else wobble) for t, r in rates.items()}),
                          decision, CFG, now)
        rest.append(decision.signal["admit_fraction"])
        levels.add((decision.shed_level, dict(decision.tenant_levels)["noisy"]))
    assert len(levels) <= 2, "the pool's level and the tenant's moved once at most (the first tick's step)"
    assert reversals(rest) <= 1


def test_a_clock_stepped_back_does_not_stretch_a_tenant_hold():
    """A worker clock set back an hour: the hold starts again at the clock as it reads now and lasts the
    dwell, not the hour until the clock is back where the hold began."""
    hour = 3_600_000
    levels, held = tenant_levels({"x": 1.05}, {}, 1.0, CFG, hour, {})
    assert levels == {} and held == {"x": (hour, 1)}
    for tick in range(40):
        levels, held = tenant_levels({"x": 1.05}, levels, 1.0, CFG, tick * TICK, held)
    assert levels == {"x": 1.05}


@pytest.mark.parametrize("seed", range(3))
def test_the_rests_hold_reads_a_pool_level_that_stood_still_as_still(seed):
    """The pool's total steady and its split between two tenants wobbling ±5% a tick: the stored pool and
    tenant levels never move, so the rest's turns back up are held. The pool's level is compared as it is
    stored (rounded): compared unrounded it differed in the last digits on nearly every tick, which
    switched the hold off (59-84 reversals in two minutes; 4-14 with it)."""
    import random

    from pipeline.admission.flapping import reversals

    rng = random.Random(seed)
    rates = {"noisy": 30.0, "b": 20.0, "c": 20.0, "d": 20.0}
    decision = steady(rates, ticks=int(3 * CFG.dwell_s * 1000 / TICK))
    now, rest, levels = decision.watermark_ms, [], set()
    for _ in range(480):
        now += TICK
        wobble = rng.uniform(-0.05, 0.05)
        decision = decide(loaded(now, {**rates, "noisy": 30 * (1 + wobble), "b": 20 - 30 * wobble}), decision, CFG, now)
        rest.append(decision.signal["admit_fraction"])
        levels.add((decision.shed_level, decision.tenant_levels))
    assert len(levels) == 1
    assert reversals(rest) <= 480 * TICK / 1000 / CFG.dwell_s


def test_the_rests_hold_lasts_at_most_the_dwell_and_never_outlives_a_levels_move():
    """A turn of the rest's level back up (shedding more) within the deadband is held while the levels it
    follows stand still, for at most ``dwell_s``; a turn down (shedding less) is never held, since the rest
    would pay for the hold; a move of the pool's level or a tenant's passes to the rest at once, and with
    nobody listed nothing is held."""
    tenants = {"x": 3.0}
    previous = Decision("p", shed_level=2.5, tenant_levels=tuple(tenants.items()), rest_level=2.0, rest_direction=-1)
    now, ticks = 0, []
    while True:
        now += TICK
        level, held = next_rest_level(2.05, previous, 2.5, tenants, CFG, now)
        if level != 2.0:
            break
        ticks.append(now)
        previous = replace(previous, rest_held_since_ms=held)
    assert level == 2.05 and CFG.dwell_s * 1000 - TICK <= len(ticks) * TICK <= CFG.dwell_s * 1000
    fresh = replace(previous, rest_held_since_ms=0)
    assert next_rest_level(2.05, fresh, 2.5, {"x": 3.1}, CFG, now)[0] == 2.05, "the tenant's level moved"
    assert next_rest_level(2.05, fresh, 2.4, tenants, CFG, now)[0] == 2.05, "the pool's level moved"
    assert next_rest_level(2.05, fresh, 2.5, {}, CFG, now)[0] == 2.05, "nobody listed: no hold"
    assert next_rest_level(1.95, replace(fresh, rest_direction=1), 2.5, tenants, CFG, now)[0] == 1.95, "shedding less"


def work_row(tenant, offered, admitted, seconds_per_request, finished_rps=5.0):
    return {"tenant": tenant, "offered_rps": offered, "admitted_rps": admitted, "finished_rps": finished_rps,
            "service_s_per_s": finished_rps * seconds_per_request}


def test_shedding_a_heavy_tenant_admits_lighter_work_and_the_ratio_says_how_much():
    rows = [work_row("heavy", 30, 10, 3.0), work_row("light", 10, 10, 1.0)]
    # offered: (30×3 + 10×1) / 40 = 2.5 s in service a request; admitted: (10×3 + 10×1) / 20 = 2
    assert admitted_work_ratio(rows, 10.0) == pytest.approx(0.8)
    rows = [work_row("heavy", 10, 10, 3.0), work_row("light", 30, 10, 1.0)]   # a light tenant shed: heavier
    assert admitted_work_ratio(rows, 10.0) == pytest.approx(2.0 / 1.5)
    alike = [work_row("a", 30, 10, 1.5), work_row("b", 10, 10, 1.5)]
    assert admitted_work_ratio(alike, 10.0) == pytest.approx(1.0)


def test_a_tenant_with_too_few_finished_attempts_counts_at_the_pools_mean_and_none_known_says_nothing():
    few = (MIN_TENANT_FINISHED - 1) / 10.0
    rows = [work_row("new", 30, 10, 100.0, finished_rps=few), work_row("b", 10, 10, 1.0)]
    mean = (few * 100 + 5 * 1) / (few + 5)   # not 100 s: nine requests say little about a tenant
    expected = ((10 * mean + 10 * 1) / 20) / ((30 * mean + 10 * 1) / 40)
    assert admitted_work_ratio(rows, 10.0) == pytest.approx(expected) and expected > 1 / MAX_WORK_RATIO
    rows[1] = work_row("b", 10, 10, 1.0, finished_rps=few)
    assert admitted_work_ratio(rows, 10.0) == 1.0
    assert admitted_work_ratio([{"tenant": "a", "offered_rps": 5, "admitted_rps": 1}], 10.0) == 1.0
    assert admitted_work_ratio([], 10.0) == 1.0
    assert admitted_work_ratio([work_row("a", 0, 0, 1.0)], 10.0) == 1.0
    older = [{"tenant": t, "offered_rps": o, "admitted_rps": 10, "finished_rps": 5.0, "finished_tokens_per_s": w}
             for t, o, w in (("heavy", 30, 15_000), ("light", 10, 5000))]   # rows of session 43's workers
    assert admitted_work_ratio(older, 10.0) == 1.0


@given(st.lists(st.tuples(st.floats(0, 1e6), st.floats(0, 1e6), st.floats(0, 1e9), st.floats(0, 1e4)),
                min_size=1, max_size=17))
def test_the_work_ratio_is_bounded_whatever_the_rows_say(values):
    """The rows come from partials: no row moves the requests/s ceiling more than MAX_WORK_RATIO either way."""
    rows = [{"tenant": f"t{i}", "offered_rps": o, "admitted_rps": a, "service_s_per_s": w, "finished_rps": f}
            for i, (o, a, w, f) in enumerate(values)]
    assert 1 / MAX_WORK_RATIO <= admitted_work_ratio(rows, 10.0) <= MAX_WORK_RATIO


def with_work(p, rates, fractions_by_tenant, seconds):
    """``p``'s tenant rows admitted at each tenant's fractions, with each tenant's seconds in service a finished
    request."""
    for row in p["tenants"]:
        fractions = fractions_by_tenant.get(row["tenant"])
        row["admitted_rps"] = (sum(rates[row["tenant"]] * MIX[c] * fractions[c] for c in SHED_ORDER)
                               if fractions else row["offered_rps"])
        row |= {"finished_rps": 5.0, "service_s_per_s": 5.0 * seconds[row["tenant"]]}
    return p


def test_while_a_heavy_tenant_is_shed_the_requests_ceiling_is_read_in_the_work_admitted():
    """Shedding a tenant whose requests are heavier and admitting the others' lighter ones in its place at the
    same requests/s leaves the fleet under-filled (noisy-neighbour: the KV cache at 0.54–0.67 of its limit
    against 0.63–0.81 without fairness): while a tenant is listed, the demand axis's admitted rate is read
    × the admitted work per request ÷ the offered, so the pool's level admits about the work it would
    without fairness. With no tenant listed the rows change nothing."""
    rates = {"noisy": 35.0, "b": 7.0, "c": 7.0, "d": 7.0}
    seconds = {"noisy": 4.0, "b": 1.0, "c": 1.0, "d": 1.0}
    fair = steady(rates)
    assert set(listed(fair)) == {"noisy"}
    now = fair.watermark_ms + TICK
    shed = {"noisy": listed(fair)["noisy"]["admit_fraction"]}

    def over(p):   # admitted above the ceiling: the demand axis drives
        p["axes"]["demand"]["detail"]["admitted_rps"] = 1.2 * p["axes"]["demand"]["limit"]
        return p

    plain = decide(over(loaded(now, rates)), fair, CFG, now)
    weighed = decide(over(with_work(loaded(now, rates), rates, shed, seconds)), fair, CFG, now)
    assert weighed.signal["pressure"] < plain.signal["pressure"] == pytest.approx(1.2)
    assert weighed.shed_level < plain.shed_level
    assert any("work" in r["note"] for r in weighed.signal["reasons"])
    assert not any("work" in r["note"] for r in plain.signal["reasons"])
    light = {t: 1.0 for t in rates}
    alike = decide(over(with_work(loaded(now, rates), rates, shed, light)), fair, CFG, now)
    assert alike.signal["pressure"] == pytest.approx(plain.signal["pressure"])
    calm = Decision("p", watermark_ms=fair.watermark_ms, last_fresh_ms=fair.last_fresh_ms)   # nobody listed
    assert (decide(over(with_work(loaded(now, rates), rates, shed, seconds)), calm, CFG, now).signal["pressure"]
            == pytest.approx(decide(over(loaded(now, rates)), calm, CFG, now).signal["pressure"]))
