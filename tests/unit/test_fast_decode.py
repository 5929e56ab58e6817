"""The compiled fast path never accepts what the schema refuses, and yields the same document.

It only decides acceptance: whatever it refuses goes to the full validator, which names the reason, so
dead-letter reasons cannot differ. What must hold is one direction — fast accepts ⇒ the full validator
accepts the same document — checked on every schema example, the hostile corpus, generated traffic and
mutated documents.
"""

import json
from itertools import islice
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from pipeline.contract import Invalid
from pipeline.events import ACCEPT, ReplicaSample, RequestEvent, _parse, decode, validate
from pipeline.fast_decode import FAST
from pipeline.sim.replay import generate, load_trace
from pipeline.sim.specimens import bad_inputs, replica_sample, request_event

EXAMPLES = Path(__file__).resolve().parents[2] / "schemas" / "examples"


CLASSES = {"request_event": RequestEvent, "replica_sample": ReplicaSample}


def agrees(schema: str, value: bytes) -> bool:
    """True when the fast path accepted; asserts the full validator accepts the same document, and that the
    event the fast path builds straight from its struct is the one built from that document."""
    fast = FAST[schema].document(value)
    event = FAST[schema].event(value, CLASSES[schema])
    assert (event is None) == (fast is None), (event, fast)
    try:
        slow = validate(schema, _parse(value))
    except Invalid as exc:
        assert fast is None, f"fast path accepted what the schema refuses ({exc.reason}: {exc.detail}): {value[:300]!r}"
        key = _key_in(value, CLASSES[schema].key_field)
        assert key is None or ACCEPT[CLASSES[schema]](value, key) is None, value[:300]
        return False
    if fast is not None:
        assert fast == slow, (fast, slow)
        assert event == CLASSES[schema](**slow), (event, slow)
    assert accepts_as_the_full_path(schema, value, slow) == (fast is not None)
    return fast is not None


def _key_in(value: bytes, key_field: str) -> bytes | None:
    """The key a producer would give this record: its key field, when the value is an object holding a string."""
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    key = doc.get(key_field) if isinstance(doc, dict) else None
    return key.encode("utf-8", "surrogatepass") if isinstance(key, str) else None


def accepts_as_the_full_path(schema: str, value: bytes, slow: dict) -> bool:
    """The workers' one-call fast path (``events.ACCEPT``) under its record's key: the event the full path
    builds (id lower-cased), or None; under any other key, None (the full path names the mismatch)."""
    cls = CLASSES[schema]
    key = slow[cls.key_field].encode()
    event = ACCEPT[cls](value, key)
    assert ACCEPT[cls](value, key + b"x") is None and ACCEPT[cls](value, b"") is None
    if event is not None:
        assert event == cls(**slow | {"event_id": slow["event_id"].lower()}), (event, slow)
        assert decode(cls, value, key, 1 << 20) == event
    return event is not None


@pytest.mark.parametrize("path", sorted(p for name in FAST for p in EXAMPLES.glob(f"{name}/*/*.json")),
                         ids=lambda p: "/".join(p.parts[-3:]))
def test_every_schema_example(path):
    schema = path.parts[-3]
    accepted = agrees(schema, path.read_bytes())
    if path.parts[-2] == "valid" and "integral-float" not in path.name:  # 1.0 for an integer: the slow path's
        assert accepted, "a valid example takes the fast path"


def test_the_hostile_corpus_gets_the_same_reasons():
    for reason, value, key in bad_inputs(1 << 16):
        if value is not None and len(value) <= 1 << 16:
            agrees("request_event", value)
        result = decode(RequestEvent, value, key, 1 << 16)
        assert getattr(result, "reason", None) == reason, (reason, result)


def test_generated_traffic_takes_the_fast_path():
    for e in islice(generate(load_trace(), rate=50, seconds=120, seed=3, start_ms=1_700_000_000_000), 3000):
        schema = "request_event" if e.kind == "request" else "replica_sample"
        assert agrees(schema, orjson.dumps(e.event))


