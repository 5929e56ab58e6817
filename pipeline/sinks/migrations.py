"""Numbered SQL migrations from ``sql/``, applied once each and recorded in the store."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import orjson

from ..cost import price_table
from ..settings import Settings
from .store import Store

log = logging.getLogger(__name__)

SQL_DIR = Path(__file__).resolve().parents[2] / "sql"
MIGRATION_FILE = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")


def migration_files(sql_dir: Path = SQL_DIR) -> list[tuple[int, str, Path]]:
    found = []
    for path in sorted(sql_dir.glob("*.sql")):
        match = MIGRATION_FILE.match(path.name)
        if not match:
            raise RuntimeError(f"{path} is not named NNN_name.sql")
        found.append((int(match.group(1)), match.group(2), path))
    versions = [v for v, _, _ in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration numbers in {sql_dir}")
    return found


def statements(text: str) -> list[str]:
    """Split a migration into statements on ``;`` at line ends, dropping ``--`` comment lines."""
    lines = [line for line in text.splitlines() if not line.strip().startswith("--")]
    return [s.strip() for s in re.split(r";\s*$", "\n".join(lines), flags=re.M) if s.strip()]


def migrate(store: Store, sql_dir: Path = SQL_DIR) -> list[str]:
    """Apply every migration not yet recorded; returns the names applied now."""
    store.command("CREATE TABLE IF NOT EXISTS sluice_migrations (version UInt32, name String, "
                  "applied_at DateTime64(3, 'UTC') DEFAULT now64(3)) ENGINE = MergeTree ORDER BY version")
    done = {row["version"] for row in store.query("SELECT version FROM sluice_migrations")}
    applied = []
    for version, name, path in migration_files(sql_dir):
        if version in done:
            continue
        for statement in statements(path.read_text()):
            store.command(statement)
        store.command(f"INSERT INTO sluice_migrations (version, name) VALUES ({version}, '{name}')")
        applied.append(f"{version:03d}_{name}")
    return applied


RETAINED_TABLES = {  # table → the time column its TTL counts from
    "request_events": "event_time",
    "replica_samples": "event_time",
    "admission_signals": "event_time",
    "dead_letters": "event_time",
    "pool_minute": "minute",
}

# what must be on disk before an insert returns: the landed tables, and each partition's last rollup (kept
# forever: it is one row a partition, and without it a partition's rollups would start again at offset 0)
DURABLE_TABLES = (*RETAINED_TABLES, "pool_minute_rollups")


def apply_retention(store: Store, days: int) -> list[str]:
    """Make each landed table's TTL match ``retention_days`` (0: keep forever); returns tables changed.

    Existing parts are not rewritten at once (``materialize_ttl_after_modify =
    0``); merges apply the new TTL as they go.
    """
    changed = []
    for table, column in RETAINED_TABLES.items():
        rows = store.query(f"SELECT create_table_query AS q FROM system.tables "
                           f"WHERE database = currentDatabase() AND name = '{table}'")
        current = re.search(r"\bTTL (.+?) SETTINGS", rows[0]["q"]) if rows else None
        wanted = f"toDateTime({column}) + toIntervalDay({days})" if days else None
        have = current.group(1).strip() if current else None
        if have == wanted:
            continue
        if wanted:
            store.command(f"ALTER TABLE {table} MODIFY TTL {wanted} SETTINGS materialize_ttl_after_modify = 0")
        elif have:
            store.command(f"ALTER TABLE {table} REMOVE TTL")
        changed.append(table)
    return changed


def apply_durability(store: Store, fsync: bool) -> list[str]:
    """Each landed table, and the record of the rollups, fsyncs a part and its directory before an insert
    returns, or not. With it, "durable" before the offset commit means on disk, not in the page cache, and a
    rollup's record is on disk before its rows (a host crash cannot lose the record of rows that stay)."""
    wanted = 1 if fsync else 0
    changed = []
    for table in DURABLE_TABLES:
        rows = store.query(f"SELECT create_table_query AS q FROM system.tables "
                           f"WHERE database = currentDatabase() AND name = '{table}'")
        have = 1 if rows and re.search(r"\bfsync_after_insert = 1\b", rows[0]["q"]) else 0
        if have != wanted:
            set_fsync(store, table, fsync)
            changed.append(table)
    return changed


def set_fsync(store: Store, table: str, on: bool) -> None:
    store.command(f"ALTER TABLE {table} MODIFY SETTING fsync_after_insert = {int(on)}, "
                  f"fsync_part_directory = {int(on)}")


def sync_reference(store: Store, prices: dict[str, float], config: dict[str, float]) -> None:
    """Mirror the price table and the settings the views use; the settings stay the one source."""
    for table, key, value_column, values in (("gpu_prices", "hardware", "usd_per_gpu_hour", prices),
                                             ("sluice_config", "name", "value", config)):
        if values:
            store.insert(table, b"\n".join(orjson.dumps({key: name, value_column: float(value)})
                                           for name, value in sorted(values.items())))


def prepare_store(store: Store, settings: Settings) -> list[str]:
    """Everything a worker needs of the store before landing: migrations, retention, reference data."""
    applied = migrate(store)
    if applied:
        log.info("applied migrations %s", ", ".join(applied))
    changed = apply_retention(store, settings.retention_days)
    if changed:
        log.info("retention set to %s days on %s", settings.retention_days or "unlimited", ", ".join(changed))
    changed = apply_durability(store, settings.store_fsync)
    if changed:
        log.info("fsync before an insert returns %s on %s", "on" if settings.store_fsync else "off", ", ".join(changed))
    sync_reference(store, price_table(settings.gpu_prices),
                   {"replica_stale_after_s": settings.replica_stale_after_s,
                    "cached_input_cost_share": settings.cached_input_cost_share})
    return applied
