"""Slow preparation started in the background as soon as the session's tests are known, so it overlaps the
unit tier (which runs first and has no timing to disturb) instead of adding to the run:

- the scenario comparison behind ``tests/unit/test_scenarios.py`` (minutes of CPU, in its own processes);
- the container images of the integration tier (compose, failover, Prometheus: debootstrap, Debian packages,
  pip, mostly network and disk), built by ``deploy/docker/build_images.py``; ``tests.containers.image`` waits
  for that build before looking for them.

A prewarm is only ever a head start: a test that finds none, or one that failed, does the work itself, and a
failure is reported there, by the normal path.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS_TEST = "tests/unit/test_scenarios.py"
WAITERS = (SCENARIOS_TEST,)   # test files that wait on a prewarm's result
_started: dict[str, tuple[subprocess.Popen, Path]] = {}
_workdir: Path | None = None


def _start(name: str, argv: list[str], output: Path) -> None:
    log = open(output.with_suffix(".log"), "wb")
    _started[name] = (subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), output)


def start_for(paths: set[str]) -> None:
    """Start what the collected tests (their files, relative to the repository) will wait on."""
    global _workdir
    _workdir = Path(tempfile.mkdtemp(prefix="sluice-prewarm-"))
    if SCENARIOS_TEST in paths:
        out = _workdir / "scenarios.json"
        _start("scenarios", [sys.executable, "-c", "import json, sys; from tests.unit.test_scenarios import "
                             "compute_rows; json.dump(compute_rows(), open(sys.argv[1], 'w'))", str(out)], out)
    if any(path.startswith("tests/integration/") for path in paths):
        from tests import containers

        if containers.engine_answers():
            _start("images", [sys.executable, "deploy/docker/build_images.py"], _workdir / "images")


def result(name: str, compute: Callable[[], Any]) -> Any:
    """The prewarm's JSON result once it is done; ``compute()`` when there was none or it failed."""
    started = _started.pop(name, None)
    if started is None:
        return compute()
    process, output = started
    if process.wait() == 0 and output.exists():
        return json.loads(output.read_text())
    print(f"\nprewarm {name} failed (rc {process.returncode}); doing it here. Its log:\n"
          f"{output.with_suffix('.log').read_text(errors='replace')[-3000:]}")
    return compute()


def wait(name: str) -> None:
    """Wait for a prewarm with no result (the images): what it built is found by the caller's own check."""
    started = _started.pop(name, None)
    if started is not None:
        started[0].wait()


def stop_all() -> None:
    for process, _ in _started.values():
        if process.poll() is None:
            process.kill()
            process.wait()
    _started.clear()
    if _workdir is not None:
        shutil.rmtree(_workdir, ignore_errors=True)
