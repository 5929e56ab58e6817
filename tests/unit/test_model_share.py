"""Which models a pool serves is evidence, not a set of every name ever seen: a redirect moves work to a pool
that shares a model, so a few absurd events must not make a pool a target for work it cannot serve."""

import orjson
import pytest

import pipeline.control_loop as control_loop_module
from pipeline.admission.policy import AdmissionConfig
from pipeline.control_loop import ControlLoop
from pipeline.events import ReplicaSample, RequestEvent
from pipeline.load.config import PictureConfigs
from pipeline.load.model_share import (MAX_MODELS, MODEL_MEMORY_EVENTS, MODEL_MIN_SHARE, ModelShares, count_model,
                                       trim)
from pipeline.load.partial import Partial, PartialBuilder
from pipeline.load.picture import PoolState
from pipeline.settings import load_settings
from pipeline.sim.specimens import replica_sample, request_event

NOW = 1_700_000_000_000
CONFIGS = PictureConfigs(load_settings(env={}))


def partial(pool: str, models: list[str], n: int, event_time: int = NOW) -> Partial:
    builder = PartialBuilder(f"raw/{n}", 15)
    for model in models:
        builder.fold_request(RequestEvent(**request_event(pool=pool, model=model, event_time=event_time)))
    (out,) = builder.drain(n)
    return out


def siblings_seen(control: ControlLoop, monkeypatch) -> dict[str, list[str]]:
    """The sibling pools the control loop hands the policy, per pool, in one step."""
    seen: dict[str, list[str]] = {}
    real = control_loop_module.decide

    def spy(picture, before, policy, now_ms, siblings=()):
        seen[picture["pool"]] = sorted(s["pool"] for s in siblings)
        return real(picture, before, policy, now_ms, siblings)

    monkeypatch.setattr(control_loop_module, "decide", spy)
    control.step(NOW + 1000)
    return seen


def test_a_few_events_naming_another_pools_model_do_not_make_it_a_redirect_target(monkeypatch):
    control = ControlLoop(CONFIGS, AdmissionConfig(), "k", b"s" * 16, 2000)
    control.merge(partial("big", ["m-big"] * 500, 1))
    # 20 of 520 events (3.8%) in the small pool name the big pool's model: a router's mistake or a lie
    control.merge(partial("small", ["m-small"] * 500 + ["m-big"] * 20, 2))
    assert siblings_seen(control, monkeypatch) == {"big": [], "small": []}
    assert control.pictures["small"]["models"] == ["m-small"]
    # the same model on a real share of the small pool's work is what makes it a sibling
    control.merge(partial("small", ["m-big"] * 200, 3))
    assert siblings_seen(control, monkeypatch) == {"big": ["small"], "small": ["big"]}


def test_invented_model_names_cannot_crowd_out_the_model_a_pool_serves():
    builder = PartialBuilder("raw/0", 15)
    for i in range(2_000):   # one real event in every two, the others each a new name
        model = "m-real" if i % 2 else f"invented-{i}"
        builder.fold_request(RequestEvent(**request_event(pool="p", model=model, event_time=NOW)))
    (flooded,) = builder.drain(0)
    assert len(flooded.model_events) <= MAX_MODELS and flooded.model_events["m-real"] >= 1_000 - 2_000 // 17
    state = PoolState("p")
    state.merge(Partial.from_bytes(flooded.to_bytes()), CONFIGS.for_pool("p"))
    assert state.models.listed() == ("m-real",)


def test_the_model_a_pool_serves_is_counted_after_invented_names_filled_every_place():
    """First come, first kept (as the list was) would leave the real model out for good."""
    names = [f"invented-{i}" for i in range(MAX_MODELS)] + ["m-real"] * 100
    state = PoolState("p")
    state.merge(Partial.from_bytes(partial("p", names, 1).to_bytes()), CONFIGS.for_pool("p"))
    assert state.models.listed() == ("m-real",)


