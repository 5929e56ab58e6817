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
