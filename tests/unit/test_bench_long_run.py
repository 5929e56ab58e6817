"""The long run's figures: memory growth is judged after warm-up, per million events handled."""

from pipeline.bench import long_run_figures


def test_a_worker_that_keeps_per_event_state_shows_growth_and_a_flat_one_does_not():
    flat = [(t, t * 20_000, 150.0 if t < 20 else 160.0) for t in range(0, 101, 5)]   # warm-up, then flat
    growing = [(t, t * 20_000, 150.0 + t * 0.5) for t in range(0, 101, 5)]          # 0.5 MiB/s at 20k events/s
    assert long_run_figures(flat)["rss_growth_mib_per_million_events"] == 0.0
    figures = long_run_figures(growing)
    assert figures["rss_growth_mib_per_million_events"] == 25.0
    assert figures["events"] == 2_000_000 and figures["events_per_s"] == 20_000
    assert figures["rss_after_warm_up_mib"] == 160.0 and figures["rss_end_mib"] == 200.0
    assert figures["rss_over_time"][-1] == (100, 2_000_000, 200)


def test_a_run_with_one_sample_reports_no_slope():
    assert long_run_figures([(0.0, 0, 100.0)])["rss_growth_mib_per_million_events"] is None
