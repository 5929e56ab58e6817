"""One OTLP/JSON ExportTraceServiceRequest → RequestEvents, pure.

The OpenTelemetry Collector's Kafka exporter with ``encoding: otlp_json`` writes an
ExportTraceServiceRequest per record (recent releases: one span per record) in the OTLP/JSON
encoding: the proto3 JSON mapping with lowerCamelCase keys, except that trace and span ids are hex
(not base64) and enums are integers; 64-bit integers (span times, ``intValue``) are decimal strings,
numbers are accepted too, and unknown fields are ignored.

Each GenAI inference span becomes one terminal RequestEvent (the mapping is in
docs/integrations.md). Every other span is skipped and counted: a shared spans topic carries all of
a service's spans. A GenAI span that cannot become an event the worker accepts is a rejection with a
dead-letter reason (the reasons of ``schemas/dead_letter.v1.json``); each event is checked with the
worker's own decoder (``events.decode``) and time bounds before it is returned, so the bridge never
publishes what the worker would dead-letter.

No Kafka, no clock (``now_ms`` is passed in), no OpenTelemetry import: records are parsed with
orjson. Nothing here raises, whatever the input.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import orjson

from ..contract import Invalid, describe
from ..events import RequestEvent, Rejected, _parse, as_dict, decode
from ..ingest import TimeBounds

# event_id = uuid5(namespace, "otlp/<trace id>/<span id>/<phase>"): a redelivered span keeps its id
SPAN_EVENT_NAMESPACE = uuid.UUID("5a7c1ce0-0000-4000-8000-000000000002")

INFERENCE_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})
SPAN_KINDS = {"unspecified": 0, "internal": 1, "server": 2, "client": 3, "producer": 4, "consumer": 5}
STATUS_ERROR = 2
INT64_MAX = (1 << 63) - 1
UINT64_MAX = (1 << 64) - 1
KEPT_REJECTIONS = 20  # rejections kept with their detail per record (all are counted)

# attribute names, first found wins
OPERATION = "gen_ai.operation.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
INPUT_TOKENS = ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens")
OUTPUT_TOKENS = ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens")
CACHED_INPUT_TOKENS = ("gen_ai.usage.cache_read.input_tokens",)
ERROR_TYPE = "error.type"
TTFT = ("gen_ai.response.time_to_first_chunk", "gen_ai.server.time_to_first_token",
        "gen_ai.latency.time_to_first_token")
TPOT = ("gen_ai.server.time_per_output_token",)
DURATION = ("gen_ai.server.request.duration", "gen_ai.latency.e2e")
QUEUE = ("gen_ai.latency.time_in_queue",)
SERVICE_NAME = "service.name"
SLUICE_FIELDS = ("task_id", "request_id", "attempt", "task_final", "tenant", "priority", "pool", "replica_id",
                 "slo_ttft_s", "slo_tpot_s")
# a span without gen_ai.operation.name is still an inference span when it names a model and carries usage or
# an end-to-end latency: instrumentations older than the attribute, and vLLM's own server spans
LEGACY_MARKERS = (*INPUT_TOKENS, *OUTPUT_TOKENS, "gen_ai.latency.e2e")

SPAN_ATTRIBUTES = frozenset({OPERATION, REQUEST_MODEL, RESPONSE_MODEL, *INPUT_TOKENS, *OUTPUT_TOKENS,
                             *CACHED_INPUT_TOKENS, ERROR_TYPE, *TTFT, *TPOT, *DURATION, *QUEUE,
                             *(f"sluice.{name}" for name in SLUICE_FIELDS)})
RESOURCE_ATTRIBUTES = frozenset({SERVICE_NAME, *(f"sluice.{name}" for name in SLUICE_FIELDS)})

_TRACE_ID = re.compile(r"[0-9a-fA-F]{32}")
_SPAN_ID = re.compile(r"[0-9a-fA-F]{16}")
_INTEGER = re.compile(r"-?[0-9]{1,20}")
_VALUE_KINDS = ("stringValue", "intValue", "doubleValue", "boolValue", "arrayValue", "kvlistValue", "bytesValue")


@dataclass(frozen=True)
class MappingConfig:
    """What the mapping needs from settings (``of``); the defaults are the defaults of settings."""

    max_record_bytes: int = 4 * 1048576   # a larger record is not parsed: oversize
    max_event_bytes: int = 1048576        # the worker's bound on one event
    span_kinds: frozenset = frozenset({SPAN_KINDS["client"], SPAN_KINDS["server"]})
    default_slo: tuple[float, float] = (2.0, 0.1)  # (ttft, tpot) of the default profile
    pool_slo: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    bounds: TimeBounds = TimeBounds()

    @classmethod
    def of(cls, settings: Any) -> "MappingConfig":
        """From settings; a bad profile assignment raises ValueError (as the worker's does)."""
        from ..load.profiles import build_profiles, check_assignment
        from ..topics import raw_topic_max_bytes

        profiles = build_profiles(settings.profiles)
        check_assignment(profiles, settings.pool_profiles, settings.default_profile)

        def slo(name: str) -> tuple[float, float]:
            return profiles[name].slo_ttft_s, profiles[name].slo_tpot_s

        return cls(max_record_bytes=raw_topic_max_bytes(settings), max_event_bytes=settings.max_event_bytes,
                   span_kinds=frozenset(SPAN_KINDS[k] for k in settings.otel_span_kinds.split(",")),
                   default_slo=slo(settings.default_profile),
                   pool_slo={pool: slo(name) for pool, name in settings.pool_profiles.items()},
                   bounds=TimeBounds.of(settings))

    def slo(self, pool: str) -> tuple[float, float]:
        return self.pool_slo.get(pool, self.default_slo)


@dataclass(frozen=True)
class SpanRejection:
    reason: str   # a dead-letter reason
    detail: str
    where: str    # "record", a path such as resourceSpans[0].scopeSpans[0].spans[3], or "span <trace>/<span>"


@dataclass
class Mapped:
    """One record, mapped: the events (wire form, valid), the rejections, and the spans skipped by cause."""

    events: list[dict[str, Any]] = field(default_factory=list)
    rejections: list[SpanRejection] = field(default_factory=list)  # the first KEPT_REJECTIONS
    rejected: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)  # not_genai, other_operation, span_kind
    spans: int = 0

    def reject(self, reason: str, detail: str, where: str) -> None:
        self.rejected += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if len(self.rejections) < KEPT_REJECTIONS:
            self.rejections.append(SpanRejection(reason, detail[:1024], where))

    def skip(self, cause: str) -> None:
        self.skipped[cause] = self.skipped.get(cause, 0) + 1

    def rejection(self) -> Rejected | None:
        """The one dead letter this record deserves (None: nothing rejected): the first rejection's reason."""
        if not self.rejected:
            return None
        first = self.rejections[0]
        where = "" if first.where == "record" or first.detail.startswith(first.where) else f"{first.where}: "
        if self.rejected == 1:
            detail = f"{where}{first.detail}"
        else:
            counts = ", ".join(f"{reason} {n}" for reason, n in sorted(self.reasons.items()))
            detail = (f"{self.rejected} spans not mapped ({counts}), {len(self.events)} mapped; "
                      f"first: {where}{first.detail}")
        return Rejected(first.reason, detail[:1024])


