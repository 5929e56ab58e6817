"""Typed events, their orjson codec, and the decode step of stage 1.

``decode`` turns the bytes of one Kafka record into either a typed event or a
``Rejected`` with a bounded reason code — never both, never neither, never an
exception — so the ingest agent can account for every input. The checks are
compiled from ``schemas/`` (see ``contract.py``), so decoder and schema agree.
Events are plain slotted dataclasses (not frozen: frozen ones cost 3x to
build on the hot path); treat them as immutable.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Union

import orjson

from .contract import Invalid, compile_schema, describe, load_schema
from .fast_decode import FAST

SCHEMA_VERSION = 1
MAX_SOURCE_TIMESTAMP_MS = 4102444800000  # 2100-01-01, the schema's bound on a record's Kafka timestamp
DEAD_LETTER_NAMESPACE = uuid.UUID("5a7c1ce0-0000-4000-8000-000000000001")

PRIORITIES = ("critical", "standard", "sheddable", "deferrable")


@dataclass(slots=True)
class RequestEvent:
    schema: ClassVar[str] = "request_event"
    key_field: ClassVar[str] = "task_id"
    schema_version: int
    event_id: str
    event_time: int
    task_id: str
    request_id: str
    attempt: int
    tenant: str
    priority: str
    pool: str
    model: str
    phase: str
    task_final: bool | None = None
    replica_id: str | None = None
    input_tokens: int | None = None
    cached_input_tokens: int | None = None
    output_tokens: int | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    duration_s: float | None = None
    error_type: str | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None


@dataclass(slots=True)
class ReplicaSample:
    schema: ClassVar[str] = "replica_sample"
    key_field: ClassVar[str] = "replica_id"
    schema_version: int
    event_id: str
    event_time: int
    replica_id: str
    pool: str
    hardware: str
    gpu_count: int
    requests_running: int
    requests_waiting: int
    kv_cache_usage: float
    preemptions_total: float
    prompt_tokens_total: float
    generation_tokens_total: float
    prefix_cache_hits_total: float
    prefix_cache_queries_total: float
    healthy: bool
    gpu_util: float | None = None
    fb_used_mib: float | None = None
    power_w: float | None = None


# value, key → event, for the raw events' fast path (``decode``); each built by position, so a field order
# its class cannot take fails here, at import. Event ids are lower-cased: one event, one id (``decode``)
ACCEPT = {cls: FAST[cls.schema].acceptor(cls, cls.key_field, lowered=("event_id",))
          for cls in (RequestEvent, ReplicaSample)}


class AdmissionSignal:
    """A signal read back for landing: the validated document, kept whole (routers verify the bytes,
    not this)."""

    schema: ClassVar[str] = "admission_signal"
    key_field: ClassVar[str] = "pool"
    __slots__ = ("doc",)

    def __init__(self, **doc: Any) -> None:
        self.doc = doc

    @property
    def event_id(self) -> str:
        return self.doc["event_id"]

    @property
    def event_time(self) -> int:
        return self.doc["event_time"]

    def row(self) -> dict[str, Any]:
        d = self.doc
        admit = d.get("admit_fraction", {})
        out = {name: d.get(name) for name in ("event_id", "pool", "seq", "state", "pressure", "key_id")}
        out.update({f"admit_{cls}": admit.get(cls, 1.0) for cls in PRIORITIES})
        out["issued_at"] = d["issued_at"]
        out["valid_until"] = d["valid_until"]
        out["signal"] = orjson.dumps(d).decode()
        return out


Event = Union[RequestEvent, ReplicaSample, AdmissionSignal]


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str
    detail: str


VALIDATORS = {name: compile_schema(load_schema(name), name)
              for name in ("request_event", "replica_sample", "admission_signal", "dead_letter")}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def as_dict(event: Any) -> dict[str, Any]:
    """The event's wire form: every set field, optional ``None`` fields left out."""
    names = _FIELD_NAMES.get(type(event))
    if names is None:
        names = _FIELD_NAMES[type(event)] = tuple(f.name for f in fields(event))
    out = {}
    for name in names:
        value = getattr(event, name)
        if value is not None:
            out[name] = value
    return out


