"""A compiled fast path for the raw events' contract: msgspec structs generated from ``schemas/``.

``schemas/`` stays the contract: the structs are built from it at import,
and a keyword they cannot express fails the import rather than diverging
quietly. A record the fast path accepts is one the schema accepts (tested on
every schema example, the hostile corpus and generated documents); anything
it refuses goes to the full validator (``contract.py``), which names the
dead-letter reason — so reasons never differ, and only valid events, the
common case, skip the slow path (docs/performance.md).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Optional, Union

import msgspec

from .contract import load_schema

# keywords of a property the structs express; anything else in a schema fails the import
KNOWN = {"type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
         "maxLength", "pattern", "description", "examples"}
TYPES = {"string": str, "integer": int, "number": float, "boolean": bool}
META = {"minimum": "ge", "maximum": "le", "exclusiveMinimum": "gt", "exclusiveMaximum": "lt",
        "minLength": "min_length", "maxLength": "max_length"}   # JSON Schema keyword → msgspec.Meta


def _ecma(pattern: str) -> str:
    """ECMA's ``$`` matches only at the end; Python's also before a final newline."""
    return pattern[:-1] + r"\Z" if pattern.endswith("$") and not pattern.endswith("\\$") else pattern


def _annotation(name: str, spec: dict) -> Any:
    unknown = {k for k in spec if k not in KNOWN and not k.startswith("x-")}
    if unknown:
        raise ValueError(f"fast decoder cannot express {sorted(unknown)} of {name}")
    if "const" in spec:
        return Literal[spec["const"]]
    if "enum" in spec:
        return Literal[tuple(spec["enum"])]
    types = spec["type"] if isinstance(spec["type"], list) else [spec["type"]]
    nullable = "null" in types
    (kind,) = [t for t in types if t != "null"]
    meta = {name: spec[keyword] for keyword, name in META.items() if keyword in spec}
    if "pattern" in spec:
        meta["pattern"] = _ecma(spec["pattern"])
    if kind == "number":  # an integer stays an exact int (a float would round 10**18 + 1 into range)
        whole = {k: (math.ceil(v) if k in ("ge", "lt") else math.floor(v)) for k, v in meta.items()}
        base = Union[Annotated[int, msgspec.Meta(**whole)], Annotated[float, msgspec.Meta(**meta)]]
    else:
        base = Annotated[TYPES[kind], msgspec.Meta(**meta)] if meta else TYPES[kind]
    return Optional[base] if nullable else base


def _conditions(schema: dict) -> list[tuple[str, frozenset, tuple[str, ...]]]:
    """``allOf: [{if: {properties: {P: {enum}}}, then: {required}}]`` as (P, values, required)."""
    out = []
    for rule in schema.get("allOf", []):
        (field, spec), = rule["if"]["properties"].items()
        if set(rule) != {"if", "then"} or set(rule["then"]) != {"required"} or set(spec) != {"enum"}:
            raise ValueError(f"fast decoder cannot express the rule {rule}")
        out.append((field, frozenset(spec["enum"]), tuple(rule["then"]["required"])))
    return out


class FastSchema:
    """One schema as a msgspec struct, plus its conditional requirements."""

    def __init__(self, name: str) -> None:
        schema = load_schema(name)
        if schema.get("additionalProperties") is not False or schema.get("type") != "object":
            raise ValueError(f"fast decoder needs a closed object schema, {name} is not")
        required = set(schema["required"])
        fields = [(p, _annotation(p, spec)) if p in required
                  else (p, _annotation(p, spec) | msgspec.UnsetType, msgspec.UNSET)  # absent ≠ null
                  for p, spec in schema["properties"].items()]
        fields.sort(key=lambda f: len(f) == 3)   # required fields first
        self.struct = msgspec.defstruct(name, fields, forbid_unknown_fields=True, kw_only=True)
        self.decoder = msgspec.json.Decoder(self.struct)
        self.conditions = _conditions(schema)

    def document(self, value: bytes) -> dict[str, Any] | None:
        """The document when the schema certainly accepts it; None sends it to the full validator."""
        try:
            decoded = self.decoder.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        doc = msgspec.to_builtins(decoded)   # a dict without the absent (UNSET) fields
        for field, values, needed in self.conditions:
            if doc.get(field) in values and any(n not in doc for n in needed):
                return None
        return doc


FAST = {name: FastSchema(name) for name in ("request_event", "replica_sample")}
