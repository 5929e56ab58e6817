"""`sluice query` through a running worker's read-only endpoint, against the store the worker holds."""

import json
import subprocess
import sys
import urllib.error
import urllib.request
from itertools import islice

import pytest

from pipeline.sim.producer import produce
from pipeline.sim.replay import generate, load_trace
from pipeline.worker_process import worker_env
from tests.conftest import run, wait_for

pytestmark = pytest.mark.integration
TOKEN = "query-token-for-tests"


def sluice_query(settings, *args):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "query", *args], env=worker_env(settings),
                          capture_output=True, text=True, timeout=60)


def test_query_reads_the_live_store_and_never_writes(settings, worker_factory):
    worker = worker_factory(query_token=TOKEN).start()
    events = list(islice(generate(load_trace(), rate=20, seconds=60, seed=2, start_ms=1_700_000_000_000), 300))
    run(produce(settings, settings.kafka_bootstrap_servers, events, paced=False))
    wait_for(lambda: worker.counts().accepted >= 300, 60, message="events to land")

    ok = sluice_query(worker.settings, "SELECT count() AS n FROM request_events", "--format", "json")
    assert ok.returncode == 0, ok.stderr
    requests = sum(e.kind == "request" for e in events)
    assert json.loads(ok.stdout) == [{"n": requests}]
    table = sluice_query(worker.settings, "SELECT pool, count() AS n FROM request_events GROUP BY pool ORDER BY pool")
    assert table.returncode == 0 and table.stdout.splitlines()[0].split() == ["pool", "n"]
    csv_out = sluice_query(worker.settings, "SELECT DISTINCT pool FROM request_events ORDER BY pool", "--format", "csv")
    assert csv_out.stdout.splitlines()[0] == "pool" and "llama-70b-a" in csv_out.stdout

    for sql in ("INSERT INTO request_events (pool) VALUES ('x')", "ALTER TABLE request_events DELETE WHERE 1",
                "DROP TABLE request_events", "SELECT 1 SETTINGS readonly = 0", "SELECT 1; DROP TABLE request_events",
                "SELECT file('/proc/self/environ')", "SELECT * FROM file('/proc/self/environ', 'RawBLOB')",
                "SELECT name, value FROM system.settings", "SELECT getSetting('readonly')"):
        refused = sluice_query(worker.settings, sql)
        assert refused.returncode == 2 and refused.stderr.startswith("sluice query: "), (sql, refused.stderr)
    still = sluice_query(worker.settings, "SELECT count() AS n FROM request_events", "--format", "json")
    assert json.loads(still.stdout) == [{"n": requests}], "nothing was written or dropped"

    request = urllib.request.Request(f"{worker.base_url}/query", data=b"SELECT 1", method="POST")
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(request, timeout=10)
    assert denied.value.code == 401