def test_shares_are_of_every_event_so_dropped_names_do_not_raise_the_others():
    """Four models at 10% each beside forty at 1.5%: the forty are dropped in stage 1, and the four must
    still read about 10% each, not a quarter of what was left."""
    names = [f"main-{i % 4}" for i in range(400)] + [f"adapter-{i % 40}" for i in range(600)]
    names = [names[(i * 7919) % 1000] for i in range(1000)]   # interleaved
    built = partial("p", names, 1)
    assert built.model_total == 1000 and sum(built.model_events.values()) < 1000
    state = PoolState("p")
    state.merge(Partial.from_bytes(built.to_bytes()), CONFIGS.for_pool("p"))
    shares = {name: n / state.models.total for name, n in state.models.counts.items()}
    assert state.models.total == 1000 and all(share <= 0.1 for share in shares.values()), shares


def test_the_misra_gries_bound_keeps_any_name_above_one_in_seventeen_whatever_the_order():
    counts: dict[str, int] = {}
    for i in range(17 * 100):
        count_model(counts, "kept" if i % 16 == 0 else f"other-{i % 97}")
    assert len(counts) <= MAX_MODELS and counts["kept"] > 0
    merged = {f"n{i}": 10 for i in range(20)} | {"big": 100}
    trim(merged)
    assert len(merged) <= MAX_MODELS and merged["big"] == 90


def test_a_pool_moved_to_another_model_forgets_the_old_one_and_an_idle_pool_keeps_its_own():
    shares = ModelShares()
    shares.add({"old": MODEL_MEMORY_EVENTS}, MODEL_MEMORY_EVENTS)
    assert shares.listed() == ("old",)
    shares.add({"new": MODEL_MEMORY_EVENTS}, MODEL_MEMORY_EVENTS)
    assert shares.listed() == ("new", "old"), "a moment after the move both are served"
    shares.add({"new": 3 * MODEL_MEMORY_EVENTS}, 3 * MODEL_MEMORY_EVENTS)
    assert shares.listed() == ("new",)
    # replica samples alone (an idle pool) carry no model counts: the listing stays
    state = PoolState("p")
    state.merge(partial("p", ["m"] * 10, 1), CONFIGS.for_pool("p"))
    builder = PartialBuilder("raw/9", 15)
    for k in range(5):
        builder.fold_sample(ReplicaSample(**replica_sample(pool="p", event_time=NOW + 120_000 + k * 1000,
                                                           prompt_tokens_total=1000 + k)))
    (idle,) = builder.drain(9)
    assert not idle.model_events
    state.merge(idle, CONFIGS.for_pool("p"))
    assert state.models.listed() == ("m",) and state.snapshot(CONFIGS.for_pool("p"))["models"] == ["m"]


def test_partials_from_a_worker_before_the_counts_still_name_their_models():
    old = orjson.loads(partial("p", ["m-a", "m-b"], 1).to_bytes())
    assert old.pop("model_events") == {"m-a": 1, "m-b": 1} and old.pop("model_total") == 2
    assert old["models"] == ["m-a", "m-b"]
    state = PoolState("p")
    state.merge(Partial.from_dict(old), CONFIGS.for_pool("p"))
    assert state.models.listed() == ("m-a", "m-b")
    # and a stored state from before the counts
    stored = state.to_dict()
    for key in ("model_events", "model_total"):
        stored.pop(key)
    assert PoolState.from_dict(stored | {"models": ["m-a"]}).models.listed() == ("m-a",)
    assert PoolState.from_dict(state.to_dict()).models.listed() == ("m-a", "m-b")


@pytest.mark.parametrize("model_events", [
    {f"m{i}": 1 for i in range(MAX_MODELS + 1)}, {"m": -1}, {"m": 1.5}, {"m": True}, {"bad name": 1},
    {"m" * 129: 1}, ["m"], None, {"m": 2}])
def test_model_counts_stage_1_could_not_have_written_refuse_the_partial(model_events):
    raw = orjson.loads(partial("p", ["m"], 1).to_bytes()) | {"model_events": model_events}   # model_total 1
    with pytest.raises(ValueError):
        Partial.from_dict(raw)


def test_the_listing_threshold_is_a_share_of_the_pools_own_events():
    shares = ModelShares()
    shares.add({"main": 950, "side": 50}, 1000)
    assert shares.listed() == ("main", "side")
    shares = ModelShares()
    shares.add({"main": 951, "side": 49}, 1000)
    assert MODEL_MIN_SHARE == 0.05 and shares.listed() == ("main",)
