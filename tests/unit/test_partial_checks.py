"""A partial read back from Kafka (the partials topic, the changelog table) is refused whole when it holds
what stage 1 could not have written: nothing of it is merged, so nothing absurd reaches a decision."""

import copy

import orjson
import pytest

from pipeline.events import ReplicaSample, RequestEvent
from pipeline.load.partial import Partial, PartialBuilder
from pipeline.sim.specimens import replica_sample, request_event

NOW_MS = 1_700_000_000_500


def valid() -> dict:
    builder = PartialBuilder("raw/0", 15)
    builder.fold_request(RequestEvent(**request_event(event_time=NOW_MS - 1000)))
    builder.fold_sample(ReplicaSample(**replica_sample(event_time=NOW_MS - 2000, prompt_tokens_total=100)))
    builder.fold_sample(ReplicaSample(**replica_sample(event_time=NOW_MS, prompt_tokens_total=300)))
    (partial,) = builder.drain("0-2")
    return orjson.loads(partial.to_bytes())


def second(data):
    return next(iter(data["requests"].values()))


def replica(data):
    return next(iter(data["replicas"].values()))


def with_second(key):
    def change(d):
        d["requests"][key] = second(d)
    return change


ABSURD = {
    "a string count": lambda d: second(d).update(events="x"),
    "a negative count": lambda d: second(d).update(completed=-5),
    "a fractional count": lambda d: second(d).update(input_tokens=1.5),
    "a boolean count": lambda d: second(d).update(completed=True),
    "a count past 2**53": lambda d: second(d).update(output_tokens=1 << 60),
    "a second's requests not an object": lambda d: d["requests"].update({"1700000000": [1]}),
    "a sketch whose count is not its buckets": lambda d: second(d)["q_ttft"].update(n=1000),
    "a sketch bucket index that overflows": lambda d: second(d)["q_ttft"].update(b={"99999": 1}),
    "a sketch with a negative total": lambda d: second(d)["q_ttft"].update(s=-1.0),
    "a sketch alpha of 0": lambda d: second(d)["q_ttft"].update(a=0),
    "a sketch bucket count as a string": lambda d: second(d)["q_ttft"].update(b={"-60": "1"}),
    "a KV usage of 7": lambda d: replica(d)["latest"].update(kv_cache_usage=7),
    "no GPUs": lambda d: replica(d)["latest"].update(gpu_count=0),
    "a healthy flag as a string": lambda d: replica(d)["latest"].update(healthy="yes"),
    "a negative queue": lambda d: replica(d)["latest"].update(requests_waiting=-1),
    "an unknown field in a sample": lambda d: replica(d)["latest"].update(owner="x"),
    "a negative counter delta": lambda d: next(iter(replica(d)["seconds"].values())).update(prompt_tokens=-200),
    "a counter delta as a string": lambda d: next(iter(replica(d)["seconds"].values())).update(prompt_tokens="2"),
    "a request second after newest_ms": with_second(str(NOW_MS // 1000 + 3600)),
    "a replica second after newest_ms": lambda d: replica(d)["seconds"].update({str(NOW_MS // 1000 + 1): {}}),
}


def test_a_partial_stage_1_writes_parses_back_the_same():
    data = valid()
    assert replica(data)["seconds"], "the specimen holds a counter delta"
    assert orjson.loads(Partial.from_dict(copy.deepcopy(data)).to_bytes()) == data


@pytest.mark.parametrize("case", sorted(ABSURD))
def test_a_partial_holding_what_stage_1_cannot_write_is_refused_whole(case):
    data = valid()
    ABSURD[case](data)
    with pytest.raises((ValueError, TypeError)):
        Partial.from_bytes(orjson.dumps(data))
