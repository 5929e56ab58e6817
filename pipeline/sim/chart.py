"""Scenario timelines as PNG charts, drawn with matplotlib (Agg, no display).

Stacked panels share the time axis, one line per controller in a fixed colour,
a legend above the panels, axis labels with units, and the scenario's
incidents (a load spike, replicas lost, longer prompts) shaded or marked in
every panel. matplotlib is the optional ``charts`` extra: without it
``render`` raises ``ChartsUnavailable`` and callers print ``MISSING``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MISSING = "charts need matplotlib, which is not installed: pip install 'matplotlib>=3.8' (the `charts` extra)"
DPI = 100
# the controllers' colours, in the order their series come (no control, fixed threshold, sluice, ...)
COLOURS = ["#c83c32", "#e69614", "#1e6ec8", "#3ca050", "#8c50aa", "#555555"]
INCIDENT_COLOURS = ["#7f7f7f", "#b07aa1", "#59a14f"]


class ChartsUnavailable(RuntimeError):
    """matplotlib is not installed."""


@dataclass
class Panel:
    title: str
    series: dict[str, list[tuple[float, float]]]   # label → (seconds, value) points
    y_max: float
    y_label: str = ""                              # the value's unit, e.g. "tasks/s"


@dataclass(frozen=True)
class Incident:
    """What happened to the pool: a span from ``start_s`` to ``end_s`` (shaded), or a moment (``end_s`` None:
    a vertical line)."""

    label: str
    start_s: float
    end_s: float | None = None
    markers: tuple[tuple[float, str], ...] = field(default=())   # extra moments inside the span, labelled


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def figure(title: str, panels: list[Panel], x_max: float, incidents: tuple[Incident, ...] = (),
           width: int = 1000, panel_height: int = 220):
    """The chart as a matplotlib ``Figure`` (not yet saved): ``width`` × (90 + panels × ``panel_height``) pixels."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ChartsUnavailable(MISSING) from exc

    height = 90 + len(panels) * panel_height
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)   # Agg: no display, whatever pyplot's backend is
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(title, fontsize=13, fontweight="bold")
    labels = list(dict.fromkeys(label for panel in panels for label in panel.series))
    colour = {label: COLOURS[i % len(COLOURS)] for i, label in enumerate(labels)}
    handles = []
    for p, (ax, panel) in enumerate(zip(axes, panels)):
        for label in labels:
            points = panel.series.get(label, [])
            (line,) = ax.plot([x for x, _ in points], [y for _, y in points], color=colour[label], lw=1.6,
                              label=label)
            if p == 0:
                handles.append(line)
        ax.set_title(panel.title, loc="left", fontsize=10)
        ax.set_ylabel(panel.y_label)
        ax.set_ylim(0, panel.y_max or 1.0)
        ax.set_xlim(0, x_max)
        ax.grid(True, color="#dddddd", lw=0.6)
        for spine in ("top", "right"):
            ax.spines[spine].set_visible(False)
        for i, incident in enumerate(incidents):
            _mark(ax, incident, INCIDENT_COLOURS[i % len(INCIDENT_COLOURS)], x_max, annotate=p == 0)
    axes[-1].set_xlabel("time since the scenario started (s)")
    for i, incident in enumerate(incidents):
        c = INCIDENT_COLOURS[i % len(INCIDENT_COLOURS)]
        handles.append(Patch(facecolor=c, alpha=0.18, edgecolor=c, label=incident.label))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 6), frameon=False, fontsize=9)
    return fig


def _mark(ax, incident: Incident, colour: str, x_max: float, annotate: bool) -> None:
    if incident.end_s is None:
        ax.axvline(incident.start_s, color=colour, lw=1.2, ls="--")
    else:
        ax.axvspan(incident.start_s, min(incident.end_s, x_max), color=colour, alpha=0.18, lw=0)
        ax.axvline(incident.start_s, color=colour, lw=1.0, ls="--")
        if incident.end_s < x_max:
            ax.axvline(incident.end_s, color=colour, lw=1.0, ls=":")
    for at_s, _ in incident.markers:
        ax.axvline(at_s, color=colour, lw=1.0, ls=":")
    if annotate:
        notes = [(incident.start_s, incident.label)] + list(incident.markers)
        for at_s, text in notes:
            ax.annotate(text, xy=(at_s, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -3),
                        textcoords="offset points", va="top", ha="left", fontsize=8, color="#333333")


def render(path: Path, title: str, panels: list[Panel], x_max: float, width: int = 1000,
           panel_height: int = 220, incidents: tuple[Incident, ...] = ()) -> Path:
    """Draw ``panels`` to the PNG ``path``; raises ``ChartsUnavailable`` without matplotlib."""
    fig = figure(title, panels, x_max, incidents, width, panel_height)
    fig.savefig(path, format="png", dpi=DPI)
    return path
