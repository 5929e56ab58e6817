"""OTLP/JSON spans → RequestEvents: spans made by the real OpenTelemetry SDK, encoded as the Collector's Kafka
exporter writes them with ``encoding: otlp_json``, and hostile records that must never raise."""

from __future__ import annotations

import base64
import copy
import uuid
from dataclasses import replace

import orjson
import pytest
from hypothesis import HealthCheck, given, settings as hypothesis_settings
from hypothesis import strategies as st

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.common")

from google.protobuf import json_format  # noqa: E402
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, Status, StatusCode, format_span_id, format_trace_id  # noqa: E402

from pipeline.contract import load_schema  # noqa: E402
from pipeline.events import RequestEvent, dead_letter, decode, validate  # noqa: E402
from pipeline.ingest import TimeBounds  # noqa: E402
from pipeline.otel.spans import SPAN_EVENT_NAMESPACE, MappingConfig, map_request  # noqa: E402
from pipeline.settings import load_settings  # noqa: E402

T0 = 1_700_000_000_000_000_000  # span start, unix nanoseconds
NOW_MS = T0 // 1_000_000 + 60_000
CONFIG = MappingConfig()
DEAD_LETTER_REASONS = set(load_schema("dead_letter")["properties"]["reason"]["enum"])
ID_FIELDS = {"traceId", "spanId", "parentSpanId"}


def otlp_json(spans) -> bytes:
    """What the Collector's Kafka exporter writes with ``encoding: otlp_json``: an ExportTraceServiceRequest in
    the OTLP/JSON encoding. The SDK's own OTLP encoder builds the protobuf; the proto3 JSON mapping then gives
    lowerCamelCase keys and int64 as decimal strings, asked for integer enums; and the one deviation OTLP/JSON
    makes from that mapping is applied: trace and span ids are hex, not base64 (opentelemetry-proto
    docs/specification.md, "JSON Protobuf Encoding")."""
    document = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    hexify_ids(document)
    return orjson.dumps(document)


def hexify_ids(node) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ID_FIELDS and isinstance(value, str):
                node[key] = base64.b64decode(value).hex()
            else:
                hexify_ids(value)
    elif isinstance(node, list):
        for item in node:
            hexify_ids(item)


class Spans:
    """A TracerProvider with an in-memory exporter; ``span`` makes one finished span with exact times."""

    def __init__(self, **resource) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(resource=Resource.create({"service.name": "acme-router", **resource}))
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("sluice-test", "1.0")

    def span(self, name="chat llama-70b", kind=SpanKind.CLIENT, attributes=None, start=T0, seconds=2.25,
             status=None, error=None):
        span = self.tracer.start_span(name, kind=kind, attributes=attributes or {}, start_time=start)
        if error is not None:
            span.record_exception(error)
        if status is not None:
            span.set_status(status)
        span.end(end_time=start + int(seconds * 1e9))
        return span

    def finished(self):
        return self.exporter.get_finished_spans()

    def record(self) -> bytes:
        return otlp_json(self.finished())


def chat(**extra):
    return {"gen_ai.operation.name": "chat", "gen_ai.request.model": "llama-70b", "gen_ai.usage.input_tokens": 1200,
            "gen_ai.usage.output_tokens": 101, **extra}


def only_event(mapped):
    assert mapped.rejected == 0, mapped.rejections
    assert len(mapped.events) == 1
    return mapped.events[0]


def accepted_by_worker(event) -> bool:
    result = decode(RequestEvent, orjson.dumps(event), event["task_id"].encode(), CONFIG.max_event_bytes)
    return isinstance(result, RequestEvent)


# --- the encoding itself ---------------------------------------------------------------------------------------

def test_the_fixture_encoding_is_otlp_json():
    spans = Spans()
    span = spans.span(attributes=chat())
    document = orjson.loads(spans.record())
    encoded = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert encoded["traceId"] == format_trace_id(span.context.trace_id)   # hex, 32 digits
    assert encoded["spanId"] == format_span_id(span.context.span_id)
    assert encoded["kind"] == 3                                          # SPAN_KIND_CLIENT as an integer
    assert encoded["startTimeUnixNano"] == str(T0)                       # fixed64 as a decimal string
    tokens = next(a for a in encoded["attributes"] if a["key"] == "gen_ai.usage.input_tokens")
    assert tokens["value"] == {"intValue": "1200"}


