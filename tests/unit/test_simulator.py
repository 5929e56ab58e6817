"""The fleet simulator's own guarantees: conservation, KV capacity, preemption, determinism."""

import pytest

from pipeline.router import Reject
from pipeline.sim.arrivals import Arrival, RateSchedule, gamma_arrivals, trace_arrivals
from pipeline.sim.controllers import FixedThreshold, NoControl
from pipeline.sim.fleet import ClientPolicy, FleetEvent, FleetSim
from pipeline.sim.replay import TraceRow, load_trace
from pipeline.sim.replica import Hardware, Replica, Sequence

SMALL = Hardware(kv_capacity_tokens=6000, max_batch=8)


def fleet(controller=None, rate=12.0, seconds=60.0, replicas=3, hw=Hardware(), seed=3, **kw):
    arrivals = trace_arrivals(load_trace(), RateSchedule(((0.0, rate),)), seconds)
    return FleetSim("p", replicas, hw, arrivals, controller or NoControl(), seed=seed, duration_s=seconds,
                    drain_s=90.0, **kw)


class KvWatch(NoControl):
    """Checks every replica's KV after every controller tick."""

    def __init__(self):
        self.max_used = 0

    def tick(self, sim, now_s):
        for r in sim.replicas:
            assert r.kv_used() <= r.hw.kv_capacity_tokens
            self.max_used = max(self.max_used, r.kv_used() / r.hw.kv_capacity_tokens)


@pytest.mark.parametrize("rate", [5.0, 40.0])
def test_every_arrival_ends_completed_failed_rejected_or_deferred(rate):
    sim = fleet(FixedThreshold(), rate=rate, fleet_events=(FleetEvent(20.0, 1, 40.0),))
    stats = sim.run()
    assert stats.arrivals == len(stats.tasks) > 0
    outcomes = [t.outcome for t in stats.tasks]
    assert None not in outcomes and set(outcomes) <= {"completed", "failed", "rejected", "deferred"}
    if rate > 20:
        assert {"completed", "failed"} <= set(outcomes), "overload fails some work"


def test_kv_capacity_is_never_exceeded_and_preemption_happens_when_it_must():
    watch = KvWatch()
    sim = fleet(watch, rate=10.0, hw=SMALL, tick_s=0.05, long_context_from_s=0.0, long_context_factor=1.5)
    sim.run()
    assert watch.max_used > 0.9, "the cache was driven to its limit"
    assert sum(r.preemptions_total for r in sim.replicas) > 0, "growth past the cache preempts"
    assert sim.stats.wasted_tokens > 0, "and the preempted work is recomputed"


def test_replica_preempts_the_newest_and_recomputes_it():
    r = Replica("r", Hardware(kv_capacity_tokens=230, max_batch=4, kv_watermark=0.0))
    old, new = Sequence("old", 100, 0, 50), Sequence("new", 100, 0, 50)
    r.enqueue(old)
    r.enqueue(new)
    preempted = []
    for _ in range(120):
        r.start_step()
        preempted += r.finish_step().preempted
        assert r.kv_used() <= 230
    assert preempted and preempted[0] is new and not old.preempted
    assert new.recomputed_tokens >= 100, "re-admitted after old finished: prompt and generated tokens again"
    assert not r.has_work(), "both finished"


def test_a_context_longer_than_the_cache_fails_instead_of_waiting_forever():
    r = Replica("r", Hardware(kv_capacity_tokens=1000))
    seq = Sequence("x", 5000, 0, 10)
    r.enqueue(seq)
    r.start_step()
    assert r.finish_step().failed == [seq] and r.waiting_count == 0


