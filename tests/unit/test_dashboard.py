"""The Grafana dashboard's structure, checked without Grafana: ids, data sources, targets, units, descriptions,
layout, every metric and label it names against pipeline/metrics.py and the recording rules, the PromQL's syntax
(promtool), and the provisioning files. tests/integration/test_dashboard.py runs every query against a real
Prometheus scraping a worker through an overload.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml
from prometheus_client.metrics import MetricWrapperBase

from pipeline import metrics
from pipeline.admission.policy import STATES
from pipeline.events import PRIORITIES
from pipeline.load.axes import AXES
from tests.unit.test_alert_rules import promtool

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy/grafana"
DASHBOARD_PATH = GRAFANA / "dashboards/sluice.json"
DASHBOARD = json.loads(DASHBOARD_PATH.read_text())
RULES = [rule for path in sorted((ROOT / "deploy/prometheus/rules").glob("*.yml"))
         for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]
DATASOURCE_UID = "prometheus"   # deploy/grafana/provisioning/datasources/prometheus.yml


def panels(dashboard: dict = DASHBOARD) -> list[dict]:
    """Every panel, rows' nested (collapsed) panels included."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def substitute(expr: str, pool: str = ".*", rate_interval: str = "1m", interval: str = "15s",
               range_: str = "1h") -> str:
    """A target's PromQL with Grafana's variables replaced by concrete values."""
    values = {"pool": pool, "__rate_interval": rate_interval, "__interval": interval, "__range": range_}
    for name, value in values.items():
        expr = re.sub(r"\$\{" + name + r"(:[a-z]+)?\}|\$" + name + r"\b", lambda _: value, expr)
    assert "$" not in expr, f"an unsubstituted variable in {expr}"
    return expr


def queries(**values) -> list[tuple[str, str]]:
    """(panel title / refId, PromQL with variables substituted) for every target of every panel."""
    return [(f"{panel['title']} / {target['refId']}", substitute(target["expr"], **values))
            for panel in panels() if panel["type"] != "row" for target in panel["targets"]]


def exported() -> dict[str, tuple[str, ...]]:
    """Every series name pipeline/metrics.py exports → its label names (counters with _total, histograms'
    _bucket/_sum/_count)."""
    names: dict[str, tuple[str, ...]] = {}
    for value in vars(metrics).values():
        if not isinstance(value, MetricWrapperBase):
            continue
        labels = tuple(value._labelnames)
        base = value.describe()[0].name
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
        for suffix in suffixes[value._type]:
            names[base + suffix] = labels + (("le",) if suffix == "_bucket" else ())
    return names


def recorded() -> dict[str, tuple[str, ...]]:
    """Recording rules → the labels they keep (every rule here aggregates ``by (pool)``)."""
    out = {}
    for rule in RULES:
        if "record" in rule:
            by = re.search(r"by \(([^)]*)\)", rule["expr"])
            out[rule["record"]] = tuple(label.strip() for label in by.group(1).split(",")) if by else ()
    return out


KNOWN = {**exported(), **recorded(), "ALERTS": ("alertname", "alertstate", "severity", "pool", "topic"),
         "up": ("job", "instance")}