# --- the mapping -----------------------------------------------------------------------------------------------

def test_a_chat_client_span_becomes_one_terminal_request_event():
    spans = Spans()
    span = spans.span(attributes=chat(**{"gen_ai.usage.cache_read.input_tokens": 800,
                                          "gen_ai.response.time_to_first_chunk": 0.25}))
    event = only_event(map_request(spans.record(), NOW_MS, CONFIG))
    trace_id, span_id = format_trace_id(span.context.trace_id), format_span_id(span.context.span_id)
    assert event == {
        "schema_version": 1, "event_id": str(uuid.uuid5(SPAN_EVENT_NAMESPACE, f"otlp/{trace_id}/{span_id}/completed")),
        "event_time": T0 // 1_000_000 + 2250, "task_id": trace_id, "request_id": span_id, "attempt": 1,
        "task_final": True, "tenant": "acme-router", "priority": "standard", "pool": "llama-70b",
        "model": "llama-70b", "phase": "completed", "input_tokens": 1200, "cached_input_tokens": 800,
        "output_tokens": 101, "ttft_s": 0.25, "tpot_s": pytest.approx(0.02), "duration_s": 2.25,
        "slo_ttft_s": 2.0, "slo_tpot_s": 0.1}
    assert accepted_by_worker(event)


def test_sluice_attributes_on_the_span_win_over_the_resource_and_the_defaults():
    spans = Spans(**{"sluice.pool": "pool-from-resource", "sluice.tenant": "team-a", "sluice.replica_id": "r7"})
    spans.span(attributes=chat(**{"sluice.task_id": "agent-run-42", "sluice.request_id": "req-3",
                                  "sluice.attempt": 2, "sluice.task_final": False, "sluice.priority": "critical",
                                  "sluice.pool": "chat-70b", "sluice.slo_ttft_s": 0.5, "sluice.slo_tpot_s": 0.04}))
    event = only_event(map_request(spans.record(), NOW_MS, CONFIG))
    assert {k: event[k] for k in ("task_id", "request_id", "attempt", "task_final", "priority", "pool", "tenant",
                                  "replica_id", "slo_ttft_s", "slo_tpot_s")} == {
        "task_id": "agent-run-42", "request_id": "req-3", "attempt": 2, "task_final": False,
        "priority": "critical", "pool": "chat-70b", "tenant": "team-a", "replica_id": "r7",
        "slo_ttft_s": 0.5, "slo_tpot_s": 0.04}


def test_slo_defaults_come_from_the_pool_profile():
    settings = load_settings(env={}, pool_profiles={"llama-70b": "interactive"}, default_profile="batch")
    config = MappingConfig.of(settings)
    spans = Spans()
    spans.span(attributes=chat())
    spans.span(attributes=chat(**{"gen_ai.request.model": "other-model"}))
    first, second = map_request(spans.record(), NOW_MS, config).events
    assert (first["slo_ttft_s"], first["slo_tpot_s"]) == (1.0, 0.05)    # interactive
    assert (second["slo_ttft_s"], second["slo_tpot_s"]) == (30.0, 0.2)  # batch, the default


def test_an_error_status_with_error_type_is_a_failed_event_with_zero_tokens():
    spans = Spans()
    spans.span(attributes={"gen_ai.operation.name": "chat", "gen_ai.request.model": "llama-70b",
                           "error.type": "timeout"},
               status=Status(StatusCode.ERROR, "deadline exceeded"), error=TimeoutError("deadline"), seconds=30)
    event = only_event(map_request(spans.record(), NOW_MS, CONFIG))
    assert (event["phase"], event["error_type"], event["input_tokens"], event["output_tokens"]) == (
        "failed", "timeout", 0, 0)
    assert event["duration_s"] == 30 and accepted_by_worker(event)


def test_error_status_without_error_type_is_other_and_error_type_alone_fails_too():
    spans = Spans()
    spans.span(attributes=chat(), status=Status(StatusCode.ERROR))
    spans.span(attributes=chat(**{"error.type": "rate_limited"}))
    spans.span(attributes=chat(), status=Status(StatusCode.OK))
    events = map_request(spans.record(), NOW_MS, CONFIG).events
    assert [(e["phase"], e.get("error_type")) for e in events] == [
        ("failed", "_OTHER"), ("failed", "rate_limited"), ("completed", None)]


