"""Affinity: warm steps (later steps sent back to the replica that holds their context) are shed after other
continuing steps, as far as the pool's caches relieve its binding resource; routers that predate the field
treat them as continuing steps."""

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.admission.policy import (RELIEF_DEADBAND, RELIEF_STEP, SHED_ORDER, AdmissionConfig, Decision,
                                       _fractions, _warm_fractions, cache_relief, changed, config_from, decide)
from pipeline.router import ADMIT, Decider, Request
from tests.unit.test_admission_policy import TICK, picture
from tests.unit.test_tenant_fairness import book_with, loaded, steady

CFG = AdmissionConfig()


def cached(now, share, compute=0.95, kv=0.5, offered=70.0):
    """A pool offered ``offered`` attempts/s against 40 (the feed-forward sheds up to standard, level ~2.2,
    below critical's line), compute binding more than KV, whose requests found ``share`` of their prompt
    tokens cached."""
    p = loaded(now, {"a": offered}, compute=compute, kv_cache=kv)
    p["cache"] = {"prefix_hit_rate": None, "cached_input_share": share, "replica_hit_rates": []}
    return p


def run(shares, cfg=CFG, **kw):
    decision, out = Decision("p"), []
    for i, share in enumerate(shares):
        now = (i + 1) * TICK
        decision = decide(cached(now, share, **kw), decision, cfg, now)
        out.append(decision)
    return out


def test_relief_is_the_cached_share_where_compute_binds_and_less_where_kv_binds():
    assert cache_relief(cached(1, 0.6)) == pytest.approx(0.6)
    assert cache_relief(cached(1, 0.6, compute=0.5, kv=2.0)) == pytest.approx(0.15)   # a cached context holds its KV
    assert cache_relief(cached(1, 0.6, compute=0.0, kv=0.0)) == pytest.approx(0.6)
    assert cache_relief(cached(1, 0.0)) == 0.0
    assert cache_relief(picture()) is None                          # a picture from before the cache readings
    for share in (None, -1.0, 1.5, math.nan, "0.5", True):
        assert cache_relief(cached(1, share)) is None, share        # not measured as a share: unknown, not 0
    for share in (None, 1.5):
        counters = cached(1, share)
        counters["cache"]["prefix_hit_rate"] = 0.4                  # then the replicas' counters: their hit rate
        assert cache_relief(counters) == pytest.approx(0.4)
    broken = picture()
    broken["cache"] = True
    assert cache_relief(broken) is None


def test_a_window_that_measured_no_share_holds_the_warm_fractions_and_a_jump_is_taken_in_steps():
    """A quiet window (no finished attempt, no lookup) says nothing about the caches: alternating with a
    measured share it must not make warm fractions appear and vanish every tick."""
    settled = run([0.8] * 60)[-1]
    decision, now, published = settled, settled.watermark_ms, []
    for i in range(20):
        now += TICK
        after = decide(cached(now, None if i % 2 else 0.8), decision, CFG, now)
        published.append(changed(decision, after))
        assert after.warm_relief == settled.warm_relief
        decision = after
    calm = settled
    for _ in range(20):
        calm = decide(cached(calm.watermark_ms + TICK, 0.8), calm, CFG, calm.watermark_ms + TICK)
    assert published.count(True) <= sum(changed(a, b) for a, b in zip([settled], [calm])) + 2
    dropped = []
    for _ in range(12):
        now += TICK
        decision = decide(cached(now, 0.0), decision, CFG, now)
        dropped.append(decision.warm_relief)
    steps = [a - b for a, b in zip([settled.warm_relief] + dropped, dropped)]
    assert max(steps) <= RELIEF_STEP + 1e-9 and dropped[-1] <= RELIEF_DEADBAND


def test_a_change_of_the_warm_fractions_alone_is_published():
    decision = run([0.8] * 60)[-1]
    other = replace(decision, signal=dict(decision.signal, warm_task_admit_fraction={c: 1.0 for c in SHED_ORDER}))
    assert changed(decision, other) and not changed(decision, decision)
    gone = replace(decision, signal={k: v for k, v in decision.signal.items() if k != "warm_task_admit_fraction"})
    assert changed(decision, gone)


def test_warm_steps_are_shed_after_continuing_steps_which_are_shed_after_new_work():
    decisions = run([0.8] * 60)
    assert any("warm_task_admit_fraction" in d.signal for d in decisions)
    for d in decisions:
        new, cont = d.signal["admit_fraction"], d.signal["continuing_task_admit_fraction"]
        warm = d.signal.get("warm_task_admit_fraction", cont)
        assert all(new[c] <= cont[c] <= warm[c] for c in SHED_ORDER), d.signal
    last = decisions[-1]
    # the credit: continuing_credit + warm_credit × relief levels after new work (no further than critical's
    # line), no more
    credit = CFG.continuing_credit + min(CFG.warm_credit * last.warm_relief, 3.0 - last.shed_level)
    shed = sum(1 - last.signal["warm_task_admit_fraction"][c] for c in SHED_ORDER)
    assert shed == pytest.approx(max(0.0, last.shed_level - credit), abs=1e-6)


def test_no_warm_fractions_without_a_cache_or_without_shedding():
    assert not any("warm_task_admit_fraction" in d.signal for d in run([None] * 40))
    assert not any("warm_task_admit_fraction" in d.signal for d in run([0.9] * 40, offered=30.0))
    off = config_from({"warm_credit": 0})
    assert not any("warm_task_admit_fraction" in d.signal for d in run([0.9] * 40, cfg=off))


