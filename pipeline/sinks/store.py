"""One store over the two ClickHouse backends, both through clickhouse-connect.

The embedded engine (chdb, clickhouse-connect's ``chdb`` interface) is the
default: a data directory, no server. Its directory is locked by one process,
so the worker that lands rows is also the one that serves reads. A ClickHouse
server is used when ``clickhouse_url`` is set. The same ``sql/`` files run on
both.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any, Protocol

import orjson

from ..settings import Settings
from .readonly import CATALOGUE_SQL, Allowed, QueryRefused, ReadLimits, check

log = logging.getLogger(__name__)

JSON_SETTINGS = {"output_format_json_quote_64bit_integers": 0}


class StoreUnavailable(RuntimeError):
    """The store refused or could not be reached; the caller holds its rows and retries.

    ``known_outage``: the error is one the store gives when it is down, full or overloaded (held
    forever); otherwise it is unclassified, and a sink that keeps meeting it while the store answers
    other queries treats the rows as the cause (see ``ClickHouseSink``)."""

    def __init__(self, message: str, known_outage: bool = True) -> None:
        super().__init__(message)
        self.known_outage = known_outage


class StoreRejected(ValueError):
    """The store refused the rows themselves (a value it cannot parse or hold): retrying cannot help."""


# How every ClickHouse error met on insert is handled (codes from the server's ErrorCodes.cpp):
# data — the rows are at fault: the block is landed in halves and refused rows are dead-lettered;
# outage — the store is down, full, overloaded or misconfigured: hold and retry, never drop.
DATA_ERRORS = re.compile(r"\b(CANNOT_PARSE\w*|CANNOT_READ\w*|TYPE_MISMATCH|INCORRECT_DATA|INCORRECT_JSON|"
                         r"VALUE_IS_OUT_OF_RANGE\w*|CANNOT_INSERT_NULL\w*|TOO_LARGE_STRING_SIZE|"
                         r"ATTEMPT_TO_READ_AFTER_EOF|DECIMAL_OVERFLOW|ARGUMENT_OUT_OF_BOUND)\b"
                         r"|Too many partitions for single INSERT block")  # code 252 for one block's spread
OUTAGE_CODES = {
    159: "TIMEOUT_EXCEEDED", 202: "TOO_MANY_SIMULTANEOUS_QUERIES", 209: "SOCKET_TIMEOUT", 210: "NETWORK_ERROR",
    241: "MEMORY_LIMIT_EXCEEDED", 242: "TABLE_IS_READ_ONLY", 243: "NOT_ENOUGH_SPACE",
    252: "TOO_MANY_PARTS (merges behind inserts)", 60: "UNKNOWN_TABLE", 81: "UNKNOWN_DATABASE",
    164: "READONLY", 497: "ACCESS_DENIED", 516: "AUTHENTICATION_FAILED", 1001: "STD_EXCEPTION (filesystem)",
}
CODE = re.compile(r"Code: (\d+)")

# Every insert skips the merge a ReplacingMergeTree otherwise runs on each new part (optimize_on_insert):
# it only drops rows repeating a sorting key within one block, which the sink has already dropped (recent
# event ids, when dedup_recent_ids >= sink_block_rows); a repeat that gets past it waits for a background
# merge, as a repeat in another block always did (the per-minute rollup takes each source offset once).
# It cost about a tenth of a landing insert (docs/performance.md, session 18).
INSERT_SETTINGS = {"optimize_on_insert": 0}


def insert_error(exc: Exception) -> Exception:
    """A refused insert: ``StoreRejected`` when the data is at fault, else ``StoreUnavailable``."""
    message = str(exc)
    if DATA_ERRORS.search(message):
        return StoreRejected(message[:1024])
    code = CODE.search(message)
    return StoreUnavailable(message, known_outage=code is None or int(code.group(1)) in OUTAGE_CODES)


class StoreQueryError(ValueError):
    """An analyst's query failed in the engine (syntax, unknown table, or refused as a write)."""


