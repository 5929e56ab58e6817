"""The matplotlib chart: a valid PNG of the promised size, every controller's line in its colour, a legend,
the incident marked; without matplotlib, one line saying how to install it instead of a traceback."""

import struct
import sys

import pytest

from pipeline.sim import chart
from pipeline.sim.chart import COLOURS, Incident, Panel, figure, render
from pipeline.sim.scenarios import SCENARIOS, incidents

pytest.importorskip("matplotlib")

PANELS = [Panel("goodput", {"a": [(0, 0), (5, 2), (10, 5)], "b": [(0, 5), (5, 3), (10, 0)],
                            "c": [(0, 2.5), (10, 2.5)]}, 5.0, "tasks/s"),
          Panel("kv", {"a": [(0, 0.5), (10, 0.5)], "b": [(0, 1.0), (10, 0.8)], "c": [(0, 0.2), (10, 0.9)]}, 1.0,
                "usage (0–1)")]
LOSS = (Incident("3 of 10 replicas lost", 3.0, 8.0, ((8.0, "replicas back, cold"),)),)


def _pixels(path):
    from matplotlib.image import imread

    rgb = (imread(path)[:, :, :3] * 255).round().astype(int)
    return {tuple(p) for p in rgb.reshape(-1, 3)}


def _has(colours: set, hex_colour: str, tolerance: int = 12) -> bool:
    target = tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    return any(all(abs(a - b) <= tolerance for a, b in zip(c, target)) for c in colours)


def test_chart_is_a_valid_png_of_the_promised_size_with_each_line_in_its_colour(tmp_path):
    path = render(tmp_path / "c.png", "title × 2", PANELS, 10.0, width=600, panel_height=180, incidents=LOSS)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (600, 90 + 2 * 180)
    colours = _pixels(path)
    assert len(colours) > 20, "more than a blank canvas"
    assert all(_has(colours, COLOURS[i]) for i in range(3)), "each controller's line drawn in its colour"


def test_figure_shares_time_axis_with_units_a_legend_and_the_incident():
    fig = figure("replica-loss", PANELS, 10.0, LOSS)
    axes = fig.axes
    assert len(axes) == 2 and axes[0].get_shared_x_axes().joined(axes[0], axes[1])
    assert axes[-1].get_xlabel().endswith("(s)") and [ax.get_ylabel() for ax in axes] == ["tasks/s", "usage (0–1)"]
    assert [line.get_label() for line in axes[0].get_lines() if not line.get_label().startswith("_")] == \
        ["a", "b", "c"]
    assert len(fig.legends) == 1
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["a", "b", "c", "3 of 10 replicas lost"]
    spans = [p for p in axes[0].patches if p.get_x() == 3.0]
    assert spans, "the incident is shaded in the panel"
    notes = [t.get_text() for t in axes[0].texts]
    assert notes == ["3 of 10 replicas lost", "replicas back, cold"]


def test_scenario_incidents_come_from_the_scenario():
    spike = incidents(SCENARIOS["spike"], 300.0)
    assert [(i.start_s, i.end_s) for i in spike] == [(60.0, 180.0)] and "2×" in spike[0].label
    loss = incidents(SCENARIOS["replica-loss"], 300.0, replicas=10)
    assert [(i.label, i.start_s, i.end_s, i.markers) for i in loss] == \
        [("3 of 10 replicas lost", 60.0, 240.0, ((240.0, "replicas back, cold"),))]
    assert [i.start_s for i in incidents(SCENARIOS["long-context"], 300.0)] == [60.0]
    assert incidents(SCENARIOS["steady"], 300.0) == ()
    assert incidents(SCENARIOS["spike"], 30.0) == (), "nothing happens in a run shorter than the incident's start"


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_without_matplotlib_render_says_how_to_install_it(no_matplotlib, tmp_path):
    assert not chart.available()
    with pytest.raises(chart.ChartsUnavailable, match=r"pip install 'matplotlib>=3\.8'"):
        render(tmp_path / "c.png", "t", PANELS, 10.0)
    assert not (tmp_path / "c.png").exists()


def test_without_matplotlib_sim_charts_prints_one_line_before_simulating(no_matplotlib, tmp_path, capsys):
    from pipeline.cli import main

    assert main(["sim", "--scenario", "spike", "--charts", str(tmp_path / "charts")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "pip install" in err, err