@given(st.lists(st.floats(-RELIEF_DEADBAND * 0.9, RELIEF_DEADBAND * 0.9), min_size=40, max_size=40))
def test_the_cached_share_wobbling_within_the_deadband_does_not_move_routers_fractions(noise):
    """The same pool with and without the share's noise: every tick's signal carries the same fractions."""
    settled = run([0.5] * 40)[-1]
    noisy = calm = settled
    now, centre = settled.watermark_ms, settled.warm_relief   # within the deadband of 0.5, where it stopped
    for n in noise:
        now += TICK
        noisy = decide(cached(now, centre + n), noisy, CFG, now)
        calm = decide(cached(now, centre), calm, CFG, now)
        assert noisy.warm_relief == calm.warm_relief
        assert noisy.signal["warm_task_admit_fraction"] == calm.signal["warm_task_admit_fraction"]


def test_an_absurd_cache_reading_buys_warm_steps_at_most_the_credit_and_never_touches_new_work():
    """A forged or broken reading (every prompt token cached) is worth at most ``warm_credit`` levels to warm
    steps; new work and other continuing steps are shed exactly as without it."""
    absurd, none = run([1.0] * 60), run([None] * 60)
    for a, b in zip(absurd, none):
        assert a.shed_level == b.shed_level
        assert a.signal["admit_fraction"] == b.signal["admit_fraction"]
        assert a.signal["continuing_task_admit_fraction"] == b.signal["continuing_task_admit_fraction"]
        assert 0.0 <= a.warm_relief <= 1.0


def test_warm_steps_get_no_extra_credit_past_criticals_line():
    """Once critical's new work is shed (level ≥ 3), a warm step of a lower class is admitted like any other
    continuing step: the extra credit shrinks to what separates the level from that line."""
    for level in (2.6, 2.9, 3.0, 3.3):
        cont = _fractions(level, CFG)[1]
        warm = _warm_fractions(level, 1.0, cont, CFG)
        assert sum(warm.values()) - sum(cont.values()) == pytest.approx(
            min(1.0, max(0.0, 3.0 - level)), abs=1e-6), (level, warm, cont)


@pytest.mark.parametrize("knob", ["continuing_credit", "warm_credit"])
@pytest.mark.parametrize("value", [-0.1, 4.5, math.nan])
def test_credit_knobs_out_of_range_fail_at_start_up(knob, value):
    with pytest.raises(ValueError, match="credit"):
        config_from({knob: value})


def _decider(decision):
    now = decision.signal["issued_at"]
    return Decider(book_with(decision.signal, now), seed=5, clock=lambda: now / 1000)


def _share(decider, request, asks=2000):
    return sum(decider.decide(request) == ADMIT for _ in range(asks)) / asks


def test_the_router_admits_warm_steps_by_their_own_fractions():
    decision = run([0.8] * 60)[-1]
    warm, cont = decision.signal["warm_task_admit_fraction"], decision.signal["continuing_task_admit_fraction"]
    klass = next(c for c in SHED_ORDER if warm[c] > cont[c])
    decider = _decider(decision)
    assert _share(decider, Request("p", klass, continuing=True, warm=True)) == pytest.approx(warm[klass], abs=0.04)
    assert _share(decider, Request("p", klass, continuing=True)) == pytest.approx(cont[klass], abs=0.04)
    # a first step is never warm, whatever the flag says: it has no context anywhere yet
    assert _share(decider, Request("p", klass, warm=True)) == pytest.approx(
        decision.signal["admit_fraction"][klass], abs=0.04)


def test_a_router_from_before_warm_fractions_sheds_warm_steps_as_continuing(monkeypatch):
    import pipeline.router.signal_book as signal_book

    decision = run([0.8] * 60)[-1]
    monkeypatch.setattr(signal_book, "KNOWN_FIELDS", signal_book.KNOWN_FIELDS - {"warm_task_admit_fraction"})
    decider = _decider(decision)
    assert "warm_task_admit_fraction" not in decider.book.signals["p"]
    cont = decision.signal["continuing_task_admit_fraction"]
    klass = next(c for c in SHED_ORDER if decision.signal["warm_task_admit_fraction"][c] > cont[c])
    assert _share(decider, Request("p", klass, continuing=True, warm=True)) == pytest.approx(cont[klass], abs=0.04)


def test_a_listed_tenants_warm_steps_follow_its_own_continuing_fractions():
    """Affinity never lets a tenant over its fair share keep more than its own level allows."""
    start = Decision("p")
    decision = steady({"noisy": 35.0, "b": 7.0, "c": 7.0, "d": 7.0}, start=start)
    entry = {e["tenant"]: e for e in decision.signal["tenant_admit_fraction"]}["noisy"]
    signal = dict(decision.signal, warm_task_admit_fraction={c: 1.0 for c in SHED_ORDER})
    decider = _decider(Decision("p", signal=signal))
    for klass in ("sheddable", "standard"):
        own = entry["continuing_task_admit_fraction"][klass]
        assert _share(decider, Request("p", klass, continuing=True, warm=True, tenant="noisy")) == pytest.approx(
            own, abs=0.04)
        assert _share(decider, Request("p", klass, continuing=True, warm=True, tenant="b")) == 1.0
