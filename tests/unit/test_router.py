"""The router client's pure core: trust, decisions from signals, and the fallback."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.admission.policy import AdmissionConfig, Decision, decide
from pipeline.admission.signing import sign
from pipeline.router import ADMIT, Admit, Decider, Defer, Redirect, Reject, Request, SignalBook
from tests.unit.test_admission_policy import picture

KEYS = {"k1": b"0123456789abcdef-k1"}


def signed(pool="p", now_ms=1_000_000, key="k1", secret=None, **pressures):
    d = decide(picture(pool, watermark=now_ms, **pressures), Decision(pool), AdmissionConfig(), now_ms)
    body = {"event_id": "0b6f3a52-9a38-4f0e-8d6e-3f0c1f1a2b3c", "event_time": now_ms, **d.signal}
    return sign(body, key, secret or KEYS[key]), d.signal


class Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


def book_with(*messages, clock=None):
    book = SignalBook(KEYS, clock=clock or Clock(1_000.0))
    for m in messages:
        book.offer(m)
    return book


def test_security_refusals_are_counted():
    good, _ = signed(now_ms=2_000_000)
    older, _ = signed(now_ms=1_990_000)
    book = SignalBook(KEYS, clock=Clock(2_000.0))
    assert book.offer(good)
    assert not book.offer(good.replace(b'"state":"ok"', b'"state":"critical"'))
    assert not book.offer(good[:good.rindex(b',"signature"')] + b"}")
    assert not book.offer(signed(key="k1", secret=b"not-the-right-secret")[0])
    assert not book.offer(signed(key="k9", secret=b"another-secret-xxxx")[0])
    assert not book.offer(older)
    assert not book.offer(None)
    assert book.refused == {"bad_signature": 2, "unsigned": 1, "unknown_key": 1, "replayed": 1, "tombstone": 1}


def test_admit_fractions_are_probabilistic_per_class():
    message, signal = signed()
    signal_book = book_with(message)
    signal_book.signals["p"]["admit_fraction"] = {"critical": 1.0, "standard": 1.0, "sheddable": 0.3,
                                                   "deferrable": 0.0}
    signal_book.signals["p"]["defer"] = {"classes": [], "retry_after_s": 5.0}
    decider = Decider(signal_book, seed=1, clock=Clock(1_000.0))
    verdicts = [decider.decide(Request("p", "sheddable")) for _ in range(2000)]
    share = sum(isinstance(v, Admit) for v in verdicts) / len(verdicts)
    assert 0.27 < share < 0.33
    assert all(isinstance(decider.decide(Request("p", "critical")), Admit) for _ in range(100))
    assert isinstance(decider.decide(Request("p", "deferrable")), Reject)


def test_same_seed_same_decisions():
    message, _ = signed(queue=1.8)
    runs = []
    for _ in range(2):
        decider = Decider(book_with(message), seed=42, clock=Clock(1_000.0))
        runs.append([decider.decide(Request("p", c)) for c in ("sheddable", "standard") * 50])
    assert runs[0] == runs[1]


def test_continuing_tasks_use_their_own_fraction():
    message, _ = signed()
    book = book_with(message)
    book.signals["p"]["admit_fraction"]["standard"] = 0.0
    book.signals["p"]["continuing_task_admit_fraction"]["standard"] = 1.0
    decider = Decider(book, seed=1, clock=Clock(1_000.0))
    assert isinstance(decider.decide(Request("p", "standard", continuing=True)), Admit)
    assert not isinstance(decider.decide(Request("p", "standard", continuing=False)), Admit)


def test_defer_redirect_and_early_rejection():
    message, _ = signed()
    book = book_with(message)
    s = book.signals["p"]
    s["admit_fraction"] = {"critical": 1.0, "standard": 0.0, "sheddable": 0.0, "deferrable": 0.0}
    s["defer"] = {"classes": ["deferrable"], "retry_after_s": 12.0}
    s["redirect"] = [{"pool": "q", "weight": 1.0, "cold_prefill_cost_s": 0.4}]
    decider = Decider(book, seed=1, clock=Clock(1_000.0))
    deferred = decider.decide(Request("p", "deferrable"))
    assert isinstance(deferred, Defer) and 12.0 <= deferred.retry_after_s <= 18.0, "never before the signal says"
    assert decider.decide(Request("p", "standard", slo_ttft_s=1.0)) == Redirect("q")
    shed = decider.decide(Request("p", "standard", slo_ttft_s=0.3))
    assert isinstance(shed, Reject) and shed.reason == "shed", "a cold move would miss the SLO"
    s["max_predicted_wait_s"] = 3.0
    s["admit_fraction"]["standard"] = 1.0
    assert decider.decide(Request("p", "standard", slo_ttft_s=1.0)) == Redirect("q", "predicted_wait"), \
        "a move says why, for a caller that cannot make it (the LiteLLM hook rejects with that reason)"
    s["redirect"] = []
    assert decider.decide(Request("p", "standard", slo_ttft_s=1.0)).reason == "predicted_wait"
    assert decider.decide(Request("p", "critical", slo_ttft_s=1.0)) == ADMIT, "critical: only its admit fraction"


def test_retry_afters_are_spread_so_shed_work_never_returns_in_one_wave():
    message, _ = signed()
    book = book_with(message)
    s = book.signals["p"]
    s["admit_fraction"] = {"critical": 1.0, "standard": 1.0, "sheddable": 0.0, "deferrable": 0.0}
    s["defer"] = {"classes": ["deferrable"], "retry_after_s": 10.0}
    s["redirect"] = []
    decider = Decider(book, seed=3, clock=Clock(1_000.0))
    afters = [decider.decide(Request("p", "sheddable")).retry_after_s for _ in range(1000)]
    assert 5.0 <= min(afters) and max(afters) <= 15.0
    assert abs(sum(afters) / len(afters) - 10.0) < 0.5, "the mean is the signal's"
    deferrals = [decider.decide(Request("p", "deferrable")).retry_after_s for _ in range(200)]
    assert 10.0 <= min(deferrals) and max(deferrals) <= 15.0, "a deferral never comes back before it was told"
    in_one_second = max(sum(1 for a in afters if lo <= a < lo + 1) for lo in range(5, 15))
    assert in_one_second < 0.15 * len(afters), "no second takes the bulk of the returning work"


def rejected_by_budget(verdict) -> bool:
    """A retry-budget rejection, its retry-after the signal's (10 s in ``signed()``) spread 0.5–1.5×."""
    return isinstance(verdict, Reject) and verdict.reason == "retry_budget" and 5.0 <= verdict.retry_after_s <= 15.0


