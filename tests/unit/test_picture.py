"""The load picture against hand-computed expectations.

Scenario (pool "p", fast window 10 s = seconds 100..109, cost window 20 s = 90..109,
watermark 110.000 s):
- replicas r1, r2 (4 GPUs each, H100 at $3.60/GPU-h = $0.001/GPU-s) sample every second
  from 90 to 109: r1 waiting 4, KV 0.6, one preemption per second; r2 waiting 2, KV 0.8;
  both +100 prompt and +50 generation tokens per second. r3 last sampled at 93 s: stale (17 s > 15 s).
- seconds 100..109, each: 6 received (5 first attempts, 1 retry), 5 completed
  (TTFT 1.0 s, TPOT 0.05 s, queue 0.2 s; 4 of them task_final), 1 failed.
- seconds 90..99, each: 5 completed, 4 task_final.

By hand:
  demand   6 req/s  ÷ (10 req/s × 2 fresh)              = 0.30
  queue    waiting 6 ÷ drain 5/s = 1.2 s ÷ (0.5 × 2.0 s)  = 1.20
  kv       mean(0.6, 0.8, stale 1.0) = 0.8 ÷ 0.9         = 0.888…  (preemptions 0.5/s/replica ÷ 1.0 = 0.5)
  compute  300 tok/s ÷ (0.5 × 1000 × 2)                  = 0.30
  latency  p95 TTFT 1.0 ÷ 2.0 = 0.5, TPOT 0.05 ÷ 0.1 = 0.5 → 0.5 (±1% sketch)
  errors   failed 10/60 = 0.1667 ÷ 0.1 = 1.667; retries 60/50 − 1 = 0.2 ÷ 0.5 = 0.4 → 1.667
  cost     2 × 19 s × 4 GPUs = 152 GPU-s = $0.152 ÷ 80 tasks = $0.0019 ÷ $0.5 = 0.0038
  pool     1.667, bound by errors
"""

from dataclasses import replace

import orjson
import pytest

from pipeline.events import ReplicaSample, RequestEvent
from pipeline.load.partial import Partial, PartialBuilder
from pipeline.load.picture import PictureConfig, PoolState, read_picture
from pipeline.load.profiles import build_profiles
from pipeline.sim.specimens import replica_sample, request_event
from tests.reference import reference

PROFILE = build_profiles({"test": {
    "slo_ttft_s": 2.0, "slo_tpot_s": 0.1, "latency_limit": 1.0, "capacity_rps_per_replica": 10,
    "queue_wait_fraction": 0.5, "kv_limit": 0.9, "preemptions_per_s_limit": 1.0, "peak_tokens_per_s": 1000,
    "compute_limit": 0.5, "error_budget": 0.1, "retry_budget": 0.5, "cost_budget_per_task": 0.5}})["test"]
CONFIG = PictureConfig(PROFILE, {"H100-80GB": 3.6}, fast_window_s=10, cost_window_s=20,
                       allowed_lateness_s=5, stale_after_s=15)


def req(second, phase, attempt=1, final=False, **kw):
    fields = request_event(event_time=second * 1000 + 500, phase=phase, attempt=attempt, pool="p",
                           task_final=final, **({"ttft_s": 1.0, "tpot_s": 0.05, "queue_s": 0.2} | kw))
    return RequestEvent(**fields)


def sample(replica, second, waiting, kv, preemptions, gpus=4):
    n = second - 90
    return ReplicaSample(**replica_sample(
        replica_id=replica, pool="p", event_time=second * 1000, requests_waiting=waiting, kv_cache_usage=kv,
        gpu_count=gpus, preemptions_total=preemptions, prompt_tokens_total=100 * n,
        generation_tokens_total=50 * n, prefix_cache_hits_total=0, prefix_cache_queries_total=0))


