"""Bench figures over several rounds: medians with their spread, so one noisy run is not read as a change."""

import pytest

from pipeline.bench import over_rounds


def test_a_figure_that_varied_is_its_median_with_its_spread_and_one_that_did_not_is_shown_once():
    runs = [{"role": "control", "workers": 1, "worker_vs_raw_ratio": r, "worker_events_per_s": e, "store": None}
            for r, e in ((0.21, 35_000), (0.17, 29_000), (0.19, 41_000))]
    figures = over_rounds(runs)
    assert figures["rounds"] == 3
    assert figures["worker_vs_raw_ratio"] == 0.19 and figures["worker_vs_raw_ratio_spread"] == [0.17, 0.21]
    assert figures["worker_events_per_s"] == 35_000 and figures["worker_events_per_s_spread"] == [29_000, 41_000]
    assert figures["role"] == "control" and figures["workers"] == 1 and figures["store"] is None
    assert "workers_spread" not in figures and "role_spread" not in figures


def test_a_figure_missing_from_one_round_is_not_summarised_as_if_it_were_there():
    """A run that could not measure (``None``: the workers never all consumed) is not a zero to take a
    median over: the figure is shown as the first run's, with no spread invented."""
    figures = over_rounds([{"worker_events_per_s": None}, {"worker_events_per_s": 30_000}])
    assert figures["worker_events_per_s"] is None and "worker_events_per_s_spread" not in figures


def test_one_round_is_that_round():
    assert over_rounds([{"a": 1.5}]) == {"rounds": 1, "a": 1.5}


def test_bench_refuses_no_rounds(tmp_path):
    from pipeline.bench import main
    from pipeline.settings import Settings

    with pytest.raises(ValueError, match="rounds"):
        main(Settings(state_dir=tmp_path), events=10, as_json=True, lag_rate=1, lag_seconds=1, long_seconds=0,
             rounds=0)
