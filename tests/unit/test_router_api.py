"""The router library's shape: other teams embed it, so its public names and its purity are pinned."""

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pipeline.router

PUBLIC = {"ADMIT", "Admit", "Decider", "Defer", "EventEmitter", "Redirect", "Reject", "Request",
          "RouterClient", "SignalBook", "SlidingCounts", "Verdict"}

PURE = ["verdicts", "sliding_counts", "signal_book", "throttle", "decider"]
KAFKA_SIDE = ["kafka_client"]
KAFKA_LIBS = ("aiokafka", "faust", "kafka")
ROOT = Path(__file__).resolve().parents[2]


def test_public_names_are_pinned_and_importable():
    assert len(pipeline.router.__all__) == len(set(pipeline.router.__all__))
    assert set(pipeline.router.__all__) == PUBLIC, "a change to the public API: update PUBLIC and the docs"
    namespace: dict = {}
    exec("from pipeline.router import *", namespace)
    assert PUBLIC <= namespace.keys()
    assert all(getattr(pipeline.router, name) is namespace[name] for name in PUBLIC)


def test_every_module_is_classified():
    """A new module must be declared pure or Kafka-side, so the purity test covers it."""
    assert {m.name for m in pkgutil.iter_modules(pipeline.router.__path__)} == set(PURE) | set(KAFKA_SIDE)


def _kafka_modules_after(imports: str) -> list[str]:
    check = (f"import json, sys; {imports}; "
             f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {KAFKA_LIBS!r})))")
    out = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_pure_modules_import_no_kafka():
    assert _kafka_modules_after("; ".join(f"import pipeline.router.{m}" for m in PURE)) == []


def test_the_package_imports_kafka_only_when_a_client_starts():
    assert _kafka_modules_after("import pipeline.router") == []