def test_other_spans_are_skipped_and_counted_not_rejected():
    spans = Spans()
    spans.span("GET /v1/chat", kind=SpanKind.SERVER, attributes={"http.request.method": "GET"})
    spans.span("execute_tool search", kind=SpanKind.INTERNAL,
               attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search"})
    spans.span("embeddings e5", attributes={"gen_ai.operation.name": "embeddings", "gen_ai.request.model": "e5"})
    spans.span("chat in-process", kind=SpanKind.INTERNAL, attributes=chat())   # a framework's wrapper span
    spans.span(attributes=chat())
    mapped = map_request(spans.record(), NOW_MS, CONFIG)
    assert len(mapped.events) == 1 and mapped.rejected == 0 and mapped.rejection() is None
    assert mapped.skipped == {"not_genai": 1, "other_operation": 2, "span_kind": 1} and mapped.spans == 5


def test_span_kinds_come_from_settings():
    config = MappingConfig.of(load_settings(env={}, otel_span_kinds="internal"))
    spans = Spans()
    spans.span(kind=SpanKind.INTERNAL, attributes=chat())
    spans.span(kind=SpanKind.CLIENT, attributes=chat())
    mapped = map_request(spans.record(), NOW_MS, config)
    assert len(mapped.events) == 1 and mapped.skipped == {"span_kind": 1}


def test_a_vllm_server_span_maps_from_its_own_latency_attributes():
    spans = Spans(**{"service.name": "vllm-replica", "sluice.replica_id": "llama-70b-r3"})
    spans.span("llm_request", kind=SpanKind.SERVER, seconds=3.0, attributes={
        "gen_ai.request.model": "meta-llama/Llama-3.1-70B-Instruct", "gen_ai.response.model": "llama",
        "gen_ai.usage.prompt_tokens": 900, "gen_ai.usage.completion_tokens": 51,
        "gen_ai.latency.time_in_queue": 0.1, "gen_ai.latency.time_to_first_token": 0.4,
        "gen_ai.latency.e2e": 2.9, "gen_ai.request.id": "cmpl-1"})
    event = only_event(map_request(spans.record(), NOW_MS, CONFIG))
    assert (event["model"], event["input_tokens"], event["output_tokens"], event["queue_s"], event["ttft_s"],
            event["duration_s"], event["replica_id"]) == (
        "meta-llama/Llama-3.1-70B-Instruct", 900, 51, 0.1, 0.4, 2.9, "llama-70b-r3")
    assert event["tpot_s"] == pytest.approx((2.9 - 0.4) / 50)


def test_event_ids_are_deterministic_so_a_redelivered_span_is_deduplicated():
    spans = Spans()
    for _ in range(3):
        spans.span(attributes=chat())
    record = spans.record()
    first, again = map_request(record, NOW_MS, CONFIG), map_request(record, NOW_MS + 5000, CONFIG)
    assert [e["event_id"] for e in first.events] == [e["event_id"] for e in again.events]
    assert len({e["event_id"] for e in first.events}) == 3


def test_many_resources_and_spans_in_one_record_with_a_bad_one_among_them():
    router, engine = Spans(), Spans(**{"service.name": "engine"})
    for i in range(50):
        router.span(attributes=chat(**{"sluice.task_id": f"task-{i}"}))
    router.span(attributes={"gen_ai.operation.name": "chat", "gen_ai.request.model": "llama-70b"})  # no usage
    engine.span(kind=SpanKind.SERVER, attributes=chat())
    record = otlp_json([*router.finished(), *engine.finished()])
    assert len(orjson.loads(record)["resourceSpans"]) == 2
    mapped = map_request(record, NOW_MS, CONFIG)
    assert len(mapped.events) == 51 and mapped.rejected == 1
    rejection = mapped.rejection()
    assert rejection.reason == "missing_field" and "gen_ai.usage.input_tokens" in rejection.detail
    assert rejection.detail.startswith("span ")
    assert {e["tenant"] for e in mapped.events} == {"acme-router", "engine"}


def test_several_rejections_make_one_summarised_dead_letter_reason():
    spans = Spans()
    spans.span(attributes=chat(**{"sluice.priority": "platinum"}))
    spans.span(attributes=chat(**{"sluice.priority": "gold"}))
    spans.span(attributes=chat(**{"gen_ai.request.model": "m" * 65}))
    spans.span(attributes=chat())
    mapped = map_request(spans.record(), NOW_MS, CONFIG)
    assert len(mapped.events) == 1 and mapped.rejected == 3
    rejection = mapped.rejection()
    assert rejection.reason == "unknown_enum"
    assert rejection.detail.startswith("3 spans not mapped (too_long 1, unknown_enum 2), 1 mapped; first: span ")
    assert "from span attribute sluice.priority" in rejection.detail
    too_long = mapped.rejections[2]
    assert too_long.reason == "too_long" and "from the model, gen_ai.request.model (no sluice.pool)" in too_long.detail


def test_event_time_bounds_are_the_workers():
    config = replace(CONFIG, bounds=TimeBounds(max_ahead_ms=60_000, max_age_ms=3_600_000))
    spans = Spans()
    spans.span(attributes=chat())
    record = spans.record()
    assert len(map_request(record, NOW_MS, config).events) == 1
    assert map_request(record, NOW_MS + 7_200_000, config).rejection().reason == "event_time_too_old"
    assert map_request(record, NOW_MS - 3_600_000, config).rejection().reason == "event_time_ahead"


def test_a_completed_span_without_usage_is_rejected_not_invented():
    spans = Spans()
    spans.span(attributes={"gen_ai.operation.name": "text_completion", "gen_ai.request.model": "llama-70b",
                           "gen_ai.usage.input_tokens": 10})
    mapped = map_request(spans.record(), NOW_MS, CONFIG)
    assert not mapped.events and mapped.rejection().reason == "missing_field"
    assert "gen_ai.usage.output_tokens" in mapped.rejection().detail


def test_the_dead_letter_for_a_rejected_record_is_valid_and_carries_the_bytes():
    spans = Spans()
    spans.span(attributes=chat(**{"sluice.attempt": "2"}))  # a string where an int belongs
    record = spans.record()
    mapped = map_request(record, NOW_MS, CONFIG)
    assert mapped.rejection().reason == "wrong_type" and "sluice.attempt" in mapped.rejection().detail
    key, letter = dead_letter(mapped.rejection(), record, None, "otlp_spans", 0, 7, None, NOW_MS)
    document = validate("dead_letter", orjson.loads(letter))
    assert base64.b64decode(document["value_b64"]) == record and key == b"otlp_spans/0/7"


# --- hostile records ---------------------------------------------------------------------------------------------

def good_document() -> dict:
    spans = Spans()
    spans.span(attributes=chat())
    return orjson.loads(spans.record())


def first_span(document: dict) -> dict:
    return document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]


