"""Slow preparation started in the background as soon as the session's tests are known, so it overlaps the
unit tier (which runs first and has no timing to disturb) instead of adding to the run:

- the scenario comparison behind ``tests/unit/test_scenarios.py`` (minutes of CPU, in its own processes);
- the container images of the integration tier (compose, failover, Prometheus: debootstrap, Debian packages,
  pip, mostly network and disk), built by ``deploy/docker/build_images.py``; ``tests.containers.image`` waits
  for that build before looking for them, and the tests that use them run first in their tier.

A prewarm is only ever a head start: a test that finds none, or one that failed, does the work itself, and a
failure is reported there, by the normal path.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS_TEST = "tests/unit/test_scenarios.py"
WAITERS = (SCENARIOS_TEST,)   # unit-tier test files that wait on a prewarm's result
# the integration tests that use the images (as containers when an engine answers): they run first in their
# tier, so no timed test shares the cores with the build
IMAGE_USERS = ("tests/integration/test_compose.py", "tests/integration/test_dashboard.py",
               "tests/integration/test_failover.py", "tests/integration/test_prometheus.py")
WAIT_S = 3600.0   # a prewarm not done by then is given up and the work done in the test
_started: dict[str, tuple[subprocess.Popen, Path]] = {}
_workdir: Path | None = None


def _path(name: str) -> Path:
    """A file in the session's prewarm directory, made on first use (most sessions start nothing)."""
    global _workdir
    if _workdir is None:
        _workdir = Path(tempfile.mkdtemp(prefix="sluice-prewarm-"))
    return _workdir / name


def _start(name: str, argv: list[str], output: Path) -> None:
    """In its own session (stopped as a group) and niced: the tests in the foreground come first."""
    with open(output.with_suffix(".log"), "wb") as log:
        _started[name] = (subprocess.Popen(["nice", "-n", "10", *argv], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True), output)


def start_for(paths: set[str]) -> None:
    """Start what the collected tests (their files, relative to the repository) will wait on."""
    if SCENARIOS_TEST in paths:
        out = _path("scenarios.json")
        _start("scenarios", [sys.executable, "-c", "import json, sys; from tests.unit.test_scenarios import "
                             "compute_rows; json.dump(compute_rows(), open(sys.argv[1], 'w'))", str(out)], out)
    if paths & set(IMAGE_USERS):
        from tests import containers

        if containers.engine_answers() and not any(os.environ.get(name)
                                                   for name in containers.build_images.ENV_NAMES.values()):
            _start("images", [sys.executable, "deploy/docker/build_images.py", "all"], _path("images"))


def _finished(name: str) -> tuple[subprocess.Popen, Path] | None:
    started = _started.pop(name, None)
    if started is None:
        return None
    try:
        started[0].wait(WAIT_S)
    except subprocess.TimeoutExpired:
        _stop(started[0])
    return started


def result(name: str, compute: Callable[[], Any]) -> Any:
    """The prewarm's JSON result once it is done; ``compute()`` when there was none or it failed."""
    started = _finished(name)
    if started is None:
        return compute()
    process, output = started
    if process.returncode == 0 and output.exists():
        return json.loads(output.read_text())
    print(f"\nprewarm {name} failed (rc {process.returncode}); doing it here. Its log:\n"
          f"{output.with_suffix('.log').read_text(errors='replace')[-3000:]}")
    return compute()


def wait(name: str) -> None:
    """Wait for a prewarm with no result (the images): what it built is found by the caller's own check."""
    _finished(name)


def _stop(process: subprocess.Popen) -> None:
    """The prewarm and everything it started (a process pool, docker build, debootstrap): asked, then made."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            pass


def stop_all() -> None:
    for process, _ in _started.values():
        if process.poll() is None:
            _stop(process)
    _started.clear()
    global _workdir
    if _workdir is not None:
        shutil.rmtree(_workdir, ignore_errors=True)
        _workdir = None