def test_local_retry_budget():
    message, _ = signed()
    book = book_with(message)
    book.signals["p"]["retry_budget"] = 0.1
    decider = Decider(book, seed=1, clock=Clock(1_000.0), min_retries=0)
    for _ in range(18):
        decider.decide(Request("p", "standard"))
    assert isinstance(decider.decide(Request("p", "standard", retry=True)), Admit)   # 1 of 19
    assert isinstance(decider.decide(Request("p", "standard", retry=True)), Admit)   # 2 of 20: at the budget
    assert rejected_by_budget(decider.decide(Request("p", "standard", retry=True)))  # 3 of 21


def test_a_burst_of_failure_retries_is_bounded_though_the_minutes_budget_has_room():
    """A replica that dies fails all it held at once: a budget over two minutes let every retry in within a
    second, into the survivors, before a picture showed the loss. Over any two seconds it holds too."""
    clock = Clock(1_000.0)
    book = book_with(signed()[0], clock=clock)
    book.signals["p"]["retry_budget"] = 0.1
    decider = Decider(book, seed=1, clock=clock, burst_s=2, min_burst_retries=3)
    for _ in range(3):   # 20 first attempts a second: the two-minute budget has room for about 16 retries
        for _ in range(20):
            decider.decide(Request("p", "standard"))
        clock.t += 1.0
    verdicts = [decider.decide(Request("p", "standard", retry=True)) for _ in range(30)]
    admitted = sum(isinstance(v, Admit) for v in verdicts)
    assert admitted == 5, "20 + 5 attempts in the last two seconds: a sixth retry is over 10% of them + 3"
    assert all(rejected_by_budget(v) for v in verdicts[admitted:])
    assert isinstance(decider.decide(Request("p", "critical", retry=True)), Admit), "critical is never budgeted"
    assert isinstance(decider.decide(Request("p", "standard", retry=True, after_shed=True)), Admit)


def test_critical_retries_count_against_the_budget_but_only_its_admit_fraction_rejects_them():
    """The docs promise critical work is rejected by nothing but its own admit fraction; a retry budget spent
    in a cascade rejected critical retries too. Their retries still tighten the budget for the others."""
    book = book_with(signed()[0])
    book.signals["p"]["retry_budget"] = 0.1
    decider = Decider(book, seed=1, clock=Clock(1_000.0), min_retries=0)
    for _ in range(10):
        decider.decide(Request("p", "standard"))
    assert all(decider.decide(Request("p", "critical", retry=True)) == ADMIT for _ in range(10))
    assert rejected_by_budget(decider.decide(Request("p", "standard", retry=True))), "10 critical retries of 21"
    book.signals["p"]["admit_fraction"] = book.signals["p"]["admit_fraction"] | {"critical": 0.0}
    assert isinstance(decider.decide(Request("p", "critical", retry=True)), (Reject, Redirect))