def map_request(value: bytes | None, now_ms: int, config: MappingConfig = MappingConfig()) -> Mapped:
    """One Kafka record of the spans topic → its RequestEvents, rejections and skips. Never raises."""
    out = Mapped()
    try:
        _walk(value, now_ms, config, out)
    except Invalid as exc:
        out.reject(exc.reason, exc.detail, "record")
    except Exception as exc:  # a mapping bug costs one dead letter, never the bridge
        out.reject("malformed_json", f"unexpected mapping error {type(exc).__name__}: {describe(str(exc), 200)}",
                   "record")
    return out


def _walk(value: bytes | None, now_ms: int, config: MappingConfig, out: Mapped) -> None:
    if value is None:
        raise Invalid("malformed_json", "value is null (a tombstone), not an OTLP/JSON ExportTraceServiceRequest")
    if len(value) > config.max_record_bytes:
        raise Invalid("oversize", f"value is {len(value)} bytes, the limit is {config.max_record_bytes}")
    try:
        document = _parse(value)
    except Invalid as exc:
        raise Invalid(exc.reason, f"{exc.detail}; not OTLP/JSON (the Collector's kafka exporter needs "
                                  f"`encoding: otlp_json`)") from None
    if type(document) is not dict:
        raise Invalid("not_object", f"an OTLP/JSON ExportTraceServiceRequest is a JSON object, got {_kind(document)}")
    resource_spans = document.get("resourceSpans")
    if resource_spans is None:
        hint = ("; original proto field names are not OTLP/JSON keys" if "resource_spans" in document else
                "; is this OTLP/protobuf, or metrics or logs?" if {"resourceMetrics", "resourceLogs"} & document.keys()
                else "")
        raise Invalid("missing_field", f"resourceSpans is required: not an OTLP/JSON ExportTraceServiceRequest"
                                       f" (keys {describe(sorted(document)[:5], 120)}){hint}")
    _check_list(resource_spans, "resourceSpans")
    for i, rs in enumerate(resource_spans):
        where = f"resourceSpans[{i}]"
        try:
            _check_object(rs, where)
            resource = rs.get("resource")
            if resource is not None:
                _check_object(resource, f"{where}.resource")
            resource_attrs = _attributes(resource.get("attributes") if resource else None, RESOURCE_ATTRIBUTES,
                                         f"{where}.resource")
            scope_spans = rs.get("scopeSpans")
            if scope_spans is None:
                continue
            _check_list(scope_spans, f"{where}.scopeSpans")
        except Invalid as exc:
            out.reject(exc.reason, exc.detail, where)
            continue
        for j, ss in enumerate(scope_spans):
            scope_where = f"{where}.scopeSpans[{j}]"
            try:
                _check_object(ss, scope_where)
                spans = ss.get("spans")
                if spans is None:
                    continue
                _check_list(spans, f"{scope_where}.spans")
            except Invalid as exc:
                out.reject(exc.reason, exc.detail, scope_where)
                continue
            for k, span in enumerate(spans):
                out.spans += 1
                ref = [f"{scope_where}.spans[{k}]"]
                try:
                    event = _span(span, resource_attrs, config, now_ms, out, ref)
                except Invalid as exc:
                    out.reject(exc.reason, exc.detail, ref[0])
                    continue
                except Exception as exc:
                    out.reject("malformed_json", f"unexpected mapping error {type(exc).__name__}: "
                                                 f"{describe(str(exc), 200)}", ref[0])
                    continue
                if event is not None:
                    out.events.append(event)


