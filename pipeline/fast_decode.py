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
import re
from typing import Annotated, Any, Callable, Literal, Optional, Union

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


KNOWN_GOOD_MAX = 4096   # values remembered per pattern as matching it (tenants, pools, models repeat)


def _pattern_lines(patterns: list[tuple[str, str, bool]], namespace: dict[str, Any]) -> list[str]:
    """Lines refusing (``return None``) a struct ``s`` whose patterned string property misses its ``pattern``;
    each pattern's compiled search and memory go into ``namespace``.

    Checked after decoding instead of inside msgspec, which matches every
    value every time: most patterned values repeat from event to event
    (tenant, pool, model, replica), so each is matched once and remembered,
    up to ``KNOWN_GOOD_MAX`` values per property, and the regular expression
    runs only for new ones (ids). Generated inline: a call per property cost
    more than the matching it saves. A null or absent value is the struct's
    type to judge, not the pattern's; a required property that refuses null
    is always a string, and is not asked.
    """
    lines = []
    for i, (field, pattern, always_str) in enumerate(patterns):
        if not field.isidentifier():
            raise ValueError(f"fast decoder cannot check property {field!r}")
        namespace[f"search{i}"], namespace[f"known{i}"] = re.compile(pattern).search, set()
        present = "" if always_str else "v is not None and v is not UNSET and "
        lines += [f"    v = s.{field}",
                  f"    if {present}v not in known{i}:",
                  f"        if search{i}(v) is None:",
                  "            return None",
                  f"        if len(known{i}) < MAX:",
                  f"            known{i}.add(v)"]
    return lines


def _condition_lines(conditions: list[tuple[str, frozenset, tuple[str, ...], tuple[str, ...]]],
                     namespace: dict[str, Any]) -> list[str]:
    """Lines refusing a struct ``s`` that lacks a property an ``if``/``then`` rule requires: absent is None
    for a property that refuses null, UNSET for one that allows it."""
    lines = []
    for i, (field, values, none_if_absent, unset_if_absent) in enumerate(conditions):
        for name in (field, *none_if_absent, *unset_if_absent):
            if not name.isidentifier():
                raise ValueError(f"fast decoder cannot check property {name!r}")
        namespace[f"values{i}"] = values
        absent = [f"s.{n} is None" for n in none_if_absent] + [f"s.{n} is UNSET" for n in unset_if_absent]
        if absent:
            lines += [f"    if s.{field} in values{i} and ({' or '.join(absent)}):", "        return None"]
    return lines


