"""Analysts' SQL can never write: the statement check, then the engine's own read-only mode."""

import pytest

from pipeline.settings import SettingsError, load_settings
from pipeline.sinks.readonly import QueryRefused, checked
from pipeline.sinks.store import ClickHouseStore, StoreQueryError


@pytest.mark.parametrize("sql,reason", [
    ("INSERT INTO request_events VALUES (1)", "read-only"),
    ("ALTER TABLE request_events DELETE WHERE 1", "read-only"),
    ("DROP TABLE request_events", "read-only"),
    ("SELECT 1; DROP TABLE request_events", "one statement"),
    ("SELECT 1 SETTINGS readonly = 0", "SETTINGS"),
    ("SET readonly = 0", "read-only"),
    ("SELECT 1 FORMAT JSON", "FORMAT"),
    ("-- just a comment", "empty"),
    ("/* hidden */ DROP TABLE x", "read-only"),
])
def test_writes_and_setting_changes_are_refused_with_a_clear_reason(sql, reason):
    with pytest.raises(QueryRefused, match=reason):
        checked(sql, 100)


def test_selects_are_row_limited_and_show_passes_as_is():
    assert checked("SELECT 1;", 10) == "SELECT * FROM (SELECT 1) LIMIT 11"
    assert checked("with x as (select 1) select * from x", 5).endswith("LIMIT 6")
    assert checked("SHOW TABLES", 10) == "SHOW TABLES"


def test_the_engine_refuses_writes_even_past_the_check(tmp_path):
    store = ClickHouseStore.embedded(tmp_path / "chdb")
    try:
        store.command("CREATE TABLE t (x UInt8) ENGINE = MergeTree ORDER BY x")
        store.command("INSERT INTO t VALUES (1)")
        assert store.read_only("SELECT count() AS n FROM t") == [{"n": 1}]
        for sql in ("INSERT INTO t VALUES (2)", "DROP TABLE t", "SELECT 1 SETTINGS readonly = 0",
                    "SELECT * FROM file('/etc/passwd', 'CSV')", "SELECT 1; DROP TABLE t"):
            with pytest.raises(StoreQueryError):
                store.read_only(sql)
        store.command("INSERT INTO t VALUES (3)")  # the writer is unaffected
        assert store.read_only("SELECT count() AS n FROM t") == [{"n": 2}]
    finally:
        store.close()


def test_endpoints_off_loopback_need_a_token():
    with pytest.raises(SettingsError, match="query_token"):
        load_settings(env={"SLUICE_WEB_HOST": "0.0.0.0"})
    assert load_settings(env={"SLUICE_WEB_HOST": "0.0.0.0", "SLUICE_QUERY_TOKEN": "s3cret-token"}).query_token
