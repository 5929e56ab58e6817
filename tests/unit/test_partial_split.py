"""A partial too large for one Kafka message goes out in parts that stage 2 merges like the whole."""

from dataclasses import replace

import orjson
from hypothesis import given, settings as hypothesis_settings, strategies as st

from pipeline import topics
from pipeline.events import ReplicaSample, RequestEvent
from pipeline.load.partial import Partial, PartialBuilder, split
from pipeline.load.picture import PoolState
from pipeline.sim.specimens import replica_sample, request_event
from tests.unit.test_picture import CONFIG

BACKLOG_CONFIG = replace(CONFIG, fast_window_s=10, cost_window_s=300, allowed_lateness_s=30)
START_S = 1_700_000_000
PHASES = ("received", "admitted", "completed", "failed", "rejected")


def sparse_backlog(builder: PartialBuilder, seconds: int = 20_000) -> None:
    """One pool's events 7 s apart (about 39 hours), and two replicas sampled every minute."""
    for i in range(seconds):
        builder.fold_request(RequestEvent(**request_event(
            task_id=f"t{i}", request_id=f"t{i}-r1", pool="p", event_time=(START_S + 7 * i) * 1000 + i % 1000,
            phase=PHASES[i % len(PHASES)], event_id=f"00000000-0000-4000-8000-{i:012d}")))
        if i % 9 == 0:
            for replica in ("r1", "r2"):
                builder.fold_sample(ReplicaSample(**replica_sample(
                    replica_id=replica, pool="p", event_time=(START_S + 7 * i) * 1000, prompt_tokens_total=10 * i,
                    generation_tokens_total=5 * i, preemptions_total=i // 90, event_id=f"{replica}-{i}")))


def backlog_partial() -> Partial:
    builder = PartialBuilder("sluice.requests.v1/3", replica_max_gap_s=120)
    sparse_backlog(builder)
    (partial,) = builder.drain("100-40099")
    return partial


def merged(raws: list[bytes], config=BACKLOG_CONFIG, before: list[bytes] = ()) -> PoolState:
    """A pool's state after merging the partials as stage 2 receives them (bytes, in order)."""
    state = PoolState("p")
    for raw in [*before, *raws]:
        state.merge(Partial.from_bytes(raw), config)
    return state


def same_state(a: PoolState, b: PoolState, config=BACKLOG_CONFIG) -> None:
    """Equal pictures and equal states (in any key order), but for what counts messages and names them."""
    picture_a, picture_b = a.snapshot(config), b.snapshot(config)
    state_a, state_b = a.to_dict(), b.to_dict()
    for counted in (picture_a, picture_b, state_a, state_b):
        counted.pop("partials_merged")
        counted.pop("seen", None)
    assert orjson.dumps(picture_a) == orjson.dumps(picture_b)
    assert orjson.dumps(state_a, option=orjson.OPT_SORT_KEYS) == orjson.dumps(state_b, option=orjson.OPT_SORT_KEYS)


def test_a_sparse_backlog_splits_into_parts_under_the_budget_with_stable_ids_and_the_same_picture():
    budget = topics.partial_budget_bytes()
    whole = backlog_partial()
    assert len(whole.requests) == 20_000 and len(whole.to_bytes()) > topics.PARTIALS.max_bytes
    unsplit = whole.to_bytes()
    parts = split(whole, budget)
    raws = [p.to_bytes() for p in parts]
    assert len(parts) >= 3 and all(len(raw) <= budget for raw in raws)
    assert [p.id for p in parts] == ["sluice.requests.v1/3/100-40099"] + [
        f"sluice.requests.v1/3/100-40099#{k}" for k in range(1, len(parts))]
    assert raws == [p.to_bytes() for p in split(backlog_partial(), budget)], "a repeat publishes the same parts"
    assert sum(len(p.requests) for p in parts) == 20_000
    assert [p.newest_ms for p in parts] == sorted(p.newest_ms for p in parts)
    assert parts[-1].newest_ms == whole.newest_ms
    same_state(merged([unsplit]), merged(raws))


def test_the_worker_drains_parts_and_a_small_partial_stays_whole():
    builder = PartialBuilder("raw/0", replica_max_gap_s=120)
    builder.fold_request(RequestEvent(**request_event(pool="p")))
    (only,) = builder.drain("0-0", topics.partial_budget_bytes())
    assert only.id == "raw/0/0-0"
    sparse_backlog(builder, 5_000)
    parts = builder.drain("1-5000", 100_000)
    assert len(parts) > 1 and {p.id.split("#")[0] for p in parts} == {"raw/0/1-5000"}


def test_the_cost_window_evicts_split_parts_and_a_rebuild_from_what_is_kept_gives_the_same_picture():
    """Stage 2 keeps a partial in its changelog until its newest event leaves the cost window: early parts
    of a backlog leave at once, the whole would have stayed."""
    parts = [p.to_bytes() for p in split(backlog_partial(), topics.partial_budget_bytes())]
    state, kept = PoolState("p"), {}
    for raw in parts:
        partial = Partial.from_bytes(raw)
        assert state.merge(partial, BACKLOG_CONFIG)
        kept[partial.id] = raw
        for evicted in state.evicted:
            del kept[evicted]
    assert list(kept) == [Partial.from_bytes(parts[-1]).id]
    assert list(kept) == list(state.seen)
    rebuilt = merged(sorted(kept.values(), key=lambda raw: Partial.from_bytes(raw).newest_ms))
    same_state(state, rebuilt)


events = st.lists(st.tuples(st.integers(0, 400), st.integers(0, 999), st.sampled_from(PHASES),
                            st.sampled_from(("m-a", "m-b"))), max_size=120)
samples = st.lists(st.tuples(st.sampled_from(("r1", "r2", "r3")), st.integers(0, 400)), max_size=40)


def fold(builder: PartialBuilder, evs, sms, offset_s: int) -> None:
    for n, (second, ms, phase, model) in enumerate(evs):
        builder.fold_request(RequestEvent(**request_event(
            pool="p", model=model, phase=phase, event_id=f"00000000-0000-4000-8000-{n:012d}",
            event_time=(START_S + offset_s + second) * 1000 + ms)))
    for n, (replica, second) in enumerate(sorted(sms, key=lambda s: s[1])):
        builder.fold_sample(ReplicaSample(**replica_sample(
            replica_id=replica, pool="p", event_time=(START_S + offset_s + second) * 1000, event_id=f"s{n}",
            prompt_tokens_total=7 * second + n, requests_waiting=n % 5, healthy=n % 7 != 3)))


@hypothesis_settings(max_examples=150, deadline=None)
@given(before_evs=events, before_sms=samples, before_offset=st.integers(-400, 400), evs=events, sms=samples,
       max_bytes=st.integers(600, 6_000))
def test_parts_merge_exactly_like_the_whole_after_any_earlier_partial(before_evs, before_sms, before_offset, evs,
                                                                      sms, max_bytes):
    """Late seconds, evictions and replicas that leave and return all end the same (small windows: CONFIG)."""
    before = PartialBuilder("raw/1", replica_max_gap_s=15)
    fold(before, before_evs, before_sms, before_offset)
    earlier = [p.to_bytes() for p in before.drain("0-9")]
    builder = PartialBuilder("raw/0", replica_max_gap_s=15)
    fold(builder, evs, sms, 0)
    wholes = builder.drain("0-9")
    if not wholes:
        return
    (whole,) = wholes
    unsplit = whole.to_bytes()
    parts = split(whole, max_bytes)
    assert len({p.id for p in parts}) == len(parts)
    same_state(merged([unsplit], CONFIG, earlier), merged([p.to_bytes() for p in parts], CONFIG, earlier), CONFIG)
