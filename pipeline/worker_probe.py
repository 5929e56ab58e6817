"""Reading a running worker from outside: health and event accounting from its HTTP endpoints."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Counts:
    accepted: int = 0
    dead_lettered: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


def scrape_counts(base_url: str, timeout_s: float = 2.0) -> Counts:
    """Accepted and dead-lettered totals from the worker's /metrics (zeros if it does not answer)."""
    counts = Counts()
    try:
        text = urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s).read().decode()
    except (urllib.error.URLError, OSError):
        return counts
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sluice_events_accepted_total":
                counts.accepted += int(sample.value)
            elif sample.name == "sluice_events_dead_lettered_total":
                counts.dead_lettered += int(sample.value)
                reason = sample.labels["reason"]
                counts.reasons[reason] = counts.reasons.get(reason, 0) + int(sample.value)
    return counts


def healthy(base_url: str, timeout_s: float = 2.0) -> bool:
    try:
        return urllib.request.urlopen(f"{base_url}/healthz", timeout=timeout_s).status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(base_url: str, timeout_s: float, process: subprocess.Popen | None = None) -> bool:
    """Wait for /healthz to say ready; False on timeout or if ``process`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            return False
        if healthy(base_url):
            return True
        time.sleep(0.2)
    return False