SELECTOR = re.compile(r"\b((?:sluice|ALERTS)[A-Za-z0-9_:]*|up(?=\{))\s*(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
LABEL_VALUES = {"axis": set(AXES), "state": set(STATES) | {"stale"}, "class": set(PRIORITIES)}


def test_panel_ids_are_unique_and_the_layout_fits_without_overlap():
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    cells = {}
    for p in panels():
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, p["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_dashboard_identity_and_variables():
    assert DASHBOARD["uid"] == "sluice" and DASHBOARD["schemaVersion"] >= 36
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["current"]["value"] == DATASOURCE_UID
    pool = variables["pool"]
    match = re.fullmatch(r"label_values\((\w+), pool\)", pool["definition"])
    assert match and pool["query"]["query"] == pool["definition"]
    assert "pool" in KNOWN[match.group(1)], "the variable's metric is a per-pool metric"
    assert pool["multi"] and pool["includeAll"] and pool["allValue"] == ".*"


def test_every_panel_has_a_datasource_targets_a_unit_and_a_description():
    for panel in panels():
        if panel["type"] == "row":
            assert not panel.get("targets"), panel["title"]
            continue
        title = panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel["targets"] and all(t["expr"].strip() and t["refId"] for t in panel["targets"]), title
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), title
        assert all(t.get("datasource", panel["datasource"]) == panel["datasource"] for t in panel["targets"])
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{title} has no unit"
        assert len(panel.get("description", "")) > 60, f"{title} does not say what it means for an operator"


def test_rows_group_the_panels():
    rows = [p["title"] for p in DASHBOARD["panels"] if p["type"] == "row"]
    assert rows == ["Alerts, SLO and cost", "Load picture: seven axes per pool", "Admission", "Overload cascade",
                    "Workers and stages", "Ingest and landing"]
    assert DASHBOARD["panels"][0]["type"] == "row"


def test_every_metric_and_label_the_queries_name_exists():
    used = set()
    for where, expr in queries():
        names = SELECTOR.findall(expr)
        assert names, f"{where}: no Sluice metric in {expr}"
        for name, braces in names:
            assert name in KNOWN, f"{where}: {name} is not in pipeline/metrics.py or the recording rules"
            used.add(name)
            for label, _, value in MATCHER.findall(braces or ""):
                assert label in KNOWN[name], f"{where}: {name} has no label {label}"
                if label in LABEL_VALUES and not set("*|(") & set(value):
                    assert value in LABEL_VALUES[label], f"{where}: {label}={value!r} is never exported"
    # the panels the issue asks for, by the metrics behind them
    for name in ("sluice_pool_axis_value", "sluice_pool_axis_pressure", "sluice_admission_state",
                 "sluice_admit_fraction", "sluice_decision_latency_seconds_bucket",
                 "sluice_events_dead_lettered_total", "sluice_landing_lag_seconds_bucket",
                 "sluice_consumer_lag_records", "sluice_events_accepted_total",
                 "sluice_pool_cost_per_successful_task_dollars", "ALERTS"):
        assert name in used, f"no panel shows {name}"


def test_one_panel_per_axis_with_the_axis_unit():
    axis_panels = {}
    for panel in panels():
        for target in panel.get("targets", []):
            m = re.search(r'sluice_pool_axis_value\{[^}]*axis="(\w+)"', target["expr"])
            if m:
                axis_panels[m.group(1)] = panel["fieldConfig"]["defaults"]["unit"]
    assert set(axis_panels) == set(AXES)
    assert axis_panels["cost"] == "currencyUSD" and axis_panels["queue"] == "s"
    assert axis_panels["kv_cache"] == axis_panels["errors"] == "percentunit"


def test_promtool_parses_every_query(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(queries())]}]}
    path = tmp_path / "dashboard.yml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_provisioning_points_grafana_at_prometheus_and_the_dashboard():
    sources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())["datasources"]
    (source,) = [s for s in sources if s["uid"] == DATASOURCE_UID]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/sluice.yml").read_text())["providers"]
    (provider,) = providers
    assert provider["type"] == "file" and provider["options"]["path"] == "/var/lib/grafana/dashboards"
    assert DASHBOARD_PATH.parent == GRAFANA / "dashboards", "the directory mounted at the provider's path"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    volumes = [v for service in compose["services"].values() for v in service.get("volumes", []) if isinstance(v, str)]
    # once docker-compose.yml mounts them: the dashboards where the provider reads, the provisioning where Grafana does
    for mount in [v for v in volumes if "deploy/grafana/dashboards" in v]:
        assert mount.split(":")[1] == provider["options"]["path"], mount
    for mount in [v for v in volumes if "deploy/grafana/provisioning" in v]:
        assert mount.split(":")[1] == "/etc/grafana/provisioning", mount


def test_the_runbook_names_a_dashboard_panel_for_every_alert():
    runbook = (ROOT / "docs/runbook.md").read_text()
    rows = [line.split("|")[1:3] for line in runbook.splitlines() if line.startswith("| Sluice")]
    titles = {p["title"] for p in panels() if p["type"] != "row"}
    answered = {}
    for alerts, answer in rows:
        named = [t for t in titles if t in answer]
        for alert in alerts.split(","):
            answered[alert.strip()] = named
    for rule in RULES:
        if "alert" in rule:
            assert answered.get(rule["alert"]), f"docs/runbook.md names no dashboard panel for {rule['alert']}"
