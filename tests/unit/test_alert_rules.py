"""promtool checks the rule files and runs the alert unit tests in tests/rules/."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool is missing: apt-get install -y --no-install-recommends prometheus"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def test_rule_files_are_valid():
    rules = sorted(str(p) for p in (ROOT / "deploy/prometheus/rules").glob("*.yml"))
    out = subprocess.run([promtool(), "check", "rules", *rules], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_config_is_valid():
    out = subprocess.run([promtool(), "check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")],
                         capture_output=True, text=True, cwd=ROOT / "deploy/prometheus")
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_fires_and_stays_silent_as_tested():
    out = subprocess.run([promtool(), "test", "rules", "sluice_test.yml"], capture_output=True, text=True,
                         cwd=ROOT / "tests/rules")
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_test_and_a_runbook_section():
    import yaml

    groups = yaml.safe_load((ROOT / "deploy/prometheus/rules/sluice.yml").read_text())["groups"]
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    tests = (ROOT / "tests/rules/sluice_test.yml").read_text()
    runbook = (ROOT / "docs/runbook.md").read_text()
    for alert in alerts:
        assert f"alertname: {alert['alert']}" in tests, alert["alert"]
        assert {"summary", "description", "runbook_url"} <= set(alert["annotations"]), alert["alert"]
        anchor = alert["annotations"]["runbook_url"].split("#")[1]
        assert f'<a id="{anchor}"></a>' in runbook, anchor
