"""Analysts' SQL in a sandbox: only SELECTs over Sluice's tables with pure functions, decided on the
engine's own parse; run read-only with engine-enforced limits, beside the inserts, never in their way."""

import os
import threading
import time

import pytest

from pipeline.settings import SettingsError, load_settings
from pipeline.sinks.migrations import migrate
from pipeline.sinks.readonly import QueryRefused, ReadLimits
from pipeline.sinks.store import ClickHouseStore, StoreQueryError
from tests.conftest import wait_for

SECRET = "sluice-test-secret-do-not-leak-4f2a"

# every class the issue names, and the ClickHouse families that reach outside the store
HOSTILE = [
    # files, the process, the environment
    "SELECT file('/proc/self/environ')",
    "SELECT file('/etc/passwd', 'CSV')",
    "SELECT * FROM file('/etc/passwd', 'CSV')",
    "SELECT * FROM file('/proc/self/environ', 'RawBLOB')",
    "SELECT FILE('/proc/self/environ')",
    "SELECT `file`('/proc/self/environ')",
    "SELECT /* hi */ file/**/('/proc/self/environ')",
    "SELECT fi\\u006ce('/proc/self/environ')",
    "SELECT length(file('/proc/self/environ'))",
    "SELECT pool FROM request_events WHERE pool = file('/proc/self/environ')",
    "WITH file('/proc/self/environ') AS e SELECT e",
    "SELECT * FROM (SELECT file('/proc/self/environ'))",
    "SELECT 1 UNION ALL SELECT file('/proc/self/environ')",
    "SELECT arrayMap(x -> file(x), ['/proc/self/environ'])",
    "SELECT * FROM executable('cat /proc/self/environ', 'RawBLOB', 'x String')",
    "SELECT * FROM input('x String')",
    # network
    "SELECT * FROM url('http://127.0.0.1:9/', 'CSV', 'x String')",
    "SELECT * FROM urlCluster('default', 'http://127.0.0.1:9/', 'CSV', 'x String')",
    "SELECT * FROM s3('http://127.0.0.1:9/b/k', 'CSV', 'x String')",
    "SELECT * FROM remote('127.0.0.1:9000', system.one)",
    "SELECT * FROM remoteSecure('127.0.0.1:9440', system.one)",
    "SELECT * FROM mysql('127.0.0.1:3306', 'db', 't', 'u', 'p')",
    "SELECT * FROM postgresql('127.0.0.1:5432', 'db', 't', 'u', 'p')",
    "SELECT * FROM hdfs('hdfs://127.0.0.1:9000/f', 'CSV', 'x String')",
    "SELECT * FROM jdbc('jdbc:x', 't')",
    "SELECT * FROM odbc('DSN=x', 't')",
    "SELECT * FROM azureBlobStorage('http://127.0.0.1:9', 'c', 'b', 'CSV')",
    "SELECT * FROM mongodb('127.0.0.1:27017', 'db', 'c', 'u', 'p', 'x String')",
    "SELECT * FROM redis('127.0.0.1:6379', 'k', 'k String')",
    # other databases, system tables, dictionaries, settings
    "SELECT * FROM system.settings",
    "SELECT * FROM system.processes",
    "SELECT * FROM system.tables",
    "SELECT * FROM system.one",
    "SELECT * FROM `system`.`one`",
    "SELECT * FROM information_schema.tables",
    "SELECT * FROM INFORMATION_SCHEMA.TABLES",
    "SELECT * FROM request_events JOIN system.users ON 1",
    "SELECT * FROM dictionary('d')",
    "SELECT dictGet('d', 'x', 1)",
    "SELECT dictGetOrDefault('d', 'x', 1, 'y')",
    "SELECT joinGet('j', 'x', 1)",
    "SELECT getSetting('max_memory_usage')",
    "SELECT getSettingOrDefault('custom_x', 1)",
    "SELECT currentUser()",
    "SELECT hostName()",
    "SELECT version()",
    "SELECT getMacro('x')",
    "SELECT filesystemAvailable()",
    "SELECT getClientHTTPHeader('Authorization')",
    "SELECT serverUUID()",
    "SELECT sleep(3)",
    "SELECT sleepEachRow(1) FROM request_events",
    "SELECT throwIf(1)",
    "SELECT * FROM merge(currentDatabase(), '.*')",
    "SELECT * FROM numbers(10)",
    "SELECT * FROM generateRandom('x String')",
    "SELECT * FROM cluster('default', system.one)",
    # not a SELECT, or the store's own choices overridden
    "INSERT INTO gpu_prices (hardware, usd_per_gpu_hour) VALUES ('x', 1)",
    "ALTER TABLE request_events DELETE WHERE 1",
    "DROP TABLE request_events",
    "TRUNCATE TABLE request_events",
    "CREATE TABLE x (a UInt8) ENGINE = Memory",
    "SET readonly = 0",
    "SELECT 1 SETTINGS readonly = 0",
    "SELECT 1 SETTINGS max_execution_time = 100000",
    "SELECT 1 INTO OUTFILE '/tmp/x'",
    "SELECT 1 FORMAT JSON",
    "SELECT 1; DROP TABLE request_events",
    "SHOW TABLES",
    "SHOW CREATE TABLE request_events",
    "DESCRIBE TABLE request_events",
    "EXPLAIN SELECT 1",
    "SYSTEM SHUTDOWN",
    "KILL QUERY WHERE 1",
    "OPTIMIZE TABLE request_events FINAL",
    "GRANT ALL ON *.* TO default",
    "",
    "-- just a comment",
    "#! SELECT file('/proc/self/environ')",
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    os.environ["SLUICE_TEST_LEAK_PROBE"] = SECRET
    store = ClickHouseStore.embedded(tmp_path_factory.mktemp("sandbox") / "chdb")
    migrate(store)
    store.command("INSERT INTO gpu_prices (hardware, usd_per_gpu_hour) VALUES ('H100-80GB', 2.5)")
    yield store
    store.close()
    del os.environ["SLUICE_TEST_LEAK_PROBE"]


def test_the_corpus_has_every_class():
    assert len(HOSTILE) >= 60


@pytest.mark.parametrize("sql", HOSTILE)
def test_hostile_queries_are_refused_and_reveal_nothing(store, sql):
    with pytest.raises((QueryRefused, StoreQueryError)) as refused:
        rows = store.read_only(sql)
        assert SECRET not in str(rows)
    assert SECRET not in str(refused.value)


def test_analysts_queries_work(store):
    assert store.read_only("SELECT hardware, usd_per_gpu_hour FROM gpu_prices") == [
        {"hardware": "H100-80GB", "usd_per_gpu_hour": 2.5}]
    assert store.read_only(
        "SELECT * FROM (WITH p AS (SELECT pool, count() AS n, countIf(phase = 'completed') AS done "
        "FROM request_events GROUP BY pool) SELECT pool, n, done, round(done / greatest(n, 1), 3) AS share FROM p "
        "UNION ALL SELECT 'none' AS pool, 0 AS n, 0 AS done, 0 AS share) ORDER BY pool LIMIT 5") == [
        {"pool": "none", "n": 0, "done": 0, "share": 0}]
    assert store.read_only("SELECT toString(toStartOfMinute(toDateTime('2024-01-01 00:00:30', 'UTC'))) AS m, "
                           "sumIf(requests, pool != '') AS n, countDistinct(pool) AS pools FROM pool_minute") == [
        {"m": "2024-01-01 00:00:00", "n": 0, "pools": 0}]


def test_no_secret_in_the_environment_or_config_is_readable(store, tmp_path):
    config = tmp_path / "sluice.toml"
    config.write_text(f'signing_keys = {{ k1 = "{SECRET}" }}\n')
    for path in ("/proc/self/environ", str(config)):
        for sql in (f"SELECT file('{path}')", f"SELECT * FROM file('{path}', 'RawBLOB')",
                    f"SELECT * FROM file('{path}', 'LineAsString')"):
            with pytest.raises((QueryRefused, StoreQueryError)) as refused:
                store.read_only(sql)
            assert SECRET not in str(refused.value)


def test_rows_time_and_memory_are_limited_by_the_engine(store):
    rows = store.read_only("SELECT a.hardware FROM gpu_prices AS a, gpu_prices AS b", ReadLimits(max_rows=0))
    assert len(rows) == 1, "max_rows + 1 at most: the caller marks the result truncated"
    with pytest.raises(StoreQueryError, match="TIMEOUT_EXCEEDED|Timeout exceeded|MEMORY_LIMIT"):
        store.read_only("SELECT count() FROM request_events AS a, request_events AS b, request_events AS c "
                        "WHERE a.event_id != b.event_id OR arrayExists(x -> x > 0, range(100000000))",
                        ReadLimits(max_execution_s=0.5, max_memory_bytes=64 << 20))


def test_an_analysts_query_never_holds_up_inserts(store):
    """The reader is a client of its own: an insert issued during a slow query does not wait for it."""
    outcome = []

    def slow_query():
        try:
            store.read_only("SELECT count() FROM (SELECT arrayJoin(range(100000)) AS x) AS a, "
                            "(SELECT arrayJoin(range(100000)) AS y) AS b WHERE cityHash64(x, y) % 7 = 0",
                            ReadLimits(max_execution_s=3.0))
            outcome.append("finished")
        except StoreQueryError as exc:
            outcome.append(str(exc))

    slow = threading.Thread(target=slow_query)
    slow.start()
    wait_for(store._read_lock.locked, 5, interval_s=0.01, message="the slow query to start")
    started = time.monotonic()
    store.command("INSERT INTO gpu_prices (hardware, usd_per_gpu_hour) VALUES ('A100-40GB', 1.5)")
    insert_s = time.monotonic() - started
    slow.join()
    assert "TIMEOUT_EXCEEDED" in outcome[0] or "Timeout exceeded" in outcome[0], outcome
    assert insert_s < 1.0, f"the insert waited {insert_s:.2f} s for an analyst's query"


def test_endpoints_off_loopback_need_a_token():
    with pytest.raises(SettingsError, match="query_token"):
        load_settings(env={"SLUICE_WEB_HOST": "0.0.0.0"})
    assert load_settings(env={"SLUICE_WEB_HOST": "0.0.0.0", "SLUICE_QUERY_TOKEN": "s3cret-token"}).query_token