class Store(Protocol):
    backend: str

    def read_only(self, sql: str, limits: ReadLimits = ReadLimits()) -> list[dict[str, Any]]:
        """An analyst's query: sandboxed, read-only, limited (see ``readonly``); at most max_rows + 1 rows."""

    def command(self, sql: str) -> None: ...

    def insert(self, table: str, rows: bytes, dedup_token: str | None = None) -> None:
        """Insert newline-delimited JSON rows; a repeated ``dedup_token`` is dropped by the table."""

    def query(self, sql: str) -> list[dict[str, Any]]: ...

    def second_writer(self) -> Store:
        """Another writer client on the same store (its statements run beside this one's), closed with it."""

    def close(self) -> None: ...


class ClickHouseStore:
    """The store through clickhouse-connect: ``chdb://<absolute path>`` (embedded) or a server URL.

    Both backends are the same client API; what differs is said where it matters:
    the directory lock of an embedded store, and how a query is made read-only.
    """

    def __init__(self, dsn: str, user: str = "default", password: str = "", ca_file: str = "",
                 verify: bool = True) -> None:
        self._lock = threading.Lock()        # the writer client: inserts, migrations, the sink's queries
        self._read_lock = threading.Lock()   # the reader client: analysts' queries
        self._closed = False
        self._reader = None                  # read-only, with the limits it was opened with
        self._reader_limits: ReadLimits | None = None
        self._allowed: Allowed | None = None
        self._writers: list[ClickHouseStore] = []   # second writers (``second_writer``), closed with this one
        if dsn.startswith("chdb://"):
            self.backend = "chdb"
            self.path = Path(dsn[len("chdb://"):]).resolve()
            self._where = f"chdb store {self.path}"
            self.path.mkdir(parents=True, exist_ok=True)
            if _locked_by_another_process(self.path / "status"):
                raise StoreUnavailable(
                    f"chdb store {self.path} is in use by another process (one process per embedded store); "
                    "run several workers against a ClickHouse server (CLICKHOUSE_URL), or give each its own chdb_path")
            try:
                self._client = self._connect()
            except Exception as exc:
                raise StoreUnavailable(f"cannot open chdb store {self.path}: {exc}") from exc
        else:
            self.backend = "server"
            self._where = "ClickHouse server"
            self._dsn, self._user, self._password = dsn, user, password
            self._tls = _tls_options(dsn, ca_file, verify)
            try:
                self._client = self._connect()
            except Exception as exc:  # the type only: the message may carry the URL's credentials
                raise StoreUnavailable(f"cannot reach ClickHouse server: {type(exc).__name__}") from exc

    @classmethod
    def embedded(cls, path: Path) -> ClickHouseStore:
        return cls(f"chdb://{Path(path).resolve()}")

    @classmethod
    def server(cls, url: str, user: str, password: str, ca_file: str = "", verify: bool = True) -> ClickHouseStore:
        return cls(url, user, password, ca_file, verify)

    def _connect(self, **settings: Any):
        import clickhouse_connect

        settings = {**JSON_SETTINGS, **settings}  # in order: nothing can be set after readonly
        if self.backend == "chdb":
            # the path as a keyword, not inside the DSN: a directory name is not parsed as a URL
            return clickhouse_connect.get_client(interface="chdb", path=str(self.path), settings=settings)
        return clickhouse_connect.get_client(dsn=self._dsn, username=self._user, password=self._password,
                                             settings=settings, **self._tls)

    def second_writer(self) -> ClickHouseStore:
        """Another writer client on the same store, with a lock of its own: the landing worker's rollup runs
        beside its inserts instead of between them (one client runs one statement at a time). Closed with
        this store; no reader of its own."""
        with self._lock:
            self._check_open()
            twin = copy.copy(self)
            twin._lock, twin._read_lock, twin._writers = threading.Lock(), threading.Lock(), []
            twin._reader = twin._reader_limits = None
            try:
                twin._client = self._connect()
            except Exception as exc:  # the type only, as when the store is opened
                raise StoreUnavailable(f"cannot open a second client on {self._where}: {type(exc).__name__}") from None
            self._writers.append(twin)
        return twin

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable(f"{self._where} is closed")

    def command(self, sql: str) -> None:
        with self._lock:
            self._check_open()
            try:
                self._client.command(sql)
            except Exception as exc:
                raise StoreUnavailable(str(exc)) from exc

    def insert(self, table: str, rows: bytes, dedup_token: str | None = None) -> None:
        # a SETTINGS clause of the insert on chdb, a request parameter on a server: per insert on both
        settings = dict(INSERT_SETTINGS, insert_deduplication_token=dedup_token) if dedup_token else dict(INSERT_SETTINGS)
        with self._lock:
            self._check_open()
            try:
                self._client.raw_insert(table, insert_block=rows, settings=settings, fmt="JSONEachRow")
            except Exception as exc:
                raise insert_error(exc) from exc

    def query(self, sql: str) -> list[dict[str, Any]]:
        with self._lock:
            self._check_open()
            try:
                raw = self._client.raw_query(sql, fmt="JSONEachRow")
            except Exception as exc:
                raise StoreUnavailable(str(exc)) from exc
        return [orjson.loads(line) for line in raw.splitlines() if line]

    def read_only(self, sql: str, limits: ReadLimits = ReadLimits()) -> list[dict[str, Any]]:
        """An analyst's query: checked on the engine's own parse (``readonly.check``), then run by a
        reader client of its own, read-only with ``limits`` — so it never waits on, or holds up, inserts.

        The reader is a second client opened with its settings once: on chdb a per-query setting is
        applied with ``SET`` and restored afterwards, and a read-only client cannot restore it.
        """
        with self._read_lock:
            with self._lock:
                self._check_open()
            if self._reader is None or self._reader_limits != limits:
                self._close_reader()
                try:
                    self._reader = self._connect(
                        max_execution_time=limits.max_execution_s, max_memory_usage=limits.max_memory_bytes,
                        max_result_rows=limits.max_rows + 1, result_overflow_mode="break", readonly=1)
                    self._reader_limits = limits
                    if self._allowed is None:
                        database = self._reader.command("SELECT currentDatabase()")
                        catalogue = self._reader.raw_query(CATALOGUE_SQL, fmt="JSONEachRow")
                        self._allowed = Allowed.from_catalogue(
                            [orjson.loads(line) for line in catalogue.splitlines() if line], str(database))
                except Exception as exc:
                    self._close_reader()
                    raise StoreUnavailable(f"cannot open a read-only client on {self._where}: {exc}") from exc
            try:
                check(self._reader.raw_query(f"EXPLAIN AST {sql}", fmt="TabSeparated").decode(), self._allowed,
                      "TabSeparated")
                raw = self._reader.raw_query(sql, fmt="JSONEachRow")
            except QueryRefused:
                raise
            except Exception as exc:
                # a failed query can leave a partial result behind on the handle: start afresh
                self._close_reader()
                raise StoreQueryError(str(exc)[:2000]) from None
        rows = []
        for line in raw.splitlines():
            if line:
                rows.append(orjson.loads(line))
                if len(rows) > limits.max_rows:
                    break
        return rows

    def _close_reader(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            try:
                reader.close()
            except Exception:
                pass

    def close(self) -> None:
        """Waits for a call in flight, then closes; later calls fail fast without touching the engine.

        Closing before the interpreter exits matters on chdb: its own shutdown
        at exit can hang if a worker thread is still inside a query.
        """
        for writer in self._writers:
            writer.close()
        with self._read_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            self._close_reader()
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


def _tls_options(dsn: str, ca_file: str, verify: bool) -> dict[str, Any]:
    """clickhouse-connect options for a server URL. The scheme is passed as the interface because
    clickhouse-connect does not read it from a DSN: ``https://host:9440`` would otherwise speak plain HTTP."""
    if not dsn.startswith("https://"):
        return {"interface": "http"}
    if not verify:
        log.warning("clickhouse_verify is off: the ClickHouse server's certificate is not checked")
    return {"interface": "https", "verify": verify,
            **({"ca_cert": os.path.expanduser(ca_file)} if ca_file and verify else {})}


def open_store(settings: Settings) -> Store:
    if settings.clickhouse_url:
        return ClickHouseStore.server(settings.clickhouse_url, settings.clickhouse_user, settings.clickhouse_password,
                                      settings.clickhouse_ca_file, settings.clickhouse_verify)
    return ClickHouseStore.embedded(settings.chdb_dir)