def _span(span: Any, resource: dict[str, Any], config: MappingConfig, now_ms: int, out: Mapped,
          ref: list[str]) -> dict[str, Any] | None:
    """One span → its event (None: skipped, counted in ``out``); raises ``Invalid``."""
    _check_object(span, "span")
    attrs = _attributes(span.get("attributes"), SPAN_ATTRIBUTES, "span")
    operation = _string(attrs, OPERATION)
    if operation is None:
        if not _string(attrs, REQUEST_MODEL) or not any(k in attrs for k in LEGACY_MARKERS):
            out.skip("not_genai")
            return None
    elif operation not in INFERENCE_OPERATIONS:
        out.skip("other_operation")
        return None
    kind = _enum(span, "kind", 5, "span")
    if kind not in config.span_kinds:
        out.skip("span_kind")
        return None

    trace_id = _id(span, "traceId", _TRACE_ID, 16)
    span_id = _id(span, "spanId", _SPAN_ID, 8)
    ref[0] = f"span {trace_id}/{span_id}"

    status = span.get("status")
    code = 0
    if status is not None:
        _check_object(status, "status")
        code = _enum(status, "code", 2, "status")
    start = _uint64(span, "startTimeUnixNano")
    end = _uint64(span, "endTimeUnixNano")
    if not end:
        raise Invalid("missing_field", "endTimeUnixNano is required (a span is exported once it has ended)")
    if start > end:
        raise Invalid("out_of_range", f"the span ends ({end}) before it starts ({start})")

    origin: dict[str, str] = {}
    model = _string(attrs, REQUEST_MODEL) or _string(attrs, RESPONSE_MODEL)
    if not model:
        raise Invalid("missing_field", f"{REQUEST_MODEL} (or {RESPONSE_MODEL}) is required")
    origin["model"] = REQUEST_MODEL if _string(attrs, REQUEST_MODEL) else RESPONSE_MODEL

    error_type = _string(attrs, ERROR_TYPE)
    failed = code == STATUS_ERROR or bool(error_type)
    if failed and not error_type:
        error_type, origin["error_type"] = "_OTHER", "status ERROR without error.type"
    if not failed:
        error_type = None

    input_tokens, origin["input_tokens"] = _first(_integer, attrs, INPUT_TOKENS)
    output_tokens, origin["output_tokens"] = _first(_integer, attrs, OUTPUT_TOKENS)
    for value, keys in ((input_tokens, INPUT_TOKENS), (output_tokens, OUTPUT_TOKENS)):
        if value is None and not failed:
            raise Invalid("missing_field", f"{keys[0]} is required on a completed span: a terminal RequestEvent "
                                           f"carries its token counts (a failed span without them counts 0)")
    input_tokens = 0 if input_tokens is None else input_tokens
    output_tokens = 0 if output_tokens is None else output_tokens
    cached_input_tokens, origin["cached_input_tokens"] = _first(_integer, attrs, CACHED_INPUT_TOKENS)

    ttft, origin["ttft_s"] = _first(_seconds, attrs, TTFT)
    duration, origin["duration_s"] = _first(_seconds, attrs, DURATION)
    if duration is None:
        if not start:
            raise Invalid("missing_field", "startTimeUnixNano is required when no duration attribute is set")
        duration, origin["duration_s"] = (end - start) / 1e9, "span end - start"
    tpot, origin["tpot_s"] = _first(_seconds, attrs, TPOT)
    if tpot is None and ttft is not None and output_tokens >= 2 and duration >= ttft:
        tpot, origin["tpot_s"] = (duration - ttft) / (output_tokens - 1), "(duration - ttft) / (output tokens - 1)"
    queue, origin["queue_s"] = _first(_seconds, attrs, QUEUE)

    def sluice(reader: Callable, name: str, default: Any, default_origin: str) -> Any:
        key = f"sluice.{name}"
        for source, where in ((attrs, "span"), (resource, "resource")):
            value = reader(source, key)
            if value is not None and value != "":
                origin[name] = f"{where} attribute {key}"
                return value
        origin[name] = default_origin
        return default

    task_id = sluice(_string, "task_id", trace_id, "the trace id (no sluice.task_id)")
    request_id = sluice(_string, "request_id", span_id, "the span id (no sluice.request_id)")
    attempt = sluice(_integer, "attempt", 1, "default 1 (no sluice.attempt)")
    task_final = sluice(_boolean, "task_final", True, "default true (no sluice.task_final)")
    tenant = sluice(_string, "tenant", _string(resource, SERVICE_NAME),
                    "resource service.name (no sluice.tenant)")
    if not tenant:
        raise Invalid("missing_field", "sluice.tenant (or the resource's service.name) is required")
    priority = sluice(_string, "priority", "standard", "default standard (no sluice.priority)")
    pool = sluice(_string, "pool", model, f"the model, {origin['model']} (no sluice.pool)")
    replica_id = sluice(_string, "replica_id", None, "")
    slo_ttft, slo_tpot = config.slo(pool)
    slo_ttft = sluice(_seconds, "slo_ttft_s", slo_ttft, "the pool's profile (no sluice.slo_ttft_s)")
    slo_tpot = sluice(_seconds, "slo_tpot_s", slo_tpot, "the pool's profile (no sluice.slo_tpot_s)")

    phase = "failed" if failed else "completed"
    document = {
        "schema_version": 1,
        "event_id": str(uuid.uuid5(SPAN_EVENT_NAMESPACE, f"otlp/{trace_id}/{span_id}/{phase}")),
        "event_time": end // 1_000_000, "task_id": task_id, "request_id": request_id, "attempt": attempt,
        "task_final": task_final, "tenant": tenant, "priority": priority, "pool": pool, "model": model,
        "phase": phase, "replica_id": replica_id, "input_tokens": input_tokens,
        "cached_input_tokens": cached_input_tokens, "output_tokens": output_tokens, "queue_s": queue,
        "ttft_s": ttft, "tpot_s": tpot, "duration_s": duration, "error_type": error_type,
        "slo_ttft_s": slo_ttft, "slo_tpot_s": slo_tpot,
    }
    document = {k: v for k, v in document.items() if v is not None}
    result = decode(RequestEvent, orjson.dumps(document), task_id.encode(), config.max_event_bytes)
    if isinstance(result, Rejected):
        raise Invalid(result.reason, _with_origin(result.detail, origin))
    late = config.bounds.check(result.event_time, now_ms)
    if late is not None:
        raise Invalid(late.reason, f"{late.detail} (event_time is the span's end)")
    return as_dict(result)


