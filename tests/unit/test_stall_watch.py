"""The worker's watch over its waits on the Kafka producer, and /healthz reading it."""

from pipeline.worker.http import health
from pipeline.worker.stall_watch import StallWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_wait_older_than_the_bound_fails_health_and_names_itself_until_it_ends():
    clock = Clock()
    waits = StallWatch(clock)
    assert health(None, None, 60, waits) == (True, {"producer_stuck_s": {}, "ok": True})
    with waits.waiting("partials"):
        clock.now += 30
        with waits.waiting("signals"):
            assert waits.longest() == 30 and health(None, None, 60, waits)[0]
            clock.now += 31
            ok, body = health(None, None, 60, waits)
            assert not ok and body["producer_stuck_s"] == {"partials": 61.0}
        with waits.waiting("signals"):   # a new wait of the same kind starts its own clock
            clock.now += 65
            ok, body = health(None, None, 60, waits)
            assert not ok and body["producer_stuck_s"] == {"partials": 126.0, "signals": 65.0}
    assert waits.longest() == 0.0 and health(None, None, 60, waits)[0]


def test_a_wait_that_raises_is_not_left_behind():
    waits = StallWatch(Clock())
    try:
        with waits.waiting("dead letters"):
            raise RuntimeError("refused")
    except RuntimeError:
        pass
    assert waits.longest() == 0.0