def set_attribute(span: dict, key: str, value: dict) -> None:
    span["attributes"] = [a for a in span["attributes"] if a["key"] != key] + [{"key": key, "value": value}]


def mutated(change) -> bytes:
    document = good_document()
    change(document)
    return orjson.dumps(document)


HOSTILE = [
    ("null value", None, "malformed_json"),
    ("not json", b'{"resourceSpans": [', "malformed_json"),
    ("otlp protobuf bytes", b"\n\xb3\x01\n\x1e\n\x1c\n\x0cservice.name\x12\x0c\n\nacme", "not_utf8"),
    ("not utf-8", b'{"resourceSpans": "\xff\xfe"}', "not_utf8"),
    ("NaN", b'{"resourceSpans": NaN}', "non_finite_number"),
    ("array", b"[1, 2, 3]", "not_object"),
    ("string", b'"spans"', "not_object"),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000, "malformed_json"),
    ("deep nesting in an object", b'{"resourceSpans": ' + b"[" * 5000 + b"]" * 5000 + b"}", "malformed_json"),
    ("metrics on the spans topic", b'{"resourceMetrics": []}', "missing_field"),
    ("proto field names", b'{"resource_spans": []}', "missing_field"),
    ("a Sluice event", orjson.dumps({"schema_version": 1, "phase": "completed"}), "missing_field"),
    ("resourceSpans not a list", b'{"resourceSpans": {"a": 1}}', "wrong_type"),
    ("resource spans item not an object", b'{"resourceSpans": [7]}', "wrong_type"),
    ("scopeSpans not a list", b'{"resourceSpans": [{"scopeSpans": "x"}]}', "wrong_type"),
    ("span not an object", b'{"resourceSpans": [{"scopeSpans": [{"spans": [null]}]}]}', "wrong_type"),
    ("attributes not a list", mutated(lambda d: first_span(d).update(attributes={"a": 1})), "wrong_type"),
    ("attribute without key", mutated(lambda d: first_span(d)["attributes"].append({"value": {}})), "wrong_type"),
    ("resource attributes not a list",
     mutated(lambda d: d["resourceSpans"][0]["resource"].update(attributes=5)), "wrong_type"),
    ("base64 ids (the plain protobuf mapping)",
     mutated(lambda d: first_span(d).update(traceId=base64.b64encode(bytes.fromhex(first_span(d)["traceId"]))
                                           .decode())), "bad_format"),
    ("all-zero trace id", mutated(lambda d: first_span(d).update(traceId="0" * 32)), "bad_format"),
    ("missing span id", mutated(lambda d: first_span(d).pop("spanId")), "missing_field"),
    ("trace id a number", mutated(lambda d: first_span(d).update(traceId=12)), "wrong_type"),
    ("kind as an enum name", mutated(lambda d: first_span(d).update(kind="SPAN_KIND_CLIENT")), "wrong_type"),
    ("unknown status code", mutated(lambda d: first_span(d).update(status={"code": 7})), "unknown_enum"),
    ("status not an object", mutated(lambda d: first_span(d).update(status=[2])), "wrong_type"),
    ("end before start",
     mutated(lambda d: first_span(d).update(endTimeUnixNano=str(T0 - 1))), "out_of_range"),
    ("no end time", mutated(lambda d: first_span(d).pop("endTimeUnixNano")), "missing_field"),
    ("time not a number", mutated(lambda d: first_span(d).update(startTimeUnixNano="soon")), "wrong_type"),
    ("time beyond fixed64", mutated(lambda d: first_span(d).update(endTimeUnixNano="9" * 20)), "out_of_range"),
    ("time a huge JSON number",
     mutated(lambda d: first_span(d).update(endTimeUnixNano=1e30)), "out_of_range"),
    ("time in 2200", mutated(lambda d: first_span(d).update(endTimeUnixNano=str(7_258_118_400 * 10**9))),
     "out_of_range"),
    ("tokens beyond int64",
     mutated(lambda d: set_attribute(first_span(d), "gen_ai.usage.input_tokens", {"intValue": "9" * 20})),
     "out_of_range"),
    ("tokens beyond the schema",
     mutated(lambda d: set_attribute(first_span(d), "gen_ai.usage.input_tokens", {"intValue": "99999999999"})),
     "out_of_range"),
    ("negative tokens",
     mutated(lambda d: set_attribute(first_span(d), "gen_ai.usage.output_tokens", {"intValue": "-1"})),
     "out_of_range"),
    ("tokens as a string",
     mutated(lambda d: set_attribute(first_span(d), "gen_ai.usage.output_tokens", {"stringValue": "12"})),
     "wrong_type"),
    ("ttft NaN",
     mutated(lambda d: set_attribute(first_span(d), "gen_ai.response.time_to_first_chunk", {"doubleValue": "NaN"})),
     "non_finite_number"),
    ("ttft Infinity",
     mutated(lambda d: set_attribute(first_span(d), "gen_ai.response.time_to_first_chunk",
                                     {"doubleValue": "Infinity"})), "non_finite_number"),
    ("ttft a list",
     mutated(lambda d: set_attribute(first_span(d), "gen_ai.response.time_to_first_chunk",
                                     {"arrayValue": {"values": []}})), "wrong_type"),
    ("model an int", mutated(lambda d: set_attribute(first_span(d), "gen_ai.request.model", {"intValue": "1"})),
     "wrong_type"),
    ("model with a control character",
     mutated(lambda d: set_attribute(first_span(d), "gen_ai.request.model", {"stringValue": "llama\u202e\x07"})),
     "bad_format"),
    ("operation name an int",
     mutated(lambda d: set_attribute(first_span(d), "gen_ai.operation.name", {"intValue": "1"})), "wrong_type"),
    ("AnyValue not an object",
     mutated(lambda d: set_attribute(first_span(d), "gen_ai.usage.input_tokens", "12")), "wrong_type"),
    ("task id of 10k characters",
     mutated(lambda d: set_attribute(first_span(d), "sluice.task_id", {"stringValue": "t" * 10_000})), "too_long"),
    ("priority unknown",
     mutated(lambda d: set_attribute(first_span(d), "sluice.priority", {"stringValue": "platinum"})),
     "unknown_enum"),
    ("no tenant at all",
     mutated(lambda d: d["resourceSpans"][0]["resource"].update(attributes=[])), "missing_field"),
]