def test_same_seed_same_results_and_another_seed_differs():
    def run(seed):
        stats = fleet(FixedThreshold(), rate=30.0, seed=seed).run()
        return [(t.id, t.priority, t.outcome, t.ended_s) for t in stats.tasks], stats.ttfts
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_every_controller_under_a_seed_serves_the_same_tasks():
    """Comparisons between controllers are paired: what a task is (class, tenant, steps and their sizes)
    never depends on what the controller did with the tasks before it, so a ratio measures the controller,
    not a different draw of work. (The two controllers here shed and retry differently from the start.)"""
    def shapes(controller):
        stats = fleet(controller, rate=40.0, fleet_events=(FleetEvent(20.0, 1, 40.0),)).run()
        return stats, [(t.id, t.arrived_s, t.priority, t.tenant, tuple(t.steps)) for t in stats.tasks]

    calm, calm_shapes = shapes(NoControl())
    strict, strict_shapes = shapes(FixedThreshold())
    assert calm.admitted != strict.admitted or calm.rejected != strict.rejected, "the runs must differ"
    assert calm_shapes == strict_shapes


def test_clients_time_out_and_retry_with_backoff_up_to_max_attempts():
    client = ClientPolicy(ttft_timeout_s=1.0, max_attempts=2, backoff_base_s=0.5)
    events = []
    sim = fleet(rate=60.0, replicas=1, client=client, emit=lambda kind, e: events.append(e) if kind == "request" else None)
    sim.run()
    cancelled = [e for e in events if e["phase"] == "cancelled"]
    assert cancelled and all(e["error_type"] == "timeout" for e in cancelled)
    assert max(e["attempt"] for e in events) == 2
    assert all(e["task_final"] == (e["attempt"] == 2) for e in cancelled)


class ShedEverything(NoControl):
    """Rejects every attempt with a 30 s retry-after."""

    def verdict(self, request, now_s):
        return Reject(30.0, "shed")


@pytest.mark.parametrize("ignore", [False, True])
def test_shed_work_returns_after_its_retry_after_unless_the_client_ignores_it(ignore):
    client = ClientPolicy(max_attempts=4, backoff_base_s=0.5, backoff_cap_s=2.0, ignore_retry_after=ignore)
    events = []
    sim = fleet(ShedEverything(), rate=2.0, seconds=20.0, client=client,
                emit=lambda kind, e: events.append(e) if kind == "request" else None)
    sim.run()
    rejected = [e for e in events if e["phase"] == "rejected"]
    assert max(e["attempt"] for e in rejected) == 4, "every attempt of a step is spent on shed retries"
    sent = {}
    for e in rejected:
        sent.setdefault(e["request_id"], []).append(e["event_time"] / 1000)
    gaps = [later - earlier for times in sent.values() for earlier, later in zip(times, times[1:])]
    assert gaps
    if ignore:
        assert max(gaps) <= 2.0 * 1.5, "the client's own capped backoff, not the 30 s it was told"
    else:
        assert min(gaps) >= 30.0, "a client that reads retry-after never comes back sooner"


def test_emitted_events_follow_the_contract():
    from pipeline.events import ReplicaSample, RequestEvent, decode
    import orjson

    events = []
    fleet(rate=5.0, seconds=10.0, emit=lambda kind, e: events.append((kind, e))).run()
    kinds = {k for k, _ in events}
    assert kinds == {"request", "replica"}
    for kind, e in events[:2000]:
        cls, key = (RequestEvent, e["task_id"]) if kind == "request" else (ReplicaSample, e["replica_id"])
        assert isinstance(decode(cls, orjson.dumps(e), key.encode(), 1 << 20), cls), e


def test_rate_schedule_and_arrival_sources():
    schedule = RateSchedule(((0.0, 10.0), (10.0, 30.0)))
    assert schedule.invert(100) == pytest.approx(10.0) and schedule.invert(130) == pytest.approx(11.0)
    trace = [TraceRow(float(i), 100, 10) for i in range(1000)]
    assert sum(1 for _ in trace_arrivals(trace, schedule, 20.0)) == pytest.approx(400, abs=2)
    bursty = list(gamma_arrivals(trace, schedule, 20.0, burstiness=0.5, seed=1))
    assert 300 < len(bursty) < 500 and all(isinstance(a, Arrival) for a in bursty)
    with pytest.raises(ValueError):
        RateSchedule(((5.0, 1.0),))