def scenario_partials():
    builder = PartialBuilder("raw/0", replica_max_gap_s=15)
    for second in range(90, 110):
        builder.fold_sample(sample("r1", second, 4, 0.6, second - 90))
        builder.fold_sample(sample("r2", second, 2, 0.8, (second - 90) // 2))
    builder.fold_sample(sample("r3", 93, 0, 0.2, 0))
    for second in range(100, 110):
        for i in range(5):
            builder.fold_request(req(second, "received"))
            builder.fold_request(req(second, "completed", final=i < 4))
        builder.fold_request(req(second, "received", attempt=2))
        builder.fold_request(req(second, "failed", attempt=2, ttft_s=None, tpot_s=None))
    for second in range(90, 100):
        for i in range(5):
            builder.fold_request(req(second, "completed", final=i < 4))
    builder.fold_request(RequestEvent(**request_event(event_time=110_000, phase="received", pool="p")))
    return builder.drain(1)


@pytest.fixture(autouse=True)
def every_snapshot_is_a_valid_picture(monkeypatch):
    """Every picture these tests produce also meets the sluice.load.v1 schema and reads back unchanged."""
    snapshot = PoolState.snapshot

    def checked(self, config):
        picture = snapshot(self, config)
        reference("load_picture").validate(picture)
        assert read_picture(orjson.dumps(picture)) == picture
        return picture

    monkeypatch.setattr(PoolState, "snapshot", checked)


@pytest.fixture
def picture():
    state = PoolState("p")
    for partial in scenario_partials():
        assert state.merge(Partial.from_bytes(partial.to_bytes()), CONFIG)
    return state.snapshot(CONFIG)


@pytest.mark.parametrize("axis,value,pressure", [
    ("demand", 6.0, 0.3),
    ("queue", 1.2, 1.2),
    ("kv_cache", 0.8, 0.8 / 0.9),
    ("compute", 300.0, 0.3),
    ("errors", 10 / 60, (10 / 60) / 0.1),
    ("cost", 0.152 / 80, 0.152 / 80 / 0.5),
])
def test_axis_by_hand(picture, axis, value, pressure):
    assert picture["axes"][axis]["value"] == pytest.approx(value, rel=1e-5)
    assert picture["axes"][axis]["pressure"] == pytest.approx(pressure, rel=1e-5)


def test_latency_axis_within_sketch_error(picture):
    latency = picture["axes"]["latency"]
    assert abs(latency["value"] - 0.5) <= 0.5 * 0.01 + 1e-6
    assert abs(latency["detail"]["ttft_p95_s"] - 1.0) <= 0.01 + 1e-6


def test_pool_pressure_is_the_maximum_axis(picture):
    assert picture["pressure"] == pytest.approx(10 / 60 / 0.1, rel=1e-5)
    assert picture["binding_axis"] == "errors"
    assert picture["axes"]["kv_cache"]["detail"]["preemptions_per_s_per_replica"] == pytest.approx(0.75)
    assert picture["axes"]["errors"]["detail"]["retry_amplification"] == pytest.approx(1.2)


def test_stale_replica_counts_as_saturated_and_leaves_capacity(picture):
    assert picture["replicas"] == {"total": 3, "fresh": 2, "stale": 1, "unhealthy": 0, "stale_ids": ["r3"],
                                   "outlier_ids": []}
    assert picture["axes"]["demand"]["limit"] == 20


def test_all_replicas_stale_means_no_capacity():
    state = PoolState("p")
    builder = PartialBuilder("raw/0", 15)
    builder.fold_sample(sample("r1", 80, 0, 0.1, 0))
    builder.fold_request(req(95, "received"))
    builder.fold_request(req(100, "received"))
    for partial in builder.drain(1):
        state.merge(partial, CONFIG)
    snap = state.snapshot(CONFIG)
    assert snap["axes"]["demand"]["limit"] == 0
    assert snap["axes"]["demand"]["pressure"] == 10.0
    assert snap["axes"]["kv_cache"]["value"] == 1.0


def test_duplicate_partial_is_not_counted_twice():
    state = PoolState("p")
    partials = scenario_partials()
    for partial in partials:
        state.merge(partial, CONFIG)
    before = state.snapshot(CONFIG)
    for partial in scenario_partials():
        assert not state.merge(partial, CONFIG)
    after = state.snapshot(CONFIG)
    assert after["axes"] == before["axes"] and after["duplicate_partials"] == len(partials)


def test_late_events_are_counted_and_left_out():
    state = PoolState("p")
    for partial in scenario_partials():
        state.merge(partial, CONFIG)
    late = PartialBuilder("raw/1", 15)
    for _ in range(7):
        late.fold_request(req(103, "received"))     # 103 < 110 − 5: closed
    within = PartialBuilder("raw/2", 15)
    within.fold_request(req(106, "received"))       # 106 ≥ 105: still open
    for partial in late.drain(2) + within.drain(2):
        state.merge(partial, CONFIG)
    snap = state.snapshot(CONFIG)
    assert snap["late_events"] == 7
    assert snap["axes"]["demand"]["value"] == pytest.approx(6.1)


def test_a_replica_silent_past_the_cost_window_is_forgotten():
    state = PoolState("p")
    builder = PartialBuilder("raw/0", 15)
    builder.fold_sample(sample("gone", 60, 0, 0.1, 0))
    builder.fold_sample(sample("r1", 110, 0, 0.1, 0))
    for partial in builder.drain(1):
        state.merge(partial, CONFIG)
    assert set(state.replicas) == {"r1"}


def test_out_of_order_events_within_the_bound_are_folded():
    """The same events, one partial each in time order or one partial in reverse order: same picture."""
    events = [req(s, "received") for s in range(100, 110)]
    one_by_one, reversed_batch = PoolState("p"), PoolState("p")
    for e in events:
        single = PartialBuilder("x", 15)
        single.fold_request(e)
        one_by_one.merge(single.drain(e.event_time)[0], CONFIG)
    builder = PartialBuilder("raw/0", 15)
    for e in reversed(events):
        builder.fold_request(e)
    for partial in builder.drain(9):
        reversed_batch.merge(partial, CONFIG)
    assert one_by_one.snapshot(CONFIG)["axes"]["demand"] == reversed_batch.snapshot(CONFIG)["axes"]["demand"]


def test_state_round_trips_through_the_changelog_form(picture):
    state = PoolState("p")
    for partial in scenario_partials():
        state.merge(partial, CONFIG)
    again = PoolState.from_dict(state.to_dict())
    assert again.snapshot(CONFIG) == state.snapshot(CONFIG)


def test_counter_reset_is_a_restart_not_a_negative_delta():
    builder = PartialBuilder("raw/0", 15)
    builder.fold_sample(sample("r1", 100, 0, 0.5, 5))
    builder.fold_sample(sample("r1", 101, 0, 0.5, 7))
    restarted = sample("r1", 102, 0, 0.5, 0)
    restarted.preemptions_total = 1
    restarted.prompt_tokens_total = 30
    builder.fold_sample(restarted)
    (partial,) = builder.drain(1)
    deltas = partial.replicas["r1"].seconds
    assert deltas[101]["preemptions"] == 2 and deltas[102]["preemptions"] == 1
    assert deltas[102]["prompt_tokens"] == 30
    assert builder.tracker.restarts == 1


def test_a_counter_jump_no_engine_could_count_is_dropped_not_fatal_to_the_partial():
    """A broken exporter jumping a counter by 1e16 (the schema allows 1e18): the delta is dropped, so the
    partial, which also carries the pool's request events, still passes stage 2's checks."""
    builder = PartialBuilder("raw/0", 15)
    builder.fold_request(RequestEvent(**request_event(pool="p", event_time=100_000)))
    builder.fold_sample(sample("r1", 100, 0, 0.5, 5))
    jumped = sample("r1", 101, 0, 0.5, 7)
    jumped.prompt_tokens_total = 1e16        # past what stage 2 accepts as a count
    jumped.generation_tokens_total = 1e12    # a count, but not one 4 GPUs make in a second
    builder.fold_sample(jumped)
    (partial,) = builder.drain(1)
    again = Partial.from_bytes(partial.to_bytes())
    assert again.replicas["r1"].seconds[101]["prompt_tokens"] == 0
    assert again.replicas["r1"].seconds[101]["generation_tokens"] == 0
    assert again.replicas["r1"].seconds[101]["preemptions"] == 2, "the other counters still count"
    assert builder.tracker.jumps == 2 and list(again.requests) == [100], "the request events go with it"


def test_the_tracker_forgets_the_least_recently_sampled_replica_beyond_its_bound(monkeypatch):
    builder = PartialBuilder("raw/0", 15)
    monkeypatch.setattr(builder.tracker, "MAX_TRACKED", 3)
    for i, replica in enumerate(("a", "b", "c", "a", "d")):
        builder.fold_sample(sample(replica, 100 + i, 0, 0.5, i))
    assert list(builder.tracker.last) == ["c", "a", "d"]


def test_a_sample_ahead_of_the_workers_clock_is_placed_at_it_but_differenced_on_its_own_times():
    """A replica whose clock runs 45 s fast: its samples land at the worker's clock (the watermark never runs
    ahead), while its counters are differenced on its own times, so its GPU-seconds are not lost."""
    builder = PartialBuilder("raw/0", 15)
    for i, second in enumerate((145, 146, 147)):
        assert builder.fold_sample(sample("r1", second, 0, 0.5, i), not_after_ms=100_500), "counted as ahead"
    assert not builder.fold_sample(sample("r2", 100, 0, 0.5, 0), not_after_ms=100_500)
    (partial,) = builder.drain(1)
    replica = partial.replicas["r1"]
    assert partial.newest_ms == 100_500 and replica.latest.event_time == 100_500
    assert list(replica.seconds) == [100] and replica.seconds[100]["gpu_seconds"] == 2 * 4   # 2 gaps of 1 s, 4 GPUs
    assert replica.seconds[100]["prompt_tokens"] == 200


def test_out_of_order_sample_is_not_differenced():
    builder = PartialBuilder("raw/0", 15)
    builder.fold_sample(sample("r1", 100, 0, 0.5, 5))
    builder.fold_sample(sample("r1", 99, 3, 0.9, 1))
    (partial,) = builder.drain(1)
    assert partial.replicas["r1"].seconds == {}
    assert partial.replicas["r1"].latest.event_time == 100_000
    assert builder.tracker.out_of_order == 1


def test_state_is_bounded_by_pools_and_replicas_not_requests():
    """An hour of traffic at 50 req/s leaves at most the windows' worth of seconds in the state."""
    state = PoolState("p")
    for minute in range(60):
        builder = PartialBuilder("raw/0", 15)
        for second in range(minute * 60, minute * 60 + 60):
            builder.fold_sample(sample("r1", second, 1, 0.5, 0))
            for i in range(50):
                builder.fold_request(req(second, "completed", final=True, task_id=f"t{second}-{i}"))
        for partial in builder.drain(minute):
            state.merge(partial, CONFIG)
    window = CONFIG.cost_window_s + CONFIG.allowed_lateness_s + 2
    assert len(state.requests) <= window
    assert all(len(r.seconds) <= window for r in state.replicas.values())
    assert len(state.seen) <= 2
    assert len(PoolState.from_dict(state.to_dict()).requests) == len(state.requests)


def test_idle_cost_window_is_not_judged_but_failing_traffic_is_unbounded():
    idle = PoolState("p")
    builder = PartialBuilder("raw/0", 15)
    for second in range(100, 112):
        builder.fold_sample(sample("r1", second, 0, 0.1, 0))
    for partial in builder.drain(1):
        idle.merge(partial, CONFIG)
    assert idle.snapshot(CONFIG)["axes"]["cost"]["pressure"] == 0.0
    builder.fold_request(req(110, "received"))
    builder.fold_request(req(110, "failed", final=True, ttft_s=None, tpot_s=None))
    builder.fold_sample(sample("r1", 112, 0, 0.1, 0))
    for partial in builder.drain(2):
        idle.merge(partial, CONFIG)
    failing = idle.snapshot(CONFIG)["axes"]["cost"]
    assert failing["pressure"] == 10.0 and failing["value"] is None


def test_retries_that_answer_our_own_rejections_are_not_amplification():
    builder = PartialBuilder("raw/0", 15)
    for second in range(100, 110):
        for i in range(10):
            builder.fold_request(req(second, "received"))
        for i in range(5):
            builder.fold_request(req(second, "rejected", final=False))
            builder.fold_request(req(second, "received", attempt=2))
    state = PoolState("p")
    for partial in builder.drain(1):
        state.merge(partial, CONFIG)
    errors = state.snapshot(CONFIG)["axes"]["errors"]
    assert errors["detail"]["retry_amplification"] == pytest.approx(1.0)


def test_a_replica_silent_for_twice_the_threshold_leaves_the_kv_mean():
    builder = PartialBuilder("raw/0", 15)
    for second in range(60, 110):
        builder.fold_sample(sample("r1", second, 0, 0.4, 0))
    builder.fold_sample(sample("dead", 95, 0, 0.4, 0))      # silent 14 s > 2 × 5 s: presumed gone
    builder.fold_sample(sample("quiet", 103, 0, 0.4, 0))    # silent 6 s: stale, maybe still serving
    config = replace(CONFIG, stale_after_s=5)
    state = PoolState("p")
    for partial in builder.drain(1):
        state.merge(partial, config)
    snap = state.snapshot(config)
    assert snap["replicas"]["stale"] == 2
    assert snap["axes"]["kv_cache"]["value"] == pytest.approx((0.4 + 1.0) / 2)


def test_ttft_censoring_and_first_token_counts():
    """First tokens without a TTFT do not switch the latency axis to an empty first-token sketch; a timeout
    before a first token counts at its duration; a failure after one (it carries its TTFT) does not."""
    from pipeline.events import RequestEvent
    from pipeline.load.aggregates import RequestAgg
    from pipeline.sim.specimens import request_event

    agg = RequestAgg()
    agg.fold(RequestEvent(**request_event(phase="first_token", ttft_s=None)))
    assert agg.counts["first_tokens"] == 1 and agg.counts["first_token_ttfts"] == 0
    agg.fold(RequestEvent(**request_event(phase="cancelled", ttft_s=None, tpot_s=None, duration_s=10.0,
                                          error_type="timeout")))
    agg.fold(RequestEvent(**request_event(phase="failed", ttft_s=0.4, tpot_s=None, duration_s=30.0,
                                          error_type="timeout")))
    assert agg.counts["timeouts"] == 1 and agg.sketches["ttft"].count == 1
    assert agg.sketches["ttft"].quantile(0.5) == pytest.approx(10.0, rel=0.02)


def snapshot_of(samples, requests=()) -> dict:
    """Pool ``p``'s published picture after folding ``samples`` and ``requests`` into one stage-1 partial."""
    builder = PartialBuilder("raw/0", replica_max_gap_s=15)
    for s in samples:
        builder.fold_sample(s)
    for event in requests:
        builder.fold_request(event)
    state = PoolState("p")
    for partial in builder.drain(1):
        state.merge(partial, CONFIG)
    return state.snapshot(CONFIG)


def test_first_tokens_set_the_ttft_only_where_they_cover_the_completions():
    """A fleet where one router sends first tokens and the rest do not (review, session 22): one first token
    at 8 s among 240 completions at 0.3 s was the whole p95 (latency 3.96× SLO, a calm pool shed to critical's
    floor within 80 s). First tokens are read while they number at least half the completions; where every
    router sends them, they lead, as before."""
    fast = [req(second, "completed", task_id=f"t{second}-{i}", ttft_s=0.3) for second in range(100, 110)
            for i in range(24)]
    one_slow = snapshot_of([], fast + [req(105, "first_token", task_id="slow", ttft_s=8.0)])
    assert one_slow["axes"]["latency"]["detail"]["ttft_p95_s"] == pytest.approx(0.3, rel=0.02)
    firsts = [req(second, "first_token", task_id=f"t{second}-{i}", ttft_s=3.0) for second in range(100, 110)
              for i in range(12)]
    covered = snapshot_of([], fast + firsts)
    assert covered["axes"]["latency"]["detail"]["ttft_p95_s"] == pytest.approx(3.0, rel=0.02), \
        "first tokens for half the completions lead the axis"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_eviction_touches_only_what_left_the_window_yet_leaves_nothing_behind(seed):
    """Eviction is incremental (a full scan per merge made rebuilds quadratic): after every merge, in any
    order and with jumps of the watermark, nothing older than the window is kept, and every partial id
    merged is either kept or reported evicted exactly once."""
    import random

    rng = random.Random(seed)
    partials = []
    for n in range(400):
        second = n // 4 + (rng.choice([0, 0, 0, 300]) if n % 97 == 0 else 0)   # a few far jumps
        builder = PartialBuilder(f"raw/{n % 4}", 15)
        builder.fold_request(req(second, "completed", task_id=f"t{n}"))
        builder.fold_sample(ReplicaSample(**replica_sample(event_time=second * 1000, pool="p",
                                                           replica_id=f"r{n % 3}")))
        partials.extend(builder.drain(f"{n}-{n}"))
    order = sorted(range(len(partials)), key=lambda i: i + rng.uniform(-30, 30))   # late and early arrivals
    state, evicted = PoolState("p"), []
    for i in order:
        state.merge(partials[i], CONFIG)
        evicted += state.evicted
        keep_from = state.watermark_ms // 1000 - CONFIG.cost_window_s - int(CONFIG.allowed_lateness_s) - 1
        assert all(s >= keep_from for s in state.requests)
        assert all(s >= keep_from for agg in state.replicas.values() for s in agg.seconds)
        assert all(newest >= keep_from * 1000 for newest in state.seen.values())
    assert len(evicted) == len(set(evicted)) and set(evicted).isdisjoint(state.seen)
    assert set(evicted) | set(state.seen) == {p.id for p in partials}
    restored = PoolState.from_dict(orjson.loads(orjson.dumps(state.to_dict())))
    late = PartialBuilder("raw/9", 15)
    late.fold_request(req(0, "completed", task_id="late"))
    (old,) = late.drain("0-0")
    assert restored.merge(old, CONFIG) and restored.evicted == [old.id], "a restored state evicts too"


def lying_pool(liar_waiting: int, liar_rate: int) -> dict:
    """Pool "p" over 90..109 s: r1 and r2 as in the scenario (waiting 4 and 2, 150 tokens/s, r1 one
    preemption a second, r2 one every two), and r9 reporting ``liar_waiting`` waiting and ``liar_rate`` times
    r1's token and preemption counts; completions of 5/s so the queue drains."""
    builder = PartialBuilder("raw/0", replica_max_gap_s=15)
    for second in range(90, 110):
        builder.fold_sample(sample("r1", second, 4, 0.6, second - 90))
        builder.fold_sample(sample("r2", second, 2, 0.6, (second - 90) // 2))
        liar = sample("r9", second, liar_waiting, 0.6, (second - 90) * liar_rate)
        liar.prompt_tokens_total *= liar_rate
        liar.generation_tokens_total *= liar_rate
        builder.fold_sample(liar)
        for i in range(5):
            builder.fold_request(req(second, "completed", final=True, task_id=f"t{second}-{i}"))
    state = PoolState("p")
    for partial in builder.drain(1):
        state.merge(partial, CONFIG)
    return state.snapshot(CONFIG)


def test_one_replica_reading_far_above_its_siblings_counts_at_most_four_times_the_next_or_half_the_limit():
    """A replica reporting a million waiting, 10,000× its siblings' tokens and preemptions (a broken exporter,
    a compromised host) read as the queue, compute and KV axes at their caps (10) and shed a pool whose other
    replicas are calm. It counts at most 4× the next highest replica, or what alone takes the axis to half
    the pool's limit if that is more, and is named in the picture."""
    honest = lying_pool(liar_waiting=4, liar_rate=1)
    lying = lying_pool(liar_waiting=1_000_000, liar_rate=10_000)
    assert honest["replicas"]["outlier_ids"] == [] and lying["replicas"]["outlier_ids"] == ["r9"]
    assert lying["axes"]["queue"]["detail"]["requests_waiting"] == 4 + 2 + 4 * 4
    # tokens: what alone takes compute to half its limit (0.5 × 3 replicas × 0.5 × 1000 tokens/s) is above
    # 4× the next (600 tokens/s), so the floor is the cap
    assert lying["axes"]["compute"]["value"] == pytest.approx(150 + 150 + 750)
    assert lying["axes"]["kv_cache"]["detail"]["preemptions_per_s_per_replica"] == pytest.approx((1 + 0.5 + 4) / 3)
    for axis in ("queue", "kv_cache", "compute"):
        assert lying["axes"][axis]["pressure"] < 3 * max(honest["axes"][axis]["pressure"], 0.1), axis
    assert lying["pressure"] < 3 * honest["pressure"] < 10


def test_a_pool_overloaded_on_every_replica_is_read_in_full():
    """The cap only touches a replica far above all its siblings: when the whole pool is loaded, every
    replica's queue counts."""
    builder = PartialBuilder("raw/0", replica_max_gap_s=15)
    for second in range(100, 110):
        for replica, waiting in (("r1", 300), ("r2", 200), ("r3", 90)):
            builder.fold_sample(sample(replica, second, waiting, 0.95, 0))
        builder.fold_request(req(second, "completed", final=True, task_id=f"t{second}"))
    state = PoolState("p")
    for partial in builder.drain(1):
        state.merge(partial, CONFIG)
    picture = state.snapshot(CONFIG)
    assert picture["replicas"]["outlier_ids"] == []
    assert picture["axes"]["queue"]["detail"]["requests_waiting"] == 590


def test_a_liar_in_a_quiet_pool_cannot_read_a_queue_its_pool_never_drains():
    """The queue axis reads waiting ÷ completions/s: with the floor in the pool's capacity, a liar beside four
    idle replicas in a pool completing 1 request/s read 10 (review, session 19). The floor is in the drain."""
    builder = PartialBuilder("raw/0", replica_max_gap_s=15)
    for second in range(100, 110):
        for replica in ("r1", "r2", "r3", "r4"):
            builder.fold_sample(sample(replica, second, 0, 0.1, 0))
        builder.fold_sample(sample("r9", second, 1_000_000, 0.1, 0))
        builder.fold_request(req(second, "completed", final=True, task_id=f"t{second}"))
    state = PoolState("p")
    for partial in builder.drain(1):
        state.merge(partial, CONFIG)
    picture = state.snapshot(CONFIG)
    assert picture["replicas"]["outlier_ids"] == ["r9"]
    assert picture["axes"]["queue"]["pressure"] <= 0.5


def test_a_replica_that_jumped_once_and_went_quiet_is_capped_while_its_counters_stay_in_the_window():
    """The axes add up the counters of every replica with deltas in the fast window, stale ones too: a replica
    whose counters leapt 10,000× for three seconds and then fell silent read as compute pressure 10 for the
    rest of the window, past the cap on replicas reporting now (review, session 19)."""
    config = replace(CONFIG, stale_after_s=3)
    builder = PartialBuilder("raw/0", replica_max_gap_s=15)
    for second in range(90, 110):
        builder.fold_sample(sample("r1", second, 4, 0.6, second - 90))
        builder.fold_sample(sample("r2", second, 2, 0.6, second - 90))
        if 100 <= second <= 103:
            liar = sample("r9", second, 0, 0.6, (second - 90) * 10_000)
            liar.prompt_tokens_total *= 10_000
            liar.generation_tokens_total *= 10_000
            builder.fold_sample(liar)
        builder.fold_request(req(second, "completed", final=True, task_id=f"t{second}"))
    state = PoolState("p")
    for partial in builder.drain(1):
        state.merge(partial, config)
    picture = state.snapshot(config)
    assert "r9" in picture["replicas"]["stale_ids"] and picture["replicas"]["outlier_ids"] == ["r9"]
    # 150 tokens/s from each honest replica; r9 counts 4× the next (1,500 tokens over the window), above the
    # floor (0.5 × 2 fresh replicas × 0.5 × 1000 tokens/s × 10 s)
    assert picture["axes"]["compute"]["value"] == pytest.approx(150 + 150 + 600)


def _prompt_state(prompts_by_second):
    """A pool whose arrivals carry their prompt sizes (input_tokens on received), second by second."""
    builder = PartialBuilder("raw/0", replica_max_gap_s=15)
    for second, prompts in prompts_by_second.items():
        for prompt in prompts:
            builder.fold_request(req(second, "received", input_tokens=prompt))
    state = PoolState("p")
    for partial in builder.drain(1):
        assert state.merge(Partial.from_bytes(partial.to_bytes()), CONFIG)
    builder = PartialBuilder("raw/1", replica_max_gap_s=15)
    builder.fold_request(RequestEvent(**request_event(event_time=(max(prompts_by_second) + 1) * 1000 + 1,
                                                      phase="completed", pool="p")))
    for partial in builder.drain(2):
        state.merge(partial, CONFIG)
    detail = state.snapshot(CONFIG)["axes"]["demand"]["detail"]
    return {k[len("prompt_"):]: v for k, v in detail.items() if k.startswith("prompt_")}


def test_the_picture_compares_the_newest_arrivals_prompts_with_the_windows():
    prompts = _prompt_state({s: [500, 1000, 3000, 1500] * 5 if s < 108 else [4000] * 20 for s in range(100, 110)})
    assert prompts["tokens_window_count"] == 200 and prompts["tokens_recent_count"] == 40
    assert prompts["tokens_window_mean"] == pytest.approx((160 * 1500 + 40 * 4000) / 200, rel=0.02)
    assert prompts["tokens_recent_mean"] == pytest.approx(4000, rel=0.02)
    assert prompts["clip_tokens"] == pytest.approx(12000, rel=0.02)   # four times the earlier seconds' p90
    # a narrow mix turning four times heavier still reads as four times
    narrow = _prompt_state({s: [1000] * 20 if s < 108 else [4000] * 20 for s in range(100, 110)})
    assert narrow["tokens_recent_mean"] == pytest.approx(4000, rel=0.02)


LEGIT = [1000 + 10 * (i % 7) for i in range(20)]   # a second's arrivals, about 1030 tokens each


def test_a_burst_of_absurd_prompts_cannot_raise_its_own_clip():
    steady = {s: list(LEGIT) for s in range(100, 110)}
    steady[109] = steady[109][:-10] + [10_000_000] * 10   # a quarter of the newest 2 s
    prompts = _prompt_state(steady)
    assert prompts["clip_tokens"] < 4 * 1070
    # each claim counts as the clip: k of the newest n raise their mean by at most k/n of it
    assert prompts["tokens_recent_mean"] <= (30 * 1060 + 10 * prompts["clip_tokens"]) / 40 + 1


def test_one_claim_in_twenty_moves_neither_the_clip_nor_the_window_by_more_than_a_fifth():
    claiming = {s: LEGIT[:-1] + [10_000_000] for s in range(100, 110)}   # one in twenty, every second
    prompts = _prompt_state(claiming)
    assert prompts["clip_tokens"] < 4 * 1070
    assert prompts["tokens_window_mean"] < 1.2 * 1030   # the window reads at most 20% heavier


def test_arrivals_without_prompt_sizes_leave_the_comparison_out():
    prompts = _prompt_state({s: [None] * 20 for s in range(100, 110)})
    assert list(prompts.values()) == [None] * 6
