"""Analysts' SQL: read-only, one statement, bounded output.

Two layers: a statement check that gives a clear error before anything runs,
and the engine's own ``readonly = 1`` (a separate chdb session, or a
per-query setting on a server), which refuses writes, DDL, table functions
that touch files, and any attempt to change settings — ``readonly`` itself
included.
"""

from __future__ import annotations

import re

ALLOWED = ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "EXISTS")
WRAPPABLE = ("SELECT", "WITH")
COMMENT = re.compile(r"--[^\n]*|/\*.*?\*/", re.S)


class QueryRefused(ValueError):
    """The statement is not a single read-only query."""


def checked(sql: str, max_rows: int) -> str:
    """The statement to run (row-limited when it is a SELECT), or QueryRefused with the reason."""
    text = COMMENT.sub(" ", sql).strip().rstrip(";").strip()
    if not text:
        raise QueryRefused("empty query")
    if ";" in text:
        raise QueryRefused("one statement at a time: ';' is not allowed inside a query")
    first = text.split(None, 1)[0].upper()
    if first not in ALLOWED:
        raise QueryRefused(f"only read-only statements are allowed ({', '.join(ALLOWED)}); got {first}")
    if re.search(r"\bSETTINGS\b", text, re.I):
        raise QueryRefused("SETTINGS clauses are not allowed: queries run read-only with fixed settings")
    if re.search(r"\bFORMAT\b", text, re.I):
        raise QueryRefused("FORMAT clauses are not allowed: choose the output with --format")
    if first in WRAPPABLE:
        return f"SELECT * FROM ({text}) LIMIT {max_rows + 1}"
    return text
