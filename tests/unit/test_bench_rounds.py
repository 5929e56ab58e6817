"""Bench figures over several rounds: medians with their spread, so one noisy run is not read as a change."""

import pytest

from pipeline.bench import over_rounds, picture_lags


def test_a_figure_that_varied_is_its_median_with_its_spread_and_one_that_did_not_is_shown_once():
    runs = [{"role": "control", "workers": 1, "worker_vs_raw_ratio": r, "worker_events_per_s": e, "store": None}
            for r, e in ((0.21, 35_000), (0.17, 29_000), (0.19, 41_000))]
    figures = over_rounds(runs)
    assert figures["rounds"] == 3
    assert figures["worker_vs_raw_ratio"] == 0.19 and figures["worker_vs_raw_ratio_spread"] == [0.17, 0.21]
    assert figures["worker_events_per_s"] == 35_000 and figures["worker_events_per_s_spread"] == [29_000, 41_000]
    assert figures["role"] == "control" and figures["workers"] == 1 and figures["store"] is None
    assert "workers_spread" not in figures and "role_spread" not in figures


def test_a_round_that_could_not_measure_a_figure_is_counted_not_hidden():
    """A run that could not measure (``None``: the workers never all consumed; or the figure absent) is not
    a zero to take a median over, nor hidden: the median is over the runs that measured, and the figure
    says how many did."""
    figures = over_rounds([{"events_per_s": 30_000}, {"events_per_s": None}, {"events_per_s": 20_000}])
    assert figures["events_per_s"] == 20_000 and figures["events_per_s_spread"] == [20_000, 30_000]
    assert figures["events_per_s_measured"] == "2/3"
    figures = over_rounds([{"events_per_s": None}, {"events_per_s": 30_000, "late": 1}])
    assert figures["events_per_s"] == 30_000 and figures["events_per_s_measured"] == "1/2"
    assert figures["late"] == 1 and figures["late_measured"] == "1/2"
    assert over_rounds([{"p99": None}, {"p99": None}]) == {"rounds": 2, "p99": None, "p99_measured": "0/2"}


def test_an_even_number_of_rounds_reports_a_figure_one_of_them_measured():
    figures = over_rounds([{"ratio": 0.1}, {"ratio": 0.2}])
    assert figures["ratio"] == 0.1 and figures["ratio_spread"] == [0.1, 0.2]


def test_one_round_is_that_round():
    assert over_rounds([{"a": 1.5}]) == {"rounds": 1, "a": 1.5}


def test_bench_refuses_no_rounds(tmp_path):
    from pipeline.bench import main
    from pipeline.settings import Settings

    with pytest.raises(ValueError, match="rounds"):
        main(Settings(state_dir=tmp_path), events=10, as_json=True, lag_rate=1, lag_seconds=1, long_seconds=0,
             rounds=0)


def test_picture_lag_counts_no_idle_time_after_the_traffic_but_what_the_pipeline_was_behind_then():
    """After the last event every picture's watermark is that event, so published_at − watermark is the
    time since the traffic stopped: counted so, the run's last tick set its p99 (0.43-0.59 s against 0.16 s
    before it). A picture published after the end counts how far behind the traffic it was at the end."""
    ended_ms = 30_000
    steady = [(ms, ms - 90) for ms in range(500, 30_001, 500)]
    lags = picture_lags(steady + [(30_170, 29_995), (30_670, 29_995)], ended_ms)
    assert len(lags) == 62 and max(lags) == 0.09 and lags[-2:] == [0.005, 0.005]
    assert picture_lags([(31_000, 29_000)], ended_ms) == [1.0]   # still a second behind when traffic ended
    assert picture_lags([(30_000, 30_001)], ended_ms) == [0.0]   # a watermark just past the stamp taken