EDGE = [
    ("task_id", "abc\n"), ("task_id", ""), ("task_id", "x" * 129), ("task_id", "tâsk"), ("attempt", 1.0),
    ("attempt", True), ("attempt", 0), ("attempt", 101), ("event_time", -1), ("event_time", 4102444800001),
    ("priority", "CRITICAL"), ("phase", None), ("ttft_s", None), ("ttft_s", -0.0), ("ttft_s", 1e300),
    ("slo_ttft_s", 0), ("slo_ttft_s", 0.0), ("replica_id", None), ("task_final", None), ("schema_version", 1.0),
    ("schema_version", True), ("input_tokens", 10_000_001), ("event_id", "0" * 36), ("tenant", "-x"),
    ("model", "a" * 129), ("error_type", "a b"), ("queue_s", 86400.0001), ("extra", 1),
]


@pytest.mark.parametrize("field,value", EDGE, ids=[f"{f}={v!r}"[:40] for f, v in EDGE])
def test_edges_of_every_keyword(field, value):
    doc = request_event()
    doc[field] = value
    agrees("request_event", orjson.dumps(doc))


@pytest.mark.parametrize("phase", ["completed", "failed", "rejected", "cancelled", "received"])
@pytest.mark.parametrize("missing", ["task_final", "duration_s", "slo_tpot_s"])
def test_terminal_phases_need_their_whole_record(phase, missing):
    doc = request_event(phase=phase)
    del doc[missing]
    assert agrees("request_event", orjson.dumps(doc)) == (phase == "received")


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
                           | st.text(max_size=20), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=5)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["request_event", "replica_sample"]), st.data())
def test_mutated_documents(schema, data):
    doc = request_event() if schema == "request_event" else replica_sample()
    for _ in range(data.draw(st.integers(1, 3))):
        field = data.draw(st.sampled_from(sorted(doc) + ["unknown"]))
        if data.draw(st.booleans()) and field in doc:
            del doc[field]
        else:
            doc[field] = data.draw(json_values)
    agrees(schema, orjson.dumps(doc))


def test_duplicate_keys_read_the_same_in_both():
    value = orjson.dumps(request_event()).replace(b"{", b'{"attempt":7,', 1)
    assert agrees("request_event", value)


def test_large_integers_in_number_fields_stay_exact():
    from pipeline.sim.specimens import replica_sample

    doc = replica_sample()
    doc["prompt_tokens_total"] = 10**18 + 1   # out of range, though a float would round it to 1e18
    assert not agrees("replica_sample", orjson.dumps(doc))
    doc["prompt_tokens_total"] = 2**53 + 1
    assert agrees("replica_sample", orjson.dumps(doc)) and FAST["replica_sample"].document(
        orjson.dumps(doc))["prompt_tokens_total"] == 2**53 + 1


def test_a_remembered_value_does_not_let_a_different_one_through_and_memory_is_bounded():
    from pipeline.fast_decode import KNOWN_GOOD_MAX

    doc = request_event()
    assert agrees("request_event", orjson.dumps(doc))          # its tenant is now remembered as matching
    for bad in ("-" + doc["tenant"], doc["tenant"] + " ", doc["tenant"] + "\n"):
        assert not agrees("request_event", orjson.dumps(doc | {"tenant": bad}))
    for i in range(KNOWN_GOOD_MAX + 100):                       # ids never repeat: the memory stops growing
        agrees("request_event", orjson.dumps(doc | {"task_id": f"task-{i}"}))
    known = [v for k, v in FAST["request_event"].namespace.items() if k.startswith("known")]
    assert known and max(len(k) for k in known) <= KNOWN_GOOD_MAX


def test_a_property_the_event_does_not_default_to_none_fails_the_builder():
    from dataclasses import dataclass

    from pipeline.fast_decode import _builder

    @dataclass
    class Wrong:
        a: int
        b: int = 0

    with pytest.raises(ValueError, match="defaults to 0"):
        _builder(Wrong, ("a", "b"), ())


def test_an_event_whose_fields_are_not_in_the_structs_order_fails_the_builder():
    """Values are passed by position: a class declaring its fields in another order would get them crossed."""
    from dataclasses import dataclass, field

    from pipeline.fast_decode import _builder

    @dataclass
    class Crossed:
        b: int
        a: int

    @dataclass
    class KeywordOnly:
        a: int
        b: int | None = field(default=None, kw_only=True)

    for cls in (Crossed, KeywordOnly):
        with pytest.raises(ValueError, match="do not start with"):
            _builder(cls, ("a", "b"), ())