def test_each_pool_spends_its_own_retry_budget():
    """One count for every pool: a retry storm in one pool spent a quiet pool's budget, and a busy healthy pool's
    first attempts let a failing pool (its budget tightened to 1 %) retry as much as it liked."""
    book = book_with(signed(pool="a")[0], signed(pool="b")[0])
    decider = Decider(book, seed=1, clock=Clock(1_000.0))
    for _ in range(50):
        decider.decide(Request("a", "standard"))
        decider.decide(Request("a", "standard", retry=True))
    for _ in range(100):
        decider.decide(Request("b", "standard"))
    assert decider.decide(Request("b", "standard", retry=True)) == ADMIT, "1 retry in 101 attempts: within 10 %"
    book.signals["a"]["retry_budget"] = 0.01
    decider = Decider(book, seed=1, clock=Clock(1_000.0))
    for _ in range(2000):
        decider.decide(Request("b", "standard"))
    for _ in range(10):
        decider.decide(Request("a", "standard"))
    retries = [decider.decide(Request("a", "standard", retry=True)) for _ in range(20 + decider.min_retries)]
    assert all(rejected_by_budget(verdict) for verdict in retries[decider.min_retries:]), \
        "past the floor, a's own 1 % of its own attempts"


def test_the_pools_a_router_tracks_are_bounded_the_least_recently_signalled_evicted_first():
    """Tombstones reach the book without their pool, so every pool a controller ever signalled stayed; and the
    retry counts follow request pools."""
    book = SignalBook(KEYS, clock=Clock(1_000.0), max_pools=2)
    assert book.offer(signed(pool="a", now_ms=999_000)[0]) and book.offer(signed(pool="b", now_ms=999_000)[0])
    assert book.offer(signed(pool="a", now_ms=999_500)[0])          # a refreshed: b is now the oldest
    assert book.offer(signed(pool="c")[0])
    assert list(book.signals) == ["a", "c"] and set(book.tenants) == {"a", "c"}
    assert not book.offer(signed(pool="a", now_ms=999_000)[0]), "a's seq is still remembered"
    decider = Decider(book, seed=1, clock=Clock(1_000.0))
    for pool in ("a", "c", "a", "b", "c"):
        book.offer(signed(pool=pool)[0])
        decider.decide(Request(pool, "standard"))
    assert list(decider.attempts) == ["c", "b"], "counted longest ago (a) forgotten first"


def test_expired_signal_fail_static_then_adaptive_throttling():
    message, signal = signed(now_ms=1_000_000)
    book = book_with(message)
    book.signals["p"]["admit_fraction"]["sheddable"] = 0.0
    book.signals["p"]["defer"]["classes"] = []
    clock = Clock(signal["valid_until"] / 1000 + 10)       # expired 10 s ago: still fail-static
    decider = Decider(book, seed=3, fallback_static_s=30, clock=clock)
    assert isinstance(decider.decide(Request("p", "sheddable")), Reject)
    clock.t = signal["valid_until"] / 1000 + 31             # past the grace: adaptive throttling
    assert isinstance(decider.decide(Request("p", "sheddable")), Admit), "no history: admit"
    for _ in range(100):
        decider.record(accepted=False)                      # the backend refuses everything
    rejects = sum(isinstance(decider.decide(Request("p", "sheddable")), Reject) for _ in range(1000))
    assert rejects / 1000 == pytest.approx(100 / 101, abs=0.03)
    for _ in range(100):
        decider.record(accepted=True)                       # requests 200, accepts 100: K·accepts ≥ requests
    assert all(isinstance(decider.decide(Request("p", "sheddable")), Admit) for _ in range(100))


@pytest.mark.parametrize("priority", ["Critical", "high", ""])
def test_an_unknown_priority_is_refused_whether_or_not_the_pool_has_a_signal(priority):
    """It raised a KeyError only for a pool with a signal: a typo passed every test run without one."""
    with pytest.raises(ValueError, match="critical, standard, sheddable, deferrable"):
        Request("p", priority)


def test_no_signal_for_an_unknown_pool_throttles_adaptively():
    decider = Decider(SignalBook(KEYS), seed=1, clock=Clock(5.0))
    assert isinstance(decider.decide(Request("unknown", "standard")), Admit)