def _with_origin(detail: str, origin: dict[str, str]) -> str:
    """The decoder names the field first; say where its value came from, since it was not sent as that field."""
    name = detail.split(" ", 1)[0]
    return f"{detail} (from {origin[name]})" if origin.get(name) else detail


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _check_object(value: Any, what: str) -> None:
    if type(value) is not dict:
        raise Invalid("wrong_type", f"{what} must be an object, got {_kind(value)}")


def _check_list(value: Any, what: str) -> None:
    if type(value) is not list:
        raise Invalid("wrong_type", f"{what} must be an array, got {_kind(value)}")


def _attributes(raw: Any, wanted: frozenset, what: str) -> dict[str, Any]:
    """key → AnyValue of the ``wanted`` attributes (the others are only checked to be KeyValues)."""
    if raw is None:
        return {}
    _check_list(raw, f"{what}.attributes")
    found: dict[str, Any] = {}
    for item in raw:
        if type(item) is not dict or type(item.get("key")) is not str:
            raise Invalid("wrong_type", f"{what}.attributes must hold KeyValue objects with a string key, "
                                        f"got {describe(item)}")
        if item["key"] in wanted:
            found[item["key"]] = item.get("value")
    return found


def _any_value(attrs: Mapping[str, Any], key: str) -> tuple[str, Any] | None:
    """(kind, raw value) of an attribute; None when absent or empty."""
    value = attrs.get(key)
    if value is None:
        return None
    if type(value) is not dict:
        raise Invalid("wrong_type", f"attribute {key} must hold an AnyValue object, got {_kind(value)}")
    for kind in _VALUE_KINDS:
        if kind in value and value[kind] is not None:
            return kind, value[kind]
    return None


