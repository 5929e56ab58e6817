from pipeline.sinks.migrations import migrate, migration_files, statements
from pipeline.sinks.store import ClickHouseStore


def test_migrations_apply_once_and_a_new_one_applies_to_an_existing_store(tmp_path):
    sql = tmp_path / "sql"
    sql.mkdir()
    for _, _, path in migration_files():
        (sql / path.name).write_text(path.read_text())
    store = ClickHouseStore.embedded(tmp_path / "chdb")
    try:
        first = migrate(store, sql)
        assert first and first[0] == "001_events"
        assert migrate(store, sql) == []
        (sql / "999_extra.sql").write_text("-- a later migration\nCREATE TABLE IF NOT EXISTS extra (x UInt8) "
                                           "ENGINE = MergeTree ORDER BY x;\n")
        assert migrate(store, sql) == ["999_extra"]
        assert store.query("SELECT count() AS n FROM extra") == [{"n": 0}]
    finally:
        store.close()


def test_statement_splitting_ignores_comments():
    assert statements("-- c;\nSELECT 1;\n\nSELECT 2;\n") == ["SELECT 1", "SELECT 2"]


def test_landed_tables_fsync_before_an_insert_returns_unless_turned_off(tmp_path):
    from pipeline.sinks.migrations import DURABLE_TABLES, apply_durability

    store = ClickHouseStore.embedded(tmp_path / "chdb")
    try:
        migrate(store)

        def fsyncing():
            return {r["name"] for r in store.query(
                "SELECT name FROM system.tables WHERE database = currentDatabase() "
                "AND create_table_query LIKE '%fsync_after_insert = 1%fsync_part_directory = 1%'")}

        assert sorted(apply_durability(store, True)) == sorted(DURABLE_TABLES)
        assert fsyncing() == set(DURABLE_TABLES) >= {"request_events", "pool_minute", "pool_minute_rollups"} and apply_durability(store, True) == []
        apply_durability(store, False)
        assert fsyncing() == set()
    finally:
        store.close()