def test_routers_judge_a_signals_time_by_their_own_clock():
    now = 5_000_000
    book = SignalBook(KEYS, clock=Clock(now / 1000))
    ahead, _ = signed(now_ms=now + 3_600_000)
    assert not book.offer(ahead), "issued an hour in the future"
    expired, _ = signed(now_ms=now - 3_600_000)
    assert not book.offer(expired), "expired on arrival: it would displace a valid signal"
    good, body = signed(now_ms=now)
    body = dict(body, valid_until=now + 3_600_000)
    forever = sign({"event_id": "0b6f3a52-9a38-4f0e-8d6e-3f0c1f1a2b3c", "event_time": now, **body}, "k1", KEYS["k1"])
    assert not book.offer(forever), "valid for an hour"
    assert book.offer(good)
    assert book.refused == {"issued_in_future": 1, "expired": 1, "validity_too_long": 1}


def test_a_controller_an_hour_fast_cannot_pin_the_routers():
    """Two controllers an hour apart publish for one pool: the routers follow the one whose clock is theirs."""
    clock = Clock(5_000.0)
    book = SignalBook(KEYS, clock=clock)
    decider = Decider(book, seed=1, clock=clock)
    fast_previous, right_previous = Decision("p"), Decision("p")
    for tick in range(40):
        now_ms = int(clock.t * 1000)
        fast_previous = decide(picture("p", watermark=now_ms + 3_600_000, kv_cache=9.0), fast_previous,
                               AdmissionConfig(), now_ms + 3_600_000)
        right_previous = decide(picture("p", watermark=now_ms), right_previous, AdmissionConfig(), now_ms)
        for decision in (fast_previous, right_previous):
            book.offer(sign({"event_id": "0b6f3a52-9a38-4f0e-8d6e-3f0c1f1a2b3c", "event_time": now_ms,
                             **decision.signal}, "k1", KEYS["k1"]))
        clock.t += 0.25
    assert fast_previous.signal["admit_fraction"]["sheddable"] == 0.0, "the fast one sheds"
    assert book.signals["p"]["seq"] == right_previous.signal["seq"]
    assert book.refused == {"issued_in_future": 40}
    assert all(decider.decide(Request("p", c, slo_ttft_s=2.0)) == ADMIT for c in ("critical", "sheddable"))


def test_a_router_clock_stepped_back_obeys_its_last_signal_for_the_fail_static_grace_only():
    """Stepped back an hour, the router kept its last (shedding) signal in force for an hour by the signal's own
    times, while refusing every newer one as issued in the future. Now the first look after the step (an offer
    or a request) takes it as expiring then: fail-static for ``fallback_static_s``, then the fallback; and the
    controller's signals are followed again once their times agree with the router's clock."""
    now = 5_000_000
    hot = Decision("p")
    for tick in range(12):
        hot = decide(picture("p", watermark=now - 12 + tick, kv_cache=9.0, demand=9.0, queue=9.0), hot,
                     AdmissionConfig(), now - 12 + tick)
    event = {"event_id": "0b6f3a52-9a38-4f0e-8d6e-3f0c1f1a2b3c", "event_time": now}
    clock = Clock(now / 1000)
    book = SignalBook(KEYS, clock=clock)
    decider = Decider(book, seed=1, fallback_static_s=30, clock=clock)
    assert book.offer(sign({**event, **hot.signal}, "k1", KEYS["k1"])) and hot.signal["admit_fraction"]["standard"] == 0
    clock.t -= 3600                                            # NTP steps the router's clock back an hour
    right = decide(picture("p", watermark=now + 1000), Decision("p"), AdmissionConfig(), now + 1000).signal
    assert not book.offer(sign({**event, **right}, "k1", KEYS["k1"])) and book.refused == {"issued_in_future": 1}
    clock.t += 20
    assert isinstance(decider.decide(Request("p", "standard")), Reject), "fail-static: the last signal still rules"
    clock.t += 11
    assert all(decider.decide(Request("p", "standard")) == ADMIT for _ in range(100)), "past the grace: fallback"
    back_ms = int(clock.t * 1000)                              # the controller's clock steps back too
    again = decide(picture("p", watermark=back_ms, kv_cache=9.0, demand=9.0, queue=9.0), hot, AdmissionConfig(),
                   back_ms)
    assert again.signal["seq"] == hot.signal["seq"] + 1, "the controller's seq rises whatever its clock does"
    assert book.offer(sign({**event, **again.signal}, "k1", KEYS["k1"]))
    assert isinstance(decider.decide(Request("p", "standard")), Reject), "followed again"