def _annotation(name: str, spec: dict) -> Any:
    unknown = {k for k in spec if k not in KNOWN and not k.startswith("x-")}
    if unknown:
        raise ValueError(f"fast decoder cannot express {sorted(unknown)} of {name}")
    if "const" in spec:
        return Literal[spec["const"]]
    if "enum" in spec:
        return Literal[tuple(spec["enum"])]
    (kind,) = [t for t in _types(spec) if t != "null"]
    meta = {name: spec[keyword] for keyword, name in META.items() if keyword in spec}
    if kind == "number":  # an integer stays an exact int (a float would round 10**18 + 1 into range)
        whole = {k: (math.ceil(v) if k in ("ge", "lt") else math.floor(v)) for k, v in meta.items()}
        base = Union[Annotated[int, msgspec.Meta(**whole)], Annotated[float, msgspec.Meta(**meta)]]
    else:
        base = Annotated[TYPES[kind], msgspec.Meta(**meta)] if meta else TYPES[kind]
    return Optional[base] if _nullable(spec) else base


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
        fields = []
        # an absent optional property is None when the schema refuses null for it (None can only mean
        # absent), and UNSET when null is allowed (absent ≠ null: a condition may require it present)
        self.unset_when_absent: tuple[str, ...] = ()
        self.none_when_absent: frozenset[str] = frozenset()
        for p, spec in schema["properties"].items():
            annotation = _annotation(p, spec)
            if p in required:
                fields.append((p, annotation))
            elif _nullable(spec):
                fields.append((p, annotation | msgspec.UnsetType, msgspec.UNSET))
                self.unset_when_absent += (p,)
            else:
                fields.append((p, annotation, None))
                self.none_when_absent |= {p}
        fields.sort(key=lambda f: len(f) == 3)   # required first, as a dataclass declares them
        self.struct = msgspec.defstruct(name, fields, forbid_unknown_fields=True, kw_only=True)
        self.decoder = msgspec.json.Decoder(self.struct)
        conditions = [(field, values, tuple(n for n in needed if n in self.none_when_absent),
                       tuple(n for n in needed if n not in self.none_when_absent))
                      for field, values, needed in _conditions(schema)]
        patterns = [(p, _ecma(spec["pattern"]), p in required and not _nullable(spec))
                    for p, spec in schema["properties"].items() if "pattern" in spec]
        # one namespace for every function generated here: they share the patterns' memories
        self.namespace: dict[str, Any] = {"UNSET": msgspec.UNSET, "MAX": KNOWN_GOOD_MAX, "decode": self.decoder.decode,
                                          "ERRORS": (msgspec.DecodeError, msgspec.ValidationError),
                                          "astuple": msgspec.structs.astuple}
        self._checks = _pattern_lines(patterns, self.namespace) + _condition_lines(conditions, self.namespace)
        self._accepted = self._generate("accepted", ["    return s"])
        self._builders: dict[type, Callable[[Any], Any]] = {}
        self._acceptors: dict[tuple, Callable[[bytes, bytes | None], Any]] = {}

    def _generate(self, name: str, tail: list[str], params: str = "value", **names: Any) -> Callable[..., Any]:
        """``def name(params)``: decode ``value`` into ``s``, refuse (None) what the schema may not accept,
        then ``tail``."""
        self.namespace.update(names)
        lines = [f"def {name}({params}):", "    try:", "        s = decode(value)", "    except ERRORS:",
                 "        return None", *self._checks, *tail]
        exec("\n".join(lines), self.namespace)   # names are the schema's identifiers (checked)
        return self.namespace[name]

    def document(self, value: bytes) -> dict[str, Any] | None:
        """The document when the schema certainly accepts it; None sends it to the full validator."""
        decoded = self._accepted(value)
        if decoded is None:
            return None
        return {k: v for k, v in msgspec.to_builtins(decoded).items()   # absent (UNSET) fields left out
                if v is not None or k not in self.none_when_absent}

    def event(self, value: bytes, cls: type) -> Any:
        """``cls(**document(value))`` without the document: the struct's fields straight into the event
        (absent ones as None, the event's default); None sends the record to the full validator."""
        decoded = self._accepted(value)
        if decoded is None:
            return None
        return (self._builders.get(cls) or self.builder(cls))(decoded)

    def builder(self, cls: type) -> Callable[[Any], Any]:
        """The struct → ``cls`` function, made once; raises if ``cls`` cannot be built by position (the event
        module asks for its classes' at import, so a mismatch stops the import, not every record)."""
        build = self._builders.get(cls)
        if build is None:
            build = self._builders[cls] = _builder(cls, self.struct.__struct_fields__, self.unset_when_absent)
        return build

    def acceptor(self, cls: type, key_field: str, lowered: tuple[str, ...] = ()) -> Callable[[bytes, bytes], Any]:
        """One generated function (value, key) → the ``cls`` event, or None for the full path to decide: the
        decode, the schema's checks, the key's agreement with ``key_field`` and the build with ``lowered``
        properties lower-cased, without a call between them (the control path's cost per event is these
        steps' calls as much as their work; docs/performance.md, session 41)."""
        made = self._acceptors.get((cls, key_field, lowered))
        if made is not None:
            return made
        for name in (key_field, *lowered):
            if name not in self.struct.__struct_fields__ or not name.isidentifier():
                raise ValueError(f"fast decoder cannot take {name!r} of {cls.__name__} from the struct")
        n = len(self._acceptors)
        tail = [f"    if key != s.{key_field}.encode():", "        return None",
                *_build_lines(cls, self.struct.__struct_fields__, self.unset_when_absent, f"cls{n}"),
                *[f"    e.{name} = e.{name}.lower()" for name in lowered], "    return e"]
        made = self._acceptors[(cls, key_field, lowered)] = self._generate(f"accept{n}", tail, "value, key",
                                                                           **{f"cls{n}": cls})
        return made


def _types(spec: dict) -> list[str]:
    return spec["type"] if isinstance(spec["type"], list) else [spec["type"]]


def _nullable(spec: dict) -> bool:
    return "null" in _types(spec)


def _builder(cls: type, names: tuple[str, ...], unset_when_absent: tuple[str, ...]) -> Callable[[Any], Any]:
    """A function struct → ``cls`` (``_build_lines``)."""
    namespace = {"cls": cls, "UNSET": msgspec.UNSET, "astuple": msgspec.structs.astuple}
    exec("\n".join(["def build(s):", *_build_lines(cls, names, unset_when_absent, "cls"), "    return e"]), namespace)
    return namespace["build"]


def _build_lines(cls: type, names: tuple[str, ...], unset_when_absent: tuple[str, ...], cls_name: str) -> list[str]:
    """Lines building ``e``, a ``cls`` (named ``cls_name`` where they run), from the struct ``s``: its values as
    one tuple (in C) passed by position, then UNSET replaced by None (generated: no per-field loop in Python;
    by name it cost 2 µs an event, the most of any step of the decode). So ``cls`` must declare the schema's
    properties first (required ones, then the rest, each in the schema's order) and default every property it
    may lack to None, or this fails rather than build a different event."""
    import dataclasses
    import keyword

    fields = dataclasses.fields(cls)
    if tuple(f.name for f in fields[:len(names)] if f.init and not f.kw_only) != names:
        raise ValueError(f"fast decoder cannot build {cls.__name__}: its fields do not start with {names} "
                         "(positional, in that order)")
    if cls.__dataclass_params__.frozen:
        raise ValueError(f"fast decoder cannot build the frozen {cls.__name__}")
    for f in fields:
        if not f.name.isidentifier() or keyword.iskeyword(f.name):
            raise ValueError(f"fast decoder cannot build {cls.__name__} from property {f.name!r}")
        if f.name in names and f.default is not dataclasses.MISSING and f.default is not None:
            raise ValueError(f"{cls.__name__}.{f.name} defaults to {f.default!r}, not None")
        if f.name not in names and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}.{f.name} has no default and no property to come from")
    return [f"    e = {cls_name}(*astuple(s))",
            *[f"    if e.{n} is UNSET:\n        e.{n} = None" for n in unset_when_absent]]


FAST = {name: FastSchema(name) for name in ("request_event", "replica_sample")}