@pytest.mark.parametrize("name,value,reason", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_records_are_rejected_with_a_dead_letter_reason(name, value, reason):
    mapped = map_request(value, NOW_MS, CONFIG)
    assert not mapped.events
    rejection = mapped.rejection()
    assert rejection is not None and rejection.reason == reason, rejection
    assert rejection.reason in DEAD_LETTER_REASONS
    assert 0 < len(rejection.detail) <= 1024 and "\x07" not in rejection.detail and "\u202e" not in rejection.detail


def test_oversize_records_are_not_parsed():
    record = orjson.dumps({"resourceSpans": [], "padding": "x" * 5000})
    mapped = map_request(record, NOW_MS, replace(CONFIG, max_record_bytes=4096))
    assert mapped.rejection().reason == "oversize" and "4096" in mapped.rejection().detail


def test_unknown_fields_and_versions_are_ignored_and_empty_envelopes_are_nothing():
    def add_unknowns(document):
        document["futureField"] = {"x": [1, 2]}
        document["resourceSpans"][0]["entityRefs"] = [{"type": "k8s.pod"}]
        document["resourceSpans"][0]["schemaUrl"] = "https://opentelemetry.io/schemas/9.99.0"  # a future version
        first_span(document)["newThing"] = "v2"
        first_span(document)["status"] = {"code": 0, "unknownInStatus": True}
    assert len(map_request(mutated(add_unknowns), NOW_MS, CONFIG).events) == 1
    for empty in (b'{"resourceSpans": []}', b'{"resourceSpans": [{}]}', b'{"resourceSpans": [{"scopeSpans": [{}]}]}'):
        mapped = map_request(empty, NOW_MS, CONFIG)
        assert (mapped.events, mapped.rejected, mapped.spans) == ([], 0, 0)


def test_a_record_of_many_tiny_spans_is_handled_in_bounded_time():
    span = first_span(good_document())
    spans = []
    for i in range(20_000):
        s = copy.deepcopy(span)
        s["spanId"] = f"{i + 1:016x}"
        spans.append(s)
    record = orjson.dumps({"resourceSpans": [{"resource": {"attributes": [
        {"key": "service.name", "value": {"stringValue": "acme"}}]}, "scopeSpans": [{"spans": spans}]}]})
    mapped = map_request(record, NOW_MS, replace(CONFIG, max_record_bytes=len(record)))
    assert len(mapped.events) == 20_000 and len({e["event_id"] for e in mapped.events}) == 20_000


JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 63), max_value=2 ** 63 - 1),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30))
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                              st.dictionaries(st.text(max_size=12), inner,
                                                                              max_size=4)), max_leaves=20)


