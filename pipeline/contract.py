"""The event contract: the JSON Schemas in ``schemas/`` compiled into fast checks.

The schema files are the single source of truth; this module turns the subset
of JSON Schema 2020-12 they use into plain Python closures so that stage 1 can
validate tens of thousands of events per second, and maps each failed keyword
to a bounded dead-letter reason. A keyword outside the subset fails at import,
so a schema can never be silently half-enforced.

Semantics follow the specification, not Python's habits: ``true`` is not an
integer, ``1.0`` is, and ``pattern`` uses ECMA-262 anchors (``$`` matches only
at the very end, never before a trailing newline).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"

ANNOTATIONS = {"$schema", "$id", "$comment", "title", "description", "examples", "default",
               "x-unit", "x-otel", "x-vllm", "x-dcgm"}

Check = Callable[[Any, str], Any]


class Invalid(ValueError):
    """A value broke the contract: ``reason`` is a bounded code, ``detail`` says where and why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def describe(value: Any, limit: int = 40) -> str:
    """A short, escaped rendering of untrusted input for error details."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _type_check(types: list[str]) -> Callable[[Any], Any]:
    """Returns a function giving the normalised value, or raising KeyError on mismatch."""
    allowed = set(types)

    def check(value: Any) -> Any:
        t = type(value)
        if t is str:
            ok = "string" in allowed
        elif t is bool:
            ok = "boolean" in allowed
        elif t is int:
            ok = "integer" in allowed or "number" in allowed
        elif t is float:
            if "number" in allowed:
                ok = True
            elif "integer" in allowed and value.is_integer():
                return int(value)
            else:
                ok = False
        elif value is None:
            ok = "null" in allowed
        elif t is dict:
            ok = "object" in allowed
        elif t is list:
            ok = "array" in allowed
        else:
            ok = False
        if not ok:
            raise KeyError
        return value

    return check


def ecma_pattern(pattern: str) -> re.Pattern:
    """Compile an ECMA-262 pattern of the simple kind the schemas use."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + r"\Z"
    return re.compile(pattern)


def _fast_leaf(schema: dict) -> Check | None:
    """One fused closure for the leaf shapes that make up almost every field.

    Same verdicts as the general path (the contract tests run both against
    the reference validator); it exists because stage 1 runs it per field per
    event.
    """
    keys = set(schema) - ANNOTATIONS
    types = schema.get("type")
    types = set(types if isinstance(types, list) else [types]) if types else set()
    nullable = "null" in types
    types.discard("null")
    if keys == {"enum"} and all(isinstance(m, str) for m in schema["enum"]):
        allowed, listed = frozenset(schema["enum"]), ", ".join(schema["enum"])

        def enum_leaf(value: Any, path: str) -> Any:
            if type(value) is str and value in allowed:
                return value
            raise Invalid("unknown_enum", f"{path} must be one of {listed}, got {describe(value)}")

        return enum_leaf
    if types == {"boolean"} and keys == {"type"}:
        def bool_leaf(value: Any, path: str) -> Any:
            if type(value) is bool or (value is None and nullable):
                return value
            raise Invalid("wrong_type", f"{path} must be boolean, got {_json_type(value)}")

        return bool_leaf
    if types in ({"number"}, {"integer"}) and keys <= {"type", "minimum", "maximum", "exclusiveMinimum"}:
        integer = types == {"integer"}
        lo = schema.get("minimum", float("-inf"))
        hi = schema.get("maximum", float("inf"))
        lo_open = schema.get("exclusiveMinimum", float("-inf"))
        wanted = " or ".join(schema["type"]) if isinstance(schema["type"], list) else schema["type"]
        bounds = (f"> {lo_open}" if "exclusiveMinimum" in schema else f">= {lo}") + (
            f" and <= {hi}" if "maximum" in schema else "")

        def number_leaf(value: Any, path: str) -> Any:
            t = type(value)
            if t is int or t is float:
                if integer and t is float:
                    if not value.is_integer():
                        raise Invalid("wrong_type", f"{path} must be {wanted}, got number")
                    value = int(value)
                if value < lo or value > hi or value <= lo_open:
                    raise Invalid("out_of_range", f"{path} must be {bounds}, got {describe(value)}")
                return value
            if value is None and nullable:
                return value
            raise Invalid("wrong_type", f"{path} must be {wanted}, got {_json_type(value)}")

        return number_leaf
    if types == {"string"} and keys <= {"type", "minLength", "maxLength", "pattern"}:
        min_len, max_len = schema.get("minLength", 0), schema.get("maxLength", float("inf"))
        pattern = schema.get("pattern")
        search = ecma_pattern(pattern).search if pattern else None
        wanted = " or ".join(schema["type"]) if isinstance(schema["type"], list) else schema["type"]

        def string_leaf(value: Any, path: str) -> Any:
            if type(value) is str:
                n = len(value)
                if n > max_len:
                    raise Invalid("too_long", f"{path} has {n} characters, the limit is {max_len}")
                if n < min_len:
                    raise Invalid("bad_format", f"{path} must have at least {min_len} character(s)")
                if search is not None and not search(value):
                    raise Invalid("bad_format", f"{path} must match {pattern}, got {describe(value)}")
                return value
            if value is None and nullable:
                return value
            raise Invalid("wrong_type", f"{path} must be {wanted}, got {_json_type(value)}")

        return string_leaf
    return None