def encode(event: Any) -> bytes:
    return orjson.dumps(as_dict(event))


def _parse(value: bytes) -> Any:
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        message = str(exc)
        if "UTF-8" in message:
            raise Invalid("not_utf8", f"value is not valid UTF-8 ({message})") from None
        # the token where parsing stopped, not anywhere in the value: "NaN-1" as a task id is a string
        at = exc.doc[exc.pos:exc.pos + 8] if isinstance(exc.doc, str) and isinstance(exc.pos, int) else ""
        if "infinity" in message or at.startswith(("NaN", "Infinity")):
            raise Invalid("non_finite_number", f"NaN and Infinity are not JSON numbers ({message})") from None
        raise Invalid("malformed_json", message) from None


def validate(schema: str, document: Any) -> dict[str, Any]:
    """Check a parsed document against a schema; returns it normalised, raises ``Invalid``."""
    if type(document) is not dict:
        kind = "array" if isinstance(document, list) else type(document).__name__
        raise Invalid("not_object", f"value must be a JSON object, got {kind}")
    if "schema_version" not in document:
        raise Invalid("missing_field", "schema_version is required")
    version = document["schema_version"]
    if type(version) is bool or version != SCHEMA_VERSION:
        raise Invalid("unknown_schema_version",
                      f"schema_version {describe(version)} is not supported (this build reads {SCHEMA_VERSION})")
    return VALIDATORS[schema](document)


def decode(cls: type[Event], value: bytes | None, key: bytes | None, max_bytes: int) -> Event | Rejected:
    """One Kafka record → a typed event or a rejection with a precise reason."""
    try:
        if value is None:
            raise Invalid("malformed_json", "value is null (a tombstone), not an event")
        if len(value) > max_bytes:
            raise Invalid("oversize", f"value is {len(value)} bytes, the limit is {max_bytes}")
        if key is None:
            raise Invalid("null_key", f"record has no key; {cls.__name__} is keyed by {cls.key_field}")
        accept = ACCEPT.get(cls)
        event = accept(value, key) if accept is not None else None
        if event is not None:
            return event
        # refused or not certain: the full validator decides, and names the reason
        document = validate(cls.schema, _parse(value))
        expected = document[cls.key_field]
        if key != expected.encode():
            raise Invalid("key_mismatch", f"record key {describe(key)} differs from {cls.key_field} "
                                          f"{describe(expected)}; the key decides the partition")
        # one event, one id: a UUID re-sent in upper case must not pass the duplicate checks as another event
        document["event_id"] = document["event_id"].lower()
        return cls(**document)
    except Invalid as exc:
        return Rejected(exc.reason, exc.detail[:1024])
    except Exception as exc:  # a decoder bug must cost one dead letter, not the pipeline
        return Rejected("malformed_json", f"unexpected decoder error {type(exc).__name__}: {describe(str(exc), 200)}")


def dead_letter(rejected: Rejected, value: bytes | None, key: bytes | None, topic: str, partition: int,
                offset: int, timestamp_ms: int | None, now_ms: int) -> tuple[bytes, bytes]:
    """(key, value) of the dead letter for one rejected record.

    Its ``event_id`` is derived from the source position, so a redelivered
    record yields the same dead letter and consumers can deduplicate.
    """
    where = f"{topic}/{partition}/{offset}"
    raw = value or b""
    if timestamp_ms is not None and not 0 <= timestamp_ms <= MAX_SOURCE_TIMESTAMP_MS:
        timestamp_ms = None  # -1 (none), or a clock no store can hold: the letter must land whatever it is
    letter = {
        "schema_version": SCHEMA_VERSION,
        "event_id": str(uuid.uuid5(DEAD_LETTER_NAMESPACE, where)),
        "event_time": now_ms,
        "reason": rejected.reason,
        "detail": rejected.detail,
        "source_topic": topic,
        "source_partition": partition,
        "source_offset": offset,
        "source_timestamp": timestamp_ms,
        "key_b64": base64.b64encode(key).decode() if key is not None else None,
        "value_b64": base64.b64encode(raw).decode(),
        "value_size": len(raw),
    }
    return where.encode(), orjson.dumps(letter)
