"""The cap that keeps one replica from speaking for its pool."""

from hypothesis import given
from hypothesis import strategies as st

from pipeline.load.replica_outliers import SIBLING_FACTOR, capped_sums, top_capped


def test_only_the_highest_reading_is_capped_and_only_far_above_the_next():
    assert top_capped({}) == ({}, None)
    assert top_capped({"r1": 1e9}) == ({"r1": 1e9}, None), "no sibling: the reading stands"
    assert top_capped({"r1": 40, "r2": 10, "r3": 0}) == ({"r1": 40, "r2": 10, "r3": 0}, None)
    assert top_capped({"r1": 1e6, "r2": 10, "r3": 0}) == ({"r1": 40, "r2": 10, "r3": 0}, "r1")
    assert top_capped({"r1": 5, "r2": 0, "r3": 0}, floor=8) == ({"r1": 5, "r2": 0, "r3": 0}, None), \
        "a queue on one replica at a time is ordinary: below the floor it stands"
    assert top_capped({"r1": 1e6, "r2": 0, "r3": 0}, floor=8) == ({"r1": 8, "r2": 0, "r3": 0}, "r1")
    assert top_capped({"r1": 1e6, "r2": 10, "r3": 0}, floor=8) == ({"r1": 40, "r2": 10, "r3": 0}, "r1")


@given(st.dictionaries(st.text(min_size=1, max_size=3), st.floats(0, 1e12), max_size=30), st.floats(0, 1e6))
def test_the_cap_never_raises_a_reading_and_touches_at_most_one(values, floor):
    capped, top = top_capped(values, floor)
    assert capped.keys() == values.keys()
    assert all(capped[r] <= values[r] for r in values)
    changed = [r for r in values if capped[r] != values[r]]
    assert changed == ([top] if top is not None else [])
    if top is not None:
        others = [v for r, v in values.items() if r != top]
        assert capped[top] == max(floor, SIBLING_FACTOR * max(others)) and values[top] >= max(values.values())


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

