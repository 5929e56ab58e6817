"""The worker's watch over its waits on the Kafka producer, and /healthz reading it."""

import asyncio

import pytest
from aiokafka.errors import NotLeaderForPartitionError, OutOfOrderSequenceNumber

from pipeline.worker.http import health
from pipeline.worker.stall_watch import RestartExit, StallWatch, spent
from tests.unit.fake_producers import StalledProducer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_waits_older_than_the_bound_are_named_without_failing_health():
    """A wait on a broker that is slow or away: a restart would meet the same broker, and every worker
    restarted at once costs a rebalance and a recovery each (found in review)."""
    clock = Clock()
    waits = StallWatch(clock)
    assert health(None, None, 60, waits) == (True, {"producer_stuck_s": {}, "ok": True})
    with waits.waiting("partials"):
        clock.now += 30
        with waits.waiting("signals"):
            assert waits.longest() == 30 and health(None, None, 60, waits)[1]["producer_stuck_s"] == {}
            clock.now += 31
            assert health(None, None, 60, waits) == (True, {"producer_stuck_s": {"partials": 61.0}, "ok": True})
        with waits.waiting("signals"):   # a new wait of the same kind starts its own clock
            clock.now += 65
            ok, body = health(None, None, 60, waits)
            assert ok and body["producer_stuck_s"] == {"partials": 126.0, "signals": 65.0}
    assert waits.longest() == 0.0 and health(None, None, 60, waits)[1]["producer_stuck_s"] == {}


@pytest.mark.parametrize("error,spoils", [(OutOfOrderSequenceNumber(), True), (NotLeaderForPartitionError(), False),
                                          (RuntimeError("anything else"), False)])
def test_a_refusal_that_spoils_the_producer_fails_health_for_good(error, spoils):
    """Every later batch of a producer refused for its sequence is refused too: only a restart brings a new
    producer. Other refusals cost their batch, not the worker's health; no wait is left behind either way."""
    waits = StallWatch(Clock())
    with pytest.raises(type(error)):
        with waits.waiting("signals"):
            raise error
    assert waits.longest() == 0.0
    ok, body = health(None, None, 60, waits)
    assert ok is not spoils
    assert body.get("producer_spent") == ("signals: OutOfOrderSequenceNumber" if spoils else None)


def test_a_producer_whose_sender_ended_fails_health():
    async def check():
        return [health(None, None, 60, StallWatch(Clock()), producer=StalledProducer(sender_done=done))
                for done in (False, True)]

    (alive_ok, alive), (ended_ok, ended) = asyncio.run(check())
    assert alive_ok and "producer_spent" not in alive
    assert not ended_ok and ended["producer_spent"] == "its sender task ended"


def test_a_spent_producer_ends_the_worker_after_the_grace():
    """Exit is for a supervisor that restarts what exits and never reads /healthz; the grace lets /healthz
    say why first. A producer that can still deliver never ends the worker."""
    clock = Clock()
    rule = RestartExit(5.0, clock)
    assert not rule.due(None)
    assert not rule.due("its sender task ended")   # first seen now
    clock.now += 4.9
    assert not rule.due("its sender task ended")
    clock.now += 0.1
    assert rule.due("its sender task ended")
    clock.now += 1
    assert not rule.due("its sender task ended")   # once: the stop it started is under way


def test_spent_names_the_ended_sender_before_a_spoiling_refusal():
    waits = StallWatch(Clock())
    with pytest.raises(OutOfOrderSequenceNumber):
        with waits.waiting("signals"):
            raise OutOfOrderSequenceNumber()

    async def check():
        return (spent(StalledProducer(sender_done=False), StallWatch(Clock())),
                spent(StalledProducer(sender_done=False), waits), spent(StalledProducer(sender_done=True), waits))

    assert asyncio.run(check()) == (None, "signals: OutOfOrderSequenceNumber", "its sender task ended")