def test_engine_priority_scheduling_takes_critical_work_first():
    from dataclasses import replace as with_fields

    from pipeline.sim.replica import Hardware, Replica, Sequence

    for priority, first in ((False, "standard"), (True, "critical")):
        replica = Replica("r", with_fields(Hardware(), max_batch=1, priority_scheduling=priority))
        replica.enqueue(Sequence("standard", 100, 0, 10, rank=1))
        replica.enqueue(Sequence("critical", 100, 0, 10, rank=0))
        replica.start_step()
        assert [s.owner for s in replica.planned()] == [first]


def test_chunked_prefill_bounds_each_step_and_keeps_decoding():
    """vLLM's max_num_batched_tokens: a 5,000-token prompt is prefilled 1,000 tokens a step (less the running
    sequences' decode tokens) while a running sequence keeps getting a token every step; its first token comes
    when the last chunk is done, and its KV is held from the first chunk."""
    hw = Hardware(max_batched_tokens=1000)
    replica = Replica("r", hw)
    replica.enqueue(Sequence("short", 100, 0, 50))
    replica.start_step()
    assert [s.owner for s in replica.finish_step().first_tokens] == ["short"]
    replica.enqueue(Sequence("long", 5000, 0, 10))
    steps, prefilled, firsts = 0, [], []
    while not firsts:
        before = replica.prompt_tokens_total
        duration = replica.start_step()
        prefilled.append(replica.prompt_tokens_total - before)
        assert duration <= hw.decode_base_s + 2 * hw.decode_per_seq_s + 999 / hw.prefill_tokens_per_s + 1e-9
        assert replica.kv_used() >= 5000   # held while the prefill is under way
        generated = replica.generation_tokens_total
        firsts = [s.owner for s in replica.finish_step().first_tokens]
        assert replica.generation_tokens_total - generated >= 1   # "short" decoded in every step
        steps += 1
    assert firsts == ["long"] and sum(prefilled) == 5000 and max(prefilled) == 999 and steps == 6


def test_chunked_prefill_frees_what_an_aborted_or_lost_prefill_held():
    replica = Replica("r", Hardware(max_batched_tokens=1000))
    seq = Sequence("long", 5000, 0, 10)
    replica.enqueue(seq)
    replica.start_step()
    replica.finish_step()
    assert replica.kv_used() == 5001 and replica.prefilling == [seq]
    replica.abort(seq)
    assert replica.kv_used() == 0 and not replica.prefilling and not replica.has_work()
    other = Sequence("other", 5000, 0, 10)
    replica.enqueue(other)
    replica.start_step()
    assert replica.fail_all() == [other] and replica.kv_used() == 0


@pytest.mark.parametrize("refused", [False, True])
def test_the_publisher_fails_loudly_when_the_broker_does_not_take_its_events(monkeypatch, refused):
    """``sluice produce`` (the demo's and the bench's publisher) awaited every send with no bound, and an
    idempotent aiokafka producer never expires a batch: a broker that stopped acknowledging held the run
    for ever. It now fails within the delivery bound (or with the broker's refusal), its producer closed."""
    import asyncio

    from aiokafka.errors import TopicAuthorizationFailedError

    from pipeline import bounded_producer
    from pipeline.settings import load_settings
    from pipeline.sim import producer as publisher
    from pipeline.sim.replay import Emitted
    from tests.unit.fake_producers import RefusingProducer, StalledProducer

    monkeypatch.setattr(bounded_producer, "DELIVERY_TIMEOUT_S", 0.2)
    monkeypatch.setattr(bounded_producer, "START_TIMEOUT_S", 0.2)
    made = []

    async def start(bootstrap, **options):
        made.append(RefusingProducer(TopicAuthorizationFailedError()) if refused else StalledProducer(False))
        return made[-1]

    monkeypatch.setattr(publisher, "start_producer", start)
    events = [Emitted(0.0, "request", f"t{i}", {"task_id": f"t{i}"}) for i in range(3)]
    expected = TopicAuthorizationFailedError if refused else bounded_producer.NotDelivered
    with pytest.raises(expected) as failure:
        asyncio.run(asyncio.wait_for(publisher.produce(load_settings(env={}), "unused", events, paced=False), 5))
    assert made[0].stopped
    if not refused:
        assert "3 of 3 records not acknowledged" in str(failure.value)
        assert made[0]._sender.sender_task.cancelled(), "its sender is not left retrying"
