"""``sluice query``: read-only SQL against the store, formatted for people or programs.

With ``clickhouse_url`` set it asks the server directly (``readonly = 1``);
otherwise it goes through the running worker's ``/query`` endpoint, because
an embedded chdb store can be opened by one process only.
"""

from __future__ import annotations

import csv
import io
import json
import urllib.error
import urllib.request
from typing import Any

from .settings import Settings
from .sinks.readonly import QueryRefused, ReadLimits


class QueryFailed(RuntimeError):
    pass


def run_query(settings: Settings, sql: str, url: str | None = None) -> tuple[list[dict[str, Any]], bool]:
    """(rows, truncated)."""
    if settings.clickhouse_url and url is None:
        from .sinks.store import StoreQueryError, open_store

        store = open_store(settings)
        try:
            rows = store.read_only(sql, ReadLimits.of(settings))
        except (QueryRefused, StoreQueryError) as exc:
            raise QueryFailed(str(exc)) from None
        finally:
            store.close()
        return rows[: settings.query_max_rows], len(rows) > settings.query_max_rows
    endpoint = url or f"http://{settings.web_host}:{settings.web_port}/query"
    request = urllib.request.Request(endpoint, data=sql.encode(), method="POST")
    if settings.query_token:
        request.add_header("Authorization", f"Bearer {settings.query_token}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", str(exc))
        except ValueError:
            message = str(exc)
        raise QueryFailed(message) from None
    except OSError as exc:
        raise QueryFailed(f"no worker answers at {endpoint} ({exc}); start one with `sluice worker`") from None
    return body["rows"], body["truncated"]


def render(rows: list[dict[str, Any]], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(rows, indent=2)
    columns = list(dict.fromkeys(c for r in rows for c in r))   # every row's columns: rows may differ
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n", restval="")
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue().rstrip("\n")
    if not rows:
        return "(no rows)"
    cells = [[_text(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _text(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