def _typed(attrs: Mapping[str, Any], key: str, expected: str, py_type: type, label: str) -> Any:
    """The attribute's value when it holds an AnyValue of kind ``expected``; None when absent."""
    found = _any_value(attrs, key)
    if found is None:
        return None
    kind, raw = found
    if kind != expected or type(raw) is not py_type:
        raise Invalid("wrong_type", f"attribute {key} must be {label} ({expected}), got {kind} {describe(raw)}")
    return raw


def _string(attrs: Mapping[str, Any], key: str) -> str | None:
    return _typed(attrs, key, "stringValue", str, "a string")


def _boolean(attrs: Mapping[str, Any], key: str) -> bool | None:
    return _typed(attrs, key, "boolValue", bool, "a boolean")


def _integer(attrs: Mapping[str, Any], key: str) -> int | None:
    found = _any_value(attrs, key)
    if found is None:
        return None
    kind, raw = found
    number: int | None = None
    if kind == "intValue":
        number = _int64_text(raw)
    elif kind == "doubleValue" and type(raw) in (int, float) and math.isfinite(raw) and float(raw).is_integer():
        number = int(raw)
    if number is None:
        raise Invalid("wrong_type", f"attribute {key} must be an integer (intValue), got {kind} {describe(raw)}")
    if not -INT64_MAX - 1 <= number <= INT64_MAX:
        raise Invalid("out_of_range", f"attribute {key} is outside int64, got {describe(raw)}")
    return number


