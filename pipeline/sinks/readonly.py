"""Analysts' SQL in a sandbox: decided on ClickHouse's own parse, by allow-list.

A query may read this store's tables and views and nothing else. The store
asks the engine for the query's syntax tree (``EXPLAIN AST``, so comments,
quoting and Unicode are resolved exactly as they will be when it runs) and
``allowed`` accepts it only when

- it is one ``SELECT`` (with ``WITH``, ``UNION``, joins, subqueries, window
  functions): every node is of a kind on ``NODE_KINDS`` — a ``SETTINGS``
  clause, ``INTO OUTFILE``, any other statement has a node that is not;
- every table is a name in this database (an unqualified name can only be a
  table here or a ``WITH`` alias; ``db.table`` only for this database): no
  table functions (``file``, ``url``, ``s3``, ``remote``, ``mysql`` …) and no
  other database (``system`` included);
- every function is on the allow-list: the engine's own functions of the pure
  categories in ``CATEGORIES`` (with aggregate combinators such as ``countIf``
  or ``quantileBFloat16Merge``), so ``file``, ``getSetting``, ``dictGet``,
  ``hostName``, ``sleep`` or any function added in a later release is refused
  unless it is in a category that cannot reach outside.

The engine then runs it read-only with limits on time, memory and result
rows (``ReadLimits``), applied to the reader's connection, not the query.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# categories of system.functions whose functions compute on their arguments only
CATEGORIES = frozenset({
    "Aggregate Functions", "Arithmetic", "Arrays", "Bit", "Comparison", "Conditional", "Dates and Times",
    "Encoding", "Hash", "IP Address", "JSON", "Logical", "Map", "Mathematical", "Null", "Rounding", "String",
    "String Replacement", "String Search", "String Splitting", "Tuple", "Type Conversion", "URL", "UUID",
    "Distance", "Time Window",
})
# operators and basics the engine lists without a category (or under "Other"), checked one by one
EXTRA_FUNCTIONS = frozenset({
    "in", "notIn", "nullIn", "notNullIn", "lambda", "if", "multiIf", "and", "or", "not", "xor", "tuple", "array",
    "tupleElement", "arrayElement", "equals", "notEquals", "less", "greater", "lessOrEquals", "greaterOrEquals",
    "like", "notLike", "ilike", "notILike", "plus", "minus", "multiply", "divide", "negate", "isNull",
    "isNotNull", "toTypeName", "formatReadableSize", "formatReadableQuantity", "formatReadableTimeDelta",
    "now", "now64", "today", "yesterday", "toStartOfMinute", "row_number", "rank", "dense_rank",
})
AGGREGATE_SUFFIXES = ("If", "Array", "Merge", "State", "MergeState", "OrDefault", "OrNull", "Distinct",
                      "ForEach", "Resample", "Map", "SimpleState", "ArgMin", "ArgMax")
NODE_KINDS = frozenset({
    "SelectWithUnionQuery", "SelectIntersectExceptQuery", "SelectQuery", "ExpressionList", "Function",
    "Identifier", "Literal", "Asterisk", "QualifiedAsterisk", "ColumnsRegexpMatcher", "ColumnsListMatcher",
    "TablesInSelectQuery", "TablesInSelectQueryElement", "TableExpression", "TableIdentifier", "TableJoin",
    "ArrayJoin", "Subquery", "WithElement", "OrderByElement", "WindowDefinition", "WindowListElement",
    "Interval", "Alias",
})
LINE = re.compile(r"^(?P<indent> *)(?P<kind>\w+)(?: (?P<name>.*?))?(?: \(alias [^)]*\))?(?: \(children \d+\))?$")


class QueryRefused(ValueError):
    """The query reads something other than this store's tables, or is not a query."""


@dataclass(frozen=True)
class ReadLimits:
    """What one analyst's query may take, enforced by the engine."""

    max_rows: int = 10_000
    max_execution_s: float = 30.0
    max_memory_bytes: int = 2 << 30

    @classmethod
    def of(cls, settings) -> "ReadLimits":
        return cls(settings.query_max_rows, settings.query_max_seconds, settings.query_max_memory_mb << 20)


@dataclass(frozen=True)
class Allowed:
    functions: frozenset[str]            # exact names
    functions_ci: frozenset[str]         # case-insensitive names, lower case
    aggregates: frozenset[str]           # aggregate names (for combinators)
    database: str

    @classmethod
    def from_catalogue(cls, rows: list[dict], database: str) -> "Allowed":
        """From ``system.functions`` rows (name, categories, is_aggregate, case_insensitive)."""
        names, ci, aggregates = set(EXTRA_FUNCTIONS), set(), set()
        for row in rows:
            if row["categories"] in CATEGORIES:
                names.add(row["name"])
                if row["case_insensitive"]:
                    ci.add(row["name"].lower())
                if row["is_aggregate"]:
                    aggregates.add(row["name"])
        return cls(frozenset(names), frozenset(ci), frozenset(aggregates), database)

    def function(self, name: str) -> bool:
        if name in self.functions or name.lower() in self.functions_ci:
            return True
        base = name
        while True:  # aggregate combinators: countIf, quantileBFloat16Merge, sumArrayIf ...
            for suffix in AGGREGATE_SUFFIXES:
                if base.endswith(suffix) and len(base) > len(suffix):
                    base = base[:-len(suffix)]
                    if base in self.aggregates or base.lower() in self.functions_ci:
                        return True
                    break
            else:
                return False


CATALOGUE_SQL = "SELECT name, categories, is_aggregate, case_insensitive FROM system.functions"


def check(ast: str, allowed: Allowed, output_format: str) -> None:
    """Refuse (QueryRefused, saying what) unless ``ast`` — ``EXPLAIN AST`` of the query, run with
    ``FORMAT output_format`` — is one SELECT over this database's tables with allowed functions."""
    lines = [line for line in ast.splitlines() if line.strip()]
    if not lines:
        raise QueryRefused("empty query")
    parsed = []
    for line in lines:
        match = LINE.match(line)
        if match is None:
            raise QueryRefused(f"cannot read the query's syntax tree at {line.strip()[:80]!r}")
        parsed.append((len(match["indent"]), match["kind"], (match["name"] or "").strip()))
    depth, kind, _ = parsed[0]
    if depth != 0 or kind not in ("SelectWithUnionQuery", "SelectIntersectExceptQuery"):
        raise QueryRefused(f"only SELECT queries are allowed; this is {kind}")
    root_children = [(k, n) for d, k, n in parsed if d == 1]
    if root_children[-1:] == [("Identifier", output_format)]:
        root_children = root_children[:-1]  # the FORMAT the store asks for
    if any(k != "ExpressionList" for k, _ in root_children):
        raise QueryRefused("FORMAT, INTO OUTFILE and SETTINGS are not allowed: the store sets them")
    for i, (depth, kind, name) in enumerate(parsed):
        if kind not in NODE_KINDS:
            raise QueryRefused(f"{kind} is not allowed in analysts' SQL (one SELECT over Sluice's tables)")
        if kind == "TableIdentifier":
            database, _, table = name.rpartition(".")
            if database and database.strip("`\"") != allowed.database:
                raise QueryRefused(f"table {name} is outside Sluice's database {allowed.database}")
        elif kind == "Function":
            parent = next((k for d, k, _ in reversed(parsed[:i]) if d < depth), "")
            if parent == "TableExpression":
                raise QueryRefused(f"table function {name}() is not allowed: read Sluice's tables by name")
            if not allowed.function(name):
                raise QueryRefused(f"function {name}() is not allowed in analysts' SQL")