def compile_schema(schema: dict, where: str = "") -> Check:
    fast = _fast_leaf(schema)
    if fast is not None:
        return fast
    unknown = set(schema) - ANNOTATIONS - {
        "type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength",
        "pattern", "properties", "required", "additionalProperties", "allOf", "if", "then",
        "items", "maxItems"}
    if unknown:
        raise ValueError(f"schema keyword(s) {sorted(unknown)} at {where or '/'} are not supported")
    steps: list[Check] = []

    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        type_of = _type_check(types)
        wanted = " or ".join(types)

        def check_type(value: Any, path: str) -> Any:
            try:
                return type_of(value)
            except KeyError:
                raise Invalid("wrong_type", f"{path} must be {wanted}, got {_json_type(value)}") from None

        steps.append(check_type)

    if "const" in schema:
        const = schema["const"]

        def check_const(value: Any, path: str) -> Any:
            if type(value) is bool or type(const) is bool:
                same = value is const
            else:
                same = value == const
            if not same:
                raise Invalid("out_of_range", f"{path} must be {const!r}, got {describe(value)}")
            return value

        steps.append(check_const)

    if "enum" in schema:
        members = schema["enum"]
        if not all(isinstance(m, str) for m in members):
            raise ValueError(f"enum at {where} must list strings only")
        allowed = frozenset(members)
        listed = ", ".join(members)

        def check_enum(value: Any, path: str) -> Any:
            if type(value) is not str or value not in allowed:
                raise Invalid("unknown_enum", f"{path} must be one of {listed}, got {describe(value)}")
            return value

        steps.append(check_enum)

    lo, hi, lo_open = schema.get("minimum"), schema.get("maximum"), schema.get("exclusiveMinimum")
    if lo is not None or hi is not None or lo_open is not None:
        def check_range(value: Any, path: str) -> Any:
            if type(value) in (int, float):
                if (lo is not None and value < lo) or (hi is not None and value > hi) or (
                        lo_open is not None and value <= lo_open):
                    bounds = f"{'>' if lo_open is not None else '>='} {lo_open if lo_open is not None else lo}"
                    if hi is not None:
                        bounds += f" and <= {hi}"
                    raise Invalid("out_of_range", f"{path} must be {bounds}, got {describe(value)}")
            return value

        steps.append(check_range)

    min_len, max_len, pattern = schema.get("minLength"), schema.get("maxLength"), schema.get("pattern")
    if min_len is not None or max_len is not None or pattern is not None:
        regex = ecma_pattern(pattern) if pattern is not None else None

        def check_string(value: Any, path: str) -> Any:
            if type(value) is str:
                if max_len is not None and len(value) > max_len:
                    raise Invalid("too_long", f"{path} has {len(value)} characters, the limit is {max_len}")
                if min_len is not None and len(value) < min_len:
                    raise Invalid("bad_format", f"{path} must have at least {min_len} character(s)")
                if regex is not None and not regex.search(value):
                    raise Invalid("bad_format", f"{path} must match {pattern}, got {describe(value)}")
            return value

        steps.append(check_string)

    if "items" in schema or "maxItems" in schema:
        item = compile_schema(schema["items"], where + "/items") if "items" in schema else None
        max_items = schema.get("maxItems")

        def check_array(value: Any, path: str) -> Any:
            if type(value) is list:
                if max_items is not None and len(value) > max_items:
                    raise Invalid("too_long", f"{path} has {len(value)} items, the limit is {max_items}")
                if item is not None:
                    return [item(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return value

        steps.append(check_array)

    if "properties" in schema or "required" in schema or "additionalProperties" in schema:
        props = {name: compile_schema(sub, f"{where}/properties/{name}")
                 for name, sub in schema.get("properties", {}).items()}
        required = list(schema.get("required", ()))
        closed = schema.get("additionalProperties", True) is False
        if schema.get("additionalProperties", True) not in (True, False):
            raise ValueError(f"additionalProperties at {where} must be true or false")

        names = frozenset(props)
        required_set = frozenset(required)

        def check_object(value: Any, path: str) -> Any:
            if type(value) is not dict:
                return value
            prefix = path + "." if path else ""
            if closed:
                extra = value.keys() - names
                if extra:
                    name = min(extra, key=repr)
                    raise Invalid("unknown_field", f"{prefix}{describe(name, 64)} is not a field of this event")
                out = {name: props[name](item, prefix + name) for name, item in value.items()}
            else:
                out = value
                for name, sub in props.items():
                    if name in value:
                        sub(value[name], prefix + name)
            if not required_set <= value.keys():
                missing = [name for name in required if name not in value]
                raise Invalid("missing_field", f"{prefix}{missing[0]} is required")
            return out

        steps.append(check_object)

    for i, sub in enumerate(schema.get("allOf", ())):
        steps.append(compile_schema(sub, f"{where}/allOf/{i}"))

    if "if" in schema:
        condition = compile_schema(schema["if"], where + "/if")
        then = compile_schema(schema.get("then", {}), where + "/then")

        def check_conditional(value: Any, path: str) -> Any:
            try:
                condition(value, path)
            except Invalid:
                return value
            then(value, path)
            return value

        steps.append(check_conditional)

    if len(steps) == 1:
        return steps[0]

    def run(value: Any, path: str = "") -> Any:
        for step in steps:
            value = step(value, path)
        return value

    return run


def load_schema(name: str) -> dict:
    path = SCHEMA_DIR / f"{name}.v1.json"
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise RuntimeError(f"schema {path} is missing; install Sluice from its source tree") from exc


SCHEMA_NAMES = ("request_event", "replica_sample", "admission_signal", "dead_letter")


def semantic_names() -> list[tuple[str, str, str, str]]:
    """(event, field, convention, name) for every OpenTelemetry / vLLM / DCGM mapping in the schemas."""
    rows = []
    for event in SCHEMA_NAMES:
        for name, sub in load_schema(event).get("properties", {}).items():
            for convention in ("x-otel", "x-vllm", "x-dcgm"):
                if convention in sub:
                    rows.append((event, name, convention[2:], sub[convention]))
    return rows