def test_a_signal_with_fields_this_router_does_not_know_is_followed_by_what_it_knows():
    """Expand before contract: a controller that adds a field to admission_signal.v1 (as the per-tenant
    fractions were, issue 16) must not make deployed routers refuse every signal. The schema alone would refuse it (what a
    router before this change did); this router drops unknown top-level fields after the signature check and
    follows the rest. Inside a known field the schema stays strict."""
    from pipeline.contract import Invalid
    from pipeline.events import validate

    d = decide(picture("p", watermark=2_000_000, queue=3.0), Decision("p"), AdmissionConfig(), 2_000_000)
    body = {"event_id": "0b6f3a52-9a38-4f0e-8d6e-3f0c1f1a2b3c", "event_time": 2_000_000, **d.signal,
            "surge_pricing": [{"tenant": "noisy", "multiplier": 2.0}]}
    with pytest.raises(Invalid):
        validate("admission_signal", body)   # a strict reader refuses the new field
    book = SignalBook(KEYS, clock=Clock(2_000.0))
    assert book.offer(sign(body, "k1", KEYS["k1"])) and book.refused == {}
    assert "surge_pricing" not in book.signals["p"]
    assert book.signals["p"]["admit_fraction"] == d.signal["admit_fraction"]
    nested = dict(body, admit_fraction={**d.signal["admit_fraction"], "platinum": 1.0}, seq=body["seq"] + 1)
    assert not book.offer(sign(nested, "k1", KEYS["k1"])) and book.refused == {"invalid": 1}


@pytest.mark.parametrize("predates", [False, True])
def test_routers_before_and_after_the_moves_cache_loss_move_work_alike(monkeypatch, predates):
    """``redirect_cache_loss_fraction`` was added in place to v1: a router that does not know it drops it and
    keeps following the signal, redirects included."""
    import pipeline.router.signal_book as signal_book

    if predates:
        monkeypatch.setattr(signal_book, "KNOWN_FIELDS", signal_book.KNOWN_FIELDS - {"redirect_cache_loss_fraction"})
    now_ms = 1_000_000
    decision = Decision("p")
    for tick in range(10):   # the level climbs in bounded steps
        hot = picture("p", watermark=now_ms + tick, demand=3.0) | {"cache": {"cached_input_share": 0.6}}
        decision = decide(hot, decision, AdmissionConfig(), now_ms + tick, siblings=[picture("q", demand=0.1)])
    signal = decision.signal
    assert signal["redirect_cache_loss_fraction"] == 0.6 and signal["admit_fraction"]["sheddable"] == 0.0
    body = {"event_id": "0b6f3a52-9a38-4f0e-8d6e-3f0c1f1a2b3c", "event_time": now_ms, **signal}
    book = book_with(sign(body, "k1", KEYS["k1"]), clock=Clock(now_ms / 1000))
    assert ("redirect_cache_loss_fraction" in book.signals["p"]) is not predates, book.refused
    decider = Decider(book, seed=1, clock=Clock(now_ms / 1000))
    assert decider.decide(Request("p", "sheddable", slo_ttft_s=5.0)) == Redirect("q")


@given(st.lists(st.tuples(st.floats(0, 5), st.booleans(), st.integers(0, 3), st.integers(0, 3)), max_size=200),
       st.floats(1, 20))
def test_sliding_counts_total_exactly_the_window_however_adds_and_reads_interleave(steps, window):
    """Expired seconds are dropped only when a new second starts (the router's hot path adds once per
    request), so a read must still leave out whatever has expired since the last add."""
    from pipeline.router import SlidingCounts

    counts, seen, now = SlidingCounts(window), [], 0.0
    for gap, read, a, b in steps:   # adds and reads, in time order
        now += gap
        if read:
            live = [(a, b) for second, a, b in seen if second > now - window]
            assert counts.totals(now) == (sum(a for a, _ in live), sum(b for _, b in live))
        else:
            counts.add(now, a, b)
            seen.append((int(now), a, b))
    assert len(counts.buckets) <= window + 2


def test_sliding_counts_forget_the_window_when_the_clock_steps_back_past_it():
    """Seconds ahead of a clock that stepped back an hour never expired: the retry budget counted an hour of
    old attempts. A small step back counts into the newest second and loses nothing."""
    from pipeline.router import SlidingCounts

    counts, t0 = SlidingCounts(10), 1_700_000_000
    for t in range(t0, t0 + 10):
        counts.add(t + 0.5, 10, 5)
    counts.add(t0 + 8.2, 1, 1)                     # NTP stepped back two seconds
    assert counts.totals(t0 + 9.9) == (101, 51)
    back = t0 + 9.9 - 3600                         # stepped back an hour: nothing from the future
    assert counts.totals(back) == (0, 0)
    counts.add(back, 2, 1)
    assert counts.totals(back + 0.05) == (2, 1)
    assert counts.totals(back + 10) == (0, 0)


