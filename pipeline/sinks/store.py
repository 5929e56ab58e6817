"""One small interface over the two ClickHouse backends.

The embedded engine (chdb) is the default: a data directory, no server. Its
directory is locked by one process, so the worker that lands rows is also the
one that serves reads. A ClickHouse server is used through clickhouse-connect
when ``clickhouse_url`` is set. The same ``sql/`` files run on both.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any, Protocol

import orjson

from ..settings import Settings


JSON_SETTINGS = {"output_format_json_quote_64bit_integers": 0}


class StoreUnavailable(RuntimeError):
    """The store refused or could not be reached; the caller holds its rows and retries."""


class StoreRejected(ValueError):
    """The store refused the rows themselves (a value it cannot parse or hold): retrying cannot help."""


DATA_ERRORS = re.compile(r"\b(CANNOT_PARSE\w*|CANNOT_READ\w*|TYPE_MISMATCH|INCORRECT_DATA|INCORRECT_JSON|"
                         r"VALUE_IS_OUT_OF_RANGE\w*|CANNOT_INSERT_NULL\w*|TOO_LARGE_STRING_SIZE|"
                         r"ATTEMPT_TO_READ_AFTER_EOF|DECIMAL_OVERFLOW)\b")


def insert_error(exc: Exception) -> Exception:
    """A refused insert: ``StoreRejected`` when the data is at fault, else ``StoreUnavailable`` (retry)."""
    message = str(exc)
    return StoreRejected(message[:1024]) if DATA_ERRORS.search(message) else StoreUnavailable(message)


class StoreQueryError(ValueError):
    """An analyst's query failed in the engine (syntax, unknown table, or refused as a write)."""


class Store(Protocol):
    backend: str

    def read_only(self, sql: str) -> list[dict[str, Any]]:
        """Run one query with the engine in read-only mode (writes and setting changes refused)."""

    def command(self, sql: str) -> None: ...

    def insert(self, table: str, rows: bytes, dedup_token: str | None = None) -> None:
        """Insert newline-delimited JSON rows; a repeated ``dedup_token`` is dropped by the table."""

    def query(self, sql: str) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...


class ChdbStore:
    backend = "chdb"

    def __init__(self, path: Path) -> None:
        from chdb import session

        path.mkdir(parents=True, exist_ok=True)
        if _locked_by_another_process(path / "status"):
            raise StoreUnavailable(
                f"chdb store {path} is in use by another process (one process per embedded store); "
                "run several workers against a ClickHouse server (CLICKHOUSE_URL), or give each its own chdb_path")
        try:
            self._session = session.Session(str(path))
        except Exception as exc:
            raise StoreUnavailable(f"cannot open chdb store {path}: {exc}") from exc
        self.path = path
        self._lock = threading.Lock()
        self._reader = None
        self._closed = False
        for name, value in JSON_SETTINGS.items():
            self._run(f"SET {name} = {value}")

    def _run(self, sql: str, fmt: str = "CSV"):
        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"chdb store {self.path} is closed")
            try:
                return self._session.query(sql, fmt)
            except Exception as exc:
                raise StoreUnavailable(str(exc)) from exc

    def command(self, sql: str) -> None:
        self._run(sql)

    def insert(self, table: str, rows: bytes, dedup_token: str | None = None) -> None:
        settings = f" SETTINGS insert_deduplication_token='{_quote(dedup_token)}'" if dedup_token else ""
        try:
            self._run(f"INSERT INTO {table}{settings} FORMAT JSONEachRow\n" + rows.decode())
        except StoreUnavailable as exc:
            raise insert_error(exc) from None

    def query(self, sql: str) -> list[dict[str, Any]]:
        result = self._run(sql, "JSONEachRow")
        return [orjson.loads(line) for line in result.bytes().splitlines() if line]

    def read_only(self, sql: str) -> list[dict[str, Any]]:
        """Through a second session of this process, set read-only once (it cannot be unset)."""
        from chdb import session

        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"chdb store {self.path} is closed")
            if self._reader is None:
                self._reader = session.Session(str(self.path))
                self._reader.query("SET readonly = 1")
            try:
                result = self._reader.query(sql, "JSONEachRow")
            except Exception as exc:
                # a failed query can leave a partial result behind in the session: start afresh
                self._reader.close()
                self._reader = None
                raise StoreQueryError(str(exc)) from None
        return [orjson.loads(line) for line in result.bytes().splitlines() if line]

    def close(self) -> None:
        """Waits for a call in flight, then closes; later calls fail fast without touching chdb.

        Closing before the interpreter exits matters: chdb's own shutdown at
        exit can hang if a worker thread is still inside a query.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._reader is not None:
                self._reader.close()
            self._session.close()


class ServerStore:
    backend = "server"

    def __init__(self, url: str, user: str, password: str) -> None:
        import clickhouse_connect

        try:
            self._client = clickhouse_connect.get_client(dsn=url, username=user, password=password)
        except Exception as exc:
            raise StoreUnavailable(f"cannot reach ClickHouse server: {type(exc).__name__}") from exc
        self._lock = threading.Lock()

    def command(self, sql: str) -> None:
        with self._lock:
            try:
                self._client.command(sql)
            except Exception as exc:
                raise StoreUnavailable(str(exc)) from exc

    def insert(self, table: str, rows: bytes, dedup_token: str | None = None) -> None:
        settings = {"insert_deduplication_token": dedup_token} if dedup_token else {}
        with self._lock:
            try:
                self._client.raw_insert(table, insert_block=rows, settings=settings, fmt="JSONEachRow")
            except Exception as exc:
                raise insert_error(exc) from exc

    def query(self, sql: str) -> list[dict[str, Any]]:
        with self._lock:
            try:
                raw = self._client.raw_query(sql, fmt="JSONEachRow", settings=JSON_SETTINGS)
            except Exception as exc:
                raise StoreUnavailable(str(exc)) from exc
        return [orjson.loads(line) for line in raw.splitlines() if line]

    def read_only(self, sql: str) -> list[dict[str, Any]]:
        with self._lock:
            try:
                raw = self._client.raw_query(sql, fmt="JSONEachRow", settings={**JSON_SETTINGS, "readonly": 1})
            except Exception as exc:
                raise StoreQueryError(str(exc)) from None
        return [orjson.loads(line) for line in raw.splitlines() if line]

    def close(self) -> None:
        self._client.close()


def _locked_by_another_process(status_file: Path) -> bool:
    """chdb holds an exclusive flock on ``<dir>/status`` while a process has the store open."""
    import fcntl

    try:
        with open(status_file, "rb") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fh, fcntl.LOCK_UN)
    except FileNotFoundError:
        return False
    return False


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


def open_store(settings: Settings) -> Store:
    if settings.clickhouse_url:
        return ServerStore(settings.clickhouse_url, settings.clickhouse_user, settings.clickhouse_password)
    return ChdbStore(settings.chdb_dir)
