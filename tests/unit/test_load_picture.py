"""The load picture as a typed value, its schema, and reading it back from sluice.load.v1.

``read_picture`` runs on every record of a topic any worker can write to, so
the hostile cases matter as much as the valid ones: whatever it accepts, the
admission policy and ``sluice pools`` must be able to read without crashing.
"""

import json
import math
import tracemalloc
from dataclasses import replace
from typing import Any, Iterator

import orjson
import pytest

from pipeline.admission.policy import AdmissionConfig, Decision, decide
from pipeline.contract import SCHEMA_DIR, compile_schema
from pipeline.load.axes import AXIS_FUNCTIONS, Axis
from pipeline.load.aggregates import ReplicaAgg, ReplicaLatest
from pipeline.load.partial import Partial, PartialBuilder
from pipeline.load.picture import AXES, MAX_PICTURE_BYTES, MAX_REPLICAS, LoadPicture, PoolState, read_picture
from pipeline.pools_view import format_table
from tests.reference import reference
from tests.unit.test_picture import CONFIG, PROFILE, req, sample, scenario_partials

SCHEMA = json.loads((SCHEMA_DIR / "load_picture.v1.json").read_text())
NOW_MS = 200_000


def busy_state(pool: str = "p") -> PoolState:
    state = PoolState(pool)
    for partial in scenario_partials():
        state.merge(partial, CONFIG)
    return state


def calm_state(pool: str) -> PoolState:
    """A sibling with one fresh replica and nothing to do: a redirect target."""
    builder = PartialBuilder("raw/9", 15)
    for second in range(100, 111):
        builder.fold_sample(sample("s1", second, 0, 0.1, 0))
    builder.fold_request(req(101, "completed", final=True))
    state = PoolState(pool)
    for partial in builder.drain(1):
        state.merge(partial, CONFIG)
    return state


BUSY = busy_state().snapshot(CONFIG)   # queue-bound: the policy sheds, and looks for a redirect
CALM = calm_state("q").snapshot(CONFIG)


@pytest.fixture
def busy() -> dict:
    return BUSY


@pytest.fixture
def calm() -> dict:
    return CALM


# -- the typed value ---------------------------------------------------------------------------------

def test_each_axis_has_one_function_and_the_picture_uses_them_in_order():
    state = busy_state()
    readings, picture = state.readings(CONFIG), state.picture(CONFIG)
    assert tuple(AXIS_FUNCTIONS) == AXES
    assert len(set(AXIS_FUNCTIONS.values())) == len(AXES)
    assert tuple(picture.axes) == AXES
    for name, axis in AXIS_FUNCTIONS.items():
        assert axis(readings) == picture.axes[name]


def test_the_schema_lists_the_registry_axes_in_order():
    axes = SCHEMA["properties"]["axes"]
    assert list(axes["properties"]) == list(axes["required"]) == list(AXES)
    assert SCHEMA["properties"]["binding_axis"]["enum"] == list(AXES)


def test_snapshot_is_the_typed_picture_on_the_wire():
    state = busy_state()
    picture = state.picture(CONFIG)
    assert isinstance(picture, LoadPicture) and all(isinstance(a, Axis) for a in picture.axes.values())
    snapshot = state.snapshot(CONFIG)
    assert snapshot == picture.to_dict()
    assert snapshot["pressure"] == picture.pressure and snapshot["binding_axis"] == picture.binding_axis == "errors"
    assert snapshot["replicas"]["stale_ids"] == list(picture.replicas.stale) == ["r3"]


def test_the_typed_value_keeps_an_unbounded_cost_that_the_wire_reports_as_null():
    builder = PartialBuilder("raw/0", 15)
    for second in range(100, 112):
        builder.fold_sample(sample("r1", second, 0, 0.1, 0))
    builder.fold_request(req(110, "received"))
    builder.fold_request(req(110, "failed", final=True, ttft_s=None, tpot_s=None))
    state = PoolState("p")
    for partial in builder.drain(1):
        state.merge(partial, CONFIG)
    cost = state.picture(CONFIG).axes["cost"]
    assert cost.value == math.inf and cost.pressure == 10.0
    assert cost.to_dict()["value"] is None


# -- replicas are bounded ----------------------------------------------------------------------------