def _seconds(attrs: Mapping[str, Any], key: str) -> float | None:
    found = _any_value(attrs, key)
    if found is None:
        return None
    kind, raw = found
    number: float | None = None
    if kind == "doubleValue":
        if type(raw) in (int, float):
            number = float(raw)
        elif type(raw) is str:  # the proto3 JSON mapping writes NaN and the infinities as strings
            try:
                number = float(raw) if len(raw) <= 40 else None
            except ValueError:
                number = None
    elif kind == "intValue":
        integer = _int64_text(raw)
        number = None if integer is None else float(integer)
    if number is None:
        raise Invalid("wrong_type", f"attribute {key} must be a number of seconds (doubleValue), "
                                    f"got {kind} {describe(raw)}")
    if not math.isfinite(number):
        raise Invalid("non_finite_number", f"attribute {key} is {describe(raw)}, not a finite number")
    return number


def _int64_text(raw: Any) -> int | None:
    if type(raw) is int:
        return raw
    if type(raw) is str and _INTEGER.fullmatch(raw):
        return int(raw)
    if type(raw) is float and math.isfinite(raw) and raw.is_integer():
        return int(raw)
    return None


def _first(reader: Callable, attrs: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[Any, str]:
    """(value, its attribute) of the first of ``keys`` that is set; (None, "") if none is."""
    for key in keys:
        value = reader(attrs, key)
        if value is not None:
            return value, f"attribute {key}"
    return None, ""


def _enum(obj: dict, name: str, largest: int, what: str) -> int:
    raw = obj.get(name)
    if raw is None:
        return 0
    if type(raw) is not int:
        raise Invalid("wrong_type", f"{what}.{name} must be an integer (OTLP/JSON writes enums as integers, "
                                    f"never names), got {describe(raw)}")
    if not 0 <= raw <= largest:
        raise Invalid("unknown_enum", f"{what}.{name} {raw} is not a known value (0-{largest})")
    return raw


def _uint64(span: dict, name: str) -> int:
    raw = span.get(name)
    if raw is None:
        return 0
    number = _int64_text(raw)
    if number is None:
        raise Invalid("wrong_type", f"{name} must be a decimal string of nanoseconds, got {describe(raw)}")
    if not 0 <= number <= UINT64_MAX:
        raise Invalid("out_of_range", f"{name} {describe(raw)} is not a fixed64")
    return number


def _id(span: dict, name: str, pattern: re.Pattern, size: int) -> str:
    raw = span.get(name)
    if raw is None or raw == "":
        raise Invalid("missing_field", f"{name} is required")
    if type(raw) is not str:
        raise Invalid("wrong_type", f"{name} must be a hex string, got {_kind(raw)}")
    if not pattern.fullmatch(raw):
        raise Invalid("bad_format", f"{name} must be {2 * size} hex digits (OTLP/JSON writes ids as hex, not "
                                    f"base64), got {describe(raw)}")
    if not raw.strip("0"):
        raise Invalid("bad_format", f"{name} is all zeros, an invalid id")
    return raw.lower()
