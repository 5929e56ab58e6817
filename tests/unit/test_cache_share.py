"""The share lever's reading in the picture: prefix-cache hit rates from the replicas' counters and the
cached-input share from the requests, bounded whatever the counters say."""

from pipeline.events import ReplicaSample
from pipeline.load.cache_share import MAX_REPLICA_RATES
from pipeline.load.picture import read_picture
from pipeline.sim.specimens import replica_sample
from tests.reference import reference
from tests.unit.test_picture import req, snapshot_of

import orjson


def counting(replica: str, second: int, hits: float, queries: float) -> ReplicaSample:
    """A sample whose prefix-cache counters have grown by ``hits``/``queries`` per second since second 90."""
    n = second - 90
    return ReplicaSample(**replica_sample(
        replica_id=replica, pool="p", event_time=second * 1000, requests_waiting=0, kv_cache_usage=0.3,
        gpu_count=4, preemptions_total=0, prompt_tokens_total=100 * n, generation_tokens_total=50 * n,
        prefix_cache_hits_total=hits * n, prefix_cache_queries_total=queries * n))


def picture_of(per_replica: dict[str, tuple[float, float]], requests=()) -> dict:
    return snapshot_of([counting(replica, second, hits, queries) for second in range(90, 111)
                        for replica, (hits, queries) in per_replica.items()], requests)


def test_hit_rates_come_from_the_counters_and_the_share_from_the_requests():
    finished = [req(105, "completed", final=True, input_tokens=1000, cached_input_tokens=600, output_tokens=10),
                req(106, "completed", final=True, input_tokens=1000, cached_input_tokens=0, output_tokens=10)]
    cache = picture_of({"warm": (80, 100), "cold": (10, 100), "idle": (0, 0)}, finished)["cache"]
    assert cache["prefix_hit_rate"] == 0.45                           # (80 + 10) / (100 + 100)
    assert cache["cached_input_share"] == 0.3                         # 600 / 2000
    assert cache["replica_hit_rates"] == [{"replica_id": "cold", "hit_rate": 0.1},
                                          {"replica_id": "warm", "hit_rate": 0.8}]   # lowest first; idle: none


def test_nothing_looked_up_or_billed_is_unknown_not_zero():
    cache = picture_of({"r1": (0, 0)})["cache"]
    assert cache == {"prefix_hit_rate": None, "cached_input_share": None, "replica_hit_rates": []}


def test_a_replica_claiming_more_hits_than_lookups_counts_as_hitting_every_one():
    cache = picture_of({"liar": (10**8, 100), "honest": (50, 100)})["cache"]   # (more would be a counter jump)
    assert cache["prefix_hit_rate"] == 0.75 and max(r["hit_rate"] for r in cache["replica_hit_rates"]) == 1.0


def test_the_list_is_bounded_and_the_picture_stays_valid_and_readable():
    fleet = {f"r{i:03d}": (i % 100, 100) for i in range(3 * MAX_REPLICA_RATES)}
    picture = picture_of(fleet)
    rates = picture["cache"]["replica_hit_rates"]
    assert len(rates) == MAX_REPLICA_RATES and rates == sorted(rates, key=lambda r: (r["hit_rate"], r["replica_id"]))
    assert not list(reference("load_picture").iter_errors(picture))
    assert read_picture(orjson.dumps(picture | {"published_at_ms": 1}))["cache"] == picture["cache"]


def test_a_picture_from_an_older_worker_without_the_block_is_still_valid():
    picture = picture_of({"r1": (1, 2)})
    del picture["cache"]
    assert not list(reference("load_picture").iter_errors(picture | {"published_at_ms": 1}))