def invented_replicas(n: int, start: int, event_ms: int) -> Partial:
    """A partial sampling ``n`` replica ids never seen before, once each."""
    latest = ReplicaLatest(event_ms, "H100-80GB", 4, 1, 0, 0.5, True)
    return Partial(id=f"raw/0/{start}", pool="p", newest_ms=event_ms,
                   replicas={f"invented-{start + i}": ReplicaAgg(replace(latest)) for i in range(n)})


def replicas_at(tick: int, second: int, *ids: str) -> Partial:
    builder = PartialBuilder(f"raw/{tick}", 15)
    for replica_id in ids:
        builder.fold_sample(sample(replica_id, second, 0, 0.5, 0))
    (partial,) = builder.drain(tick)
    return partial


def test_100k_invented_replica_ids_leave_a_pools_state_and_picture_bounded():
    state = busy_state()  # r1, r2 fresh and r3 quiet at 110 s
    tracemalloc.start()
    settled = tracemalloc.get_traced_memory()[0]
    for start in range(0, 100_000, 1000):
        state.merge(invented_replicas(1000, start, 110_000), CONFIG)
    grown = tracemalloc.get_traced_memory()[0] - settled
    tracemalloc.stop()
    assert len(state.replicas) == MAX_REPLICAS and {"r1", "r2", "r3"} <= state.replicas.keys()
    assert grown < 2 << 20, f"{grown / 2**20:.1f} MiB for invented replicas"
    picture = state.picture(CONFIG)
    assert picture.replicas_refused == state.replicas_refused == 100_000 - (MAX_REPLICAS - 3)
    assert picture.to_dict()["replicas"]["total"] == MAX_REPLICAS
    assert len(orjson.dumps(picture.to_dict())) < MAX_PICTURE_BYTES


def test_a_gone_replica_makes_room_for_a_new_one_but_a_live_or_quiet_one_never_does():
    config = replace(CONFIG, max_replicas=3, cost_window_s=300)  # the cost window alone would keep all
    state = PoolState("p")
    state.merge(replicas_at(1, 100, "old", "a"), config)
    state.merge(replicas_at(2, 125, "a", "b"), config)   # old silent 25 s: stale but quiet (may still serve)
    state.merge(replicas_at(3, 125, "c"), config)
    assert set(state.replicas) == {"old", "a", "b"} and state.replicas_refused == 1
    state.merge(replicas_at(4, 131, "a", "b", "d"), config)  # old silent 31 s: gone, d takes its place
    assert set(state.replicas) == {"a", "b", "d"} and state.replicas_refused == 1
    picture = state.picture(config)
    assert picture.replicas.fresh == ("a", "b", "d") and picture.replicas.stale == ()
    assert picture.axes["demand"].limit == PROFILE.capacity_rps_per_replica * 3


def test_a_quiet_replica_is_not_forgotten_before_it_is_gone_even_past_the_cost_window():
    """A cost window shorter than twice ``stale_after_s`` once dropped a replica while its cache still
    counted as full; now each replica goes only once it is gone."""
    state = PoolState("p")
    state.merge(replicas_at(1, 100, "quiet", "live"), CONFIG)  # cost window 20 s + lateness 5 s; stale 15 s
    state.merge(replicas_at(2, 127, "live"), CONFIG)
    assert state.picture(CONFIG).replicas.quiet == ("quiet",)
    state.merge(replicas_at(3, 131, "live"), CONFIG)
    assert set(state.replicas) == {"live"}


def test_churning_replica_ids_are_forgotten_a_bounded_time_after_their_last_sample():
    state = PoolState("p")
    for second in range(100, 1100):
        state.merge(replicas_at(second, second, f"replica-{second}"), CONFIG)
        assert len(state.replicas) <= 32, "silent for 31 s at most: twice stale_after_s, past the cost window"
    assert state.replicas_refused == 0


# -- the schema --------------------------------------------------------------------------------------

def test_schema_is_valid_2020_12_and_within_the_contract_subset(busy, calm):
    """Within the subset ``pipeline.contract`` compiles, so it could be enforced like the event schemas."""
    compiled = compile_schema(SCHEMA, "load_picture")
    for picture in (busy, calm, PoolState("empty").snapshot(CONFIG)):
        published = dict(picture, published_at_ms=1_700_000_000_000)
        for document in (picture, published):
            reference("load_picture").validate(document)
            compiled(document)