def test_the_emitter_loses_only_the_events_it_cannot_encode_or_the_broker_refuses():
    """One event without a task id lost its whole batch, and a batch with one refused record was counted
    as lost in full although the rest were delivered."""
    import asyncio

    from pipeline.router import EventEmitter
    from pipeline.settings import load_settings

    class Producer:
        delivered: list = []

        async def send(self, topic, value, key):
            outcome = asyncio.get_running_loop().create_future()
            if key == b"t3":
                outcome.set_exception(RuntimeError("the broker refused t3"))
            else:
                self.delivered.append(key)
                outcome.set_result(None)
            return outcome

        async def stop(self):
            pass

    async def run():
        emitter = EventEmitter(load_settings(env={}), "unused")
        emitter._producer = Producer()
        for event in [{"task_id": "t0"}, {"task_id": None}, {"other": 1}, {"task_id": "t1"},
                      {"task_id": "t2", "v": object()}, {"task_id": "t3"}, {"task_id": "t4"}]:
            emitter.emit(event)
        emitter._task = asyncio.create_task(emitter._pump())
        await emitter.stop(drain_timeout_s=5)    # returns once every event was sent or counted as dropped
        return emitter

    emitter = asyncio.run(run())
    assert Producer.delivered == [b"t0", b"t1", b"t4"]
    assert (emitter.sent, emitter.dropped) == (3, 4)


@pytest.mark.parametrize("sender_done", [True, False])
def test_a_stalled_producer_is_replaced_and_later_events_are_delivered(sender_done):
    """aiokafka's producer keeps queueing records after its background sender ended, and their futures never
    resolve: the emitter's pump awaited them for ever and every later event stayed in the buffer (the
    LiteLLM proxy's events stopped reaching the worker, CI). A sender seen to have ended is replaced before a
    batch goes to it; one that leaves a batch unacknowledged past ``delivery_timeout_s`` is replaced after,
    that batch counted as lost. A replacement that fails costs its batch only."""
    import asyncio

    from pipeline.router import EventEmitter
    from pipeline.settings import load_settings
    from tests.unit.fake_producers import DeliveringProducer, StalledProducer

    async def scenario():
        emitter = EventEmitter(load_settings(env={}), "unused", start_timeout_s=0.2, delivery_timeout_s=0.3)
        stalled, good = StalledProducer(sender_done), DeliveringProducer()
        made: list = [RuntimeError("the broker is down"), good] if not sender_done else [good]

        async def new_producer():
            made_now = made.pop(0)
            if isinstance(made_now, Exception):
                raise made_now
            return made_now

        emitter._new_producer = new_producer
        emitter._producer = stalled
        emitter._task = asyncio.create_task(emitter._pump())
        emitter.emit({"task_id": "t0"})
        await asyncio.wait_for(emitter.queue.join(), 5)
        emitter.emit({"task_id": "t1"})   # after a failed replacement: no producer yet, so one is made now
        await emitter.stop(drain_timeout_s=5)
        return emitter, stalled, good

    emitter, stalled, good = asyncio.run(scenario())
    if sender_done:   # seen before sending: nothing is lost
        assert stalled.queued == [] and good.delivered == [b"t0", b"t1"]
        assert (emitter.sent, emitter.dropped, emitter.producers_replaced) == (2, 0, 1)
    else:             # t0 went to the stalled producer: lost and counted; the first replacement failed
        assert stalled.queued == [b"t0"] and good.delivered == [b"t1"]
        assert (emitter.sent, emitter.dropped, emitter.producers_replaced) == (1, 1, 1), "a failed start not counted"
        assert stalled.stopped and stalled._sender.sender_task.cancelled(), "its sender is not left retrying"


def test_a_producer_refused_for_its_sequence_is_replaced_not_kept_refusing():
    """A batch refused with an out-of-order sequence costs its partition's sequence numbers: that producer's every
    later batch is refused the same way, and the emitter dropped every event from then on (found in review)."""
    import asyncio

    from aiokafka.errors import NotLeaderForPartitionError, OutOfOrderSequenceNumber

    from pipeline.router import EventEmitter
    from pipeline.settings import load_settings
    from tests.unit.fake_producers import DeliveringProducer, RefusingProducer

    async def scenario():
        emitter = EventEmitter(load_settings(env={}), "unused", start_timeout_s=0.2, delivery_timeout_s=0.3)
        passing, spoiled, good = RefusingProducer(NotLeaderForPartitionError()), \
            RefusingProducer(OutOfOrderSequenceNumber()), DeliveringProducer()

        async def new_producer():
            return good

        emitter._new_producer = new_producer
        emitter._task = asyncio.create_task(emitter._pump())
        for producer, task in ((passing, "t0"), (spoiled, "t1")):
            emitter._producer = producer
            emitter.emit({"task_id": task})
            await asyncio.wait_for(emitter.queue.join(), 5)
            if producer is passing:
                assert emitter._producer is passing, "a refusal of that batch alone keeps the producer"
        emitter.emit({"task_id": "t2"})
        await emitter.stop(drain_timeout_s=5)
        return emitter, spoiled, good

    emitter, spoiled, good = asyncio.run(scenario())
    assert spoiled.stopped and good.delivered == [b"t2"]
    assert (emitter.sent, emitter.dropped, emitter.producers_replaced) == (1, 2, 1)


