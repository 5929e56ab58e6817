"""Every schema example is judged identically by the reference JSON Schema validator and by our decoder."""

import json
from pathlib import Path

import orjson
import pytest

from pipeline.contract import SCHEMA_DIR, Invalid, compile_schema, semantic_names
from pipeline.events import ReplicaSample, Rejected, RequestEvent, decode, encode, validate
from tests.reference import reference_accepts

EXAMPLES = sorted((SCHEMA_DIR / "examples").glob("*/*/*.json"))
DECODED = {"request_event": RequestEvent, "replica_sample": ReplicaSample}


def test_there_are_valid_and_invalid_examples_for_every_schema():
    seen = {(p.parts[-3], p.parts[-2]) for p in EXAMPLES}
    for schema in ("request_event", "replica_sample", "admission_signal", "dead_letter"):
        assert {(schema, "valid"), (schema, "invalid")} <= seen


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: "/".join(p.parts[-3:]))
def test_example_verdict_agrees_with_reference(path: Path):
    schema, kind = path.parts[-3], path.parts[-2]
    raw = path.read_bytes()
    document = json.loads(raw)
    assert reference_accepts(schema, document) is (kind == "valid")
    expected_reason = None if kind == "valid" else path.stem.split("-")[0]
    if schema in DECODED:
        cls = DECODED[schema]
        key = document.get(cls.key_field, "k").encode() if isinstance(document, dict) else b"k"
        result = decode(cls, raw, key, 1 << 20)
        if expected_reason is None:
            assert isinstance(result, cls), result
        else:
            assert isinstance(result, Rejected) and result.reason == expected_reason, result
    else:
        try:
            validate(schema, document)
            reason = None
        except Invalid as exc:
            reason = exc.reason
        assert reason == expected_reason


@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.parts[-2] == "valid" and p.parts[-3] in DECODED],
                         ids=lambda p: "/".join(p.parts[-3:]))
def test_valid_examples_round_trip_through_the_codec(path: Path):
    cls = DECODED[path.parts[-3]]
    document = json.loads(path.read_bytes())
    event = decode(cls, path.read_bytes(), document[cls.key_field].encode(), 1 << 20)
    again = decode(cls, encode(event), document[cls.key_field].encode(), 1 << 20)
    assert again == event
    assert reference_accepts(path.parts[-3], orjson.loads(encode(event)))


def test_unsupported_schema_keyword_fails_loudly():
    with pytest.raises(ValueError, match="not supported"):
        compile_schema({"type": "object", "patternProperties": {"x": {}}})


def test_every_semantic_name_is_mapped_once():
    rows = semantic_names()
    names = {(event, field, convention) for event, field, convention, _ in rows}
    assert len(names) == len(rows)
    assert ("request_event", "ttft_s", "otel", "gen_ai.server.time_to_first_token") in rows
    assert ("replica_sample", "requests_waiting", "vllm", "vllm:num_requests_waiting") in rows


def test_contract_doc_lists_every_semantic_name():
    doc = (SCHEMA_DIR.parent / "docs" / "contract.md").read_text()
    for event, field, convention, name in semantic_names():
        assert f"| {event} | `{field}` | {convention} | `{name}` |" in doc
