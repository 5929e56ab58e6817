"""Stage 1's decode step: precise reasons for bad input, and total accounting."""

import json

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.events import ReplicaSample, Rejected, RequestEvent, dead_letter, decode
from tests.reference import reference_accepts
from pipeline.sim.specimens import bad_inputs, replica_sample, request_event

MAX = 1 << 20


@pytest.mark.parametrize("reason,value,key", bad_inputs(MAX), ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(bad_inputs(MAX))])
def test_bad_input_is_rejected_with_its_reason(reason, value, key):
    result = decode(RequestEvent, value, key, MAX)
    assert isinstance(result, Rejected)
    assert result.reason == reason, result.detail
    assert result.detail


def test_detail_escapes_hostile_strings():
    result = decode(RequestEvent, orjson.dumps(request_event(pool="a\x1b[2J\nb")), b"task-1", MAX)
    assert "\x1b" not in result.detail and "\n" not in result.detail


def test_integral_float_is_an_integer_and_normalised():
    event = decode(RequestEvent, orjson.dumps(request_event(input_tokens=12.0)), b"task-1", MAX)
    assert isinstance(event, RequestEvent) and event.input_tokens == 12 and type(event.input_tokens) is int


def test_replica_sample_keyed_by_replica_id():
    assert isinstance(decode(ReplicaSample, orjson.dumps(replica_sample()), b"r1", MAX), ReplicaSample)
    assert decode(ReplicaSample, orjson.dumps(replica_sample()), b"r2", MAX).reason == "key_mismatch"


def test_dead_letter_carries_original_bytes_and_is_valid():
    import base64

    value = b"\xff\x00 not json"
    key, letter = dead_letter(Rejected("not_utf8", "x"), value, None, "sluice.requests.v1", 3, 99, 123, 456)
    doc = orjson.loads(letter)
    assert key == b"sluice.requests.v1/3/99"
    assert base64.b64decode(doc["value_b64"]) == value and doc["key_b64"] is None
    assert reference_accepts("dead_letter", doc)
    _, again = dead_letter(Rejected("not_utf8", "x"), value, None, "sluice.requests.v1", 3, 99, 123, 999)
    assert orjson.loads(again)["event_id"] == doc["event_id"]


json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=80)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
FIELDS = list(request_event())


@st.composite
def mutated_events(draw):
    """Mostly-valid events with a few fields dropped, replaced or added: the inputs where a validator can be subtly wrong."""
    event = request_event(phase=draw(st.sampled_from(["received", "completed", "failed", "first_token"])))
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["drop", "replace", "add"]))
        name = draw(st.sampled_from(FIELDS))
        if action == "drop":
            event.pop(name, None)
        elif action == "replace":
            event[name] = draw(json_values)
        else:
            event[draw(st.text(max_size=10))] = draw(json_values)
    return event


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(mutated_events())
def test_decoder_agrees_with_reference_on_mutated_events(event):
    key = event["task_id"].encode() if isinstance(event.get("task_id"), str) else b"k"
    result = decode(RequestEvent, json.dumps(event).encode(), key, MAX)
    assert isinstance(result, (RequestEvent, Rejected))
    if isinstance(result, Rejected) and result.reason == "key_mismatch":
        assert reference_accepts("request_event", event), "only the key may be wrong"
    else:
        assert isinstance(result, RequestEvent) == reference_accepts("request_event", event), result


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300), st.none() | st.binary(max_size=20))
def test_random_bytes_are_accepted_or_rejected_never_both_never_neither(value, key):
    result = decode(RequestEvent, value, key, MAX)
    assert isinstance(result, (RequestEvent, Rejected)) and not (
        isinstance(result, RequestEvent) and isinstance(result, Rejected))
    if isinstance(result, Rejected):
        assert result.reason and result.detail


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_random_json_is_accepted_or_rejected(document):
    result = decode(ReplicaSample, json.dumps(document).encode(), b"r1", MAX)
    assert isinstance(result, (ReplicaSample, Rejected))
    if isinstance(result, ReplicaSample):
        assert reference_accepts("replica_sample", document)