def test_a_quiet_pool_may_retry_a_failure_whatever_its_budget():
    """Counted per pool, a pool with a request a minute would refuse its first retry (1 > 10% of 3): a floor of
    min_retries per window lets it, and a storm is still held to the budget beyond that."""
    book = book_with(signed()[0])
    book.signals["p"]["retry_budget"] = 0.1
    decider = Decider(book, seed=1, clock=Clock(1_000.0), min_retries=2)
    decider.decide(Request("p", "standard"))
    verdicts = [decider.decide(Request("p", "standard", retry=True)) for _ in range(3)]
    assert verdicts[:2] == [ADMIT, ADMIT] and rejected_by_budget(verdicts[2])


@pytest.mark.parametrize("predates", [False, True])
def test_a_request_is_moved_only_to_a_pool_that_serves_its_model(monkeypatch, predates):
    """``redirect_models`` (added in place to v1) says which of the source's models each target serves: a pool
    of two models moves each request only where its model is served. A router that predates it drops it and
    moves as before; one that does not know the request's model moves as before too."""
    import orjson

    import pipeline.router.signal_book as signal_book
    from pipeline.events import validate

    if predates:
        monkeypatch.setattr(signal_book, "KNOWN_FIELDS", signal_book.KNOWN_FIELDS - {"redirect_models"})
    now_ms = 1_000_000
    decision = Decision("p")
    for tick in range(10):
        hot = picture("p", watermark=now_ms + tick, demand=3.0) | {"models": ["m-chat", "m-code"]}
        decision = decide(hot, decision, AdmissionConfig(), now_ms + tick,
                          siblings=[picture("q", demand=0.1) | {"models": ["m-code", "m-other"]}])
    signal = decision.signal
    assert signal["redirect_models"] == [{"pool": "q", "models": ["m-code"]}]
    body = {"event_id": "0b6f3a52-9a38-4f0e-8d6e-3f0c1f1a2b3c", "event_time": now_ms, **signal}
    validate("admission_signal", orjson.loads(sign(body, "k1", KEYS["k1"])))
    book = book_with(sign(body, "k1", KEYS["k1"]), clock=Clock(now_ms / 1000))
    assert ("redirect_models" in book.signals["p"]) is not predates, book.refused
    decider = Decider(book, seed=1, clock=Clock(now_ms / 1000))
    chat = decider.decide(Request("p", "sheddable", slo_ttft_s=5.0, model="m-chat"))
    assert chat == (Redirect("q") if predates else Reject(chat.retry_after_s, "shed"))
    assert decider.decide(Request("p", "sheddable", slo_ttft_s=5.0, model="m-code")) == Redirect("q")
    assert decider.decide(Request("p", "sheddable", slo_ttft_s=5.0)) == Redirect("q")
    # off, for routers from before session 7 (they refuse any member they do not know)
    off = Decision("p")
    for tick in range(10):
        hot = picture("p", watermark=now_ms + tick, demand=3.0) | {"models": ["m-chat", "m-code"]}
        off = decide(hot, off, AdmissionConfig(redirect_models=False), now_ms + tick,
                     siblings=[picture("q", demand=0.1) | {"models": ["m-code", "m-other"]}])
    assert off.signal["redirect"] and "redirect_models" not in off.signal


def test_no_redirect_no_redirect_models():
    calm = decide(picture("p", watermark=1, demand=0.1) | {"models": ["m"]}, Decision("p"), AdmissionConfig(), 1,
                  siblings=[picture("q", demand=0.1) | {"models": ["m"]}]).signal
    assert calm["redirect"] == [] and "redirect_models" not in calm


