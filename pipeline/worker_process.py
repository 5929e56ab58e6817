"""A worker as a subprocess, seen from outside: start, stop, health and event accounting.

The demo, the benchmark and the integration tests all run real ``sluice
worker`` processes configured through the environment, as an operator would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from .settings import ALIASES, ENV_PREFIX, Settings


@dataclass
class Counts:
    accepted: int = 0
    dead_lettered: int = 0
    duplicates: int = 0
    already_landed: int = 0  # records skipped after an assignment because the store held them
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
            elif sample.name == "sluice_events_duplicate_total":
                counts.duplicates += int(sample.value)
            elif sample.name == "sluice_events_already_landed_total":
                counts.already_landed += int(sample.value)
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


def worker_env(settings: Settings) -> dict[str, str]:
    """This process's environment with ``settings`` as ``SLUICE_*`` variables (and no stray overrides)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) and k not in ALIASES.values()}
    for name in settings.redacted():
        value = getattr(settings, name)
        env[ENV_PREFIX + name.upper()] = json.dumps(value) if isinstance(value, dict) else str(value)
    return env


class WorkerProcess:
    """One ``sluice worker`` subprocess with its log in a file."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.settings = settings
        self.log_path = log_path
        self.base_url = f"http://{settings.web_host}:{settings.web_port}"
        self.proc: subprocess.Popen | None = None
        self.command = [sys.executable, "-m", "pipeline.cli", "worker"]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout_s: float = 90) -> "WorkerProcess":
        """Start and wait for /healthz; raises with the log's tail if it does not get there."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, env=worker_env(self.settings), stdout=log,
                                         stderr=subprocess.STDOUT)
        if not wait_healthy(self.base_url, timeout_s, self.proc):
            self.kill()
            raise RuntimeError(f"worker not healthy within {timeout_s:.0f}s; {self.log_path}:\n{self.log_tail()}")
        return self

    def counts(self) -> Counts:
        return scrape_counts(self.base_url)

    def scrape(self, timeout_s: float = 5.0) -> str:
        """The worker's /metrics exposition."""
        return urllib.request.urlopen(f"{self.base_url}/metrics", timeout=timeout_s).read().decode()

    def kill(self) -> None:
        """kill -9: no shutdown hooks, no final commit."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def pause(self) -> None:
        """SIGSTOP: the process holds its connections and partitions but does nothing until ``resume``."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause`` (harmless on a running process)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM (and SIGCONT, should it be paused) and wait; SIGKILL if it does not exit in time."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.send_signal(signal.SIGCONT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
