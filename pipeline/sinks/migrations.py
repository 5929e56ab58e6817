"""Numbered SQL migrations from ``sql/``, applied once each and recorded in the store."""

from __future__ import annotations

import re
from pathlib import Path

from .store import Store

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