def test_work_is_never_moved_to_its_own_pool_nor_to_a_pool_shedding_its_class():
    """A signal's redirect is the source's view of the target; the target's own current signal is newer news.
    Two pools relaxing after an overload offered each other, so moved work went round (A → B → A), a move
    admitted work into a pool shedding it, and a signal naming its own pool switched its shedding off."""
    now_ms = 1_000_000
    shed = {"critical": 1.0, "standard": 0.0, "sheddable": 0.0, "deferrable": 0.0}

    def body(pool, redirect_to, admit):
        message, _ = signed(pool, now_ms)
        signal = orjson.loads(message)
        for field in ("key_id", "signature"):
            del signal[field]
        signal |= {"admit_fraction": admit, "continuing_task_admit_fraction": admit,
                   "redirect": [{"pool": redirect_to, "weight": 1.0, "cold_prefill_cost_s": 0.1}]}
        return sign(signal, "k1", KEYS["k1"])

    import orjson

    half = dict(shed, standard=0.5)
    book = book_with(body("A", "B", shed), body("B", "A", shed), body("C", "C", shed), body("D", "E", shed),
                     body("F", "G", shed), body("G", "A", half), clock=Clock(now_ms / 1000))
    assert book.refused == {}, book.refused
    decider = Decider(book, seed=1, clock=Clock(now_ms / 1000))
    for pool in ("A", "B", "C"):
        verdict = decider.decide(Request(pool, "standard", slo_ttft_s=2.0))
        assert isinstance(verdict, Reject) and verdict.reason == "shed", (pool, verdict)
    assert decider.decide(Request("D", "standard", slo_ttft_s=2.0)) == Redirect("E"), "E has no signal: it may take it"
    assert decider.decide(Request("A", "critical", slo_ttft_s=2.0)) == ADMIT
    # a target whose own signal expired but is still obeyed (the fail-static grace) sheds moved work too
    grace = Decider(book, seed=1, clock=Clock(now_ms / 1000 + 20))
    assert isinstance(grace.decide(Request("A", "standard", slo_ttft_s=2.0)), Reject)
    # into a pool admitting half of the class, about half of it moves: as that pool's own requests are admitted
    moved = [decider.decide(Request("F", "standard", slo_ttft_s=2.0)) for _ in range(2000)]
    assert 0.45 < sum(v == Redirect("G") for v in moved) / 2000 < 0.55
    assert all(v == Redirect("G") or isinstance(v, Reject) for v in moved)


def test_a_signal_with_an_absurd_seq_rules_until_it_expires_not_for_good():
    """A valid key holder's one signal with seq 2^53 - 1 refused every later signal as replayed, for good: an
    hour of correct shedding signals afterwards, and the router admitted everything."""
    import orjson

    now_ms = 1_000_000_000
    pinned, _ = signed(now_ms=now_ms)
    body = orjson.loads(pinned)
    for field in ("key_id", "signature"):
        del body[field]
    clock = Clock(now_ms / 1000)
    book = book_with(sign(body | {"seq": 2**53 - 1}, "k1", KEYS["k1"]), clock=clock)
    later = body | {"issued_at": now_ms + 1000, "valid_until": now_ms + 7000, "seq": now_ms + 1000}
    clock.t = (now_ms + 1000) / 1000
    assert not book.offer(sign(later, "k1", KEYS["k1"])), "while the held signal rules, the seq must rise"
    after = body | {"issued_at": now_ms + 40_000, "valid_until": now_ms + 46_000, "seq": now_ms + 40_000,
                    "state": "overloaded"}
    clock.t = (now_ms + 40_000) / 1000   # the pinned one expired more than the skew allowance ago
    # a captured signal issued before the held one (valid longer: validity_s lowered since) cannot roll it back
    captured = body | {"issued_at": now_ms - 1000, "valid_until": now_ms + 59_000, "seq": now_ms - 1000,
                       "state": "ok"}
    assert not book.offer(sign(captured, "k1", KEYS["k1"]))
    assert book.offer(sign(after, "k1", KEYS["k1"])) and book.signals["p"]["state"] == "overloaded"


@given(st.lists(st.tuples(st.floats(-3, 5), st.integers(0, 3), st.integers(0, 3)), max_size=200),
       st.integers(1, 5), st.integers(6, 20))
def test_sliding_counts_recent_are_the_newest_seconds_and_never_more_than_the_window(steps, seconds, window):
    """The retry budget's burst bound reads the newest seconds of the same buckets. With a clock that only
    moves on, they are exactly the adds of those seconds; with one that steps back (a negative gap), what is
    counted ahead of it still counts as newest, and never more than the window holds."""
    from pipeline.router import SlidingCounts

    counts, seen, now, monotonic = SlidingCounts(window), [], 1_000.0, True
    for gap, a, b in steps:
        now += gap
        monotonic = monotonic and gap >= 0
        counts.add(now, a, b)
        seen.append((int(now), a, b))
        recent = counts.recent(now, seconds)
        if monotonic:
            newest = [(a, b) for second, a, b in seen if second > int(now) - seconds]
            assert recent == (sum(a for a, _ in newest), sum(b for _, b in newest))
        total = counts.totals(now)
        assert recent[0] <= total[0] and recent[1] <= total[1]
