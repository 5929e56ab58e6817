"""The cap that keeps one replica from speaking for its pool."""

from hypothesis import given
from hypothesis import strategies as st

from pipeline.load.replica_outliers import SIBLING_FACTOR, capped_sums, top_capped


def test_only_readings_far_above_the_rest_are_capped():
    assert top_capped({}) == ({}, ())
    assert top_capped({"r1": 1e9}) == ({"r1": 1e9}, ()), "no sibling: the reading stands"
    assert top_capped({"r1": 40, "r2": 10, "r3": 0}) == ({"r1": 40, "r2": 10, "r3": 0}, ())
    assert top_capped({"r1": 1e6, "r2": 10, "r3": 0}) == ({"r1": 40, "r2": 10, "r3": 0}, ("r1",))
    assert top_capped({"r1": 5, "r2": 0, "r3": 0}, floor=8) == ({"r1": 5, "r2": 0, "r3": 0}, ()), \
        "within the floor: a queue on one replica at a time is ordinary"
    assert top_capped({"r1": 1e6, "r2": 0, "r3": 0}, floor=8) == ({"r1": 8, "r2": 0, "r3": 0}, ("r1",))
    assert top_capped({"r1": 1e6, "r2": 10, "r3": 0}, floor=8) == ({"r1": 40, "r2": 10, "r3": 0}, ("r1",))


def test_a_few_replicas_lying_together_are_capped_together_and_share_the_floor():
    """Two or three replicas (one bad exporter on a few hosts) are capped as one replica is, at the multiple of
    the highest honest reading, and share the floor; half the pool or more is read as it reports."""
    honest = {f"r{i}": 10.0 for i in range(6)}
    two = {**honest, "bad1": 1e6, "bad2": 5e5}
    assert top_capped(two) == ({**honest, "bad1": 40.0, "bad2": 40.0}, ("bad1", "bad2"))
    assert top_capped(two, floor=100) == ({**honest, "bad1": 50.0, "bad2": 50.0}, ("bad1", "bad2"))
    idle = {f"r{i}": 0.0 for i in range(6)}
    few = {**idle, "q1": 4.0, "q2": 3.0, "q3": 2.0, "q4": 1.0}
    assert top_capped(few, floor=8.65) == (few, ()), \
        "queues on a few replicas beside idle ones, each within the floor, are ordinary: read in full"
    assert top_capped({**idle, "bad1": 1e6, "bad2": 9.0}, floor=8.65) == \
        ({**idle, "bad1": 4.325, "bad2": 4.325}, ("bad1", "bad2")), \
        "two readings each past the floor are capped together, and together keep it"
    three = {**two, "bad3": 1e3}
    assert top_capped(three) == ({**honest, "bad1": 40.0, "bad2": 40.0, "bad3": 40.0}, ("bad1", "bad2", "bad3"))
    assert top_capped({**honest, "r9": 1e6, "r8": 50.0})[1] == ("r8", "r9"), \
        "the largest outlying group is capped: a liar cannot hide behind a smaller step"
    half = {"r0": 10.0, "r1": 10.0, "r2": 10.0, "bad1": 1e6, "bad2": 1e6, "bad3": 1e6}
    assert top_capped(half) == (half, ()), "half the pool is not a minority: read as it reports"
    busy = {"r0": 300.0, "r1": 200.0, "r2": 90.0, "r3": 60.0, "r4": 50.0}
    assert top_capped(busy) == (busy, ()), "a pool loaded on every replica is read in full"


@given(st.dictionaries(st.text(min_size=1, max_size=3), st.floats(0, 1e12), max_size=30), st.floats(0, 1e6))
def test_the_cap_never_raises_a_reading_and_touches_only_a_minority_at_the_top(values, floor):
    capped, lowered = top_capped(values, floor)
    assert capped.keys() == values.keys()
    assert all(capped[r] <= values[r] for r in values)
    changed = sorted(r for r in values if capped[r] != values[r])
    assert changed == list(lowered)
    if lowered:
        (level,) = {capped[r] for r in lowered}
        assert all(values[r] <= level for r in values if r not in lowered), "only the highest readings"
        group = [r for r in values if values[r] > level / SIBLING_FACTOR]
        assert len(group) <= max(1, (len(values) - 1) // 2), "a minority far above the rest, never a majority"
        assert sum(capped.values()) >= min(floor, sum(values.values())) * (1 - 1e-9), \
            "together the readings keep at least the floor"


def test_counter_groups_are_capped_together_and_each_group_on_its_own():
    sums = {"liar": {"prompt_tokens": 9e6, "generation_tokens": 1e6, "preemptions": 1.0, "prefix_hits": 7.0},
            "r2": {"prompt_tokens": 800.0, "generation_tokens": 200.0, "preemptions": 2.0, "prefix_hits": 3.0},
            "r3": {"prompt_tokens": 0.0, "generation_tokens": 0.0, "preemptions": 0.0, "prefix_hits": 0.0}}
    out, scaled = capped_sums(sums, ((("prompt_tokens", "generation_tokens"), 0.0), (("preemptions",), 0.0)))
    assert scaled == {"liar"}
    assert out["liar"]["prompt_tokens"] + out["liar"]["generation_tokens"] == SIBLING_FACTOR * 1000
    assert out["liar"]["prompt_tokens"] == 9 * out["liar"]["generation_tokens"], "the group keeps its mix"
    assert out["liar"]["preemptions"] == 1.0 and out["liar"]["prefix_hits"] == 7.0, "other counters untouched"
    assert out["r2"] == sums["r2"] and sums["liar"]["prompt_tokens"] == 9e6, "the input is not changed"