@pytest.mark.parametrize("change", [
    {"published_at_ms": -1}, {"extra": 1}, {"pressure": 11}, {"binding_axis": "staleness"},
    {"models": ["m"] * 17}, {"pool": "bad pool"},
])
def test_schema_rejects_what_stage_2_never_publishes(busy, change):
    assert not reference("load_picture").is_valid({**busy, **change})


# -- reading it back ---------------------------------------------------------------------------------

def test_read_picture_accepts_what_stage_2_publishes(busy, calm):
    for picture in (busy, calm, PoolState("empty").snapshot(CONFIG)):
        published = dict(picture, published_at_ms=1_700_000_000_000)
        assert read_picture(orjson.dumps(published)) == published
        assert read_picture(bytearray(orjson.dumps(picture))) == picture


def without(document: dict, *path: str) -> dict:
    document = json.loads(json.dumps(document))
    node = document
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return document


def with_(document: dict, value: Any, *path: str) -> dict:
    document = json.loads(json.dumps(document))
    node = document
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return document


RAW_CORPUS = [
    b"", b"   ", b"not json", b"{", b'{"pool": "p"', b"\xff\xfe\x00", b"NaN", b"Infinity", b"-Infinity", b"1e400",
    b'{"pool": NaN}', b"[]", b"[1, 2]", b"null", b"42", b'"a string"', b"true", b"{}",
    b"[" * 100_000, b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
    b"{" + b" " * MAX_PICTURE_BYTES + b"}",
]


def document_corpus(busy: dict) -> Iterator[tuple[str, dict]]:
    """Pictures broken in one place each: (what is wrong, the document)."""
    for field in ("pool", "axes", "models", "watermark_ms", "pressure", "replicas", "rates", "profile"):
        yield f"no {field}", without(busy, field)
    yield "no queue axis", without(busy, "axes", "queue")
    yield "no demand detail", without(busy, "axes", "demand", "detail")
    yield "no input tokens", without(busy, "axes", "demand", "detail", "input_tokens_per_s")
    yield "no axis value", without(busy, "axes", "latency", "value")
    yield "no arrival rate", without(busy, "rates", "arrival_rps")
    yield "no fresh count", without(busy, "replicas", "fresh")
    for value in (None, 1, "", "bad pool", "p" * 65, "p\n", ["p"], {"p": 1}):
        yield f"pool {value!r}", with_(busy, value, "pool")
    for value in ("110000", 110.5, True, None, -1, 2 ** 64 - 1, [110000]):
        yield f"watermark {value!r}", with_(busy, value, "watermark_ms")
    for value in ("m", [1], [None], [["m"]], ["m"] * 17, ["m" * 129], {"m": 1}):
        yield f"models {value!r}", with_(busy, value, "models")
    for value in ([], None, "axes", {**busy["axes"], "staleness": busy["axes"]["demand"]}):
        yield f"axes {str(value)[:20]}", with_(busy, value, "axes")
    for axis in AXES:
        for value in ("0.3", None, True, -0.1, 11, 1e300, [0.3], {"v": 0.3}):
            yield f"{axis} pressure {value!r}", with_(busy, value, "axes", axis, "pressure")
        for value in ("1.0", True, -1, [1], {"v": 1}):
            yield f"{axis} value {value!r}", with_(busy, value, "axes", axis, "value")
        for value in (None, "20", -1, False):
            yield f"{axis} limit {value!r}", with_(busy, value, "axes", axis, "limit")
        for value in (None, [], "detail", 1):
            yield f"{axis} detail {value!r}", with_(busy, value, "axes", axis, "detail")
        yield f"{axis} not an object", with_(busy, [1, 2], "axes", axis)
        yield f"{axis} nested detail", with_(busy, [[[[[[[[1]]]]]]]], "axes", axis, "detail", "x")
    for value in (5, "x", [1], {"critical": "1"}, {"critical": None}, {"critical": -1}):
        yield f"first attempts {value!r}", with_(busy, value, "axes", "demand", "detail", "first_attempts_rps")
    for value in ({"x": 1}, [1], "1"):
        yield f"input tokens {value!r}", with_(busy, value, "axes", "demand", "detail", "input_tokens_per_s")
    for key in ("total", "fresh", "stale", "unhealthy"):
        for value in ("2", 2.5, True, None, -1):
            yield f"replicas.{key} {value!r}", with_(busy, value, "replicas", key)
    for value in (None, "6", True, -1, [6]):
        yield f"arrival {value!r}", with_(busy, value, "rates", "arrival_rps")
    yield "a null rate", with_(busy, None, "rates", "goodput_tasks_per_s")
    yield "binding axis unknown", with_(busy, "staleness", "binding_axis")
    yield "binding axis a list", with_(busy, ["errors"], "binding_axis")


