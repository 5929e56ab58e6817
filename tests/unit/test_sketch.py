import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.load.sketch import QuantileSketch

values = st.lists(st.floats(min_value=1e-4, max_value=1e4, allow_nan=False), min_size=1, max_size=400)


def exact(sorted_values, q):
    return sorted_values[math.floor(q * (len(sorted_values) - 1))]


@settings(max_examples=200, deadline=None)
@given(values, st.sampled_from([0.0, 0.25, 0.5, 0.9, 0.95, 0.99, 1.0]))
def test_relative_error_is_within_one_percent(data, q):
    sketch = QuantileSketch(0.01)
    sketch.extend(data)
    truth = exact(sorted(data), q)
    assert abs(sketch.quantile(q) - truth) <= 0.01 * truth + 1e-12


@settings(max_examples=100, deadline=None)
@given(values, values)
def test_merge_equals_one_sketch_of_everything(a, b):
    left, right, whole = QuantileSketch(), QuantileSketch(), QuantileSketch()
    left.extend(a)
    right.extend(b)
    whole.extend(a + b)
    left.merge(right)
    assert left.buckets == whole.buckets and left.count == whole.count
    assert QuantileSketch.from_dict(left.to_dict()) == left


def test_empty_zero_and_bad_values():
    sketch = QuantileSketch()
    assert sketch.quantile(0.5) is None
    sketch.add(0.0)
    assert sketch.quantile(0.5) == 0.0
    with pytest.raises(ValueError):
        sketch.add(-1)
    with pytest.raises(ValueError):
        sketch.merge(QuantileSketch(0.02))


def test_memory_is_bounded_by_range_not_count():
    sketch = QuantileSketch()
    for i in range(100_000):
        sketch.add(0.001 + (i % 1000) * 3.6)
    assert len(sketch.buckets) < 800


def test_clipped_moments_count_each_value_at_most_the_limit():
    sketch = QuantileSketch()
    sketch.extend([100.0] * 99 + [1e7])
    count, mean, sd = sketch.clipped_moments(200.0)
    assert count == 100
    assert mean == pytest.approx(101.0, rel=0.02)     # the absurd value counts as 200
    assert sd == pytest.approx(math.sqrt(0.99 * 0.01) * 100, rel=0.05)
    _, unclipped, _ = sketch.clipped_moments(math.inf)
    assert unclipped == pytest.approx((99 * 100 + 1e7) / 100, rel=0.02)
    sketch.add(0.0)
    assert sketch.clipped_moments(200.0)[:2] == (101, pytest.approx(100 * 101 / 101, rel=0.02))
    assert QuantileSketch().clipped_moments(1.0) == (0, 0.0, 0.0)
