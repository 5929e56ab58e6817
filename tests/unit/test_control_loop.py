"""The pure control loop's bounds: invented pool names cannot grow its state or its signal traffic."""

import tracemalloc

from pipeline.admission.policy import AdmissionConfig
from pipeline.control_loop import ControlLoop
from pipeline.events import RequestEvent
from pipeline.load.config import PictureConfigs
from pipeline.load.partial import PartialBuilder
from pipeline.settings import load_settings
from pipeline.sim.specimens import request_event


def loop(**bounds):
    return ControlLoop(PictureConfigs(load_settings(env={})), AdmissionConfig(), "k", b"s" * 16, 2000, **bounds)


def partial_for(pool, event_time, n):
    builder = PartialBuilder(f"raw/{n}", 15)
    builder.fold_request(RequestEvent(**request_event(pool=pool, event_time=event_time)))
    (partial,) = builder.drain(n)
    return partial


def test_100k_invented_pool_names_leave_memory_and_signal_traffic_bounded():
    control = loop(max_pools=1000)
    now = 1_700_000_000_000
    tracemalloc.start()
    for i in range(1_000):
        control.merge(partial_for(f"real-{i}", now, i))
    settled = tracemalloc.get_traced_memory()[0]
    for i in range(100_000):
        assert control.merge(partial_for(f"invented-{i}", now, i)) is None
    grown = tracemalloc.get_traced_memory()[0] - settled
    tracemalloc.stop()
    assert len(control.states) == 1000 and control.refused_pools == 100_000
    assert grown < 5 << 20, f"{grown / 2**20:.1f} MiB for refused pools"
    step = control.step(now + 1000)
    assert len(step.signals) == 1000 and len(control.step(now + 1250).signals) == 0, "heartbeats, not floods"


def test_an_idle_pool_is_forgotten_and_its_place_freed():
    control = loop(max_pools=1, pool_idle_ms=60_000)
    now = 1_700_000_000_000
    control.merge(partial_for("a", now, 1))
    assert control.merge(partial_for("b", now, 2)) is None and control.refused_pools == 1
    control.step(now + 1000)
    assert control.step(now + 60_000).forgotten == [], "idle for 59 s"
    step = control.step(now + 61_001)
    assert step.forgotten == ["a"] and not control.states and not control.decisions and not control.pictures
    assert control.merge(partial_for("b", now + 61_000, 3)) is not None


def test_a_forgotten_pool_releases_the_partials_it_held():
    control = loop(pool_idle_ms=60_000)
    now = 1_700_000_000_000
    control.merge(partial_for("a", now, 1))
    control.merge(partial_for("a", now + 500, 2))
    control.step(now + 1000)
    step = control.step(now + 61_001)
    assert step.forgotten == ["a"] and sorted(step.released) == [("a", "raw/1/1"), ("a", "raw/2/2")]


def test_rebuild_leaves_out_pools_idle_past_pool_idle_and_keeps_the_others_idle_clocks():
    control = loop(pool_idle_ms=60_000)
    now = 1_700_000_000_000
    partials = [partial_for("idle", now - 90_000, 1), partial_for("busy", now - 90_000, 2),
                partial_for("old", now - 90_000, 3)]
    idle = control.rebuild(partials, now, {"idle": now - 60_001, "busy": now - 59_000})
    assert idle == ["idle"] and set(control.states) == {"busy", "old"}, "no merge time (an older table): active"
    assert control.step(now + 999).forgotten == []
    assert control.step(now + 1_001).forgotten == ["busy"], "idle since it last merged, not since the rebuild"
    assert control.step(now + 60_001).forgotten == ["old"]


def test_replicas_refused_at_a_pools_bound_are_counted():
    from pipeline.load.aggregates import ReplicaAgg, ReplicaLatest
    from pipeline.load.picture import MAX_REPLICAS

    control = loop()
    now = 1_700_000_000_000
    partial = partial_for("p", now, 1)
    partial.replicas = {f"r{i}": ReplicaAgg(ReplicaLatest(now, "H100-80GB", 4, 0, 0, 0.5, True))
                        for i in range(MAX_REPLICAS + 76)}
    control.merge(partial)
    assert control.refused_replicas == 76 and len(control.states["p"].replicas) == MAX_REPLICAS


def test_a_pool_whose_picture_raises_costs_only_that_pools_signal(monkeypatch):
    """An unforeseen error in one pool's state (a bug, a value no check caught) must not stop every other
    pool's signals: the failing pool is named in the step and gets no signal (its routers' last one expires
    as documented), the others are signalled."""
    control = loop()
    now = 1_700_000_000_000
    control.merge(partial_for("good", now, 1))
    control.merge(partial_for("bad", now, 2))

    def broken(config):
        raise ValueError("cannot merge sketches with different alpha")

    assert {s.pool for s in control.step(now + 500).signals} == {"good", "bad"}
    control.merge(partial_for("bad", now + 600, 3))
    monkeypatch.setattr(control.states["bad"], "snapshot", broken)
    for tick in (1000, 1250):   # tried again every tick, each failure named
        step = control.step(now + tick)
        assert step.failed == [("bad", "ValueError: cannot merge sketches with different alpha")]
    assert "bad" not in control.pictures, "no decision on its old picture, and no redirect target"
    assert [s.pool for s in control.step(now + 3000).signals] == ["good"], "the heartbeat: good's only"
    # nor through its last picture read back from the load topic (the worker passes those in as the fleet)
    import pipeline.control_loop as control_loop_module

    offered = []
    real = control_loop_module.decide
    monkeypatch.setattr(control_loop_module, "decide", lambda picture, before, policy, now_ms, siblings=():
                        offered.append([s["pool"] for s in siblings]) or real(picture, before, policy, now_ms, siblings))
    old_bad = dict(control.pictures["good"], pool="bad")
    control.merge(partial_for("good", now + 3100, 4))
    control.step(now + 3200, {"bad": old_bad, "elsewhere": dict(old_bad, pool="elsewhere")})
    assert offered == [["elsewhere"]], offered


def test_a_sketch_stage_1_could_not_have_written_refuses_its_partial():
    """A sketch with another alpha would merge by reference and make every later merge into that pool raise."""
    import orjson
    import pytest
    from pipeline.load.partial import Partial

    doc = orjson.loads(partial_for("p", 1_700_000_000_000, 1).to_bytes())
    (second,) = doc["requests"].values()
    second["q_ttft"] = {"a": 0.5, "z": 0, "n": 1, "s": 1.0, "b": {"1": 1}}
    with pytest.raises(ValueError, match="alpha"):
        Partial.from_dict(doc)