DOCUMENT_CORPUS = dict(document_corpus(BUSY))
DEEP_IN_A_FIELD = orjson.dumps(BUSY).replace(b'"pool":"p"', b'"pool":' + b"[" * 1000 + b"]" * 1000, 1)


@pytest.mark.parametrize("raw", RAW_CORPUS, ids=lambda r: repr(r[:24]))
def test_read_picture_rejects_hostile_bytes_with_a_value_error(raw):
    with pytest.raises(ValueError):
        read_picture(raw)


@pytest.mark.parametrize("value", [None, "{}", 12, memoryview(b"{}")], ids=repr)
def test_read_picture_rejects_what_is_not_bytes(value):
    with pytest.raises(ValueError, match="bytes"):
        read_picture(value)


@pytest.mark.parametrize("name", DOCUMENT_CORPUS)
def test_read_picture_rejects_every_broken_picture_with_a_value_error(name):
    with pytest.raises(ValueError):
        read_picture(orjson.dumps(DOCUMENT_CORPUS[name]))


def test_deep_nesting_in_a_field_is_named_not_printed():
    assert b"\"pool\":" + b"[" * 1000 in DEEP_IN_A_FIELD  # parses (under orjson's depth limit), then fails
    with pytest.raises(ValueError, match="pool must be a string, got array"):
        read_picture(DEEP_IN_A_FIELD)


@pytest.mark.parametrize("raw,message", [
    (b"[1]", "must be a JSON object, got array"),
    (b"null", "must be a JSON object, got null"),
    (b"{,}", "not JSON"),
    (b'{"pool": 3}', "pool must be a string, got integer"),
])
def test_read_picture_says_what_is_wrong(raw, message):
    with pytest.raises(ValueError, match=message):
        read_picture(raw)


def test_read_picture_names_the_field(busy):
    with pytest.raises(ValueError, match=r"axes\.queue\.pressure must be a number, got string"):
        read_picture(orjson.dumps(with_(busy, "1.2", "axes", "queue", "pressure")))
    with pytest.raises(ValueError, match="missing queue"):
        read_picture(orjson.dumps(without(busy, "axes", "queue")))


# -- whatever read_picture accepts, its readers survive -----------------------------------------------

HOSTILE_VALUES = [None, True, False, 0, -1, 2.5, 1e308, 2 ** 64 - 1, "", "x", [], [1], {}, {"a": {}}]


def leaf_paths(node: Any, path: tuple = ()) -> Iterator[tuple]:
    yield path
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaf_paths(value, path + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from leaf_paths(value, path + (i,))


def mutations(document: dict) -> Iterator[dict]:
    """The document with each node in turn replaced by each hostile value, or removed."""
    for path in list(leaf_paths(document))[1:]:
        for value in HOSTILE_VALUES:
            yield with_(document, value, *path)
        yield without(document, *path)


def survives(own: dict, sibling: dict) -> None:
    cfg = AdmissionConfig()
    decision = decide(own, Decision(own["pool"]), cfg, NOW_MS, [sibling])
    for entry in decision.signal["redirect"]:
        assert isinstance(entry["pool"], str) and 0 < entry["weight"] <= 1
        assert 0 <= entry["cold_prefill_cost_s"] <= 3600
    format_table({own["pool"]: own, sibling["pool"]: sibling}, use_colour=False)


def test_the_fixtures_exercise_the_redirect_path(busy, calm):
    cfg = AdmissionConfig()
    decision = decide(busy, Decision("p"), cfg, NOW_MS, [calm])
    assert [r["pool"] for r in decision.signal["redirect"]] == ["q"]


def test_whatever_read_picture_accepts_the_policy_and_pools_view_can_read(busy, calm):
    accepted = 0
    for own, sibling, hostile in [(busy, calm, "sibling"), (busy, calm, "own")]:
        target = sibling if hostile == "sibling" else own
        for document in mutations(target):
            try:
                picture = read_picture(orjson.dumps(document))
            except ValueError:
                continue
            accepted += 1
            if hostile == "sibling":
                survives(own, picture)
            else:
                survives(picture, sibling)
    assert accepted > 100  # the mutations that stay valid (e.g. a number for a number) are still read