def replace_at(document, path: list[int], value):
    """Replace the node reached by following ``path`` (indices into each container's children)."""
    node = document
    for step in path:
        children = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        if not children:
            break
        key, child = children[step % len(children)]
        if not isinstance(child, (dict, list)) or step == path[-1]:
            node[key] = value
            return document
        node = child
    return document


@hypothesis_settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=12), value=JSON_VALUE)
def test_no_mutation_of_a_good_record_raises_or_yields_an_invalid_event(path, value):
    mapped = map_request(orjson.dumps(replace_at(good_document(), path, value)), NOW_MS, CONFIG)
    # every span is an event, a skip or a rejection (rejections also count broken envelopes)
    handled = len(mapped.events) + sum(mapped.skipped.values())
    assert handled <= mapped.spans <= handled + mapped.rejected
    for event in mapped.events:
        assert accepted_by_worker(event)
    if mapped.rejected:
        assert mapped.rejection().reason in DEAD_LETTER_REASONS


@hypothesis_settings(max_examples=200, deadline=None)
@given(value=st.binary(max_size=300))
def test_arbitrary_bytes_never_raise(value):
    mapped = map_request(value, NOW_MS, CONFIG)
    assert mapped.events == [] or all(accepted_by_worker(e) for e in mapped.events)
